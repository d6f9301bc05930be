"""The checkpoint that outlives its host, done (rules/checkpoints.py decides): the newest
complete checkpoint of the saving rank's AIP_CHECKPOINT_DIR copied to the controller,
beside the inventory (`.provision/checkpoints/JOB/`, with its record), or through it to a
peer host of the job (`copy: peer`: layout.checkpoint_copy_dir), and put back into the
saving rank's new host's AIP_CHECKPOINT_DIR before a recovery starts it there.

The copy is `fetch`'s transfer (run/fetch.py): the host's listing and tar stream are
untrusted (regular files of the listing at their sizes, no links, nothing outside,
bytes bounded), read at the copy's bandwidth, the host's tar at the lowest CPU and I/O
priority. Each copy is written into a directory of its own (`c-...`) and only then named
by the record file (`copy.json`, replaced at once): a copy interrupted (the host lost, the
service killed) leaves the record naming the previous complete copy; what it left is
removed by the next copy.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shlex
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from provision.core.errors import ProvisionError
from provision.core.recovery import CheckpointSpec
from provision.core.target import HostError, Target
from provision.host import layout, outdirs
from provision.io.ssh import Result
from provision.rules.checkpoints import (
    Act,
    CopyRecord,
    copying,
    newest,
    peer_of,
    record_of,
    restore_to,
    saving_task,
    verdict,
)
from provision.rules.progress import checkpoint_dir
from provision.run.context import Context
from provision.run.fetch import Downloader, claimed, listing, transfer

RECORD = "copy.json"
Say = Callable[[str], None]


def copy_dir(inventory_path: str | Path, job: str) -> Path:
    """Where the controller keeps a job's copy: beside its inventory, as its local state."""
    return Path(inventory_path).resolve().parent / ".provision" / "checkpoints" / job


class Copier(Downloader, Protocol):
    """What the copy needs of io/ssh.py's Session (tests give a stand-in)."""

    def run(self, target: Target, command: str, *, stdin: bytes = b"", timeout: float | None = 600) -> Result: ...


def read_record(d: Path) -> CopyRecord:
    try:
        with open(d / RECORD, encoding="utf-8", errors="replace") as f:
            rec = record_of(f.read(1 << 16))
    except OSError:
        return CopyRecord()
    return rec if not rec.has_copy or rec.peer or (d / rec.dir).is_dir() else CopyRecord()


def forget_copy(inventory_path: str | Path, job: str) -> None:
    """The job destroyed: its copy removed (a job of the same name later starts afresh)."""
    shutil.rmtree(copy_dir(inventory_path, job), ignore_errors=True)


def write_record(d: Path, rec: CopyRecord) -> None:
    """The record replaced at once (a write killed half-way leaves the previous one)."""
    tmp = d / f".{RECORD}.{os.getpid()}.tmp"
    tmp.write_text(rec.to_text(), encoding="utf-8")
    os.replace(tmp, d / RECORD)


def _clean(d: Path, keep: str) -> None:
    """The copies the record does not name (the previous one, or one interrupted)."""
    for name in os.listdir(d):
        if name.startswith("c-") and name != keep and not os.path.islink(d / name):
            shutil.rmtree(d / name, ignore_errors=True)


@contextmanager
def _held(d: Path) -> Iterator[None]:
    try:
        with claimed(d):
            yield
    except ProvisionError as e:
        raise ProvisionError(f"checkpoint copy {d}: {e.message}") from None


def copy_newest(
    session: Copier,
    target: Target,
    ckdir: str,
    spec: CheckpointSpec,
    d: Path,
    say: Say,
    now: float,
    peer: tuple[str, Target] | None = None,
) -> CopyRecord:
    """One look at the saving host's checkpoint directory, and its newest complete
    checkpoint copied when it is not the copy already (or said when it is too large):
    into d, or through it to `peer` (its name and where it is). The record afterwards."""
    with _held(d):
        rec = read_record(d)
        _clean(d, "" if rec.peer else rec.dir)
        where = f"{target.name}:{ckdir}"
        chosen = newest(listing(session, target, ckdir, where))
        v = verdict(spec, rec, chosen, target.name, peer[0] if peer else "")
        if v.act is Act.KEEP or chosen is None:
            rec = dataclasses.replace(rec, looked_at=now)
        elif v.act is Act.SKIP:
            if rec.skipped != v.words:
                say(f"checkpoint copy: {v.words}")
            rec = dataclasses.replace(rec, looked_at=now, skipped=v.words)
        else:
            new = f"c-{int(now * 1000):x}"
            dest = d / new
            try:
                dest.mkdir(mode=0o700)
                transfer(session, target, ckdir, where, list(chosen.files), dest, lambda _: None, rate=spec.rate)
                if peer is not None:
                    _keep_on_peer(session, peer[1], rec, new, dest)
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise
            if peer is not None:
                shutil.rmtree(dest, ignore_errors=True)  # the peer keeps it, not this machine
            rec = CopyRecord(
                new, chosen.name, chosen.step, chosen.size, chosen.mtime, target.name, time.time(), "", now,
                peer[0] if peer else "",
            )  # fmt: skip
            say(f"checkpoint copy: {v.words}")
        write_record(d, rec)
        _clean(d, "" if rec.peer else rec.dir)
        return rec


