"""The preempted job's side: a synchronous job is preempted whole.

Its preemptor preempts it on the hosts the preemptor's inventory names; a job with tasks on
other hosts would keep them running, holding their GPUs, its ranks waiting for peers that
are gone. The preemptor may not connect to those hosts (another host's ledger naming them
is host-sent data, untrusted), so whoever acts for the job does it, with the job's own
inventory: the service watching it (serve/worker.py), its owner's `status` (run/jobend.py)
and `apply` (run/planning.py, before it plans the resume). When a host of the job marks it
Preempted (rules/preempted.rest), its other hosts are asked the same preemption
(PreemptRequest with `follows`): the same marker, deadline, signal and grace (the units'
own KillSignal= and TimeoutStopSec=), and no reservation for the preemptor there. The job
then ends one run everywhere, and its resume is one run on all hosts (PROVISION_RESUME=1).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from provision.core.target import HostError
from provision.host.protocol import PreemptReport, PreemptRequest
from provision.io.ssh import call_agent
from provision.rules.preempted import Rest
from provision.rules.status import job_status
from provision.run.context import Ask, Context, probe

# Both sides of a preemption wait the same: the preemptor for its victims (run/preempt.py),
# the victim's side for its own tasks. Beyond the grace: systemd's kill, the exit records and
# a probe take a moment.
MARGIN = float(os.environ.get("PROVISION_PREEMPT_MARGIN", 15))
TICK = float(os.environ.get("PROVISION_PREEMPT_TICK", 1))  # seconds between looks while tasks stop


def preempt_rest(ctx: Context, rest: Rest, progress: Callable[[str], None]) -> float:
    """Preempt the job on `rest.stop` (its hosts still running) as its marker on `rest.first`
    says: the longest grace its tasks got there (0: none could be asked now)."""
    job, mark = ctx.inventory.job, rest.mark
    req = PreemptRequest(
        job, mark.by, {"who": mark.who or "?"}, mark.priority or 0, mark.priority_name, 0, follows=rest.first
    )
    longest = 0.0
    for host in rest.stop:
        target = ctx.targets.get(host)
        if target is None:  # --target left it out: the whole job's commands reach it
            continue
        try:
            rep: PreemptReport = call_agent(ctx.session, target, req)
        except HostError as e:  # the next look asks again
            progress(f"{host}: cannot stop job {job} there now: {e.message}")
            continue
        if rep.errors:
            progress(f"{host}: stopping job {job}: {'; '.join(rep.errors)}")
        if rep.refused:
            progress(f"{host}: job {job} is being preempted there by {rep.refused} already")
            continue
        progress(
            f"job {job} was preempted on {rest.first} by {req.by}: preempted whole, its tasks on {host} "
            f"have {int(rep.grace)} s to save a checkpoint"
        )
        longest = max(longest, rep.grace)
    return longest


def wait_stopped(ctx: Context, hosts: tuple[str, ...], grace: float) -> bool:
    """Wait until the job's tasks on `hosts` have ended (within grace + MARGIN): True when
    they have."""
    tasks = [t for t in ctx.rendered.placement.tasks if t.host.name in hosts]
    until = time.monotonic() + grace + MARGIN
    while True:
        res = probe(ctx, Ask(files=False), fast=True, only=set(hosts))
        st = job_status(ctx.inventory, tasks, res.ok, {})
        if not any(t.state.live for t in st.tasks):
            return True
        if time.monotonic() > until:
            return False
        time.sleep(TICK)


def preempt_whole(ctx: Context, rest: Rest | None, progress: Callable[[str], None], *, wait: bool = True) -> bool:
    """Preempt the job whole: stop it where it still runs, and (`wait`) wait until its tasks
    have ended on every host (those told now, and those still stopping). True when it
    acted or waited."""
    if rest is None:
        return False
    grace = preempt_rest(ctx, rest, progress) if rest.stop else 0.0
    if wait:
        m = rest.mark
        left = max(0.0, m.deadline - m.at) if m.deadline is not None and m.at is not None else 0.0
        wait_stopped(ctx, tuple(sorted(set(rest.stop) | set(rest.stopping))), max(grace, left))
    return True
