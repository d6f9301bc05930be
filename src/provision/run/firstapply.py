"""A first apply in one round trip per host: planned from a presumed answer, the host's
probe, the ledger's compare-and-set, the write and the first start in one agent call.

A first apply (`apply -y`, the state knows none of the job's hosts) of a job for which plan
learns nothing from a host beyond "nothing of the job or of anyone's ledger is here, and
the GPUs the inventory declares, idle and healthy" (no setup, images, study, interface
lookup, TPUs) is planned from `presumed` answers, without a probe; each host's batch begins
with a guard (host/fresh.py) that probes and refuses, writing nothing, when the host is not
as presumed (a GPU fewer or of another model, one busy or failing, no room for `files:`).
The ledger's compare-and-set in the same call refuses a GPU another job took meanwhile,
and the host's health record one quarantined. A host that refuses (or cannot be reached)
is planned again from what it answered; when that plan changes what the hosts already
written were given (a problem, a task moved there), those hosts are cleared and the apply
runs as one that probes first would. Setup and images stay two steps: a setup's mark and
an image's presence decide what runs at all, and shipping an image is a transfer of its own.

PROVISION_FIRST_APPLY=probe turns this off (every apply probes first).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.model import Host, Inventory
from provision.core.target import HostError, Target
from provision.host.protocol import DestroyReport, DestroyRequest, FileInfo, FreshRequest, ProbeReport, ProbeRequest
from provision.io.ssh import call_agent
from provision.io.steps import Step, run_step
from provision.placement.tasks import place
from provision.render.clusterenv import uses_socket_ifname
from provision.render.files import FileKind, HostBundle
from provision.rules import provenance
from provision.rules.facts import needed as needed_facts
from provision.rules.hypertune import pythons
from provision.rules.plan import Plan
from provision.rules.planner import Checks, Images, Tenancy, make_plan
from provision.rules.preflight import (
    CLOCK_SKEW,
    DISK_MARGIN,
    GPU_TIMEOUT,
    Status,
    clock_offsets,
    clock_skews,
    driver_findings,
)
from provision.rules.programs import warnings as program_warnings
from provision.rules.tenancy import held_for
from provision.run.apply import HostOutcome, apply_plan
from provision.run.context import Ask, Context, Progress, probe_request
from provision.run.planning import build_plan

# How far a host's clock may be from the controller's, for a guard asked to compare (this
# module asks none: the clock is judged afterwards, as a warning).
SKEW = CLOCK_SKEW + 5.0


def eligible(ctx: Context, *, auto_approve: bool, flags: Mapping[str, object]) -> bool:
    """Whether this apply may plan without asking the hosts (module docstring)."""
    inv = ctx.inventory
    if os.environ.get("PROVISION_FIRST_APPLY", "") == "probe" or not auto_approve:
        return False  # asked: the answer takes longer than the round trip saved
    if any(v for k, v in flags.items() if k != "checks") or ctx.take_over or ctx.subset or ctx.dev is not None:
        return False
    if ctx.state.hosts:
        return False  # not a first apply (a killed one left records: they are looked at)
    if inv.setup or inv.tune or inv.tf_config.trial is not None:
        return False
    if uses_socket_ifname(inv) or any(p.image for p in inv.pools):
        return False
    if any(needed_facts(h) not in ([], ["gpus"]) or pythons(inv, h) for h in inv.hosts):
        return False  # TPUs: who holds the chips is asked first
    return bool(ctx.rendered.hosts) and all(n in ctx.targets for n in ctx.rendered.hosts)


def ask(checks: bool) -> Ask:
    """What build_plan would ask every host for this apply."""
    return Ask(facts="check", tenancy=True, checks=checks, interface=False)


def presumed(req: ProbeRequest, now: float, host: Host | None = None) -> ProbeReport:
    """The answer of a host with nothing of the job and nobody's ledger on it, to `req`,
    with the GPUs `host` declares (of its model, idle, healthy; their UUIDs the host fills
    in): host/fresh.refusals of it is empty (the host refuses whenever it answers otherwise)."""
    files: dict[str, FileInfo | None] = {p: None for p in (*req.want, *req.paths)}
    facts: dict[str, Any] = {"systemd_pid1": True}
    if "gpus" in req.facts_only and host is not None and host.accelerators is not None:
        facts["nvidia_smi"] = "ok"
        facts["gpus"] = [
            {"index": i, "uuid": "", "name": host.accelerators.type} for i in range(host.accelerator_count)
        ]
    for p in req.programs:
        files[p] = FileInfo("file", 0o755, 0)
    units = {u: {"Id": u, "LoadState": "not-found", "ActiveState": "inactive"} for u in req.units}
    return ProbeReport(
        files=files,
        units=units,
        exits={u: [] for u in req.units},
        facts=facts,
        now=now,
        ledger={},
        ledger_units={},
        listening=[],
        checks={"ports": {}} if req.checks is not None else None,
        listening_local=[],
        dropins=[],
        ledger_records={},
        health={},
    )


@dataclasses.dataclass(frozen=True)
class Presumed:
    """The plan made from presumed answers, and the probe each host's guard runs."""

    plan: Plan
    requests: Mapping[str, ProbeRequest]
    ports: Mapping[str, list[int]]


