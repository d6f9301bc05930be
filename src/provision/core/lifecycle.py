"""A task's life and the job's, as rules: states, phases, orders, budgets and decisions. Pure.

The one place that decides
- in which order tasks start (ps and reduction servers, then chief and workers, then the
  evaluator) and stop (the reverse);
- how many automatic restarts a pool allows (rendered into the unit, counted by status);
- what state a task is in, from what systemd and the task's .exits records say;
- what phase the job is in (Pending, Running, Succeeded, Failed, Stopped);
- what plan does with a task (start, restart, stop or nothing) and why.
Enums, not free strings: their values are what users and --json see.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, TypedDict

from provision.core.explain import exit_words, reason
from provision.core.model import RestartPolicy
from provision.host import layout


class TaskState(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"
    UNKNOWN = "Unknown"  # its host did not answer

    @property
    def live(self) -> bool:
        return self in (TaskState.RUNNING, TaskState.RESTARTING)

    @property
    def ended(self) -> bool:
        return self in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.STOPPED)


class JobPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"  # `provision stop` ended it; `apply --rerun` starts it again
    # Higher-priority work took its GPUs: it holds nothing, and it is not over:
    # its owner's apply (or the service) resumes it, so `wait` and restart rules go on.
    PREEMPTED = "Preempted"
    # Its run broke (a host lost, a task failed, a hang): provision stops it everywhere,
    # sets the failed host aside and runs it again from its last checkpoint (run/recover.py).
    RECOVERING = "Recovering"
    UNKNOWN = "Unknown"

    @property
    def ended(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)


class Action(StrEnum):
    """What plan does with a task; the value is what --json shows."""

    START = "start"
    RESTART = "restart"
    STOP = "stop"
    NONE = "none"

    @property
    def starts(self) -> bool:
        return self in (Action.START, Action.RESTART)


class Reason(StrEnum):
    """Why plan decided a task's Action (like Terraform's ResourceInstanceChangeActionReason)."""

    NEW = "new task"
    REPLACE = "replace requested"
    INPUTS_CHANGED = "inputs changed"
    DRIFT = "edited by hand"
    RUNNING = "running"
    JOB_ENDED = "job ended"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED_BY_HAND = "stopped by hand"
    NOT_RUNNING = "not running"
    LEFT = "no longer in the inventory"
    WITH_JOB = "restarts with the job"
    RERUN = "rerun requested"
    RESUMED = "resumes after preemption"
    RECOVERED = "resumes after a recovery"


# --------------------------------------------------------------------------- orders

# Start order (cluster-env.md, Lifecycle): servers first, so chief and workers find them;
# the evaluator last, as it follows the chief's checkpoints.
START_ORDER: Mapping[str, int] = {"ps": 0, "reduction_server": 0, "chief": 1, "worker": 1, "evaluator": 2}
LAST_PHASE = max(START_ORDER.values())
# Pools whose tasks run until stopped; provision stops them when the job ends.
LONG_LIVED = frozenset({"ps", "reduction_server", "evaluator"})


# The end marker's phase that `provision stop` writes (jobend.stop_marker).
STOP_PHASE = JobPhase.STOPPED.value
# The marker's phase a preemption writes (host/preempt.py): the next start resumes.
PREEMPT_PHASE = JobPhase.PREEMPTED.value


def recovering(marker: Mapping[str, object] | None) -> bool:
    """Does the end marker say a recovery stopped the job (host/preempt.py writes a
    Preempted marker with the recovery in it: the same stop and resume)?"""
    return isinstance(marker, Mapping) and isinstance(marker.get("recovery"), dict)


def start_phase(role: str) -> int:
    return START_ORDER[role]


def stop_rank(role: str) -> int:
    """Stop order is the start order reversed: evaluator first, ps and reduction servers last."""
    return LAST_PHASE - START_ORDER[role]


def phases(*, stopping: bool = False) -> list[int]:
    """Start phases in the order they run (reversed when stopping)."""
    ordered = sorted(set(START_ORDER.values()))
    return ordered[::-1] if stopping else ordered


# --------------------------------------------------------------------------- restart budget


# ExitCode: exit codes 1..127 are the program's own verdict (no restart); above, a signal's.
EXIT_CODE_PREVENT = 127


def restart_budget(policy: RestartPolicy) -> int:
    """Automatic restarts a task of the pool may have after its first try."""
    return 0 if policy.policy == "Never" else policy.limit


def systemd_restart(policy: RestartPolicy) -> dict[str, object]:
    """The unit's Restart=, RestartPreventExitStatus= and StartLimitBurst= for a policy."""
    budget = restart_budget(policy)
    if budget == 0:
        return {"restart": "no", "restart_prevent": "", "start_limit_burst": 0}
    # systemd counts every start against StartLimitBurst, the first one too.
    if policy.policy == "Always":
        return {"restart": "always", "restart_prevent": "", "start_limit_burst": budget + 1}
    prevent = " ".join(str(c) for c in range(1, EXIT_CODE_PREVENT + 1)) if policy.policy == "ExitCode" else ""
    return {"restart": "on-failure", "restart_prevent": prevent, "start_limit_burst": budget + 1}


