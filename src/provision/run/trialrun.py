"""One trial's life on the hosts, on a thread of its own: placed and started as a job of its
own (waiting for room as `apply --queue` does, marked in the hosts' ledgers), followed (its
status and its metric file, one look at a time; between looks a wait on the host that
returns as soon as a task ends), stopped early when the study loop says so, its logs kept
on the controller, and removed from the hosts when it ends. A trial whose runner died is
adopted the same way, from where that runner got.

The hand-off (a trial's end to the next trial's first line on its GPUs): the ended trial
says where it ran; the next one is placed there (Places: beside this runner's other
trials, without waiting for their plans but on the same hosts), planned without the
checks its hosts passed a moment ago, and the ended one's logs and removal wait until it
started.

A trial whose job is preempted pauses, not ends: its worker posts `Paused` (the
loop does not tell it), waits in the queue as before its first start, and resumes it as
the same trial: an apply of its Preempted job (PROVISION_RESUME=1, the same
AIP_CHECKPOINT_DIR), followed as before, its reports going on.

The worker never touches the study: it posts what happened (`Started`, `Reported`,
`Paused`, `JobEnded`, `Removed`) to the study loop (run/tune.py), which alone asks, tells and decides,
and answers through the trial's `Handle` (recorded, stop early).

Every step is the same code `apply`, `status`, `stop`, `logs -o` and `destroy` run: a trial
is an ordinary job (its own ledger entries, so two trials never share a GPU or a port).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from provision.core.errors import ProvisionError
from provision.core.lifecycle import PREEMPT_PHASE, JobPhase, TaskState
from provision.core.model import Inventory
from provision.core.scheduling import PreemptMark
from provision.core.target import HostError, Target
from provision.core.trialend import Ended, Ending
from provision.core.tuning import EarlyStopping, Report, Tune, Value, measured
from provision.host import layout
from provision.host.protocol import DestroyReport, DestroyRequest
from provision.inventory.trial import trial_inventory
from provision.io.ssh import Session, call_agent
from provision.io.steps import Step, run_step
from provision.placement.tasks import PlacementError, Slot
from provision.render.files import render
from provision.rules import preempted
from provision.rules.plan import Plan
from provision.rules.status import JobStatus
from provision.rules.trialwait import end_wait_command, settled_free
from provision.run import trialposts as posts
from provision.run.apply import HostOutcome, apply_plan
from provision.run.context import Context, open_context
from provision.run.destroy import destroy, destroy_plan, study_of
from provision.run.jobend import end_job, look
from provision.run.logs import run_logs
from provision.run.planning import build_plan
from provision.run.queue import Queue, Stopped, ledger_marks
from provision.run.trialmetric import MetricReader, MetricRefused, metric_task
from provision.run.trialplaces import HostLocks, Places
from provision.run.victim import preempt_whole

T = TypeVar("T")
TRACE = bool(os.environ.get("PROVISION_TUNE_TRACE"))  # each trial's steps, timed, on stderr (bench/tune.py)


def trace(number: int | None, what: str) -> None:
    """A trial's step (None: the tune process's own, its start and end)."""
    if TRACE:
        who = "tune" if number is None else f"trial {number}"
        sys.stderr.write(f"{time.time():.3f} {who}: {what}\n")  # one write: threads' lines never interleave
        sys.stderr.flush()


@dataclass
class Handle:
    """One trial as its worker and the loop share it. The loop answers through it."""

    number: int
    params: dict[str, Value]
    phase: str = ""  # how far a dead runner got: "", "running", "paused" or "ended"
    told: bool = False  # adopted after its outcome was told: only its removal is left
    recorded: Ended | None = None  # phase "ended": the outcome that runner recorded
    adopt: bool = False
    stop_early: str | None = None  # set by the loop: the early-stopping rule stops it (why, in words)
    stop_at: Report | None = None  # set with stop_early: the report at which the rule decided
    freed: bool = False  # set by the loop: its place was given up (Freed) before its end was told
    free_posted: bool = False  # its worker posted Freed
    told_event: threading.Event = field(default_factory=threading.Event)  # set by the loop once told
    quiet: bool = False  # its job ended with none of its tasks running (its removal: one round trip)
    # Where the trial that ended before it ran (its GPUs, its ports): placed there first
    # (no other trial of this runner is given those).
    hint: Mapping[str, Slot] | None = None
    # That trial: told once this one is on its hosts (or could not be), so that its logs and
    # removal (round trips, a daemon-reload) do not slow this one's start on the same hosts.
    after: Handle | None = None
    # Set when this trial's successor started (or none was given its place): its wind-up
    # may go on. Waited for at most HANDOFF_WAIT seconds.
    handed_off: threading.Event = field(default_factory=threading.Event)


@dataclass
class TrialWork:
    """What a trial's thread needs: the study's inventory and how to say what happens."""

    where: str  # the inventory's path, as the user gave it
    inv: Inventory  # the study's, as loaded once
    tune: Tune
    logs_dir: Path  # the study's directory beside the state: trial-N/<task>.log
    stop: threading.Event  # set by Ctrl-C: leave the trials running
    say: Callable[[str], None]
    post: Callable[[posts.Post], None] = lambda event: None  # to the study loop
    poll: float = 1.0
    verbose: bool = False
    # One trial planned and applied at a time on a host by this runner: two trials' plans
    # made at once would not see each other's files there (the study's pushed files are
    # shared: each plans to write them as its own). Trials placed on other hosts go on
    # meanwhile; one that `places` found no room for takes every host's turn.
    starting: HostLocks = field(default_factory=HostLocks)
    places: Places = field(default_factory=Places)
    # host -> when (monotonic) a trial's plan last checked it (its GPUs' facts and health,
    # the pre-flight checks) and started there: the next trials there within CHECKED_FOR
    # seconds are planned without them (nvidia-smi and the checks on every trial's start).
    checked: dict[str, float] = field(default_factory=dict)
    # The study's connections: every trial's context uses them (no new SSH handshake per
    # trial, and one known_hosts writer).
    session: Session | None = None
    # A local state: each trial's state file goes in the study's directory (beside its logs),
    # not beside the inventory. A database state keeps a row per trial, as for any job.
    local_state: bool = True


def run_trial(w: TrialWork, h: Handle) -> None:
    """The worker: start (or adopt) the trial, follow it to its end, post that, keep its
    logs, remove it, post that. Raises nothing: a bug fails the trial with its words."""
    ended: Ended | None = None
    posted = h.told  # a told trial's outcome is in the study already
    try:
        ended, posted = _run(w, h, posted)
    except Exception as e:  # a bug, not the user's: the trial fails with it, the study goes on
        ended = Ended(Ending.FAILED, f"provision: {type(e).__name__}: {e}")
    finally:
        _handed_off(h)
        w.places.leave(h.number)
        if ended is None:  # KeyboardInterrupt or the like: the trial runs on
            ended = Ended(Ending.LEFT_RUNNING, "tune was interrupted")
        left = ended.ending is Ending.LEFT_RUNNING
        if not posted and not left:
            w.post(posts.JobEnded(h.number, ended))
        w.post(posts.Removed(h.number, ended, left=left))


def _handed_off(h: Handle) -> None:
    """The trial whose place this one took may wind up now (this one started, or will not)."""
    if h.after is not None:
        h.after.handed_off.set()
        h.after = None


def _run(w: TrialWork, h: Handle, posted: bool) -> tuple[Ended, bool]:
    """The trial's life; returns how it ended and whether that was posted already."""
    inv = trial_inventory(w.inv, h.number, h.params)
    try:
        trace(h.number, "opening")
        state = str(w.logs_dir / f"{inv.job}.state.json") if w.local_state else None
        ctx = open_context(
            w.where, state_path=state, loaded=inv, verbose=w.verbose, operation="apply", session=w.session
        )
        trace(h.number, "opened")
    except ProvisionError as e:
        return Ended(Ending.FAILED, e.message), posted
    try:
        if h.phase == ENDED and h.recorded is not None:
            ended = h.recorded
        else:
            ended, started = _run_on(w, ctx, h)
            if not started:
                return ended, posted
        if ended.ending is Ending.LEFT_RUNNING:
            return ended, posted
        return _wind_up(w, ctx, h, ended, posted)
    except HostError as e:
        return Ended(Ending.FAILED, f"{e.target.where}: {e.message}"), posted
    except ProvisionError as e:
        return Ended(Ending.FAILED, e.message), posted
    finally:
        ctx.close()


