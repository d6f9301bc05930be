"""`provision fetch`: the chief's output directory (`outputs:`) back to the controller, only
what changed.

Two round trips to the task's host: a listing (`find`: path, size, modification time of
every file under the directory), then one tar of the files whose size or time differ from
the local copy, read as it arrives into a temporary file beside the destination (never
all in memory: a model may be gigabytes) and unpacked with tarfile's "data" filter, which
refuses absolute paths, `..` and links leading out of the destination. Times are kept, so
the next fetch finds the files unchanged.
"""

from __future__ import annotations

import os
import shlex
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from provision.core.errors import ProvisionError
from provision.core.target import Target
from provision.core.text import duration
from provision.host import outdirs
from provision.io.ssh import Result
from provision.run.context import Context, Progress


@dataclass(frozen=True)
class Remote:
    path: str  # relative to the output directory
    size: int
    mtime: int


def parse_listing(out: bytes) -> list[Remote]:
    """`find -printf '%P\\0%s\\0%T@\\0'` output as Remotes (a file whose name holds a
    newline or anything else survives: NUL separates)."""
    words = out.split(b"\0")
    got = []
    for i in range(0, len(words) - 2, 3):
        name, size, mtime = words[i : i + 3]
        try:
            got.append(Remote(name.decode("utf-8", "surrogateescape"), int(size), int(float(mtime))))
        except ValueError:
            continue
    return got


def changed(remote: list[Remote], dest: Path) -> list[Remote]:
    """The remote files the local copy lacks or holds with another size or time."""
    out = []
    for r in remote:
        try:
            st = (dest / r.path).stat()
        except OSError:
            out.append(r)
            continue
        if st.st_size != r.size or int(st.st_mtime) != r.mtime:
            out.append(r)
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def fetch(
    ctx: Context, task_name: str | None, dest: Path, progress: Progress, *, ran_on: dict[str, str] | None = None
) -> tuple[int, int]:
    """Copy the task's output directory (default: the chief, else worker 0) into dest;
    returns (files fetched, files there). ran_on: task -> the host it ran on, when that is
    known better than placement says (a study's trial, removed since)."""
    inv = ctx.inventory
    if inv.outputs is None:
        raise ProvisionError(f"job {inv.job} has no `outputs:` directory: nothing to fetch (inventory key `outputs`)")
    tasks = ctx.rendered.placement.tasks
    ranked = [t for t in tasks if t.role == "chief"] or [t for t in tasks if t.name == "worker-0"]
    task = next((t for t in tasks if t.name == task_name), None) if task_name else next(iter(ranked), None)
    if task is None:
        raise ProvisionError(f"no task named {task_name} in job {inv.job}" if task_name else "the job has no chief")
    host = (ran_on or {}).get(task.name, task.host.name)
    target = ctx.all_targets.get(host) or ctx.targets[host]
    base = inv.outputs
    where = f"{task.name}@{host}:{base}"
    listing = ctx.session.run(
        target,
        "sh -c " + shlex.quote(f"{outdirs.read_prefix(base)}find . -xdev -type f -printf '%P\\0%s\\0%T@\\0'"),
        timeout=300,
    )
    if listing.exit_status != 0:
        raise ProvisionError(f"{where}: cannot list it: {listing.stderr.decode(errors='replace').strip()}")
    remote = parse_listing(listing.stdout)
    todo = changed(remote, dest)
    total = sum(r.size for r in todo)
    progress(f"{where}: {len(todo)} of {len(remote)} file{'s' if len(remote) != 1 else ''} changed ({_mb(total)})")
    if not todo:
        return 0, len(remote)
    _transfer(ctx, target, base, where, todo, dest, progress)
    return len(todo), len(remote)


def _transfer(
    ctx: Context, target: Target, base: str, where: str, todo: list[Remote], dest: Path, progress: Progress
) -> None:
    """One tar of `todo`, streamed into a file beside dest, then unpacked (data filter)."""
    total = sum(r.size for r in todo)
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".provision-fetch-", suffix=".tar", dir=dest)
    tmp = Path(tmp_name)
    try:
        got = [0]
        began = last = time.monotonic()

        def sink(chunk: bytes) -> None:
            nonlocal last
            os.write(fd, chunk)
            got[0] += len(chunk)
            if time.monotonic() - last >= 2:
                last = time.monotonic()
                progress(f"{where}: {_mb(got[0])} of about {_mb(total)}")

        names = b"\0".join(r.path.encode("utf-8", "surrogateescape") for r in todo) + b"\0"
        # In the directory read_prefix checked (host/outdirs.py): never through a link to root's files.
        cmd = "sh -c " + shlex.quote(outdirs.read_prefix(base) + "exec tar --null -T - -cf -")
        res: Result = ctx.session.download(target, cmd, sink, stdin=names)
        os.close(fd)
        fd = -1
        if res.exit_status != 0:
            raise ProvisionError(
                f"{where}: tar exited {res.exit_status}: {res.stderr.decode(errors='replace').strip()}"
            )
        with tarfile.open(tmp) as tar:
            tar.extractall(dest, filter="data")
        progress(
            f"{where}: fetched {len(todo)} file{'s' if len(todo) != 1 else ''} ({_mb(got[0])}) in "
            f"{duration(int(time.monotonic() - began)) or '0s'}"
        )
    finally:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
