#!/usr/bin/env python3
"""Per host, the SSH round trips from the first connect to the task running, and where the
controller's CPU goes, for a first apply, a plan and a no-op apply; beside both floors.

    python bench/roundtrips.py SANDBOX --out bench/results/DATE-roundtrips.txt
    python bench/roundtrips.py SANDBOX --src A=/path/to/main/src --src B=$PWD/src --order ABBA

SANDBOX: a running sandbox (`provision sandbox up -n 32 --name SANDBOX`). The workload is
bench/workload/provision.yaml on the sandbox's hosts (one task per host, host keys strict);
with --gpus G each task takes G of its host's GPUs (a sandbox made with `-g`: the hosts
declare them, their nvidia-smi stand-in answers the probe and the guard).

Floors, measured in the same sitting:
- connect floor: every host at once, a thread each, a fresh paramiko connection + `true`;
- work floor: the same, with one command that writes the task's env file and unit (the
  bytes provision renders for it, under another job's name) and starts the unit, no
  daemon-reload: the least a push-based tool can do for a first apply.

Each command runs once instrumented (this file's `--inner` mode wraps the Session's dials
and commands, render, make_plan, the state's save and paramiko's transport threads, and
counts sha256 calls and agent payload builds; thread CPU time by part) and --runs times
plain for the wall times (its process tree's CPU from rusage, the hosts' from their
cgroups). With several --src, the sources alternate in --order (A B B A).

Each plain plan and no-op apply also gets a connect floor of its own, run just before it:
its "paired" ratio is the median of each run's wall over that floor's, which the sandbox's
load (128 hosts' systemd on 2 cores: 8 at the start, 200 later) moves together. --ops
plan,noop leaves the first apply out (one apply, untimed, puts the job on the hosts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = "brt"
FLOOR_JOB = "brtfloor"


# --------------------------------------------------------------------------- inside the command


class _Probe:
    """What the instrumented command records (one per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.events: dict[str, list[tuple[float, float, str]]] = defaultdict(list)  # host -> (start, end, what)

    def add(self, part: str, seconds: float) -> None:
        with self.lock:
            self.cpu[part] += seconds
            self.calls[part] += 1


def _patch(probe: _Probe, module: Any, name: str, part: str) -> None:
    """module.name timed (the calling thread's CPU) wherever provision imported it by name."""
    orig = getattr(module, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.thread_time()
        try:
            return orig(*a, **k)
        finally:
            probe.add(part, time.thread_time() - t0)

    for m in list(sys.modules.values()):
        if m is not None and getattr(m, "__name__", "").startswith("provision") and getattr(m, name, None) is orig:
            setattr(m, name, timed)
    setattr(module, name, timed)


def _what(command: str, stdin: bytes, payload: bytes) -> str:
    if "provision-agent" not in command:
        return "shell probe" if "probe" in command or len(command) > 200 else command.split()[0]
    try:
        req = json.loads(stdin[len(payload) :])
    except ValueError:
        return "agent ?"
    if req.get("op") == "batch":
        return "agent " + "+".join(r.get("op", "?") for r in req.get("requests", []))
    return "agent " + str(req.get("op"))


def inner(out: str, argv: list[str]) -> None:
    """Run `provision ARGV` here, instrumented; what it measured to OUT as JSON."""
    import hashlib

    import paramiko

    from provision.cli import app, change  # noqa: F401 - loaded first, so their names are patched
    from provision.host import bundle
    from provision.io import ssh, state
    from provision.render import files
    from provision.rules import planner, provenance
    from provision.run import apply, context, planning  # noqa: F401 - as above

    probe = _Probe()
    started_cpu = time.process_time()
    _patch(probe, files, "render", "render (files, hashes)")
    _patch(probe, planner, "make_plan", "plan (make_plan)")
    _patch(probe, provenance, "mark", "plan (provenance)")
    _patch(probe, context, "probe_request", "probe requests")
    _patch(probe, apply, "host_record", "state records")
    _patch(probe, state.State, "_save", "state save")
    _patch(probe, bundle, "_built_parts", "agent payload build")
    real_sha = hashlib.sha256

    def sha(*a: Any, **k: Any) -> Any:
        probe.calls["sha256"] += 1
        return real_sha(*a, **k)

    hashlib.sha256 = sha  # type: ignore[assignment]
    dial, exec_ = ssh.Session._dial, ssh.Session._exec

    def timed_dial(self: Any, target: Any) -> Any:
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            return dial(self, target)
        finally:
            probe.add("ssh connect (calling thread)", time.thread_time() - c0)
            probe.events[target.name].append((t0, time.monotonic(), "connect"))

    def timed_exec(self: Any, target: Any, command: str, sink: Any, stdin: bytes, *rest: Any) -> Any:
        what = _what(command, stdin, bundle.payload() if "provision-agent" in command else b"")
        if target.name not in self._conns:  # the connect is its own event (timed_dial)
            self.connect(target)
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            return exec_(self, target, command, sink, stdin, *rest)
        finally:
            probe.add("ssh commands (calling thread)", time.thread_time() - c0)
            probe.events[target.name].append((t0, time.monotonic(), what))

    ssh.Session._dial, ssh.Session._exec = timed_dial, timed_exec  # type: ignore[method-assign]
    run = paramiko.Transport.run

    def timed_run(self: Any) -> None:
        c0 = time.thread_time()
        try:
            run(self)
        finally:
            probe.add("ssh transport threads (kex, ciphers, packets)", time.thread_time() - c0)

    paramiko.Transport.run = timed_run  # type: ignore[method-assign]
    code = 0
    try:
        app.main(argv, prog_name="provision")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    time.sleep(0.2)  # the transport threads' last packets (closed by the command)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_text(
        json.dumps(
            {
                "code": code,
                "start_cpu": started_cpu,
                "total_cpu": ru.ru_utime + ru.ru_stime,
                "cpu": probe.cpu,
                "calls": dict(probe.calls),
                "events": probe.events,
            }
        )
    )
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------- the bench


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace):
        sys.path.insert(0, str(HERE))
        import compare  # bench/compare.py: Fleet (floor, cgroup CPU), clean_command

        from provision import sandbox

        self.compare = compare
        self.sb = sandbox.load(args.sandbox)
        self.n = len(self.sb.hosts)
        self.fleet = compare.Fleet(self.sb)
        self.work = Path(args.work) / args.sandbox
        self.args = args
        shutil.rmtree(self.work, ignore_errors=True)
        (self.work / ".provision").mkdir(parents=True)
        shutil.copy(self.sb.known_hosts_path, self.work / ".provision" / "known_hosts")
        self.inv = self.work / "inventory.yaml"
        self._write_inventory()
        self.floor_files = self._floor_files()

    def _write_inventory(self) -> None:
        import yaml

        wl = yaml.safe_load((HERE / "workload" / "provision.yaml").read_text())
        inv = self.sb_inventory(wl)
        self.inv.write_text(yaml.safe_dump(inv, sort_keys=False))

    def sb_inventory(self, wl: dict[str, Any]) -> dict[str, Any]:
        from provision import sandbox

        inv = sandbox.inventory_dict(
            self.sb, JOB, wl["pools"], ssh={**wl["ssh"], "identity_file": str(self.sb.key_path)}, env=wl["env"]
        )
        inv["pools"]["worker"]["replicas"] = self.n - 1
        for pool in inv["pools"].values() if self.args.gpus else ():
            pool["accelerators"] = self.args.gpus
        return inv

    def _floor_files(self) -> dict[str, tuple[bytes, bytes, str]]:
        """host -> (env bytes, unit bytes, unit name) as provision renders them, under FLOOR_JOB."""
        out = self.work / "rendered"
        src = self.inv.read_text().replace(f"job: {JOB}", f"job: {FLOOR_JOB}")
        (self.work / "floor.yaml").write_text(src)
        subprocess.run(
            [sys.executable, "-m", "provision", "render", str(self.work / "floor.yaml"), "-o", str(out)],
            check=True,
            capture_output=True,
            env=self._env(self.args.src[0][1]),
        )
        files = {}
        for h in self.sb.hosts:
            env_dir = out / h.name / "etc" / "provision" / FLOOR_JOB
            task = next(p.stem for p in env_dir.glob("*.env"))
            unit = f"provision-{FLOOR_JOB}-{task}.service"
            files[h.name] = (
                (env_dir / f"{task}.env").read_bytes(),
                (out / h.name / "etc" / "systemd" / "system" / unit).read_bytes(),
                unit,
            )
        return files

    def _env(self, src: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=src)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return env

    # -- floors

    def connect_floor(self) -> tuple[float, float]:
        """(wall s, the hosts' CPU s)"""
        h0 = self.fleet.host_cpu()
        wall = self.fleet.floor()
        return wall, self.fleet.host_cpu() - h0

    def work_floor(self) -> tuple[float, float]:
        """Connect + one command per host (write env and unit from stdin, start), at once:
        (wall s, the hosts' CPU s)."""
        self.fleet.run_all(lambda h: self.compare.clean_command(FLOOR_JOB))
        barrier = threading.Barrier(self.n + 1)
        errors: list[BaseException] = []
        d = f"/etc/provision/{FLOOR_JOB}"

        def one(h: Any) -> None:
            env, unit_b, unit = self.floor_files[h.name]
            cmd = (
                f"mkdir -p {d} && dd bs={len(env)} count=1 iflag=fullblock status=none of={d}/{unit.split('-', 2)[2].removesuffix('.service')}.env"
                f" && cat > /etc/systemd/system/{unit}"
                f" && systemctl start {unit}"
            )
            barrier.wait()
            try:
                c = self.fleet._client(h)
                stdin, out, err = c.exec_command(cmd)
                stdin.write(env + unit_b)
                stdin.channel.shutdown_write()
                if out.channel.recv_exit_status() != 0:
                    raise RuntimeError(f"{h.name}: work floor failed: {err.read()[-300:]!r}")
                c.close()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(h,)) for h in self.sb.hosts]
        for t in threads:
            t.start()
        h0 = self.fleet.host_cpu()
        t0 = time.perf_counter()
        barrier.wait()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        hosts = self.fleet.host_cpu() - h0
        self.fleet.run_all(lambda h: self.compare.clean_command(FLOOR_JOB))
        if errors:
            raise RuntimeError(f"work floor: {errors[0]!r}")
        return elapsed, hosts

    # -- provision

    def clean(self) -> None:
        """The hosts as before the job's first apply: its files, units and ledger entry gone."""
        self.fleet.run_all(lambda h: self.compare.clean_command(JOB) + f"; rm -f /var/lib/provision/.ledger/{JOB}.json")
        for p in (self.work / ".provision").glob(f"{JOB}.state.json*"):
            p.unlink()

    def argv(self, op: str) -> list[str]:
        return {
            "first": ["apply", "-y", str(self.inv)],
            "noop": ["apply", "-y", str(self.inv)],
            "plan": ["plan", str(self.inv)],
        }[op]

    def timed(self, src: str, op: str) -> dict[str, float]:
        if op == "first":
            self.clean()
        h0 = self.fleet.host_cpu()
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "provision", *self.argv(op)],
            cwd=self.work,
            env=self._env(src),
            capture_output=True,
        )
        wall = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode not in (0, 2) or (op == "first" and p.returncode != 0):
            raise RuntimeError(f"{op}: exit {p.returncode}: {p.stderr.decode()[-800:]}")
        return {
            "wall": wall,
            "controller": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
            "hosts": self.fleet.host_cpu() - h0,
        }

    def instrumented(self, src: str, op: str) -> dict[str, Any]:
        if op == "first":
            self.clean()
        out = self.work / f"inner-{op}.json"
        p = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--inner", str(out), "--", *self.argv(op)],
            cwd=self.work,
            env=self._env(src),
            capture_output=True,
        )
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"{op} (instrumented): exit {p.returncode}: {p.stderr.decode()[-800:]}")
        return dict(json.loads(out.read_text()))


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"


