"""What is handed over: the inventory and every file it pushes, as they are at submission.

Each file is a content-addressed blob (sha256 -> bytes, stored once however many
submissions use it) and the submission keeps a manifest (path relative to the snapshot's
root -> sha256, mode). The root is the deepest directory holding the inventory and every
pushed file, so the inventory's relative `src:` paths (`../train.py`) read the snapshot
when it is materialised in the service's work directory. The submitter may then edit or
delete their files: the service runs what was submitted.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from provision.core.errors import ProvisionError
from provision.core.model import Inventory
from provision.inventory.pushed import walk_spec
from provision.io.servicestore import ServiceStore, Submission


@dataclass(frozen=True)
class Snapshot:
    root: Path
    inventory: str  # relative to root
    files: dict[str, tuple[Path, int]]  # relative path -> (the file read, mode)


def snapshot_of(inv: Inventory) -> Snapshot:
    """The files to hand over (read nothing yet). A pushed directory is walked as render
    walks it (links inside it are pushed as their content)."""
    inv_path = inv.path.resolve()
    found: dict[Path, tuple[Path, int]] = {inv_path: (inv_path, stat.S_IMODE(inv_path.stat().st_mode))}
    for spec in inv.files:
        pushed, problems = walk_spec(spec.src, spec.dest, spec.is_dir)
        if problems:
            raise ProvisionError(f"{inv.path}: {problems[0]}")
        for f in pushed:
            if spec.is_dir:
                rel = Path(f.dest).relative_to(spec.dest.rstrip("/") or "/")
                found[spec.src / rel] = (f.src, f.mode)
            else:
                found[spec.src] = (f.src, f.mode)
    root = Path(os.path.commonpath([str(p.parent) for p in found]))
    files = {str(p.relative_to(root)): v for p, v in found.items()}
    return Snapshot(root, str(inv_path.relative_to(root)), files)


CHUNK = 8 << 20  # bytes of a blob's piece: a pushed file is read, stored and written a piece at a time


def _pieces(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while piece := f.read(CHUNK):
            yield piece


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    for piece in _pieces(path):
        h.update(piece)
    return h.hexdigest()


def store_files(store: ServiceStore, snap: Snapshot) -> dict[str, tuple[str, int]]:
    """Every file into the store as a blob (once, in pieces: a 700 MiB file is never whole
    in memory); the manifest."""
    manifest: dict[str, tuple[str, int]] = {}
    for rel, (path, mode) in sorted(snap.files.items()):
        try:
            sha = _sha(path)
            store.put_blob_parts(sha, _pieces(path))
        except OSError as e:
            raise ProvisionError(f"{path}: cannot read: {e.strerror}") from None
        manifest[rel] = (sha, mode)
    return manifest


def materialise(store: ServiceStore, manifest: dict[str, tuple[str, int]], dest: Path) -> None:
    """The snapshot's files under dest (0700), each with its mode, written a piece at a time;
    files already there with the right content are left as they are (a restart
    materialises again)."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(dest, 0o700)
    for rel, (sha, mode) in manifest.items():
        target = dest / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ProvisionError(f"the submission's manifest names {rel!r}: outside its directory")
        if target.is_file() and not target.is_symlink() and _sha(target) == sha:
            continue
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = target.with_name(f".{target.name}.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as out:
            for piece in store.blob_parts(sha):
                out.write(piece)
        os.chmod(tmp, mode & 0o777)
        os.replace(tmp, target)


def prepare(store: ServiceStore, sub: Submission, workdir: Path) -> Path:
    """The snapshot in the work directory; with a local state, `.provision` beside the
    inventory is the submitter's (its state, its study, its trials' logs), so that their
    `provision status/tune/logs` see this work as their own."""
    materialise(store, sub.manifest, workdir)
    where = workdir / sub.inventory
    if sub.backend == "local" and sub.state_path:
        link = where.parent / ".provision"
        target = Path(sub.state_path).parent
        target.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and Path(os.readlink(link)) != target:
            link.unlink()
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target, target_is_directory=True)
    return where
