"""Benchmark: how tightly `provision tune` packs trials onto GPUs.

    python bench/tune.py [--trials 40] [--seconds 2] [--slots 4] [--poll 0.3]

Starts a sandbox of 2 hosts with 2 fake GPUs each (4 slots), runs a random study of
`--trials` trials of a `--seconds`-second job (tests/fixtures/tune/trainer.py, reporting as
cloudml-hypertune does), at most `--slots` at once, and reports from the trials' kept logs
(their first and last line, as the hosts' journals stamp them):
- the hand-off: from a trial's last line to the first line of the next trial that started
  after it (the freed GPU's next user), median and p95;
- the study's wall time against the ideal, trials x seconds / slots: the whole `provision
  tune` process (start-up, the final picture and removals included), and the trials' span.
With --trace, each hand-off in steps (from the trials' trace, PROVISION_TUNE_TRACE, and
their logs): the job's end on the host (its last line) -> seen by the controller -> the
next trial asked -> planned -> applied -> its first line, median and p95 of each.
A benchmark, not a timed test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provision import sandbox
from provision.sandbox.inventory import dump

TRAINER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tune" / "trainer.py"


def _stamp(line: str) -> float:
    return dt.datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00")).timestamp()


def spans_by_trial(logs: Path) -> dict[int, tuple[float, float]]:
    """trial -> its first and last line's times (the host's journal's stamps)."""
    out = {}
    for d in sorted(logs.glob("trial-*")):
        lines = [ln for ln in (d / "chief-0.log").read_text().splitlines() if ln.strip() and "[systemd]" not in ln]
        if lines:
            out[int(d.name.split("-")[1])] = (_stamp(lines[0]), _stamp(lines[-1]))
    return out


def spans(logs: Path) -> list[tuple[float, float]]:
    return list(spans_by_trial(logs).values())


def handoffs(sp: list[tuple[float, float]]) -> list[float]:
    """Each trial's end to the start of the first unmatched trial that started after it."""
    starts = sorted(s for s, _ in sp)
    used: set[int] = set()
    out = []
    for _, end in sorted(sp, key=lambda x: x[1]):
        nxt = next((i for i, s in enumerate(starts) if s >= end and i not in used), None)
        if nxt is not None:
            used.add(nxt)
            out.append(starts[nxt] - end)
    return out


STEPS = ("ended", "submitted", "planned", "applied")  # a trial's trace words, in order


def traced(stderr: str) -> dict[int, dict[str, float]]:
    """trial -> its trace's word -> when (the first time; "after": whose place it took)."""
    out: dict[int, dict[str, float]] = {}
    for line in stderr.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 4 or parts[1] != "trial" or not parts[2].rstrip(":").isdigit():
            continue
        at, n, what = float(parts[0]), int(parts[2].rstrip(":")), parts[3].strip()
        mine = out.setdefault(n, {})
        if what.startswith("submitted after "):
            mine["after"] = float(what.split()[-1])
            what = "submitted"
        mine.setdefault(what, at)
    return out


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else float("nan")


def steps_of_handoffs(logs: Path, stderr: str) -> list[str]:
    """Each hand-off (a trial and the one given its place) in steps: median and p95 of each."""
    tr = traced(stderr)
    sp = spans_by_trial(logs)
    names = [
        "end on host -> seen",
        "seen -> next asked",
        "asked -> planned",
        "planned -> applied",
        "applied -> first line",
    ]
    deltas: list[list[float]] = [[] for _ in names]
    whole: list[float] = []
    for n, t in tr.items():
        before = int(t.get("after", 0))
        if not before or before not in sp or n not in sp or before not in tr:
            continue
        b = tr[before]
        marks = [sp[before][1], b.get("ended"), t.get("submitted"), t.get("planned"), t.get("applied"), sp[n][0]]
        if any(m is None for m in marks):
            continue
        for i in range(len(names)):
            deltas[i].append(marks[i + 1] - marks[i])  # type: ignore[operator]
        whole.append(sp[n][0] - sp[before][1])
    out = [f"hand-offs traced: {len(whole)} (the trial given an ended one's place)"]
    for name, d in zip(names, deltas, strict=True):
        if d:
            out.append(f"  {name:24s} median {statistics.median(d):.3f} s, p95 {_p95(d):.3f} s")
    if whole:
        out.append(f"  {'end -> first line':24s} median {statistics.median(whole):.3f} s, p95 {_p95(whole):.3f} s")
    return out


def phases(logs: Path, stderr: str, t0: float, t1: float, slots: int) -> list[str]:
    """The tune process's own start and end, in steps (its start and exit, the trace, the logs)."""
    tr = traced(stderr)
    sp = spans_by_trial(logs)
    if not tr or not sp:
        return []
    first = sorted(tr)[:slots]  # the first wave
    last_end = max(e for _, e in sp.values())
    last = max(sp, key=lambda n: sp[n][1])

    def at(n: int, word: str) -> float:
        return tr.get(n, {}).get(word, float("nan"))

    wave_applied = max(at(n, "applied") for n in first)
    wave_line = max(sp[n][0] for n in first if n in sp)
    removed = max((t.get("removed", 0.0) for t in tr.values()), default=float("nan"))
    own = [ln.split(" ", 2) for ln in stderr.splitlines() if ln.split(" ", 2)[1:2] == ["tune:"]]
    return [
        "the tune process's start and end (s from its start; the first wave: the first trials asked):",
        "  its own steps: " + ", ".join(f"{w[2]} {float(w[0]) - t0:.2f}" for w in own if len(w) == 3),
        f"  first trial asked {min(at(n, 'submitted') for n in first) - t0:.2f}, "
        f"first planned {min(at(n, 'planned') for n in first) - t0:.2f}, "
        f"first wave applied {wave_applied - t0:.2f}, its last first line {wave_line - t0:.2f}",
        f"  last trial's last line {last_end - t0:.2f}, seen {at(last, 'ended') - t0:.2f}, "
        f"last removal {removed - t0:.2f}, exit {t1 - t0:.2f} (last line to exit {t1 - last_end:.2f})",
    ]