def _keep_on_peer(session: Copier, peer: Target, rec: CopyRecord, new: str, dest: Path) -> None:
    """The copy sent on to the peer (its side: layout.CHECKPOINT_KEEP_SH), the one the
    record names kept there until the record names the new one."""
    job_dir = layout.checkpoint_copy_dir(dest.parent.name)  # d is .provision/checkpoints/JOB
    keep = rec.dir if rec.peer == peer.name else ""
    cmd = (
        "sh -c "
        + shlex.quote(layout.CHECKPOINT_KEEP_SH)
        + " x "
        + " ".join(shlex.quote(a) for a in (job_dir, new, keep or "-"))
    )
    res = session.run(target=peer, command=cmd, stdin=tar_of(dest), timeout=600)
    if res.exit_status != 0:
        raise ProvisionError(f"{peer.name}: the checkpoint copy not kept there: {_first(res.stderr, res.exit_status)}")


def _first(err: bytes, status: int) -> str:
    lines = err.decode(errors="replace").strip().splitlines()
    return lines[0][:300] if lines else f"exit {status}"


def copy_job(ctx: Context, tasks: dict[str, str], say: Say, now: float) -> CopyRecord | None:
    """The job's copy brought up to date from its saving rank's host (None: not copied)."""
    spec, ckdir = copying(ctx.inventory), checkpoint_dir(ctx.inventory)
    task = saving_task(tasks)
    if spec is None or ckdir is None or task is None:
        return None
    target = ctx.targets.get(tasks[task])
    peer = peer_of(spec, tasks)
    if target is None or peer is None or (peer and peer not in ctx.targets):
        return None
    d = copy_dir(ctx.inventory.path, ctx.inventory.job)
    d.mkdir(parents=True, exist_ok=True)
    return copy_newest(ctx.session, target, ckdir, spec, d, say, now, (peer, ctx.targets[peer]) if peer else None)


def tar_of(d: Path) -> bytes:
    """The copy as one tar (our own, checked when it came): regular files only."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for root, dirs, files in os.walk(d, followlinks=False):
            dirs.sort()
            for f in sorted(files):
                p = Path(root) / f
                if p.is_file() and not p.is_symlink():
                    tar.add(p, arcname=str(p.relative_to(d)), recursive=False)
    return buf.getvalue()


def put_back(ctx: Context, tasks: dict[str, str], answering: list[str], say: Say) -> str | None:
    """Before a recovery starts the job: the copy into the saving rank's new host's
    AIP_CHECKPOINT_DIR (made as the task's unit makes it), when it moved. The host, or None."""
    inv = ctx.inventory
    ckdir = checkpoint_dir(inv)
    d = copy_dir(inv.path, inv.job)
    rec = read_record(d)
    host = restore_to(rec, tasks, answering)
    if host is None or ckdir is None:
        return None
    # Without the copy's lock: a copy under way (from a host that died in the middle, maybe
    # until its timeout) writes beside and never touches the complete one the record names.
    try:
        _put(ctx.session, ctx.targets, rec, d, inv.job, ckdir, host)
    except (HostError, ProvisionError) as e:
        say(f"{host}: checkpoint copy not put back: {e.message}")
        return None
    except OSError as e:
        say(f"{host}: checkpoint copy not put back: {d / rec.dir}: {e.strerror or e}")
        return None
    say(f"{host}: checkpoint copy {rec.name} (step {rec.step}) of {rec.host} put into {ckdir}")
    return host


def _put(
    session: Copier, targets: dict[str, Target], rec: CopyRecord, d: Path, job: str, ckdir: str, host: str
) -> None:
    """The copy into `host`'s ckdir: from this machine, from its peer through this machine,
    or on the peer itself when it is the host."""
    make = "sh -c '" + outdirs.GUARD_SH + "' provision-outputs 1 " + ckdir + " || exit 1; "
    src = layout.checkpoint_copy_dir(job) + "/" + rec.dir
    if rec.peer == host:  # on the host already
        cmd = make + outdirs.read_prefix(ckdir) + layout.put_sh(f'cp -R -p -- {shlex.quote(src)}/. "$w"/')
        data = b""
    else:
        data = tar_of(d / rec.dir) if not rec.peer else _from_peer(session, targets, rec, d, src)
        cmd = make + outdirs.read_prefix(ckdir) + layout.put_sh(layout.UNPACK_STDIN)
    res = session.run(targets[host], "sh -c " + shlex.quote(cmd), stdin=data, timeout=600)
    if res.exit_status != 0:
        raise ProvisionError(_first(res.stderr, res.exit_status))


def _from_peer(session: Copier, targets: dict[str, Target], rec: CopyRecord, d: Path, src: str) -> bytes:
    """The peer's copy read back (checked as any host's stream) and made one tar."""
    peer = targets.get(rec.peer)
    if peer is None:
        raise ProvisionError(f"{rec.peer}, which keeps the copy, is not a host of the job")
    work = Path(tempfile.mkdtemp(prefix=".back-", dir=d))  # not a copy's name: no copy removes it
    try:
        where = f"{rec.peer}:{src}"
        files = listing(session, peer, src, where)
        if not files:
            raise ProvisionError(f"{where}: the copy is not there")
        transfer(session, peer, src, where, files, work, lambda _: None)
        return tar_of(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
