"""Plan, apply and destroy: the steps that need hosts, in order.

inventory → render (desired) → probe (one round trip per host) → plan (pure) → apply:
  1. record the placement, and every host about to be written as pending (state);
  2. WRITE: every host's files at once (the first start phase in the same round trip when
     nothing has to stop first);
  3. START: phase by phase across all hosts (ps and reduction servers → chief and workers →
     evaluator), each host recorded in the state once its last phase started.
destroy: STOP phase by phase in reverse, then REMOVE everything, forgetting each host.
Only `ssh.py` talks to the network; this module decides what to ask (host/protocol.py).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from . import checks as preflight
from . import images
from .clusterenv import uses_socket_ifname
from .errors import ProvisionError
from .facts import needed as needed_facts
from .host.protocol import (
    CHECK_FACTS,
    BatchReport,
    BatchRequest,
    DestroyReport,
    DestroyRequest,
    FileWrite,
    ProbeReport,
    ProbeRequest,
    SetupReport,
    SetupRequest,
    UnitsReport,
    UnitsRequest,
    WriteReport,
    WriteRequest,
)
from .inventory import load
from .lifecycle import needs_reset_failed, never_loaded, phases, started_ok
from .model import Inventory
from .placement import place
from .plan import FileAction, HostPlan, Plan, make_plan, plan_host
from .probe import probe_host
from .programs import paths as program_paths
from .programs import warnings as program_warnings
from .render import FileKind, HostBundle, Rendered, manifest_bytes, render
from .ssh import HostError, KnownHosts, Session, Target, call_agent
from .state import HostRecord, State, StateLock, TaskRecord, default_state_path
from .steps import GroupResult, Step, run_step
from .tenancy import Holder, Owner, gpu_uuids, held_for, holders, owner_problem, reservation

Progress = Callable[[str], None]
Facts = Literal["none", "check", "all"]


@dataclass
class Context:
    inventory: Inventory
    state: State
    session: Session
    targets: dict[str, Target]  # inventory hosts, plus hosts only the state remembers
    rendered: Rendered
    lock: StateLock | None = None
    subset: bool = False  # --target: only some of the hosts
    secrets: dict[str, str] | None = None
    take_over: bool = False  # --take-over: this state becomes the owner of the job
    # host → NCCL's and Gloo's interface that `rendered` was rendered with (checks.py).
    ifnames: dict[str, str] = field(default_factory=dict)

    @property
    def owner(self) -> Owner:
        return Owner.here(self.state.lineage, self.state.path)

    def close(self) -> None:
        self.session.close()
        if self.lock is not None:
            self.lock.release()


def secrets_from_env(inv: Inventory, display: str | None = None) -> dict[str, str]:
    from .localcheck import secret_problems

    missing = secret_problems(inv, display=display or inv.path.name)
    if missing:
        raise ProvisionError(missing[0], details=missing[1:])
    return {k: os.environ[k] for k in inv.secret_env}


def target_of(name: str, rec: HostRecord) -> Target:
    return Target(
        name,
        rec.address,
        rec.port,
        rec.user,
        rec.identity_file,
        rec.jump_host,
        rec.connect_timeout,
        rec.host_key_policy,
    )


def open_context(
    inventory_path: str,
    *,
    state_path: str | None = None,
    only: tuple[str, ...] = (),
    parallelism: int | None = None,
    verbose: bool = False,
    render_secrets: bool = True,
    operation: str | None = None,
) -> Context:
    """Load, lock (when `operation` changes hosts: before the state is read, so no other
    run can save over what this one read), read the state, render."""
    inv = load(inventory_path)
    sp = Path(state_path) if state_path else default_state_path(Path(inventory_path), inv.job)
    lock = StateLock(sp, operation).acquire() if operation else None
    try:
        state = State.load(sp, inv.job)
        targets = {h.name: Target.from_host(h) for h in inv.hosts}
        for name, rec in state.hosts.items():
            targets.setdefault(name, target_of(name, rec))
        if only:
            unknown = [h for h in only if h not in targets]
            if unknown:
                raise ProvisionError(f"--target: no host named {', '.join(unknown)} in {inventory_path} or its state")
            targets = {k: v for k, v in targets.items() if k in only}
        if not only:  # a missing key fails every connection: say so once, before any
            from .localcheck import identity_problems

            bad_keys = identity_problems(inv, inventory_path)
            if bad_keys:
                raise ProvisionError(bad_keys[0], details=bad_keys[1:])
        secrets = secrets_from_env(inv, inventory_path) if render_secrets else None
        ifnames = cached_ifnames(inv, state)
        rendered = render(inv, previous=state.previous_placement(), secrets=secrets, socket_ifnames=ifnames)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    session = Session(KnownHosts(state.known_hosts_path), parallelism=parallelism, verbose=verbose)
    return Context(inv, state, session, targets, rendered, lock, bool(only), secrets, ifnames=ifnames)


def cached_ifnames(inv: Inventory, state: State) -> dict[str, str]:
    """host → the interface the state last saw holding the host's cluster address (while
    the address is the same)."""
    out = {}
    for h in inv.hosts:
        rec = state.hosts.get(h.name)
        if rec is not None and rec.interface and rec.interface_address == h.cluster_address:
            out[h.name] = rec.interface
    return out


def settled(ctx: Context, name: str) -> bool:
    """The state says the host has exactly what is rendered for it now: the files, the
    tasks and their inputs, the interface. Plan then expects nothing to start there and
    leaves out what only matters before a start (pre-flight checks, listening ports, the
    interface lookup); if the host shows otherwise, it is asked again with them
    (build_plan). The same record host_record would write."""
    rec, bundle = ctx.state.hosts.get(name), ctx.rendered.hosts.get(name)
    if rec is None or bundle is None or rec.pending:
        return False
    if name not in ctx.ifnames and uses_socket_ifname(ctx.inventory):
        return False  # its interface is to be found yet
    return (rec.files, rec.tasks) == kept(ctx, bundle)


def kept(ctx: Context, bundle: HostBundle) -> tuple[dict[str, str], dict[str, TaskRecord]]:
    """What the state keeps of a host's bundle: each file's and task's inputs, keyed."""
    k = ctx.state.keyed
    files = {f.path: k(f.sha256) for f in bundle.files}
    return files, {u.task.name: TaskRecord(u.unit, k(u.inputs), u.phase) for u in bundle.tasks}


