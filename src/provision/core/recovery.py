"""What a job asks of provision when its hardware fails: how its progress is watched
(`progress:`), how often it is recovered (`recovery:`), which hosts wait as spares
(`spares:`), and a pool's
elastic size (`pools.ROLE.elastic`). The values as the inventory gives them; rules/progress.py
and rules/recovery.py judge with them. Pure."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TypedDict

from provision.core.text import duration

# The service's round while a watched job changes or is watched for progress
# (serve/gpusample.SAMPLE_EVERY, which a test holds equal): a progress bound shorter than
# one round could not be told from a round that has not come yet.
ROUND_S = 10.0
# `progress: {timeout: auto}`: the bound learnt from the job's own intervals between two
# signs of progress, AUTO_FACTOR times their median, never under AUTO_FLOOR_S; until
# AUTO_SAMPLES intervals were seen, AUTO_START_S.
AUTO_FACTOR = 5.0
AUTO_FLOOR_S = 60.0
AUTO_SAMPLES = 3
AUTO_START_S = 600.0  # NCCL's own watchdog's default: no sooner than it before anything is learnt
# A run's first sign of progress comes after its start-up (imports, the rendezvous, a
# checkpoint loaded), which a loaded host stretches: until its first sign a run is hung only
# past its bound or this, whichever is longer.
STARTUP_S = 120.0
# ... and a sign within this of its start is not its own: the start itself moves the
# checkpoint directory (made as the units start, on a host new to the job).
SETTLE_S = 30.0
DEFAULT_MAX = 5
DEFAULT_WINDOW_S = 24 * 3600


@dataclass(frozen=True)
class ProgressSpec:
    """`progress: {timeout: 10m}` (seconds) or `{timeout: auto}` (None)."""

    timeout_s: int | None = None

    @property
    def auto(self) -> bool:
        return self.timeout_s is None


@dataclass(frozen=True)
class RecoverySpec:
    """`recovery: {max: 5, window: 24h}`: at most `max` recoveries within `window`."""

    max: int = DEFAULT_MAX
    window_s: int = DEFAULT_WINDOW_S


class CopyTo(StrEnum):
    """`checkpoint.copy`: where the newest complete checkpoint is kept off its host."""

    CONTROLLER = "controller"  # beside the inventory: .provision/checkpoints/JOB/
    PEER = "peer"  # on another host of the job: state_dir(JOB)/checkpoint-copy/
    SHARED = "shared"  # `outputs:` is storage every host mounts: nothing to copy
    NONE = "none"  # not copied


DEFAULT_COPY_MAX = 1 << 30  # bytes: a checkpoint over it is not copied (shared storage is the answer)
DEFAULT_COPY_RATE = 20_000_000  # bytes a second: the copy never takes the training's network


@dataclass(frozen=True)
class CheckpointSpec:
    """`checkpoint: {copy: controller, max_size: 1GiB, bandwidth: 20MB/s}`."""

    copy: CopyTo = CopyTo.CONTROLLER
    max_bytes: int = DEFAULT_COPY_MAX
    rate: int = DEFAULT_COPY_RATE


@dataclass(frozen=True)
class Elastic:
    """`pools.ROLE.elastic: {min: 2, max: 4}`: the pool's nodes under torchrun's c10d
    rendezvous (`--nnodes=MIN:MAX`)."""

    min: int
    max: int


# --------------------------------------------------------------------------- the state's record


class Broke(StrEnum):
    """How a run broke."""

    FAILED = "failed"  # a task ended on a host that answers
    HOST = "host"  # a host of the job stopped answering and the others ended or stopped progressing
    HUNG = "hung"  # its tasks live but show no progress past the bound


class Stage(StrEnum):
    """Where a recovery is: a service killed in the middle goes on from here (the state's)."""

    STOPPING = "stopping"  # the job is being stopped everywhere that answers, with its grace
    PLACING = "placing"  # stopped: its failed replicas are placed again and it starts
    DONE = "done"  # it runs again
    GAVE_UP = "gave up"  # not recovered (budget spent, or the same failure on another host)


KEEP_INCIDENTS = 50


class IncidentJson(TypedDict):
    """An incident as the job's state and `status --json` keep it (Incident.to_json)."""

    n: int
    broke: str
    task: str
    host: str
    words: str
    signature: str
    run: int | None
    at: float | None
    detected: float | None
    stopped: float | None
    running: float | None
    checkpoint: float | None
    aside: list[str]
    gpus: dict[str, list[int]]
    stage: str
    why: str
    new_run: int | None
    started: float | None
    progressing: float | None


class RecoveryJson(TypedDict):
    """A job's recoveries (RecoveryRecord.to_json)."""

    aside: list[str]
    gpus: dict[str, list[int]]
    incidents: list[IncidentJson]
    learnt_bound_seconds: float | None


Gpus = tuple[tuple[str, tuple[int, ...]], ...]  # host -> GPUs, sorted by host (hashable)


def gpus_of(d: object) -> Gpus:
    """host -> GPUs as the state keeps them ({"gpu-3": [5]}); anything malformed left out."""
    if not isinstance(d, dict):
        return ()
    out = []
    for host, gs in d.items():
        if not isinstance(host, str) or not isinstance(gs, list):
            continue
        got = tuple(sorted({g for g in gs if isinstance(g, int) and not isinstance(g, bool) and g >= 0}))
        if got:
            out.append((host, got))
    out.sort()
    return tuple(out)


def merge_gpus(a: Gpus, b: Gpus) -> Gpus:
    both: dict[str, set[int]] = {}
    for host, gs in (*a, *b):
        both.setdefault(host, set()).update(gs)
    return tuple((h, tuple(sorted(g))) for h, g in sorted(both.items()))


@dataclass(frozen=True)
class Incident:
    """One failure of the job and its recovery, with the times goodput counts (this
    machine's clock, epoch seconds): when it broke (the first failed exit, the last progress
    before a hang, the last answer of a host), when it was seen, stopped, running again;
    and the work done since its last checkpoint, redone after it."""

    n: int
    broke: Broke
    task: str
    host: str
    words: str  # where it broke, one line ("chief-0's host gpu-3 stopped answering at 14:02")
    signature: str  # how it failed, to tell the same failure on another host (its own bug)
    run: int | None = None  # the run that broke
    at: float | None = None  # when it broke
    detected: float | None = None
    stopped: float | None = None
    running: float | None = None  # the next run started
    checkpoint: float | None = None  # the newest checkpoint before it broke (its mtime)
    aside: tuple[str, ...] = ()  # hosts set aside for the job by this recovery (whole, or `gpus`)
    gpus: Gpus = ()  # of those hosts, the ones where only these GPUs were set aside
    stage: Stage = Stage.STOPPING
    why: str = ""  # a recovery given up: why
    new_run: int | None = None
    started: float | None = None  # when the run that broke started (goodput counts from the first)
    # the next run's first sign of progress (its start-up, e.g. `import torch`, the
    # rendezvous and the checkpoint's load, is lost time too); None until the service saw one
    progressing: float | None = None

    def to_json(self) -> IncidentJson:
        return {
            "n": self.n,
            "broke": self.broke.value,
            "task": self.task,
            "host": self.host,
            "words": self.words,
            "signature": self.signature,
            "run": self.run,
            "at": self.at,
            "detected": self.detected,
            "stopped": self.stopped,
            "running": self.running,
            "checkpoint": self.checkpoint,
            "aside": list(self.aside),
            "gpus": {h: list(g) for h, g in self.gpus},
            "stage": self.stage.value,
            "why": self.why,
            "new_run": self.new_run,
            "started": self.started,
            "progressing": self.progressing,
        }

    def lost(self, now: float) -> Lost:
        """What this incident cost (module's goodput)."""
        return lost(self, now)

    @classmethod
    def from_json(cls, d: object) -> Incident | None:
        if not isinstance(d, dict) or not isinstance(d.get("n"), int):
            return None
        try:
            return cls(
                int(d["n"]),
                Broke(str(d.get("broke"))),
                str(d.get("task", "")),
                str(d.get("host", "")),
                str(d.get("words", "")),
                str(d.get("signature", "")),
                _int(d.get("run")),
                _num(d.get("at")),
                _num(d.get("detected")),
                _num(d.get("stopped")),
                _num(d.get("running")),
                _num(d.get("checkpoint")),
                tuple(str(h) for h in d.get("aside") or ()),
                gpus_of(d.get("gpus")),
                Stage(str(d.get("stage", Stage.STOPPING.value))),
                str(d.get("why", "")),
                _int(d.get("new_run")),
                _num(d.get("started")),
                _num(d.get("progressing")),
            )
        except ValueError:
            return None


@dataclass(frozen=True)
class RecoveryRecord:
    """What the job's state keeps of its recoveries: the hosts set aside for it (placement
    treats them as drained for this job alone), the GPUs set aside for it where the
    evidence was a GPU's (placement gives the job the host's other GPUs), and its
    incidents, newest last."""

    aside: tuple[str, ...] = ()
    incidents: tuple[Incident, ...] = ()
    gpus: Gpus = ()
    # `progress: {timeout: auto}`: the bound the service's rounds learnt (seconds), so a
    # one-off look (`status`, the owner's apply) judges as the service does
    learnt: float | None = None

    @property
    def gpu_map(self) -> dict[str, tuple[int, ...]]:
        return dict(self.gpus)

    @property
    def open(self) -> Incident | None:
        """The recovery under way (stopping or placing), if any."""
        last = self.incidents[-1] if self.incidents else None
        return last if last is not None and last.stage in (Stage.STOPPING, Stage.PLACING) else None

    def with_incident(self, inc: Incident) -> RecoveryRecord:
        kept = [i for i in self.incidents if i.n != inc.n] + [inc]
        kept.sort(key=lambda i: i.n)
        return replace(self, incidents=tuple(kept[-KEEP_INCIDENTS:]))

    def with_aside(self, hosts: tuple[str, ...], gpus: Gpus = ()) -> RecoveryRecord:
        """`hosts` set aside whole, and of others only `gpus` (a host set aside whole has
        no GPUs of its own in the record)."""
        whole = set(self.aside) | set(hosts)
        kept = tuple((h, g) for h, g in merge_gpus(self.gpus, gpus) if h not in whole)
        return replace(self, aside=tuple(sorted(whole)), gpus=kept)

    def without_aside(self, hosts: tuple[str, ...]) -> RecoveryRecord:
        gone = set(hosts)
        kept = tuple((h, g) for h, g in self.gpus if h not in gone)
        return replace(self, aside=tuple(h for h in self.aside if h not in gone), gpus=kept)

    def next_number(self) -> int:
        return (self.incidents[-1].n if self.incidents else 0) + 1

    def to_json(self) -> RecoveryJson:
        return {
            "aside": list(self.aside),
            "gpus": {h: list(g) for h, g in self.gpus},
            "incidents": [i.to_json() for i in self.incidents],
            "learnt_bound_seconds": self.learnt,
        }

    @classmethod
    def from_json(cls, d: object) -> RecoveryRecord:
        if not isinstance(d, dict):
            return cls()
        incs = [i for i in (Incident.from_json(x) for x in d.get("incidents") or ()) if i is not None]
        return cls(
            tuple(str(h) for h in d.get("aside") or ()),
            tuple(incs[-KEEP_INCIDENTS:]),
            gpus_of(d.get("gpus")),
            _num(d.get("learnt_bound_seconds")),
        )


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# --------------------------------------------------------------------------- goodput


class LostJson(TypedDict):
    """An incident's times (seconds; None: that stage not reached)."""

    n: int
    detect_seconds: float | None  # from when it broke to when it was seen
    stop_seconds: float | None  # from seen to stopped everywhere
    run_again_seconds: float | None  # from stopped to running again
    start_up_seconds: float | None  # from running again to its first sign of progress
    redone_seconds: float | None  # the work done since its last checkpoint, redone
    # from when it broke to progressing again (running again where no progress was seen;
    # now while it is not running), with the work redone
    lost_seconds: float


class GoodputJson(TypedDict):
    """A job's goodput: the share of its wall time (since its first watched run started)
    spent progressing, and each incident's times."""

    ratio: float | None
    wall_seconds: float
    lost_seconds: float
    incidents: list[LostJson]


@dataclass(frozen=True)
class Lost:
    n: int
    detect: float | None
    stop: float | None
    run_again: float | None
    redone: float | None
    total: float
    start_up: float | None = None

    def to_json(self) -> LostJson:
        def r(v: float | None) -> float | None:
            return round(v, 1) if v is not None else None

        return {
            "n": self.n,
            "detect_seconds": r(self.detect),
            "stop_seconds": r(self.stop),
            "run_again_seconds": r(self.run_again),
            "start_up_seconds": r(self.start_up),
            "redone_seconds": r(self.redone),
            "lost_seconds": round(self.total, 1),
        }

    def words(self) -> str:
        def s(v: float | None) -> str:
            return f"{v:.0f} s" if v is not None else "-"

        return (
            f"seen in {s(self.detect)}, stopped in {s(self.stop)}, running again in {s(self.run_again)}"
            + (f", progressing {s(self.start_up)} later" if self.start_up is not None else "")
            + f", {s(self.redone)} of work redone"
        )


def _gap(a: float | None, b: float | None) -> float | None:
    return max(0.0, b - a) if a is not None and b is not None else None


def lost(i: Incident, now: float) -> Lost:
    """An incident's cost: from when it broke to when it was seen, stopped, running again
    and progressing again (its start-up), and the work since its last checkpoint (redone
    after it); in all, from when it broke to progressing again (running again where the
    job shows no progress, or none was seen yet; now, while it is not running), plus the
    work redone. A recovery given up loses nothing more here: the job ended."""
    redone = _gap(i.checkpoint, i.at) if i.checkpoint is not None and i.checkpoint <= (i.at or 0) else None
    up = _gap(i.running, i.progressing)
    end = i.running if i.running is not None else (i.detected if i.stage is Stage.GAVE_UP else now)
    total = (_gap(i.at, end) or 0.0) + (up or 0.0) + (redone or 0.0)
    return Lost(i.n, _gap(i.at, i.detected), _gap(i.detected, i.stopped), _gap(i.stopped, i.running), redone, total, up)


def goodput(record: RecoveryRecord, started: float | None, now: float) -> GoodputJson | None:
    """The job's goodput since `started` (its first watched run's start: the oldest
    incident's, else the run now): its wall time less what its incidents lost, as a share.
    None when nothing says when it started."""
    first = next((i.started for i in record.incidents if i.started is not None), None)
    known = [x for x in (first, started) if x is not None]
    since = min(known) if known else None
    if since is None or now <= since:
        return None
    wall = now - since
    losses = [lost(i, now) for i in record.incidents]
    total = min(wall, sum(x.total for x in losses))
    return {
        "ratio": round((wall - total) / wall, 4),
        "wall_seconds": round(wall, 1),
        "lost_seconds": round(total, 1),
        "incidents": [x.to_json() for x in losses],
    }


def goodput_words(g: GoodputJson) -> str | None:
    """The job's goodput in one line, as `status` prints it and the job's page shows it
    ("Goodput: 97% of 3h, 1 incident, 5m lost"); None while it has no ratio."""
    if g["ratio"] is None:
        return None
    n = len(g["incidents"])
    lost = f", {n} incident{'s' if n != 1 else ''}, {duration(int(g['lost_seconds']))} lost" if n else ""
    return f"Goodput: {g['ratio']:.0%} of {duration(int(g['wall_seconds']))}{lost}"


def incident_words(inc: Incident, now: float) -> str:
    """An incident in one line, as `status` prints it and the job's page shows it: where it
    broke, then its times (or why it was not recovered)."""
    how = f"not recovered: {inc.why}" if inc.why else inc.lost(now).words()
    return f"incident {inc.n} ({inc.stage.value}): {inc.words}: {how}"
