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
import time

import click

from .engine import Context, open_context, probe
from .errors import ProvisionError
from .render import unit_name
from .ssh import HostError, call_agent
from .status import JobStatus, job_status

ENDED = ("Succeeded", "Failed")
# Stop order at the end of a job (cluster-env.md: stop in reverse start order).
STOP_RANK = {"evaluator": 0, "chief": 1, "worker": 1, "ps": 2, "reduction_server": 2}


def _status(ctx: Context) -> tuple[JobStatus, list[str]]:
    """The status, and the reachable hosts without the end marker."""
    assert ctx.rendered is not None
    tasks = [(t, unit_name(ctx.inventory.job, t.name)) for t in ctx.rendered.placement.tasks]
    hosts = {t.host.name for t, _ in tasks}
    reports = probe(ctx, facts=False, files=False, only=hosts)
    ok = {n: r for n, r in reports.items() if not isinstance(r, HostError)}
    bad = sorted(n for n, r in reports.items() if isinstance(r, HostError))
    st = job_status(ctx.inventory, tasks, ok, bad)
    return st, sorted(n for n, r in ok.items() if not r.get("lifecycle"))


def collect(ctx: Context) -> JobStatus:
    """The job's status; when it has ended, stop what still runs and mark the hosts first."""
    st, unmarked = _status(ctx)
    if st.phase in ENDED:
        live = [t for t in st.tasks if t.state in ("Running", "Restarting")]
        if live or unmarked:
            end_job(ctx, st)
            st, _ = _status(ctx)
    return st


def end_job(ctx: Context, st: JobStatus) -> list[str]:
    """Mark every reachable host, then stop what still runs: evaluator, then chief and
    workers, then ps and reduction servers. Returns the units stopped."""
    job = ctx.inventory.job
    marker = {
        "phase": st.phase,
        "reason": st.reason,
        "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    running = [t for t in st.tasks if t.state in ("Running", "Restarting", "Pending")]
    hosts = sorted({t.host for t in st.tasks if t.state != "Unknown"})
    stopped: list[str] = []
    for rank in (0, 1, 2):
        batch: dict[str, list[str]] = {}
        for t in running:
            if STOP_RANK[t.role] == rank:
                batch.setdefault(t.host, []).append(unit_name(job, t.task))
        first = rank == 0
        names = hosts if first else sorted(batch)
        targets = [ctx.targets[h] for h in names if h in ctx.targets]
        if not targets:
            continue
        res = ctx.session.map(
            lambda tg: call_agent(
                ctx.session, tg,
                {"op": "units", "job": job, "actions": [["stop", batch.get(tg.name, [])]],
                 "lifecycle": marker if first else None},
            ),
            targets,
        )
        for h, r in res.items():
            if not isinstance(r, HostError):
                stopped += batch.get(h, [])
    return stopped


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
                raise ProvisionError(
                    f"job {st.job} is not on its hosts: run `provision apply {inventory}` first"
                )
            first = False
            line = f"job {st.phase}" + (f": {st.reason}" if st.reason else "")
            if st.unreachable:
                line += f" (unreachable: {', '.join(st.unreachable)})"
            if not quiet and line != last:
                click.echo(f"[{int(time.monotonic() - start)}s] {line}", err=True)
                last = line
            if st.phase == "Succeeded":
                return 0
            if st.phase == "Failed":
                return 1
            if timeout is not None and time.monotonic() - start > timeout:
                click.echo(f"Error: timed out after {timeout:g}s; the job is still {st.phase}", err=True)
                return 1
            time.sleep(interval)
    finally:
        ctx.close()
