"""Following a job: status, the end-of-job stop, and wait.

When the job ends (success policy met, or a task failed for good) the tasks still running
(ps, reduction servers, evaluator, and PS-strategy workers that serve forever) are
stopped, as the managed services do: evaluator first, then chief and workers, then ps and
reduction servers. Every host that runs a task is marked (/etc/provision/<job>/lifecycle.json)
so that a no-op apply does not start the finished job again, and so that status can say
that provision stopped a task and why. Any command that sees the end does this: `status`,
`wait`, `apply --wait`. Stopping is idempotent: a command that sees an ended job with a
task still running (an earlier stop was interrupted) stops it again.
"""

from __future__ import annotations

import datetime as _dt
import functools
import time

import click

from .engine import Context, open_context, probe
from .errors import ProvisionError
from .host import layout
from .host.protocol import UnitsReport, UnitsRequest
from .lifecycle import JobPhase, TaskState, phases, stop_rank
from .ssh import Target, call_agent
from .state import StateLock
from .status import JobStatus, job_status
from .steps import Step, run_step


def _status(ctx: Context) -> tuple[JobStatus, list[str]]:
    """The status, and the reachable hosts without the end marker."""
    tasks = list(ctx.rendered.placement.tasks)
    hosts = {t.host.name for t in tasks} & set(ctx.targets)
    res = probe(ctx, files=False, only=hosts)
    st = job_status(ctx.inventory, tasks, res.ok, {n: e.message for n, e in res.errors.items()})
    return st, sorted(n for n, r in res.ok.items() if not r.lifecycle)


def collect(ctx: Context) -> JobStatus:
    """The job's status; when it has ended, stop what still runs and mark the hosts first.

    The stop takes the state's lock (an apply in progress owns the hosts: then this run only
    reports), and is left out when only some hosts were asked (--target): a part of the job
    cannot tell that the whole has ended."""
    st, unmarked = _status(ctx)
    if st.phase.ended and not ctx.subset:
        live = [t for t in st.tasks if t.state.live]
        if live or unmarked:
            lock = ctx.lock or StateLock(ctx.state.path, "end of job")
            if lock is ctx.lock or lock.try_acquire() is None:
                try:
                    end_job(ctx, st)
                finally:
                    if lock is not ctx.lock:
                        lock.release()
                st, _ = _status(ctx)
    return st


def end_job(ctx: Context, st: JobStatus) -> list[str]:
    """Mark every reachable host, then stop what still runs in stop order (the start order
    reversed: evaluator, then chief and workers, then ps and reduction servers). Returns the
    units stopped."""
    job = ctx.inventory.job
    marker = {
        "phase": st.phase.value,
        "reason": st.reason,
        "at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
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
            h: UnitsRequest(job, [["stop", batch.get(h, [])]], lifecycle=marker if first else None) for h in names
        }
        res = run_step(ctx.session, Step.END, functools.partial(_send, ctx, requests), targets)
        for h in res.ok:
            stopped += batch.get(h, [])
    return stopped


def _send(ctx: Context, requests: dict[str, UnitsRequest], t: Target) -> UnitsReport:
    report: UnitsReport = call_agent(ctx.session, t, requests[t.name])
    return report


def wait_for_job(
    inventory: str,
    *,
    state_path: str | None = None,
    timeout: float | None = None,
    interval: float = 2.0,
    verbose: bool = False,
    quiet: bool = False,
) -> int:
    """Block until the job succeeds (0) or fails (1); 1 on timeout too, saying so."""
    ctx = open_context(inventory, state_path=state_path, verbose=verbose, render_secrets=False)
    start = time.monotonic()
    last = None
    try:
        first = True
        while True:
            st = collect(ctx)
            if first and st.tasks and all(t.detail == "not applied" for t in st.tasks):
                raise ProvisionError(f"job {st.job} is not on its hosts: run `provision apply {inventory}` first")
            first = False
            line = f"job {st.phase}" + (f": {st.reason}" if st.reason else "")
            if st.unreachable:
                line += f" (unreachable: {', '.join(st.unreachable)})"
            if not quiet and line != last:
                click.echo(f"[{int(time.monotonic() - start)}s] {line}", err=True)
                last = line
            if st.phase is JobPhase.SUCCEEDED:
                return 0
            if st.phase is JobPhase.FAILED:
                return 1
            if timeout is not None and time.monotonic() - start > timeout:
                click.echo(f"Error: timed out after {timeout:g}s; the job is still {st.phase}", err=True)
                return 1
            time.sleep(interval)
    finally:
        ctx.close()
