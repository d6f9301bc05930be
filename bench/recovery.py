"""A run that survives its hardware (docs/recovery.md), measured on sandbox hosts with a real
torch DDP job on CPU over gloo (examples/recovery/train.py), a service watching it:

    PYTHONPATH=$PWD/src python bench/recovery.py [--hosts 4] [--step 1] [--checkpoint 20] [--blinks 3]

One job: its chief and workers on all hosts but the last, the last one a spare (`spares:`).
In turn, each with a fresh job, the service recovering it with no command typed:
- kill: a worker's host killed (its container killed): the time from the kill to the
  service's detection, to the job running again on the spare, and the work redone (read
  from the trainer's own step log: its last step before the failure less the step it
  resumed from);
- hang: a worker's rank SIGSTOPped (its collectives wait longer than the progress bound):
  the time to detection against its bound plus one round;
- blink: a host's SSH dropped for 5 s, `--blinks` times, a round apart: no restart.

Writes bench/results/<date>-recovery.txt, beside the anchors: Slurm's usual SlurmdTimeout
300 s, NCCL's watchdog 600 s, Ray's node death 15-65 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servebench import ROOT, Report, Serve

from provision import sandbox
from provision.sandbox.inventory import dump

TRAIN = ROOT / "examples" / "recovery" / "train.py"
PY = "/usr/bin/python3"
ROUND = 10.0  # the service's round while a job is watched (core/recovery.ROUND_S)
BOUND = 20  # progress.timeout (s) of the hang
ANCHORS = "Slurm SlurmdTimeout 300 s, NCCL watchdog 600 s, Ray node death 15-65 s"


def cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "provision", *args], cwd=cwd, env=env, capture_output=True, text=True)


def sh(sb: sandbox.Sandbox, host: str, cmd: str) -> str:
    return sb.docker_exec(host, ["/bin/sh", "-c", cmd])[1]


def docker(*args: str) -> None:
    subprocess.run(["docker", *args], check=True, capture_output=True)


def journal(sb: sandbox.Sandbox, host: str, job: str, task: str) -> str:
    return sh(sb, host, f"journalctl -q -o cat -t provision-{job}-{task} --no-pager")


def found(pattern: str, text: str) -> list[int]:
    return [int(m) for m in re.findall(pattern, text)]


def until(pred, timeout: float, what: str, every: float = 0.5):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


class Job:
    def __init__(self, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], name: str, args: argparse.Namespace,
                 **extra: object):  # fmt: skip
        self.sb, self.env, self.name = sb, env, name
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        names = [h.name for h in sb.hosts]
        self.workers, self.spare = names[1:-1], names[-1]
        cmd = [PY, "/opt/rec/train.py"]
        pools = {"chief": {"replicas": 1, "command": cmd}, "worker": {"replicas": len(self.workers), "command": cmd}}
        gloo = extra.pop("gloo", 15)
        inv = sandbox.inventory_dict(
            sb, job=name, pools=pools, files=[{"src": str(TRAIN), "dest": "/opt/rec/train.py"}],
            env={"STEP_S": str(args.step), "CKPT_EVERY": str(args.checkpoint), "GLOO_TIMEOUT": str(gloo)},
            outputs=f"/var/tmp/{name}", spares=[self.spare], recovery={"max": 5, "window": "1h"},
            progress={"timeout": f"{BOUND}s"}, preemption={"grace": "20s"}, ssh={"connect_timeout": 3}, **extra,
        )  # fmt: skip
        self.inv = self.dir / "inv.yaml"
        self.inv.write_text(dump(inv, sb))

    def status(self) -> dict:
        r = cli("status", "--json", str(self.inv), cwd=self.dir, env=self.env)
        return json.loads(r.stdout) if r.stdout.startswith("{") else {}

    def apply(self) -> None:
        r = cli("apply", "-y", str(self.inv), cwd=self.dir, env=self.env)
        assert r.returncode == 0, r.stdout + r.stderr

    def steps(self, host: str, task: str) -> list[int]:
        return found(r"\] step (\d+) ", journal(self.sb, host, self.name, task))

    def checkpoints(self) -> list[int]:
        return found(r"checkpoint step (\d+)", journal(self.sb, "host-1", self.name, "chief-0"))

    def resumed(self) -> list[int]:
        return found(r"resumed from step (\d+)", journal(self.sb, "host-1", self.name, "chief-0"))

    def redone(self, resumed: int, resumes: int = 0) -> int:
        """The steps the broken run made after the checkpoint it resumed from: the chief's
        last step before it resumed (the resume after `resumes` earlier ones), less that
        checkpoint's."""
        parts = journal(self.sb, "host-1", self.name, "chief-0").split("resumed from")
        steps = found(r"\] step (\d+) ", parts[resumes] if len(parts) > resumes else "")
        return (max(steps) if steps else resumed) - resumed

    def incident(self) -> dict | None:
        st = self.status()
        incs = (st.get("recovery") or {}).get("incidents") or []
        return incs[-1] if incs else None

    def running_again(self, after: int = 0) -> dict | None:
        """The newest incident, numbered after `after`, once the job runs again."""
        inc = self.incident()
        return inc if inc and inc["n"] > after and inc.get("stage") == "done" and inc.get("running") else None

    def incidents(self) -> int:
        inc = self.incident()
        return int(inc["n"]) if inc else 0

    def destroy(self) -> None:
        cli("destroy", "-y", str(self.inv), cwd=self.dir, env=self.env)
        for h in self.sb.hosts:
            cli("health", "release", str(self.inv), h.name, "--skip-test", cwd=self.dir, env=self.env)