def presumed_plan(ctx: Context, *, checks: bool) -> Presumed | None:
    """The plan as build_plan would make it from hosts that answer `presumed`, or None when
    the placement around nothing held is not the one rendered (then probe first)."""
    now = time.time()
    requests = {n: probe_request(ctx, n, ask(checks)) for n in ctx.targets}
    reports = {n: presumed(r, now, ctx.host(n)) for n, r in requests.items()}
    held = {n: held_for(ctx.inventory.job, [], [], now, [], None) for n in ctx.targets if ctx.host(n) is not None}
    if place(ctx.inventory, ctx.state.previous_placement(), held) != ctx.rendered.placement:
        return None
    warnings = {
        n: program_warnings(ctx.inventory, n, b, None, ctx.state.keyed, reports[n].files, setup_pending=False)
        for n, b in ctx.rendered.hosts.items()
    }
    p = make_plan(
        ctx.rendered,
        ctx.targets,
        dict(reports),
        images=Images(),
        tenancy=Tenancy(ctx.owner, {n: [] for n in reports}, ctx.take_over, ctx.turn),
        warnings=warnings,
        checks=Checks({n: (now, now) for n in reports}) if checks else None,
    )
    ports = {n: sorted({u.task.port for u in b.tasks}) for n, b in ctx.rendered.hosts.items()}
    return Presumed(provenance.mark(p, ctx.state.hosts, ctx.state.keyed, ctx.owner.who), requests, ports)


def gpus_presumed(host: Host | None) -> dict[str, Any]:
    """What the guard holds a GPU host's GPUs to: as many as declared, every word of the type
    with a digit (the model: rules/preflight.gpu_model_problem) in their names, a size
    ('80gb') their memory within a tenth."""
    acc = host.accelerators if host is not None else None
    if acc is None or acc.kind != "gpu" or not acc.count:
        return {}
    words = [w for w in re.split(r"[^a-z0-9]+", acc.type.lower()) if w and any(c.isdigit() for c in w)]
    sizes = [int(m.group(1)) * 1024 for w in words if (m := re.fullmatch(r"(\d+)gb?", w))]
    return {
        "count": acc.count,
        "words": [w for w in words if not re.fullmatch(r"\d+gb?", w)],
        "mib": max(sizes, default=0),
    }


def room(inv: Inventory, bundle: HostBundle | None) -> dict[str, Any]:
    """What `files:` need on a host, per destination (each file once, under the longest
    destination holding it, as the disk check counts), and the margin beyond."""
    if not inv.files or bundle is None:
        return {}
    dests = {
        posixpath.normpath(s.dest if s.is_dir or s.dest.endswith("/") else posixpath.dirname(s.dest)) for s in inv.files
    }
    files = [f for f in bundle.files if f.kind is FileKind.FILE]
    need: list[list[Any]] = []
    counted: set[str] = set()
    for dest in sorted(dests, key=len, reverse=True):
        mine = [
            f for f in files if f.path not in counted and (f.path == dest or f.path.startswith(dest.rstrip("/") + "/"))
        ]
        counted |= {f.path for f in mine}
        need.append([dest, sum(len(f.content) if f.content is not None else _size(f.source) for f in mine)])
    return {"need": need, "margin": DISK_MARGIN}


def _size(path: str | os.PathLike[str] | None) -> int:
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0


def guard(ctx: Context, pre: Presumed, *, checks: bool) -> Callable[[Target], FreshRequest]:
    """Each host's guard (the probe it runs, the ports it binds, the GPUs and room it
    presumes)."""

    def one(t: Target) -> FreshRequest:
        req = pre.requests[t.name]
        gpus = gpus_presumed(ctx.host(t.name))
        # The job's ports are bound on the host to tell they are free (host/fresh.in_use),
        # not looked up among every listener (/proc/net/tcp costs the host ~7 ms); the other
        # checks but the GPUs' read nothing the guard does not (the room for files: is the
        # guard's; the clock is the report's): a host without GPUs loads no check module.
        gpu_check = {"gpus": True, "gpu_timeout": GPU_TIMEOUT} if gpus and checks else None
        asked = dataclasses.replace(req, listening=False, checks=gpu_check)
        # The clock is judged here afterwards, against the other hosts' (clock_warnings):
        # it is a warning, as in a probing plan, never a refusal.
        bundle = ctx.rendered.hosts.get(t.name)
        return FreshRequest(
            req.job, asked, pre.ports.get(t.name, []), gpus=gpus, room=room(ctx.inventory, bundle) if checks else {}
        )

    return one