def restart_due(policy: RestartPolicy, record: Sequence[str]) -> bool:
    """Would systemd restart the task after this exit (its .exits record), budget aside?
    What systemd_restart renders: Always after any exit, OnFailure after a failure, ExitCode
    after a failure other than an exit code 1..127; never after a stop or a reboot's record
    (a reboot is on_reboot's), nor under Never."""
    if restart_budget(policy) == 0 or len(record) > 4 or len(record) < 4:
        return False
    _, result, kind, status = record[:4]
    if policy.policy == "Always":
        return True
    if result == "success":
        return False
    if policy.policy == "ExitCode":
        return not (kind == "exited" and status.isdigit() and 1 <= int(status) <= EXIT_CODE_PREVENT)
    return True


def _restart_due_sh(policy: RestartPolicy) -> str:
    """restart_due as a sh test on a record's words ($2 result, $3 kind, $4 status)."""
    if restart_budget(policy) == 0:
        return "false"
    if policy.policy == "Always":
        return "true"
    if policy.policy == "ExitCode":
        return f'[ "$2" != success ] && {{ [ "$3" != exited ] || [ "$4" -gt {EXIT_CODE_PREVENT} ]; }}'
    return '[ "$2" != success ]'


# --------------------------------------------------------------------------- reboots


class RebootAction(StrEnum):
    """What a task whose run a reboot ended does once its host is back."""

    RESTART = "restart"  # starts again by itself, counted as a restart against the limit
    FAIL = "fail"  # stays down: Failed, "host rebooted"


def on_reboot(policy: RestartPolicy) -> RebootAction:
    """OnFailure, ExitCode and Always bring the task back (a restart, while the budget
    lasts); Never, or no budget at all, leaves it Failed."""
    return RebootAction.FAIL if restart_budget(policy) == 0 else RebootAction.RESTART


RUN_LIVE, RUN_SHUTDOWN = "", layout.REBOOT_MARK  # the .run mark's contents (layout.py)


def gate(
    policy: RestartPolicy,
    exits: Sequence[Sequence[str]],
    *,
    rebooted: bool,
    run: str | None,
    job_ended: bool = False,
) -> tuple[bool, bool]:
    """(start?, write a reboot record?) for one start of a task through its unit's gate.

    The reference of what layout.exec_condition_command does on the host with boot_gate's
    values. `rebooted`: the first start since the host booted again (provision's own starts
    never are); `run`: the .run mark (None: no run was in progress; RUN_LIVE: one was when
    the host went down without a shutdown; RUN_SHUTDOWN: a shutdown ended it and wrote its
    record); `job_ended`: the job's end marker is on the host."""
    n = len(exits)
    add = False
    if rebooted:
        if job_ended:
            return False, False
        if run is not None:
            if run != RUN_SHUTDOWN:
                add, n = True, n + 1
            if on_reboot(policy) is RebootAction.FAIL:
                return False, add
        elif not exits or not restart_due(policy, exits[-1]):
            return False, False
    budget = restart_budget(policy)
    if budget and n > budget:
        return False, add
    return True, add


class BootGate(TypedDict):
    budget: int
    fail_on_reboot: bool
    restart_due: str


def boot_gate(policy: RestartPolicy) -> BootGate:
    """The values layout.exec_condition_command renders the gate with (gate is the rule)."""
    return {
        "budget": restart_budget(policy),
        "fail_on_reboot": on_reboot(policy) is RebootAction.FAIL,
        "restart_due": _restart_due_sh(policy),
    }


def _rebooted_at(record: Sequence[str]) -> str:
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record[0])))
    except (ValueError, OverflowError, OSError):
        when = "an unknown time"
    return f"host rebooted at {when}"


