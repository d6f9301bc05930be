"""Benchmark (dev sessions): from `provision dev` to a working `ssh provision-dev-NAME
nvidia-smi` on a warm sandbox host, and how soon an idle session's GPUs are free after its
idle limit, while a busy one and a logged-in one are never ended for idleness.

    PYTHONPATH=$PWD/src python bench/dev_start.py [--repeat 10] [--sandbox NAME] [--keep]

A sandbox of 2 hosts (2 stand-in GPUs each), warmed by one session started and stopped
(the agent compiled on the hosts, the session program pushed once). Then --repeat times:
the clock from the start of `provision dev INV --name bN` (a new process, as a person
types it) to the end of `ssh -F $HOME/.ssh/config provision-dev-bN nvidia-smi` (OpenSSH
through the config provision wrote: the user's file with its Include line); the session
is stopped between runs (not timed). Target: <= 5 s each.

Then `provision serve --inventory INV` with the test knobs (idle time IDLE_S, warning
WARN_S before): an idle session (nobody logged in, 0 %), a busy one (its GPU at 60 %, the
stand-in's utilization file) and a logged-in one (ssh -tt); the ledger is polled every
half second until the idle one's GPU is free: how long after its idle limit. The other two
are looked at after twice the idle time: still running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servebench import Report

from provision import sandbox
from provision.sandbox.inventory import dump

TARGET_S = 5.0
IDLE_S, WARN_S = 90, 20
ROUND_S = 10.0  # the service's rounds while an end is due (serve/gpusample.SAMPLE_EVERY)
SLEEP = ["/bin/sh", "-c", "exec sleep 600"]


def provision(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "provision", *args], cwd=cwd, capture_output=True, text=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--sandbox", default="")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    rep = Report(f"{time.strftime('%Y-%m-%d')}-dev-start", "provision dev: start to ssh, and idle GPUs back")
    client = sandbox.check_engine()
    name = args.sandbox or f"devbench{os.getpid()}"
    sb = sandbox.load(name) if args.sandbox else sandbox.up(name, hosts=2, gpus_per_host=2, client=client)
    try:
        with tempfile.TemporaryDirectory() as d:
            run(rep, sb, Path(d), args.repeat)
    finally:
        if not args.keep and not args.sandbox:
            sandbox.down(name, client=client)
    rep.write()


def run(rep: Report, sb: sandbox.Sandbox, d: Path, repeat: int) -> None:
    inv = d / "team.yaml"
    inv.write_text(dump(sandbox.inventory_dict(sb, job="team", pools={"chief": {"replicas": 1, "command": SLEEP}}), sb))
    home = d / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    env = {
        **os.environ,
        "HOME": str(home),
        "PROVISION_OWNER": "ana@lab.example",
        "PROVISION_SERVICE_DB": str(d / "svc.sqlite"),
    }

    def ssh(alias: str, cmd: str) -> subprocess.CompletedProcess:
        argv = ["ssh", "-F", str(home / ".ssh" / "config"), "-o", "BatchMode=yes", alias, cmd]
        return subprocess.run(argv, capture_output=True, text=True, env=env)

    warm = provision("dev", str(inv), "--name", "warm", cwd=d, env=env)
    assert warm.returncode == 0, warm.stderr
    assert ssh("provision-dev-warm", "nvidia-smi -L").returncode == 0
    provision("dev", str(inv), "--stop", "warm", cwd=d, env=env)

    took, cmd_s = [], []
    for i in range(repeat):
        t0 = time.monotonic()
        r = provision("dev", str(inv), "--name", f"b{i}", cwd=d, env=env)
        t1 = time.monotonic()
        s = ssh(f"provision-dev-b{i}", "nvidia-smi")
        t2 = time.monotonic()
        assert r.returncode == 0 and s.returncode == 0 and "NVIDIA H100" in s.stdout, r.stderr + s.stderr
        took.append(t2 - t0)
        cmd_s.append(t1 - t0)
        rep.say(f"run {i + 1}: provision dev {t1 - t0:.2f} s, then ssh nvidia-smi {t2 - t1:.2f} s: {t2 - t0:.2f} s")
        provision("dev", str(inv), "--stop", f"b{i}", cwd=d, env=env)
    rep.say(
        f"start to a working ssh nvidia-smi over {repeat} runs: median {statistics.median(took):.2f} s, "
        f"max {max(took):.2f} s (provision dev alone: median {statistics.median(cmd_s):.2f} s)"
    )
    rep.verdict(f"every run <= {TARGET_S:g} s", f"max {max(took):.2f} s", max(took) <= TARGET_S)
    idle(rep, sb, inv, home, env, ssh)


def idle(rep: Report, sb: sandbox.Sandbox, inv: Path, home: Path, env: dict[str, str], ssh) -> None:  # noqa: ANN001
    knobs = {"PROVISION_TEST_DEV_IDLE_S": str(IDLE_S), "PROVISION_TEST_DEV_WARN_S": str(WARN_S)}
    log = inv.parent / "serve.log"
    with open(log, "wb") as out:
        svc = subprocess.Popen(
            [sys.executable, "-m", "provision", "serve", "--poll", "0.5", "--listen", "none", "--inventory", str(inv)],
            cwd=inv.parent, stdout=out, stderr=subprocess.STDOUT, env={**env, **knobs},
        )  # fmt: skip
    login = None
    try:
        for n in ("idle", "busy", "here"):
            assert provision("dev", str(inv), "--name", n, cwd=inv.parent, env=env).returncode == 0
        sessions = {
            s["name"]: s
            for s in json.loads(provision("dev", str(inv), "--list", "--json", cwd=inv.parent, env=env).stdout)[
                "sessions"
            ]
        }
        b = sessions["busy"]
        sb.docker_exec(
            b["host"], ["/bin/sh", "-c", f"printf '{b['gpus'][0]} 60\\n' > /etc/provision-sandbox/utilization"]
        )
        argv = [
            "ssh",
            "-F",
            str(home / ".ssh" / "config"),
            "-o",
            "BatchMode=yes",
            "-tt",
            "provision-dev-here",
            "sleep 600",
        ]
        login = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        s = sessions["idle"]
        limit = s["since"] + IDLE_S
        freed = None
        while time.time() < limit + 5 * 60:
            view = json.loads(provision("jobs", "--json", str(inv), cwd=inv.parent, env=env).stdout)
            if s["gpus"][0] in view["hosts"][s["host"]]["free_gpus"]:
                freed = time.time()
                break
            time.sleep(0.5)
        assert freed is not None, log.read_text()
        rep.say(
            f"idle session (idle time {IDLE_S} s, warned {WARN_S} s before): its GPU free {freed - limit:.1f} s after its idle limit"
        )
        rep.verdict(
            f"free within one round ({ROUND_S:g} s) of its idle limit, and the round's own time",
            f"{freed - limit:.1f} s",
            freed - limit <= ROUND_S + 5,
        )
        while time.time() < sessions["busy"]["since"] + 2 * IDLE_S:
            time.sleep(1)
        now = {
            x["name"]: x
            for x in json.loads(provision("dev", str(inv), "--list", "--json", cwd=inv.parent, env=env).stdout)[
                "sessions"
            ]
        }
        kept = [n for n in ("busy", "here") if now[n]["state"] == "running"]
        rep.verdict(
            "a busy session and a logged-in one never ended for idleness (twice the idle time)",
            ", ".join(kept) or "none",
            kept == ["busy", "here"],
        )
        warned = [line for line in log.read_text().splitlines() if " warned: " in line or " ended: " in line]
        for line in warned:
            rep.say(f"  service: {line}")
    finally:
        if login is not None:
            login.kill()
        svc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            svc.wait(60)
        for h in ("host-1", "host-2"):
            sb.docker_exec(h, ["/bin/sh", "-c", "rm -f /etc/provision-sandbox/utilization"])
        for n in ("idle", "busy", "here"):
            provision("dev", str(inv), "--stop", n, cwd=inv.parent, env=env)


if __name__ == "__main__":
    main()
