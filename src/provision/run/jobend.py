"""Following a job: status and the end-of-job stop (waiting for it: progress.wait_job).

When the job ends (success policy met, or a task failed for good) the tasks still running
(ps, reduction servers, evaluator, and PS-strategy workers that serve forever) are
stopped, as the managed services do: evaluator first, then chief and workers, then ps and
reduction servers. Every host that runs a task is marked (/etc/provision/<job>/lifecycle.json)
so that a no-op apply does not start the finished job again, and so that status can say
that provision stopped a task and why. Any command that sees the end does this: `status`,
`wait`, `apply --wait`. Stopping is idempotent: a command that sees an ended job with a
task still running (an earlier stop was interrupted) stops it again. So is a preemption:
a job preempted on some of its hosts is preempted on the others too (run/victim.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import time
from collections.abc import Iterator

import click

from provision.core.lifecycle import STOP_PHASE, TaskState, phases, stop_rank
from provision.core.target import Target
from provision.core.text import printable
from provision.host import layout
from provision.host.protocol import UnitsReport, UnitsRequest
from provision.io.journal import last_lines, setup_last_lines
from provision.io.ssh import call_agent
from provision.io.steps import Step, run_step
from provision.rules.checkpoints import copying
from provision.rules.checkpoints import view as ck_view
from provision.rules.gpuuse import with_task_util
from provision.rules.health import of_report
from provision.rules.progress import seen as progress_seen
from provision.rules.progress import watched
from provision.rules.recovery import awaits, judged
from provision.rules.status import JobStatus, job_status, left_behind, needs_lines, with_lines
from provision.rules.tenancy import holders, owner_problem
from provision.run.checkpoints import copy_dir, read_record
from provision.run.context import Ask, Context, probe
from provision.run.victim import preempt_whole


def _status(ctx: Context, *, util: bool = True) -> tuple[JobStatus, list[str], str | None, set[str]]:
    """The status, the reachable hosts without the end marker, why this state may not
    stop the job (another state owns it), if so, and the hosts the job left that still run
    some of it. `util`: each task's GPU utilization too (an nvidia-smi run on each host)."""
    tasks = list(ctx.rendered.placement.tasks)
    hosts = {t.host.name for t in tasks} & set(ctx.targets)
    # Hosts the job left that the state still records (an apply could not reach them).
    left = {n for n in ctx.state.hosts if n not in ctx.rendered.hosts and n in ctx.targets}
    # The shell probe (and the clocks for how long each task has been in its state); the
    # ledger says who owns the job, its listening ports are not needed; the GPUs' facts give
    # each task's utilization (the same nvidia-smi run plan's checks make, on GPU hosts only).
    inv = ctx.inventory
    ask = Ask(
        facts="check" if util else "none", files=False, tenancy=True, listening=False, clocks=True,
        health=util, progress=inv.progress is not None,
    )  # fmt: skip
    res = probe(ctx, ask, fast=True, only=hosts | left)
    answered = {n: r for n, r in res.ok.items() if n in hosts}
    st = job_status(inv, tasks, answered, {n: e.message for n, e in res.errors.items() if n in hosts})
    if inv.progress is not None or inv.recovery is not None:  # its progress, where it broke, its recoveries
        paths = {h: watched(inv, [t.name for t in ctx.rendered.placement.on_host(h)]) for h in hosts}
        now = time.time()
        healths = {h: of_report(r) for h, r in answered.items()}
        seen = progress_seen(paths, answered, now)
        st = judged(inv, st, seen, ctx.state.recovery, now, healths)
        if copying(inv) is not None:  # its newest checkpoint kept off its host, and how far behind
            st = dataclasses.replace(
                st, checkpoint_copy=ck_view(read_record(copy_dir(inv.path, inv.job)), seen.checkpoint)
            )
    st = with_task_util(st, answered) if util else st
    behind, running = [], set()
    for n in sorted(left):
        units = {t.unit: name for name, t in ctx.state.hosts[n].tasks.items()}
        err = res.errors.get(n)
        got = left_behind(n, units, res.ok.get(n), err.message if err else None)
        if got:
            behind.append(got[0])
            running |= {n} if got[1] else set()
    st = dataclasses.replace(st, left_behind=tuple(behind))
    wanted = needs_lines(st)
    if wanted:  # one more round trip, to the hosts of failed tasks only: their journal says why
        st = with_lines(ctx.inventory, st, last_lines(ctx.session, ctx.targets, ctx.inventory.job, wanted))
    if st.setup_failed:  # and to hosts whose setup failed: its last lines
        idents = {h: b.setup.log_identifier for h, b in ctx.rendered.hosts.items() if b.setup is not None}
        failed = [ctx.targets[h] for h in st.setup_failed if h in idents]
        setup = setup_last_lines(ctx.session, failed, idents)
        st = dataclasses.replace(st, setup_lines=setup)
    job, me = ctx.inventory.job, ctx.owner
    foreign, owner = None, None
    for n, r in res.ok.items():
        own = next((h for h in holders(n, r) if h.job == job), None)
        foreign = foreign or owner_problem(job, own, me, ctx.take_over)
        owner = owner or (own.owner.who if own is not None and own.owner is not None else None)
    st = dataclasses.replace(st, owner=owner)
    return st, sorted(n for n, r in res.ok.items() if not r.lifecycle and n in hosts), foreign, running


