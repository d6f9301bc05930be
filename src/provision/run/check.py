"""`provision check`: the pre-flight checks of every host (rules/preflight) and the job's own
network (rules/network: listeners on each host, dialled from the others)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from provision.host.protocol import NetcheckReport
from provision.io.ssh import call_agent
from provision.io.steps import Step, run_step
from provision.rules.network import NetFailure, network_findings, network_plan
from provision.rules.plan import Plan
from provision.rules.preflight import FORMAT_VERSION, ORDER, Finding, Status, judge
from provision.run.context import (
    Context,
)
from provision.run.planning import build_plan


@dataclass
class CheckResult:
    job: str
    plan: Plan
    findings: list[Finding]
    failures: list[NetFailure] = field(default_factory=list)
    network: bool = False
    network_seconds: float | None = None
    skipped: list[str] = field(default_factory=list)

    @property
    def unreachable(self) -> list[str]:
        return [h.name for h in self.plan.unreachable]

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status is Status.FAIL]

    @property
    def warned(self) -> list[Finding]:
        return [f for f in self.findings if f.status is Status.WARN]

    @property
    def exit_code(self) -> int:
        if self.unreachable:
            return 3
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "job": self.job,
            "ok": not self.failed and not self.unreachable,
            "unreachable": self.unreachable,
            "hosts": {
                hp.name: {
                    "address": hp.target.where,
                    "error": hp.error.message if hp.error else None,
                    "unreachable": bool(hp.error and hp.error.unreachable),
                    "checks": [f.to_json() for f in self.findings if f.host == hp.name],
                }
                for hp in self.plan.hosts
            },
            "network": {
                "checked": self.network,
                "seconds": self.network_seconds,
                "failures": [f.to_json() for f in self.failures],
                "not_tried": self.skipped,
            },
            "failures": [f"{f.host}: {f.detail}" if f.check != "network" else f.detail for f in self.failed],
            "warnings": [f"{f.host}: {f.detail}" for f in self.warned],
        }


def run_check(
    ctx: Context, *, skip_network: bool = False, progress: Callable[[str], None] = lambda s: None
) -> CheckResult:
    """plan's round trip with the checks (failures of the plan itself shown too), then the
    network's, unless skipped or no host answered."""

    timings: dict[str, tuple[float, float]] = {}
    p = build_plan(ctx, checks=True, thorough=True, timings=timings)
    findings = judge(ctx.inventory, p, timings)
    covered = {(f.host, f.detail) for f in findings}
    for hp in p.hosts:
        for problem in hp.problems:
            if (hp.name, problem) not in covered:
                findings.append(Finding(hp.name, "plan", Status.FAIL, problem))
    res = CheckResult(ctx.inventory.job, p, findings)
    if skip_network:
        res.findings = _ordered(res.findings, p)
        return res
    net = network_plan(ctx.inventory, p, ctx.rendered.placement)
    res.skipped = net.skipped
    if net.requests:
        timeout = max(r.window for r in net.requests.values()) + 60

        def one(t: Any) -> NetcheckReport:
            report: NetcheckReport = call_agent(ctx.session, t, net.requests[t.name], timeout=timeout)
            return report

        started = time.monotonic()
        got = run_step(ctx.session, Step.NETWORK, one, [ctx.targets[n] for n in net.requests])
        res.network, res.network_seconds = True, round(time.monotonic() - started, 3)
        results: dict[str, NetcheckReport | Exception] = {**got.ok, **got.errors}
        more, res.failures = network_findings(net, results, ctx.rendered.placement)
        res.findings += more
    res.findings = _ordered(res.findings, p)
    return res


def _ordered(findings: list[Finding], p: Plan) -> list[Finding]:
    rank = {c: i for i, c in enumerate(ORDER)}
    order = {hp.name: i for i, hp in enumerate(p.hosts)}
    return sorted(findings, key=lambda f: (order.get(f.host, 1 << 30), rank.get(f.check, len(ORDER))))


def table_rows(res: CheckResult) -> list[list[str]]:
    rows = [["HOST", "CHECK", "STATUS", "DETAIL"]]
    for f in res.findings:
        detail = f.detail
        if f.check == "network" and f.status is Status.FAIL and len(detail) > 100:
            detail = detail[:97] + "..."
        rows.append([f.host, f.check, f.status.value, detail])
    return rows


def summary(res: CheckResult) -> str:
    hosts = len(res.plan.hosts)
    fails, warns = len(res.failed), len(res.warned)
    parts = [f"{fails} failed" if fails else "all passed", f"{warns} warning{'s' if warns != 1 else ''}"]
    if res.unreachable:
        parts.append(f"{len(res.unreachable)} unreachable")
    net = "" if res.network else " (network not checked)"
    return f"check: {', '.join(parts)} on {hosts} host{'s' if hosts != 1 else ''}{net}."