def ended_by_reboot(record: Sequence[str] | None) -> bool:
    """Was this exit the host going down (a shutdown's stop, or the gate's record of a crash)?"""
    return record is not None and len(record) > 4 and record[4] == layout.REBOOT_MARK


# --------------------------------------------------------------------------- task state

CLD_EXITED, CLD_KILLED, CLD_DUMPED = "1", "2", "3"  # systemd's ExecMainCode
_KIND = {CLD_EXITED: "exited", CLD_KILLED: "killed", CLD_DUMPED: "dumped"}


class TaskOutcome(NamedTuple):
    state: TaskState
    exit_code: int | None
    detail: str


def _how(kind: str, status: str) -> str:
    if kind == "none":
        return "between tries"
    if kind == "exited":
        return f"exit code {status}"
    sig = status if not status.isdigit() else None
    what = "core dumped, " if kind == "dumped" else ""
    return f"{what}killed by {'SIG' + sig if sig else 'signal ' + status}"


def task_state(
    unit: Mapping[str, str] | None,
    exits: Sequence[Sequence[str]] | None = None,
    ended: Mapping[str, object] | None = None,
    restart_limit: int | None = None,
) -> TaskOutcome:
    """The state of one task.

    `unit`: `systemctl show` properties; `exits`: the task's .exits records (layout.py; oldest
    first), which survive systemd unloading an inactive unit; `ended`: the job's end marker
    on this host, if any; `restart_limit`: the pool's restart budget, when known: a task
    waiting to restart that has spent it is Failed already (systemd would refuse the next
    start with "start request repeated too quickly").

    A run the host's reboot ended (ended_by_reboot) is named so, never taken for a stop: the
    task is back (Running, the reboot named), on its way back (Restarting: the boot has not
    reached the unit's gate yet), or Failed when its pool's policy or spent budget keeps it
    down (gate; with the limit unknown, on its way back) or Stopped when the job ended.
    """
    if not unit or unit.get("LoadState") in (None, "not-found"):
        if exits:  # the unit file is gone but the outcome was recorded
            unit = {"ActiveState": "inactive", "SubState": "dead"}
        else:
            return TaskOutcome(TaskState.PENDING, None, "not applied")
    active, sub = unit.get("ActiveState"), unit.get("SubState")
    last = list(exits[-1]) if exits else None
    rebooted = ended_by_reboot(last)
    if active in ("active", "reloading", "deactivating") or (active == "activating" and sub != "auto-restart"):
        detail = "stopping" if active == "deactivating" else (sub or "")
        if rebooted and last is not None:
            detail = f"{detail}; {_rebooted_at(last)}"
        return TaskOutcome(TaskState.RUNNING, None, detail)
    if rebooted and last is not None:
        return _after_reboot(last, exits, ended, restart_limit)
    if last is None:
        # No record yet: fall back to what systemd still remembers, if anything.
        code = unit.get("ExecMainCode", "0")
        if code == "0":
            return TaskOutcome(TaskState.PENDING, None, "not started")
        last = ["0", unit.get("Result", ""), _KIND.get(code, code), unit.get("ExecMainStatus", "0")]
    _, result, kind, status = last[:4]
    asked_stop = len(last) > 4 and last[4] == layout.STOP_MARK
    exit_code = int(status) if kind == "exited" and status.lstrip("-").isdigit() else None
    how = _how(kind, status)
    if asked_stop or (result == "success" and kind == "killed"):
        # Stopped on request: by provision at the end of the job, or by someone else.
        who = f"by provision: job {str(ended.get('phase', 'ended')).lower()}" if ended else "by hand"
        return TaskOutcome(
            TaskState.STOPPED, exit_code, f"stopped {who} ({'exited ' + status if kind == 'exited' else how})"
        )
    return _after_exit(unit, last, exits, restart_limit, exit_code)


def _spent(exits: Sequence[Sequence[str]] | None, restart_limit: int | None) -> bool:
    """The pool's restart budget is used up (every exit after the first run is a restart)."""
    return restart_limit is not None and exits is not None and len(exits) > restart_limit


def _after_reboot(
    last: Sequence[str],
    exits: Sequence[Sequence[str]] | None,
    ended: Mapping[str, object] | None,
    restart_limit: int | None,
) -> TaskOutcome:
    """A run the host's reboot ended: its own outcome first (it may be what ended the job),
    then the job's end."""
    if restart_limit == 0:
        return TaskOutcome(TaskState.FAILED, None, _rebooted_at(last))
    if _spent(exits, restart_limit):
        return TaskOutcome(TaskState.FAILED, None, f"{_rebooted_at(last)}, restart limit ({restart_limit}) reached")
    if ended:
        job = str(ended.get("phase", "ended")).lower()
        return TaskOutcome(TaskState.STOPPED, None, f"{_rebooted_at(last)}; not restarted: job {job}")
    return TaskOutcome(TaskState.RESTARTING, None, f"{_rebooted_at(last)}; starting again")


