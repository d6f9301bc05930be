#!/usr/bin/env python3
"""Where the CPU of each step goes, per host, by program: the profile behind the benchmark.

    python bench/hostprofile.py [--hosts 128] [--runs 3] [--out bench/results/DATE-hostprofile-128]

Needs root, Docker and `perf` (Debian: apt-get install linux-perf). Starts bench/compare.py's
sandbox and workload (one sleeping task per host) for provision and pyinfra, then runs, each
--runs times and under `perf record -a` (every process on the machine, one sample per
millisecond of CPU): the floor (connect + `true` on every host at once, as compare.py
times it), and for provision the first apply, no-op apply, changed apply (BENCH_GEN bumped:
every task restarts), plan and check; for pyinfra its first, no-op and changed apply.

The samples are counted by command name and the names put in groups (GROUPS): sshd, the
login around each connection (the user's shell, PAM's motd scripts), the tool on the
controller, provision's agent (python3 on the hosts), the probe's programs, systemctl,
systemd and what it runs for a unit (the gate's sh, the task, journald, D-Bus), the
sandbox's Docker plumbing. The table is milliseconds of CPU per host and run; the
machine's cores are shared by the controller and every host, so on a busy sandbox the wall
time follows the sum. Markdown on stdout (and in OUT.md, the raw counts in OUT.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402 - the sandbox, workload and tools of bench/compare.py

# Command name → group. Names not listed count as "other"; perf's own and the idle task's
# samples are left out.
GROUPS: dict[str, tuple[str, ...]] = {
    "controller (the tool's process)": ("provision", "pyinfra", "python", "ssh"),
    "sshd (key exchange, auth, sessions)": ("sshd",),
    "login (shell, PAM motd, logind)": ("bash", "run-parts", "10-uname", "uname", "env", "systemd-logind"),
    "agent (python3 on the host)": ("python3",),
    "probe / pyinfra's commands (sh and tools)": (
        "sh",
        "ss",
        "stat",
        "date",
        "sha256sum",
        "head",
        "getent",
        "ip",
        "cat",
        "grep",
        "mkdir",
        "rm",
        "mv",
        "chmod",
        "test",
        "timeout",
        "which",
        "sed",
        "awk",
        "cut",
        "tr",
        "ls",
        "find",
        "id",
        "sudo",
        "dd",
        "sftp-server",
        "sha1sum",
        "md5sum",
        "chown",
        "touch",
    ),
    "systemctl": ("systemctl",),
    "systemd's work for the units (gate, task, journal, D-Bus)": (
        "systemd",
        "(sh)",
        "(sleep)",
        "sleep",
        "systemd-journal",
        "dbus-daemon",
        "(systemctl)",
        "systemd-userwor",
        "systemd-userdbd",
    ),
    "sandbox only (docker-proxy, shims)": ("docker-proxy", "containerd-shim", "dockerd", "containerd"),
    "kernel threads": ("kworker", "kdamond", "rcu_", "ksoftirq", "migration", "jbd2", "kcompactd"),
}
IGNORED = ("swapper", "perf", "perf-exec")
PERIOD_NS = 1_000_000  # one sample per millisecond of CPU (cpu-clock counts nanoseconds)


def group_of(comm: str) -> str:
    if comm.startswith(IGNORED):
        return ""
    for group, names in GROUPS.items():
        if comm in names or (group == "kernel threads" and comm.startswith(names)):
            return group
    return "other"


def comm_counts(report: str) -> dict[str, int]:
    """`perf report --sort comm -n --stdio` as {command name: samples}."""
    out: dict[str, int] = {}
    for line in report.splitlines():
        m = re.match(r"^\s*[\d.]+%\s+(\d+)\s+(.+?)\s*$", line)
        if m:
            out[m.group(2)] = out.get(m.group(2), 0) + int(m.group(1))
    return out


class Perf:
    """`perf record -a` around a block; the samples by command name."""

    def __init__(self, work: Path):
        self.work = work
        self.n = 0

    def __call__(self, fn):
        self.n += 1
        data = self.work / f"perf-{self.n}.data"
        rec = subprocess.Popen(
            ["perf", "record", "-a", "-e", "cpu-clock", "-c", str(PERIOD_NS), "-o", str(data), "-q"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # perf is recording once its buffers are mapped
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            wall = time.perf_counter() - t0
            rec.send_signal(signal.SIGINT)
            rec.wait(timeout=120)
        rep = subprocess.run(
            ["perf", "report", "-i", str(data), "--sort", "comm", "-n", "--stdio"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        data.unlink()
        return comm_counts(rep), wall


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="runs of each step (default 3)")
    ap.add_argument("--out", help="OUT.md and OUT.json (default bench/results/DATE-hostprofile-N)")
    args = ap.parse_args()
    if not shutil.which("perf"):
        sys.exit("hostprofile: perf is not installed (Debian: apt-get install linux-perf)")
    out = Path(args.out or HERE / "results" / f"{dt.date.today().isoformat()}-hostprofile-{args.hosts}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),) * 2)

    bin_dir = compare.ensure_venv()
    provision_bin = compare.provision_command(None)
    compare.warm_up(provision_bin)
    versions = compare.tool_versions(bin_dir, provision_bin)
    sha = subprocess.run(
        ["git", "-C", str(compare.REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    bargs = argparse.Namespace(tools=("provision", "pyinfra"), runs=args.runs, noop_runs=args.runs, ansible_runs=0)
    bench = compare.Bench(args.hosts, bargs, bin_dir, provision_bin)
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    counts: dict[str, list[dict[str, int]]] = {}
    walls: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hostprofile-") as tmp:
        perf = Perf(Path(tmp))

        def measure(label: str, fn) -> None:
            c, w = perf(fn)
            counts.setdefault(label, []).append(c)
            walls.setdefault(label, []).append(w)
            compare.log(f"{args.hosts} hosts: {label}: {w:.2f} s, {sum(c.values()) / 1000:.2f} s of CPU")

        bench.up()
        try:
            bench._tool_files()
            for _ in range(3):
                bench.fleet.floor()  # the sandbox just booted: let sshd and systemd settle
            for _ in range(args.runs):
                measure("floor", bench.fleet.floor)
            for tool in ("provision", "pyinfra"):
                for i in range(args.runs):
                    bench.clean(tool)
                    measure(f"{tool} first apply", lambda t=tool, i=i: bench.measure(t, "apply", f"first{i}"))
                    bench.verify(tool)
                for i in range(args.runs):
                    measure(f"{tool} no-op apply", lambda t=tool, i=i: bench.measure(t, "apply", f"noop{i}"))
                    if tool == "provision":
                        measure("provision plan", lambda i=i: bench.measure("provision", "plan", f"plan{i}"))
                        measure("provision check", lambda i=i: bench.measure("provision", "check", f"check{i}"))
                for i in range(args.runs):
                    bench.set_gen(tool, 2 + i)
                    measure(f"{tool} changed apply", lambda t=tool, i=i: bench.measure(t, "apply", f"changed{i}"))
                    bench.verify(tool)
        finally:
            bench.down()

    raw = {
        "started": started,
        "hosts": args.hosts,
        "versions": versions,
        "commit": sha,
        "counts": counts,
        "walls": walls,
    }
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    text = report(raw)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def per_host(raw: dict) -> dict[str, dict[str, float]]:
    """label → group → ms of CPU per host and run (and "total")."""
    n = raw["hosts"]
    table: dict[str, dict[str, float]] = {}
    for label, runs in raw["counts"].items():
        g: dict[str, float] = {}
        for c in runs:
            for comm, samples in c.items():
                grp = group_of(comm)
                if grp:
                    g[grp] = g.get(grp, 0.0) + samples * PERIOD_NS / 1e6
        table[label] = {k: v / len(runs) / n for k, v in g.items()}
        table[label]["total"] = sum(table[label].values())
    return table


def report(raw: dict) -> str:
    n = raw["hosts"]
    t = per_host(raw)
    labels = list(raw["counts"])
    groups = [g for g in [*GROUPS, "other"] if any(t[lb].get(g, 0) >= 0.05 for lb in labels)]
    walls = {lb: sorted(raw["walls"][lb])[len(raw["walls"][lb]) // 2] for lb in labels}
    lines = [
        f"# Where each host's CPU goes, {n} hosts — {raw['started']}",
        "",
        f"Made by `python bench/hostprofile.py --hosts {n} --runs {len(raw['walls']['floor'])}` "
        f"at commit {raw['commit']} ({raw['versions'].get('pyinfra', 'pyinfra ?')}; python {raw['versions']['python']}). "
        "Sandbox hosts: Docker containers (systemd + sshd) on this machine; every process on it "
        "sampled by `perf record -a` once per millisecond of CPU during each step, the samples "
        "counted by command name and grouped as bench/hostprofile.py's GROUPS say. "
        "Milliseconds of CPU per host and run (the controller's too, divided by the host count); "
        "wall: median seconds of the step.",
        "",
        "| ms of CPU per host | " + " | ".join(labels) + " |",
        "| --- | " + " | ".join("---" for _ in labels) + " |",
    ]
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(f"{t[lb].get(g, 0.0):.1f}" for lb in labels) + " |")
    lines.append("| **total** | " + " | ".join(f"**{t[lb]['total']:.1f}**" for lb in labels) + " |")
    lines.append("| wall (s) | " + " | ".join(f"{walls[lb]:.2f}" for lb in labels) + " |")
    lines.append(
        "| CPU / wall (cores busy) | "
        + " | ".join(f"{t[lb]['total'] * n / 1000 / walls[lb]:.2f}" for lb in labels)
        + " |"
    )
    others: dict[str, float] = {}
    for lb in labels:
        for c in raw["counts"][lb]:
            for comm, samples in c.items():
                if group_of(comm) == "other":
                    others[comm] = others.get(comm, 0.0) + samples / len(raw["counts"][lb]) / n
    if others:
        top = sorted(others.items(), key=lambda kv: -kv[1])[:12]
        lines += [
            "",
            '"other", summed over the steps (ms per host): ' + ", ".join(f"{c} {v:.1f}" for c, v in top) + ".",
        ]
    cores = os.cpu_count() or 1
    lines += [
        "",
        f"The machine has {cores} cores. A step whose CPU / wall is near {cores} is bound by CPU: its wall "
        "time is its CPU divided by the cores, so the ratios between steps are the ratios of the "
        "totals above.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
