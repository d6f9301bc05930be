"""What an inventory's `files:` entry pushes: one walk, used by validate and by render.

The rules live here once:

* `normalize_dest` turns a `dest:` into the absolute path provision writes: `//`, `/./`
  and `..` are resolved lexically (as the host would read the path), a trailing `/` is
  dropped; a path that climbs above `/` is refused. Checks (reserved directories,
  duplicates) are made on the normalised path only.
* `walk_spec` lists the files of one entry as `PushedFile(src, dest, mode, ...)`:

  - `src` itself may be a symbolic link to anywhere: it is the file or directory the user
    named, and it is resolved once (`FileSpec.src` is the resolved path).
  - Inside a pushed directory, a symbolic link must point into that directory (the
    resolved `src`). A link to a file is pushed as that file's content, with the target's
    mode; a link to a directory is walked like a directory. A link to a directory that
    contains the link (`x -> .`, `x -> ..` inside the tree) would repeat forever and is a
    problem, as are a link out of the tree, a dangling link, a link loop (`a -> b -> a`),
    a FIFO, socket or device, and anything that cannot be read.
  - Names in `SKIP_NAMES` (files, directories or links) and `*.pyc` files (or links so
    named) are left out, never followed.
  - `mode` is the source's permission bits, never widened: set-uid, set-gid and sticky
    bits are dropped and so is group and other write (`pushed_mode`). 0600 stays 0600,
    0755 stays 0755, 0664 becomes 0644.

A walk returns every problem it finds (`Problem`), each naming the path at fault, so that
`provision validate` reports them all; render refuses the first one (the tree changed
after validation).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

SKIP_NAMES = frozenset({"__pycache__", ".git", ".DS_Store"})
SKIPPED_SUFFIX = ".pyc"  # compiled Python: rebuilt on the host


@dataclass(frozen=True)
class PushedFile:
    src: Path  # the file whose content is pushed (links resolved)
    dest: str  # normalised absolute path on the host
    mode: int  # permission bits for the host (see pushed_mode)
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Problem:
    path: Path  # the link or file at fault, as found in the tree
    message: str  # a whole sentence naming `path`, without a trailing period


def pushed_mode(st_mode: int) -> int:
    """The mode a pushed file gets: its own permission bits, without set-id/sticky bits
    and without group/other write (a pushed file is never more open than its source)."""
    return stat.S_IMODE(st_mode) & 0o777 & ~0o022


def normalize_dest(dest: str) -> str | None:
    """`dest` as an absolute path without `//`, `.`, `..` or a trailing `/`.

    None when it climbs above `/` with `..` (a path the user cannot have meant). `dest`
    must start with `/`."""
    parts: list[str] = []
    for part in dest.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)


def into_directory(dest: str) -> bool:
    """True when `dest` names a directory to put a file into: it ends with `/` (or `/.`,
    `/..`), as with cp."""
    return dest.rsplit("/", 1)[-1] in ("", ".", "..")


def _kind(st_mode: int) -> str:
    if stat.S_ISFIFO(st_mode):
        return "a FIFO"
    if stat.S_ISSOCK(st_mode):
        return "a socket"
    if stat.S_ISCHR(st_mode) or stat.S_ISBLK(st_mode):
        return "a device"
    return "not a regular file"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _file(real: str, shown: Path, dest: str, st: os.stat_result, problems: list[Problem]) -> PushedFile | None:
    if not os.access(real, os.R_OK):
        problems.append(Problem(shown, f"cannot read {shown}: permission denied"))
        return None
    return PushedFile(Path(real), dest, pushed_mode(st.st_mode), st.st_size, st.st_mtime_ns)


def _follow(path: Path, problems: list[Problem]) -> tuple[str, os.stat_result] | None:
    """The resolved target of the link `path` and its stat, or None (problem recorded)."""
    try:
        target = os.readlink(path)
    except OSError as e:
        problems.append(Problem(path, f"cannot read the symbolic link {path}: {e.strerror}"))
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        problems.append(Problem(path, f"{path} is a symbolic link to {target}, which does not exist"))
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            problems.append(Problem(path, f"{path} is a symbolic link that loops ({target}, too many levels of links)"))
        else:
            problems.append(Problem(path, f"cannot follow the symbolic link {path}: {e.strerror}"))
        return None
    return os.path.realpath(path), st


def _one_file(src: Path, dest: str, problems: list[Problem]) -> list[PushedFile]:
    """A `files:` entry whose source is one file."""
    try:
        st = os.stat(src)
    except OSError as e:
        problems.append(Problem(src, f"cannot read {src}: {e.strerror}"))
        return []
    if not stat.S_ISREG(st.st_mode):
        problems.append(Problem(src, f"{src} is {_kind(st.st_mode)}, not a regular file or directory"))
        return []
    one = _file(os.path.realpath(src), src, dest, st, problems)
    return [one] if one else []


def _entry(
    entry: os.DirEntry[str], real: str, shown: Path, root: str, problems: list[Problem]
) -> tuple[str, os.stat_result] | None:
    """A directory entry's real path and stat, a link followed (inside the pushed
    directory only); None for what is skipped or a problem (recorded)."""
    try:
        is_link = entry.is_symlink()
        st = os.lstat(real)
    except OSError as e:
        problems.append(Problem(shown, f"cannot read {shown}: {e.strerror}"))
        return None
    if is_link and entry.name.endswith(SKIPPED_SUFFIX):
        return None  # as a *.pyc file would be, without following it
    if not is_link:
        return real, st
    followed = _follow(Path(real), problems)
    if followed is None:
        return None
    real, st = followed
    if not _inside(real, root):
        problems.append(Problem(shown, f"{shown} is a symbolic link to {real}, outside the pushed directory {root}"))
        return None
    return real, st


def walk_spec(src: Path, dest: str, is_dir: bool) -> tuple[list[PushedFile], list[Problem]]:  # noqa: C901  a directory walk with every rule of what may be pushed (links, loops, types)
    """Every file one `files:` entry pushes, sorted by destination, and every problem.

    `src` is the entry's resolved source, `dest` its normalised destination (the file's
    path for a file, the directory to fill for a directory)."""
    problems: list[Problem] = []
    if not is_dir:
        return _one_file(src, dest, problems), problems

    root = os.path.realpath(src)
    out: list[PushedFile] = []
    # (real directory, the path it was reached by, its destination, real directories above it and itself)
    stack: list[tuple[str, Path, str, frozenset[str]]] = [(root, src, dest.rstrip("/"), frozenset({root}))]
    while stack:
        real_dir, shown_dir, dest_dir, above = stack.pop()
        try:
            with os.scandir(real_dir) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            problems.append(Problem(shown_dir, f"cannot read the directory {shown_dir}: {e.strerror}"))
            continue
        subdirs: list[tuple[str, Path, str, frozenset[str]]] = []
        for entry in entries:
            name = entry.name
            if name in SKIP_NAMES:
                continue
            shown = shown_dir / name
            found = _entry(entry, os.path.join(real_dir, name), shown, root, problems)
            if found is None:
                continue
            real, st = found
            if stat.S_ISDIR(st.st_mode):
                if real in above:
                    problems.append(
                        Problem(shown, f"{shown} is a symbolic link to {real}, a directory that contains it (a loop)")
                    )
                    continue
                subdirs.append((real, shown, f"{dest_dir}/{name}", above | {real}))
            elif stat.S_ISREG(st.st_mode):
                if name.endswith(SKIPPED_SUFFIX):
                    continue
                f = _file(real, shown, f"{dest_dir}/{name}", st, problems)
                if f is not None:
                    out.append(f)
            else:
                problems.append(Problem(shown, f"{shown} is {_kind(st.st_mode)}, not a regular file or directory"))
        stack.extend(reversed(subdirs))
    out.sort(key=lambda f: f.dest)
    return out, problems
