"""A recovery, done: what rules/recovery.decide called for, acted on one job's Context (its
state locked), by the service (serve/recovery.py) or by the owner's next apply.

In order, each stage recorded in the job's state before it is acted on (a service killed in
the middle, or the next apply, goes on from the stage the state says: core/recovery.Stage):
1. STOPPING: a hang's look first (host/stacks.py: each task's processes and their states,
   its Python stacks into its log; a stopped or device-bound process names the host to set
   aside); then the whole job is stopped on every host of its placement that answers, as a
   preemption stops it (host/preempt.py: its units' own signal and grace, so its tasks save
   a checkpoint; the end marker says a recovery stopped it, and the next start resumes with
   PROVISION_RESUME=1), and waited for until its tasks have ended;
2. PLACING: the failed host is set aside for the job (its state's record: placement treats
   it as drained for this job alone), or only its failed GPUs where the evidence is a
   GPU's (rules/recovery.aside_of: the host answers and the task held GPUs; placement then
   withholds those GPUs from the job), and quarantined through the host's own health
   (set_aside_quarantine); the job is planned and applied again: only the replicas of
   what was set aside move (a spare, the same host's other free GPUs, or a free GPU
   elsewhere), each start resumes from the same AIP_CHECKPOINT_DIR;
3. DONE: its new run runs.
Nothing of the job starts before every task of the broken run has ended where its host
answers: the job never runs twice.

An elastic job's lost workers (rules/recovery.scale_up) are no incident: `grow` places them
again and starts them alone, in the run under way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from provision.core.errors import ProvisionError
from provision.core.recovery import Broke, Gpus, Incident, Stage
from provision.core.target import HostError
from provision.host import layout
from provision.host.protocol import HealthRequest, PreemptReport, PreemptRequest, StacksReport, StacksRequest
from provision.io.ssh import call_agent
from provision.placement.tasks import set_aside
from provision.render.files import render
from provision.rules import health as hl
from provision.rules.checkpoints import copying, saving_task
from provision.rules.health import Change, State, of_report
from provision.rules.progress import seen as progress_seen
from provision.rules.progress import watched
from provision.rules.recovery import (
    Do,
    Verdict,
    aside_of,
    decide,
    facts_of_status,
    sick_of,
    stacks_culprits,
    stall_of,
)
from provision.rules.status import job_status
from provision.run.apply import apply_plan
from provision.run.checkpoints import copy_job, put_back
from provision.run.context import Ask, Context, probe
from provision.run.health import look as health_look
from provision.run.health import send as send_health
from provision.run.planning import build_plan
from provision.run.victim import wait_stopped

Say = Callable[[str], None]


def recovery_by(job: str) -> str:
    """Who the health marks a recovery sets say set them."""
    return f"provision recovery of {job}"


def _broke_gpus(ctx: Context, inc: Incident, host: str) -> list[int]:
    """The GPUs of the job's tasks on `host` that broke (the failed task's, else every
    task's there)."""
    tasks = [t for t in ctx.rendered.placement.on_host(host) if not inc.task or t.name == inc.task or inc.host != host]
    return sorted({g for t in tasks for g in t.accelerators})


def _marks(ctx: Context, inc: Incident, host: str) -> list[int | None]:
    """What of `host` the incident quarantines: the GPUs it set aside there (a GPU's
    evidence), else those of the job's tasks there that broke, or the host itself when they
    hold none (a CPU host)."""
    gpus = dict(inc.gpus).get(host) or _broke_gpus(ctx, inc, host)
    return list(gpus) if gpus else [None]


def set_aside_quarantine(ctx: Context, inc: Incident, say: Say) -> None:
    """The failed host or GPU set aside for every job, through the hosts' health (host/
    health.py: a quarantine on the host's ledger, which placement keeps new work off and
    the service's health keeper tells as gpu.quarantined or host.drained): on each host of
    `inc.aside` that answers. A host that does not answer cannot take the mark: it is set
    aside for this job alone (its state's record), which placement honours as well."""
    job = ctx.inventory.job
    words = f"recovery of job {job}: {inc.words}"[: hl.TEXT]
    expect = (State.HEALTHY, State.SUSPECT)
    requests = {
        host: HealthRequest(job, [Change(g, State.QUARANTINED, expect, words, "", recovery_by(job), job).to_wire()
                                  for g in _marks(ctx, inc, host)])
        for host in inc.aside
        if host in ctx.targets and not (inc.broke is Broke.HOST and host == inc.host)
    }  # fmt: skip
    _send_health(ctx, requests, "quarantined", say)


