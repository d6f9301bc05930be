"""The checkpoint that outlives its host (docs/recovery.md): what of a job's
AIP_CHECKPOINT_DIR is copied off the host that saves it, when, and where it goes back.

Pure: the decisions. run/checkpoints.py lists, copies and puts back; serve/checkpoints.py
asks every round; run/recover.py puts the copy on the saving rank's new host.

- **Complete** is what the trainer renamed into place: an entry of the directory whose name
  is not hidden (`.ckpt-40.tmp`) nor a temporary one (`*.tmp`, `*.part`, `*.partial`, `*~`).
  An entry is a file, or a directory of files (a sharded checkpoint): its time is its newest
  file's.
- **Newest only**: the newest complete entry (by its time, then its name), as the saving
  rank's host lists it. Only when it is not the one copied already.
- **Bounded**: an entry over `checkpoint.max_size` is not copied, and said so once.
- **Where**: on the controller, or (`copy: peer`) on another host of the job, through the
  controller (it reads the host's stream, checked, and sends it on).
- **Where it goes back**: the saving rank (chief-0, else worker-0) placed on a host other
  than the one the copy came from gets it into its AIP_CHECKPOINT_DIR before it starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, TypedDict

from provision.core.model import Inventory
from provision.core.recovery import CheckpointSpec, CopyTo
from provision.rules.fetchtar import Remote

TEMPORARY = (".tmp", ".part", ".partial", "~")
LOOK_EVERY_S = 60.0  # a look at the directory at least this often while its time is not watched
STEP = re.compile(r"(\d+)(?!.*\d)")
SAME_S = 5  # seconds between the file's time and its directory's that are the same save
RECORD_MAX = 64 << 10  # bytes of the record file believed


@dataclass(frozen=True)
class Chosen:
    """The newest complete checkpoint of a listing: its entry's name, its files (relative
    to AIP_CHECKPOINT_DIR), their bytes, its time (the host's clock) and its step."""

    name: str
    files: tuple[Remote, ...]
    size: int
    mtime: int
    step: int | None


def complete(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(TEMPORARY) and bool(name)


def step_of(name: str) -> int | None:
    """The step a checkpoint's name carries (`ckpt-120.pt`: 120; its last number)."""
    m = STEP.search(name)
    return int(m.group(1)) if m else None


def newest(listing: Sequence[Remote]) -> Chosen | None:
    """The newest complete checkpoint of the directory's listing (module docstring)."""
    groups: dict[str, list[Remote]] = {}
    for r in listing:
        top = r.path.split("/", 1)[0]
        if complete(top) and all(complete(p) for p in r.path.split("/")):
            groups.setdefault(top, []).append(r)
    if not groups:
        return None
    name = max(groups, key=lambda n: (max(r.mtime for r in groups[n]), n))
    files = tuple(sorted(groups[name], key=lambda r: r.path))
    return Chosen(name, files, sum(r.size for r in files), max(r.mtime for r in files), step_of(name))


def saving_task(tasks: Mapping[str, str]) -> str | None:
    """The task whose rank saves (rank 0): chief-0, else worker-0."""
    return next((t for t in ("chief-0", "worker-0") if t in tasks), None)


@dataclass(frozen=True)
class CopyRecord:
    """What the controller keeps of a job's copy (its record file, beside it): the directory
    holding it, the checkpoint's name, step, bytes and time (the host's clock), the host it
    came from, when it was copied; and the newest one not copied, with why."""

    dir: str = ""
    name: str = ""
    step: int | None = None
    size: int = 0
    mtime: int = 0
    host: str = ""
    copied_at: float = 0.0
    skipped: str = ""  # "ckpt-80.pt: 3.2 GB, over max_size 1.1 GB"
    looked_at: float = 0.0  # the last look at the directory (this machine's clock)
    peer: str = ""  # the host that keeps it (`copy: peer`); "" the controller

    @property
    def has_copy(self) -> bool:
        return bool(self.dir and self.name)

    def to_text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def record_of(text: str) -> CopyRecord:
    """The record file read back (a damaged one is no copy: the next look copies again)."""
    try:
        raw = json.loads(text[:RECORD_MAX])
        if not isinstance(raw, dict):
            return CopyRecord()
        rec = CopyRecord(**{k: raw[k] for k in CopyRecord.__dataclass_fields__ if k in raw})
    except (ValueError, TypeError):
        return CopyRecord()
    ok = (
        isinstance(rec.peer, str)
        and isinstance(rec.dir, str)
        and re.fullmatch(r"c-[0-9a-z_-]{1,64}", rec.dir or "c-x") is not None
    )
    return rec if ok and isinstance(rec.name, str) and isinstance(rec.mtime, int) else CopyRecord()


def copying(inv: Inventory) -> CheckpointSpec | None:
    """The job's copy spec when it is copied (to the controller or a peer; None: not)."""
    spec = inv.checkpoint
    return spec if spec is not None and spec.copy in COPIED and inv.outputs is not None else None


COPIED = (CopyTo.CONTROLLER, CopyTo.PEER)


def peer_of(spec: CheckpointSpec, tasks: Mapping[str, str]) -> str | None:
    """Where a `copy: peer` copy is kept: the first host (by name) of the job's other
    tasks, not the saving rank's; "" for the controller; None when the job has no other
    host to keep it (not copied: said)."""
    if spec.copy is not CopyTo.PEER:
        return ""
    task = saving_task(tasks)
    others = sorted({h for t, h in tasks.items() if task is None or h != tasks[task]})
    return others[0] if others else None


def look_now(rec: CopyRecord, dir_changed: float | None, now: float) -> bool:
    """Is the saving host's directory worth a listing this round: its time (the round's
    stat, when `progress:` watches it) moved since the last look, or no look for a while."""
    if dir_changed is not None and dir_changed > rec.looked_at:
        return True
    return now - rec.looked_at >= LOOK_EVERY_S


class Act(StrEnum):
    COPY = "copy"
    SKIP = "skip"  # over max_size: said, the previous copy kept
    KEEP = "keep"  # the copy is the newest already (or nothing saved yet)


@dataclass(frozen=True)
class Verdict:
    act: Act
    words: str = ""


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def verdict(spec: CheckpointSpec, rec: CopyRecord, chosen: Chosen | None, host: str, peer: str = "") -> Verdict:
    """What to do with the newest complete checkpoint the saving host listed (`peer`: the
    host to keep it, "" the controller)."""
    if chosen is None:
        return Verdict(Act.KEEP)
    now = (chosen.name, chosen.mtime, chosen.size, host, peer)
    if rec.has_copy and (rec.name, rec.mtime, rec.size, rec.host, rec.peer) == now:
        return Verdict(Act.KEEP)
    if chosen.size > spec.max_bytes:
        return Verdict(
            Act.SKIP,
            f"{chosen.name}: {_mb(chosen.size)}, over checkpoint.max_size {_mb(spec.max_bytes)}: not copied "
            "(put outputs: on shared storage)",
        )
    return Verdict(Act.COPY, f"{chosen.name} ({_mb(chosen.size)}) from {host}, kept on {peer or 'the controller'}")


def restore_to(rec: CopyRecord, tasks: Mapping[str, str], answering: Sequence[str]) -> str | None:
    """The host the copy goes back to before the job starts: the saving rank's new host,
    when it is not the host the copy came from (that one keeps its own) and it answers."""
    task = saving_task(tasks)
    if not rec.has_copy or task is None:
        return None
    host = tasks[task]
    return host if host != rec.host and host in answering else None


class CopyJson(TypedDict):
    """`status --json`'s `checkpoint_copy`."""

    name: str | None
    step: int | None
    bytes: int
    host: str | None
    kept_on: str | None  # "controller", or the peer host's name
    saved_at: int | None
    copied_at: int | None
    lag_seconds: int | None
    skipped: str | None


def view(rec: CopyRecord, newest_seen: float | None) -> CopyJson:
    """The copy as status shows it: how far behind the newest checkpoint the round saw
    (its directory's time) it is."""
    lag = None
    if rec.has_copy and newest_seen is not None:
        lag = max(0, int(newest_seen - rec.mtime))
    return CopyJson(
        name=rec.name or None,
        step=rec.step,
        bytes=rec.size,
        host=rec.host or None,
        kept_on=(rec.peer or "controller") if rec.has_copy else None,
        saved_at=rec.mtime or None,
        copied_at=int(rec.copied_at) or None,
        lag_seconds=lag,
        skipped=rec.skipped or None,
    )


def line(j: CopyJson, ago: Any) -> str:
    """`Checkpoint copy: ckpt-120.pt (step 120) of host-1 on the controller, copied 20s
    ago, 0s behind` (ago: seconds -> words)."""
    if j["name"] is None:
        return "Checkpoint copy: none yet" + (f" ({j['skipped']})" if j["skipped"] else "")
    step = f" (step {j['step']})" if j["step"] is not None else ""
    lag = j["lag_seconds"]
    behind = "" if lag is None else f", {ago(lag)} behind the newest" if lag > SAME_S else ", the newest"
    skipped = f"; {j['skipped']}" if j["skipped"] else ""
    on = "the controller" if j["kept_on"] == "controller" else j["kept_on"]
    return f"Checkpoint copy: {j['name']}{step} of {j['host']} on {on}{behind}{skipped}"
