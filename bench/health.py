"""Benchmarks of GPU and host health (docs/health.md), on sandbox hosts:

    PYTHONPATH=$PWD/src python bench/health.py latency [--trials 6]
        a fatal Xid on a held GPU: quarantined (the host's record) and its owner told (the
        `gpu.quarantined` event, naming the job and its owner) within one service round;
    PYTHONPATH=$PWD/src python bench/health.py race [--applies 1000] [--seconds 1800] [--hosts 4]
        [--gpus 4] [--appliers 4]
        applies racing with quarantines and releases: no work ever placed on a quarantined
        GPU, as sampled on the hosts (their ledger and health record read together, under
        the ledger's lock, every 1 s) and as every task says (its start and its
        CUDA_VISIBLE_DEVICES, against the spans its GPU was certainly quarantined);
    PYTHONPATH=$PWD/src python bench/health.py soak [--seconds 1800] [--hosts 32]
        a healthy cluster watched by the service (a page looking, a GPU held on each host:
        rounds every 5 s): no false quarantine, no suspect, no incident.

The idle service's CPU with and without the health read is bench/serve_idle.py
--health-abba ROUNDS (A B B A in one sitting; bench/results/*-health-serve-idle-*.txt).

Each writes bench/results/<date>-health-<what>.txt. The service runs with its embedded
database, a page looking (a client reads /api/v1/hosts every 5 s): rounds every 10 s, every
5 s while a job holds a GPU (serve/gpusample.HELD_EVERY).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from servebench import ROOT, Report, Serve

from provision import sandbox
from provision.host import layout
from provision.sandbox.inventory import dump
from provision.serve.gpusample import HELD_EVERY

FAULTS = "/etc/provision-sandbox"
ROUND = HELD_EVERY  # the service's period while a page looks and a job holds a GPU
BOUND = 10.0  # seconds from the kernel's Xid line to the quarantine and its event


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "provision", *args], cwd=cwd, env=env, capture_output=True, text=True)


def docker_sh(sb: sandbox.Sandbox, host: str, cmd: str) -> str:
    code, out = sb.docker_exec(host, ["/bin/sh", "-c", cmd])
    if code != 0:
        raise RuntimeError(f"{host}: {cmd}: {out}")
    return str(out)


class Looker:
    """A page looking: /api/v1/hosts every `every` s, so the rounds come every 10 s."""

    def __init__(self, port: int, every: float = 5.0):
        self.port, self.every, self.stop = port, every, threading.Event()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/hosts", timeout=30).read()
            except OSError:
                pass


def setup(name: str, hosts: int, gpus: int) -> tuple[sandbox.Sandbox, Path, dict[str, str]]:
    sb = sandbox.up(name, hosts=hosts, gpus_per_host=gpus, timeout=900)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PROVISION_SERVICE_DB": str(tmp / "svc" / "service.sqlite"),
           "PROVISION_OWNER": "bench@example.com"}  # fmt: skip
    return sb, tmp, env


def write_inv(sb: sandbox.Sandbox, path: Path, job: str, host: str | None = None, gpus: int = 1) -> Path:
    pool = {"replicas": 1, "accelerators": gpus, "command": ["sleep", "infinity"]}
    if host:
        pool["hosts"] = [host]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(sandbox.inventory_dict(sb, job=job, pools={"chief": pool}), sb))
    return path


def record(sb: sandbox.Sandbox, host: str) -> dict:
    return json.loads(docker_sh(sb, host, f"cat {layout.HEALTH_PATH} 2>/dev/null || echo {{}}"))


def rounds(db: Path) -> list[float]:
    """When each round's GPU samples were stored (the database's clock: this machine's)."""
    with sqlite3.connect(db, timeout=30) as c:
        return [float(r[0]) for r in c.execute("SELECT DISTINCT t FROM provision_service_gpu_samples ORDER BY t")]