def give_back_quarantine(ctx: Context, hosts: tuple[str, ...], say: Say) -> None:
    """The quarantines a recovery set on `hosts` taken away (the failure was the job's own):
    only the marks it set itself (the host refuses a mark that is otherwise now)."""
    job = ctx.inventory.job
    requests = {}
    for look in health_look(ctx, set(hosts) & set(ctx.targets)):
        marks = ([(None, look.health.host)] if look.health.host else []) + list(look.health.gpus.items())
        changes = [
            Change(g, State.HEALTHY, (State.QUARANTINED,), f"given back: job {job}'s own failure", "", recovery_by(job))
            for g, m in marks
            if m is not None and m.by == recovery_by(job) and m.state is State.QUARANTINED
        ]
        if changes:
            requests[look.name] = HealthRequest(job, [c.to_wire() for c in changes])
    _send_health(ctx, requests, "released", say)


def _send_health(ctx: Context, requests: dict[str, HealthRequest], did: str, say: Say) -> None:
    if not requests:
        return
    res = send_health(ctx, requests)
    for host, err in sorted(res.errors.items()):
        say(f"{host}: health not changed ({err.message}); the job keeps it aside itself")
    for host, rep in sorted(res.ok.items()):
        for why in rep.refused + rep.errors:
            say(f"{host}: {why}")
        if not rep.refused and not rep.errors:
            say(f"{host}: {did} for every job (provision health {host})")


def record(ctx: Context, inc: Incident, aside: tuple[str, ...] = (), gpus: Gpus = ()) -> Incident:
    """The incident (and the hosts, or GPUs, set aside) in the job's state, saved now."""
    rec = ctx.state.recovery.with_incident(inc)
    ctx.state.set_recovery(rec.with_aside(aside, gpus) if aside or gpus else rec)
    return inc


def aside_now(ctx: Context, inc: Incident, away: set[str]) -> tuple[tuple[str, ...], Gpus]:
    """What of the incident's hosts is set aside (rules/recovery.aside_of): each asked for
    its health once (a host that answers, and the GPUs its fatal marks name)."""
    hosts = set(inc.aside) - away
    looks = [x for x in health_look(ctx, hosts) if x.error is None] if hosts else []
    held = {h: _broke_gpus(ctx, inc, h) for h in inc.aside}
    return aside_of(inc, held, {x.name for x in looks}, {x.name: sick_of(x.health) for x in looks})


def stacks(ctx: Context, inc: Incident, say: Say) -> dict[str, list[str]]:
    """A hang's look on every answering host of the job: its Python stacks into its logs,
    and host -> its task processes' states."""
    job = ctx.inventory.job
    out: dict[str, list[str]] = {}
    for host in sorted({t.host.name for t in ctx.rendered.placement.tasks}):
        target = ctx.targets.get(host)
        if target is None:
            continue
        units = [layout.unit_name(job, t.name) for t in ctx.rendered.placement.on_host(host)]
        try:
            rep: StacksReport = call_agent(ctx.session, target, StacksRequest(job, units, inc.words), timeout=120)
        except HostError as e:
            say(f"{host}: no stacks taken: {e.message}")
            continue
        out[host] = [str(s) for t in rep.tasks.values() for s in (t.get("states") or {}).values()]
        if not any(t.get("py_spy") for t in rep.tasks.values()):
            say(f"{host}: py-spy is not installed: no Python stacks in the logs (pip install py-spy on the host)")
    return out


def stop_everywhere(ctx: Context, inc: Incident, away: set[str], say: Say) -> float:
    """Stop the job on every host of its placement that answers, as a preemption by the job
    itself (its GPUs wait for its own next run); the longest grace its tasks got."""
    job, owner, turn = ctx.inventory.job, ctx.owner, ctx.turn
    req = PreemptRequest(job, job, owner.to_json(), turn.priority, "", 0, recovery={"n": inc.n, "words": inc.words})
    hosts = sorted({t.host.name for t in ctx.rendered.placement.tasks} | set(ctx.state.hosts))
    longest = 0.0
    for host in hosts:
        target = ctx.targets.get(host)
        if target is None or host in away:
            continue
        try:
            rep: PreemptReport = call_agent(ctx.session, target, req)
        except HostError as e:  # it does not answer: its tasks are the lost ones
            say(f"{host}: not stopped ({e.message})")
            continue
        if rep.refused:
            raise ProvisionError(f"job {job} is being preempted by {rep.refused} on {host}: not recovered now")
        for why in rep.errors:
            say(f"{host}: {why}")
        longest = max(longest, rep.grace)
    return longest