def _after_exit(
    unit: Mapping[str, str],
    last: Sequence[str],
    exits: Sequence[Sequence[str]] | None,
    restart_limit: int | None,
    exit_code: int | None,
) -> TaskOutcome:
    """A run that ended by itself: succeeded, failed (in words), or waiting to restart."""
    _, result, kind, status = last[:4]
    how = exit_words(kind, status, result)  # a failure: explained (explain.py)
    spent = _spent(exits, restart_limit)
    if unit.get("ActiveState") == "activating" and unit.get("SubState") == "auto-restart":
        if spent:
            if kind == "exited" and status == "0":
                return TaskOutcome(TaskState.SUCCEEDED, 0, "exited 0")
            return TaskOutcome(TaskState.FAILED, exit_code, f"{how}, restart limit ({restart_limit}) reached")
        return TaskOutcome(TaskState.RESTARTING, exit_code, f"last try: {how}")
    if kind == "exited" and status == "0":
        return TaskOutcome(TaskState.SUCCEEDED, 0, "exited 0")
    if unit.get("Result") == "start-limit-hit" or (restart_limit and spent):
        how += f", restart limit ({restart_limit if restart_limit is not None else '?'}) reached"
    return TaskOutcome(TaskState.FAILED, exit_code, how)


def restarts(unit: Mapping[str, str] | None, exits: Sequence[object] | None, state: TaskState | None = None) -> int:
    """Automatic restarts in the current run (every apply start resets the .exits record):
    every recorded exit was followed by a restart while the task runs or waits to restart;
    the last one was not once it ended."""
    n = len(exits or [])
    if state is not None and state.ended:
        return max(0, n - 1)
    running = (unit or {}).get("ActiveState") in ("active", "activating", "reloading", "deactivating")
    # A task on its way back after a reboot: the restart is under way (gate).
    return n if running or state is TaskState.RESTARTING else max(0, n - 1)


# --------------------------------------------------------------------------- job phase


@dataclass(frozen=True)
class TaskRow:
    """What the job's phase is decided from, per task."""

    task: str
    role: str
    host: str
    state: TaskState
    detail: str
    ended_at: float | None  # host clock of the exit that ended it


def _when(r: TaskRow) -> float:
    return r.ended_at if r.ended_at is not None else float("inf")


def job_phase(
    success_policy: str, rows: Iterable[TaskRow], stopped: Mapping[str, object] | None = None
) -> tuple[JobPhase, str]:
    """(phase, reason). Succeeded when the success policy holds (the chief exited 0; worker 0
    when there is no chief; every worker with `all_workers`) and no task had failed for good
    before that; Failed when one did first, or when every task ended without the policy
    holding; Running while any task runs; Pending before that.

    `stopped`: the end marker `provision stop` left on the hosts (STOP_PHASE). The job is
    Stopped, unless it had already succeeded or failed before the stop (on the hosts' clock:
    a worker that fails as its peers are stopped does not make the job Failed)."""
    phase, why, when = _phase(success_policy, list(rows))
    if stopped is None:
        return phase, why
    at = stopped.get("host_time")
    if phase in (JobPhase.SUCCEEDED, JobPhase.FAILED) and isinstance(at, (int, float)) and when < at:
        return phase, why
    if stopped.get("phase") == PREEMPT_PHASE and recovering(stopped):
        return JobPhase.RECOVERING, str(stopped.get("reason") or "recovering")
    if stopped.get("phase") == PREEMPT_PHASE:
        return JobPhase.PREEMPTED, str(stopped.get("reason") or "preempted")
    return JobPhase.STOPPED, str(stopped.get("reason") or "stopped")