def _run_on(w: TrialWork, ctx: Context, h: Handle) -> tuple[Ended, bool]:
    """Start (or adopt) the trial and follow it to its end. Preempted, it pauses: its GPUs
    go, the loop is told (Paused, not its end), and it waits in the queue as before its
    first start; its resume is an apply of the same job (the hosts' Preempted marker makes
    it one: PROVISION_RESUME=1, the same AIP_CHECKPOINT_DIR), followed as before. False: it
    never started: nothing to wind up."""
    reader = MetricReader(w.tune, metric_task(ctx.inventory))  # kept through a pause: reports go on
    while True:
        started = h.phase != RUNNING
        if started:  # new, adopted before it ran, or paused: a queued apply
            failed = _start(w, ctx, h)
            _handed_off(h)
            if failed is not None:
                return failed, h.phase == PAUSED  # a paused one is on its hosts: wound up
            # Where its tasks ran, for `fetch --trial` once it is gone from the hosts.
            w.post(posts.Started(h.number, {t.name: t.host.name for t in ctx.rendered.placement.tasks}))
        ctx.release_lock()  # other operators may look meanwhile; the trial may run for hours
        ended = _follow(w, ctx, h, reader, started=started)
        if ended.ending is not Ending.PAUSED:
            return ended, True
        w.places.leave(h.number)  # its GPUs are the preemptor's now
        reader.pause()
        w.post(posts.Paused(h.number, ended.why))
        h.phase, h.hint = PAUSED, None  # it resumes where its state placed it
        if not _relock(w, ctx):  # its resume is an apply
            return Ended(Ending.LEFT_RUNNING, "tune was interrupted"), True