def recover(ctx: Context, v: Verdict, say: Say, away: set[str] | None = None, *, start: bool = True) -> Incident:
    """Act on the verdict (RECOVER: a new incident, FINISH: the one under way) through its
    stages; `start` False stops after STOPPING, for an apply that goes on with its own plan.
    The incident as recorded at the end."""
    assert v.incident is not None and v.do in (Do.RECOVER, Do.FINISH)
    inc = v.incident
    away = set(away or ()) | (set(inc.aside) if inc.broke is Broke.HOST else set())
    if inc.stage is Stage.STOPPING:
        inc = _stop(ctx, inc, away, say)
    if inc.stage is Stage.PLACING:
        before = {t.name: t.host.name for t in ctx.rendered.placement.tasks}
        _set_aside(ctx, inc, say)
        _checkpoint_moves(ctx, before, away, say)
        if start:
            inc = _start(ctx, inc, say)
    return inc


def _checkpoint_moves(ctx: Context, before: dict[str, str], away: set[str], say: Say) -> None:
    """The resumed run finds its checkpoint where it expects it: when the saving rank
    moves, the newest copy off its old host (brought up to date first where that host still
    answers: its tasks saved one when stopped) is put into its new host's
    AIP_CHECKPOINT_DIR before the job starts (run/checkpoints.py)."""
    if copying(ctx.inventory) is None:
        return
    now = {t.name: t.host.name for t in ctx.rendered.placement.tasks}
    task = saving_task(now)
    if task is None or before.get(task) in (None, now[task]):
        return
    if before[task] not in away and before[task] in ctx.targets:
        try:
            copy_job(ctx, before, say, time.time())
        except (ProvisionError, HostError) as e:
            say(f"checkpoint copy from {before[task]}: {e.message} (the last copy is put back)")
    put_back(ctx, now, sorted(set(ctx.targets) - away), say)


def _stop(ctx: Context, inc: Incident, away: set[str], say: Say) -> Incident:
    if inc.broke in (Broke.HUNG, Broke.FAILED):
        # Its stacks into its logs. A rank stopped or stuck on a device is the culprit: of a
        # hang, and of a failure too (its peers fail when their collective times out).
        culprits = tuple(h for h in stacks_culprits(stacks(ctx, inc, say)) if h != inc.host)
        if culprits and (inc.broke is Broke.FAILED or not inc.aside):
            inc = dataclasses.replace(
                inc, aside=culprits, host=culprits[0], words=f"{inc.words}; stopped rank on {culprits[0]}"
            )
    record(ctx, inc)
    say(f"job {ctx.inventory.job}: {inc.words}: stopping it on every host that answers (its tasks save a checkpoint)")
    grace = stop_everywhere(ctx, inc, away, say)
    hosts = tuple(sorted({t.host.name for t in ctx.rendered.placement.tasks} - away))
    if not wait_stopped(ctx, hosts, grace):
        raise ProvisionError(f"job {ctx.inventory.job}: its tasks had not ended {int(grace)} s after the stop")
    whole, gpus = aside_now(ctx, inc, away)
    inc = dataclasses.replace(inc, stopped=time.time(), stage=Stage.PLACING, gpus=gpus)
    return record(ctx, inc, whole, gpus)


def _set_aside(ctx: Context, inc: Incident, say: Say) -> None:
    """The failed host or GPU quarantined (where it answers), and the job placed again
    without the hosts set aside for it (its state's), rendered."""
    if inc.aside:
        set_aside_quarantine(ctx, inc, say)
    rec = ctx.state.recovery
    ctx.inventory = set_aside(ctx.inventory, rec.aside, rec.gpu_map)
    ctx.rendered = render(
        ctx.inventory, previous=ctx.state.previous_placement(), secrets=ctx.secrets, socket_ifnames=ctx.ifnames
    )


def _start(ctx: Context, inc: Incident, say: Say) -> Incident:
    p = build_plan(ctx, checks=False, whole=say)
    if p.problems:
        raise ProvisionError(f"job {ctx.inventory.job}: not started again: {p.problems[0]}")
    outcomes = apply_plan(ctx, p, say)
    errors = [f"{o.name}: {o.error}" for o in outcomes.values() if o.error and o.name in ctx.rendered.hosts]
    if errors:
        raise ProvisionError(f"job {ctx.inventory.job}: not started again: {errors[0]}")
    new_run = inc.run + 1 if inc.run is not None else None  # the next run number (core/runs)
    inc = dataclasses.replace(inc, running=time.time(), stage=Stage.DONE, new_run=new_run)
    parts = dict(inc.gpus)
    without = [f"GPU {','.join(map(str, parts[h]))} of {h}" if h in parts else h for h in inc.aside]
    aside = f"; placed without {', '.join(without)}" if without else ""
    say(f"job {ctx.inventory.job} runs again (incident {inc.n}){aside}")
    return record(ctx, inc)


