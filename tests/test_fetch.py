"""provision fetch: the listing, what changed locally, and what a host's tar stream may hold
(6 and 7). The streams are crafted with tarfile in memory, as a hostile
host would send them; the transfer runs against a stand-in for the SSH session. The whole
command runs on sandbox hosts in tests/integration/test_ux.py and test_hostile.py."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
import subprocess
import tarfile
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from provision.core.errors import ProvisionError
from provision.core.target import Target
from provision.io.ssh import Result
from provision.rules.fetchtar import BLOCK, End, Member, Refused, TarStream, bound, listing_problem
from provision.run import fetch as fetchmod
from provision.run.fetch import Remote, changed, claimed, parse_listing, transfer

MTIME = 1700000000
WHERE = "chief-0@gpu-1:/data/runs"


def test_listing_survives_odd_names():
    out = b"model/a.pt\x0012\x001700000000.5\x00odd\nname\x003\x001700000001.0\x00"
    assert parse_listing(out) == [Remote("model/a.pt", 12, 1700000000), Remote("odd\nname", 3, 1700000001)]
    assert parse_listing(b"") == []


def test_a_malformed_listing_entry_is_dropped_not_a_traceback():
    out = b"a\x00-1\x001.0\x00b\x001\x00inf\x00c\x001\x00nan\x00d\x00x\x001\x00e\x002\x001.0\x00"
    assert parse_listing(out) == [Remote("e", 2, 1)]


def test_only_what_differs_in_size_or_time(tmp_path):
    (tmp_path / "model").mkdir()
    same = tmp_path / "model" / "same.pt"
    same.write_bytes(b"x" * 4)
    os.utime(same, (1700000000, 1700000000))
    older = tmp_path / "model" / "older.pt"
    older.write_bytes(b"y" * 4)
    os.utime(older, (1600000000, 1600000000))
    remote = [
        Remote("model/same.pt", 4, 1700000000),
        Remote("model/older.pt", 4, 1700000000),
        Remote("model/bigger.pt", 5, 1700000000),
        Remote("logs/new.txt", 1, 1700000000),
    ]
    (tmp_path / "model" / "bigger.pt").write_bytes(b"z" * 4)
    assert [r.path for r in changed(remote, tmp_path)] == ["model/older.pt", "model/bigger.pt", "logs/new.txt"]


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        (["model/a", "../x"], "../x: `..` in its path"),
        (["model/../../x"], "model/../../x: `..` in its path"),
        (["/etc/passwd"], "/etc/passwd: an absolute path"),
        (["a//b"], "a//b: not a plain relative path"),
        (["./a"], "./a: not a plain relative path"),
        (["a", "a"], "a: listed twice"),
        (["model", "model/a.pt"], "model/a.pt: listed inside model, which is listed as a file"),
        ([".provision-fetch-x/a"], ".provision-fetch-x/a: a name fetch keeps for its own work"),
        (["odd\nname/../x"], "odd\\nname/../x: `..` in its path"),  # shown on one line
    ],
)
def test_a_listing_fetch_could_not_write_safely_is_refused(names, problem):
    got = listing_problem([Remote(n, 1, MTIME) for n in names])
    assert got is not None and str(got).startswith(problem), got
    assert "\n" not in str(got)


def test_a_plain_listing_passes():
    assert listing_problem([Remote(n, 1, MTIME) for n in ["model/a.pt", "logs/odd\nname", "a b/c"]]) is None


# -- crafted streams


def entry(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **kw) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mtime = MTIME
    info.mode = kw.pop("mode", 0o644)
    for k, v in kw.items():
        setattr(info, k, v)
    return info, data


def tar_of(*entries: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def read_all(stream: TarStream, data: bytes, chunk: int = 7) -> dict[str, bytes]:
    """Feed data in small chunks (every boundary case); what came out, per file."""
    files: dict[str, bytes] = {}
    current: list[bytes] = []
    for i in range(0, len(data), chunk):
        for ev in stream.feed(data[i : i + chunk]):
            if isinstance(ev, Member):
                current = []
            elif isinstance(ev, End):
                files[ev.member.name] = b"".join(current)
            else:
                current.append(bytes(ev))
    stream.close()
    return files


def test_a_plain_stream_gives_its_files_in_any_chunking():
    long = "model/" + "n" * 150
    data = tar_of(entry("model/a.pt", b"weights"), entry(long, b"x" * 600), entry("empty", b""))
    announced = {"model/a.pt": 7, long: 600, "empty": 0}
    for chunk in (1, 7, 512, 1 << 20):
        assert read_all(TarStream(announced), data, chunk) == {"model/a.pt": b"weights", long: b"x" * 600, "empty": b""}


def test_gnu_tars_own_stream_is_accepted(tmp_path):
    """What the hosts run: GNU tar --format=gnu, long names and the record's padding."""
    long = "n" * 150
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.pt").write_bytes(b"weights")
    (tmp_path / long).write_bytes(b"y" * 1000)
    names = ["model/a.pt", long]
    out = subprocess.run(
        ["tar", "-C", tmp_path, "--format=gnu", "--null", "-T", "-", "-cf", "-"],
        input=b"\0".join(n.encode() for n in names) + b"\0",
        capture_output=True,
        check=True,
    ).stdout
    assert len(out) <= bound({"model/a.pt": 7, long: 1000})
    assert read_all(TarStream({"model/a.pt": 7, long: 1000}), out, 4096) == {
        "model/a.pt": b"weights",
        long: b"y" * 1000,
    }