def events(db: Path, kind: str) -> list[tuple[float, str, str, str]]:
    with sqlite3.connect(db, timeout=30) as c:
        try:
            return [(float(r[0]), r[1], r[2], r[3]) for r in c.execute(
                "SELECT t, job, owner, words FROM provision_service_events WHERE kind = ? ORDER BY id", (kind,))]  # fmt: skip
        except sqlite3.OperationalError:
            return []


# --------------------------------------------------------------------------- latency


def latency(args: argparse.Namespace) -> int:  # noqa: C901  one bench's steps in order
    rep = Report(
        args.name or time.strftime("%Y-%m-%d-health-latency"),
        "a fatal Xid on a held GPU: quarantined and its owner told",
    )
    sb, tmp, env = setup("hlat", 2, 2)
    db = Path(env["PROVISION_SERVICE_DB"])
    inv = write_inv(sb, tmp / "job" / "job.yaml", "held", "host-1")
    svc = None
    try:
        r = cli("apply", "-y", str(inv), cwd=inv.parent, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        port = free_port()
        svc = Serve(tmp / "serve", env, ("--listen", f"127.0.0.1:{port}", "--inventory", str(inv)))
        svc.wait_for("leading", 60)
        looker = Looker(port)
        end = time.monotonic() + 120
        while len(rounds(db)) < 2 and time.monotonic() < end:
            time.sleep(0.5)
        bus = docker_sh(sb, "host-1", "nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader").splitlines()[0]
        pci = "0000:" + bus.split(", ")[1].split(":", 1)[1][:5].lower()
        took, told = [], []
        for i in range(args.trials):
            time.sleep(random.uniform(0, ROUND))  # anywhere in a round
            # From the kernel line's own time (the host's clock is this machine's: containers
            # share it), not from before `docker exec`, which takes seconds on a loaded machine.
            t0 = float(docker_sh(sb, "host-1", f's=$(date +%s.%N | cut -c1-17); echo "$s host-1 kernel: NVRM: Xid '
                                 f'(PCI:{pci}): 79, pid={i}, name=python3, GPU has fallen off the bus." >> {FAULTS}/kmsg;'
                                 ' echo $s'))  # fmt: skip
            seen = None
            while time.time() - t0 < 120:
                if record(sb, "host-1").get("gpus", {}).get("0", {}).get("state") == "quarantined":
                    seen = time.time()
                    break
                time.sleep(0.2)
            assert seen is not None, svc.output()
            while len(events(db, "gpu.quarantined")) < i + 1 and time.time() - t0 < 120:
                time.sleep(0.2)
            ev = events(db, "gpu.quarantined")[i]
            took.append(seen - t0)
            told.append(ev[0] - t0)
            rep.say(f"trial {i + 1}: quarantined {seen - t0:.1f} s after the Xid, its event stored {ev[0] - t0:.1f} s "
                    f"after it (job {ev[1]}, owner {ev[2]})")  # fmt: skip
            assert ev[1] == "held" and ev[2] == "bench@example.com", ev
            r = cli("health", "release", str(inv), "host-1:0", "--skip-test", cwd=inv.parent, env=env)
            assert r.returncode == 0, r.stdout + r.stderr
            while len(events(db, "gpu.released")) < i + 1 and time.time() - t0 < 180:
                time.sleep(0.2)
        looker.stop.set()
        made = rounds(db)
        gaps = [b - a for a, b in zip(made, made[1:], strict=False)]
        rep.say(f"{args.trials} trials on 2 sandbox hosts x 2 GPUs, a job holding GPU 0 of host-1, rounds every "
                f"{ROUND:g} s (a page looking, a GPU held): {len(made)} rounds, from one round's samples to the next "
                f"median {statistics.median(gaps):.1f} s, max {max(gaps):.1f} s")  # fmt: skip
        rep.say(f"  quarantined after the Xid: median {statistics.median(took):.1f} s, max {max(took):.1f} s")
        rep.say(
            f"  owner told (event stored) after the Xid: median {statistics.median(told):.1f} s, max {max(told):.1f} s"
        )
        # The host is read once a round: an Xid written just after a read waits for the next
        # round (one period), then that round's own time (its probe of every host, the keeper's
        # call to the host) before it is told.
        worst = max(max(took), max(told))
        rep.verdict(f"quarantined and the owner told <= {BOUND:g} s after the Xid", f"max {worst:.1f} s "
                    f"(quarantined {max(took):.1f} s, told {max(told):.1f} s)", worst <= BOUND)  # fmt: skip
    finally:
        if svc is not None:
            svc.stop()
        sandbox.down(sb.name)
    rep.write()
    return 0


# --------------------------------------------------------------------------- race

SAMPLE_SH = (
    f"cd {layout.LEDGER_DIR} 2>/dev/null || exit 0; flock .lock sh -c "
    '\'cat .health.json 2>/dev/null; echo; echo @@; for f in *.json; do [ -f "$f" ] && cat "$f" && echo; done\''
)


def sample(sb: sandbox.Sandbox, host: str) -> list[str]:
    """Work placed on a quarantined GPU here: a ledger entry holding it, reserved after the
    quarantine (ledger and health record read together under the ledger's lock)."""
    out = docker_sh(sb, host, SAMPLE_SH)
    head, _, rest = out.partition("@@")
    rec = json.loads(head) if head.strip() else {}
    bad = []
    marks = rec.get("gpus") or {}
    for line in rest.splitlines():
        if not line.strip():
            continue
        e = json.loads(line)
        for g in e.get("gpus") or []:
            m = marks.get(str(g))
            if m and m.get("state") in ("quarantined", "testing") and float(e.get("since", 0)) > float(m["since"]):
                bad.append(
                    f"{host}: job {e.get('job')} took GPU {g} at {e.get('since')}, quarantined since {m['since']}"
                )
    return bad


STARTS = "/var/tmp/bench-health-starts"  # each task's first line, on its host: when it began, on which GPUs


def task(job: str) -> list[str]:
    """A task that says when it began and on which GPUs (its CUDA_VISIBLE_DEVICES), then
    sleeps. When it began is its process's start as the kernel keeps it (/proc/PID/stat's
    starttime, clock ticks since boot, dated by the clock and /proc/uptime read together):
    systemd made it in the agent's `systemctl start`, while the agent held the ledger's lock
    after its last look at the health record. The shell's own clock read comes later (its
    `date` is a process of its own, tens of ms later on a loaded machine) and would date a
    start that came before a quarantine after it."""
    line = (
        "read u _ < /proc/uptime; n=$(date +%s.%N); set -- $(cut -d' ' -f22 /proc/$$/stat) $(getconf CLK_TCK); "
        f'echo "$n $u $1 $2 {job} $CUDA_VISIBLE_DEVICES" >> {STARTS}; exec sleep infinity'
    )
    return ["sh", "-c", line]


def started_on_quarantined(
    starts: dict[str, str], uuids: dict[str, dict[str, int]], held: dict[str, list[tuple[float, float]]]
) -> tuple[int, list[str]]:
    """Every task's start line (its process's start: task) against the times its GPU was
    certainly quarantined (after the quarantine command returned, before its release
    began): (tasks, violations)."""
    n, bad = 0, []
    for host, text in starts.items():
        for line in text.splitlines():
            parts = line.split()
            try:  # now, uptime now, the process's start in ticks since boot, ticks a second
                now, up, ticks, hz = float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])
                job, devs = parts[4], parts[5]
            except (IndexError, ValueError):
                continue
            n += 1
            t = now - up + ticks / max(1, hz)  # within 10 ms either way (both in hundredths)
            for dev in devs.split(","):
                g = uuids.get(host, {}).get(dev, int(dev) if dev.isdigit() else -1)
                for q, r in held.get(f"{host}:{g}", []):
                    if q < t < r:
                        bad.append(f"{host}: task of {job} began on GPU {g} at {t:.2f}, quarantined {q:.2f}-{r:.2f}")
    return n, bad