def _relock(w: TrialWork, ctx: Context) -> bool:
    """The trial's state lock again (waited for while another command holds it a moment);
    False: Ctrl-C meanwhile."""
    lock = ctx.state.store.lock("apply")
    while lock.try_acquire() is not None:
        if w.stop.wait(w.poll):
            return False
    ctx.lock = lock
    return True


RUNNING, PAUSED, ENDED = "running", "paused", "ended"  # how far a trial's runner got (io/study.py records it)


HANDOFF_WAIT = 5.0  # seconds an ended trial's wind-up waits for its successor's start
CHECKED_FOR = 60.0  # seconds a host's checks by one trial's plan stand for the next trials there


def _wind_up(w: TrialWork, ctx: Context, h: Handle, ended: Ended, posted: bool) -> tuple[Ended, bool]:
    """An ended trial: told (its GPUs are free from then on; a failure once its log's last
    lines are kept, for its why), its logs kept, and it removed from the hosts. The logs and
    the removal wait until the next trial took its place (a few seconds at most): theirs are
    round trips to the same hosts. The removal waits until the loop has recorded the
    outcome: a tune killed in between leaves the outcome, and the removal, for the next one."""
    w.places.leave(h.number)  # its GPUs are free from now
    if not posted and ended.ending is not Ending.FAILED:
        w.post(posts.JobEnded(h.number, ended, ctx.rendered.placement.slots()))
        posted = True
        trace(h.number, "told")
        until = time.monotonic() + HANDOFF_WAIT
        while not h.handed_off.wait(0.1) and not w.stop.is_set() and time.monotonic() < until:
            pass
    _keep_logs(w, ctx, h.number)
    trace(h.number, "logs kept")
    if ended.ending is Ending.FAILED and not ended.lines:
        ended = _with_kept_lines(ended, w.logs_dir / f"trial-{h.number}" / f"{metric_task(ctx.inventory)}.log")
    if not posted:
        w.post(posts.JobEnded(h.number, ended, ctx.rendered.placement.slots()))
        posted = True
    while not h.told and not h.told_event.wait(w.poll):
        if w.stop.is_set():
            return Ended(Ending.LEFT_RUNNING, "tune was interrupted"), posted
    _remove(w, ctx, quiet=h.quiet)
    trace(h.number, "removed")
    return ended, posted