# --------------------------------------------------------------------------- probe + plan


@dataclass(frozen=True)
class Ask:
    """What a probe asks each host besides its files, units and records (ProbeRequest).
    facts: none, check (only what plan checks against the inventory, much cheaper) or all;
    tenancy: the ledger (and with `listening` the listening ports); checks: the pre-flight
    checks; interface: the cluster address's interface; clocks: the host's clocks (status)."""

    facts: Facts = "none"
    files: bool = True
    tenancy: bool = False
    listening: bool = True
    checks: bool = False
    interface: bool = False
    clocks: bool = False

    def settled(self) -> Ask:
        """For a settled host: nothing that only matters before a start (engine.settled)."""
        return dataclasses.replace(self, listening=False, checks=False, interface=False)


def probe_request(ctx: Context, name: str, ask: Ask) -> ProbeRequest:
    rec = ctx.state.hosts.get(name)
    bundle = ctx.rendered.hosts.get(name)
    host = next((h for h in ctx.inventory.hosts if h.name == name), None)
    units = set(rec.units()) if rec else set()
    # What the state says was put there, besides what should be: the host's manifest names
    # it too, but the shell probe must name every path before it reads the manifest.
    if bundle is not None:
        units |= {u.unit for u in bundle.tasks}
    return ProbeRequest(
        job=ctx.inventory.job,
        want={f.path: f.sha256 for f in bundle.files} if bundle else {},
        paths=sorted(set(rec.files if rec else ())),
        # ... and each program a task about to start runs (programs.py: plan's warning).
        programs=program_paths(ctx.inventory, bundle, rec, ctx.state.keyed),
        units=sorted(units),
        files=ask.files,
        facts=ask.facts,
        facts_only=sorted(needed_facts(host)) if ask.facts == CHECK_FACTS and host else [],
        content_max=256 * 1024,
        tenancy=ask.tenancy,
        listening=ask.listening,
        clocks=ask.clocks,
        # Pre-flight checks and the cluster address's interface (checks.py).
        **(
            preflight.request_fields(
                ctx.inventory,
                host,
                bundle,
                needed_facts(host) if ask.facts == CHECK_FACTS else [],
                checks=ask.checks,
                interface=ask.interface,
            )
            if ask.checks or ask.interface
            else {}
        ),
    )


