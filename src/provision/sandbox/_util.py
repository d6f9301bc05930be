"""Small helpers shared by the sandbox modules."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from ._paths import locks_dir

Progress = Callable[[str], None]


def no_progress(_msg: str) -> None:
    pass


@contextlib.contextmanager
def file_lock(name: str, on_wait: Progress | None = None, wait_msg: str = "") -> Iterator[None]:
    """Inter-process lock (flock): parallel test workers and CLI runs share one image and
    one framework cache, and must not build the same thing twice at once."""
    locks_dir().mkdir(parents=True, exist_ok=True)
    path = locks_dir() / f"{name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait and wait_msg:
                on_wait(wait_msg)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tail(path: Path, lines: int = 5) -> str:
    """The last lines of a log file, joined with ' | ' so an error stays one line."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())


def write_private(path: Path, data: str | bytes, mode: int = 0o600) -> None:
    """Write a file that only its owner may read (keys), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def raise_sysctls(root: Path, name: str, limits: dict[str, int], why: str, progress: Progress) -> None:
    """Raise the kernel settings under root (/proc/sys/NAME as a path) to at least `limits`,
    never lowering one; say what was raised, or how to raise it when not root. `why`: for
    what, e.g. "40 systemd hosts"."""
    for key, want in limits.items():
        path = root / key
        try:
            current = int(path.read_text())
        except (OSError, ValueError):
            continue
        if current >= want:
            continue
        try:
            path.write_text(str(want))
            progress(f"raised {name}.{key} from {current} to {want} for {why}")
        except OSError:
            progress(
                f"warning: {name}.{key}={current} is low for {why}, and could not be raised (needs root): "
                f"`sysctl -w {name}.{key}={want}`"
            )
