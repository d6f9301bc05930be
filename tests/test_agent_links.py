"""A pushed file whose directory reaches provision's own directories through a symbolic link
on the host is refused by the agent before anything is written (a finding:
validation sees only the destination as written)."""

from __future__ import annotations

import os

import pytest

from provision.host import agent, protocol


@pytest.fixture
def tree(tmp_path):
    reserved = tmp_path / "etc-provision"
    (reserved / "job").mkdir(parents=True)
    (tmp_path / "opt").mkdir()
    os.symlink(reserved / "job", tmp_path / "opt" / "link")  # /opt/link -> /etc/provision/job
    os.symlink(tmp_path / "opt", tmp_path / "opt-alias")  # a link that stays outside
    (tmp_path / "opt" / "real").mkdir()
    return tmp_path, (str(reserved),)


@pytest.mark.parametrize(
    "dest, refused",
    [
        ("opt/link/chief-0.env", True),  # through the link into the reserved directory
        ("opt/link/sub/x", True),  # deeper (not there yet: realpath still follows the link)
        ("opt/real/x", False),
        ("opt-alias/real/x", False),  # a link, but not into a reserved directory
        ("etc-provision/job/chief-0.env", False),  # provision's own files, written as they are
        ("opt/missing/x", False),
    ],
)
def test_a_file_through_a_link_into_a_reserved_directory(tree, dest, refused):
    root, reserved = tree
    got = agent.through_link(str(root / dest), reserved)
    assert (got == reserved[0]) is refused, got


def test_the_write_is_refused_whole_and_names_the_path(tree, monkeypatch):
    root, reserved = tree
    original = agent.through_link
    monkeypatch.setattr(agent, "through_link", lambda path: original(path, reserved))
    bad, good = str(root / "opt/link/chief-0.env"), str(root / "opt/real/x")
    files = [protocol.FileWrite(good, 0o644, "aGk="), protocol.FileWrite(bad, 0o644, "aGk=")]
    rep = agent.op_write(protocol.WriteRequest(job="links-test", files=files))
    assert rep.written == 0 and rep.errors == [
        f"{bad}: its directory leads into {reserved[0]} through a symbolic link on this host; refused "
        "(push it to a path that is not a link, or remove the link)"
    ]
    assert not os.path.exists(good) and not os.path.exists(bad), "nothing is written"