def probe(
    ctx: Context,
    ask: Ask = Ask(),
    *,
    fast: bool = False,
    only: set[str] | None = None,
    quiet: Iterable[str] = (),
    timings: dict[str, tuple[float, float]] | None = None,
) -> GroupResult[ProbeReport]:
    """One round trip per host. fast: through the shell probe where it can answer
    (probe.py); else the agent. quiet: hosts asked `ask.settled()`. `timings` gets when
    each host was asked and answered (checks.py: the clock check)."""
    quiet = set(quiet)

    def one(t: Target) -> ProbeReport:
        req = probe_request(ctx, t.name, ask.settled() if t.name in quiet else ask)
        asked = time.time()
        if fast:
            report = probe_host(ctx.session, t, req)
        else:
            report = call_agent(ctx.session, t, req, timeout=120)
        if timings is not None:
            timings[t.name] = (asked, time.time())
        return report

    targets = [t for n, t in ctx.targets.items() if only is None or n in only]
    return run_step(ctx.session, Step.PROBE, one, targets)


def build_plan(
    ctx: Context,
    *,
    replace: set[str] | None = None,
    facts: bool = True,
    rerun: bool = False,
    partial: bool = False,
    force_setup: bool = False,
    checks: bool = False,
    thorough: bool = False,
    timings: dict[str, tuple[float, float]] | None = None,
) -> Plan:
    """checks: the per-host pre-flight checks (checks.py) in the same round trip; their
    failures are problems (the apply is refused), their warnings warnings. They matter
    where something starts: a settled host is asked without them, and again with them
    only if it turns out to need a change (a second round trip there, rare). thorough:
    every host with everything (`provision check`)."""
    timings = {} if timings is None else timings
    if replace:
        names = {t.name for t in ctx.rendered.placement.tasks}
        unknown = sorted(replace - names)
        if unknown:
            raise ProvisionError(f"--replace: no task named {', '.join(unknown)} (tasks: {', '.join(sorted(names))})")
    # The cluster address's interface, where the tasks' env takes it (`check` reports it always).
    interface = thorough or uses_socket_ifname(ctx.inventory)
    ask = Ask(facts="check" if facts else "none", tenancy=True, checks=checks, interface=interface)
    forced = thorough or rerun or force_setup or bool(replace)
    quiet = set() if forced else {n for n in ctx.targets if settled(ctx, n)}

    def request(n: str) -> ProbeRequest:
        return probe_request(ctx, n, ask.settled() if n in quiet else ask)

    reports = probe(ctx, ask, fast=True, timings=timings, quiet=quiet)
    now = time.time()
    held_by = {n: holders(n, r, now) for n, r in reports.ok.items()}
    # Placement sees what other jobs hold; when that moves a task, render again and probe
    # again the hosts whose question changed (only on shared hosts: the common case is one
    # round trip).
    held = {n: held_for(ctx.inventory.job, hs, reports.ok[n].listening or [], now) for n, hs in held_by.items()}
    placement = place(ctx.inventory, ctx.state.previous_placement(), held)
    if placement != ctx.rendered.placement:
        before = {n: request(n) for n in ctx.targets}
        ctx.rendered = render(ctx.inventory, placement=placement, secrets=ctx.secrets, socket_ifnames=ctx.ifnames)
        quiet = {n for n in quiet if settled(ctx, n)}
        again = {n for n in ctx.targets if request(n) != before[n]}
        if again:
            more = probe(ctx, ask, fast=True, only=again, timings=timings, quiet=quiet)
            reports = reports.updated(more)
            held_by = {n: holders(n, r, now) for n, r in reports.ok.items()}
    preflight.with_interfaces(ctx, reports)  # NCCL's and Gloo's interface, as the hosts report it
    shipping, image_errors, image_restarts = _image_changes(ctx, reports)

    def plan_now() -> Plan:
        return make_plan(
            ctx.rendered,
            ctx.targets,
            {n: reports.get(n) for n in ctx.targets},
            replace=(replace or set()) | image_restarts or None,
            rerun=rerun,
            partial=partial,
            force_setup=force_setup,
        )

    p = plan_now()
    # A settled host that needs a change after all (a task ended, a file edited by hand):
    # ask it again with the checks, the interface and the listening ports. Its tasks keep
    # their places, so placement stands.
    drifted = {hp.name for hp in p.hosts if hp.name in quiet and hp.error is None and hp.changed}
    if drifted:
        quiet -= drifted
        more = probe(ctx, ask, fast=True, only=drifted, timings=timings)
        reports = reports.updated(more)
        held_by = {n: holders(n, r, now) for n, r in reports.ok.items()}
        preflight.with_interfaces(ctx, reports)
        p = plan_now()
    _tenancy(ctx, p, held_by)
    for hp in p.hosts:
        if hp.name in image_errors and hp.error is None:
            hp.error = image_errors[hp.name]
        hp.images = shipping.get(hp.name, [])
    for hp in p.hosts:
        if hp.report is not None and hp.bundle is not None:
            rec = ctx.state.hosts.get(hp.name)
            hp.warnings += program_warnings(ctx.inventory, hp.name, hp.bundle, rec, ctx.state.keyed, hp.report.files)
    if checks:
        preflight.add_to_plan(ctx.inventory, p, timings)
    return p