def _start(w: TrialWork, ctx: Context, h: Handle) -> Ended | None:
    """Wait until the trial fits beside the other jobs, as `apply --queue` waits (each look
    one round trip per host; the hosts' ledgers say it waits, so `provision jobs` shows
    it), then apply. None: started. A plan with a problem is made once more before the
    trial fails: another runner's trial leaving a shared file may have been half-way."""
    number = h.number
    queue = Queue(None, lambda line: None, ledger_marks(ctx), poll=w.poll, stop=w.stop, waiting=_waiting(w, h))
    # Where it goes beside this runner's other trials (first where the trial before it ran,
    # when it took an ended one's place): rendered there from the start, the plan's probe
    # asks the right hosts the right questions (no second round trip), and the plan waits
    # only for this runner's trials on the same hosts.
    # An adopted trial's state may place it already (its dead runner's apply got that far):
    # there, not anew (elsewhere, its first start would run on beside the second).
    hint = w.places.take(number, ctx.inventory, h.hint or ctx.state.placement or None)
    if hint:
        ctx.state.set_placement(hint)
        ctx.rendered = render(ctx.inventory, previous=hint, secrets=ctx.secrets, socket_ifnames=ctx.ifnames)
    second_look = True
    while True:
        hosts = {s.host for s in hint.values()} if hint else set(ctx.targets)
        done = _placed_and_applied(w, ctx, number, queue, hosts, may_skip_checks=hint is not None)
        if isinstance(done, Ended):
            return done
        plan, outcomes = done
        if plan.problems and second_look:
            second_look = False
            if w.stop.wait(w.poll):
                return Ended(Ending.LEFT_RUNNING, "interrupted before it started")
            continue
        if plan.problems:
            return Ended(Ending.FAILED, plan.problems[0])
        trace(number, "applied")
        if any(o.lost_race for o in outcomes.values()):
            hint = None  # another trial took the GPUs first (one waiting for room): plan again, in turn
            _handed_off(h)  # and the trial whose place that was winds up now, not once this one starts
            continue
        errors = [f"{n}: {o.error}" for n, o in outcomes.items() if o.error]
        if errors:
            _remove(w, ctx)
            return Ended(Ending.FAILED, errors[0])
        w.places.hold(number, ctx.rendered.placement.slots())  # where it is (the plan may have moved it)
        return None


def _waiting(w: TrialWork, h: Handle) -> Callable[[str | None], None]:
    """What the trial's queue calls with what it waits for (None: it waits no more)."""

    def said(why: str | None) -> None:
        if why is not None:  # no quick start: the trial whose place it was given winds up now
            _handed_off(h)
        w.post(posts.Waiting(h.number, why))

    return said