def chain() -> list[tuple[tarfile.TarInfo, bytes]]:
    """CVE-2025-4517's shape: directories and links whose resolved path outgrows PATH_MAX,
    then a link through them to outside, then a file written through that link."""
    parts = []
    step = "d" * 200
    path = ""
    for i in range(16):
        parts.append(entry(path + step, kind=tarfile.DIRTYPE))
        parts.append(entry(path + "l" * (i + 1), kind=tarfile.SYMTYPE, linkname=step))
        path += "l" * (i + 1) + "/"
    parts.append(entry("escape", kind=tarfile.SYMTYPE, linkname=path + "../" * 16 + "../.."))
    parts.append(entry("escape/owned", b"pwned"))
    return parts


@pytest.mark.parametrize(
    ("members", "problem"),
    [
        ([entry("model/a.pt", kind=tarfile.SYMTYPE, linkname="../../etc")], "model/a.pt: a symbolic link to ../../etc"),
        ([entry("model/a.pt", kind=tarfile.SYMTYPE, linkname="/etc/passwd")], "a symbolic link to /etc/passwd"),
        ([entry("model/a.pt", kind=tarfile.LNKTYPE, linkname="/etc/shadow")], "a hard link to /etc/shadow"),
        ([entry("model/a.pt", kind=tarfile.CHRTYPE, devmajor=1, devminor=5)], "a character device"),
        ([entry("model/a.pt", kind=tarfile.BLKTYPE, devmajor=8)], "a block device"),
        ([entry("model/a.pt", kind=tarfile.FIFOTYPE)], "a FIFO"),
        ([entry("model", kind=tarfile.DIRTYPE)], "model: a directory"),
        ([entry("../../evil", b"x")], "../../evil: `..` in its path"),
        ([entry("model/../../../evil", b"x")], "`..` in its path"),
        ([entry("/tmp/evil", b"x")], "/tmp/evil: an absolute path"),
        ([entry("other.pt", b"x")], "other.pt: not a file the listing named"),
        ([entry("model/a.pt", b"y" * 5000)], "model/a.pt: 5000 bytes where the listing announced 7"),
        ([entry("model/a.pt", b"y")], "model/a.pt: 1 bytes where the listing announced 7"),
        ([entry("model/a.pt", b"weights"), entry("model/a.pt", b"weights")], "model/a.pt: sent twice"),
        ([entry("model/a.pt", b"weights", mtime=2**50)], "a modification time out of range"),
    ],
)
def test_every_member_but_a_listed_regular_file_is_refused(members, problem):
    data = tar_of(*members)
    with pytest.raises(Refused) as e:
        read_all(TarStream({"model/a.pt": 7}), data, 1000)
    assert problem in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("members", "listed", "problem"),
    [
        (chain(), False, "a long name of 202 bytes, longer than any the listing announced"),
        # A listing that names the chain's members (a hostile host lists what it likes):
        # refused at its first member, and at its first link; the file is never reached.
        (chain(), True, "d" * 157 + "...: a directory"),
        (chain()[1:], True, "l: a symbolic link to " + "d" * 157 + "..."),
        (chain()[-2:], True, "escape: a symbolic link to l/ll/"),
    ],
)
def test_a_link_chain_as_in_cve_2025_4517_is_refused(members, listed, problem):
    announced = {"model/a.pt": 7} | ({info.name: info.size for info, _ in members} if listed else {})
    with pytest.raises(Refused) as e:
        read_all(TarStream(announced), tar_of(*members), 1000)
    assert problem in str(e.value), str(e.value)


