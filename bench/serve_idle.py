"""Benchmark ("the service watching 128 sandbox hosts and 100 idle jobs uses < 5 %
of one core and < 200 MiB; it keeps its SSH connections open"):

    PYTHONPATH=$PWD/src python bench/serve_idle.py [--hosts 128] [--jobs 100] [--seconds 90]
        [--sandbox NAME (reuse a running sandbox)] [--keep (leave the sandbox up)]
        [--src PATH (the provision the service and the applies run: another commit's
         `git archive REV src templates`, for A against B; default this checkout's src)]

A sandbox of --hosts hosts (8 fake GPUs each); --jobs jobs spread over them (every host
holds one job: the first hosts - jobs jobs have two hosts), each one task per host that
sleeps (`sleep infinity`, one GPU), handed to a `provision serve` (embedded database,
default --poll, no pages) with `provision apply --queue --detach`: the service applies
each and then watches it until it ends (rules/watch.py: from the service's round of every
host every 10 s while looked at, else every minute; before d7640a1, a worker process per job looked every 10 s). Jobs applied from a terminal are not watched by the service
(only --inventory pages probe them, when a page asks), so handing them over is the case.

Measured over --seconds, once every job runs (and once before any was handed over, the
service alone): CPU from /proc/PID/stat (utime + stime) of the service and every
descendant (its workers), RSS summed over them, and the TCP connections they hold to the
hosts' SSH ports (ss), sampled every 2 s: how many at once and how many distinct ones over
the window (the same number: kept open; more: reconnecting).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from servebench import ROOT, Report, Sampler, Serve, median, rss_mib, tree

from provision import sandbox
from provision.sandbox.inventory import dump

CPU_BOUND = 0.05  # of one core
RSS_BOUND = 200.0  # MiB


def connections(pids: set[int], ports: set[int]) -> set[tuple[int, int]]:
    """(local port, remote port) of the established TCP connections these processes hold to the hosts."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 5:
            continue
        local, peer = cols[2], cols[3]
        rport = int(peer.rsplit(":", 1)[1])
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if rport in ports and owners & pids:
            found.add((int(local.rsplit(":", 1)[1]), rport))
    return found


def assign(hosts: list[str], jobs: int) -> list[list[str]]:
    """Every host in one job: the first len(hosts) - jobs jobs take two."""
    doubles = max(0, len(hosts) - jobs)
    out, i = [], 0
    for j in range(jobs):
        k = 2 if j < doubles else 1
        out.append(hosts[i : i + k])
        i += k
    return out


def submit(inv: Path, env: dict[str, str]) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "provision", "apply", "--queue", "--detach", inv.name],
        cwd=inv.parent,
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{inv}: {r.stdout}{r.stderr}")
    return r.stdout