OPS = {"first": "first apply", "plan": "plan", "noop": "no-op apply"}


def breakdown(label: str, op: str, d: dict[str, Any], n: int) -> list[str]:
    """One instrumented command as text: round trips per host, CPU by part."""
    lines = [f"### {label}: {OPS[op]} (instrumented, exit {d['code']})", ""]
    seqs: Counter[str] = Counter()
    spans = []
    for _host, evs in d["events"].items():
        evs = sorted(evs)
        seqs[" -> ".join(e[2] for e in evs)] += 1
        spans.append(evs[-1][1] - evs[0][0])
    lines.append("round trips per host, from the first connect to the last answer (hosts: sequence):")
    for seq, k in seqs.most_common():
        commands = seq.count("->") + 1 - seq.count("connect")
        lines.append(f"  {k:4d}: {seq}   [{commands} command{'s' if commands != 1 else ''} after the connect]")
    if spans:
        lines.append(f"  per host, first connect to last answer: {_med(spans)} s")
    total = d["total_cpu"]
    parts = dict(sorted(d["cpu"].items(), key=lambda kv: -kv[1]))
    known = sum(parts.values())
    lines += ["", f"controller CPU: {total:.3f} s in all, {total / n * 1000:.1f} ms per host", ""]
    lines.append(f"  {'part':48s} {'s':>7s} {'ms/host':>8s} {'calls':>6s}")
    lines.append(f"  {'start-up (interpreter, imports)':48s} {d['start_cpu']:7.3f} {d['start_cpu'] / n * 1000:8.2f}")
    for part, s in parts.items():
        lines.append(f"  {part:48s} {s:7.3f} {s / n * 1000:8.2f} {d['calls'].get(part, 0):6d}")
    rest = total - d["start_cpu"] - known
    lines.append(f"  {'the rest (click, inventory, placement, threads)':48s} {rest:7.3f} {rest / n * 1000:8.2f}")
    lines.append(f"  sha256 calls: {d['calls'].get('sha256', 0)} ({d['calls'].get('sha256', 0) / n:.1f} per host)")
    lines.append("")
    return lines