def _image_changes(
    ctx: Context, reports: GroupResult[ProbeReport]
) -> tuple[dict[str, list[images.ImageChange]], dict[str, HostError], set[str]]:
    """The images each host must get before its tasks start (images.py): one more round
    trip, only to hosts that run a container pool. Tasks whose image the host has with
    another ID restart with the new one."""
    roles = {name: [u.task.role for u in b.tasks] for name, b in ctx.rendered.hosts.items() if name in reports.ok}
    changes, errors = images.plan_images(ctx.session, ctx.inventory, roles, ctx.targets)
    restarts: set[str] = set()
    for name, todo in changes.items():
        replaced = {c.ref for c in todo if c.replaces}
        for u in ctx.rendered.hosts[name].tasks:
            pool = ctx.inventory.pool(u.task.role)
            if pool is not None and pool.image in replaced:
                restarts.add(u.task.name)
    return changes, errors, restarts


def _tenancy(ctx: Context, p: Plan, held_by: dict[str, list[Holder]]) -> None:
    """Ownership (refuse another state's job) and the ledger entry each host needs."""
    job, me = ctx.inventory.job, ctx.owner
    for hp in p.hosts:
        hs = held_by.get(hp.name)
        if hp.error is not None or hs is None or hp.report is None:
            continue
        own = next((h for h in hs if h.job == job), None)
        why = owner_problem(job, own, me, ctx.take_over)
        if why is not None:
            hp.problems.append(why)
            continue
        if hp.bundle is not None:
            tasks = [u.task for u in hp.bundle.tasks]
            hp.reserve = reservation(job, tasks, [u.unit for u in hp.bundle.tasks], hs, me, gpu_uuids(hp.report))


# --------------------------------------------------------------------------- apply


@dataclass
class HostOutcome:
    name: str
    error: str | None = None
    unreachable: bool = False
    started: list[str] = field(default_factory=list)
    failed_tasks: list[str] = field(default_factory=list)
    lost_race: bool = False  # another job's reservation won here, or this host was rolled back

    def fail(self, e: HostError) -> None:
        self.error = self.error or e.message
        self.unreachable = self.unreachable or e.unreachable


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _manifests(hp: HostPlan) -> tuple[bytes, bytes, bytes]:
    """(pending, interim, final) manifests for a host being changed.

    pending: old ∪ new files and tasks, written before anything else, so whatever a kill
    leaves behind is listed. interim: the new manifest, but tasks still to (re)start keep
    'pending' inputs until they run with the new ones. final: the new manifest.
    """
    assert hp.bundle is not None
    final = hp.bundle.manifest
    interim = copy.deepcopy(final)
    for t in hp.starts():
        interim["tasks"][t.task]["inputs"] = "pending"
    pending = copy.deepcopy(interim)
    old = hp.report.readable_manifest() if hp.report else None
    if old is not None:
        for path, rec in old.get("files", {}).items():
            pending["files"].setdefault(path, rec)
        for name, rec in old.get("tasks", {}).items():
            pending["tasks"].setdefault(name, {**rec, "inputs": "pending"})
    return manifest_bytes(pending), manifest_bytes(interim), manifest_bytes(final)


