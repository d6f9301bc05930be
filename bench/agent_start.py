#!/usr/bin/env python3
"""The host agent's start: the CPU a host spends per agent call before and around its work.

    python bench/agent_start.py SANDBOX [--host host-1] [--runs 200] [--src A=DIR --src B=DIR] [--out FILE]

On one host of a running sandbox, each source's agent (its bundle and boot command, as the
controller sends them) runs --runs times in a row from a driver on the host, each call a
fresh `python3 -S` as over SSH, with stdin the bundle and a request, and the driver sums
each call's CPU (user + system, from wait4's rusage: nothing but the call itself):

- `python3 -S -c pass`: the interpreter alone;
- an empty batch: the agent's start (loader, the modules every call imports, main);
- a probe of a job not on the host, with facts and the ledger (what a first apply's guard
  asks, GPUs included on a sandbox with them).

The modules' compiled cache is warm (a first call fills it), as on a host after its first
call. Then `-X importtime` of the empty batch: the imports that cost the most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Runs on the host: each call from a file holding its stdin, CPU from wait4 (microseconds).
DRIVER = r"""
import os, sys
argv, stdin, runs = sys.argv[1:-2], sys.argv[-2], int(sys.argv[-1])
out = []
for _ in range(runs):
    fd = os.open(stdin, os.O_RDONLY)
    null = os.open("/dev/null", os.O_WRONLY)
    pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[(os.POSIX_SPAWN_DUP2, fd, 0), (os.POSIX_SPAWN_DUP2, null, 1)])
    os.close(fd); os.close(null)
    _, status, ru = os.wait4(pid, 0)
    if status:
        sys.exit("exit status %d" % status)
    out.append(int((ru.ru_utime + ru.ru_stime) * 1e6))
print(" ".join(map(str, out)))
"""


def _built(src: str, request: dict) -> tuple[str, bytes]:
    """(boot command, stdin) of the agent in `src` for `request`, built by that source."""
    code = (
        "import json,sys;from provision.host import bundle;"
        "sys.stdout.buffer.write(json.dumps(bundle.boot_command()).encode()+b'\\n'+bundle.payload())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=src), capture_output=True, check=True
    ).stdout
    boot, payload = out.split(b"\n", 1)
    return json.loads(boot), payload + json.dumps(request).encode()


def _exec(sb, host: str, cmd: list[str], stdin: bytes = b"") -> str:
    name = next(h for h in sb.hosts if h.name == host).container
    p = subprocess.run(["docker", "exec", "-i", name, *cmd], input=stdin, capture_output=True, check=True)
    return p.stdout.decode()


def measure(sb, host: str, label: str, argv: list[str], stdin: bytes, runs: int) -> list[float]:
    path = f"/tmp/agent-start-{label}.in"
    _exec(sb, host, ["sh", "-c", f"cat > {path}"], stdin)
    _exec(sb, host, ["python3", "-S", "-c", DRIVER, *argv, path, "1"])  # the cache warm
    got = _exec(sb, host, ["python3", "-S", "-c", DRIVER, *argv, path, str(runs)])
    return [int(x) / 1000 for x in got.split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sandbox")
    ap.add_argument("--host", default="host-1")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--src", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--out")
    args = ap.parse_args()
    from provision import sandbox

    sb = sandbox.load(args.sandbox)
    gpus = sb.gpus_per_host
    srcs = [tuple(s.split("=", 1)) for s in args.src] or [("here", str(HERE.parent / "src"))]
    probe = {
        "op": "probe",
        "job": "agentstart",
        "want": {"/etc/provision/agentstart/chief-0.env": "0" * 64},
        "units": ["provision-agentstart-chief-0.service"],
        "facts": "check",
        "facts_only": ["gpus"] if gpus else [],
        "tenancy": True,
    }
    lines = [
        f"# The host agent's start, CPU per call on {args.host} of {args.sandbox} "
        f"({gpus} GPUs a host; {time.strftime('%Y-%m-%d %H:%M')} UTC)",
        "",
        f"`python bench/agent_start.py {' '.join(sys.argv[1:])}`; load average {os.getloadavg()[0]:.2f} at start.",
        "",
        f"  {'source':8s} {'call':34s} {'CPU ms/call: median':>20s} {'p10-p90':>14s}",
    ]
    imports = {}
    for label, src in srcs:
        boot, empty = _built(src, {"op": "batch", "requests": []})
        _, probed = _built(src, probe)
        argv = ["sh", "-c", boot]
        for what, cmd, stdin in (
            ("python3 -S -c pass", ["python3", "-S", "-c", "pass"], b""),
            ("empty batch (the agent's start)", argv, empty),
            ("probe, facts and ledger (the guard's)", argv, probed),
        ):
            ms = sorted(measure(sb, args.host, label, cmd, stdin, args.runs))
            p10, p90 = ms[len(ms) // 10], ms[len(ms) * 9 // 10]
            lines.append(f"  {label:8s} {what:34s} {statistics.median(ms):20.2f} {p10:6.2f}-{p90:.2f}")
        traced = boot.replace("python3 -S", "python3 -S -X importtime", 1) + " 2>&1 >/dev/null"
        trace = _exec(sb, args.host, ["sh", "-c", traced], empty)
        rows = [r.split("|") for r in trace.splitlines() if r.startswith("import time:") and "self" not in r]
        imports[label] = sorted(((int(r[1].split(":")[-1]), r[2].rstrip()) for r in rows if len(r) == 3), reverse=True)
    for label, rows in imports.items():
        lines += ["", f"{label}: the empty batch's imports by cumulative time (us, -X importtime; one run):"]
        lines += [f"  {us:7d}  {name}" for us, name in rows[:12]]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
