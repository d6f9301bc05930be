"""An elastic PyTorch job's node lost and the spare brought in (docs/recovery.md, "Elastic
PyTorch"), measured on sandbox hosts with a real torch job on CPU over gloo under torchrun's
c10d rendezvous (examples/recovery/train.py), a service watching it:

    PYTHONPATH=$PWD/src python bench/recovery_elastic.py [--hosts 4] [--step 1] [--checkpoint 8]

The job: its chief on the first host, `elastic: {min: 1, max: HOSTS-2}` workers on the
others but the last, the last a spare (`spares:`). A worker's host killed (its container):
the time from the kill to the chief's first step at the smaller world size (torchrun's
scale-down), to the service's `job.scaled`, and to the spare's and the chief's first steps
at the full size again (read from the trainer's own step log); the job's run and the chief's
process the same throughout. The bench/recovery.py helpers, its own job's shape.

Writes bench/results/<date>-recovery-elastic.txt, beside the anchors: Slurm's usual
SlurmdTimeout 300 s, NCCL's watchdog 600 s, Ray's node death 15-65 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from recovery import ANCHORS, PY, TRAIN, cli, docker, found, journal, serve, sh, until
from servebench import ROOT, Report

from provision import sandbox
from provision.sandbox.inventory import dump


class ElasticJob:
    """The job (module docstring); `serve` (bench/recovery.py) needs its name and inv."""

    def __init__(self, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace):
        self.sb, self.env, self.name = sb, env, "bench-elastic"
        self.dir = tmp / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        names = [h.name for h in sb.hosts]
        self.chief, self.workers, self.spare = names[0], names[1:-1], names[-1]
        torchrun = [PY, "-m", "torch.distributed.run", "/opt/rec/train.py"]
        n = len(self.workers)
        pools = {
            "chief": {"replicas": 1, "command": torchrun},
            "worker": {"replicas": n, "command": torchrun, "elastic": {"min": max(1, n - 1), "max": n}},
        }
        inv = sandbox.inventory_dict(
            sb, job=self.name, pools=pools, files=[{"src": str(TRAIN), "dest": "/opt/rec/train.py"}],
            env={"STEP_S": str(args.step), "CKPT_EVERY": str(args.checkpoint), "GLOO_TIMEOUT": str(args.gloo),
                 "PET_RDZV_CONF": f"last_call_timeout={args.last_call:g}"},
            outputs=f"/var/tmp/{self.name}", spares=[self.spare], recovery={"max": 5, "window": "1h"},
            preemption={"grace": "20s"}, ssh={"connect_timeout": 3},
        )  # fmt: skip
        self.inv = self.dir / "inv.yaml"
        self.inv.write_text(dump(inv, sb))
        self.full = n + 1

    def status(self) -> dict:
        r = cli("status", "--json", str(self.inv), cwd=self.dir, env=self.env)
        return json.loads(r.stdout) if r.stdout.startswith("{") else {}

    def world(self, n: int, host: str, task: str) -> list[int]:
        return found(rf"\] step (\d+) loss \S+ world {n}\b", journal(self.sb, host, self.name, task))

    def chief_pid(self) -> str:
        return sh(self.sb, self.chief, f"systemctl show -p MainPID --value provision-{self.name}-chief-0").strip()

    def scaled(self, tmp: Path) -> list[dict]:
        r = cli("events", "--json", "--kind", "job.scaled", cwd=tmp, env=self.env)
        return json.loads(r.stdout)["events"] if r.returncode == 0 else []


def elastic(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    job = ElasticJob(sb, tmp, env, args)
    r = cli("apply", "-y", str(job.inv), cwd=job.dir, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    where = {t["task"]: t["host"] for t in job.status().get("tasks", [])}
    victim_task = f"worker-{len(job.workers) - 1}"
    victim = where[victim_task]
    container = sb.host(victim).container
    svc = serve(tmp, env, job)  # type: ignore[arg-type]
    try:
        until(lambda: job.world(job.full, job.chief, "chief-0"), 300, f"steps at world size {job.full}")
        until(lambda: found(r"checkpoint step (\d+)", journal(sb, job.chief, job.name, "chief-0")), 120, "a checkpoint")
        run, pid = (job.status().get("run") or {}).get("number"), job.chief_pid()
        before = max(job.world(job.full, job.chief, "chief-0"))
        t0 = time.monotonic()
        docker("kill", container)
        until(lambda: job.world(job.full - 1, job.chief, "chief-0"), 300, "the smaller size", every=0.5)
        smaller = time.monotonic() - t0
        rep.say(
            f"elastic: {victim} ({victim_task}) killed; the chief at world size {job.full - 1} after {smaller:.1f} s"
        )
        rep.verdict("elastic: training at the smaller size <= 30 s after the kill", f"{smaller:.1f} s", smaller <= 30)
        until(lambda: job.scaled(tmp), 300, "job.scaled", every=0.5)
        scaled = time.monotonic() - t0
        rep.say(f"elastic: job.scaled after {scaled:.1f} s: {job.scaled(tmp)[0]['words']}")
        until(lambda: job.world(job.full, job.spare, victim_task), 300, "the spare's first step", every=0.5)
        joined = time.monotonic() - t0
        rep.say(f"elastic: the spare's first step at world size {job.full} after {joined:.1f} s")
        rep.verdict("elastic: the spare joins <= 60 s after the kill", f"{joined:.1f} s", joined <= 60)
        until(lambda: max(job.world(job.full, job.chief, "chief-0")) > before, 120, "the chief at full size")
        chief_back = time.monotonic() - t0
        until(lambda: len(job.world(job.full, job.chief, "chief-0")) > 30, 120, "30 steps at full size")
        st = job.status()
        same = (st.get("run") or {}).get("number") == run and job.chief_pid() == pid
        where = {t["task"]: t["host"] for t in st.get("tasks", [])}
        rep.say(f"elastic: the chief at world size {job.full} again after {chief_back:.1f} s; the same run and "
                f"chief process 30 steps on: {same}; placed {where}")  # fmt: skip
        rep.verdict("elastic: no restart of the job (same run, same chief process)", str(same), same)
        return smaller <= 30 and joined <= 60 and same and where.get(victim_task) == job.spare
    finally:
        for host, task in ((job.chief, "chief-0"), (job.spare, victim_task)):
            for line in journal(sb, host, job.name, task).splitlines()[-25:]:
                rep.say(f"  elastic: {task} on {host}: {line[:300]}")
        for line in svc.output().splitlines():
            if any(w in line for w in ("scaled up", "starting", "stopping it", "recovered", "not scaled")):
                rep.say(f"  elastic: service: {line}")
        svc.stop()
        docker("start", container)
        cli("destroy", "-y", str(job.inv), cwd=job.dir, env=env)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--checkpoint", type=float, default=8.0)
    ap.add_argument("--gloo", type=float, default=10.0, help="the trainer's collectives' timeout (s)")
    ap.add_argument("--last-call", type=float, default=5.0, help="torchrun's rendezvous last_call_timeout (s)")
    ap.add_argument("--name")
    args = ap.parse_args()
    rep = Report(args.name or time.strftime("%Y-%m-%d-recovery-elastic"), "an elastic job's node lost, the spare in")
    sb = sandbox.up("benchela", hosts=args.hosts, with_=("torch",), timeout=1800)
    tmp = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PROVISION_SERVICE_DB": str(tmp / "svc" / "service.sqlite"),
           "PROVISION_OWNER": "bench@example.com"}  # fmt: skip
    rep.say(f"{args.hosts} sandbox hosts (the chief, {args.hosts - 2} elastic workers, a spare), torch over gloo on "
            f"CPU under torchrun's c10d rendezvous, a step {args.step:g} s, a checkpoint every {args.checkpoint:g} "
            f"s, collectives' timeout {args.gloo:g} s, torchrun's last call {args.last_call:g} s (PET_RDZV_CONF); "
            f"the anchors: {ANCHORS}")  # fmt: skip
    try:
        ok = elastic(rep, sb, tmp, env, args)
    except (AssertionError, TimeoutError) as e:
        rep.verdict("elastic: ran", str(e)[:300], False)
        ok = False
    finally:
        sandbox.down(sb.name)
    rep.write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