def execute(
    ctx: Context,
    pre: Presumed,
    progress: Progress,
    *,
    checks: bool,
    again: Callable[[], dict[str, HostOutcome]],
    vet: Callable[[Plan], None],
) -> dict[str, HostOutcome]:
    """Apply the presumed plan in one round trip per host; hosts that refused are planned
    again from their answers and applied so; `again`: the apply as a probing one makes it,
    after the hosts this one wrote were cleared, when that cannot be done host by host.
    `vet` raises for a plan the command would not apply unasked (another's content)."""
    refused: dict[str, tuple[ProbeReport | None, list[str]]] = {}
    answers: dict[str, tuple[ProbeReport | None, float, float]] = {}
    outcomes = apply_plan(
        ctx, pre.plan, progress, guard=guard(ctx, pre, checks=checks), refused=refused, answers=answers
    )
    if checks:
        for line in clock_warnings(answers) + driver_warnings(answers):
            progress(line)
    if not refused or any(o.lost_race for o in outcomes.values()):
        return outcomes  # a lost reservation was rolled back as in any apply
    for n, (_, why) in sorted(refused.items()):
        progress(f"{n}: not as the plan presumed ({'; '.join(why)}): planning again")
    sub = dataclasses.replace(ctx, targets={n: ctx.targets[n] for n in refused}, subset=True)
    try:
        p2: Plan | None = build_plan(sub, checks=checks)
    except ProvisionError:  # held by other work, say: the whole apply decides (preemption, the queue)
        p2 = None
    wrote = [n for n in outcomes if n not in refused]
    # Placed again around what the host holds (a GPU taken or quarantined there), a task may
    # move on it alone: the hosts written keep theirs while their files are as rendered.
    moved = any(sub.rendered.hosts.get(n) != ctx.rendered.hosts.get(n) for n in wrote)
    if p2 is None or p2.problems or moved:
        clear(ctx, wrote, progress)
        return again()
    try:
        vet(p2)
    except (ProvisionError, SystemExit):  # refused as a probing apply would: before anything was written
        clear(ctx, wrote, progress)
        raise
    outcomes.update(apply_plan(sub, p2, progress))
    return outcomes


def clock_warnings(answers: Mapping[str, tuple[ProbeReport | None, float, float]]) -> list[str]:
    """The pre-flight clock check's warnings (rules/preflight), from the guards' answers:
    each host's clock against the other hosts', within when it was asked and answered."""
    nows = {n: r.now for n, (r, _, _) in answers.items() if r is not None and r.now is not None}
    skews = clock_skews(clock_offsets(nows, {n: (a, b) for n, (_, a, b) in answers.items()}))
    return [
        f"{n}: warning: clock {abs(s):.1f} s {'ahead of' if s > 0 else 'behind'} the other hosts' "
        f"(over {CLOCK_SKEW:g} s): timeouts and log times will not agree; is NTP running?"
        for n, s in sorted(skews.items())
        if abs(s) > CLOCK_SKEW
    ]


def driver_warnings(answers: Mapping[str, tuple[ProbeReport | None, float, float]]) -> list[str]:
    """The pre-flight driver check's warnings, from the GPU hosts' guards' answers."""
    found = driver_findings({n: r.checks or {} for n, (r, _, _) in answers.items() if r is not None})
    return [f"{f.host}: warning: {f.detail}" for f in found if f.status is Status.WARN]


def clear(ctx: Context, names: list[str], progress: Progress) -> None:
    """Take the job off hosts this apply brought it to (they had nothing of it before)."""

    def one(t: Target) -> None:
        rep: DestroyReport = call_agent(ctx.session, t, DestroyRequest(ctx.inventory.job))
        if rep.errors:
            raise HostError(t, "; ".join(rep.errors))
        ctx.state.forget_host(t.name)

    if names:
        res = run_step(ctx.session, Step.REMOVE, one, [ctx.targets[n] for n in sorted(names)])
        progress(f"cleared the job from {len(res.ok)} host{'s' if len(res.ok) != 1 else ''} to plan every host again")