def watched(db: Path) -> tuple[int, int]:
    """Runs the service follows (applied, not ended) and submissions that failed."""
    with sqlite3.connect(db, timeout=30) as c:
        runs = c.execute(
            "SELECT count(*) FROM provision_service_history WHERE kind = 'run' AND ended IS NULL"
        ).fetchone()[0]
        failed = c.execute("SELECT count(*) FROM provision_service_submissions WHERE status = 'failed'").fetchone()[0]
    return int(runs), int(failed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(rep: Report, what: str, svc: Serve, seconds: float, ports: set[int]) -> Sampler:
    conns: list[set[tuple[int, int]]] = []

    def count() -> float:
        conns.append(connections(set(tree(svc.p.pid)), ports))
        return float(len(conns[-1]))

    s = Sampler(svc.p.pid, every=2.0, extra=count)
    s.run(seconds)
    seen = set().union(*conns) if conns else set()
    procs = [n for *_, n in s.samples]
    rep.say(f"{what}: {s.samples[-1][0] - s.samples[0][0]:.0f} s, {min(procs)}-{max(procs)} processes")
    rep.say(f"  CPU {100 * s.cpu_share():.2f} % of one core (utime+stime of the service and its workers)")
    rep.say(f"  RSS max {s.rss_max():.1f} MiB (sum), median {median([x[2] for x in s.samples]):.1f} MiB")
    if conns:
        counts = [len(c) for c in conns]
        rep.say(
            f"  SSH connections to the hosts: {min(counts)}-{max(counts)} at once, {len(seen)} distinct over "
            f"{len(conns)} samples ({len(seen) - len(conns[0])} opened after the first sample)"
        )
    return s


def round_times(db: Path) -> list[float]:
    with sqlite3.connect(db, timeout=30) as c:
        return [float(r[0]) for r in c.execute("SELECT DISTINCT t FROM provision_service_gpu_samples ORDER BY t")]


def health_abba(
    rep: Report, svc: Serve, tmp: Path, env: dict[str, str], port: int, ports: set[int], rounds: int
) -> Serve:
    """The idle service with its health read and without, A B B A, in one sitting: each a
    service started again on the same database (it watches the same jobs), measured from
    the middle of a quiet gap over `rounds` whole rounds (every QUIET_EVERY s)."""
    db = Path(env["PROVISION_SERVICE_DB"])
    share: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False, False, True):
        svc.stop()
        svc = Serve(tmp / "serve", {**env, "PROVISION_BENCH_NO_HEALTH": "" if on else "1"},
                    ("--listen", f"127.0.0.1:{port}"))  # fmt: skip
        svc.wait_for("leading", 60)
        before = len(round_times(db))
        end = time.monotonic() + 300
        while len(round_times(db)) < before + 1 and time.monotonic() < end:  # its first round (connecting)
            time.sleep(1)
        time.sleep(max(0.0, round_times(db)[-1] + 30.0 - time.time()))  # the middle of the gap
        what = "with the health read" if on else "without it (PROVISION_BENCH_NO_HEALTH=1)"
        m = measure(rep, f"  {'A' if on else 'B'}: {what}, {rounds} rounds", svc, rounds * 60.0, ports)
        share[on].append(m.cpu_share())
    a, b = statistics.mean(share[True]), statistics.mean(share[False])
    rep.say(f"health read on: {', '.join(f'{100 * x:.2f}' for x in share[True])} % of a core (mean {100 * a:.2f} %); "
            f"off: {', '.join(f'{100 * x:.2f}' for x in share[False])} % (mean {100 * b:.2f} %)")  # fmt: skip
    rep.verdict("the health read adds <= 10 % to the idle service's CPU", f"+{100 * (a - b) / b:.1f} %", a <= 1.1 * b)
    return svc


