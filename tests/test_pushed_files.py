"""`files:` entries: the walk of a pushed directory (links, loops, modes) and the
normalisation of destinations, as validate and render both see them."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from provision.core.errors import ProvisionError, ValidationError
from provision.core.model import FileSpec
from provision.inventory.inventory import parse
from provision.inventory.pushed import PushedFile, normalize_dest, pushed_mode, walk_spec
from provision.render.files import pushed_files, render

BASE = """\
job: ptest
hosts:
  - {name: cpu-1, address: 192.0.2.21}
pools:
  chief: {replicas: 1, command: [/opt/venv/bin/python, /opt/job/train.py]}
"""


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """A walk that loops must fail the test, not hang it."""

    def fail(signum: int, frame: object) -> None:
        raise TimeoutError("the walk did not end")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def inv(tmp_path: Path, files: str) -> str:
    text = BASE + "files:\n" + files
    (tmp_path / "inventory.yaml").write_text(text)
    return text


def problems(tmp_path: Path, files: str) -> list[str]:
    text = inv(tmp_path, files)
    with pytest.raises(ValidationError) as e:
        parse(text, tmp_path / "inventory.yaml", display="inventory.yaml")
    return e.value.problems


def specs(tmp_path: Path, files: str) -> tuple[FileSpec, ...]:
    return parse(inv(tmp_path, files), tmp_path / "inventory.yaml").files


def tree(root: Path, files: dict[str, tuple[str, int]]) -> Path:
    for rel, (content, mode) in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        os.chmod(p, mode)
    return root


def by_dest(entries: list[PushedFile]) -> dict[str, PushedFile]:
    return {e.dest: e for e in entries}


# --------------------------------------------------------------------------- links


def test_link_out_of_the_tree_refused_naming_the_link(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    shadow = tree(tmp_path / "etc", {"shadow": ("root:secret\n", 0o600)}) / "shadow"
    os.symlink(shadow, job / "x")  # absolute
    os.symlink("../etc/shadow", job / "y")  # relative
    entries, found = walk_spec(job, "/opt/job", True)
    assert [e.dest for e in entries] == ["/opt/job/train.py"]  # the links are not pushed
    assert [p.message for p in found] == [
        f"{job}/x is a symbolic link to {shadow}, outside the pushed directory {job}",
        f"{job}/y is a symbolic link to {shadow}, outside the pushed directory {job}",
    ]
    assert [p.path for p in found] == [job / "x", job / "y"]
    assert problems(tmp_path, "  - {src: job/, dest: /opt/job/}\n") == [
        f"inventory.yaml:7: files[0].src: {job}/x is a symbolic link to {shadow}, outside the pushed directory {job}",
        f"inventory.yaml:7: files[0].src: {job}/y is a symbolic link to {shadow}, outside the pushed directory {job}",
    ]


def test_link_to_a_file_inside_is_pushed_as_that_file(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"data/model.bin": ("weights\n", 0o600), "run.sh": ("#!/bin/sh\n", 0o755)})
    os.symlink("data/model.bin", job / "latest.bin")
    os.symlink(job / "run.sh", job / "start")  # absolute, but inside
    entries, found = walk_spec(job, "/opt/job", True)
    assert found == []
    got = by_dest(entries)
    assert sorted(got) == ["/opt/job/data/model.bin", "/opt/job/latest.bin", "/opt/job/run.sh", "/opt/job/start"]
    assert got["/opt/job/latest.bin"].src.read_text() == "weights\n"
    assert got["/opt/job/latest.bin"].mode == 0o600  # the target's mode, not the link's 0777
    assert got["/opt/job/start"].mode == 0o755
    rendered = {f.path: f for f in pushed_files(specs(tmp_path, "  - {src: job/, dest: /opt/job/}\n"))}
    assert rendered["/opt/job/latest.bin"].data() == b"weights\n"
    assert rendered["/opt/job/latest.bin"].mode == 0o600


def test_link_to_a_directory_inside_is_walked(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"lib/python3/m.py": ("m\n", 0o644), "lib/python3/__pycache__/m.pyc": ("", 0o644)})
    os.symlink("lib", job / "lib64")
    os.symlink("lib/python3", job / "py")
    entries, found = walk_spec(job, "/opt/job", True)
    assert found == []
    assert [e.dest for e in entries] == [
        "/opt/job/lib/python3/m.py",
        "/opt/job/lib64/python3/m.py",
        "/opt/job/py/m.py",
    ]
    assert all(e.src == (job / "lib/python3/m.py").resolve() for e in entries)


def test_link_to_an_ancestor_directory_is_a_loop(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"a/x.py": ("x\n", 0o644), "b/y.py": ("y\n", 0o644)})
    os.symlink(".", job / "self")
    os.symlink("..", job / "a" / "up")  # the root of the tree: an ancestor of a/
    entries, found = walk_spec(job, "/opt/job", True)
    assert sorted(p.message for p in found) == [
        f"{job}/a/up is a symbolic link to {job}, a directory that contains it (a loop)",
        f"{job}/self is a symbolic link to {job}, a directory that contains it (a loop)",
    ]
    assert [e.dest for e in entries] == ["/opt/job/a/x.py", "/opt/job/b/y.py"]


def test_links_between_sibling_directories_end(tmp_path: Path) -> None:
    """a/to_b -> ../b and b/to_a -> ../a: each is walked once through the other, and the
    way back into a directory already on the path is refused as a loop."""
    job = tree(tmp_path / "job", {"a/x": ("x\n", 0o644), "b/y": ("y\n", 0o644)})
    os.symlink("../b", job / "a" / "to_b")
    os.symlink("../a", job / "b" / "to_a")
    entries, found = walk_spec(job, "/opt/job", True)
    assert [p.message for p in found] == [
        f"{job}/a/to_b/to_a is a symbolic link to {job}/a, a directory that contains it (a loop)",
        f"{job}/b/to_a/to_b is a symbolic link to {job}/b, a directory that contains it (a loop)",
    ]
    assert [e.dest for e in entries] == ["/opt/job/a/to_b/y", "/opt/job/a/x", "/opt/job/b/to_a/x", "/opt/job/b/y"]


def test_dangling_link_refused_at_validate(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    os.symlink("gone.bin", job / "model.bin")
    assert problems(tmp_path, "  - {src: job/, dest: /opt/job/}\n") == [
        f"inventory.yaml:7: files[0].src: {job}/model.bin is a symbolic link to gone.bin, which does not exist",
    ]


def test_link_cycle_refused(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    os.symlink("b", job / "a")
    os.symlink("a", job / "b")
    _, found = walk_spec(job, "/opt/job", True)
    assert [p.message for p in found] == [
        f"{job}/a is a symbolic link that loops (b, too many levels of links)",
        f"{job}/b is a symbolic link that loops (a, too many levels of links)",
    ]


def test_skipped_names_are_not_followed(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    os.symlink("/etc", job / ".git")
    os.symlink("/nonexistent", job / "__pycache__")
    os.symlink("/etc/hostname", job / "old.pyc")
    entries, found = walk_spec(job, "/opt/job", True)
    assert found == [] and [e.dest for e in entries] == ["/opt/job/train.py"]


def test_fifo_refused(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    os.mkfifo(job / "pipe")
    _, found = walk_spec(job, "/opt/job", True)
    assert [p.message for p in found] == [f"{job}/pipe is a FIFO, not a regular file or directory"]


def test_src_itself_may_link_anywhere(tmp_path: Path) -> None:
    """Only links found inside a pushed directory are held to the tree; the src is the
    user's own choice of file or directory."""
    elsewhere = tree(tmp_path / "elsewhere", {"key": ("k\n", 0o600), "dir/a.py": ("a\n", 0o644)})
    (tmp_path / "inv").mkdir()
    os.symlink(elsewhere / "key", tmp_path / "inv" / "key")
    os.symlink(elsewhere / "dir", tmp_path / "inv" / "code")
    (tmp_path / "inv" / "train.py").write_text("x\n")
    got = specs(tmp_path / "inv", "  - {src: key, dest: /etc/job/key}\n  - {src: code/, dest: /opt/code/}\n")
    assert [(s.src, s.dest, s.is_dir) for s in got] == [
        (elsewhere / "key", "/etc/job/key", False),
        (elsewhere / "dir", "/opt/code", True),
    ]
    assert {f.path: f.mode for f in pushed_files(got)} == {"/etc/job/key": 0o600, "/opt/code/a.py": 0o644}


