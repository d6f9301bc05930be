"""Validation of the inventory's `files:` entries: sources that exist and can be read,
destinations that are absolute, outside provision's own directories, and not written twice
(a file where another entry writes a directory)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from provision.core.model import (
    FileSpec,
)
from provision.host.layout import RESERVED_DIRS
from provision.inventory.pushed import into_directory, normalize_dest, walk_spec
from provision.inventory.yamldoc import Checker, KeyPath, show_value


def reserved_dir(dest: str) -> str | None:
    """The reserved directory `dest` (normalised) is in or is, if any."""
    return next((d for d in RESERVED_DIRS if dest == d or dest.startswith(d + "/")), None)


MAX_TREE_PROBLEMS = 10  # per files: entry; the rest are counted


def check_files(c: Checker, value: Any, base_dir: Path, *, here: bool = True) -> list[FileSpec]:  # noqa: C901  every rule of a files: entry, in the order a user fixes them
    """`files:` entries. Destinations are normalised (`//`, `/./`, `..`, a trailing `/`)
    before any check; a directory's tree is walked (pushed.walk_spec, as render walks it)
    so that links out of it, dangling links and loops are reported here, not at apply.

    `here` False: a command that pushes nothing (status, logs, cancel, ...) reads the job
    without its sources: one that is missing or unreadable is left out, not a problem."""

    path: KeyPath = ("files",)
    if value is None:
        return []
    if not isinstance(value, list):
        c.add(path, f"expected a list of {{src, dest}} entries, got {show_value(value)}")
        return []
    out: list[FileSpec] = []
    owners: dict[str, int] = {}  # destination file -> the entry that writes it
    parents: dict[str, int] = {}  # directory a destination file needs -> the entry
    for i, raw in enumerate(value):
        fp = path + (i,)
        m = c.mapping(raw, fp)
        if m is None:
            continue
        c.keys(m, fp, ("src", "dest", "replace"), required=("src", "dest"))
        replace = m.get("replace", False)
        if not isinstance(replace, bool):
            c.add(fp + ("replace",), f"expected true or false, got {show_value(replace)}")
        src = c.string(m.get("src"), fp + ("src",)) if "src" in m else None
        dest = c.string(m.get("dest"), fp + ("dest",)) if "dest" in m else None
        # The src itself may be a link to anywhere (the user named that file); only links
        # found inside a pushed directory must stay inside it.
        src_path: Path | None = None
        is_dir = False
        if src is not None:
            given = base_dir / os.path.expanduser(src)
            try:
                src_path = given.resolve()
                os.stat(src_path)
                is_dir = src_path.is_dir()
            except FileNotFoundError:
                if here:
                    c.add(fp + ("src",), f"no such file or directory: {src_path or given}")
                src_path = None
            except (OSError, RuntimeError) as e:  # RuntimeError: a link loop, from resolve()
                reason = getattr(e, "strerror", None) or "too many levels of symbolic links"
                if here:
                    c.add(fp + ("src",), f"cannot read {given}: {reason}")
                src_path = None
        norm: str | None = None
        if dest is not None:
            if not dest.startswith("/") or "\n" in dest:
                c.add(fp + ("dest",), f"expected an absolute path on the host, got {show_value(dest)}")
            elif (norm := normalize_dest(dest)) is None:
                c.add(fp + ("dest",), f"climbs above / with '..', got {show_value(dest)}")
            elif norm == "/":
                c.add(fp + ("dest",), f"is the root directory /; name a directory below it, got {show_value(dest)}")
                norm = None
            elif src_path is not None and not is_dir and into_directory(dest):
                # `dest: /opt/job/` for a file: into that directory, under the file's name.
                norm = f"{norm}/{os.path.basename(os.path.normpath(base_dir / os.path.expanduser(src or '')))}"
            if norm is not None and reserved_dir(norm) is not None:
                shown = "" if dest == norm else f", got {show_value(dest)}"
                c.add(fp + ("dest",), f"{norm} is reserved for provision's own files{shown}")
                norm = None
        if src_path is None or norm is None:
            continue
        # A directory pushed above a reserved one (dest: /etc) must not reach into it.
        hits = [d for d in RESERVED_DIRS if d.startswith(norm + "/") and (src_path / os.path.relpath(d, norm)).exists()]
        if is_dir and hits:
            c.add(
                fp + ("src",),
                f"{src_path / os.path.relpath(hits[0], norm)} would be pushed into {hits[0]}, which is reserved for provision's own files",
            )
            continue
        entries, problems = walk_spec(src_path, norm, is_dir)
        for problem in problems[:MAX_TREE_PROBLEMS] if here else []:
            c.add(fp + ("src",), problem.message)
        if len(problems) > MAX_TREE_PROBLEMS and here:
            c.add(fp + ("src",), f"{len(problems) - MAX_TREE_PROBLEMS} more problems like these in {src_path}")
        if problems:
            continue
        # Two entries may not write the same file, nor one a file where another needs a directory.
        clashes: dict[int, tuple[str, int]] = {}  # other entry -> (first message, count)
        for pf in entries:
            found: list[tuple[int, str]] = []
            if pf.dest in owners:
                found.append(
                    (
                        owners[pf.dest],
                        f"{pf.dest} is also written by files[{owners[pf.dest]}]; a file on the host has one source",
                    )
                )
            elif pf.dest in parents:
                found.append(
                    (
                        parents[pf.dest],
                        f"{pf.dest} is a directory that files[{parents[pf.dest]}] writes into; it cannot also be a file",
                    )
                )
            found += [
                (owners[a], f"{pf.dest} needs {a} to be a directory, but files[{owners[a]}] writes a file there")
                for a in ancestors(pf.dest)
                if a in owners
            ]
            for j, message in found:
                first, count = clashes.get(j, (message, 0))
                clashes[j] = (first, count + 1)
        for j, (message, count) in sorted(clashes.items()):
            more = (
                f" ({count - 1} more {'file clashes' if count == 2 else 'files clash'} with files[{j}])"
                if count > 1
                else ""
            )
            c.add(fp + ("dest",), message + more)
        if clashes:
            continue
        for pf in entries:
            owners[pf.dest] = i
            for a in ancestors(pf.dest):
                parents.setdefault(a, i)
        out.append(FileSpec(src_path, norm, is_dir, replace is True))
    return out


def ancestors(dest: str) -> list[str]:
    """/a/b/c -> [/a/b, /a] (not /)."""
    out: list[str] = []
    while dest := dest.rsplit("/", 1)[0]:
        out.append(dest)
    return out