def _placed_and_applied(
    w: TrialWork, ctx: Context, number: int, queue: Queue, hosts: set[str], *, may_skip_checks: bool = False
) -> tuple[Plan, dict[str, HostOutcome]] | Ended:
    """One plan (waited for as the queue waits) and its apply, holding `hosts`' turns
    (`starting`) from the plan that worked to the end of its apply: this runner's trials on
    a host are placed one after another, each seeing the last one's files and reservation.
    `may_skip_checks` (placed already): without the hosts' facts and pre-flight checks when
    a trial of this runner passed them there just now (looked at once the turn is held: the
    first wave's second trial on a host is planned right after the first one's apply)."""
    held: list[threading.Lock] = []
    checks = True

    def attempt() -> Plan:
        # Trials share the study's pushed files: a trial leaving takes a shared file away
        # only when no other job's manifest lists it, and an apply counting on it finds it
        # gone under the same lock on the host (a conflict: planned again by the caller).
        nonlocal checks
        held.extend(w.starting.acquire(hosts))
        try:
            now = time.monotonic()
            checks = not may_skip_checks or any(now - w.checked.get(n, -math.inf) >= CHECKED_FOR for n in hosts)
            trace(number, "planning")
            # Placed where a trial just ended (it fits: no waiting look to pay for): the
            # shared files' owners are asked beside the probe.
            plan = build_plan(ctx, checks=checks, facts=checks, whole=lambda line: None, owners_ahead=may_skip_checks)
            trace(number, "planned")
            return plan
        except BaseException:
            w.starting.release(held)  # the queue waits without them
            held.clear()
            raise

    try:
        plan = queue.plan(attempt)  # the hosts' queue marks stay until the apply's reservation (done())
        if plan.problems:
            return plan, {}
        setups = tuple(sorted(hp.name for hp in plan.hosts if hp.setup is not None and hp.error is None))
        if setups:
            w.post(posts.SettingUp(number, setups))
        outcomes = apply_plan(ctx, plan, lambda line: None)
        if checks and not any(o.lost_race or o.error for o in outcomes.values()):
            now = time.monotonic()  # under the turn: the next trial there sees it
            w.checked.update({t.host.name: now for t in ctx.rendered.placement.tasks})
        return plan, outcomes
    except Stopped:
        return Ended(Ending.LEFT_RUNNING, "interrupted before it started")
    except PlacementError as e:
        return Ended(Ending.FAILED, e.message)
    finally:
        queue.done()
        w.starting.release(held)


def _follow(w: TrialWork, ctx: Context, h: Handle, reader: MetricReader, *, started: bool = False) -> Ended:
    """Poll the trial's status and metric until its job ends (or, preempted, its tasks
    stopped: PAUSED), posting its reports; the loop may say to stop it early (the median
    rule). `started`: this worker's apply just started its tasks: the first look is the
    wait on the host (a look now would only say they run: two round trips a trial)."""
    reports: tuple[Report, ...] = ()
    # The job was found on its hosts at least once. Not taken from the apply: a trial
    # removed right after its start is lost, as before (the look after the wait sees a
    # task that ran, its exit records).
    seen = False
    if started and not w.stop.is_set():
        _waited(w, ctx, h, [(t.host.name, t.name) for t in ctx.rendered.placement.tasks])
    while True:
        # Read-only: an ended trial's leftovers are stopped by its removal, not here (two
        # round trips fewer between its end and the next trial's start on its GPUs). The
        # metric is read beside the look (its round trip in the same time).
        read = _beside(lambda: reader.read(ctx))
        st, _ = look(ctx, util=False)  # a trial's status needs no GPU utilization
        _hold_adopted(w, ctx, h, st, first=not (started or seen))
        if any(t.detail != "not applied" for t in st.tasks):
            seen = True
        elif not seen:
            with contextlib.suppress(Exception):  # its metric no longer counts
                read()
            return Ended(Ending.LOST, "not on its hosts any more (removed while no tune followed it)")
        try:
            reports = read() or reports
        except HostError:
            pass  # a host that does not answer now may at the next poll; status says so
        except MetricRefused as e:
            end_job(ctx, st)
            return Ended(Ending.FAILED, str(e))
        if st.phase.ended:
            return _job_ended(w, h, st, reports)
        if reports:
            w.post(posts.Reported(h.number, reports))
        ended = _paused(ctx, st) or _told_to_end(w, ctx, h, st, reports)
        if ended is not None:
            return ended


def _job_ended(w: TrialWork, h: Handle, st: JobStatus, reports: tuple[Report, ...]) -> Ended:
    """The look that found its job ended: its reports go to the study, those since the last
    look too (a completed trial's whole curve counts in the median rule), and how it ended."""
    trace(h.number, "ended")
    h.quiet = not any(t.state.live or t.state is TaskState.UNKNOWN for t in st.tasks)
    if reports:
        w.post(posts.Reported(h.number, reports, final=True))
    return _ending(w, st, reports)


def _hold_adopted(w: TrialWork, ctx: Context, h: Handle, st: JobStatus, *, first: bool) -> None:
    """At an adopted trial's first look (`first`), if it still runs: where it runs is this
    runner's to keep free. One whose job ended is not held: its dead runner may have given
    its place to the next trial already (Freed), and that one runs there now."""
    if first and any(t.state.live for t in st.tasks):
        w.places.hold(h.number, ctx.rendered.placement.slots())


