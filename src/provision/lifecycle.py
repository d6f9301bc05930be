"""Following a job: status, the end-of-job stop, and wait.

When the job ends (success policy met, or a task failed for good) the tasks still running
(ps, reduction servers, evaluator, and PS-strategy workers that serve forever) are
stopped, as the managed services do, and every host is marked so that a no-op apply does
not start the finished job again. Any command that sees the end does this: `status`,
`wait`, `apply --wait`.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time

import click

from .engine import Context, open_context, probe
from .render import unit_name
from .ssh import HostError, call_agent
from .status import JobStatus, job_status


def collect(ctx: Context) -> JobStatus:
    assert ctx.rendered is not None
    tasks = [(t, unit_name(ctx.inventory.job, t.name)) for t in ctx.rendered.placement.tasks]
    hosts = {t.host.name for t, _ in tasks}
    reports = probe(ctx, facts=False, files=False, only=hosts)
    ok = {n: r for n, r in reports.items() if not isinstance(r, HostError)}
    bad = sorted(n for n, r in reports.items() if isinstance(r, HostError))
    st = job_status(ctx.inventory, tasks, ok, bad)
    ended = [r.get("lifecycle") for r in ok.values() if r.get("lifecycle")]
    if st.phase in ("Succeeded", "Failed") and len(ended) < len(ok):
        end_job(ctx, st)
    return st


def end_job(ctx: Context, st: JobStatus) -> list[str]:
    """Stop what still runs (evaluator, then chief/workers, then ps/reduction servers) and mark the hosts."""
    job = ctx.inventory.job
    marker = {"phase": st.phase, "reason": st.reason, "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    running = [t for t in st.tasks if t.state in ("Running", "Restarting", "Pending")]
    order = {"evaluator": 0, "chief": 1, "worker": 1, "ps": 2, "reduction_server": 2}
    hosts = sorted({t.host for t in st.tasks if t.state != "Unknown"})
    stopped: list[str] = []
    for rank in (0, 1, 2):
        batch: dict[str, list[str]] = {}
        for t in running:
            if order[t.role] == rank:
                batch.setdefault(t.host, []).append(unit_name(job, t.task))
        last = rank == 2
        targets = [ctx.targets[h] for h in (hosts if last else sorted(batch))]
        if not targets:
            continue
        res = ctx.session.map(
            lambda tg: call_agent(ctx.session, tg, {"op": "units", "job": job, "actions": [["stop", batch.get(tg.name, [])]], "lifecycle": marker if last else None}),
            targets,
        )
        for h, r in res.items():
            if not isinstance(r, HostError):
                stopped += [u for u in batch.get(h, [])]
    return stopped


def wait_for_job(inventory: str, *, state_path: str | None = None, timeout: float | None = None, interval: float = 2.0, verbose: bool = False, quiet: bool = False) -> int:
    """Block until the job succeeds (0) or fails (1); 1 on timeout too, saying so."""
    ctx = open_context(inventory, state_path=state_path, verbose=verbose, render_secrets=False)
    start = time.monotonic()
    last = None
    try:
        while True:
            st = collect(ctx)
            line = f"job {st.phase}" + (f": {st.reason}" if st.reason else "")
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