Walls = dict[tuple[str, str], list[dict[str, float]]]  # (source, command) -> each plain run's
Floors = dict[str, list[tuple[float, float]]]  # "connect"/"work" -> (wall, hosts' CPU) of each


def turns(
    b: Bench, srcs: dict[str, str], order: list[str], args: argparse.Namespace
) -> tuple[Walls, Floors, dict[tuple[str, str], list[float]], list[str]]:
    """Each source's turn in `order`: its commands, instrumented once and --runs times plain,
    beside their floors; (walls, floors, each plain plan's and no-op's wall over the connect
    floor run just before it, the breakdowns' lines)."""
    out: list[str] = []
    walls: Walls = defaultdict(list)
    floors: Floors = defaultdict(list)
    paired: dict[tuple[str, str], list[float]] = defaultdict(list)
    broken: set[str] = set()
    ops = [op for op in OPS if op in args.ops.split(",")]
    if "first" not in ops:
        b.timed(srcs[order[0]], "first")  # the job on the hosts: what a plan and a no-op compare with
    for label in order:
        s = srcs[label]
        for op in ops:
            if not args.no_breakdown and label not in broken:
                out += breakdown(label, op, b.instrumented(s, op), b.n)
            for _ in range(args.runs):
                floors["connect"].append(b.connect_floor())
                if op == "first":
                    floors["work"].append(b.work_floor())
                walls[(label, op)].append(b.timed(s, op))
                if op != "first":
                    paired[(label, op)].append(walls[(label, op)][-1]["wall"] / floors["connect"][-1][0])
                log(f"{label} {op}: {walls[(label, op)][-1]['wall']:.3f} s")
        broken.add(label)
    return walls, floors, paired, out


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--inner":
        inner(sys.argv[2], sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sandbox")
    ap.add_argument("--src", action="append", default=[], metavar="LABEL=DIR", help="a source tree (PYTHONPATH)")
    ap.add_argument("--order", default="", help="the sources' order by label, e.g. ABBA (default: each once)")
    ap.add_argument("--runs", type=int, default=3, help="plain runs of each command per source turn")
    ap.add_argument("--work", default="/tmp/roundtrips")
    ap.add_argument("--out")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs each task takes (a sandbox with GPUs)")
    ap.add_argument("--ops", default="first,plan,noop", help="the commands timed, of first, plan, noop")
    args = ap.parse_args()
    src = [tuple(s.split("=", 1)) for s in args.src] or [("here", str(HERE.parent / "src"))]
    args.src = src
    srcs = dict(src)
    order = list(args.order) if args.order else [label for label, _ in src]
    b = Bench(args)
    load0 = os.getloadavg()
    walls, floors, paired, out = turns(b, srcs, order, args)
    b.clean()
    b.fleet.close()
    # No work floor with --ops plan,noop: its figures are nan.
    fw = {k: [w for w, _ in floors[k]] for k in ("connect", "work")}
    fh = {k: statistics.median(h for _, h in floors[k]) / b.n * 1000 if floors[k] else math.nan for k in fw}
    cf, wf = (statistics.median(fw[k]) if fw[k] else math.nan for k in ("connect", "work"))
    head = [
        f"# provision's round trips and CPU per host, {b.n} sandbox hosts ({time.strftime('%Y-%m-%d %H:%M')} UTC)",
        "",
        f"`python bench/roundtrips.py {' '.join(sys.argv[1:])}`; load average at start {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f}, at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"sources: {', '.join(f'{k}={v}' for k, v in src)}; order {''.join(order)}.",
        "",
        f"connect floor (connect + `true`): {_med(fw['connect'])} s, hosts' CPU {fh['connect']:.1f} ms/host",
        f"work floor (connect + write env and unit + start, one command): {_med(fw['work'])} s, "
        f"hosts' CPU {fh['work']:.1f} ms/host",
        "",
        f"  {'source':8s} {'command':12s} {'wall s: median (min-max)':28s} {'/connect':>9s} {'/work':>7s}"
        f" {'ctrl CPU ms/host':>17s} {'hosts CPU ms/host':>18s}  paired /connect: median (min-max)",
    ]
    for (label, op), rs in sorted(walls.items(), key=lambda kv: (kv[0][0], list(OPS).index(kv[0][1]))):
        w = [r["wall"] for r in rs]
        m = statistics.median(w)
        ctrl = statistics.median(r["controller"] for r in rs) / b.n * 1000
        hosts = statistics.median(r["hosts"] for r in rs) / b.n * 1000
        head.append(
            f"  {label:8s} {OPS[op]:12s} {_med(w):28s} {m / cf:8.2f}x {m / wf:6.2f}x {ctrl:17.1f} {hosts:18.1f}"
            + (f"  {_med(paired[(label, op)])}" if paired[(label, op)] else "")
        )
    text = "\n".join(head + [""] + out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
