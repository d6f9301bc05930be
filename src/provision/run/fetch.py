"""`provision fetch`: the chief's output directory (`outputs:`) back to the controller, only
what changed.

Two round trips to the task's host: a listing (`find`: path, size, modification time of
every file under the directory), then one tar of the files whose size or time differ from
the local copy. What the host sends is not trusted: the stream is checked as it
arrives (rules/fetchtar.py: regular files of the listing at their announced sizes, bytes
bounded by the listing) and unpacked into a private directory inside the destination, never
all in memory (a model may be gigabytes) and never through a link; only when the whole
stream is in are the files moved into place, so a refused member leaves nothing of that
fetch behind. Times are kept, so the next fetch finds the files unchanged.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from provision.core.errors import ProvisionError
from provision.core.target import Target
from provision.core.text import duration
from provision.host import outdirs
from provision.io.ssh import Result
from provision.rules.fetchtar import (
    RESERVED,
    End,
    Event,
    Member,
    Refused,
    Remote,
    TarStream,
    listing_problem,
    parse_listing,
    shown,
)
from provision.run.context import Context, Progress

__all__ = ["Remote", "changed", "fetch", "parse_listing", "transfer"]

LISTING_MAX = 64 << 20  # bytes of a host's listing (about 800,000 files)
STDERR_SHOWN = 400  # characters of tar's complaint in a message


class Downloader(Protocol):
    """What fetch needs of io/ssh.py's Session (tests give a stand-in)."""

    def download(
        self, target: Target, command: str, sink: Callable[[bytes], None], *, stdin: bytes = b"", timeout: float = 600
    ) -> Result: ...


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


def _local(path: Path, e: OSError) -> ProvisionError:
    """An error on the controller's side: one line, exit 1 (never "host unreachable")."""
    return ProvisionError(f"{path}: {e.strerror or e}")


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
    with claimed(dest):
        remote = listing(ctx.session, target, base, where)
        todo = changed(remote, dest)
        total = sum(r.size for r in todo)
        progress(f"{where}: {len(todo)} of {len(remote)} file{'s' if len(remote) != 1 else ''} changed ({_mb(total)})")
        if todo:
            transfer(ctx.session, target, base, where, todo, dest, progress)
    return len(todo), len(remote)


def listing(session: Downloader, target: Target, base: str, where: str) -> list[Remote]:
    """The host's files under base (read with a bound: a listing is data from the host)."""
    # In the directory read_prefix checked (host/outdirs.py): every component root's, no link.
    cmd = "sh -c " + shlex.quote(f"{outdirs.read_prefix(base)}find . -xdev -type f -printf '%P\\0%s\\0%T@\\0'")
    chunks: list[bytes] = []
    got = 0

    def sink(chunk: bytes) -> None:
        nonlocal got
        got += len(chunk)
        if got > LISTING_MAX:
            raise ProvisionError(f"{where}: its listing is over {LISTING_MAX >> 20} MiB: refused")
        chunks.append(chunk)

    res = session.download(target, cmd, sink, timeout=300)
    if res.exit_status != 0:
        raise ProvisionError(f"{where}: cannot list it: {_one_line(res.stderr)}")
    remote = parse_listing(b"".join(chunks))
    problem = listing_problem(remote)
    if problem is not None:
        raise ProvisionError(f"{where}: {problem} (in its listing): nothing fetched")
    return remote


def _one_line(err: bytes) -> str:
    text = "; ".join(ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip())
    return shown(text) if len(text) <= STDERR_SHOWN else shown(text[: STDERR_SHOWN - 3]) + "..."