def host_record(ctx: Context, t: Target, hp: HostPlan, *, pending: bool = False) -> HostRecord:
    """What the state keeps of a host: how to reach it, and (keyed) what is there."""
    assert hp.bundle is not None
    files, tasks = kept(ctx, hp.bundle)
    host = next((h for h in ctx.inventory.hosts if h.name == hp.name), None)
    ifname = ctx.ifnames.get(hp.name, "")
    return HostRecord(
        address=t.address,
        port=t.port,
        user=t.user,
        identity_file=t.identity_file,
        jump_host=t.jump_host,
        connect_timeout=t.connect_timeout,
        host_key_policy=t.host_key_policy,
        files=files,
        tasks=tasks,
        pending=pending,
        interface=ifname,
        interface_address=host.cluster_address if host is not None and ifname else "",
    )


class _Apply:
    """One apply: the plan's hosts that change, walked through the steps."""

    def __init__(self, ctx: Context, plan: Plan, progress: Progress):
        self.ctx, self.plan, self.progress = ctx, plan, progress
        self.job = ctx.inventory.job
        self.outcomes: dict[str, HostOutcome] = {}
        self.work: dict[str, HostPlan] = {}
        for hp in plan.hosts:
            if hp.error is not None:
                self.outcomes[hp.name] = HostOutcome(hp.name, hp.error.message, hp.error.unreachable)
            elif hp.changed:
                self.work[hp.name] = hp
                self.outcomes[hp.name] = HostOutcome(hp.name)
        self.manifests = {n: _manifests(hp) for n, hp in self.work.items() if hp.bundle is not None}
        self.last_phase = {n: max((t.phase for t in hp.starts()), default=-1) for n, hp in self.work.items()}
        # The first phase needs nothing started before it: when nothing stops anywhere (stops
        # must finish on every host first), a host's tasks of that phase start in the round
        # trip that writes its files.
        first = min((t.phase for hp in self.work.values() for t in hp.starts()), default=None)
        if any(hp.bundle is None or hp.stops() for hp in self.work.values()):
            first = None
        self.first = first
        self._early: set[str] = set()  # hosts whose first phase started with the write
        self.lost: set[str] = set()  # hosts where another job's reservation won the race
        self._lock = threading.Lock()

    def run(self) -> dict[str, HostOutcome]:
        ctx = self.ctx
        # Adopt hosts that run the job but that the state does not know (a killed apply, a
        # lost state): the state must name every host with the job on it.
        with ctx.state.deferred():
            for hp in self.plan.hosts:
                if hp.adopt and not hp.changed and hp.name not in ctx.state.hosts:
                    ctx.state.record_host(hp.name, host_record(ctx, ctx.targets[hp.name], hp))
        if not self.work:
            return self.outcomes
        # Growing pools must not move tasks: the placement is recorded before anything moves,
        # and every host about to be written is named (pending) before it is written.
        ctx.state.set_placement(ctx.rendered.placement.slots())
        ctx.state.record_hosts(
            {
                n: host_record(ctx, ctx.targets[n], hp, pending=True)
                for n, hp in self.work.items()
                if hp.bundle is not None
            }
        )
        shipping = {n: hp.images for n, hp in self.work.items() if hp.images}
        if shipping:  # before the files: a task never starts without its image
            self._note(images.ship(ctx.session, shipping, ctx.targets, self.progress))
        with ctx.state.deferred():  # one save when the step ends (the pending records are saved)
            self._note(
                run_step(
                    ctx.session,
                    Step.WRITE,
                    self._write,
                    self._targets(n for n in self.work if not self.outcomes[n].error),
                )
            )
        if self.lost:
            self._roll_back()
            return self.outcomes
        setups = [n for n, hp in self.work.items() if hp.setup is not None and self.outcomes[n].error is None]
        if setups:
            self._note(run_step(ctx.session, Step.SETUP, self._setup, self._targets(setups)))
        for phase in phases():
            movers = [
                n
                for n, hp in self.work.items()
                if self.outcomes[n].error is None
                and not (phase == self.first and n in self._early)
                and any(t.phase == phase for t in hp.starts())
            ]
            if movers:
                with ctx.state.deferred():
                    self._note(
                        run_step(
                            ctx.session, Step.START, functools.partial(self._start, phase=phase), self._targets(movers)
                        )
                    )
        return self.outcomes

    def _roll_back(self) -> None:
        """Another apply took GPUs or ports on some hosts between plan and write: the job
        cannot run as planned. Hosts this apply brought the job to are cleared again
        (tasks stopped, files and ledger entry removed), so the loser holds nothing; hosts
        that had the job before keep what was written, and the next apply re-plans."""
        ctx, lost = self.ctx, sorted(self.lost)
        fresh = [
            n
            for n, hp in self.work.items()
            if n not in self.lost
            and self.outcomes[n].error is None
            and hp.bundle is not None
            and (hp.report is None or hp.report.readable_manifest() is None)
        ]

        def clear(t: Target) -> None:
            rep: DestroyReport = call_agent(ctx.session, t, DestroyRequest(self.job))
            if rep.errors:
                raise HostError(t, "; ".join(rep.errors))
            ctx.state.forget_host(t.name)

        res = run_step(ctx.session, Step.REMOVE, clear, self._targets(fresh))
        self._note(res)
        why = f"rolled back: another job took GPUs or ports on {', '.join(lost)} first"
        for n in res.ok:
            self.outcomes[n].error = why
        for n in [*lost, *res.ok]:
            self.outcomes[n].lost_race = True
        self.progress(f"{why}; cleared the job from {len(res.ok)} host{'s' if len(res.ok) != 1 else ''}")

    def _targets(self, names: Iterable[str]) -> list[Target]:
        return [self.ctx.targets[n] for n in names]

    def _note(self, res: GroupResult[None]) -> None:
        for name, e in res.errors.items():
            with self._lock:
                self.outcomes[name].fail(e)

    def _start_request(self, t: Target, phase: int) -> UnitsRequest:
        hp = self.work[t.name]
        units = [x.unit for x in hp.starts() if x.phase == phase]
        # Units systemd had never loaded when probed (a first apply) have no failed state,
        # start counters or process to reset or stop: a plain start saves the host two
        # systemctl runs each (~7 ms apiece, mostly loading the binary).
        seen = hp.report.units if hp.report else {}
        unseen = [u for u in units if never_loaded(seen.get(u))]
        rest = [u for u in units if u not in unseen]
        policy = {u.unit: self.ctx.inventory.pool(u.task.role) for u in (hp.bundle.tasks if hp.bundle else ())}
        reset = [u for u in rest if (p := policy.get(u)) is None or needs_reset_failed(seen.get(u), p.restart)]
        return UnitsRequest(
            job=self.job,
            actions=[["reset-failed", reset], ["restart", rest], ["start", unseen]],
            report=units,
            manifest=_b64(self.manifests[t.name][2]) if self.last_phase[t.name] == phase else "",
        )

    def _started(self, t: Target, phase: int, res: UnitsReport) -> None:
        hp = self.work[t.name]
        movers = [x for x in hp.starts() if x.phase == phase]
        bad = []
        for x in movers:
            st = res.units.get(x.unit, {})
            if started_ok(st, res.exits.get(x.unit)):
                self.outcomes[t.name].started.append(x.task)
            else:
                bad.append(x)
                self.outcomes[t.name].failed_tasks.append(x.task)
        if res.errors or bad:
            raise HostError(t, "; ".join(self._not_started(t, res, bad)))
        self.progress(f"{t.name}: started {', '.join(x.task for x in movers)}")
        if self.last_phase[t.name] == phase:
            self.ctx.state.record_host(t.name, host_record(self.ctx, t, hp))

    def _not_started(self, t: Target, res: UnitsReport, bad: list) -> list[str]:
        """The host's errors, and for each task that did not start why, in words
        (explain.py), with its journal (one more round trip, only on a failure)."""
        from .explain import start_failure
        from .logs import host_last_lines

        lines: dict[str, list[str]] = {}
        if bad:
            try:
                lines = host_last_lines(self.ctx.session, t, self.job, [x.task for x in bad], 10)
            except HostError:
                pass
        # systemctl's own "Job for X failed ... see journalctl -xeu X" is said better below.
        out = [e for e in res.errors if not any(x.unit in e for x in bad)]
        inv = self.ctx.inventory.path.name
        for x in bad:
            why = start_failure(x.task, res.units.get(x.unit, {}), res.exits.get(x.unit), lines.get(x.task, []))
            out.append(f"{x.task} did not start: {why}; see `provision logs {inv} {x.task}`")
        return out

    def _write_request(self, t: Target) -> WriteRequest:
        hp = self.work[t.name]
        assert hp.bundle is not None
        desired = hp.bundle.file_map()
        changes = [f for f in hp.files if f.action is not FileAction.DELETE and f.kind is not FileKind.MANIFEST]
        stops = [x.unit for x in hp.stops()]
        pending, interim, final = self.manifests[t.name]
        # Unit files new to the host, of units systemd had not loaded when probed, need no
        # daemon-reload (a tenth of a second of the host's CPU): systemd 246+ finds them at
        # the start (older ones say "not found": the agent reloads then, agent.start).
        # Changed or removed unit files, a unit systemd still holds, and stops, reload.
        unit_changes = [f for f in hp.files if f.kind in (FileKind.UNIT, FileKind.TARGET)]
        seen = hp.report.units if hp.report else {}
        fresh = (
            bool(unit_changes)
            and not stops
            and all(f.action is FileAction.CREATE and not f.drift for f in unit_changes)
            and all(never_loaded(seen.get(os.path.basename(f.path))) for f in unit_changes if f.kind is FileKind.UNIT)
        )
        return WriteRequest(
            job=self.job,
            manifest_pending=_b64(pending),
            stop=stops,
            files=[
                FileWrite(f.path, desired[f.path].mode, _b64(desired[f.path].data()), f.keep_original) for f in changes
            ],
            remove=[f.path for f in hp.files if f.action is FileAction.DELETE],
            daemon_reload=(hp.units_changed and not fresh) or bool(stops),
            reset_failed=stops,
            clear_lifecycle=bool(hp.starts()),
            manifest=_b64(final if self.last_phase[t.name] < 0 else interim),
            reserve=hp.reserve,
        )

    def _write(self, t: Target) -> None:
        ctx, hp = self.ctx, self.work[t.name]
        if hp.bundle is None:  # the job leaves this host
            rep: DestroyReport = call_agent(ctx.session, t, DestroyRequest(self.job, [x.unit for x in hp.stops()]))
            if rep.errors:
                raise HostError(t, "; ".join(rep.errors))
            ctx.state.forget_host(t.name)
            self.progress(f"{t.name}: removed the job ({rep.removed} file{'s' if rep.removed != 1 else ''})")
            return
        req = self._write_request(t)
        # A host whose setup runs starts nothing until the setup step says it succeeded.
        early = self.first is not None and hp.setup is None and any(x.phase == self.first for x in hp.starts())
        if early:
            assert self.first is not None
            batch = BatchRequest([req, self._start_request(t, self.first)])
            both: BatchReport = call_agent(ctx.session, t, batch)
            res: WriteReport = both.results[0]
        else:
            res = call_agent(ctx.session, t, req)
        if res.conflict:
            with self._lock:
                self.lost.add(t.name)
            raise HostError(t, "; ".join(res.errors) + "; nothing was written here")
        if res.errors:
            raise HostError(t, "; ".join(res.errors))
        self.progress(f"{t.name}: wrote {res.written} file{'s' if res.written != 1 else ''}, removed {res.removed}")
        if self.last_phase[t.name] < 0:
            ctx.state.record_host(t.name, host_record(ctx, t, hp))
        if early:
            assert self.first is not None
            with self._lock:
                self._early.add(t.name)
            self._started(t, self.first, both.results[1])

    def _setup(self, t: Target) -> None:
        hp = self.work[t.name]
        assert hp.bundle is not None and hp.bundle.setup is not None
        s = hp.bundle.setup
        self.progress(f"{t.name}: setup running ({hp.setup})")
        req = SetupRequest(self.job, s.unit, s.key, force=hp.setup == "forced")
        rep: SetupReport = call_agent(self.ctx.session, t, req, timeout=24 * 3600)
        if rep.errors:
            code = f"exit code {rep.exit_code}" if rep.exit_code is not None else "; ".join(rep.errors)
            tail = "".join(f"\n    {line}" for line in rep.lines) or " (it printed nothing)"
            raise HostError(t, f"setup failed ({code}); no task started here. Its last lines:{tail}")
        self.progress(f"{t.name}: setup done")

    def _start(self, t: Target, phase: int) -> None:
        self._started(t, phase, call_agent(self.ctx.session, t, self._start_request(t, phase)))