def main() -> int:  # noqa: C901  one bench's steps in order, each with its report lines
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=128)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--sandbox", help="a running sandbox's name (else one is started and removed)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the provision the service and applies run")
    ap.add_argument("--name", default="2026-11-27-issue40-serve-idle")
    ap.add_argument(
        "--health-abba",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then the service restarted 4 times, A B B A: with the health read, without it "
        "(PROVISION_BENCH_NO_HEALTH=1), without, with; each measured over ROUNDS whole rounds",
    )
    args = ap.parse_args()
    rep = Report(args.name, f"the service watching {args.hosts} sandbox hosts and {args.jobs} idle jobs")
    rep.say(f"the service and the applies run {args.src.resolve()}")
    t = time.monotonic()
    sb = (
        sandbox.load(args.sandbox)
        if args.sandbox
        else sandbox.up("servebench", hosts=args.hosts, gpus_per_host=8, timeout=900)
    )
    hosts = [h.name for h in sb.hosts][: args.hosts]
    rep.say(f"sandbox {sb.name}: {len(hosts)} hosts ({time.monotonic() - t:.0f} s to have them)")
    ports = {h.ssh_port for h in sb.hosts if h.name in hosts}
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-idle-"))
    db = tmp / "svc" / "service.sqlite"
    env = {
        **os.environ,
        "PYTHONPATH": str(args.src.resolve()),
        "PROVISION_SERVICE_DB": str(db),
        "PROVISION_OWNER": "bench@example.com",
    }
    invs = []
    for j, mine in enumerate(assign(hosts, args.jobs), 1):
        d = tmp / f"job{j:03d}"
        d.mkdir()
        pools = {"worker": {"replicas": len(mine), "accelerators": 1, "command": ["sleep", "infinity"]}}
        inv = sandbox.inventory_dict(sb, job=f"idle{j:03d}", pools=pools, hosts=mine)
        (d / "job.yaml").write_text(dump(inv, sb))
        invs.append(d / "job.yaml")
    port = free_port()
    svc = Serve(tmp / "serve", env, ("--listen", f"127.0.0.1:{port}"))
    try:
        svc.wait_for("leading", 60)
        time.sleep(5)
        if not args.health_abba:
            measure(rep, "the service alone (nothing handed over)", svc, 60.0, ports)
        t = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: submit(p, env), invs))
        rep.say(f"{len(invs)} jobs handed over (`apply --queue --detach`) in {time.monotonic() - t:.0f} s")
        end = time.monotonic() + 1800
        while time.monotonic() < end:
            runs, failed = watched(db)
            if runs + failed >= len(invs):
                break
            time.sleep(5)
        runs, failed = watched(db)
        rep.say(
            f"{runs} jobs applied and watched, {failed} failed, {time.monotonic() - t:.0f} s after the first hand-over"
        )
        if failed:
            with sqlite3.connect(db, timeout=30) as c:
                for job, why in c.execute("SELECT job, why FROM provision_service_submissions WHERE status = 'failed'"):
                    rep.say(f"  failed: {job}: {why}")
        time.sleep(20)  # the applies' aftermath (workers' first looks) settles
        s = measure(rep, f"the service watching {runs} idle jobs on {len(hosts)} hosts", svc, args.seconds, ports)
        if args.health_abba:
            svc = health_abba(rep, svc, tmp, env, port, ports, args.health_abba)
        # Someone looks: /metrics scraped every 15 s (the last round's samples, no probe of its
        # own), so the rounds come every 10 s instead of every minute (serve/gpusample.round_every).
        scraping = threading.Event()

        def scrape() -> None:
            while not scraping.wait(15.0):
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()

        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        time.sleep(12)  # the first round at the fast rate
        looked = measure(
            rep,
            "the same, /metrics scraped every 15 s (rounds every 10 s, every 5 s while a job holds a GPU)",
            svc,
            args.seconds,
            ports,
        )
        scraping.set()
        pids = tree(svc.p.pid)
        main_rss = rss_mib(svc.p.pid)
        workers = [rss_mib(p) for p in pids if p != svc.p.pid]
        rep.say(
            f"  RSS now: the service's process {main_rss:.1f} MiB; {len(workers)} worker processes, "
            f"median {median(workers):.1f} MiB each"
        )
        share, rss = s.cpu_share(), s.rss_max()
        rep.verdict(f"CPU < {100 * CPU_BOUND:g} % of one core", f"{100 * share:.2f} %", share < CPU_BOUND)
        rep.verdict(f"RSS < {RSS_BOUND:g} MiB", f"{rss:.1f} MiB", rss < RSS_BOUND)
        rep.say(
            f"  (while scraped: CPU {100 * looked.cpu_share():.2f} % of one core, RSS max {looked.rss_max():.1f} MiB)"
        )
        if runs and runs < args.jobs:
            rep.say(
                f"  linear in the jobs (one worker each): {args.jobs} jobs ~ {100 * share * args.jobs / runs:.1f} % CPU, "
                f"{main_rss + median(workers) * args.jobs:.0f} MiB"
            )
    finally:
        svc.stop()
        if not args.keep:
            sandbox.down(sb.name)
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