def race(args: argparse.Namespace) -> int:  # noqa: C901  one bench's threads and their counts
    rep = Report(args.name or time.strftime("%Y-%m-%d-health-race"), "applies racing with quarantines and releases")
    sb, tmp, env = setup("hrace", args.hosts, args.gpus)
    hosts = [h.name for h in sb.hosts]
    ctl = write_inv(sb, tmp / "ctl" / "ctl.yaml", "ctl")  # the inventory quarantines and releases go through
    counts = {"applied": 0, "refused": 0, "quarantined": 0, "released": 0, "samples": 0}
    violations: list[str] = []
    held: dict[str, list[tuple[float, float]]] = {}  # HOST:GPU -> (quarantine returned, release began)
    stop = threading.Event()
    lock = threading.Lock()

    def applier(a: int) -> None:
        n = 0
        while not stop.is_set():
            with lock:
                if counts["applied"] + counts["refused"] >= args.applies:
                    stop.set()
                    return
            n += 1
            job = f"race{a}-{n}"
            inv = tmp / f"a{a}" / f"r{n}.yaml"
            inv.parent.mkdir(parents=True, exist_ok=True)
            pools = {"chief": {"replicas": 1, "accelerators": 1, "command": task(job)}}
            inv.write_text(dump(sandbox.inventory_dict(sb, job=job, pools=pools), sb))
            r = cli("apply", "-y", str(inv), cwd=inv.parent, env=env)
            with lock:
                counts["applied" if r.returncode == 0 else "refused"] += 1
            cli("destroy", "-y", str(inv), cwd=inv.parent, env=env)

    def quarantiner() -> None:
        mine: dict[str, float] = {}  # HOST:GPU -> when its quarantine returned
        while not stop.wait(random.uniform(0.5, 2.0)):
            if mine and (len(mine) >= args.hosts or random.random() < 0.5):
                t = random.choice(sorted(mine))
                began = time.time()
                r = cli("health", "release", str(ctl), t, "--skip-test", cwd=ctl.parent, env=env)
                if r.returncode == 0:
                    with lock:
                        held.setdefault(t, []).append((mine.pop(t), began))
                        counts["released"] += 1
            else:
                t = f"{random.choice(hosts)}:{random.randrange(args.gpus)}"
                if t in mine:
                    continue
                r = cli("health", "quarantine", str(ctl), t, "--reason", "race", cwd=ctl.parent, env=env)
                if r.returncode == 0:
                    mine[t] = time.time()
                    with lock:
                        counts["quarantined"] += 1
        with lock:
            for t, q in mine.items():
                held.setdefault(t, []).append((q, time.time()))

    def sampler() -> None:
        while not stop.wait(1.0):
            for h in hosts:
                try:
                    got = sample(sb, h)
                except (RuntimeError, ValueError):
                    continue  # a file between two writes: the next sample
                with lock:
                    counts["samples"] += 1
                    violations.extend(got)

    threads = [threading.Thread(target=applier, args=(a,)) for a in range(args.appliers)]
    threads += [threading.Thread(target=quarantiner), threading.Thread(target=sampler)]
    try:
        t0 = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(args.seconds)
        stop.set()
        for t in threads:
            t.join(300)
        took = time.monotonic() - t0
        starts = {h: docker_sh(sb, h, f"cat {STARTS} 2>/dev/null || true") for h in hosts}
        uuids = {}
        for h in hosts:
            q = docker_sh(sb, h, "nvidia-smi --query-gpu=index,uuid --format=csv,noheader")
            uuids[h] = {u.strip(): int(i) for i, u in (ln.split(",", 1) for ln in q.splitlines() if "," in ln)}
        tasks, bad = started_on_quarantined(starts, uuids, held)
        spans = sum(len(v) for v in held.values())
        rep.say(f"{args.hosts} sandbox hosts x {args.gpus} GPUs, {args.appliers} appliers (apply -y then destroy -y "
                f"of a 1-GPU job, each its own, whose task writes when it began and its CUDA_VISIBLE_DEVICES) and a "
                f"quarantiner (`health quarantine` or `release --skip-test` every 0.5-2 s), {took:.0f} s")  # fmt: skip
        rep.say("  " + ", ".join(f"{k} {v}" for k, v in counts.items()) + " (ledger samples, every 1 s per host)")
        rep.say(f"  {tasks} tasks began (their lines on the hosts), {spans} quarantine spans")
        for v in (violations + bad)[:20]:
            rep.say(f"  violation: {v}")
        rep.verdict("no reservation of a quarantined GPU (the ledger and the health record sampled together)",
                    f"{len(violations)} in {counts['samples']} samples", not violations and counts["samples"] > 0)  # fmt: skip
        rep.verdict("no task began on a GPU quarantined at its start (every task's process start, the kernel's)",
                    f"{len(bad)} of {tasks} tasks", not bad and tasks > 0)  # fmt: skip
        done = counts["applied"] + counts["refused"]
        rep.verdict(f"{args.applies} applies racing", f"{done} applies in {took:.0f} s", done >= args.applies)
    finally:
        stop.set()
        sandbox.down(sb.name)
    rep.write()
    return 0


