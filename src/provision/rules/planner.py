"""The planner: what every rule says about each host, folded into one Plan.

rules/plan.py holds the plan's nouns (HostPlan, FileChange, TaskChange) and the per-host
diff; this module makes the whole plan from what it is given: the rendered job, what each
host reported, and the findings of the other rules (images to ship, who holds the hosts,
programs that will not start, pre-flight checks). Once make_plan returns, nothing edits
the plan (Terraform's rule: a plan is data).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from provision.core.imagechange import ImageChange
from provision.core.target import HostError, Target
from provision.host.protocol import ProbeReport
from provision.rules.plan import HostPlan, Plan, Shared, as_a_unit, plan_host
from provision.rules.preflight import Status, judge
from provision.rules.tenancy import (
    Holder,
    Owner,
    gpu_uuids,
    owner_problem,
    reservation,
    unreadable_entries,
    unreadable_problem,
)
from provision.spec.placement import Placement
from provision.spec.render import Rendered
from provision.spec.tpu import coordinator_ports


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
            force_setup=force_setup,
            shared=(shared or {}).get(name),
        )
        for name, target in targets.items()
    ]
    plan = Plan(inv.job, plans)
    for hp in plan.hosts:  # a host the job leaves that cannot be told so: it keeps its tasks
        if hp.error is not None and hp.error.unreachable and hp.name not in hosts:
            hp.warnings.append(
                f"{hp.name} leaves the job but cannot be reached: its tasks stay there (and may start "
                "when it boots) until a command reaches it (status stops them, apply removes them)"
            )
    as_a_unit(plan, rendered, rerun=rerun, partial=partial)
    if tenancy is not None:
        _fold_tenancy(plan, tenancy, rendered.placement)
    for hp in plan.hosts:
        if hp.name in images.errors and hp.error is None:
            e = images.errors[hp.name]
            if e.unreachable:
                hp.error = e
            else:  # the host answered (its Docker engine did not): a problem that refuses the apply
                hp.problems.append(e.message)
        hp.images = list(images.changes.get(hp.name, []))
        if hp.report is not None and hp.bundle is not None:
            hp.warnings += (warnings or {}).get(hp.name, [])
    if checks is not None:
        _fold_checks(rendered, plan, checks)
    return plan


def _fold_tenancy(plan: Plan, t: Tenancy, placement: Placement | None = None) -> None:
    """Ownership (refuse another state's job) and the ledger entry each host needs (a TPU
    job's JAX coordinator port too: spec/tpu.py)."""
    job = plan.job
    ranked = [*placement.by_role("chief"), *placement.by_role("worker")] if placement is not None else []
    extra = coordinator_ports(ranked)
    for hp in plan.hosts:
        hs = t.held_by.get(hp.name)
        if hp.error is not None or hs is None or hp.report is None:
            continue
        own = next((h for h in hs if h.job == job), None)
        why = owner_problem(job, own, t.owner, t.take_over)
        if why is not None:
            hp.problems.append(why)
            continue
        bad = unreadable_entries(hp.report, but=job)
        if bad and hp.bundle is not None and hp.bundle.tasks:
            hp.problems.append(unreadable_problem(bad))
            continue
        if hp.bundle is not None:
            tasks = [u.task for u in hp.bundle.tasks]
            units = [u.unit for u in hp.bundle.tasks]
            more = [extra[hp.name]] if hp.name in extra else []
            hp.reserve = reservation(job, tasks, units, hs, t.owner, gpu_uuids(hp.report), more)


def _fold_checks(rendered: Rendered, plan: Plan, checks: Checks) -> None:
    """Only hosts that were checked: a settled host (run/context.settled), where nothing
    starts, is not."""
    checked: list[HostPlan] = [hp for hp in plan.hosts if hp.report is not None and hp.report.checks is not None]
    by_name = {hp.name: hp for hp in plan.hosts}
    for f in judge(rendered.inventory, Plan(plan.job, checked), checks.timings):
        hp = by_name[f.host]
        if f.check in ("ssh", "plan"):
            continue
        if f.status is Status.FAIL and f.detail not in hp.problems:
            hp.problems.append(f.detail)
        elif f.status is Status.WARN and f"{f.host}: {f.detail}" not in hp.warnings:
            hp.warnings.append(f"{f.host}: {f.detail}")


def make_destroy_plan(
    job: str, targets: Mapping[str, Target], reports: Mapping[str, ProbeReport | HostError], tenancy: Tenancy
) -> Plan:
    """Everything of the job removed from every host: no bundle anywhere."""
    plan = Plan(job, [plan_host(name, t, None, None, reports[name], job=job) for name, t in targets.items()])
    _fold_tenancy(plan, tenancy)
    return plan