def collect(ctx: Context) -> JobStatus:
    """The job's status; when it has ended, stop what still runs and mark the hosts first.

    The stop takes the state's lock (an apply in progress owns the hosts: then this run only
    reports), and is left out when only some hosts were asked (--target): a part of the job
    cannot tell that the whole has ended."""
    st, unmarked, foreign, running_left = _status(ctx)
    if st.rest is not None and st.rest.stop and foreign is None and not ctx.subset:
        with _locked(ctx, "preempted whole") as mine:  # preempted on some hosts: on all (run/victim.py)
            if mine:
                preempt_whole(ctx, st.rest, lambda line: click.echo(printable(line), err=True), wait=False)
                st, unmarked, foreign, running_left = _status(ctx)
    if running_left and foreign is None:
        with _locked(ctx, "tasks left behind") as mine:
            if mine:
                leave_hosts(ctx, running_left)
                st, unmarked, foreign, _ = _status(ctx)
    if st.phase.ended and not ctx.subset and not awaits(ctx.inventory, st, ctx.state.recovery):
        live = [t for t in st.tasks if t.state.live]
        if (live or unmarked) and foreign is not None:
            # Reading is anyone's; ending another operator's job is its owner's call.
            click.echo(
                printable(f"Note: the job has ended, but its remaining tasks are left running: {foreign}"), err=True
            )
        elif live or unmarked:
            with _locked(ctx, "end of job") as mine:
                if mine:
                    end_job(ctx, st)
                    st, _, _, _ = _status(ctx)
    return st


@contextlib.contextmanager
def _locked(ctx: Context, why: str) -> Iterator[bool]:
    """The state's lock for a change status makes (an apply in progress owns the hosts:
    then nothing is changed, False)."""
    lock = ctx.lock or ctx.state.store.lock(why)
    if lock is ctx.lock or lock.try_acquire() is None:
        try:
            yield True
        finally:
            if lock is not ctx.lock:
                lock.release()
    else:
        yield False


def leave_hosts(ctx: Context, left: set[str]) -> None:
    """Hosts the job left while they were unreachable, now reached: their tasks stop and the
    job is marked left there, so that no boot starts them again beside their replacements
    (the next apply removes the rest)."""
    job = ctx.inventory.job
    marker = {"phase": "Left", "reason": "the job no longer runs on this host", "at": _now()}
    requests = {
        n: UnitsRequest(job, [["stop", sorted(t.unit for t in ctx.state.hosts[n].tasks.values())]], lifecycle=marker)
        for n in left
    }
    run_step(ctx.session, Step.END, functools.partial(_send, ctx, requests), [ctx.targets[n] for n in sorted(left)])


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def look(ctx: Context, *, util: bool = True) -> tuple[JobStatus, str | None]:
    """The status as the hosts report it, changing nothing, and why this state may not
    change the job (another state owns it), if so. `util=False`: without the GPUs'
    utilization (no nvidia-smi run: 50-300 ms of a host's CPU at each of a trial's looks)."""
    st, _, foreign, _ = _status(ctx, util=util)
    return st, foreign


def stop_marker(ctx: Context) -> dict[str, str]:
    """The end marker of `provision stop`: the job is Stopped (lifecycle.job_phase), and no
    apply or boot starts it again until `apply --rerun`."""
    return {"phase": STOP_PHASE, "reason": f"stopped by {ctx.owner.who} (provision stop)", "at": _now()}


def end_job(ctx: Context, st: JobStatus, *, marker: dict[str, str] | None = None, hold: bool = False) -> list[str]:
    """Mark every reachable host, then stop what still runs in stop order (the start order
    reversed: evaluator, then chief and workers, then ps and reduction servers). Returns the
    units stopped. `marker`: the end marker (default: the job's phase and why); `hold`: the
    hosts' ledger entries keep their GPUs and ports (`provision stop --hold`)."""
    job = ctx.inventory.job
    marker = marker or {
        "phase": st.phase.value,
        "reason": st.reason,
        "at": _now(),
    }
    running = [t for t in st.tasks if t.state.live or t.state is TaskState.PENDING]
    hosts = sorted({t.host for t in st.tasks if t.state is not TaskState.UNKNOWN})
    stopped: list[str] = []
    for rank, _ in enumerate(phases(stopping=True)):
        batch: dict[str, list[str]] = {}
        for t in running:
            if stop_rank(t.role) == rank:
                batch.setdefault(t.host, []).append(layout.unit_name(job, t.task))
        first = rank == 0
        names = hosts if first else sorted(batch)
        targets = [ctx.targets[h] for h in names if h in ctx.targets]
        if not targets:
            continue
        requests = {
            h: UnitsRequest(job, [["stop", batch.get(h, [])]], lifecycle=marker if first else None, hold=hold and first)
            for h in names
        }
        res = run_step(ctx.session, Step.END, functools.partial(_send, ctx, requests), targets)
        for h in res.ok:
            stopped += batch.get(h, [])
    return stopped


def _send(ctx: Context, requests: dict[str, UnitsRequest], t: Target) -> UnitsReport:
    report: UnitsReport = call_agent(ctx.session, t, requests[t.name])
    return report
