"""The planner: what every rule says about each host, folded into one Plan.

rules/plan.py holds the plan's nouns (HostPlan, FileChange, TaskChange) and the per-host
diff; this module makes the whole plan from what it is given: the rendered job, what each
host reported, and the findings of the other rules (images to ship, who holds the hosts,
programs that will not start, pre-flight checks). Plan and HostPlan are frozen, their
lists tuples: each rule folded in here makes new values, and once make_plan returns
nothing can edit the plan (Terraform's rule: a plan is data, all apply needs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as with_fields

from provision.core.imagechange import ImageChange
from provision.core.target import HostError, Target
from provision.host.protocol import ProbeReport
from provision.placement.tasks import Placement
from provision.placement.tpu import coordinator_ports
from provision.render.files import Rendered
from provision.rules.plan import HostPlan, Plan, as_a_unit, plan_host
from provision.rules.preflight import Status, judge
from provision.rules.sharing import Shared
from provision.rules.tenancy import (
    Holder,
    Owner,
    Turn,
    gpu_uuids,
    owner_problem,
    reservation,
    unreadable_entries,
    unreadable_problem,
)


@dataclass(frozen=True)
class Images:
    """What io/images found: per host, the images to ship or pull, or why it cannot."""

    changes: Mapping[str, list[ImageChange]] = field(default_factory=dict)
    errors: Mapping[str, HostError] = field(default_factory=dict)


@dataclass(frozen=True)
class Tenancy:
    """Who holds each host (its ledger, rules/tenancy) and who is applying."""

    owner: Owner
    held_by: Mapping[str, list[Holder]]
    take_over: bool = False
    turn: Turn = Turn()  # the job's priority, preemptible, submission


@dataclass(frozen=True)
class Checks:
    """Fold the pre-flight checks in (hosts whose report carries them): failures refuse the
    apply, warnings are shown. timings: when each host was asked and answered (clocks)."""

    timings: Mapping[str, tuple[float, float]] = field(default_factory=dict)


def make_plan(
    rendered: Rendered,
    targets: Mapping[str, Target],
    reports: Mapping[str, ProbeReport | HostError],
    *,
    replace: set[str] | None = None,
    new_image: set[str] | None = None,
    rerun: bool = False,
    partial: bool = False,
    force_setup: bool = False,
    images: Images = Images(),
    tenancy: Tenancy | None = None,
    warnings: Mapping[str, list[str]] | None = None,
    checks: Checks | None = None,
    shared: Shared | None = None,
) -> Plan:
    """The whole plan. `warnings`: per host, what other rules warn of (programs.py);
    `shared`: per host, the pushed paths other jobs there list too (plan.owners_wanted)."""
    inv = rendered.inventory
    hosts = {h.name: h for h in inv.hosts}
    plans = [
        plan_host(
            name,
            target,
            hosts.get(name),
            rendered.hosts.get(name),
            reports[name],
            job=inv.job,
            secrets=rendered.secret_values,
            replace=replace,
            new_image=new_image,
            force_setup=force_setup,
            shared=(shared or {}).get(name),
        )
        for name, target in targets.items()
    ]
    plan = Plan(inv.job, tuple(_leaving_unreachable(hp, hosts) for hp in plans))
    plan = as_a_unit(plan, rendered, rerun=rerun, partial=partial)
    if tenancy is not None:
        plan = _fold_tenancy(plan, tenancy, rendered.placement)
    warned = warnings or {}
    plan = with_fields(plan, hosts=tuple(_fold_images(hp, images, warned.get(hp.name, ())) for hp in plan.hosts))
    if checks is not None:
        plan = _fold_checks(rendered, plan, checks)
    return plan


def _leaving_unreachable(hp: HostPlan, hosts: Mapping[str, object]) -> HostPlan:
    """A host the job leaves that cannot be told so: it keeps its tasks (a warning)."""
    if hp.error is None or not hp.error.unreachable or hp.name in hosts:
        return hp
    why = (
        f"{hp.name} leaves the job but cannot be reached: its tasks stay there (and may start "
        "when it boots) until a command reaches it (status stops them, apply removes them)"
    )
    return with_fields(hp, warnings=(*hp.warnings, why))


def _fold_images(hp: HostPlan, images: Images, warnings: Sequence[str]) -> HostPlan:
    """The images to ship or pull, the image check's error, and the other rules' warnings."""
    error, problems = hp.error, hp.problems
    if hp.name in images.errors and hp.error is None:
        e = images.errors[hp.name]
        if e.unreachable:
            error = e
        else:  # the host answered (its Docker engine did not): a problem that refuses the apply
            problems = (*problems, e.message)
    more = tuple(warnings) if hp.report is not None and hp.bundle is not None else ()
    return with_fields(
        hp,
        error=error,
        problems=problems,
        images=tuple(images.changes.get(hp.name, ())),
        warnings=(*hp.warnings, *more),
    )


def _fold_tenancy(plan: Plan, t: Tenancy, placement: Placement | None = None) -> Plan:
    """Ownership (refuse another state's job) and the ledger entry each host needs (a TPU
    job's JAX coordinator port too: placement/tpu.py)."""
    job = plan.job
    ranked = [*placement.by_role("chief"), *placement.by_role("worker")] if placement is not None else []
    extra = coordinator_ports(ranked)

    def fold(hp: HostPlan) -> HostPlan:
        hs = t.held_by.get(hp.name)
        if hp.error is not None or hs is None or hp.report is None:
            return hp
        own = next((h for h in hs if h.job == job), None)
        why = owner_problem(job, own, t.owner, t.take_over)
        if why is not None:
            return with_fields(hp, problems=(*hp.problems, why))
        bad = unreadable_entries(hp.report, but=job)
        if bad and hp.bundle is not None and hp.bundle.tasks:
            return with_fields(hp, problems=(*hp.problems, unreadable_problem(bad)))
        if hp.bundle is None:
            return hp
        tasks = [u.task for u in hp.bundle.tasks]
        units = [u.unit for u in hp.bundle.tasks]
        more = [extra[hp.name]] if hp.name in extra else []
        return with_fields(hp, reserve=reservation(job, tasks, units, hs, t.owner, gpu_uuids(hp.report), more, t.turn))

    return with_fields(plan, hosts=tuple(fold(hp) for hp in plan.hosts))


def _fold_checks(rendered: Rendered, plan: Plan, checks: Checks) -> Plan:
    """Only hosts that were checked: a settled host (run/context.settled), where nothing
    starts, is not."""
    checked = tuple(hp for hp in plan.hosts if hp.report is not None and hp.report.checks is not None)
    problems: dict[str, list[str]] = {hp.name: list(hp.problems) for hp in plan.hosts}
    warned: dict[str, list[str]] = {hp.name: list(hp.warnings) for hp in plan.hosts}
    for f in judge(rendered.inventory, Plan(plan.job, checked), checks.timings):
        if f.check in ("ssh", "plan"):
            continue
        if f.status is Status.FAIL and f.detail not in problems[f.host]:
            problems[f.host].append(f.detail)
        elif f.status is Status.WARN and f"{f.host}: {f.detail}" not in warned[f.host]:
            warned[f.host].append(f"{f.host}: {f.detail}")
    return with_fields(
        plan,
        hosts=tuple(
            with_fields(hp, problems=tuple(problems[hp.name]), warnings=tuple(warned[hp.name])) for hp in plan.hosts
        ),
    )


def make_destroy_plan(
    job: str, targets: Mapping[str, Target], reports: Mapping[str, ProbeReport | HostError], tenancy: Tenancy
) -> Plan:
    """Everything of the job removed from every host: no bundle anywhere."""
    plan = Plan(job, tuple(plan_host(name, t, None, None, reports[name], job=job) for name, t in targets.items()))
    return _fold_tenancy(plan, tenancy)