@contextmanager
def claimed(dest: Path) -> Iterator[None]:
    """dest made if missing and held for this fetch (a lock on the directory itself); what
    a fetch killed earlier left there (.provision-fetch-*) removed."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileExistsError, NotADirectoryError):
        raise ProvisionError(f"{dest}: not a directory (-o names where the files go)") from None
    except OSError as e:
        raise _local(dest, e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ProvisionError(f"{dest}: another provision fetch is writing into it: wait for it to end") from None
        _clear(dest)
        yield
    finally:
        os.close(fd)


def _clear(dest: Path) -> None:
    """Remove what a killed fetch left: its work directory (or an earlier version's partial
    .provision-fetch-*.tar). Never followed: a link is removed as a link."""
    try:
        names = [n for n in os.listdir(dest) if n.startswith(RESERVED)]
    except OSError as e:
        raise _local(dest, e) from None
    for name in names:
        path = dest / name
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ProvisionError(f"{path}: cannot remove what an earlier fetch left: {e.strerror or e}") from None


# The host's side of a background copy: the lowest CPU and I/O priority (ionice where the
# host has it), so the copy never slows the training.
LOW = "nice -n 19 $(command -v ionice >/dev/null 2>&1 && echo ionice -c 3) "


def transfer(
    session: Downloader,
    target: Target,
    base: str,
    where: str,
    todo: list[Remote],
    dest: Path,
    progress: Progress,
    *,
    rate: int | None = None,
) -> None:
    """One tar of `todo`, checked as it arrives and unpacked into a private directory in
    dest (claimed), then moved into place once all of it is in. `rate`: a background copy's
    (run/checkpoints.py): bytes a second, read no faster (SSH's window holds tar back)."""
    announced = {r.path: r.size for r in todo}
    total = sum(announced.values())
    _check_room(dest, announced, where)
    stream = TarStream(announced)
    try:
        work = Path(tempfile.mkdtemp(prefix=RESERVED, dir=dest))
    except OSError as e:
        raise _local(dest, e) from None
    writer = _Writer(work, dest)
    try:
        began = last = time.monotonic()

        def sink(chunk: bytes) -> None:
            nonlocal last
            try:
                events = stream.feed(chunk)
            except Refused as e:
                raise ProvisionError(f"{where}: {e}: nothing fetched") from None
            writer.take(events)
            if rate:
                time.sleep(max(0.0, stream.got / rate - (time.monotonic() - began)))
            if time.monotonic() - last >= 2:
                last = time.monotonic()
                progress(f"{where}: {_mb(stream.got)} of about {_mb(total)}")

        names = b"\0".join(r.path.encode("utf-8", "surrogateescape") for r in todo) + b"\0"
        res = session.download(target, _tar_command(base, rate), sink, stdin=names)
        if res.exit_status != 0:
            raise ProvisionError(f"{where}: tar exited {res.exit_status}: {_one_line(res.stderr)}: nothing fetched")
        try:
            stream.close()
        except Refused as e:
            raise ProvisionError(f"{where}: {e}: nothing fetched") from None
        writer.close()
        _check_room(dest, announced, where)
        _place(work, dest, announced)
        progress(
            f"{where}: fetched {len(todo)} file{'s' if len(todo) != 1 else ''} ({_mb(stream.got)}) in "
            f"{duration(int(time.monotonic() - began)) or '0s'}"
        )
    finally:
        writer.close()
        shutil.rmtree(work, ignore_errors=True)


def _tar_command(base: str, rate: int | None) -> str:
    """tar of the names on stdin, in the directory read_prefix checked (host/outdirs.py):
    never through a link to root's files; a background copy's at the lowest priority."""
    tar = (LOW if rate else "") + "tar --format=gnu --null -T - -cf -"
    return "sh -c " + shlex.quote(outdirs.read_prefix(base) + "exec " + tar)


class _Writer:
    """The stream's files written below a fresh private directory (only this fetch writes
    there): directories made as it goes, each file created anew, never through a link."""

    def __init__(self, root: Path, dest: Path):
        self.root = root
        self.dest = dest  # for messages: where the file is going
        self._fd = -1
        self._member: Member | None = None
        self._dirs: set[str] = set()

    def take(self, events: Iterable[Event]) -> None:
        for ev in events:
            try:
                if isinstance(ev, Member):
                    self._open(ev)
                elif isinstance(ev, End):
                    self._finish(ev.member)
                else:
                    view = ev
                    while view:
                        view = view[os.write(self._fd, view) :]
            except OSError as e:
                name = self._member.name if self._member else ev.member.name if isinstance(ev, End) else ""
                raise _local(self.dest / name, e) from None

    def _open(self, m: Member) -> None:
        self._member = m
        parts = m.name.split("/")
        for i in range(1, len(parts)):
            rel = "/".join(parts[:i])
            if rel in self._dirs:
                continue
            try:
                os.mkdir(self.root / rel, 0o700)
            except FileExistsError:
                pass
            if not stat.S_ISDIR(os.lstat(self.root / rel).st_mode):
                raise ProvisionError(f"{self.dest / rel}: the fetch has a file where {shown(m.name)} needs a directory")
            self._dirs.add(rel)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self.root / m.name, flags, 0o600)

    def _finish(self, m: Member) -> None:
        os.fchmod(self._fd, m.mode)
        os.utime(self._fd, (m.mtime, m.mtime))
        os.close(self._fd)
        self._fd = -1
        self._member = None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _check_room(dest: Path, announced: dict[str, int], where: str) -> None:  # noqa: C901  one branch per thing in the way, each its own words
    """Nothing local in the way of the files: every directory on their way a real one (or
    missing), no directory where a file goes. Checked before the transfer and again before
    the move."""
    seen: dict[str, bool] = {}  # directory below dest -> it exists
    for name in announced:
        parts = name.split("/")
        for i in range(1, len(parts)):
            rel = "/".join(parts[:i])
            if rel in seen:
                if not seen[rel]:
                    break
                continue
            path = dest / rel
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                seen[rel] = False
                break
            except OSError as e:
                raise _local(path, e) from None
            if stat.S_ISLNK(mode):
                raise ProvisionError(
                    f"{path} is a symbolic link: fetch writes only into real directories "
                    f"({where}/{shown(name)} goes below it)"
                )
            if not stat.S_ISDIR(mode):
                raise ProvisionError(
                    f"{path} is a file, where {where} has a directory ({shown(name)} goes below it): "
                    "move it away or fetch into another -o"
                )
            seen[rel] = True
        else:
            path = dest / name
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _local(path, e) from None
            if stat.S_ISDIR(mode):
                raise ProvisionError(f"{path} is a directory, where {where} has a file: move it away")


def _place(work: Path, dest: Path, announced: dict[str, int]) -> None:
    """Move the fetched files from the work directory into dest (the same filesystem: a
    rename each; one that was a link is replaced, never followed)."""
    made: set[str] = set()
    for name in announced:
        parts = name.split("/")
        for i in range(1, len(parts)):
            rel = "/".join(parts[:i])
            if rel in made:
                continue
            path = dest / rel
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            except OSError as e:
                raise _local(path, e) from None
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise ProvisionError(f"{path}: not a directory (it changed during the fetch)")
            made.add(rel)
        try:
            os.replace(work / name, dest / name)
        except OSError as e:
            raise _local(dest / name, e) from None