def _phase(success_policy: str, rows: list[TaskRow]) -> tuple[JobPhase, str, float]:  # noqa: C901  the phase rules in the order they apply, one return per phase
    """job_phase without a stop, and when (host clock) the outcome was decided: inf when
    it was not, or not by a recorded exit."""
    failed = sorted((r for r in rows if r.state is TaskState.FAILED), key=_when)
    chief = [r for r in rows if r.role == "chief"]
    workers = [r for r in rows if r.role == "worker"]
    success: tuple[float, str] | None = None
    if success_policy == "all_workers":
        if workers and all(r.state is TaskState.SUCCEEDED for r in workers):
            success = (max(_when(r) for r in workers), "every worker exited 0")
    else:
        lead = chief[0] if chief else next((w for w in workers if w.task == "worker-0"), None)
        if lead is not None and lead.state is TaskState.SUCCEEDED:
            success = (_when(lead), f"{lead.task} exited 0")
    # A task that fails after the job succeeded (a worker losing its peers as the chief
    # leaves, say) does not undo the success; one that failed first decides the outcome.
    inf = float("inf")
    if failed and (success is None or _when(failed[0]) < success[0]):
        f = failed[0]
        return JobPhase.FAILED, f"{f.task} on {f.host} failed: {f.detail}", _when(f)
    if success is not None:
        return JobPhase.SUCCEEDED, success[1], success[0]
    if any(r.state.live for r in rows):
        return JobPhase.RUNNING, "", inf
    if rows and all(r.state is TaskState.PENDING for r in rows):
        return JobPhase.PENDING, "not started", inf
    if any(r.state is TaskState.UNKNOWN for r in rows):
        return JobPhase.UNKNOWN, "some hosts are unreachable", inf
    if any(r.state is TaskState.PENDING for r in rows):
        return JobPhase.PENDING, "", inf
    stopped = [r for r in rows if r.state is TaskState.STOPPED]
    if stopped:
        return (
            JobPhase.FAILED,
            f"every task ended without the success policy ({success_policy}) holding: "
            f"{stopped[0].task} was {stopped[0].detail}",
            inf,
        )
    return JobPhase.FAILED, f"every task ended without the success policy ({success_policy}) holding", inf


# --------------------------------------------------------------------------- plan decision


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason
    detail: str  # the words after the reason: what changed, how it failed
    drift: bool = False
    new: bool = False

    def describe(self) -> str:
        r = self.reason
        if r is Reason.INPUTS_CHANGED:
            return f"{self.detail or 'its inputs'} changed"
        if r is Reason.DRIFT:
            return f"drift: {self.detail} edited by hand"
        if r in (Reason.STOPPED_BY_HAND, Reason.NOT_RUNNING):
            return f"drift: {r.value}"
        if r is Reason.JOB_ENDED:
            return f"job {self.detail}; not restarted"
        if r is Reason.COMPLETED:
            return "completed (exit 0)"
        if r is Reason.FAILED:
            return self.detail
        if r is Reason.WITH_JOB:
            return f"restarts with the job ({self.detail}: its tasks run together)"
        return str(r.value)


def decide(
    task: str,
    in_manifest: bool,
    inputs_changed: bool,
    drifted: Sequence[str],
    unit: Mapping[str, str] | None,
    exits: Sequence[Sequence[str]] | None,
    ended: Mapping[str, object] | None,
    replace: bool,
    *,
    restart_limit: int | None = None,
) -> Decision:
    """What plan does with a task of the job that should run on this host.

    `in_manifest`: the host's manifest knows the task; `inputs_changed`: what it runs with
    differs from what the manifest recorded; `drifted`: its files edited by hand (or, with
    changed inputs, every changed file); `ended`: the job's end marker on the host;
    `restart_limit`: the pool's budget, so that plan and status judge a task by one rule
    (task_state): a `Never` task that a reboot ended is Failed for both.
    """
    if not in_manifest:
        return Decision(Action.START, Reason.NEW, "", new=True)
    if replace:
        return Decision(Action.RESTART, Reason.REPLACE, "")
    outcome = task_state(unit, exits, restart_limit=restart_limit)
    # A finished task (its job ended: succeeded, failed or stopped; or it exited for good)
    # is not started again by a change: apply writes the changed files, and `--rerun`
    # starts the job with them. The rule `finished` and --rerun use, so they agree.
    done = not outcome.state.live and (ended or outcome.state in (TaskState.SUCCEEDED, TaskState.FAILED))
    if inputs_changed and not done:
        return Decision(Action.RESTART, Reason.INPUTS_CHANGED, ", ".join(drifted))
    if drifted and not done:
        return Decision(Action.RESTART, Reason.DRIFT, ", ".join(drifted), drift=True)
    if outcome.state.live:
        return Decision(Action.NONE, Reason.RUNNING, "")
    if ended:
        return _after_end(ended)
    if outcome.state is TaskState.SUCCEEDED:
        return Decision(Action.NONE, Reason.COMPLETED, "")
    if outcome.state is TaskState.FAILED:
        return Decision(Action.NONE, Reason.FAILED, f"failed ({outcome.detail}); not restarted, use --replace {task}")
    if outcome.state is TaskState.STOPPED:
        return Decision(Action.START, Reason.STOPPED_BY_HAND, "", drift=True)
    return Decision(Action.START, Reason.NOT_RUNNING, "", drift=True)


