"""Plan: probe every host (one round trip each), place, render again where what other jobs
hold moved a task, and build the plan (rules/plan.make_plan) from what came back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from provision.core.errors import ProvisionError
from provision.core.imagechange import ImageChange
from provision.core.target import HostError, Target
from provision.host import layout
from provision.host.protocol import (
    OwnersReport,
    OwnersRequest,
    ProbeReport,
    ProbeRequest,
)
from provision.io import images
from provision.io.ssh import call_agent
from provision.io.steps import GroupResult, Step, run_step
from provision.placement.tasks import place
from provision.render.clusterenv import uses_socket_ifname
from provision.render.files import FileKind, render
from provision.rules import provenance
from provision.rules.health import of_report
from provision.rules.plan import Plan, owners_wanted
from provision.rules.planner import Checks, Images, Tenancy, make_plan
from provision.rules.programs import warnings as program_warnings
from provision.rules.queueorder import check_turn
from provision.rules.sharing import OtherJob, Shared, setup_done
from provision.rules.status import job_status
from provision.rules.tenancy import Hold, Holder, held_for, holders
from provision.run.context import (
    Ask,
    Context,
    Progress,
    probe,
    probe_request,
    settled,
    with_interfaces,
)
from provision.run.victim import preempt_whole


def _known_tasks(ctx: Context, replace: set[str]) -> None:
    names = {t.name for t in ctx.rendered.placement.tasks}
    unknown = sorted(replace - names)
    if unknown:
        raise ProvisionError(f"--replace: no task named {', '.join(unknown)} (tasks: {', '.join(sorted(names))})")


def _place_around_others(
    ctx: Context,
    ask: Ask,
    reports: GroupResult[ProbeReport],
    quiet: set[str],
    timings: dict[str, tuple[float, float]],
    now: float,
) -> tuple[GroupResult[ProbeReport], set[str]]:
    """Placement sees what other jobs hold; when that moves a task, render again and probe
    again the hosts whose question changed (only on shared hosts: the common case is one
    round trip). The reports and the settled hosts, after. A placement that fits still
    waits its turn behind waiting work ahead of it (rules/queueorder)."""

    def request(n: str) -> ProbeRequest:
        return probe_request(ctx, n, ask.settled() if n in quiet else ask)

    held_by = {n: holders(n, r, now) for n, r in reports.ok.items()}
    held = {
        n: held_for(
            ctx.inventory.job,
            hs,
            reports.ok[n].listening or [],
            now,
            reports.ok[n].listening_local or [],
            of_report(reports.ok[n]),  # what the host's health keeps from new work
        )
        for n, hs in held_by.items()
    }
    placement = place(ctx.inventory, ctx.state.previous_placement(), held)
    check_turn(ctx.inventory.job, ctx.turn, placement, held_by, now, ctx.policy)  # the queue's order
    if placement == ctx.rendered.placement:
        return reports, quiet
    before = {n: request(n) for n in ctx.targets}
    ctx.rendered = render(ctx.inventory, placement=placement, secrets=ctx.secrets, socket_ifnames=ctx.ifnames)
    quiet = {n for n in quiet if settled(ctx, n)}
    again = {n for n in ctx.targets if request(n) != before[n]}
    if again:
        reports = reports.updated(probe(ctx, ask, fast=True, only=again, timings=timings, quiet=quiet))
    return reports, quiet


def build_plan(
    ctx: Context,
    *,
    replace: set[str] | None = None,
    facts: bool = True,
    rerun: bool = False,
    partial: bool = False,
    force_setup: bool = False,
    checks: bool = False,
    thorough: bool = False,
    timings: dict[str, tuple[float, float]] | None = None,
    whole: Progress | None = None,
    owners_ahead: bool = False,
) -> Plan:
    """checks: the pre-flight checks in the same round trip (failures refuse the apply; a
    settled host is asked without). thorough: every host with everything (`provision
    check`). whole: _whole_first. owners_ahead: _owners_beside, beside the probe."""
    timings = {} if timings is None else timings
    _known_tasks(ctx, replace or set())
    ahead = _owners_beside(ctx) if owners_ahead else None
    interface = thorough or uses_socket_ifname(ctx.inventory)  # the cluster address's (check: always)
    ask = Ask(facts="check" if facts else "none", tenancy=True, checks=checks, interface=interface, health=thorough)
    forced = thorough or rerun or force_setup or bool(replace)
    quiet = set() if forced else {n for n in ctx.targets if settled(ctx, n)}
    reports = probe(ctx, ask, fast=True, timings=timings, quiet=quiet)
    reports = _whole_first(ctx, ask, reports, whole, quiet, timings)
    now = time.time()
    reports, quiet = _place_around_others(ctx, ask, reports, quiet, timings, now)
    held_by = {n: holders(n, r, now) for n, r in reports.ok.items()}
    with_interfaces(ctx, reports)  # NCCL's and Gloo's interface, as the hosts report it
    shipping, image_errors, image_restarts = _image_changes(ctx, reports)

    def plan_now(shared: Shared | None = None) -> Plan:
        asked = {n: reports.get(n) for n in ctx.targets}
        return make_plan(
            ctx.rendered,
            ctx.targets,
            asked,
            replace=replace or None,
            new_image=image_restarts,
            rerun=rerun,
            partial=partial,
            force_setup=force_setup,
            images=Images(shipping, image_errors),
            tenancy=Tenancy(ctx.owner, held_by, ctx.take_over, ctx.turn),
            warnings=_program_warnings(ctx, asked),
            checks=Checks(timings) if checks else None,
            shared=shared,
        )

    p = plan_now()
    drifted = {hp.name for hp in p.hosts if hp.name in quiet and hp.error is None and hp.changed}  # asked in full
    if drifted:
        quiet -= drifted
        reports = reports.updated(probe(ctx, ask, fast=True, only=drifted, timings=timings))
        held_by = {n: holders(n, r, now) for n, r in reports.ok.items()}
        with_interfaces(ctx, reports)
        p = plan_now()
    shared = _other_owners(ctx, p, held_by, ahead)  # pushed files other jobs have too
    return provenance.mark(plan_now(shared) if shared else p, ctx.state.hosts, ctx.state.keyed, ctx.owner.who)


def _whole_first(
    ctx: Context,
    ask: Ask,
    reports: GroupResult[ProbeReport],
    whole: Progress | None,
    quiet: set[str],
    timings: dict[str, tuple[float, float]],
) -> GroupResult[ProbeReport]:
    """An apply (`whole`: its progress) of a job preempted on some of its hosts preempts it
    on the others first, and waits until its tasks have ended everywhere (run/victim.py):
    its resume is one run on all its hosts. `provision plan` (None) changes nothing. The
    reports, as the hosts are after."""
    if whole is None or ctx.subset:  # --target: a part of the job cannot tell the whole
        return reports
    st = job_status(ctx.inventory, list(ctx.rendered.placement.tasks), reports.ok, {})
    if not preempt_whole(ctx, st.rest, whole):
        return reports
    return probe(ctx, ask, fast=True, timings=timings, quiet=quiet)


Asked = dict[str, tuple[list[str], OwnersReport]]  # host -> the paths asked, the answer


def _owners_beside(ctx: Context) -> Callable[[], Asked]:
    """The other owners of every file the job pushes (and of its setup's unit), asked on a
    thread now, beside the probe; the function returned waits for the answers (the hosts
    that gave one)."""
    paths: dict[str, list[str]] = {}
    for name, b in ctx.rendered.hosts.items():
        mine = [f.path for f in b.files if f.kind is FileKind.FILE]
        mine += [layout.setup_unit_path(b.setup.key)] if b.setup is not None else []
        if mine and name in ctx.targets:
            paths[name] = sorted(mine)
    got: Asked = {}

    def ask(t: Target) -> OwnersReport:
        rep: OwnersReport = call_agent(ctx.session, t, OwnersRequest(ctx.inventory.job, paths[t.name]))
        got[t.name] = (paths[t.name], rep)
        return rep

    thread = threading.Thread(
        target=lambda: run_step(ctx.session, Step.PROBE, ask, [ctx.targets[n] for n in sorted(paths)]), daemon=True
    )
    thread.start()

    def wait() -> Asked:
        thread.join()
        return got

    return wait


def _other_owners(
    ctx: Context, p: Plan, held_by: Mapping[str, list[Holder]], ahead: Callable[[], Asked] | None = None
) -> Shared:
    """host -> path -> the other jobs whose manifests there list it (and who applied them,
    as the host's ledger says), for the paths plan must judge so (a variant of a job pushes
    the same files): one more round trip, only to those hosts, unless they were asked
    beside the probe (`ahead`: every path wanted among those asked). A host that does not
    answer is judged without it: plan then refuses what it cannot tell from a host's own file."""
    wanted = {hp.name: owners_wanted(hp) for hp in p.hosts if hp.error is None}
    wanted = {n: w for n, w in wanted.items() if w}
    if not wanted:
        return {}
    answered: dict[str, OwnersReport] = {}
    for name, (asked, rep) in (ahead() if ahead is not None else {}).items():
        if name in wanted and set(wanted[name]) <= set(asked):
            answered[name] = OwnersReport({k: v for k, v in rep.owners.items() if k in wanted[name]})

    def ask(t: Target) -> OwnersReport:
        rep: OwnersReport = call_agent(ctx.session, t, OwnersRequest(ctx.inventory.job, wanted[t.name]))
        return rep

    rest = [ctx.targets[n] for n in sorted(wanted) if n not in answered]
    res = run_step(ctx.session, Step.PROBE, ask, rest) if rest else None
    out: dict[str, dict[str, list[OtherJob]]] = {}
    for name, rep in {**answered, **(res.ok if res is not None else {})}.items():
        who = {h.job: h.who for h in held_by.get(name, [])}
        idle = {h.job for h in held_by.get(name, []) if h.hold in (Hold.ENDED, Hold.HELD, Hold.STALE)}
        for path, jobs in rep.owners.items():
            out.setdefault(name, {})[path] = [
                OtherJob(j, sha, who.get(j, "?"), running=j not in idle) for j, sha in sorted(jobs.items())
            ]
    return out


def _program_warnings(ctx: Context, reports: Mapping[str, ProbeReport | HostError]) -> dict[str, list[str]]:
    """Per host: programs a task would start that the host lacks (rules/programs)."""
    out = {}
    for name, bundle in ctx.rendered.hosts.items():
        r = reports.get(name)
        if isinstance(r, ProbeReport):
            rec = ctx.state.hosts.get(name)
            pending = bundle.setup is not None and not setup_done(bundle.setup, r)
            out[name] = program_warnings(
                ctx.inventory, name, bundle, rec, ctx.state.keyed, r.files, setup_pending=pending
            )
    return out


def _image_changes(
    ctx: Context, reports: GroupResult[ProbeReport]
) -> tuple[dict[str, list[ImageChange]], dict[str, HostError], set[str]]:
    """The images each host must get before its tasks start (images.py): one more round
    trip, only to hosts that run a container pool. Tasks whose image the host has with
    another ID restart with the new one."""
    roles = {name: [u.task.role for u in b.tasks] for name, b in ctx.rendered.hosts.items() if name in reports.ok}
    changes, errors = images.plan_images(ctx.session, ctx.inventory, roles, ctx.targets)
    restarts: set[str] = set()
    for name, todo in changes.items():
        replaced = {c.ref for c in todo if c.replaces}
        for u in ctx.rendered.hosts[name].tasks:
            pool = ctx.inventory.pool(u.task.role)
            if pool is not None and pool.image in replaced:
                restarts.add(u.task.name)
    return changes, errors, restarts