def _paused(ctx: Context, st: JobStatus) -> Ended | None:
    """Preempted: paused once its tasks have stopped (saved a checkpoint). Preempted on some
    of its hosts only, it is preempted on the others first (run/victim.py): its runner acts
    for it."""
    if st.phase is not JobPhase.PREEMPTED:
        return None
    if not any(t.state.live for t in st.tasks):
        gpus = sum(len(t.accelerators) for t in ctx.rendered.placement.tasks)
        return Ended(Ending.PAUSED, preempted.paused(PreemptMark.of_marker(st.stopped, PREEMPT_PHASE), gpus))
    if st.rest is not None and st.rest.stop:
        preempt_whole(ctx, st.rest, lambda line: None, wait=False)
    return None


def _beside(f: Callable[[], T]) -> Callable[[], T]:
    """f called on a thread of its own now; the function returned waits for its result (or
    raises what it raised)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(f())
        except BaseException as e:  # noqa: BLE001 - raised again by the caller's wait
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def wait() -> T:
        t.join()
        if err:
            raise err[0]
        return out[0]

    return wait


def _told_to_end(w: TrialWork, ctx: Context, h: Handle, st: JobStatus, reports: tuple[Report, ...]) -> Ended | None:
    """Between two looks: Ctrl-C (the trial runs on), or the loop's word to stop it early;
    else wait on the host until one of its tasks ends (or the next look is due)."""
    if w.stop.is_set():
        return Ended(Ending.LEFT_RUNNING, "tune was interrupted")
    if h.stop_early is not None:
        end_job(ctx, st)
        h.quiet = True  # stopped in order
        last = h.stop_at or (reports[-1] if reports else None)  # where the rule stopped it
        return Ended(Ending.STOPPED_EARLY, h.stop_early, last.value if last else None, last.step if last else None)
    running = [(t.host, t.task) for t in st.tasks if t.state is TaskState.RUNNING]
    if not _waited(w, ctx, h, running) and w.stop.wait(w.poll):
        return Ended(Ending.LEFT_RUNNING, "tune was interrupted")
    if w.stop.is_set():
        return Ended(Ending.LEFT_RUNNING, "tune was interrupted")
    return None


WAIT_LONGEST = 3.0  # without early stopping, seconds between looks while nothing ends (the loop's beat)
WAIT_ANSWER_MAX = 256  # bytes of the host-side wait's answer kept ("ended inactive preempted" and the like)


def _waited(w: TrialWork, ctx: Context, h: Handle, running: list[tuple[str, str]]) -> bool:
    """The wait on the host (_host_wait). When it saw the trial's only task end and its unit
    settle, the trial's place is freed at once (Freed): the next trial is asked, planned and
    started before this one's look. False: not waited."""
    said = _host_wait(w, ctx, running)
    tasks = ctx.rendered.placement.tasks
    if said is not None and len(tasks) == 1 and not h.free_posted and settled_free(said):
        h.free_posted = True
        trace(h.number, "ended")
        w.places.leave(h.number)
        w.post(posts.Freed(h.number, ctx.rendered.placement.slots()))
        # Its look (how it ended) waits until the next trial is on its place: the two would
        # share the host and the connection, and the next trial's start is what waits.
        h.handed_off.wait(HANDOFF_WAIT)
    return said is not None


