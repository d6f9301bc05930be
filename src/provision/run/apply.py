"""Apply a plan, in order:
1. record the placement, and every host about to be written as pending (state);
2. WRITE: every host's files at once (the first start phase in the same round trip when
   nothing has to stop first);
3. START: phase by phase across all hosts (ps and reduction servers → chief and workers →
   evaluator), each host recorded in the state once its last phase started."""

from __future__ import annotations

import base64
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from provision.core.lifecycle import needs_reset_failed, never_loaded, phases, start_failure, started_ok
from provision.core.records import HostRecord
from provision.core.recovery import Stage
from provision.core.target import HostError, Target
from provision.core.text import duration
from provision.host.protocol import (
    BatchReport,
    BatchRequest,
    DestroyReport,
    DestroyRequest,
    FileWrite,
    FreshReport,
    FreshRequest,
    ProbeReport,
    SetupReport,
    SetupRequest,
    UnitsReport,
    UnitsRequest,
    WriteReport,
    WriteRequest,
)
from provision.io import images
from provision.io.journal import host_last_lines, setup_follow_command, terminal_text
from provision.io.ssh import call_agent
from provision.io.steps import GroupResult, Step, run_step
from provision.render.clusterenv import output_dirs
from provision.render.files import FileKind, manifest_bytes
from provision.rules.plan import FileAction, HostPlan, Plan, TaskChange
from provision.rules.tenancy import STALE_AFTER
from provision.run.context import (
    Context,
    Progress,
    kept,
)

SETUP_TICK = float(os.environ.get("PROVISION_SETUP_TICK", 30))  # seconds between "setup still running" lines


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
    # Copies of the levels changed only (nothing below is changed): the manifest of a
    # many-host job's host is large, and deep copies of it were most of an apply's CPU.
    starts = {t.task for t in hp.starts()}
    tasks = {k: {**v, "inputs": "pending"} if k in starts else v for k, v in final["tasks"].items()}
    interim = {**final, "tasks": tasks}
    old = hp.report.readable_manifest() if hp.report else None
    # The final manifest's bytes are the rendered manifest file's (encoded once, in render).
    final_b = next((f.data() for f in hp.bundle.files if f.kind is FileKind.MANIFEST), None) or manifest_bytes(final)
    interim_b = manifest_bytes(interim) if starts else final_b
    if old is None:
        return interim_b, interim_b, final_b
    pending = {**interim, "files": dict(interim["files"]), "tasks": dict(tasks)}
    for path, rec in old.get("files", {}).items():
        pending["files"].setdefault(path, rec)
    for name, rec in old.get("tasks", {}).items():
        pending["tasks"].setdefault(name, {**rec, "inputs": "pending"})
    return manifest_bytes(pending), interim_b, final_b