def test_too_many_problems_are_counted(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    for i in range(13):
        os.symlink(f"gone-{i:02d}", job / f"l{i:02d}")
    got = problems(tmp_path, "  - {src: job/, dest: /opt/job/}\n")
    assert len(got) == 11
    assert got[-1] == f"inventory.yaml:7: files[0].src: 3 more problems like these in {job}"


def test_render_refuses_a_tree_changed_after_validation(tmp_path: Path) -> None:
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    got = specs(tmp_path, "  - {src: job/, dest: /opt/job/}\n")
    os.symlink("/etc/passwd", job / "passwd")
    with pytest.raises(ProvisionError, match=r"files: .*/job/passwd is a symbolic link to /etc/passwd, outside"):
        pushed_files(got)


# --------------------------------------------------------------------------- modes


@pytest.mark.parametrize(
    ("source", "pushed"),
    [
        (0o600, 0o600),
        (0o755, 0o755),
        (0o644, 0o644),
        (0o700, 0o700),
        (0o400, 0o400),
        (0o664, 0o644),  # group-writable: never group-writable on the host
        (0o666, 0o644),
        (0o777, 0o755),
        (0o4755, 0o755),  # set-uid dropped
        (0o2750, 0o750),  # set-gid dropped
    ],
)
def test_mode_kept_never_widened(tmp_path: Path, source: int, pushed: int) -> None:
    assert pushed_mode(0o100000 | source) == pushed
    job = tree(tmp_path / "job", {"f": ("x\n", 0o644)})
    os.chmod(job / "f", source)
    (tmp_path / "train.py").write_text("x\n")
    os.chmod(tmp_path / "train.py", source)
    rendered = {
        f.path: f.mode
        for f in pushed_files(
            specs(tmp_path, "  - {src: job/, dest: /opt/job/}\n  - {src: train.py, dest: /opt/t.py}\n")
        )
    }
    assert rendered == {"/opt/job/f": pushed, "/opt/t.py": pushed}


def test_modes_reach_the_rendered_bundle(tmp_path: Path) -> None:
    tree(
        tmp_path / "job", {"secret.key": ("k\n", 0o600), "run.sh": ("#!/bin/sh\n", 0o755), "shared.cfg": ("c\n", 0o664)}
    )
    r = render(parse(inv(tmp_path, "  - {src: job/, dest: /opt/job/}\n"), tmp_path / "inventory.yaml"))
    got = {f.path: f.mode for f in r.hosts["cpu-1"].files if f.kind == "file"}
    assert got == {"/opt/job/secret.key": 0o600, "/opt/job/run.sh": 0o755, "/opt/job/shared.cfg": 0o644}
    assert r.hosts["cpu-1"].manifest["files"]["/opt/job/secret.key"]["mode"] == 0o600


# --------------------------------------------------------------------------- destinations


@pytest.mark.parametrize(
    ("dest", "norm"),
    [
        ("//etc/provision/j/x.env", "/etc/provision/j/x.env"),
        ("/etc/./provision/x", "/etc/provision/x"),
        ("/opt/../etc/provision/x", "/etc/provision/x"),
        ("/etc/systemd/system//x.service", "/etc/systemd/system/x.service"),
        ("/etc/systemd/system/", "/etc/systemd/system/train.py"),  # a file into that directory
        ("/etc/provision", "/etc/provision"),
    ],
)
def test_reserved_destinations_refused_once_normalised(tmp_path: Path, dest: str, norm: str) -> None:
    (tmp_path / "train.py").write_text("x\n")
    shown = "" if dest == norm else f", got {dest!r}"
    assert normalize_dest(dest) == norm.removesuffix("/train.py")
    assert problems(tmp_path, f"  - {{src: train.py, dest: '{dest}'}}\n") == [
        f"inventory.yaml:7: files[0].dest: {norm} is reserved for provision's own files{shown}",
    ]


def test_file_into_a_directory_that_is_reserved(tmp_path: Path) -> None:
    """`dest: /etc/` for a file named provision would write /etc/provision itself."""
    (tmp_path / "provision").write_text("x\n")
    assert problems(tmp_path, "  - {src: provision, dest: /etc/}\n") == [
        "inventory.yaml:7: files[0].dest: /etc/provision is reserved for provision's own files, got '/etc/'",
    ]


@pytest.mark.parametrize(
    ("dest", "norm"),
    [
        ("/opt/a//b/", "/opt/a/b"),
        ("/opt/./a/b", "/opt/a/b"),
        ("/opt/x/../a/b/.", "/opt/a/b"),
        ("///opt/a/b//", "/opt/a/b"),
    ],
)
def test_destinations_normalised(tmp_path: Path, dest: str, norm: str) -> None:
    assert normalize_dest(dest) == norm
    tree(tmp_path / "job", {"m.py": ("m\n", 0o644)})
    (tmp_path / "train.py").write_text("x\n")
    got = specs(tmp_path, f"  - {{src: job, dest: '{dest}'}}\n  - {{src: train.py, dest: '{dest}/t.py'}}\n")
    assert [s.dest for s in got] == [norm, f"{norm}/t.py"]
    assert sorted(f.path for f in pushed_files(got)) == [f"{norm}/m.py", f"{norm}/t.py"]


def test_file_with_a_trailing_slash_goes_into_the_directory(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("x\n")
    (tmp_path / "cfg.json").write_text("{}\n")
    got = specs(tmp_path, "  - {src: train.py, dest: /opt/job/}\n  - {src: cfg.json, dest: /opt/job/config.json}\n")
    assert [s.dest for s in got] == ["/opt/job/train.py", "/opt/job/config.json"]


@pytest.mark.parametrize(
    ("dest", "message"),
    [
        ("/..", "climbs above / with '..', got '/..'"),
        ("/opt/../../etc/x", "climbs above / with '..', got '/opt/../../etc/x'"),
        ("//", "is the root directory /; name a directory below it, got '//'"),
        ("/opt/..", "is the root directory /; name a directory below it, got '/opt/..'"),
        ("opt/x", "expected an absolute path on the host, got 'opt/x'"),
    ],
)
def test_bad_destinations(tmp_path: Path, dest: str, message: str) -> None:
    tree(tmp_path / "job", {"m.py": ("m\n", 0o644)})
    assert problems(tmp_path, f"  - {{src: job/, dest: '{dest}'}}\n") == [f"inventory.yaml:7: files[0].dest: {message}"]


def test_two_entries_to_the_same_file_refused(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("a\n")
    (tmp_path / "b.py").write_text("b\n")
    assert problems(tmp_path, "  - {src: a.py, dest: /opt/job/x.py}\n  - {src: b.py, dest: //opt/job/./x.py}\n") == [
        "inventory.yaml:8: files[1].dest: /opt/job/x.py is also written by files[0]; a file on the host has one source",
    ]


def test_directories_that_overlap_on_files_refused(tmp_path: Path) -> None:
    tree(tmp_path / "a", {"same.py": ("a\n", 0o644), "also.py": ("a\n", 0o644), "only_a.py": ("a\n", 0o644)})
    tree(tmp_path / "b", {"same.py": ("b\n", 0o644), "also.py": ("b\n", 0o644), "only_b.py": ("b\n", 0o644)})
    assert problems(tmp_path, "  - {src: a/, dest: /opt/job/}\n  - {src: b/, dest: /opt/job}\n") == [
        "inventory.yaml:8: files[1].dest: /opt/job/also.py is also written by files[0]; a file on the host has one source (1 more file clashes with files[0])",
    ]


def test_directories_sharing_a_destination_without_common_files_are_fine(tmp_path: Path) -> None:
    tree(tmp_path / "a", {"only_a.py": ("a\n", 0o644)})
    tree(tmp_path / "b", {"only_b.py": ("b\n", 0o644)})
    got = specs(tmp_path, "  - {src: a/, dest: /opt/job/}\n  - {src: b/, dest: /opt/job}\n")
    assert sorted(f.path for f in pushed_files(got)) == ["/opt/job/only_a.py", "/opt/job/only_b.py"]


def test_a_file_where_a_directory_is_needed_refused(tmp_path: Path) -> None:
    tree(tmp_path / "job", {"m.py": ("m\n", 0o644)})
    (tmp_path / "train.py").write_text("x\n")
    assert problems(tmp_path, "  - {src: job/, dest: /opt/job/}\n  - {src: train.py, dest: /opt/job}\n") == [
        "inventory.yaml:8: files[1].dest: /opt/job is a directory that files[0] writes into; it cannot also be a file",
    ]


def test_a_command_that_pushes_nothing_reads_the_job_without_its_sources(tmp_path: Path) -> None:
    """status, logs, cancel... (files_here=False) take an inventory whose sources are gone
    (handed over: the service has its snapshot), leaving them out; their destinations are
    still checked; a command that pushes refuses as before."""
    job = tree(tmp_path / "job", {"train.py": ("x\n", 0o644)})
    os.symlink("gone.bin", job / "model.bin")
    files = (
        "  - {src: gone.py, dest: /opt/j/gone.py}\n  - {src: job/, dest: /opt/j/}\n  - {src: here.py, dest: /opt/x/}\n"
    )
    (tmp_path / "here.py").write_text("y\n")
    text = inv(tmp_path, files + "setup:\n  commands: [pip install /opt/j]\n  inputs: [/opt/j/gone.py]\n")
    assert (
        problems(tmp_path, files)[0] == f"inventory.yaml:7: files[0].src: no such file or directory: {tmp_path}/gone.py"
    )
    got = parse(text, tmp_path / "inventory.yaml", display="inventory.yaml", files_here=False)
    assert [(f.src.name, f.dest) for f in got.files] == [("here.py", "/opt/x/here.py")]
    with pytest.raises(ValidationError) as e:
        parse(
            text.replace("/opt/j/gone.py}", "opt/j/gone.py}"),
            tmp_path / "inventory.yaml",
            display="inventory.yaml",
            files_here=False,
        )
    assert e.value.problems == [
        "inventory.yaml:7: files[0].dest: expected an absolute path on the host, got 'opt/j/gone.py'"
    ]
