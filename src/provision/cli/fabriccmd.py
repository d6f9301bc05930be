"""`provision check --bandwidth`: the fabric between the hosts (run/bandwidth.py), in words:
each round's rings and pairs with their bus bandwidth against the reference, the job-wide
figure, the slow host, the hosts that did not answer, and the baseline."""

from __future__ import annotations

import json as _json
import sys

import click

from provision.cli.common import open_ctx, progress_line
from provision.cli.output import table
from provision.core.text import printable
from provision.rules import fabric as F
from provision.rules.bisection import max_rounds
from provision.run.bandwidth import BandwidthResult, run_bandwidth

TOOL_WORDS = {
    F.Tool.NCCL: "nccl-tests' all_reduce_perf under mpirun",
    F.Tool.TORCH: "torch.distributed all_reduce",
    F.Tool.TCP: "provision's stream test",
}


def bandwidth_check(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    as_json: bool,
    tool: str,
    new_baseline: bool,
) -> None:
    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose, render_secrets=False, files_here=False)
    try:
        res = run_bandwidth(ctx, tool=tool, new_baseline=new_baseline, progress=progress_line)
    finally:
        ctx.close()
    if as_json:
        click.echo(_json.dumps(res.to_json(), indent=1))
    else:
        for line in lines(res):
            click.echo(line)
    for name, why in res.not_answering.items():
        click.echo(click.style(f"Did not answer: {name}: {printable(why)}", fg="red"), err=True)
    sys.exit(res.exit_code)


def rate(gbps: float | None, at_most: bool = False) -> str:
    if gbps is None:
        return "-"
    digits = 0 if gbps >= 100 else 1 if gbps >= 10 else 2 if gbps >= 1 else 3
    text = f"{gbps:.{digits}f}" if gbps >= 0.001 or gbps == 0 else f"{gbps:.2g}"
    return f"{'< ' if at_most else ''}{text} GB/s"


def group_words(hosts: tuple[str, ...]) -> str:
    return " ".join(hosts) if len(hosts) <= 4 else f"{hosts[0]} .. {hosts[-1]} ({len(hosts)} hosts)"


def pct(share: float | None) -> str:
    return "-" if share is None else f"{round(100 * share)} %"


def versus(j: F.Judged) -> str:
    """Against its peers (or the baseline, with too few peers): SLOW below SLOW of it."""
    f = j.figure
    if f.gbps is None:
        return f"failed: {f.error or '?'}"
    if j.reference is None:
        return "-"
    where = "" if j.against == "peers" else " of the baseline"
    return f"SLOW: {pct(j.share)}{where}" if j.slow else f"{pct(j.share)}{where}"


def base_cell(j: F.Judged) -> str:
    if j.baseline is None or j.figure.gbps is None:
        return "-"
    return f"BELOW: {pct(j.of_baseline)}" if j.below else pct(j.of_baseline)


def lines(res: BandwidthResult) -> list[str]:
    n = len(res.hosts)
    out = [
        f"Bandwidth of {n} hosts (class {res.host_class}) with {TOOL_WORDS[res.tool]}, "
        f"{res.size >> 20} MiB all-reduced; bus bandwidth as nccl-tests counts it:"
    ]
    rows = [["ROUND", "HOSTS", "BUS BW", "VS PEERS", "VS BASELINE", "SECONDS"]]
    for r in res.rounds:
        for j in r.judged:
            figure = rate(j.figure.gbps, j.figure.at_most)
            rows.append([str(r.number), group_words(j.figure.hosts), figure, versus(j), base_cell(j), ""])
        rows[-1][5] = f"{r.seconds:.1f}"
    out += [printable(x) for x in table(rows)] if res.rounds else []
    out += summary_lines(res)
    out += [printable(f"Note: {x}") for x in res.notes]
    out += verdict_lines(res)
    if res.kept is not None:
        b = res.kept
        out.append(
            f"Baseline kept for host class {b.host_class} ({b.tool}): pairs {rate(b.pair)}, job-wide {rate(b.ring)} "
            f"on {b.ring_hosts} hosts."
        )
    out.append(closing(res))
    return out