def host_record(ctx: Context, t: Target, hp: HostPlan, *, pending: bool = False) -> HostRecord:
    """What the state keeps of a host: how to reach it, and (keyed) what is there."""
    assert hp.bundle is not None
    files, tasks = kept(ctx, hp.bundle)
    host = ctx.host(hp.name)
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
        self.setup_lines: Callable[[str, str], None] | None = None
        self.run_number = plan.new_run()  # recorded on the hosts that start tasks (core/runs.py)
        # A recovery placing the job again (run/recover.py): every host it starts resumes.
        inc = ctx.state.recovery.open
        self._recovering = inc is not None and inc.stage is Stage.PLACING
        self._lock = threading.Lock()
        # A first apply planned without a probe (run/firstapply.py): each host's guard goes
        # first in its write's batch; a host that refuses is left to the caller, with why.
        self.guard: Callable[[Target], FreshRequest] | None = None
        self.refused: dict[str, tuple[ProbeReport | None, list[str]]] = {}
        self.answers: dict[str, tuple[ProbeReport | None, float, float]] = {}  # guard: answer, asked, answered

    def run(self) -> dict[str, HostOutcome]:
        ctx = self.ctx
        adopt_hosts(ctx, self.plan)
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
        setups = [
            n
            for n, hp in self.work.items()
            if hp.setup is not None and self.outcomes[n].error is None and n not in self.refused
        ]
        if setups:
            self._note(run_step(ctx.session, Step.SETUP, self._setup, self._targets(setups)))
        for phase in phases():
            movers = [
                n
                for n, hp in self.work.items()
                if self.outcomes[n].error is None
                and n not in self.refused
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

    def _not_started(self, t: Target, res: UnitsReport, bad: list[TaskChange]) -> list[str]:
        """The host's errors, and for each task that did not start why, in words
        (explain.py), with its journal (one more round trip, only on a failure)."""
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
            expect=[path for path, _ in hp.shared],
            outputs=output_dirs(self.ctx.inventory),
            run={"run": self.run_number, "by": self.ctx.owner.who} | ({"resume": True} if self._recovering else {})
            if self.run_number is not None and hp.starts()
            else None,
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
            got = self._write_and_start(t, BatchRequest([req, self._start_request(t, self.first)]))
            if got is None:
                return  # refused by the guard: nothing written
            both = got
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

    def _write_and_start(self, t: Target, batch: BatchRequest) -> BatchReport | None:
        """The write and the first start in one round trip, behind the guard when there is
        one (None: the host refused; its answer and why in self.refused)."""
        if self.guard is None:
            out: BatchReport = call_agent(self.ctx.session, t, batch)
            return out
        fresh = self.guard(t)
        self.ctx.session.connect(t)  # first: the clock's bounds are the request's, not the handshake's
        asked = time.time()
        both: BatchReport = call_agent(self.ctx.session, t, BatchRequest([fresh, *batch.requests]))
        checked: FreshReport = both.results[0]
        with self._lock:
            self.answers[t.name] = (checked.probe, asked, time.time())
            if checked.errors or len(both.results) < 2:
                self.refused[t.name] = (checked.probe, checked.errors)
                return None
        return BatchReport(both.results[1:])

    def _setup(self, t: Target) -> None:
        hp = self.work[t.name]
        assert hp.bundle is not None and hp.bundle.setup is not None
        s = hp.bundle.setup
        self.progress(f"{t.name}: setup running ({hp.setup}; at most {duration(s.timeout)})")
        renew = max(1.0, STALE_AFTER / 4)
        # The unit's TimeoutStartSec= ends it first; the margins cover systemd stopping it.
        req = SetupRequest(
            self.job, s.unit, s.key, force=hp.setup == "forced", renew_every=renew, timeout=s.timeout + 120
        )
        done = threading.Event()
        started = time.monotonic()

        def tick() -> None:  # something on the screen while a long setup runs
            while not done.wait(SETUP_TICK):
                self.progress(f"{t.name}: setup still running ({duration(int(time.monotonic() - started))})")

        threading.Thread(target=tick, daemon=True).start()
        streaming, stop_stream = None, threading.Event()
        if self.setup_lines is not None:
            streaming = threading.Thread(target=self._stream_setup, args=(t, int(time.time()) - 2, stop_stream))
            streaming.start()
        try:
            rep: SetupReport = call_agent(self.ctx.session, t, req, timeout=s.timeout + 240)
        finally:
            done.set()
            if streaming is not None:  # its last lines are on their way: a second to arrive
                time.sleep(1)
                stop_stream.set()
                streaming.join(timeout=5)
        if rep.errors:
            code = f"exit code {rep.exit_code}" if rep.exit_code is not None else "; ".join(rep.errors)
            tail = "".join(f"\n    {line}" for line in rep.lines) or " (it printed nothing)"
            raise HostError(t, f"setup failed ({code}); no task started here. Its last lines:{tail}")
        self.progress(f"{t.name}: setup done" + ("" if rep.ran else " (by another job with the same setup)"))

    def _stream_setup(self, t: Target, since: int, done: threading.Event) -> None:
        """`apply --wait --logs`: the setup's output as it runs, until it ends (best effort:
        a stream that breaks leaves the progress lines, and `logs --setup` has it all)."""
        show, bundle = self.setup_lines, self.work[t.name].bundle
        assert show is not None and bundle is not None and bundle.setup is not None

        def on_line(raw: bytes) -> None:
            show(t.name, terminal_text(raw.decode("utf-8", "replace")))

        try:
            self.ctx.session.stream(t, setup_follow_command(bundle.setup.log_identifier, since), on_line, stop=done)
        except Exception:  # noqa: BLE001 - only the view of the setup is lost, not the setup
            pass

    def _start(self, t: Target, phase: int) -> None:
        self._started(t, phase, call_agent(self.ctx.session, t, self._start_request(t, phase)))


def adopt_hosts(ctx: Context, plan: Plan, *, pending_only: bool = False) -> None:
    """Record the hosts that run the job as the inventory wants it but that the state does
    not know (a killed apply, a lost state), or knows as pending (an apply whose last save
    failed: the database stopped): the state must name every host with the job on it, as it
    is there. An apply without changes records the pending ones (pending_only)."""
    with ctx.state.deferred():
        for hp in plan.hosts:
            rec = ctx.state.hosts.get(hp.name)
            if (
                hp.adopt
                and not hp.changed
                and ((rec is None and not pending_only) or (rec is not None and rec.pending))
            ):
                ctx.state.record_host(hp.name, host_record(ctx, ctx.targets[hp.name], hp))


def apply_plan(
    ctx: Context,
    plan: Plan,
    progress: Progress = lambda s: None,
    setup_lines: Callable[[str, str], None] | None = None,
    *,
    guard: Callable[[Target], FreshRequest] | None = None,
    refused: dict[str, tuple[ProbeReport | None, list[str]]] | None = None,
    answers: dict[str, tuple[ProbeReport | None, float, float]] | None = None,
    join_run: int | None = None,
) -> dict[str, HostOutcome]:
    """Make it so. Hosts with errors in the plan are left alone; the rest converge.
    `setup_lines(host, line)`: each line a setup prints, as it runs. `guard`: a first
    apply's (run/firstapply.py), first in each host's batch; the hosts that refused go to
    `refused` (their answer, and why), untouched; every guard's answer to `answers`, with
    when it was asked and answered. `join_run`: the run the tasks it starts join (an
    elastic job's scale-up on some hosts alone), recorded on their hosts as that run."""
    a = _Apply(ctx, plan, progress)
    if join_run is not None:
        a.run_number = join_run
    a.setup_lines = setup_lines
    if guard is not None and a.first is None:
        raise ValueError("a guarded apply writes and starts in one batch: nothing may stop first")
    a.guard = guard
    try:
        return a.run()
    finally:
        if refused is not None:
            refused.update(a.refused)
        if answers is not None:
            answers.update(a.answers)