def _host_wait(w: TrialWork, ctx: Context, running: list[tuple[str, str]]) -> str | None:
    """Wait on the host of the trial's metric task (else of its first running task) until
    a running task of it there ends, or the next look is due: its end is seen within a
    twentieth of a second, with one command in flight instead of a look per poll. With
    early stopping the next look is due after `poll` (its reports decide), else after a few
    seconds (a task on another host that ends is seen then). `running`: (host, task) of
    each task running. Its answer (end_wait_command's line); None: not waited (nothing to
    watch, or the host did not answer): the caller waits its poll."""
    if not running:
        return None
    task = metric_task(ctx.inventory)
    host = next((hn for hn, tn in running if tn == task), running[0][0])
    target = ctx.targets.get(host)
    if target is None:
        return None
    units = [layout.unit_name(ctx.inventory.job, tn) for hn, tn in running if hn == host]
    longest = w.poll if w.tune.early_stopping is not EarlyStopping.NONE else max(w.poll, WAIT_LONGEST)
    said = bytearray()

    def keep(data: bytes) -> None:  # one short line is the answer: a host sending more is not kept
        said.extend(data[: max(0, WAIT_ANSWER_MAX - len(said))])

    try:
        preempted = layout.preempt_at_path(ctx.inventory.job)
        ctx.session.stream(target, end_wait_command(units, longest, preempted), keep, stop=w.stop)
    except Exception:  # noqa: BLE001 - a wait that fails is a poll's sleep: the next look says why
        return None
    text = bytes(said).decode("utf-8", "replace").strip()
    return text if text and text != "none" else None


def _ending(w: TrialWork, st: JobStatus, reports: tuple[Report, ...]) -> Ended:
    last = reports[-1] if reports else None
    steps = last.step if last else None
    if st.phase is JobPhase.SUCCEEDED:
        value = measured(reports, w.tune.metric, w.tune.measurement)
        if value is None:
            return Ended(Ending.FAILED, f"no {w.tune.metric.name} reported (the job succeeded without one)")
        return Ended(Ending.SUCCEEDED, st.reason or "the job succeeded", value, steps)  # "chief-0 exited 0"
    lines: tuple[str, ...] = ()
    for t in st.tasks:
        if t.last_lines:
            lines = t.last_lines
            break
    why = st.reason or f"the job {st.phase.value.lower()}"
    return Ended(Ending.FAILED, why, last.value if last else None, steps, lines)


def _with_kept_lines(ended: Ended, log: Path) -> Ended:
    """A failed trial's last lines from the log kept on the controller (its traceback), and
    the last of them in why it failed."""
    try:
        # `logs -o` writes "TIME HOST TEXT" per line.
        lines = [
            parts[2]
            for parts in (ln.split(" ", 2) for ln in log.read_text(errors="replace").splitlines())
            if len(parts) == 3
        ]
    except OSError:
        return ended
    own = [ln for ln in lines if not ln.startswith("[systemd]")]
    if not own:
        return ended
    return dataclasses.replace(ended, lines=tuple(own[-10:]), why=f"{ended.why} ({own[-1].strip()})")


def _keep_logs(w: TrialWork, ctx: Context, number: int) -> None:
    try:
        run_logs(ctx, out_dir=str(w.logs_dir / f"trial-{number}"), echo_err=lambda s: None)
    except (ProvisionError, HostError, OSError) as e:
        w.say(f"trial {number}: its logs could not be kept: {getattr(e, 'message', e)}")


def _remove(w: TrialWork, ctx: Context, *, quiet: bool = False) -> None:
    """destroy, as `provision destroy` does it, under the trial's lock. `quiet`: the trial's
    job ended with none of its tasks running (seen so, or stopped in order by end_job):
    each host it is on removes it in one round trip (the agent's destroy: units, files,
    shared files other jobs still list kept), without destroy's probe and stop steps;
    any host that fails that is destroyed as usual."""
    if ctx.lock is None:
        ctx.lock = ctx.state.store.lock("destroy").acquire()
    on = [ctx.targets[n] for n in sorted(ctx.state.hosts) if n in ctx.targets]
    if quiet and on:

        def clear(t: Target) -> None:
            # The trial's setup stays held for its study (as destroy's removal holds it).
            req = DestroyRequest(ctx.inventory.job, hold_setup=study_of(ctx.inventory))
            rep: DestroyReport = call_agent(ctx.session, t, req)
            if rep.errors:
                raise HostError(t, "; ".join(rep.errors))
            ctx.state.forget_host(t.name)

        with ctx.state.deferred():
            if not run_step(ctx.session, Step.REMOVE, clear, on).errors:
                return
    plan = destroy_plan(ctx)
    if plan.changed:
        destroy(ctx, plan)
