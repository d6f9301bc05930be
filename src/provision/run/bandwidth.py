"""`provision check --bandwidth`: the all-reduce bus bandwidth a job's collectives would see
between its hosts, per pair and across all of them, against the stored baseline of the
hosts' class, and the slow host found by bisection (rules/fabric: its rounds and
judgement).

A look at every host first (which tool each has: nccl-tests, torch, or provision's own
stream test), then the bisection's rounds, each one SSH round trip per host taking part,
every host at once, each bounded (rules/fabric.call_timeout): a host that does not answer
is named and left out of the rounds after. The first healthy measurement of a host class
becomes its baseline (io/fabricstore: beside the local state, or in the team's PostgreSQL).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.model import Host
from provision.core.target import HostError
from provision.host.protocol import FabricReport, FabricRequest
from provision.io import fabricstore
from provision.io.ssh import call_agent
from provision.io.steps import Step, run_step
from provision.rules import fabric as F
from provision.rules.bisection import Bisection, Verdict, max_rounds
from provision.run.context import Context

# What marks a slow host (the hosts' health, quarantine): given the names and the result.
SlowHook = Callable[[list[str], "BandwidthResult"], None]


@dataclass
class Round:
    number: int
    kind: str  # "rings", or "pairs" (each suspect with a known-good host)
    judged: list[F.Judged]
    seconds: float


@dataclass
class BandwidthResult:
    job: str
    tool: F.Tool
    size: int
    hosts: list[str]
    host_class: str
    rounds: list[Round] = field(default_factory=list)
    baseline: F.Baseline | None = None
    kept: F.Baseline | None = None  # the baseline this run kept
    notes: list[str] = field(default_factory=list)
    verdict: Verdict | None = None
    not_answering: dict[str, str] = field(default_factory=dict)  # host -> in which step, why
    seconds: float = 0.0

    @property
    def judged(self) -> list[F.Judged]:
        return [j for r in self.rounds for j in r.judged]

    @property
    def job_wide(self) -> F.Judged | None:
        first = self.rounds[0].judged if self.rounds else []
        return first[0] if len(first) == 1 else None

    @property
    def pairs(self) -> list[F.Judged]:
        return [j for j in self.judged if len(j.figure.hosts) == 2]

    @property
    def failed(self) -> list[F.Judged]:
        return [j for j in self.judged if j.figure.gbps is None]

    @property
    def slow(self) -> list[str]:
        return list(self.verdict.slow) if self.verdict else []

    @property
    def healthy(self) -> bool:
        v = self.verdict
        bad = v is not None and bool(v.slow or v.untested or v.links)
        any_slow = any(j.slow or j.below for j in self.judged)
        return bool(self.rounds) and not (bad or any_slow or self.failed or self.not_answering)

    @property
    def exit_code(self) -> int:
        if self.not_answering:
            return 3
        return 0 if self.healthy else 1

    def to_json(self) -> dict[str, Any]:
        v = self.verdict or Verdict([], [], [], [])
        jw = self.job_wide
        return {
            "format_version": 1,
            "job": self.job,
            "tool": self.tool.value,
            "size": self.size,
            "host_class": self.host_class,
            "ok": self.exit_code == 0,
            "hosts": self.hosts,
            "job_wide": judged_json(jw) if jw else None,
            "pairs": [judged_json(j) for j in self.pairs],
            "rounds": [
                {
                    "round": r.number,
                    "kind": r.kind,
                    "seconds": round(r.seconds, 3),
                    "groups": [judged_json(j) for j in r.judged],
                }
                for r in self.rounds
            ],
            "max_rounds": max_rounds(len(self.hosts)),
            "baseline": self.baseline.to_json() if self.baseline else None,
            "kept_baseline": self.kept.to_json() if self.kept else None,
            "slow_hosts": v.slow,
            "slow_links": [list(p) for p in v.links],
            "not_isolated": v.untested,
            "not_answering": self.not_answering,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
        }


def judged_json(j: F.Judged) -> dict[str, Any]:
    f = j.figure
    return {
        "hosts": list(f.hosts),
        "round": f.round,
        "gbps": None if f.gbps is None else round(f.gbps, 6),
        "at_most": f.at_most,
        "reference_gbps": None if j.reference is None else round(j.reference, 6),
        "against": j.against or None,
        "share": None if j.share is None else round(j.share, 4),
        "slow": j.slow,
        "baseline_gbps": None if j.baseline is None else round(j.baseline, 6),
        "of_baseline": None if j.of_baseline is None else round(j.of_baseline, 4),
        "below_baseline": j.below,
        "seconds": None if f.seconds is None else round(f.seconds, 6),
        "error": f.error,
    }


def measured_hosts(ctx: Context) -> list[Host]:
    """The inventory's hosts the command was pointed at (--target), in inventory order."""
    return [h for h in ctx.inventory.hosts if h.name in ctx.targets]


