"""Destroy: STOP phase by phase in reverse, then REMOVE everything, forgetting each host."""

from __future__ import annotations

import functools
import time

from provision.core.lifecycle import phases
from provision.core.model import Inventory
from provision.core.target import HostError, Target
from provision.host.protocol import (
    DestroyReport,
    DestroyRequest,
    UnitsReport,
    UnitsRequest,
)
from provision.io import images
from provision.io.ssh import call_agent
from provision.io.steps import Step, run_step
from provision.rules.plan import Plan
from provision.rules.planner import Tenancy, make_destroy_plan
from provision.rules.tenancy import holders
from provision.run.apply import HostOutcome
from provision.run.checkpoints import forget_copy
from provision.run.context import (
    Ask,
    Context,
    Progress,
    probe,
)


def destroy_plan(ctx: Context) -> Plan:
    reports = probe(ctx, Ask(tenancy=True, listening=False), fast=True)
    job, now = ctx.inventory.job, time.time()
    held_by = {n: holders(n, r, now) for n, r in reports.ok.items()}
    asked = {n: reports.get(n) for n in ctx.targets}
    return make_destroy_plan(job, ctx.targets, asked, Tenancy(ctx.owner, held_by, ctx.take_over))


def study_of(inv: Inventory) -> str:
    """The study a trial's job belongs to ("" for any other job): its removal leaves the
    shared setup to the study's next trials (host/setups.hold), until `provision destroy`
    of the study's inventory releases it."""
    if inv.tune is None or inv.tf_config.trial is None:
        return ""
    return inv.job.removesuffix(f"-t{inv.tf_config.trial}")


def _stop(ctx: Context, units: dict[str, list[str]], t: Target) -> UnitsReport:
    report: UnitsReport = call_agent(ctx.session, t, UnitsRequest(ctx.inventory.job, [["stop", units[t.name]]]))
    return report


def destroy(  # noqa: C901  destroy's steps in order (stop by phase, remove, images, forget)
    ctx: Context, plan: Plan, progress: Progress = lambda s: None, *, remove_images: bool = False
) -> dict[str, HostOutcome]:
    """Stop tasks in reverse start order across hosts, then remove every file (and, with
    remove_images, the container pools' images: shipped images stay by default)."""
    job = ctx.inventory.job
    outcomes = {
        h.name: HostOutcome(h.name, h.error.message if h.error else None, bool(h.error and h.error.unreachable))
        for h in plan.hosts
    }
    work = {h.name: h for h in plan.hosts if h.error is None and h.changed}
    for phase in phases(stopping=True):
        stoppers = {n: [x.unit for x in hp.stops() if x.phase == phase] for n, hp in work.items()}
        stoppers = {n: u for n, u in stoppers.items() if u and outcomes[n].error is None}
        if stoppers:
            res = run_step(
                ctx.session, Step.STOP, functools.partial(_stop, ctx, stoppers), [ctx.targets[n] for n in stoppers]
            )
            for n, e in res.errors.items():
                outcomes[n].fail(e)

    study = study_of(ctx.inventory)

    def remove(t: Target) -> DestroyReport:
        rep: DestroyReport = call_agent(ctx.session, t, DestroyRequest(job, hold_setup=study))
        if rep.errors:
            raise HostError(t, "; ".join(rep.errors))
        ctx.state.forget_host(t.name)
        progress(f"{t.name}: removed {rep.removed} file{'s' if rep.removed != 1 else ''}")
        return rep

    with ctx.state.deferred():  # a host left in the state by a kill is found empty next time
        removed = run_step(
            ctx.session, Step.REMOVE, remove, [ctx.targets[n] for n in work if outcomes[n].error is None]
        )
    for n, e in removed.errors.items():
        outcomes[n].fail(e)
    refs = list(dict.fromkeys(p.image for p in ctx.inventory.pools if p.image))
    if remove_images and refs and removed.ok:

        def rm_images(t: Target) -> None:
            ctx.session.run(t, images.remove_command(refs), timeout=300)
            progress(f"{t.name}: removed image{'s' if len(refs) != 1 else ''} {', '.join(refs)}")

        run_step(ctx.session, Step.REMOVE, rm_images, [ctx.targets[n] for n in removed.ok])
    if not ctx.subset and all(o.error is None for o in outcomes.values()):  # its checkpoint copy goes too
        forget_copy(ctx.inventory.path, ctx.inventory.job)
    # Hosts with nothing left are forgotten, so a second destroy is a clean no-op.
    with ctx.state.deferred():
        for h in plan.hosts:
            if h.error is None and not h.changed:
                ctx.state.forget_host(h.name)
    return outcomes
