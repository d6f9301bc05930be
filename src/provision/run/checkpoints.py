"""The checkpoint that outlives its host, done (rules/checkpoints.py decides): the newest
complete checkpoint of the saving rank's AIP_CHECKPOINT_DIR copied to the controller,
beside the inventory (`.provision/checkpoints/JOB/`), and put back into the saving rank's
new host's AIP_CHECKPOINT_DIR before a recovery starts it there.

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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from provision.core.errors import ProvisionError
from provision.core.recovery import CheckpointSpec
from provision.core.target import HostError, Target
from provision.host import outdirs
from provision.rules.checkpoints import Act, CopyRecord, copying, newest, record_of, restore_to, saving_task, verdict
from provision.rules.progress import checkpoint_dir
from provision.run.context import Context
from provision.run.fetch import Downloader, claimed, listing, transfer

RECORD = "copy.json"
Say = Callable[[str], None]


def copy_dir(inventory_path: str | Path, job: str) -> Path:
    """Where the controller keeps a job's copy: beside its inventory, as its local state."""
    return Path(inventory_path).resolve().parent / ".provision" / "checkpoints" / job


def read_record(d: Path) -> CopyRecord:
    try:
        with open(d / RECORD, encoding="utf-8", errors="replace") as f:
            rec = record_of(f.read(1 << 16))
    except OSError:
        return CopyRecord()
    return rec if not rec.has_copy or (d / rec.dir).is_dir() else CopyRecord()


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
    session: Downloader, target: Target, ckdir: str, spec: CheckpointSpec, d: Path, say: Say, now: float
) -> CopyRecord:
    """One look at the saving host's checkpoint directory, and its newest complete
    checkpoint copied when it is not the copy already (or said when it is too large).
    The record as it is afterwards."""
    with _held(d):
        rec = read_record(d)
        _clean(d, rec.dir)
        where = f"{target.name}:{ckdir}"
        chosen = newest(listing(session, target, ckdir, where))
        v = verdict(spec, rec, chosen, target.name)
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
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise
            rec = CopyRecord(
                new, chosen.name, chosen.step, chosen.size, chosen.mtime, target.name, time.time(), "", now
            )
            say(f"checkpoint copy: {v.words} kept on the controller")
        write_record(d, rec)
        _clean(d, rec.dir)
        return rec


def copy_job(ctx: Context, tasks: dict[str, str], say: Say, now: float) -> CopyRecord | None:
    """The job's copy brought up to date from its saving rank's host (None: not copied)."""
    spec, ckdir = copying(ctx.inventory), checkpoint_dir(ctx.inventory)
    task = saving_task(tasks)
    if spec is None or ckdir is None or task is None:
        return None
    target = ctx.targets.get(tasks[task])
    if target is None:
        return None
    d = copy_dir(ctx.inventory.path, ctx.inventory.job)
    d.mkdir(parents=True, exist_ok=True)
    return copy_newest(ctx.session, target, ckdir, spec, d, say, now)


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


# The host's side of putting it back: unpacked into a hidden directory inside the
# checkpoint directory (the trainer never takes a hidden name), then renamed into place:
# the checkpoint appears whole or not at all. In the directory read_prefix checked.
PUT_SH = (
    'w=.provision-restore-$$; rm -rf -- "$w"; mkdir -m 0700 -- "$w" && '
    'tar -xf - -C "$w" --no-same-owner --no-same-permissions && '
    'for e in "$w"/* "$w"/.[!.]*; do [ -e "$e" ] || continue; '
    'rm -rf -- "./${e##*/}"; mv -f -- "$e" .; done; rm -rf -- "$w"'
)


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
    target = ctx.targets[host]
    data = tar_of(d / rec.dir)
    make = "sh -c '" + outdirs.GUARD_SH + "' provision-outputs 1 " + ckdir + " || exit 1; "
    cmd = "sh -c " + shlex.quote(make + outdirs.read_prefix(ckdir) + PUT_SH)
    try:
        res = ctx.session.run(target, cmd, stdin=data, timeout=600)
    except HostError as e:
        say(f"{host}: checkpoint copy not put back: {e.message}")
        return None
    if res.exit_status != 0:
        err = res.stderr.decode(errors="replace").strip().splitlines()
        say(f"{host}: checkpoint copy not put back: {err[0] if err else f'exit {res.exit_status}'}")
        return None
    say(f"{host}: checkpoint copy {rec.name} (step {rec.step}) of {rec.host} put into {ckdir}")
    return host