def apply_plan(ctx: Context, plan: Plan, progress: Progress = lambda s: None) -> dict[str, HostOutcome]:
    """Make it so. Hosts with errors in the plan are left alone; the rest converge."""
    return _Apply(ctx, plan, progress).run()


# --------------------------------------------------------------------------- destroy


def destroy_plan(ctx: Context) -> Plan:
    reports = probe(ctx, Ask(tenancy=True, listening=False), fast=True)
    job, now = ctx.inventory.job, time.time()
    p = Plan(job, [plan_host(name, t, None, None, reports.get(name), job=job) for name, t in ctx.targets.items()])
    _tenancy(ctx, p, {n: holders(n, r, now) for n, r in reports.ok.items()})
    return p


def _stop(ctx: Context, units: dict[str, list[str]], t: Target) -> UnitsReport:
    report: UnitsReport = call_agent(ctx.session, t, UnitsRequest(ctx.inventory.job, [["stop", units[t.name]]]))
    return report


def destroy(
    ctx: Context, plan: Plan, progress: Progress = lambda s: None, *, remove_images: bool = False
) -> dict[str, HostOutcome]:
    """Stop tasks in reverse start order across hosts, then remove every file (and, with
    remove_images, the container pools' images: shipped images stay by default)."""
    job = ctx.inventory.job
    outcomes = {
        h.name: HostOutcome(h.name, h.error.message if h.error else None, bool(h.error and h.error.unreachable))
        for h in plan.hosts
    }
    work = {h.name: h for h in plan.hosts if h.error is None and h.changed}
    for phase in phases(stopping=True):
        stoppers = {n: [x.unit for x in hp.stops() if x.phase == phase] for n, hp in work.items()}
        stoppers = {n: u for n, u in stoppers.items() if u and outcomes[n].error is None}
        if stoppers:
            res = run_step(
                ctx.session, Step.STOP, functools.partial(_stop, ctx, stoppers), [ctx.targets[n] for n in stoppers]
            )
            for n, e in res.errors.items():
                outcomes[n].fail(e)

    def remove(t: Target) -> DestroyReport:
        rep: DestroyReport = call_agent(ctx.session, t, DestroyRequest(job))
        if rep.errors:
            raise HostError(t, "; ".join(rep.errors))
        ctx.state.forget_host(t.name)
        progress(f"{t.name}: removed {rep.removed} file{'s' if rep.removed != 1 else ''}")
        return rep

    with ctx.state.deferred():  # a host left in the state by a kill is found empty next time
        removed = run_step(
            ctx.session, Step.REMOVE, remove, [ctx.targets[n] for n in work if outcomes[n].error is None]
        )
    for n, e in removed.errors.items():
        outcomes[n].fail(e)
    refs = list(dict.fromkeys(p.image for p in ctx.inventory.pools if p.image))
    if remove_images and refs and removed.ok:

        def rm_images(t: Target) -> None:
            ctx.session.run(t, images.remove_command(refs), timeout=300)
            progress(f"{t.name}: removed image{'s' if len(refs) != 1 else ''} {', '.join(refs)}")

        run_step(ctx.session, Step.REMOVE, rm_images, [ctx.targets[n] for n in removed.ok])
    # Hosts with nothing left are forgotten, so a second destroy is a clean no-op.
    with ctx.state.deferred():
        for h in plan.hosts:
            if h.error is None and not h.changed:
                ctx.state.forget_host(h.name)
    return outcomes
