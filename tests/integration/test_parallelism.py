"""--parallelism bounds the controller's threads and sockets, not the host count: a 6-host
apply, status and plan at --parallelism 2, the CLI's process sampled from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HOSTS = 6
PARALLELISM = 2
# main thread + per slot: a pool worker, its connection's paramiko transport thread, the
# stderr reader of its command and the handshake watchdog timer; + a few of the CLI's own.
MAX_THREADS = 1 + 4 * PARALLELISM + 4
MAX_SOCKETS = PARALLELISM + 1  # one per open connection (+1: the main thread may hold one)


@pytest.fixture(scope="module")
def sandbox6(sandbox_factory):
    sb = sandbox_factory(hosts=HOSTS)
    yield sb
    sandbox_factory.down(sb)


def sampled(*args, cwd: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess, int, int]:
    """`python -m provision ARGS` with its peak thread count and open sockets (every 5 ms)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "provision", *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = {"threads": 0, "sockets": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
                sockets = 0
                for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                    try:
                        sockets += os.readlink(f"/proc/{proc.pid}/fd/{fd}").startswith("socket:")
                    except OSError:
                        pass
            except (OSError, StopIteration):
                threads = sockets = 0
            peak["threads"] = max(peak["threads"], threads)
            peak["sockets"] = max(peak["sockets"], sockets)
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate(timeout=timeout)
    done.set()
    th.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), peak["threads"], peak["sockets"]


def test_threads_and_sockets_are_bounded_by_parallelism(sandbox6, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox6,
        job="par",
        path=inv,
        pools={"worker": {"replicas": HOSTS, "command": ["/bin/sh", "-c", "exec sleep 600"]}},
    )
    par = ("--parallelism", PARALLELISM)
    peaks = {}
    try:
        for op in (("apply", "-y"), ("status", "--json"), ("plan",)):
            r, threads, sockets = sampled(*op, *par, inv, cwd=tmp_path)
            assert r.returncode == 0, r.stdout + r.stderr
            peaks[op[0]] = (threads, sockets)
            if op[0] == "status":
                status = json.loads(r.stdout)
                states = {t["task"]: t["state"] for t in status["tasks"]}
                assert len(states) == HOSTS and set(states.values()) == {"Running"}, r.stdout
        print(f"peak (threads, sockets) at --parallelism {PARALLELISM} on {HOSTS} hosts: {peaks}")
        for op, (threads, sockets) in peaks.items():
            assert threads <= MAX_THREADS, f"{op}: {threads} threads at --parallelism {PARALLELISM}"
            assert sockets <= MAX_SOCKETS, f"{op}: {sockets} sockets at --parallelism {PARALLELISM}"
    finally:
        subprocess.run([sys.executable, "-m", "provision", "destroy", "-y", inv], cwd=tmp_path, capture_output=True)