# --------------------------------------------------------------------------- soak


def soak(args: argparse.Namespace) -> int:
    rep = Report(args.name or time.strftime("%Y-%m-%d-health-soak"), "a healthy cluster watched: no false quarantine")
    sb, tmp, env = setup("hsoak", args.hosts, 2)
    db = Path(env["PROVISION_SERVICE_DB"])
    invs = [write_inv(sb, tmp / f"j{i}" / "job.yaml", f"soak{i}") for i in range(args.hosts)]
    svc = None
    try:
        for inv in invs:
            r = cli("apply", "-y", str(inv), cwd=inv.parent, env=env)
            assert r.returncode == 0, r.stdout + r.stderr
        port = free_port()
        args_ = ["--listen", f"127.0.0.1:{port}"] + [a for inv in invs for a in ("--inventory", str(inv))]
        svc = Serve(tmp / "serve", env, tuple(args_))
        svc.wait_for("leading", 60)
        looker = Looker(port)
        t0 = time.monotonic()
        time.sleep(args.seconds)  # the soak itself: the service's rounds run meanwhile
        looker.stop.set()
        made = rounds(db)
        with sqlite3.connect(db, timeout=30) as c:
            incidents = c.execute("SELECT count(*) FROM provision_service_health").fetchone()[0]
        marks = {h.name: record(sb, h.name) for h in sb.hosts}
        marked = {h: m for h, m in marks.items() if m.get("host") or any((m.get("gpus") or {}).values())}
        quarantined = events(db, "gpu.quarantined") + events(db, "host.drained")
        rep.say(f"{args.hosts} sandbox hosts x 2 GPUs, a job on each (one GPU held), {time.monotonic() - t0:.0f} s, "
                f"{len(made)} rounds")  # fmt: skip
        rep.say(f"  incidents {incidents}, quarantines and drains {len(quarantined)}, "
                f"hosts with a mark (suspect or any other) {len(marked)}")  # fmt: skip
        for h, m in sorted(marked.items())[:10]:
            rep.say(f"  {h}: {json.dumps(m)[:300]}")
        rep.verdict("no false quarantine in a healthy soak", f"{len(quarantined)} quarantines, {incidents} incidents "
                    f"over {len(made)} rounds, {len(marked)} marked", not quarantined and not incidents and not marked and len(made) > 0)  # fmt: skip
    finally:
        if svc is not None:
            svc.stop()
        sandbox.down(sb.name)
    rep.write()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("latency")
    a.add_argument("--trials", type=int, default=6)
    b = sub.add_parser("race")
    b.add_argument("--seconds", type=float, default=1800.0)
    b.add_argument("--applies", type=int, default=1000)
    b.add_argument("--hosts", type=int, default=4)
    b.add_argument("--gpus", type=int, default=4)
    b.add_argument("--appliers", type=int, default=4)
    c = sub.add_parser("soak")
    c.add_argument("--seconds", type=float, default=1800.0)
    c.add_argument("--hosts", type=int, default=32)
    for p in (a, b, c):
        p.add_argument("--name", default="")
    args = ap.parse_args()
    return {"latency": latency, "race": race, "soak": soak}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