def run_bandwidth(
    ctx: Context,
    *,
    tool: str = "auto",
    new_baseline: bool = False,
    progress: Callable[[str], None] = lambda s: None,
    on_slow: SlowHook | None = None,
) -> BandwidthResult:
    started = time.monotonic()
    hosts = measured_hosts(ctx)
    if len(hosts) < 2:
        only = f" ({hosts[0].name})" if hosts else ""
        raise ProvisionError(
            f"{ctx.where}: --bandwidth measures between hosts, and {'--target leaves' if ctx.subset else 'it has'} "
            f"{len(hosts)}{only}: nothing to measure"
        )
    if ctx.session.parallelism < len(hosts):
        raise ProvisionError(
            f"--parallelism {ctx.session.parallelism}: the bandwidth test needs every host of a round at once "
            f"({len(hosts)} hosts)"
        )
    by_name = {h.name: h for h in hosts}
    progress(f"looking at {len(hosts)} hosts")
    look = run_step(
        ctx.session,
        Step.FABRIC,
        lambda t: call_agent(ctx.session, t, FabricRequest(ctx.inventory.job, "look"), timeout=60),
        [ctx.targets[h.name] for h in hosts],
    )
    gone = {n: f"the look: {e.message}" for n, e in look.errors.items()}
    live = [h.name for h in hosts if h.name in look.ok]
    chosen, why = F.choose_tool({n: look.ok[n].tools for n in live}, tool)
    if chosen is None:
        raise ProvisionError(why)
    res = BandwidthResult(
        ctx.inventory.job, chosen, F.SIZES[chosen], [h.name for h in hosts], F.class_of(by_name[n] for n in live)
    )
    res.not_answering = gone
    store = fabricstore.of(ctx.state.store)
    res.baseline, note = F.pick_baseline(store.read(), res.host_class, chosen)
    if note:
        res.notes.append(note)
    if len(live) < 2:
        res.notes.append("fewer than two hosts answered: nothing was measured")
        res.seconds = time.monotonic() - started
        return res
    _bisect(ctx, res, live, by_name, progress)
    if res.healthy and (res.baseline is None or new_baseline):
        res.kept = _keep(ctx, res, store, replace=new_baseline)
    res.seconds = time.monotonic() - started
    if on_slow is not None and res.slow:
        on_slow(res.slow, res)
    return res


def _bisect(
    ctx: Context, res: BandwidthResult, live: list[str], by_name: Mapping[str, Host], progress: Callable[[str], None]
) -> None:
    """The rounds of rings (halves of halves), then the pairs with known-good hosts; every
    figure judged once all are in (a pair's peers are every pair measured)."""
    most = max_rounds(len(live))
    b = Bisection(live, res.baseline)
    done: list[tuple[str, float]] = []
    while (step := b.next()) is not None:
        kind, groups = step
        number = len(done) + 1
        if kind == "rings":
            progress(f"round {number} of at most {most}: {_groups_words(groups)}")
        else:
            progress(f"round {number} of at most {most}: {len(groups)} pair{'s' if len(groups) != 1 else ''} "
                     "with known-good hosts")  # fmt: skip
        figures, took = _measure(ctx, res, groups, number, by_name)
        b.record(figures, gone=res.not_answering)
        done.append((kind, took))
    res.rounds = [Round(i, kind, js, took) for i, ((kind, took), js) in enumerate(zip(done, b.judged()), 1)]
    res.verdict = b.verdict()


def _groups_words(groups: Sequence[tuple[str, ...]]) -> str:
    sizes = sorted({len(g) for g in groups})
    n = len(groups)
    return f"{n} ring{'s' if n != 1 else ''} of {'/'.join(map(str, sizes))} hosts"


def _measure(
    ctx: Context, res: BandwidthResult, groups: Sequence[tuple[str, ...]], number: int, by_name: Mapping[str, Host]
) -> tuple[list[F.Figure], float]:
    """One round: every group's members asked at once (nccl-tests: its first only); the
    figures, and the round's time. A host that does not answer is named and left out after."""
    tool, size = res.tool, res.size
    requests: dict[str, FabricRequest] = {}
    for g in groups:
        peers = [[by_name[h].cluster_address, F.PORT] for h in g]
        token = secrets.token_hex(16)
        members = g[:1] if tool is F.Tool.NCCL else g
        for rank, h in enumerate(members):
            requests[h] = FabricRequest(
                ctx.inventory.job,
                {F.Tool.NCCL: "nccl", F.Tool.TORCH: "torch", F.Tool.TCP: "tcp"}[tool],
                rank=rank,
                peers=peers,
                token=token,
                size=size,
                seconds=F.TCP_SECONDS,
                timeout=F.TIMEOUT_S,
                join=F.JOIN_S,
                gpus=by_name[h].accelerator_count,
            )

    def one(t: Any) -> FabricReport:
        report: FabricReport = call_agent(ctx.session, t, requests[t.name], timeout=F.call_timeout(tool))
        return report

    got = run_step(ctx.session, Step.FABRIC, one, [ctx.targets[n] for n in requests])
    for n, e in got.errors.items():
        res.not_answering.setdefault(n, f"round {number}: {e.message}")
    answers: dict[str, FabricReport | HostError] = {**got.ok, **got.errors}
    figures = []
    for g in groups:
        if tool is F.Tool.NCCL:
            figures.append(F.nccl_figure(g, number, answers))
        elif tool is F.Tool.TORCH:
            figures.append(F.torch_figure(g, number, answers, size))
        else:
            figures.append(F.tcp_figure(g, number, answers, size))
    return figures, got.seconds


def _keep(ctx: Context, res: BandwidthResult, store: fabricstore.Baselines, *, replace: bool) -> F.Baseline | None:
    """This healthy measurement as the class's baseline: its pairs' median, its job-wide figure."""
    import statistics  # only a kept baseline needs it

    pairs = [j.figure.gbps for j in res.pairs if j.figure.gbps is not None]
    jw = res.job_wide
    b = F.Baseline(
        res.host_class,
        res.tool.value,
        statistics.median(pairs) if pairs else None,
        jw.figure.gbps if jw else None,
        len(jw.figure.hosts) if jw else 0,
        res.size,
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        fabricstore.who(),
        ctx.inventory.job,
    )
    return b if store.keep(b, replace=replace) else None
