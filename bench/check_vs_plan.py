"""Benchmark: `provision check` against `provision plan` on N sandbox hosts.

    python bench/check_vs_plan.py [--hosts 8] [--repeat 5] [--out bench/results/DATE-check]

Starts an N-host sandbox with 2 fake GPUs per host, applies a job of a chief and N-1
workers (one GPU each, one task per host, tasks that sleep), then times, REPEAT times each
and interleaved, as a user runs them (a fresh `python -m provision` process each time):
  - `plan` (its pre-flight checks included, as every plan runs them),
  - `plan --skip-checks` (what the checks cost plan),
  - `check --skip-network` (the per-host checks alone: plan's round trip),
  - `check` (the per-host checks and the network round trip: every host listens on its
    task's port while every task dials the N-1 others).
Every run must succeed (plan: no changes; check: all passed). Prints a markdown table and
writes it with the raw figures to OUT.md and OUT.json. Target: check's median at most 2x
plan's; exit 1 when missed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provision import sandbox
from provision.sandbox.inventory import dump

TARGET = 2.0
LONG = ["/bin/sh", "-c", "exec sleep 3600"]
HERE = Path(__file__).resolve().parent
VARIANTS = {
    "plan": ["plan", "--detailed-exitcode"],
    "plan --skip-checks": ["plan", "--detailed-exitcode", "--skip-checks"],
    "check --skip-network": ["check", "--json", "--skip-network"],
    "check": ["check", "--json"],
}


def cli(args: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "provision", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    return time.monotonic() - t, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / f"{datetime.date.today()}-check"))
    a = ap.parse_args()

    name = f"bench-check-{os.getpid()}"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    sb = sandbox.up(name, hosts=a.hosts, gpus_per_host=2, progress=lambda s: print("  ...", s, file=sys.stderr))
    up_s = time.monotonic() - t0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            pools = {"chief": {"replicas": 1, "accelerators": 1, "command": LONG}}
            if a.hosts > 1:
                pools["worker"] = {"replicas": a.hosts - 1, "accelerators": 1, "command": LONG}
            inv = d / "inv.yaml"
            inv.write_text(dump(sandbox.inventory_dict(sb, job="bench", pools=pools), sb))
            took, r = cli(["apply", "-y", str(inv)], d)
            if r.returncode != 0:
                raise SystemExit(f"apply failed:\n{r.stdout}\n{r.stderr}")
            print(f"apply: {took:.2f} s", file=sys.stderr)
            times: dict[str, list[float]] = {k: [] for k in VARIANTS}
            network: list[float] = []
            for i in range(a.repeat):
                for label, args in VARIANTS.items():
                    took, r = cli([*args, str(inv)], d)
                    if r.returncode != 0:
                        raise SystemExit(f"{label} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
                    times[label].append(took)
                    if label == "check":
                        net = json.loads(r.stdout)["network"]
                        assert net["checked"] and not net["failures"], net
                        network.append(net["seconds"])
                print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), file=sys.stderr)
            cli(["destroy", "-y", str(inv)], d)
    finally:
        sandbox.down(name)

    load_after = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["check"] / med["plan"]
    lines = [
        f"# `provision check` vs `provision plan` on {a.hosts} sandbox hosts",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')}; {platform.node()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; sandbox of {a.hosts} hosts (2 fake GPUs each) up in {up_s:.0f} s; "
        f"job: chief + {a.hosts - 1} workers, one GPU and one task per host; {a.repeat} runs each, interleaved, "
        "each a fresh `python -m provision` process (its start-up included, as a user sees it). "
        f"1-minute load average: {load_before:.1f} before, {load_after:.1f} after (other work shares the cores).",
        "",
        "| command | median (s) | min (s) | max (s) |",
        "|---|---|---|---|",
    ]
    for k, v in times.items():
        lines.append(f"| `provision {k}` | {med[k]:.2f} | {min(v):.2f} | {max(v):.2f} |")
    lines += [
        "",
        f"- check / plan: **{ratio:.2f}x** (target at most {TARGET:g}x): {'met' if ratio <= TARGET else 'MISSED'}.",
        f"- What the per-host checks cost plan: {med['plan'] - med['plan --skip-checks']:+.2f} s "
        f"({med['plan'] / med['plan --skip-checks']:.2f}x).",
        f"- The network round trip as `check --json` reports it (listen + dial {a.hosts - 1} peers "
        f"per host, all hosts at once): median {statistics.median(network):.2f} s.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "hosts": a.hosts,
                "repeat": a.repeat,
                "times": times,
                "network": network,
                "ratio": ratio,
                "load": [load_before, load_after],
            },
            indent=1,
        )
        + "\n"
    )
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
