"""host/trust.py: which of provision's directories a host may trust (OpenSSH's StrictModes
rule, every component from /), and host/taskenv.py: the env file read as data (issue 28,
items 1-5)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from provision.core.encode import env_assignment
from provision.host import taskenv, trust

_spec = importlib.util.spec_from_file_location("_provision_test_encode", Path(__file__).with_name("test_encode.py"))
_ports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ports)  # type: ignore[union-attr]
HOSTILE, parse_env_file = _ports.HOSTILE, _ports.parse_env_file

USER = 4242  # a uid that is not root's (the tests run as root: chown works)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def test_a_tree_only_root_can_write_passes(tmp_path):
    d = tmp_path / "etc" / "provision" / "job"
    d.mkdir(parents=True)
    assert trust.problem(str(d)) is None
    assert trust.problem(str(d / "not" / "there")) is None  # made later, by the agent


@pytest.mark.parametrize("where", ["etc", "etc/provision", "etc/provision/job"])
def test_a_component_another_user_owns_is_refused(tmp_path, where):
    d = tmp_path / "etc" / "provision" / "job"
    d.mkdir(parents=True)
    os.chown(tmp_path / where, USER, USER)
    why = trust.problem(str(d))
    assert (
        why == f"{tmp_path / where} is owned by uid {USER} (mode 0755): provision uses only directories owned by root"
    )


def test_group_or_other_write_is_refused_unless_sticky(tmp_path):
    d = tmp_path / "var" / ".ledger"
    d.mkdir(parents=True)
    d.chmod(0o777)
    assert trust.problem(str(d)) == (
        f"{d} is writable by group or others (mode 0777): provision uses only directories only root may write"
    )
    d.chmod(0o1777)  # as /tmp: others cannot rename or remove what they do not own
    assert trust.problem(str(d)) is None


def test_a_link_counts_where_it_leads_and_by_whom_it_was_made(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "home").mkdir()
    os.chown(tmp_path / "home", USER, USER)
    link = tmp_path / "cache"
    link.symlink_to(tmp_path / "home")
    assert "is owned by uid" in (trust.problem(str(link / "agent")) or "")  # leads to a user's directory
    link.unlink()
    link.symlink_to(real)
    assert trust.problem(str(link / "agent")) is None  # root's link to root's directory
    os.lchown(link, USER, USER)
    assert f"{link} is owned by uid {USER}" in (trust.problem(str(link / "agent")) or "")


def test_a_file_inside_is_never_opened_through_a_link(tmp_path):
    (tmp_path / "a.env").write_text('A="1"\n')
    (tmp_path / "b.env").symlink_to(tmp_path / "a.env")
    assert taskenv.open_file(str(tmp_path / "a.env")) == b'A="1"\n'
    with pytest.raises(OSError):
        taskenv.open_file(str(tmp_path / "b.env"))


def test_env_files_read_as_systemd_reads_them():
    entries = [(f"K{i}", v) for i, v in enumerate(HOSTILE) if "\x00" not in v]
    text = "# made by provision\n" + "\n".join(env_assignment(k, v) for k, v in entries) + "\n"
    assert taskenv.parse_env(text) == entries == parse_env_file(text)


@pytest.mark.parametrize("bad", ["rm -rf /\n", 'A="unterminated\n', "A=1\n", '1A="x"\n', 'A B="x"\n'])
def test_anything_but_provisions_own_lines_is_refused(bad):
    with pytest.raises(ValueError):
        taskenv.parse_env(bad)
