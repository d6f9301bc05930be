"""What the job's network check asks: which peers each task dials, where listeners go, and
how the answers become findings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from provision.core.model import Inventory
from provision.host.protocol import NetcheckReport, NetcheckRequest
from provision.placement.tasks import PlacedTask, Placement
from provision.rules.plan import Plan
from provision.rules.preflight import (
    ALL_TO_ALL_HOSTS,
    NEIGHBOURS,
    NET_TIMEOUT,
    NET_WINDOW,
    Finding,
    Status,
    _mine,
    _own_units,
)


def peers(inv: Inventory, placement: Placement) -> dict[str, list[PlacedTask]]:
    """task → the tasks whose address it will dial (shared/spec/cluster-env.md): chief and
    workers dial each other (TF_CONFIG; MASTER_ADDR and the JAX coordinator are among them),
    every ps and every reduction server; parameter servers dial the scheduler (DMLC) when
    there is one; the evaluator, the chief. Past ALL_TO_ALL_HOSTS chief/worker hosts, each
    dials the master and its NEIGHBOURS next ones instead of all."""
    tasks = placement.tasks
    if len(tasks) <= 1:
        return {}
    group = [t for t in tasks if t.role in ("chief", "worker")]
    servers = [t for t in tasks if t.role in ("ps", "reduction_server")]
    master = group[0] if group else None
    big = len({t.host.name for t in group}) > ALL_TO_ALL_HOSTS
    out: dict[str, list[PlacedTask]] = {}
    for t in tasks:
        targets: list[PlacedTask] = []
        if t.role in ("chief", "worker"):
            if big:
                i = group.index(t)
                targets += ([master] if master else []) + [
                    group[(i + k) % len(group)] for k in range(1, NEIGHBOURS + 1)
                ]
            else:
                targets += group
            targets += servers
        elif t.role == "ps" and master is not None:
            targets.append(master)
        elif t.role == "evaluator":
            targets += [x for x in tasks if x.role == "chief"][:1]
        seen: dict[str, PlacedTask] = {}
        for x in targets:
            if x.name != t.name:
                seen.setdefault(x.name, x)
        out[t.name] = list(seen.values())
    return out


@dataclass
class NetFailure:
    from_host: str
    from_tasks: list[str]
    to_task: str
    address: str
    error: str

    @property
    def line(self) -> str:
        return f"{', '.join(self.from_tasks)} on {self.from_host} cannot reach {self.to_task} at {self.address} ({self.error})"

    def to_json(self) -> dict[str, Any]:
        return {
            "from_host": self.from_host,
            "from_tasks": self.from_tasks,
            "to_task": self.to_task,
            "address": self.address,
            "error": self.error,
            "line": self.line,
        }


@dataclass
class NetworkPlan:
    requests: dict[str, NetcheckRequest] = field(default_factory=dict)
    # host → per dial of its request: (target task, its address as rendered, the host's tasks that dial it)
    dials: dict[str, list[tuple[PlacedTask, list[str]]]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # what was not tried, and why
    taken: set[tuple[str, int]] = field(default_factory=set)  # (host, port) something else holds


def network_plan(inv: Inventory, plan: Plan, placement: Placement) -> NetworkPlan:  # noqa: C901  listeners, dialers and expected connections worked out in one pass over the hosts
    """Per host: the ports to listen on, the addresses to dial, and how many connections to
    wait for. Hosts that did not answer the probe take no part; a port something else holds
    is neither listened on nor dialed (the ports check says who holds it)."""
    job = inv.job
    ready = {hp.name: hp for hp in plan.hosts if hp.error is None and hp.report is not None and hp.bundle is not None}
    taken: set[tuple[str, int]] = set()
    answered: set[tuple[str, int]] = set()  # the job's own task listens: it answers itself
    for name, hp in ready.items():
        assert hp.report is not None and hp.bundle is not None
        owners = (hp.report.checks or {}).get("ports") or {}
        own = _own_units(job, hp.bundle, hp.report)
        for u in hp.bundle.tasks:
            holders = owners.get(str(u.task.port)) or []
            if holders and all(_mine(o, own, job) for o in holders):
                answered.add((name, u.task.port))
            elif holders:
                taken.add((name, u.task.port))
    net = NetworkPlan(taken=taken)
    dials: dict[str, dict[tuple[str, int], tuple[PlacedTask, list[str]]]] = {}
    for t, targets in peers(inv, placement).items():
        src = placement.task(t)
        if src.host.name not in ready:
            continue
        for x in targets:
            key = (x.host.name, x.port)
            if x.host.name not in ready:
                net.skipped.append(
                    f"{t} on {src.host.name} did not try {x.name} at {x.address}: {x.host.name} is not checked "
                    "(unreachable, or left out by --target)"
                )
                continue
            if key in taken:
                net.skipped.append(
                    f"{t} on {src.host.name} did not try {x.name} at {x.address}: the port is taken (see ports)"
                )
                continue
            entry = dials.setdefault(src.host.name, {}).setdefault(key, (x, []))
            entry[1].append(t)
    expect: dict[tuple[str, int], int] = {}
    for by_target in dials.values():
        for key in by_target:
            expect[key] = expect.get(key, 0) + 1
    window = max(NET_WINDOW, NET_TIMEOUT + 1.0)
    for name, hp in ready.items():
        assert hp.bundle is not None
        ports = sorted({u.task.port for u in hp.bundle.tasks} - {p for h, p in taken | answered if h == name})
        mine = dials.get(name, {})
        net.dials[name] = list(mine.values())
        net.requests[name] = NetcheckRequest(
            job=job,
            listen=ports,
            expect={str(p): expect[(name, p)] for p in ports if (name, p) in expect},
            dial=[[x.host.cluster_address, x.port] for x, _ in mine.values()],
            timeout=NET_TIMEOUT,
            window=window,
        )
    return net


def network_findings(
    net: NetworkPlan, results: Mapping[str, NetcheckReport | Exception], placement: Placement
) -> tuple[list[Finding], list[NetFailure]]:
    findings: list[Finding] = []
    failures: list[NetFailure] = []
    for name, req in net.requests.items():
        r = results.get(name)
        if not isinstance(r, NetcheckReport):
            why = getattr(r, "message", None) or str(r)
            findings.append(Finding(name, "network", Status.FAIL, f"the network check did not run here: {why}"))
            continue
        mine = []
        for (x, tasks), result in zip(net.dials[name], r.results):
            if result is not None:
                nf = NetFailure(name, sorted(tasks), x.name, x.address, result)
                mine.append(nf)
                findings.append(Finding(name, "network", Status.FAIL, nf.line))
        for port, err in sorted(r.listen_errors.items()):
            task = next((t.name for t in placement.on_host(name) if str(t.port) == port), "?")
            findings.append(
                Finding(name, "network", Status.FAIL, f"could not listen on port {port} ({task}) to test it: {err}")
            )
        failures += mine
        untested = [f"{t.port} ({t.name})" for t in placement.on_host(name) if (name, t.port) in net.taken]
        if untested:
            findings.append(
                Finding(name, "network", Status.SKIP, f"not tested: {', '.join(untested)}, taken by another process")
            )
        if not mine and not r.listen_errors:
            n = len(req.dial)
            findings.append(
                Finding(
                    name,
                    "network",
                    Status.PASS,
                    f"reached {n} address{'es' if n != 1 else ''}; listened on {len(req.listen)} port"
                    f"{'s' if len(req.listen) != 1 else ''} ({r.seconds:.2f} s)",
                )
            )
    return findings, failures
