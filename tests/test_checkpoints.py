"""The checkpoint that outlives its host: the decisions (rules/checkpoints.py) as tables,
the inventory's `checkpoint:` key, and the copy itself against a stand-in host sending a
real tar stream (run/checkpoints.py): a copy interrupted keeps the previous complete one.
The whole loop (a copy, the saving rank's host killed, the job resumed on the spare from
it) runs on sandbox hosts in tests/integration/test_recovery.py."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from provision.core.errors import ValidationError
from provision.core.recovery import CheckpointSpec, CopyTo
from provision.core.target import HostError, Target
from provision.inventory.inventory import parse
from provision.io.ssh import Result
from provision.rules.checkpoints import (
    Act,
    CopyRecord,
    line,
    look_now,
    newest,
    record_of,
    restore_to,
    saving_task,
    step_of,
    verdict,
    view,
)
from provision.rules.fetchtar import Remote
from provision.run.checkpoints import copy_newest, read_record, tar_of
from provision.run.fetch import LOW

# -- the rules, as tables


@pytest.mark.parametrize(
    "listing, name, files",
    [
        ([], None, ()),
        ([Remote("ckpt-8.pt", 10, 100), Remote("ckpt-16.pt", 10, 200)], "ckpt-16.pt", ("ckpt-16.pt",)),
        # the trainer's temporary name (before its rename) is never the newest
        ([Remote("ckpt-8.pt", 10, 100), Remote(".ckpt-16.tmp", 10, 300)], "ckpt-8.pt", ("ckpt-8.pt",)),
        (
            [Remote("ckpt-8.pt", 10, 100), Remote("ckpt-16.pt.tmp", 10, 300), Remote("x.part", 1, 400)],
            "ckpt-8.pt",
            None,
        ),
        # a sharded checkpoint: a directory, its time its newest file's; hidden files inside skipped
        (
            [
                Remote("step-2/a", 1, 100),
                Remote("step-4/a", 1, 150),
                Remote("step-4/b", 2, 250),
                Remote("step-4/.b.tmp", 2, 260),
            ],
            "step-4",
            ("step-4/a", "step-4/b"),
        ),
        ([Remote(".hidden", 1, 500)], None, ()),
        # the same time: the name decides (one answer, whatever order the host lists)
        ([Remote("b", 1, 100), Remote("a", 1, 100)], "b", ("b",)),
    ],
)
def test_the_newest_complete_checkpoint(listing, name, files):
    got = newest(listing)
    assert (got.name if got else None) == name
    if got is not None and files is not None:
        assert tuple(r.path for r in got.files) == files
        assert got.size == sum(r.size for r in got.files)


@pytest.mark.parametrize(
    "name, step", [("ckpt-120.pt", 120), ("step-4", 4), ("model", None), ("run2-ckpt-30.pt", 30), ("e3s1000", 1000)]
)
def test_the_step_a_name_carries(name, step):
    assert step_of(name) == step


@pytest.mark.parametrize(
    "tasks, task",
    [
        ({"chief-0": "a", "worker-0": "b"}, "chief-0"),
        ({"worker-0": "b", "worker-1": "c"}, "worker-0"),
        ({"ps-0": "a"}, None),
    ],
)
def test_the_saving_rank(tasks, task):
    assert saving_task(tasks) == task


SPEC = CheckpointSpec(CopyTo.CONTROLLER, max_bytes=1000)
HAVE = CopyRecord("c-1", "ckpt-8.pt", 8, 10, 100, "host-1", 1.0)


@pytest.mark.parametrize(
    "rec, listing, host, act",
    [
        (CopyRecord(), [], "host-1", Act.KEEP),  # nothing saved yet
        (CopyRecord(), [Remote("ckpt-8.pt", 10, 100)], "host-1", Act.COPY),
        (HAVE, [Remote("ckpt-8.pt", 10, 100)], "host-1", Act.KEEP),  # the copy is the newest
        (HAVE, [Remote("ckpt-16.pt", 10, 200)], "host-1", Act.COPY),  # a newer one
        (HAVE, [Remote("ckpt-8.pt", 10, 100)], "host-3", Act.COPY),  # the saving rank moved
        (HAVE, [Remote("ckpt-16.pt", 5000, 200)], "host-1", Act.SKIP),  # over max_size: the old copy kept
    ],
)
def test_what_a_look_does(rec, listing, host, act):
    v = verdict(SPEC, rec, newest(listing), host)
    assert v.act is act
    if act is Act.SKIP:
        assert v.words == (
            "ckpt-16.pt: 0.0 MB, over checkpoint.max_size 0.0 MB: not copied (put outputs: on shared storage)"
        )


@pytest.mark.parametrize(
    "looked, changed, now, look",
    [
        (0.0, None, 10.0, False),  # the first minute: no look without a sign
        (0.0, None, 61.0, True),  # a minute since the last look
        (100.0, 150.0, 110.0, True),  # the directory changed since the last look
        (100.0, 90.0, 110.0, False),
    ],
)
def test_when_to_look(looked, changed, now, look):
    assert look_now(CopyRecord(looked_at=looked), changed, now) is look


@pytest.mark.parametrize(
    "tasks, answering, host",
    [
        ({"chief-0": "host-1", "worker-0": "host-2"}, ["host-1", "host-2"], None),  # it did not move
        ({"chief-0": "host-3", "worker-0": "host-2"}, ["host-2", "host-3"], "host-3"),  # onto the spare
        ({"chief-0": "host-3", "worker-0": "host-2"}, ["host-2"], None),  # its new host does not answer
    ],
)
def test_where_the_copy_goes_back(tasks, answering, host):
    assert restore_to(HAVE, tasks, answering) == host
    assert restore_to(CopyRecord(), tasks, answering) is None  # no copy: nothing to put back


def test_how_far_behind_the_copy_is_shown():
    j = view(HAVE, 130.0)
    assert j["step"] == 8 and j["lag_seconds"] == 30 and j["host"] == "host-1"
    assert (
        line(j, lambda s: f"{s}s")
        == "Checkpoint copy: ckpt-8.pt (step 8) of host-1 on the controller, 30s behind the newest"
    )
    assert line(view(HAVE, 101.0), str).endswith("on the controller, the newest")
    assert line(view(CopyRecord(skipped="x: too big"), None), str) == "Checkpoint copy: none yet (x: too big)"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "{",
        json.dumps({"dir": "../x", "name": "a", "mtime": 1}),
        json.dumps({"dir": "c-1", "mtime": "x", "name": "a"}),
    ],
)
def test_a_damaged_record_is_no_copy(text):
    assert not record_of(text).has_copy


# -- the inventory's key

BASE = {
    "job": "j",
    "hosts": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"}],
    "pools": {"chief": {"replicas": 1, "image": "x"}},
}


def inv_of(**extra):
    return parse(json.dumps({**BASE, **extra}), Path("inv.yaml"), files_here=False)


def test_a_job_with_recovery_and_outputs_is_copied_to_the_controller_by_default():
    assert inv_of(outputs="/data/r", recovery={}).checkpoint == CheckpointSpec()
    assert inv_of(outputs="/data/r").checkpoint is None  # no recovery: not copied
    got = inv_of(outputs="/data/r", recovery={}, checkpoint={"copy": "shared"}).checkpoint
    assert got is not None and got.copy is CopyTo.SHARED
    got = inv_of(outputs="/d", checkpoint={"max_size": "500MB", "bandwidth": "1MiB/s"}).checkpoint
    assert got == CheckpointSpec(CopyTo.CONTROLLER, 500_000_000, 1 << 20)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"checkpoint": {"copy": "peers"}}, "checkpoint.copy"),
        (
            {"checkpoint": {"max_size": "lots"}},
            "checkpoint.max_size: expected a size up to 1TiB (2GiB, 500MB, bytes), got 'lots'",
        ),
        ({"checkpoint": {"bandwidth": "10"}}, "checkpoint.bandwidth: expected bytes a second of at least 1kB/s"),
        ({"checkpoint": {"speed": 1}}, "checkpoint"),
        (
            {"checkpoint": {"copy": "controller"}, "outputs": None},
            "checkpoint.copy: copies AIP_CHECKPOINT_DIR, which is below `outputs:`",
        ),
    ],
)
def test_a_bad_checkpoint_key_is_one_line(extra, message):
    extra = {"outputs": "/d", **extra}
    if extra["outputs"] is None:
        del extra["outputs"]
    with pytest.raises(ValidationError) as e:
        inv_of(**extra)
    assert len(e.value.problems) == 1 and message in e.value.problems[0], e.value.problems


# -- the copy, against a stand-in host sending a real tar stream


def tar_bytes(files: dict[str, bytes], mtime: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Host:
    """The saving rank's host: its listing, then tar of what was asked; `cut` bytes into the
    stream the connection is lost (the host killed mid-copy)."""

    def __init__(self, files: dict[str, bytes], mtime: int, cut: int | None = None):
        self.files, self.mtime, self.cut = files, mtime, cut
        self.commands: list[str] = []

    def download(
        self, target: Target, command: str, sink: Callable[[bytes], None], *, stdin: bytes = b"", timeout: float = 600
    ) -> Result:
        self.commands.append(command)
        if "find ." in command:
            sink(b"".join(f"{n}\0{len(d)}\0{self.mtime}.0\0".encode() for n, d in self.files.items()))
            return Result(0, b"", b"")
        asked = [n.decode() for n in stdin.split(b"\0") if n]
        data = tar_bytes({n: self.files[n] for n in asked}, self.mtime)
        end = len(data) if self.cut is None else self.cut
        for i in range(0, end, 1000):
            sink(data[i : min(i + 1000, end)])
        if self.cut is not None:
            raise HostError(target, "connection lost: the host was killed", unreachable=True)
        return Result(0, b"", b"")


TARGET = Target("host-1", "10.0.0.1")
CK = "/data/r/checkpoints"


def test_a_copy_interrupted_keeps_the_previous_complete_one(tmp_path):
    said: list[str] = []
    first = Host({"ckpt-8.pt": b"eight" * 100}, 1000)
    rec = copy_newest(first, TARGET, CK, CheckpointSpec(), tmp_path, said.append, 10.0)
    assert rec.name == "ckpt-8.pt" and rec.step == 8 and read_record(tmp_path) == rec
    assert (tmp_path / rec.dir / "ckpt-8.pt").read_bytes() == b"eight" * 100
    assert said == ["checkpoint copy: ckpt-8.pt (0.0 MB) from host-1, kept on the controller"]
    # the host's side of the stream: the lowest CPU and I/O priority
    assert LOW.strip() in first.commands[-1]

    # The trainer renamed a newer one into place (its temporary name beside it); the host
    # is lost half-way through the copy.
    files = {"ckpt-16.pt": b"sixteen" * 400, ".ckpt-24.tmp": b"partial"}
    with pytest.raises(HostError):
        copy_newest(Host(files, 2000, cut=1500), TARGET, CK, CheckpointSpec(), tmp_path, said.append, 20.0)
    kept = read_record(tmp_path)
    assert kept == rec and (tmp_path / kept.dir / "ckpt-8.pt").read_bytes() == b"eight" * 100
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("c-")) == [rec.dir]  # nothing half-written

    # The next look copies the newer one whole, and the previous copy goes.
    rec2 = copy_newest(Host(files, 2000), TARGET, CK, CheckpointSpec(), tmp_path, said.append, 30.0)
    assert rec2.name == "ckpt-16.pt" and read_record(tmp_path) == rec2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("c-")) == [rec2.dir]
    assert [p.name for p in (tmp_path / rec2.dir).iterdir()] == ["ckpt-16.pt"]
    assert tarfile.open(fileobj=io.BytesIO(tar_of(tmp_path / rec2.dir))).getnames() == ["ckpt-16.pt"]


def test_a_checkpoint_over_the_cap_is_said_and_not_copied(tmp_path):
    said: list[str] = []
    spec = CheckpointSpec(max_bytes=100)
    rec = copy_newest(Host({"ckpt-8.pt": b"x" * 500}, 1000), TARGET, CK, spec, tmp_path, said.append, 10.0)
    assert not rec.has_copy and "over checkpoint.max_size" in rec.skipped and len(said) == 1
    copy_newest(Host({"ckpt-8.pt": b"x" * 500}, 1000), TARGET, CK, spec, tmp_path, said.append, 80.0)
    assert len(said) == 1  # said once


def test_a_hostile_stream_is_refused_and_keeps_the_copy(tmp_path):
    rec = copy_newest(Host({"ckpt-8.pt": b"a"}, 1000), TARGET, CK, CheckpointSpec(), tmp_path, lambda _: None, 1.0)

    class Liar(Host):
        def download(self, target, command, sink, *, stdin=b"", timeout=600):
            if "find ." in command:
                return super().download(target, command, sink, stdin=stdin, timeout=timeout)
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
                info = tarfile.TarInfo("ckpt-16.pt")
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
                t.addfile(info)
            sink(buf.getvalue())
            return Result(0, b"", b"")

    from provision.core.errors import ProvisionError

    with pytest.raises(ProvisionError, match="a symbolic link to /etc/shadow"):
        copy_newest(Liar({"ckpt-16.pt": b"b"}, 2000), TARGET, CK, CheckpointSpec(), tmp_path, lambda _: None, 2.0)
    assert read_record(tmp_path) == rec and not Path(tmp_path / rec.dir / "ckpt-16.pt").exists()


def test_status_prints_the_copy_and_its_lag():
    import click

    from provision.cli.output import status_lines
    from provision.core.lifecycle import JobPhase
    from provision.rules.status import JobStatus

    st = JobStatus("bert", JobPhase.RUNNING, "", (), checkpoint_copy=view(HAVE, 160.0))
    text = "\n".join(click.unstyle(x) for x in status_lines(st))
    assert "Checkpoint copy: ckpt-8.pt (step 8) of host-1 on the controller, 60s behind the newest" in text, text
    doc = st.to_json()
    assert doc["checkpoint_copy"]["step"] == 8 and doc["checkpoint_copy"]["lag_seconds"] == 60, doc


# -- a peer keeps it (`copy: peer`)

PEER = CheckpointSpec(CopyTo.PEER)


@pytest.mark.parametrize(
    "tasks, peer",
    [
        ({"chief-0": "host-1", "worker-0": "host-2", "worker-1": "host-3"}, "host-2"),
        ({"chief-0": "host-2", "worker-0": "host-1"}, "host-1"),
        ({"chief-0": "host-1", "worker-0": "host-1"}, None),  # one host: no peer to keep it
    ],
)
def test_the_peer_that_keeps_it(tasks, peer):
    from provision.rules.checkpoints import peer_of

    assert peer_of(PEER, tasks) == peer
    assert peer_of(CheckpointSpec(), tasks) == ""  # the controller


def test_a_copy_is_made_again_when_its_peer_changes():
    kept = CopyRecord("c-1", "ckpt-8.pt", 8, 10, 100, "host-1", 1.0, peer="host-2")
    chosen = newest([Remote("ckpt-8.pt", 10, 100)])
    assert verdict(PEER, kept, chosen, "host-1", "host-2").act is Act.KEEP
    assert verdict(PEER, kept, chosen, "host-1", "host-3").act is Act.COPY  # its peer left the job
    assert line(view(kept, None), str) == "Checkpoint copy: ckpt-8.pt (step 8) of host-1 on host-2"


class Relay(Host):
    """The saving host and, through `run`, the peer (its commands and what they were sent)."""

    def __init__(self, *a, peer_status: int = 0, **kw):
        super().__init__(*a, **kw)
        self.ran: list[tuple[str, str, bytes]] = []
        self.peer_status = peer_status

    def run(self, target, command, *, stdin=b"", timeout=600):
        self.ran.append((target.name, command, stdin))
        return Result(self.peer_status, b"", b"no room" if self.peer_status else b"")


def test_a_peers_copy_goes_through_the_controller_and_is_kept_there_only(tmp_path):
    d = tmp_path / "j"
    d.mkdir()
    peer = Target("host-2", "10.0.0.2")
    host = Relay({"ckpt-8.pt": b"eight"}, 1000)
    rec = copy_newest(host, TARGET, CK, PEER, d, lambda _: None, 10.0, ("host-2", peer))
    assert rec.peer == "host-2" and read_record(d) == rec
    assert not [p for p in d.iterdir() if p.name.startswith("c-")]  # not on this machine
    (name, command, data) = host.ran[0]
    assert name == "host-2" and f"/var/lib/provision/j/checkpoint-copy {rec.dir} -" in command
    assert tarfile.open(fileobj=io.BytesIO(data)).getnames() == ["ckpt-8.pt"]
    # The peer refuses the next one: the record still names the copy it keeps.
    bad = Relay({"ckpt-16.pt": b"sixteen"}, 2000, peer_status=1)
    with pytest.raises(Exception, match="host-2: the checkpoint copy not kept there: no room"):
        copy_newest(bad, TARGET, CK, PEER, d, lambda _: None, 20.0, ("host-2", peer))
    assert read_record(d) == rec
    assert f"checkpoint-copy c-{int(20.0 * 1000):x} {rec.dir}" in bad.ran[0][1]  # the kept one stays there


def _sh(script: str, *args: str, cwd: Path, stdin: bytes = b"") -> int:
    import subprocess

    return subprocess.run(["sh", "-c", script, "x", *args], cwd=cwd, input=stdin, capture_output=True).returncode


def test_the_hosts_side_keeps_the_named_copy_until_the_next_and_puts_one_back_whole(tmp_path):
    from provision.host import layout

    keep = tmp_path / "keep"
    assert _sh(layout.CHECKPOINT_KEEP_SH, str(keep), "c-1", "-", cwd=tmp_path, stdin=tar_bytes({"a.pt": b"1"}, 1)) == 0
    assert (
        _sh(layout.CHECKPOINT_KEEP_SH, str(keep), "c-2", "c-1", cwd=tmp_path, stdin=tar_bytes({"b.pt": b"2"}, 2)) == 0
    )
    assert sorted(p.name for p in keep.iterdir()) == ["c-1", "c-2"]  # the record's (c-1) kept until it names c-2
    assert _sh(layout.CHECKPOINT_KEEP_SH, str(keep), "c-3", "c-2", cwd=tmp_path, stdin=b"not a tar") != 0
    assert sorted(p.name for p in keep.iterdir() if not p.name.startswith(".")) == ["c-1", "c-2"]
    assert (
        _sh(layout.CHECKPOINT_KEEP_SH, str(keep), "c-3", "c-2", cwd=tmp_path, stdin=tar_bytes({"c.pt": b"3"}, 3)) == 0
    )
    assert sorted(p.name for p in keep.iterdir() if not p.name.startswith(".")) == ["c-2", "c-3"]

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "ckpt-4.pt").write_bytes(b"old")
    assert _sh(layout.put_sh(layout.UNPACK_STDIN), cwd=ck, stdin=tar_bytes({"ckpt-8.pt": b"8", "s/x": b"x"}, 8)) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["ckpt-4.pt", "ckpt-8.pt", "s"]  # no hidden work left
    assert _sh(layout.put_sh(layout.UNPACK_STDIN), cwd=ck, stdin=b"cut short") != 0
    assert sorted(p.name for p in ck.iterdir()) == ["ckpt-4.pt", "ckpt-8.pt", "s"]  # nothing half-put
    src = keep / "c-3"
    assert _sh(layout.put_sh(f'cp -R -p -- {src}/. "$w"/'), cwd=ck) == 0  # on the peer itself
    assert (ck / "c.pt").read_bytes() == b"3"


def test_the_service_copies_a_controller_and_a_peer_job_and_nothing_else(tmp_path, monkeypatch):
    """The keeper's choice, one round: a job copied to the controller or to a peer gets its
    copy started (in a thread), one shared or not copied does not, nor one whose saving
    host did not answer."""
    import threading

    from provision.rules.progress import Seen
    from provision.rules.rounds import HostSeen, JobWatch, Round
    from provision.rules.tenancy import HostView
    from provision.serve.checkpoints import CheckpointKeeper

    tasks = {"chief-0": "host-1", "worker-0": "host-2"}

    def watch(copy: CopyTo, job: str) -> JobWatch:
        return JobWatch(str(tmp_path / f"{job}.yaml"), None, None, tasks, Seen(), checkpoint=CheckpointSpec(copy=copy))

    started: list[str] = []
    keeper = CheckpointKeeper(None, lambda line: None)  # type: ignore[arg-type]
    monkeypatch.setattr(keeper, "_copy", lambda job, w: started.append(job))
    jobs = {copy.value: watch(copy, copy.value) for copy in CopyTo}
    hosts = {h: HostSeen(HostView(h, 0)) for h in ("host-1", "host-2")}
    keeper.on_round(Round(1, 1.0, hosts, {}, watch=jobs))  # type: ignore[arg-type]
    for t in list(keeper.busy.values()):
        t.join(10)
    assert sorted(started) == ["controller", "peer"]
    started.clear()
    keeper.busy.clear()
    gone = {**hosts, "host-1": HostSeen(HostView("host-1", 0, error="no answer"))}
    keeper.on_round(Round(2, 2.0, gone, {}, watch=jobs))  # type: ignore[arg-type]
    assert started == [] and not any(isinstance(t, threading.Thread) for t in keeper.busy.values())