def _gbps(j: F.Judged) -> float:
    return j.figure.gbps or 0.0


def summary_lines(res: BandwidthResult) -> list[str]:
    """The job-wide figure and the pairs', each against the baseline where there is one."""
    out = []
    b = res.baseline
    jw = res.job_wide
    if jw is not None and jw.figure.gbps is not None:
        line = f"Job-wide: {rate(jw.figure.gbps, jw.figure.at_most)} across {len(jw.figure.hosts)} hosts"
        if b is not None and jw.baseline is not None:
            word = "BELOW: " if jw.below else ""
            line += f", {word}{pct(jw.of_baseline)} of the baseline ({rate(b.ring)} on {b.ring_hosts} hosts, {b.at})"
        elif b is not None and b.ring is not None:
            line += f" (the baseline's is of {b.ring_hosts} hosts: not compared)"
        out.append(line + ".")
    pairs = [j for j in res.pairs if j.figure.gbps is not None]
    if len(pairs) == 1:
        line = f"Pair: {' '.join(pairs[0].figure.hosts)} {rate(pairs[0].figure.gbps)}"
    elif pairs:
        low, high = min(pairs, key=_gbps), max(pairs, key=_gbps)
        line = (
            f"Pairs: {len(pairs)} measured, {rate(low.figure.gbps)} ({' '.join(low.figure.hosts)}) to "
            f"{rate(high.figure.gbps)} ({' '.join(high.figure.hosts)})"
        )
    if pairs and b is not None and b.pair is not None:
        below = [j for j in pairs if j.below]
        line += f"; the baseline's pair: {rate(b.pair)}" + (
            f", {len(below)} of {len(pairs)} below it" if below else ", none below it"
        )
    if pairs:
        out.append(line + ".")
    return out


def verdict_lines(res: BandwidthResult) -> list[str]:
    v = res.verdict
    if v is None:
        return []
    out = []
    last = res.rounds[-1] if res.rounds and res.rounds[-1].kind == "pairs" else None
    for h in v.slow:
        j = next((x for x in (last.judged if last else []) if x.figure.hosts[0] == h), None)
        with_ = (
            f" with known-good {j.figure.hosts[1]}: {rate(j.figure.gbps)}, {versus(j).removeprefix('SLOW: ')}"
            if j
            else ""
        )
        out.append(f"Slow: {h}{with_} (named in round {len(res.rounds)} of at most {max_rounds(len(res.hosts))}).")
    for a, b in v.links:
        out.append(f"Slow link: {a} - {b} (each is fine with another host).")
    if v.untested:
        out.append(
            f"Not isolated: {', '.join(v.untested)} (slow, and no known-good host left to pair "
            f"{'it' if len(v.untested) == 1 else 'them'} with)"
        )
    return out


def closing(res: BandwidthResult) -> str:
    n = len(res.rounds)
    took = f"{n} round{'s' if n != 1 else ''}, {res.seconds:.1f} s"
    if res.exit_code == 0:
        return f"bandwidth: healthy on {len(res.hosts)} hosts ({took})."
    parts = []
    if res.slow:
        parts.append(f"slow: {', '.join(res.slow)}")
    if res.not_answering:
        parts.append(f"{len(res.not_answering)} did not answer")
    failed = len(res.failed)
    if failed:
        parts.append(f"{failed} measurement{'s' if failed != 1 else ''} failed")
    below = [j for j in res.judged if j.below]
    if below:
        parts.append(f"{len(below)} figure{'s' if len(below) != 1 else ''} below the baseline")
    if not parts:
        parts.append("slower than its peers")
    return f"bandwidth: {'; '.join(parts)} ({took})."
