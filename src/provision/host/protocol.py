"""What the controller asks a host, and what the host answers: typed, shared by both sides.

Every request is one SSH round trip to the host agent (host/agent.py), or, for a probe,
possibly to the shell probe (probe.sh, read by controller-side probe.py), which must give
the same ProbeReport. The wire form is JSON: `to_wire` and `from_wire` turn these classes
into plain dicts and back, field by field; nothing else crosses the wire.

Runs on hosts too (shipped by host/bundle.py), under `python3 -S`, where the real dataclasses
module costs more than a probe's work: the bundle gives it a tested stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TYPE_CHECKING = False  # mypy reads the guarded import; hosts never import typing
if TYPE_CHECKING:
    from typing import Any

PROTOCOL_VERSION = 1
MAX_PROGRESS_PATHS = 256  # a probe stats at most this many progress paths (ProbeRequest.progress)
NO_FACTS, CHECK_FACTS, ALL_FACTS = "none", "check", "all"


# --------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class ProbeRequest:
    """Read what plan, status or facts need. `want`: path → sha256 provision would write
    (a file that differs comes back with its content, for the diff, up to content_max);
    `paths`, `units`: what local state says was put there besides."""

    job: str
    want: dict[str, str] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)
    # Looked at only (type, mode, owner, size; no checksum, no content): the programs tasks
    # about to start run (programs.py). A program is often python3, megabytes to hash.
    programs: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    files: bool = True
    facts: str = NO_FACTS  # none | check (only facts_only) | all
    facts_only: list[str] = field(default_factory=list)  # with check: "gpus", "tpu"
    content_max: int = 0
    tenancy: bool = False  # the host's ledger, other jobs' unit states, listening ports
    # With tenancy: the listening TCP ports too. Only placing a new task needs them, and
    # reading them is the costliest part of the probe (engine.settled says when to skip).
    listening: bool = True
    # The host's wall and monotonic clocks in the report (status: how long each task has
    # been in its state). The agent always sends them; the shell probe when asked.
    clocks: bool = False
    # Pre-flight checks (host/hostcheck.py says what each key asks): gpus, gpu_timeout,
    # ports, disk, clock. cluster_address: the host's, resolved there (the interface that
    # holds it is where NCCL and Gloo must talk).
    checks: dict[str, Any] | None = None
    cluster_address: str = ""
    # Paths whose modification time alone is read (never their content, never through a
    # link): what shows a job's progress here (rules/progress.py: heartbeats, metric files,
    # the checkpoint directory). Bounded by the controller (MAX_PROGRESS_PATHS).
    progress: list[str] = field(default_factory=list)
    # Who is logged in to each dev session here (host/devsession.py): the service's rounds.
    logins: bool = False

    op = "probe"

    def listed(self) -> list[str]:
        """The paths the report lists under `files`."""
        return sorted(set(self.want) | set(self.paths) | set(self.programs)) if self.files else []

    def looked(self) -> list[str]:
        """The listed paths only looked at: programs that are not also files provision put
        there (those are read like the others)."""
        return sorted(set(self.programs) - set(self.want) - set(self.paths)) if self.files else []


@dataclass(frozen=True)
class FileInfo:
    """One path on the host: type file | dir | symlink | other | error."""

    type: str
    mode: int | None = None
    uid: int | None = None
    size: int | None = None
    sha256: str | None = None
    content: str | None = None  # base64, when it differs from `want` and is small
    error: str | None = None


@dataclass(frozen=True)
class ProbeReport:
    manifest: dict[str, Any] | None = None  # {"_unreadable": why} when it is not JSON
    lifecycle: dict[str, Any] | None = None
    files: dict[str, FileInfo | None] = field(default_factory=dict)
    units: dict[str, dict[str, str]] = field(default_factory=dict)  # systemctl show
    exits: dict[str, list[list[str]]] = field(default_factory=dict)  # unit → .exits records
    facts: dict[str, Any] | None = None
    # The host's clocks, for status (the agent's; the shell probe has no monotonic clock).
    now: float | None = None
    now_monotonic_us: int | None = None
    boot_id: str | None = None
    # With tenancy: job → ledger entry (host/ledger.py), the states of the units other
    # jobs' entries name, and the TCP ports something listens on.
    ledger: dict[str, Any] | None = None
    ledger_units: dict[str, dict[str, str]] | None = None
    listening: list[int] | None = None
    # With checks: GPU health and compute processes, who listens on the job's ports, free
    # disk (host/hostcheck.py); with cluster_address: {"address", "name", "error"}.
    checks: dict[str, Any] | None = None
    interface: dict[str, Any] | None = None
    setup_key: str | None = None  # the key of the last setup that succeeded here
    runs: list[Any] | None = None  # the job's runs here (core/runs.py), as recorded
    # Listening ports whose every listener is on loopback: the host's own services.
    listening_local: list[int] | None = None
    # Every drop-in file of a provision-*.d directory systemd reads (layout.DROPIN_BASES),
    # sorted: plan picks those of the job's units (layout.dropin_applies). None: not read.
    dropins: list[str] | None = None
    # With tenancy: each other job of the ledger's runs and end marker here ({"runs": [...],
    # "lifecycle": {...}}, either absent when the host has none): how a job the service's
    # rounds watch ended, and which run it was.
    ledger_records: dict[str, dict[str, Any]] | None = None
    # With `progress`: path -> its modification time (the host's clock, whole seconds), for
    # those that exist; None: not asked.
    progress: dict[str, int] | None = None
    # With tenancy: the host's health record (host/health.py: a state per GPU and for the
    # host), {} when it has none.
    health: dict[str, Any] | None = None
    # With logins: unit -> its dev session's connections (`user@pts/3`, `user@notty`).
    logins: dict[str, list[str]] | None = None

    def readable_manifest(self) -> dict[str, Any] | None:
        m = self.manifest
        return m if isinstance(m, dict) and "_unreadable" not in m else None

    def without_clock(self) -> ProbeReport:
        return ProbeReport(
            self.manifest,
            self.lifecycle,
            self.files,
            self.units,
            self.exits,
            self.facts,
            ledger=self.ledger,
            ledger_units=self.ledger_units,
            listening=self.listening,
            checks=self.checks,
            interface=self.interface,
            setup_key=self.setup_key,
            runs=self.runs,
            listening_local=self.listening_local,
            dropins=self.dropins,
            ledger_records=self.ledger_records,
            progress=self.progress,
            health=self.health,
            logins=self.logins,
        )


# --------------------------------------------------------------------------- write


@dataclass(frozen=True)
class Reservation:
    """What a job takes on a host, written to the ledger before anything else in the write
    (compare-and-set under the ledger's flock): `free` maps the other jobs the controller saw
    as finished or stale to the entry token it saw; `expect_lineage` is the owner of this
    job's entry at plan time (None: there was none)."""

    job: str
    owner: dict[str, Any] = field(default_factory=dict)
    gpus: list[int] = field(default_factory=list)
    gpu_uuids: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    free: dict[str, str] = field(default_factory=dict)
    expect_lineage: str | None = None
    # The job's turn on a shared cluster, for the queue's order and preemption:
    # its level (rules/priority.level), whether it may be preempted, and when it was
    # submitted (the controller's clock; None: the time of this reserve, or the entry's).
    priority: int = 500
    preemptible: bool = False
    submitted: float | None = None
    dev: dict[str, Any] | None = None  # a dev session's terms (core/devsession.DevTerms)


@dataclass(frozen=True)
class FileWrite:
    path: str
    mode: int
    content: str  # base64
    keep_original: bool = False  # move a file that is there (not provision's) aside first


@dataclass(frozen=True)
class WriteRequest:
    """Write a host's files at once. Order on the host: pending manifest (old and new files
    named together), stop `stop`, write `files`, remove `remove`, daemon-reload when asked,
    reset-failed, then the interim or final manifest."""

    job: str
    manifest_pending: str = ""  # base64
    stop: list[str] = field(default_factory=list)
    files: list[FileWrite] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    daemon_reload: bool = False
    reset_failed: list[str] = field(default_factory=list)
    clear_lifecycle: bool = False
    manifest: str = ""  # base64
    reserve: Reservation | None = None  # first of all; on a conflict nothing is written
    run: dict[str, Any] | None = None  # {"run", "by", "resume"?}: this apply starts run N (core/runs.py)
    # Pushed files the plan found shared with another job (same bytes), so not sent: still
    # there after the pending manifest names them, or a conflict (the other job left: plan again).
    expect: list[str] = field(default_factory=list)
    # outputs: directories the host's units make and its tasks write as root (host/outdirs.py
    # checks them first: a refusal writes nothing).
    outputs: list[str] = field(default_factory=list)

    op = "write"


@dataclass(frozen=True)
class WriteReport:
    written: int = 0
    removed: int = 0
    errors: list[str] = field(default_factory=list)
    conflict: bool = False  # the reservation lost a race: nothing was written


# --------------------------------------------------------------------------- units


@dataclass(frozen=True)
class UnitsRequest:
    """systemctl verbs in order ([verb, units]: start, stop, restart, reset-failed), then
    the end-of-job marker, then the states of `report`, then the manifest."""

    job: str
    actions: list[list[Any]] = field(default_factory=list)
    lifecycle: dict[str, Any] | None = None
    report: list[str] = field(default_factory=list)
    manifest: str = ""  # base64: written once the units run with their new inputs
    hold: bool = False  # the ledger entry keeps its GPUs and ports (`provision stop --hold`)

    op = "units"


@dataclass(frozen=True)
class UnitsReport:
    errors: list[str] = field(default_factory=list)
    units: dict[str, dict[str, str]] = field(default_factory=dict)
    exits: dict[str, list[list[str]]] = field(default_factory=dict)


# --------------------------------------------------------------------------- destroy


@dataclass(frozen=True)
class DestroyRequest:
    """Stop `stop` (in order), then every unit the manifest names, remove every file it
    names and the directories provision created, put back originals, daemon-reload."""

    job: str
    stop: list[str] = field(default_factory=list)
    # A trial's removal: its shared setup stays, held by its study (this name), for the
    # study's next trials on the host, until the study is destroyed (host/setups.py).
    hold_setup: str = ""

    op = "destroy"


@dataclass(frozen=True)
class DestroyReport:
    removed: int = 0
    stopped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- network check


@dataclass(frozen=True)
class NetcheckRequest:
    """`provision check`'s network round trip (host/hostcheck.py): listen on `listen` (the
    job's ports nothing listens on yet), reach every [address, port] of `dial`, each attempt
    within `timeout` seconds, for up to `window` seconds; `expect`: port → connections to
    wait for before ending early."""

    job: str
    listen: list[int] = field(default_factory=list)
    expect: dict[str, int] = field(default_factory=dict)
    dial: list[list[Any]] = field(default_factory=list)
    timeout: float = 2.0
    window: float = 5.0

    op = "netcheck"


@dataclass(frozen=True)
class NetcheckReport:
    results: list[str | None] = field(default_factory=list)  # per dial: None (reached) or why not
    listen_errors: dict[str, str] = field(default_factory=dict)  # port → why it could not listen
    accepted: dict[str, int] = field(default_factory=dict)  # port → connections that came in
    seconds: float = 0.0


# --------------------------------------------------------------------------- the fabric


@dataclass(frozen=True)
class FabricRequest:
    """The fabric between hosts (host/fabric.py). `look`: the tools this host has to measure
    it with. `tcp` and `torch`: this host's part (`rank`) of an all-reduce over `peers`
    (every member's [address, port], in ring order). `nccl`: nccl-tests' all_reduce_perf
    under mpirun over `peers`, started from this host (the group's first)."""

    job: str
    action: str = "look"
    rank: int = 0
    peers: list[list[Any]] = field(default_factory=list)
    token: str = ""  # what the members present to each other: who may connect
    size: int = 0  # bytes all-reduced per iteration
    seconds: float = 0.5  # tcp: iterations go on until this long
    timeout: float = 60.0  # the transfer's bound, once every member joined
    join: float = 20.0  # how long the members wait for each other
    gpus: int = 0  # nccl: GPUs per host (-g); torch: CUDA (NCCL) when > 0

    op = "fabric"


@dataclass(frozen=True)
class FabricReport:
    tools: dict[str, Any] | None = None  # look: all_reduce_perf, mpirun, torch
    seconds: float | None = None  # the timed part, on this host's clock
    sent: int = 0  # bytes this host sent (received: got) in the timed part
    received: int = 0
    iterations: int = 0
    error: str | None = None
    peer: int | None = None  # the rank an error is about (did not join, could not be reached)
    output: str = ""  # nccl: the tail of all_reduce_perf's output
    backend: str = ""  # torch: gloo or nccl


# --------------------------------------------------------------------------- batch


@dataclass(frozen=True)
class SetupRequest:
    """Run the job's setup unit on the host (a oneshot: start waits for it) unless `key` is
    already the last one that succeeded there (or `force`); record `key` once it succeeds."""

    job: str
    unit: str
    key: str
    force: bool = False
    tail: int = 15  # lines of its output to send back when it fails
    # While it runs, the job's ledger entry is renewed this often: other controllers judge a
    # reservation stale by its age (tenancy.STALE_AFTER), and a setup may take an hour.
    renew_every: float = 60.0
    timeout: float = 24 * 3600  # how long to wait for `systemctl start` (the unit's own bound, and a margin)

    op = "setup"


@dataclass(frozen=True)
class SetupReport:
    ran: bool = False
    exit_code: int | None = None  # when it failed
    lines: list[str] = field(default_factory=list)  # its last lines, when it failed
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BatchRequest:
    """Several requests in one round trip, in order, stopping after the first with errors."""

    requests: list[Any] = field(default_factory=list)

    op = "batch"


@dataclass(frozen=True)
class BatchReport:
    results: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class FreshRequest:
    """A first apply's guard, first in its batch: probe as `probe` asks and refuse (errors:
    why; the batch then stops, nothing written) unless the host is as a plan presumed it
    without asking (host/fresh.py). `now`/`skew`: the controller's clock, how far the
    host's may be; `gpus`: {count, words, mib} presumed; `room`: {need: [[dir, bytes]], margin}."""

    job: str
    probe: ProbeRequest
    ports: list[int] = field(default_factory=list)
    now: float = 0.0
    skew: float = 0.0
    gpus: dict[str, Any] = field(default_factory=dict)
    room: dict[str, Any] = field(default_factory=dict)

    op = "fresh"


@dataclass(frozen=True)
class FreshReport:
    probe: ProbeReport | None = None  # the host as it is (the apply plans again from it)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class QueueRequest:
    """Mark the job's ledger entry as waiting in `apply --queue` (waiting: for what); None: unmark."""

    job: str
    owner: dict[str, Any] = field(default_factory=dict)
    waiting: str | None = None
    priority: int = 500  # the waiting work's level and submission time: the queue's order
    submitted: float | None = None
    gpus: int = 1  # the GPUs its largest task here needs (0: none: it holds no GPU taker back)

    op = "queue"


@dataclass(frozen=True)
class QueueReport:
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PreemptRequest:
    """Preempt `job` here for job `by` (host/preempt.py): mark its ledger entry
    under the ledger's lock (refused when another job preempted it first), write the
    deadline (PROVISION_PREEMPT_AT) and the Preempted end marker, then stop its units as
    their own KillSignal= and TimeoutStopSec= say (the preemption's signal and grace)."""

    job: str
    by: str = ""
    owner: dict[str, Any] = field(default_factory=dict)  # the preemptor's (tenancy.Owner)
    priority: int = 0
    priority_name: str = ""  # as users name it ("high"), for status
    gpus: int = 0  # how many GPUs the preemptor needs here
    # The job's side: preempted on this host (its marker) and asked by whoever acts
    # for the job to stop here too (a job is preempted whole): its GPUs wait for nobody.
    follows: str = ""
    # A recovery's stop (run/recover.py): `by` is the job itself (its GPUs here wait for
    # its own next run), and the end marker says so: {"n": incident, "words": where it broke}.
    recovery: dict[str, Any] | None = None

    op = "preempt"


@dataclass(frozen=True)
class PreemptReport:
    errors: list[str] = field(default_factory=list)
    refused: str = ""  # another job preempted it first: that job's name
    deadline: float | None = None  # host clock
    grace: float = 0.0
    gpus: list[int] = field(default_factory=list)  # what it held here


@dataclass(frozen=True)
class StacksRequest:
    """A hung job's look (host/stacks.py): each unit's processes and their states, and
    its Python stacks (py-spy, when installed) written into the task's log."""

    job: str
    units: list[str] = field(default_factory=list)
    why: str = ""  # said in the log above the stacks

    op = "stacks"


@dataclass(frozen=True)
class StacksReport:
    # unit -> {"pids": [...], "states": {pid: letter}, "dumped": bool, "py_spy": bool}
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DevRequest:
    """A dev session's terms in its ledger entry replaced (`provision dev --extend`): `dev`,
    when the entry is there and is the session's (`lineage`, its owner's state); and/or
    `warn`, a message to the terminals logged in to the session's `unit` (host/logins.py)."""

    job: str
    dev: dict[str, Any] | None = None
    lineage: str = ""
    warn: str = ""
    unit: str = ""

    op = "dev"


@dataclass(frozen=True)
class DevReport:
    errors: list[str] = field(default_factory=list)
    warned: int = 0  # terminals the message was written to


@dataclass(frozen=True)
class OwnersRequest:
    """Which other jobs' manifests on the host list these paths (files two jobs push)."""

    job: str
    paths: list[str] = field(default_factory=list)

    op = "owners"


@dataclass(frozen=True)
class OwnersReport:
    owners: dict[str, dict[str, str]] = field(default_factory=dict)  # path -> {job: sha256}


@dataclass(frozen=True)
class HealthRequest:
    """Change the host's health record under the ledger's lock (host/health.py): each change
    {"gpu": N or None (the host), "to": STATE, "from": [STATES] (refused unless the mark is
    one of them; absent: any), "reason", "evidence", "by", "job", "owner", "uuid"}; and
    `xid_after`, the last kernel message the health read has dealt with (host clock)."""

    job: str = ""
    changes: list[Any] = field(default_factory=list)
    xid_after: float | None = None

    op = "health"


@dataclass(frozen=True)
class HealthReport:
    record: dict[str, Any] = field(default_factory=dict)  # the record after the changes
    refused: list[str] = field(default_factory=list)  # a change whose mark was not as expected
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HealthTestRequest:
    """Test GPUs here (DCGM's diagnostics, else provision's torch test): `gpus`, the host
    itself when `host` (then `gpus` are all of its GPUs); released when they pass and
    `release`, quarantined when they fail."""

    job: str = ""
    gpus: list[int] = field(default_factory=list)
    host: bool = False
    by: str = ""
    release: bool = True
    timeout: float = 900.0

    op = "healthtest"


@dataclass(frozen=True)
class HealthTestReport:
    ran: str = ""  # what tested ("dcgmi diag -r 2", "torch"); "" nothing could
    passed: bool | None = None
    words: str = ""  # its verdict in its words (the evidence of a failure)
    record: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


REQUESTS = {
    c.op: c
    for c in (
        ProbeRequest, WriteRequest, UnitsRequest, DestroyRequest, SetupRequest, BatchRequest, NetcheckRequest,
        OwnersRequest, QueueRequest, PreemptRequest, StacksRequest, HealthRequest, HealthTestRequest, FabricRequest,
        DevRequest, FreshRequest,
    )
}  # fmt: skip
REPORTS = {
    "probe": ProbeReport, "write": WriteReport, "units": UnitsReport, "destroy": DestroyReport, "setup": SetupReport,
    "batch": BatchReport, "netcheck": NetcheckReport, "owners": OwnersReport, "queue": QueueReport,
    "preempt": PreemptReport, "stacks": StacksReport, "health": HealthReport, "healthtest": HealthTestReport,
    "fabric": FabricReport, "dev": DevReport, "fresh": FreshReport}  # fmt: skip


# --------------------------------------------------------------------------- wire form


def _names(cls: type) -> list[str]:
    return list(cls.__dict__.get("__annotations__", {}))


MESSAGES = frozenset([*REQUESTS.values(), *REPORTS.values(), FileInfo, FileWrite, Reservation])


def to_wire(msg: Any) -> Any:
    """A message (or a value inside one) as plain JSON-able data. Requests carry their op."""
    if type(msg) in MESSAGES:
        out = {n: to_wire(getattr(msg, n)) for n in _names(type(msg))}
        if type(msg) in REQUESTS.values():
            out["op"] = type(msg).op
        return out
    if isinstance(msg, dict):
        return {k: to_wire(v) for k, v in msg.items()}
    if isinstance(msg, (list, tuple)):
        return [to_wire(v) for v in msg]
    return msg


class WireError(ValueError):
    pass


def _build(cls: type, data: Any, nested: dict[str, Any]) -> Any:
    if not isinstance(data, dict):
        raise WireError("%s: expected an object, got %s" % (cls.__name__, type(data).__name__))
    kw = {}
    for n in _names(cls):
        if n in data:
            kw[n] = nested[n](data[n]) if n in nested and data[n] is not None else data[n]
    return cls(**kw)


def _map_of(fn: Any) -> Any:
    return lambda d: {k: (fn(v) if v is not None else None) for k, v in d.items()}


def request_from_wire(data: dict[str, Any]) -> Any:
    op = data.get("op") if isinstance(data, dict) else None
    cls = REQUESTS.get(op)  # type: ignore[arg-type]
    if cls is None:
        raise WireError("unknown request op %r" % (op,))
    nested: dict[str, Any] = {}
    if cls is WriteRequest:
        nested["files"] = lambda fs: [_build(FileWrite, f, {}) for f in fs]
        nested["reserve"] = lambda r: _build(Reservation, r, {})
    if cls is BatchRequest:
        nested["requests"] = lambda rs: [request_from_wire(r) for r in rs]
    if cls is FreshRequest:
        nested["probe"] = lambda r: _build(ProbeRequest, r, {})
    return _build(cls, data, nested)


def report_from_wire(op: str, data: Any) -> Any:
    cls = REPORTS[op]
    nested: dict[str, Any] = {}
    if cls is ProbeReport:
        nested["files"] = _map_of(lambda f: _build(FileInfo, f, {}))
    if cls is FreshReport:
        nested["probe"] = lambda r: report_from_wire("probe", r)
    if cls is BatchReport:
        raise WireError("batch reports are read with batch_from_wire")
    return _build(cls, data, nested)


def batch_from_wire(req: BatchRequest, data: Any) -> BatchReport:
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise WireError("batch: no results")
    return BatchReport([report_from_wire(r.op, d) for r, d in zip(req.requests, results)])