def test_a_pax_header_is_refused():
    data = tar_of(entry("model/a.pt", b"weights", pax_headers={"path": "../../x"}), fmt=tarfile.PAX_FORMAT)
    with pytest.raises(Refused, match="a pax header"):
        read_all(TarStream({"model/a.pt": 7}), data)


def test_a_long_name_longer_than_any_listed_is_refused_before_it_is_read():
    data = tar_of(entry("model/" + "x" * 5000, b"w"))
    with pytest.raises(Refused, match="a long name of 5007 bytes"):
        read_all(TarStream({"model/a.pt": 7}), data)


def test_garbage_is_not_a_tar_stream():
    with pytest.raises(Refused, match="not a tar stream: the header at byte 0 is invalid"):
        read_all(TarStream({"model/a.pt": 7}), b"y\n" * 600)


@pytest.mark.parametrize(
    ("cut", "problem"),
    [
        (BLOCK + 3, "model/a.pt: the stream ended 4 bytes before the end of this file"),
        (2 * BLOCK, "the stream ended after 1024 bytes, before the end of the archive"),
        (100, "the stream ended after 100 bytes"),
    ],
)
def test_a_truncated_stream_is_refused(cut, problem):
    data = tar_of(entry("model/a.pt", b"weights"))[:cut]
    with pytest.raises(Refused) as e:
        read_all(TarStream({"model/a.pt": 7}), data)
    assert problem in str(e.value)


def test_a_missing_file_is_refused():
    data = tar_of(entry("model/a.pt", b"weights"))
    with pytest.raises(Refused, match=r"model/b.pt: not in the stream \(it held 1 of the 2 files announced\)"):
        read_all(TarStream({"model/a.pt": 7, "model/b.pt": 1}), data)


def test_the_stream_is_cut_at_the_listings_bound():
    """A listing of one empty file: a correct archive, then an endless stream of zeros (or
    anything) is cut at the bound, not read for ever."""
    announced = {"model/a.pt": 0}
    stream = TarStream(announced)
    stream.feed(tar_of(entry("model/a.pt", b"")))
    with pytest.raises(
        Refused, match=r"the host sent more than the 12800 bytes its listing leaves room for \(1 file of 0 bytes\)"
    ):
        for _ in range(100):
            stream.feed(bytes(1 << 16))
    assert stream.got <= bound(announced) + (1 << 16)


# -- the transfer, against a stand-in session


class Host:
    """A session whose download sends what a test crafted, in chunks, as a host would."""

    def __init__(self, data: bytes | Iterable[bytes], status: int = 0, stderr: bytes = b""):
        self.data = data
        self.status = status
        self.stderr = stderr
        self.sent = 0
        self.calls = 0

    def download(
        self, target: Target, command: str, sink: Callable[[bytes], None], *, stdin: bytes = b"", timeout: float = 600
    ) -> Result:
        self.calls += 1
        chunks = (
            [self.data[i : i + 3000] for i in range(0, len(self.data), 3000)]
            if isinstance(self.data, bytes)
            else self.data
        )
        for c in chunks:
            self.sent += len(c)
            sink(c)
        return Result(self.status, b"", self.stderr)


TARGET = Target("gpu-1", "10.0.0.1")


