"""Benchmark ("the service's overhead on a study is <= 2 % of its wall time"): the
same small study (bench/tune.py's shape: 2 sandbox hosts x 2 fake GPUs, a random study of
--trials trials of --seconds s, --slots at once) run in the terminal (A: `provision tune`,
wall from its start to its exit) and handed over (B: `provision tune --detach`, wall from
its start to the submission's end in the service's database, read every 0.05 s), the runs
interleaved A B B A (--rounds times), each study under a job name of its own.

    PYTHONPATH=$PWD/src python bench/serve_detach.py [--trials 12] [--seconds 4] [--rounds 2]
        [--sandbox NAME (reuse a running sandbox's host-1 and host-2)]

The service (embedded database, default --poll, no pages) runs throughout, started before
the first run; what B pays is the hand-over, the leader's next look, the worker's start
(its own Python and imports) and its end's record. The noise: A against A and B against B.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servebench import ROOT, Report, Serve, median

from provision import sandbox
from provision.sandbox.inventory import dump

TRAINER = ROOT / "tests" / "fixtures" / "tune" / "trainer.py"
BOUND = 0.02


def study(sb: sandbox.Sandbox, d: Path, job: str, trials: int, seconds: float, slots: int) -> Path:
    d.mkdir(parents=True)
    shutil.copy(TRAINER, d / "trainer.py")
    steps = 4
    inv = sandbox.inventory_dict(
        sb,
        job=job,
        hosts=["host-1", "host-2"],
        files=[{"src": "trainer.py", "dest": f"/opt/{job}/trainer.py"}],
        pools={
            "chief": {
                "replicas": 1,
                "accelerators": 1,
                "command": [
                    "python3",
                    f"/opt/{job}/trainer.py",
                    f"--steps={steps}",
                    f"--step_seconds={seconds / steps}",
                ],
            }
        },
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
            "algorithm": "random",
            "max_trials": trials,
            "parallel_trials": slots,
        },
    )
    (d / "study.yaml").write_text(dump(inv, sb))
    return d / "study.yaml"


def finished(db: Path, job: str) -> str | None:
    with sqlite3.connect(db, timeout=30) as c:
        row = c.execute(
            "SELECT status, why FROM provision_service_submissions WHERE job = ? AND status IN ('done', 'failed', 'cancelled')",
            (job,),
        ).fetchone()
    return f"{row[0]}: {row[1]}" if row else None


def run_a(inv: Path, env: dict[str, str], poll: float) -> float:
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "provision", "tune", "--poll", f"{poll:g}", inv.name],
        cwd=inv.parent,
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.monotonic() - t
    if r.returncode != 0:
        raise RuntimeError(f"A failed: {r.stdout}{r.stderr}")
    return wall


def run_b(inv: Path, env: dict[str, str], poll: float, db: Path, job: str) -> tuple[float, str]:
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "provision", "tune", "--detach", "--poll", f"{poll:g}", inv.name],
        cwd=inv.parent,
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise RuntimeError(f"B's hand-over failed: {r.stdout}{r.stderr}")
    end = t + 1800
    while time.monotonic() < end:
        how = finished(db, job)
        if how is not None:
            return time.monotonic() - t, how
        time.sleep(0.05)
    raise RuntimeError(f"B: {job} did not end within 1800 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--poll", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sandbox", help="a running sandbox's name (else one of 2 hosts x 2 GPUs is started)")
    ap.add_argument("--name", default="2026-11-27-issue40-detach-overhead")
    args = ap.parse_args()
    rep = Report(args.name, "a detached study's overhead (terminal A vs handed over B, A B B A)")
    sb = sandbox.load(args.sandbox) if args.sandbox else sandbox.up("servedetach", hosts=2, gpus_per_host=2)
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-detach-"))
    db = tmp / "svc" / "service.sqlite"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "PROVISION_SERVICE_DB": str(db),
        "PROVISION_OWNER": "bench@example.com",
    }
    rep.say(
        f"study: {args.trials} trials of {args.seconds:g} s, {args.slots} at once on host-1 and host-2, "
        f"tune --poll {args.poll:g}; ideal {args.trials * args.seconds / args.slots:.1f} s"
    )
    svc = Serve(tmp / "serve", env, ("--listen", "none"))
    walls: dict[str, list[float]] = {"A": [], "B": []}
    try:
        svc.wait_for("leading", 60)
        n = 0
        for _ in range(args.rounds):
            for kind in "ABBA":
                n += 1
                job = f"det{n:02d}{kind.lower()}"
                inv = study(sb, tmp / job, job, args.trials, args.seconds, args.slots)
                if kind == "A":
                    wall, how = run_a(inv, env, args.poll), "exit 0"
                else:
                    wall, how = run_b(inv, env, args.poll, db, job)
                walls[kind].append(wall)
                rep.say(
                    f"run {n} {kind} ({job}): {wall:.2f} s ({how}); {Path('/proc/loadavg').read_text().split()[0]} load"
                )
    finally:
        svc.stop()
        if not args.sandbox:
            sandbox.down(sb.name)
    a, b = walls["A"], walls["B"]
    ma, mb = median(a), median(b)
    over = (mb - ma) / ma
    rep.say(f"A (terminal): {', '.join(f'{x:.2f}' for x in a)} s; median {ma:.2f} s, spread {max(a) - min(a):.2f} s")
    rep.say(f"B (handed over): {', '.join(f'{x:.2f}' for x in b)} s; median {mb:.2f} s, spread {max(b) - min(b):.2f} s")
    pairs = [b[i] - a[i] for i in range(min(len(a), len(b)))]
    rep.say(f"B - A by position: {', '.join(f'{x:+.2f}' for x in pairs)} s")
    noise = max(max(a) - min(a), max(b) - min(b)) / ma
    rep.say(
        f"overhead (median B - median A) / median A: {100 * over:+.1f} %; noise (the larger spread / median A): {100 * noise:.1f} %"
    )
    rep.verdict(
        f"overhead <= {100 * BOUND:g} % of the wall time",
        f"{100 * over:+.1f} % (noise {100 * noise:.1f} %)",
        over <= BOUND,
    )
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