def serve(tmp: Path, env: dict[str, str], job: Job) -> Serve:
    svc = Serve(tmp / f"serve-{job.name}", env, ("--listen", "none", "--inventory", str(job.inv)))
    svc.wait_for("leading", 60)
    return svc


def said(rep: Report, svc: Serve, what: str) -> None:
    """The service's lines about the job (its stops, runs again, recoveries) in the report."""
    for line in svc.output().splitlines():
        if any(w in line for w in ("stopping it", "recovered", "runs again", "quarantined", "not recovered")):
            rep.say(f"  {what}: service: {line}")


def kill(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    job = Job(sb, tmp, env, "bench-kill", args, gloo=10)
    job.apply()
    victim = job.workers[-1]
    container = sb.host(victim).container
    svc = serve(tmp, env, job)
    try:
        until(lambda: len(job.checkpoints()) >= 2, 300, "two checkpoints")
        before = job.incidents()  # a loaded machine's false alarm before the kill is not this one
        t0 = time.time()
        docker("kill", container)
        inc = until(lambda: job.running_again(before), 300, "the job running again", every=1.0)
        resumed = until(lambda: job.resumed()[before:], 120, "the chief to resume")[0]
        redone = job.redone(resumed, before)
        detect, again = inc["detected"] - t0, inc["running"] - inc["detected"]
        where = {t["task"]: t["host"] for t in job.status().get("tasks", [])}
        rep.say(f"kill: {victim} killed; detected {detect:.1f} s after, running again {again:.1f} s after "
                f"detection (on {where}), {redone} steps redone (checkpoint every {args.checkpoint:g} s, "
                f"a step {args.step:g} s)")  # fmt: skip
        g = job.status().get("goodput") or {}
        rep.say(f"kill: incident times {json.dumps((g.get('incidents') or [{}])[-1])}")
        return rep_verdicts(rep, "kill", detect, 30.0, again, redone, args) and job.spare in where.values()
    finally:
        said(rep, svc, "kill")
        svc.stop()
        docker("start", container)
        until(lambda: cli("status", str(job.inv), cwd=job.dir, env=env).returncode in (0, 1), 120, "the host back")
        job.destroy()


def rep_verdicts(rep: Report, what: str, detect: float, bound: float, again: float, redone: int,
                 args: argparse.Namespace) -> bool:  # fmt: skip
    most = int(args.checkpoint / args.step) + 1
    rep.verdict(f"{what}: detected <= {bound:g} s", f"{detect:.1f} s", detect <= bound)
    rep.verdict(f"{what}: running again <= 60 s after detection", f"{again:.1f} s", again <= 60)
    rep.verdict(
        f"{what}: work redone <= one checkpoint interval + one step ({most} steps)", f"{redone}", redone <= most
    )
    return detect <= bound and again <= 60 and redone <= most


def hang(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    job = Job(sb, tmp, env, "bench-hang", args, gloo=600)
    job.apply()
    victim = job.workers[-1]
    svc = serve(tmp, env, job)
    try:
        until(lambda: len(job.checkpoints()) >= 2, 300, "two checkpoints")
        before = job.incidents()
        t0 = time.time()
        sh(sb, victim, "pkill -STOP -f '^/usr/bin/python3 /opt/rec/train.py'")
        inc = until(lambda: job.running_again(before), 300, "the job running again", every=1.0)
        resumed = until(lambda: job.resumed()[before:], 120, "the chief to resume")[0]
        redone = job.redone(resumed, before)
        detect, again = inc["detected"] - t0, inc["running"] - inc["detected"]
        rep.say(f"hang: a rank on {victim} SIGSTOPped; detected {detect:.1f} s after (bound {BOUND} s), running "
                f"again {again:.1f} s after detection, {redone} steps redone; incident: {inc['words']}")  # fmt: skip
        return rep_verdicts(rep, "hang", detect, BOUND + ROUND + 5.0, again, redone, args)
    finally:
        said(rep, svc, "hang")
        svc.stop()
        job.destroy()


def blink(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    job = Job(sb, tmp, env, "bench-blink", args)
    job.apply()
    victim = job.workers[-1]
    svc = serve(tmp, env, job)
    try:
        run = until(lambda: (job.status().get("run") or {}).get("number"), 120, "the run")
        for _ in range(args.blinks):
            sh(sb, victim, "systemctl stop ssh.socket ssh.service 2>/dev/null; pkill -x sshd; true")
            time.sleep(5)
            sh(sb, victim, "systemctl start ssh.service 2>/dev/null || systemctl start ssh.socket")
            time.sleep(ROUND + 5)
        st = job.status()
        same = (st.get("run") or {}).get("number") == run and all(t["state"] == "Running" for t in st["tasks"])
        stops = len([x for x in svc.output().splitlines() if "stopping it on every host" in x])
        rep.say(f"blink: {victim}'s SSH down 5 s, {args.blinks} times a round apart: run {run} -> "
                f"{(st.get('run') or {}).get('number')}, {stops} stops")  # fmt: skip
        rep.verdict("blink: no restart", f"{stops} stops, same run: {same}", same and stops == 0)
        return same and stops == 0
    finally:
        said(rep, svc, "blink")
        svc.stop()
        job.destroy()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--checkpoint", type=float, default=20.0)
    ap.add_argument("--blinks", type=int, default=3)
    ap.add_argument("--only", choices=("kill", "hang", "blink"), action="append")
    ap.add_argument("--name")
    args = ap.parse_args()
    rep = Report(args.name or time.strftime("%Y-%m-%d-recovery"), "a job's host killed, a rank hung, SSH blinking")
    sb = sandbox.up("benchrec", hosts=args.hosts, with_=("torch",), timeout=1800)
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PROVISION_SERVICE_DB": str(tmp / "svc" / "service.sqlite"),
           "PROVISION_OWNER": "bench@example.com"}  # fmt: skip
    rep.say(f"{args.hosts} sandbox hosts (the last a spare), torch DDP over gloo on CPU, a step {args.step:g} s, "
            f"a checkpoint every {args.checkpoint:g} s; the anchors: {ANCHORS}")  # fmt: skip
    ok = True
    try:
        for name, run in (("kill", kill), ("hang", hang), ("blink", blink)):
            if args.only and name not in args.only:
                continue
            try:
                ok = run(rep, sb, tmp, env, args) and ok
            except (AssertionError, TimeoutError) as e:
                rep.verdict(f"{name}: ran", str(e)[:300], False)
                ok = False
    finally:
        sandbox.down(sb.name)
    rep.write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