def run(host: Host, dest: Path, todo: dict[str, int]) -> list[str]:
    said: list[str] = []
    with claimed(dest):
        transfer(host, TARGET, "/data/runs", WHERE, [Remote(n, s, MTIME) for n, s in todo.items()], dest, said.append)
    return said


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_the_files_land_with_their_times_and_modes(tmp_path):
    data = tar_of(entry("model/a.pt", b"weights", mode=0o4777), entry("logs/ev", b"e", mode=0o600))
    said = run(Host(data), tmp_path / "out", {"model/a.pt": 7, "logs/ev": 1})
    out = tmp_path / "out"
    assert (out / "model" / "a.pt").read_bytes() == b"weights"
    assert tree(out) == {"model", "model/a.pt", "logs", "logs/ev"}  # the work directory is gone
    assert int((out / "model" / "a.pt").stat().st_mtime) == MTIME
    assert stat.S_IMODE((out / "model" / "a.pt").stat().st_mode) == 0o755  # no set-id, no write for others
    assert stat.S_IMODE((out / "logs" / "ev").stat().st_mode) == 0o600
    assert said[-1].startswith(f"{WHERE}: fetched 2 files")


def test_a_bad_member_leaves_nothing_of_that_fetch(tmp_path):
    """Good files came first: none of them is placed, and the work directory is gone."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "old.pt").write_bytes(b"old")
    data = tar_of(entry("model/a.pt", b"weights"), *chain()[-2:])
    with pytest.raises(ProvisionError) as e:
        run(Host(data), out, {"model/a.pt": 7, "escape": 0, "escape/owned": 5})
    assert str(e.value).startswith(f"{WHERE}: escape: a symbolic link to l/ll/"), e.value
    assert str(e.value).endswith(": nothing fetched")
    assert "\n" not in str(e.value) and e.value.exit_code == 1
    assert tree(out) == {"model", "model/old.pt"}
    assert tree(tmp_path) == {"out", "out/model", "out/model/old.pt"}  # nothing outside -o either


def test_an_endless_stream_is_cut(tmp_path):
    def endless() -> Iterable[bytes]:
        yield tar_of(entry("model/a.pt", b""))
        while True:
            yield bytes(1 << 16)

    host = Host(endless())
    with pytest.raises(ProvisionError, match="the host sent more than"):
        run(host, tmp_path / "out", {"model/a.pt": 0})
    assert host.sent < 1 << 17
    assert tree(tmp_path / "out") == set()


def test_tars_failure_is_one_line(tmp_path):
    host = Host(b"", status=2, stderr=b"tar: model/a.pt: Cannot stat: No such file\ntar: Exiting with failure status\n")
    with pytest.raises(ProvisionError) as e:
        run(host, tmp_path / "out", {"model/a.pt": 7})
    assert str(e.value) == (
        f"{WHERE}: tar exited 2: tar: model/a.pt: Cannot stat: No such file; "
        "tar: Exiting with failure status: nothing fetched"
    )


@pytest.mark.parametrize("kind", ["file", "link"])
def test_something_in_the_way_is_one_line_before_anything_is_sent(tmp_path, kind):
    out = tmp_path / "out"
    out.mkdir()
    if kind == "file":
        (out / "model").write_bytes(b"not a directory")
    else:
        (tmp_path / "elsewhere").mkdir()
        (out / "model").symlink_to(tmp_path / "elsewhere")
    host = Host(tar_of(entry("model/a.pt", b"weights")))
    with pytest.raises(ProvisionError) as e:
        run(host, out, {"model/a.pt": 7})
    said = {
        "file": f"{out}/model is a file, where {WHERE} has a directory (model/a.pt goes below it)",
        "link": f"{out}/model is a symbolic link: fetch writes only into real directories",
    }
    assert str(e.value).startswith(said[kind]), e.value
    assert host.calls == 0
    assert not list((tmp_path / "elsewhere").glob("*")) if kind == "link" else True


def test_a_directory_where_a_file_goes_is_one_line(tmp_path):
    out = tmp_path / "out"
    (out / "model" / "a.pt").mkdir(parents=True)
    with pytest.raises(ProvisionError, match=r"/model/a.pt is a directory, where .* has a file"):
        run(Host(tar_of(entry("model/a.pt", b"weights"))), out, {"model/a.pt": 7})


def test_a_link_where_a_file_goes_is_replaced_not_followed(tmp_path):
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    (out / "model" / "a.pt").symlink_to(victim)
    run(Host(tar_of(entry("model/a.pt", b"weights"))), out, {"model/a.pt": 7})
    assert victim.read_bytes() == b"mine"
    assert not (out / "model" / "a.pt").is_symlink() and (out / "model" / "a.pt").read_bytes() == b"weights"


def test_a_full_local_disk_is_one_line_exit_1_not_a_host_error(tmp_path, monkeypatch):
    real = os.write

    def full(fd: int, data) -> int:
        if len(data) > 100:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(fetchmod.os, "write", full)
    out = tmp_path / "out"
    with pytest.raises(ProvisionError) as e:
        run(Host(tar_of(entry("model/a.pt", b"w" * 1000))), out, {"model/a.pt": 1000})
    assert str(e.value) == f"{out}/model/a.pt: No space left on device" and e.value.exit_code == 1
    assert tree(out) == set()


def test_what_a_killed_fetch_left_is_removed_by_the_next(tmp_path):
    out = tmp_path / "out"
    (out / ".provision-fetch-abc123").mkdir(parents=True)
    (out / ".provision-fetch-abc123" / "model").mkdir()
    (out / ".provision-fetch-abc123" / "model" / "half.pt").write_bytes(b"x")
    (out / ".provision-fetch-1f2e3d.tar").write_bytes(b"y" * 1000)  # an earlier version's
    (out / "model").mkdir()
    (out / "model" / "kept.pt").write_bytes(b"k")
    with claimed(out):
        assert tree(out) == {"model", "model/kept.pt"}


def test_one_fetch_at_a_time_into_a_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ProvisionError, match="another provision fetch is writing into it"):
            with claimed(out):
                pass
    finally:
        os.close(fd)


def test_an_output_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "out").write_bytes(b"x")
    with pytest.raises(ProvisionError, match=r"out: not a directory"):
        with claimed(tmp_path / "out"):
            pass


# -- the SSH download's side: a sink's failure is the controller's, not the host's


class Channel:
    def __init__(self, out: list[bytes], err: bytes = b""):
        self.out = list(out)
        self.err = err
        self.closed = False

    def settimeout(self, t):
        pass

    def exec_command(self, cmd):
        pass

    def makefile_stderr(self, mode):
        return io.BytesIO(self.err)

    def sendall(self, data):
        pass

    def shutdown_write(self):
        pass

    def recv(self, n):
        return self.out.pop(0) if self.out else b""

    def recv_exit_status(self):
        return 0

    def close(self):
        self.closed = True


def ssh_with(tmp_path, chan: Channel):
    from types import SimpleNamespace

    from provision.io.hostkeys import KnownHosts
    from provision.io.ssh import Session

    conn = SimpleNamespace(
        name="gpu-1",
        user="root",
        is_connected=True,
        close=lambda: None,
        client=SimpleNamespace(get_transport=lambda: SimpleNamespace(open_session=lambda timeout: chan)),
    )
    s = Session(KnownHosts(tmp_path / "known_hosts"))
    s._dial = lambda target: conn  # type: ignore[method-assign]
    return s


def test_a_sinks_oserror_is_raised_as_it_is_and_the_channel_closed(tmp_path):
    """A full local disk while a tar arrives was "connection lost" (exit 3, the host
    unreachable): the sink's OSError is the controller's own."""
    chan = Channel([b"a" * 10, b"b" * 10, b"c" * 10])
    s = ssh_with(tmp_path, chan)

    def sink(data: bytes) -> None:
        if data.startswith(b"b"):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as e:
        s.download(TARGET, "tar -cf - x", sink)
    assert type(e.value) is OSError and e.value.errno == errno.ENOSPC
    assert chan.closed and chan.out == [b"c" * 10]  # read no further
    assert "gpu-1" in s._conns  # the connection is fine


def test_a_hosts_stderr_is_kept_to_a_bound(tmp_path):
    from provision.io.ssh import STDERR_KEPT

    s = ssh_with(tmp_path, Channel([b"out"], err=b"e" * (STDERR_KEPT + 12345)))
    res = s.download(TARGET, "x", lambda d: None)
    assert len(res.stderr) == STDERR_KEPT