def _after_end(ended: Mapping[str, object]) -> Decision:
    """A task of an ended job: left as it is, but a preempted job's apply resumes it."""
    if ended.get("phase") == PREEMPT_PHASE:
        return Decision(Action.RESTART, Reason.RECOVERED if recovering(ended) else Reason.RESUMED, "")
    return Decision(Action.NONE, Reason.JOB_ENDED, str(ended.get("phase", "ended")).lower())


def started_ok(unit: Mapping[str, str] | None, exits: Sequence[Sequence[str]] | None) -> bool:
    """Right after a start: is the task running, or did it already finish well?"""
    return task_state(unit, exits).state in (TaskState.RUNNING, TaskState.RESTARTING, TaskState.SUCCEEDED)


def needs_reset_failed(unit: Mapping[str, str] | None, policy: RestartPolicy) -> bool:
    """Before provision starts a unit systemd knows: does it need `systemctl reset-failed`?
    Only to leave the failed state, or to zero the start counter of a unit with a start
    limit (a restart budget: systemd_restart counts every start against StartLimitBurst=,
    provision's too).
    A unit without a limit that is not failed would gain nothing from it (one systemctl
    run saved per host when a job without restarts is changed)."""
    return restart_budget(policy) > 0 or (unit or {}).get("ActiveState") == "failed"


def never_loaded(unit: Mapping[str, str] | None) -> bool:
    """systemd knows nothing of the unit: no file was loaded and nothing runs under it (a
    first start needs no reset-failed or stop before it)."""
    return (
        unit is not None
        and unit.get("LoadState") == "not-found"
        and unit.get("ActiveState") == "inactive"
        and unit.get("SubState", "dead") == "dead"
    )


# --------------------------------------------------------------------------- the job as a unit


def synchronous(roles: Iterable[str]) -> bool:
    """Do the job's tasks run in lockstep (MWMS, DDP, JAX, all-reduce with reduction
    servers: every rank waits for every other), so that one restarting alone would leave
    the others waiting for it? Parameter-server jobs do not: workers come and go."""
    return "ps" not in set(roles)


FINISHED_REASONS = frozenset({Reason.JOB_ENDED, Reason.COMPLETED, Reason.FAILED})


def whole_job(decisions: Mapping[str, Decision], *, sync: bool, rerun: bool) -> dict[str, Decision]:
    """Plan's decisions for every task of the job, made job-wide:
    - rerun: every task starts again (the job must have finished: see `finished`);
    - a synchronous job restarts all its tasks when one of its existing tasks (re)starts.
    Tasks leaving the job (STOP) are left as they are."""
    if rerun:
        return {
            t: d if d.action is Action.STOP else Decision(Action.RESTART, Reason.RERUN, "")
            for t, d in decisions.items()
        }
    moving = sorted(t for t, d in decisions.items() if d.action.starts and not d.new)
    if not sync or not moving:
        return dict(decisions)
    why = ", ".join(moving[:3]) + (f" and {len(moving) - 3} more" if len(moving) > 3 else "")
    return {
        t: Decision(Action.RESTART, Reason.WITH_JOB, f"{why} restart{'s' if len(moving) == 1 else ''}")
        if d.action is Action.NONE
        else d
        for t, d in decisions.items()
    }


def finished(decisions: Mapping[str, Decision]) -> bool:
    """Has the job ended everywhere plan looked (what --rerun needs)?"""
    kept = [d for d in decisions.values() if d.action is not Action.STOP]
    return bool(kept) and all(d.action is Action.NONE and d.reason in FINISHED_REASONS for d in kept)


def start_failure(task: str, unit: dict[str, str], exits: Sequence[Sequence[str]] | None, lines: Sequence[str]) -> str:
    """Why a task that apply started is not running, from the unit's state right after the
    start, its exit records and its journal lines."""
    out = task_state(unit, exits)
    detail = out.detail
    if out.state.value == "Pending" or not detail:
        detail = f"{unit.get('Result', '?')}, exit status {unit.get('ExecMainStatus', '?')}"
    return reason(detail, out.exit_code, lines)