def _machine_busy() -> float:
    """Seconds of CPU the whole machine has spent busy (not idle, not waiting for I/O), from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _container_cpu(container: str) -> float:
    """Seconds of CPU a container's processes have used (cgroup v1 or v2); 0 when neither is readable."""
    try:
        cid = subprocess.run(
            ["docker", "inspect", "-f", "{{.Id}}", container], capture_output=True, text=True
        ).stdout.strip()
        v1 = Path(f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage")
        if v1.exists():
            return int(v1.read_text()) / 1e9
        for v2 in (
            Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/cpu.stat"),
            Path(f"/sys/fs/cgroup/docker/{cid}/cpu.stat"),
        ):
            if v2.exists():
                return int(v2.read_text().split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--poll", type=float, default=0.3)
    ap.add_argument("--trace", action="store_true", help="each hand-off in steps, timed (the trials' trace)")
    ap.add_argument("--trace-out", type=Path, help="with --trace: the tune process's stderr (the trace) kept here")
    args = ap.parse_args()
    sb = sandbox.up(hosts=2, gpus_per_host=2, progress=lambda m: print(f"  {m}", file=sys.stderr))
    tmp = Path(tempfile.mkdtemp(prefix="bench-tune-"))
    try:
        shutil.copy(TRAINER, tmp / "trainer.py")
        steps = 4
        inv = sandbox.inventory_dict(
            sb,
            job="btune",
            files=[{"src": "trainer.py", "dest": "/opt/btune/trainer.py"}],
            pools={
                "chief": {
                    "replicas": 1,
                    "accelerators": 1,
                    "command": [
                        "python3",
                        "/opt/btune/trainer.py",
                        f"--steps={steps}",
                        f"--step_seconds={args.seconds / steps}",
                    ],
                }
            },
            tune={
                "metric": {"name": "loss", "goal": "minimize"},
                "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
                "algorithm": "random",
                "max_trials": args.trials,
                "parallel_trials": args.slots,
            },
        )
        (tmp / "study.yaml").write_text(dump(inv, sb))
        hosts_cpu0 = sum(_container_cpu(h.container) for h in sb.hosts)
        busy0, kids0 = _machine_busy(), resource.getrusage(resource.RUSAGE_CHILDREN)
        t0, e0 = time.monotonic(), time.time()
        r = subprocess.run(
            [sys.executable, "-m", "provision", "tune", "--poll", str(args.poll), "study.yaml"],
            cwd=tmp,
            capture_output=True,
            text=True,
            env={**os.environ, "PROVISION_TUNE_TRACE": "1"} if args.trace else None,
        )
        wall, e1 = time.monotonic() - t0, time.time()
        kids1, busy1 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_busy()
        hosts_cpu = sum(_container_cpu(h.container) for h in sb.hosts) - hosts_cpu0
        tune_cpu = kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime
        if r.returncode != 0:
            print(r.stdout + r.stderr)
            return 1
        sp = spans(tmp / ".provision" / "btune.tune")
        ho = sorted(handoffs(sp))
        ideal = args.trials * args.seconds / args.slots
        p95 = ho[min(len(ho) - 1, int(0.95 * len(ho)))] if ho else float("nan")
        print(f"{len(sp)} trials of {args.seconds:g} s on {args.slots} slots (poll {args.poll:g} s)")
        counted = [ln for ln in r.stdout.splitlines() if " trials: " in ln and "(max_trials" in ln]
        failed = [ln for ln in r.stdout.splitlines() if ln.startswith("trial ") and " failed" in ln]
        print(f"the study: {counted[-1] if counted else '?'}", *failed, sep="\n  ")
        print(f"hand-off, trial end to the next start: median {statistics.median(ho):.2f} s, p95 {p95:.2f} s")
        span = max(e for _, e in sp) - min(b for b, _ in sp)
        print(f"wall {wall:.1f} s (the tune process), ideal {ideal:.1f} s: {100 * ideal / wall:.0f} % of the ideal")
        print(
            f"trials' span {span:.1f} s (first trial's first line to the last one's last): {100 * ideal / span:.0f} % of the ideal"
        )
        cores = os.cpu_count() or 1
        print(
            f"CPU in the study's wall time: the tune process {tune_cpu:.1f} s, the hosts {hosts_cpu:.1f} s, "
            f"the machine {busy1 - busy0:.1f} s of {cores * wall:.1f} ({cores} cores busy {100 * (busy1 - busy0) / (cores * wall):.0f} %)"
        )
        if args.trace_out is not None:
            args.trace_out.write_text(r.stderr)
        if args.trace:
            for line in steps_of_handoffs(tmp / ".provision" / "btune.tune", r.stderr):
                print(line)
            for line in phases(tmp / ".provision" / "btune.tune", r.stderr, e0, e1, args.slots):
                print(line)
        return 0
    finally:
        sandbox.down(sb.name)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
