"""One trial's life on the hosts: placed and started as a job of its own, followed (its
status and its metric file, one poll at a time; intermediate values told to the pruner),
stopped early when the median rule says so, its logs kept on the controller, and removed
from the hosts when it ends. A trial whose runner died is adopted the same way, from
"followed" on.

Every step is the same code `apply`, `status`, `stop`, `logs -o` and `destroy` run: a trial
is an ordinary job (its own ledger entries, so two trials never share a GPU or a port).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import optuna
from optuna.trial import TrialState as OptunaState

from provision.core.errors import ProvisionError
from provision.core.lifecycle import JobPhase
from provision.core.model import Inventory
from provision.core.target import HostError, Target
from provision.core.tuning import Report, Tune, Value, measured
from provision.host import layout
from provision.io.journal import host_last_lines
from provision.io.ssh import Session
from provision.rules.metrics import parse_log_lines, parse_metric_file
from provision.rules.status import JobStatus
from provision.run.apply import HostOutcome, apply_plan
from provision.run.context import Context, open_context
from provision.run.destroy import destroy, destroy_plan
from provision.run.jobend import end_job, look
from provision.run.logs import run_logs
from provision.run.planning import build_plan
from provision.run.study import beat, mark_removed
from provision.spec.placement import PlacementError
from provision.spec.trial import trial_inventory

TRACE = bool(os.environ.get("PROVISION_TUNE_TRACE"))  # each trial's steps, timed, on stderr (bench/tune.py)


def trace(number: int, what: str) -> None:
    if TRACE:
        print(f"{time.time():.3f} trial {number}: {what}", file=sys.stderr, flush=True)


class Ending(str, Enum):
    SUCCEEDED = "succeeded"
    STOPPED_EARLY = "stopped early"
    FAILED = "failed"
    LOST = "lost"  # adopted, but not on its hosts any more: failed, and run again
    LEFT_RUNNING = "left running"  # tune was interrupted: the trial runs on, for the next tune


@dataclass
class Ended:
    ending: Ending
    why: str
    value: float | None = None
    steps: int | None = None
    lines: tuple[str, ...] = ()  # a failed task's last lines (its traceback)


@dataclass
class TrialWork:
    """What a trial's thread needs: the study's inventory, file and record, and how to say
    what happens."""

    where: str  # the inventory's path, as the user gave it
    inv: Inventory  # the study's, as loaded once
    tune: Tune
    study: optuna.Study
    logs_dir: Path  # the study's directory beside the state: trial-N/<task>.log
    stop: threading.Event  # set by Ctrl-C: leave the trials running
    say: Callable[[str], None]
    poll: float = 1.0
    verbose: bool = False
    waiting: dict[int, str] = field(default_factory=dict)  # trial number -> why it waits for room
    # One trial placed and started at a time by this runner: trials started together would
    # all be placed on the same free GPU (placement is deterministic) and all but one lose
    # the reservation and plan again; one after the other, each sees the last one's.
    starting: threading.Lock = field(default_factory=threading.Lock)
    # The study's connections: every trial's context uses them (no new SSH handshake per
    # trial, and one known_hosts writer).
    session: Session | None = None
    # A local state: each trial's state file goes in the study's directory (beside its logs),
    # not beside the inventory. A database state keeps a row per trial, as for any job.
    local_state: bool = True
    # Called by a trial's thread as soon as its job has ended (before its logs are kept and
    # it is removed: its GPUs are free from then on, ENDED in the ledger): the loop tells
    # Optuna and starts the next trial meanwhile.
    on_ended: Callable[[int, int, dict[str, Value], Ended], None] = lambda trial_id, number, params, ended: None


def metric_task(inv: Inventory) -> str:
    """Whose metric counts: the chief's, else the first worker's (Vertex's workerpool0)."""
    roles = [p.role for p in inv.pools if p.replicas > 0]
    return "chief-0" if "chief" in roles else f"{roles[0]}-0" if roles else "chief-0"


def read_reports(ctx: Context, task: str, tune: Tune) -> tuple[Report, ...]:
    """The metric so far: the task's hypertune file (one round trip to its host), or with
    `metric.regex` its log lines."""
    placed = {t.name: t for t in ctx.rendered.placement.tasks}
    t = placed.get(task)
    if t is None:
        return ()
    target: Target = ctx.targets[t.host.name]
    if tune.metric.regex:
        lines = host_last_lines(ctx.session, target, ctx.inventory.job, [task], n=20000).get(task, [])
        return parse_log_lines(lines, tune.metric.regex)
    path = layout.metric_file(ctx.inventory.job, task)
    res = ctx.session.run(target, f"cat {shlex.quote(path)} 2>/dev/null || true", timeout=60)
    return parse_metric_file(res.stdout, tune.metric.name)


def run_trial(w: TrialWork, trial_id: int, number: int, params: dict[str, Value], *, adopt: bool) -> Ended:
    """Start (or adopt) the trial, follow it to its end, keep its logs, remove it. Raises
    nothing a user caused: every failure is an Ended.

    An adopted trial goes on from where its runner was (the `phase` it recorded): not yet
    started (apply converges whatever part got onto the hosts), running (followed), or ended
    (its outcome recorded: only the logs and the removal were left)."""
    inv = trial_inventory(w.inv, number, params)
    frozen = w.study._storage.get_trial(trial_id) if adopt else None
    attrs = frozen.user_attrs if frozen is not None else {}
    told = frozen is not None and frozen.state is not OptunaState.RUNNING  # only its removal was left
    try:
        trace(number, "opening")
        state = str(w.logs_dir / f"{inv.job}.state.json") if w.local_state else None
        ctx = open_context(
            w.where, state_path=state, loaded=inv, verbose=w.verbose, operation="apply", session=w.session
        )
        trace(number, "opened")
    except ProvisionError as e:
        return Ended(Ending.FAILED, e.message)
    try:
        if attrs.get("phase") == ENDED:
            ended = _recorded(attrs)
        else:
            if attrs.get("phase") != RUNNING:
                failed = _start(w, ctx, trial_id, number)
                if failed is not None:
                    return failed
                # Where its tasks ran, for `fetch --trial` once it is gone from the hosts.
                hosts = {t.name: t.host.name for t in ctx.rendered.placement.tasks}
                beat(w.study, trial_id, phase=RUNNING, hosts=hosts)
            ctx.release_lock()  # other operators may look meanwhile; the trial may run for hours
            ended = _follow(w, ctx, trial_id, number)
        if ended.ending is Ending.LEFT_RUNNING:
            return ended
        return _wind_up(w, ctx, trial_id, number, params, ended, told=told)
    except HostError as e:
        return Ended(Ending.FAILED, f"{e.target.where}: {e.message}")
    except ProvisionError as e:
        return Ended(Ending.FAILED, e.message)
    finally:
        ctx.close()


RUNNING, ENDED = "running", "ended"  # how far a trial's runner got (user attribute `phase`)


def _recorded(attrs: dict[str, object]) -> Ended:
    value, steps = attrs.get("value"), attrs.get("steps")
    return Ended(
        Ending(str(attrs.get("ending"))),
        str(attrs.get("why", "")),
        float(value) if isinstance(value, (int, float)) else None,
        steps if isinstance(steps, int) else None,
    )


def _wind_up(
    w: TrialWork, ctx: Context, trial_id: int, number: int, params: dict[str, Value], ended: Ended, *, told: bool
) -> Ended:
    """An ended trial: its outcome recorded and told (its GPUs are free from then on), its
    logs kept, and it removed from the hosts. `told`: a dead runner told it already."""
    if not told:
        # Recorded before its logs are kept and it is removed: a tune killed in between
        # leaves the outcome, and the removal, for the next one.
        beat(
            w.study,
            trial_id,
            phase=ENDED,
            ending=ended.ending.value,
            why=ended.why,
            value=ended.value,
            steps=ended.steps,
        )
        if ended.ending is not Ending.FAILED:
            w.on_ended(trial_id, number, params, ended)  # a failure waits for its log's last lines
    trace(number, "told")
    _keep_logs(w, ctx, number)
    trace(number, "logs kept")
    _remove(w, ctx)
    trace(number, "removed")
    mark_removed(w.study, number)
    if ended.ending is Ending.FAILED and not ended.lines:
        ended = _with_kept_lines(ended, w.logs_dir / f"trial-{number}" / f"{metric_task(ctx.inventory)}.log")
    return ended


def _start(w: TrialWork, ctx: Context, trial_id: int, number: int) -> Ended | None:
    """Plan until the trial fits beside the other jobs (each poll one round trip per host),
    then apply. None: started. A plan with a problem is made once more before the trial
    fails: another runner's trial leaving a shared file may have been half-way."""
    second_look = True
    outcomes: dict[str, HostOutcome] = {}
    while True:
        if w.stop.is_set():
            return Ended(Ending.LEFT_RUNNING, "interrupted before it started")
        # Trials share the study's pushed files: a trial leaving takes a shared file away
        # only when no other job's manifest lists it, and an apply counting on it finds it
        # gone under the same lock on the host (a conflict: planned again, below).
        with w.starting:
            trace(number, "planning")
            try:
                plan = build_plan(ctx, checks=True)
                trace(number, "planned")
            except PlacementError as e:
                plan = None
                if not e.held:
                    return Ended(Ending.FAILED, e.message)
                w.waiting[number] = e.reason
            if plan is not None and not plan.problems:
                outcomes = apply_plan(ctx, plan, lambda line: None)
        if plan is None:
            beat(w.study, trial_id)
            time.sleep(w.poll)
            continue
        w.waiting.pop(number, None)
        if plan.problems and second_look:
            second_look = False
            time.sleep(w.poll)
            continue
        if plan.problems:
            return Ended(Ending.FAILED, plan.problems[0])
        trace(number, "applied")
        if any(o.lost_race for o in outcomes.values()):
            continue  # another trial took the GPUs first: plan again
        errors = [f"{n}: {o.error}" for n, o in outcomes.items() if o.error]
        if errors:
            _remove(w, ctx)
            return Ended(Ending.FAILED, errors[0])
        return None


def _follow(w: TrialWork, ctx: Context, trial_id: int, number: int) -> Ended:
    task = metric_task(ctx.inventory)
    trial = optuna.Trial(w.study, trial_id)
    told: set[int] = set()
    reports: tuple[Report, ...] = ()
    seen = False  # the job was found on its hosts at least once
    while True:
        # Read-only: an ended trial's leftovers are stopped by its removal, not here (two
        # round trips fewer between its end and the next trial's start on its GPUs).
        st, _ = look(ctx)
        if any(t.detail != "not applied" for t in st.tasks):
            seen = True
        elif not seen:
            return Ended(Ending.LOST, "not on its hosts any more (removed while no tune followed it)")
        try:
            reports = read_reports(ctx, task, w.tune) or reports
        except HostError:
            pass  # a host that does not answer now may at the next poll; status says so
        last = reports[-1] if reports else None
        for r in reports:
            if r.step not in told and not st.phase.ended:
                told.add(r.step)
                trial.report(r.value, r.step)
        beat(w.study, trial_id, steps=last.step if last else None, value=last.value if last else None)
        if st.phase.ended:
            trace(number, "ended")
            return _ending(w, st, reports)
        if w.stop.is_set():
            return Ended(Ending.LEFT_RUNNING, "tune was interrupted")
        if told and trial.should_prune():
            end_job(ctx, st)
            why = _median_words(w, last) if last else "the median rule"
            return Ended(Ending.STOPPED_EARLY, why, last.value if last else None, last.step if last else None)
        time.sleep(w.poll)


def _ending(w: TrialWork, st: JobStatus, reports: tuple[Report, ...]) -> Ended:
    last = reports[-1] if reports else None
    steps = last.step if last else None
    if st.phase is JobPhase.SUCCEEDED:
        value = measured(reports, w.tune.metric, w.tune.measurement)
        if value is None:
            return Ended(Ending.FAILED, f"no {w.tune.metric.name} reported (the job succeeded without one)")
        return Ended(Ending.SUCCEEDED, "", value, steps)
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


def _median_words(w: TrialWork, last: Report) -> str:
    """Why the median rule stopped it, with the numbers."""
    others = []
    for t in w.study.get_trials(deepcopy=False, states=(OptunaState.COMPLETE, OptunaState.PRUNED)):
        v = t.intermediate_values.get(last.step)
        if v is not None:
            others.append(v)
    name = w.tune.metric.name
    if not others:
        return f"{name}={last.value:.4g} at step {last.step}: the median rule"
    others.sort()
    mid = len(others) // 2
    median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
    return f"{name}={last.value:.4g} at step {last.step}, worse than the median {median:.4g} of {len(others)} earlier trials there"


def _keep_logs(w: TrialWork, ctx: Context, number: int) -> None:
    try:
        run_logs(ctx, out_dir=str(w.logs_dir / f"trial-{number}"), echo_err=lambda s: None)
    except (ProvisionError, HostError, OSError) as e:
        w.say(f"trial {number}: its logs could not be kept: {getattr(e, 'message', e)}")


def _remove(w: TrialWork, ctx: Context) -> None:
    """destroy, as `provision destroy` does it, under the trial's lock."""
    if ctx.lock is None:
        ctx.lock = ctx.state.store.lock("destroy").acquire()
    plan = destroy_plan(ctx)
    if plan.changed:
        destroy(ctx, plan)