def grow(ctx: Context, v: Verdict, run: int | None, say: Say) -> dict[str, str]:
    """SCALE_UP acted on: the lost hosts set aside for the job (its state's record), their
    workers placed again (a spare, a free GPU elsewhere) and started there alone, in the
    run under way (`run`): torchrun's rendezvous takes the new nodes in and restarts its
    workers at the larger size; the running tasks are not touched. Task -> its new host."""
    job = ctx.inventory.job
    before = ctx.rendered.placement.slots()
    rec = ctx.state.recovery
    inv = set_aside(ctx.inventory, set(rec.aside) | set(v.hosts), rec.gpu_map)
    # Placed first, recorded after: a job with no room left stays as it is (and says so).
    rendered = render(inv, previous=ctx.state.previous_placement(), secrets=ctx.secrets, socket_ifnames=ctx.ifnames)
    moved = {n: s.host for n, s in rendered.placement.slots().items() if n not in before or before[n] != s}
    if set(moved) - set(v.tasks):
        others = ", ".join(sorted(set(moved) - set(v.tasks)))
        raise ProvisionError(f"job {job}: not scaled up: placing {', '.join(v.tasks)} again would move {others}")
    ctx.state.set_recovery(ctx.state.recovery.with_aside(v.hosts))
    ctx.inventory, ctx.rendered = inv, rendered
    there = dataclasses.replace(ctx, targets={h: ctx.targets[h] for h in set(moved.values())}, subset=True)
    say(f"job {job}: {v.words}: starting {', '.join(sorted(moved))} on {', '.join(sorted(set(moved.values())))}")
    p = build_plan(there, checks=False)
    if p.problems:
        raise ProvisionError(f"job {job}: not scaled up: {p.problems[0]}")
    outcomes = apply_plan(there, p, say, join_run=run)
    errors = [f"{o.name}: {o.error}" for o in outcomes.values() if o.error]
    if errors:
        raise ProvisionError(f"job {job}: not scaled up: {errors[0]}")
    return moved


def give_up(ctx: Context, v: Verdict, say: Say) -> Incident:
    """A broken job that is not recovered: recorded with why, and the hosts set aside for
    an earlier incident of the same failure given back (the job's own bug)."""
    assert v.incident is not None
    rec = ctx.state.recovery.with_incident(v.incident)
    ctx.state.set_recovery(rec.without_aside(v.give_back) if v.give_back else rec)
    if v.give_back:
        give_back_quarantine(ctx, v.give_back, say)
    say(f"job {ctx.inventory.job}: {v.words}")
    return v.incident


def close(ctx: Context, v: Verdict, started: float | None, run: int | None) -> Incident:
    """The recovery's run runs (the apply that started it was the owner's): done."""
    assert v.incident is not None
    inc = dataclasses.replace(v.incident, stage=Stage.DONE, running=v.incident.running or started, new_run=run)
    return record(ctx, inc)


def recover_first(ctx: Context, say: Say) -> bool:
    """The owner's apply of a job with `recovery:` (no service needed): one look at the job
    (its tasks, its progress); a run that broke is stopped everywhere and its failed host set
    aside before the apply plans, so the plan places its replicas again and resumes it (its
    end markers); a recovery under way is finished. True when it acted."""
    inv = ctx.inventory
    if inv.recovery is None or ctx.subset:
        return False
    tasks = list(ctx.rendered.placement.tasks)
    hosts = {t.host.name for t in tasks}
    ask = Ask(files=False, tenancy=True, listening=False, clocks=True, progress=inv.progress is not None)
    res = probe(ctx, ask, fast=True, only=hosts)
    st = job_status(inv, tasks, res.ok, {n: e.message for n, e in res.errors.items() if n in hosts})
    now = time.time()
    seen = progress_seen({h: watched(inv, [t.name for t in tasks if t.host.name == h]) for h in hosts}, res.ok, now)
    f = facts_of_status(
        st, seen, stall_of(inv, st, seen, now, ctx.state.recovery.learnt), {h: of_report(r) for h, r in res.ok.items()}
    )
    v = decide(inv.recovery, ctx.state.recovery, f, now, {t.name: t.host.name for t in tasks})
    if v.do is Do.GIVE_UP:
        give_up(ctx, v, say)
    elif v.do is Do.CLOSE:
        close(ctx, v, st.run.started_at if st.run is not None else None, f.run)
    elif v.do in (Do.RECOVER, Do.FINISH):
        recover(ctx, v, say, set(res.errors) & hosts, start=False)
        return True
    return False


def started_again(ctx: Context, errors: bool, say: Say) -> Incident | None:
    """After an apply: a recovery it was placing (recover_first) is done when the apply
    started the job without errors."""
    inc = ctx.state.recovery.open
    if inc is None or inc.stage is not Stage.PLACING or errors:
        return None
    new_run = inc.run + 1 if inc.run is not None else None
    inc = record(ctx, dataclasses.replace(inc, running=time.time(), stage=Stage.DONE, new_run=new_run))
    say(f"job {ctx.inventory.job} runs again (incident {inc.n})")
    return inc
