"""A run that survives its hardware (docs/recovery.md), measured on sandbox hosts with a real
torch DDP job on CPU over gloo (examples/recovery/train.py), a service watching it:

    PYTHONPATH=$PWD/src python bench/recovery.py [--hosts 4] [--spares 1] [--step 1] [--checkpoint 20]
        [--blinks 3] [--only MODE ...] [--minutes 10] [--every 120] [--soak 30] [--by HH:MM] [--gpus G]

One job: its chief and workers on --hosts hosts, the next --spares its spares (`spares:`);
with --gpus G each task takes G of its host's stand-in GPUs (as a training job does: the
service's rounds are then every 5 s, not 10).
In turn, each with a fresh job, the service recovering it with no command typed:
- kill: a worker's host killed (its container killed): the time from the kill to the
  service's detection, to the job running again on the spare, and the work redone (read
  from the trainer's own step log: its last step before the failure less the step it
  resumed from);
- hang: a worker's rank SIGSTOPped (its collectives wait longer than the progress bound):
  the time to detection against its bound plus one round;
- blink: a host's SSH dropped for 5 s, `--blinks` times, a round apart: no restart;
- freeze: a worker's host frozen off the network (`docker pause`): as kill, and once woken
  its old rank gone (the service stops it there);
- auto: as hang under `progress: {timeout: auto}`, the rank stopped after a minute of
  steps (the service has learnt the bound by then): detected within 2 minutes;
- goodput: a run of --minutes with a fault every --every seconds (a rank SIGKILLed, a
  worker's host killed, a rank SIGSTOPped, in turn; a spare for each, as each failed host is
  set aside): provision's goodput (`status --json`) against the trainer's own step log
  (its last step at its median step time, over the same wall time), every fault recovered;
- soak: --soak minutes in which a worker's host drops port 22 (iptables) for 5 s every
  minute: no restart, no break in the chief's step log (--by ends it sooner if need be).

Writes bench/results/<date>-recovery.txt (kill, hang, blink) and
bench/results/<date>-recovery-<mode>.txt for each other mode, beside the anchors: Slurm's
usual SlurmdTimeout 300 s, NCCL's watchdog 600 s, Ray's node death 15-65 s.
"""

from __future__ import annotations

import argparse
import calendar
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
from provision.serve.gpusample import HELD_EVERY  # the service's round while a job holds a GPU

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
        # the job on the first --hosts (the chief on the first), the next `spares` its spares;
        # the sandbox's others are not in its inventory
        spares = int(extra.pop("spares", args.spares))  # type: ignore[call-overload]
        names = [h.name for h in sb.hosts][: args.hosts + spares]
        self.workers, self.spares = names[1 : args.hosts], names[args.hosts :]
        self.spare = self.spares[0]
        cmd = [PY, "/opt/rec/train.py"]
        pools = {"chief": {"replicas": 1, "command": cmd}, "worker": {"replicas": len(self.workers), "command": cmd}}
        for pool in pools.values() if args.gpus else ():
            pool["accelerators"] = args.gpus
        gloo = extra.pop("gloo", 15)
        progress = extra.pop("progress", {"timeout": f"{BOUND}s"})
        inv = sandbox.inventory_dict(
            sb, job=name, pools=pools, files=[{"src": str(TRAIN), "dest": "/opt/rec/train.py"}],
            env={"STEP_S": str(args.step), "CKPT_EVERY": str(args.checkpoint), "GLOO_TIMEOUT": str(gloo)},
            outputs=f"/var/tmp/{name}", spares=self.spares, recovery={"max": 5, "window": "1h"}, hosts=names,
            progress=progress, preemption={"grace": "20s"}, ssh={"connect_timeout": 3}, **extra,
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


def freeze(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    """A worker's host frozen off the network (`docker pause`: its processes stopped, its
    SSH and its gloo connections silent, nothing closed); woken after the recovery, its
    rank still there must be stopped at once (the job never runs twice)."""
    job = Job(sb, tmp, env, "bench-freeze", args, gloo=10)
    job.apply()
    victim = job.workers[-1]
    container = sb.host(victim).container
    svc = serve(tmp, env, job)
    paused = False
    try:
        until(lambda: len(job.checkpoints()) >= 2, 300, "two checkpoints")
        before = job.incidents()
        t0 = time.time()
        docker("pause", container)
        paused = True
        inc = until(lambda: job.running_again(before), 300, "the job running again", every=1.0)
        resumed = until(lambda: job.resumed()[before:], 120, "the chief to resume")[0]
        redone = job.redone(resumed, before)
        detect, again = inc["detected"] - t0, inc["running"] - inc["detected"]
        where = {t["task"]: t["host"] for t in job.status().get("tasks", [])}
        rep.say(f"freeze: {victim} paused; detected {detect:.1f} s after, running again {again:.1f} s after "
                f"detection (on {where}), {redone} steps redone; incident: {inc['words']}")  # fmt: skip
        g = job.status().get("goodput") or {}
        rep.say(f"freeze: incident times {json.dumps((g.get('incidents') or [{}])[-1])}")
        ok = rep_verdicts(rep, "freeze", detect, 30.0, again, redone, args) and job.spare in where.values()
        docker("unpause", container)
        paused = False
        t1 = time.time()
        pat = "'^/usr/bin/python3 /opt/rec/train.py'"
        until(lambda: "none" in sh(sb, victim, f"pgrep -f {pat} || echo none"), 180, "the woken rank gone")
        rep.say(f"freeze: {victim} woken: its old rank gone {time.time() - t1:.1f} s later")
        return ok
    finally:
        said(rep, svc, "freeze")
        svc.stop()
        if paused:
            docker("unpause", container)
        job.destroy()


def auto(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    """A rank SIGSTOPped under `progress: {timeout: auto}`, once the service could learn the
    bound from the job's own intervals."""
    job = Job(sb, tmp, env, "bench-auto", args, gloo=600, progress={"timeout": "auto"})
    job.apply()
    victim = job.workers[-1]
    svc = serve(tmp, env, job)
    try:
        # the service learns the bound from the rounds' intervals (`status`, one look, says
        # AUTO_START_S): a minute of steps gives it AUTO_SAMPLES and more; the incident's
        # words say the bound it used
        first = until(lambda: timed_steps(sb, job), 300, "the first step")[0][0]
        time.sleep(max(0.0, first + 60 - time.time()))
        until(lambda: len(job.checkpoints()) >= 2, 300, "two checkpoints")
        before = job.incidents()
        t0 = time.time()
        sh(sb, victim, "pkill -STOP -f '^/usr/bin/python3 /opt/rec/train.py'")
        inc = until(lambda: job.running_again(before), 400, "the job running again", every=1.0)
        resumed = until(lambda: job.resumed()[before:], 120, "the chief to resume")[0]
        redone = job.redone(resumed, before)
        detect, again = inc["detected"] - t0, inc["running"] - inc["detected"]
        learnt_bound = re.search(r"bound (\d+) s", inc["words"])
        rep.say(f"auto: a rank on {victim} SIGSTOPped {t0 - first:.0f} s after its first step; detected {detect:.1f} s "
                f"after (the bound learnt: {learnt_bound.group(1) if learnt_bound else '?'} s), "
                f"running again {again:.1f} s after detection, {redone} steps redone; incident: {inc['words']}")  # fmt: skip
        return rep_verdicts(rep, "auto", detect, 120.0, again, redone, args)
    finally:
        said(rep, svc, "auto")
        svc.stop()
        job.destroy()


def timed_steps(sb: sandbox.Sandbox, job: Job) -> list[tuple[float, int]]:
    """The chief's step log with its journal's times: (when, step)."""
    out = sh(sb, "host-1", f"journalctl -q -o short-unix -t provision-{job.name}-chief-0 --no-pager")
    return [(float(t), int(n)) for t, n in re.findall(r"^(\d+\.\d+) .*?\] step (\d+) ", out, re.M)]


def left(by: str | None) -> float:
    """Seconds from now to HH:MM UTC today (--by), or a day without one."""
    if not by:
        return 86400.0
    hh, mm = (int(x) for x in by.split(":"))
    return calendar.timegm(time.gmtime()[:3] + (hh, mm, 0, 0, 0, 0)) - time.time()


def nfaults(args: argparse.Namespace) -> int:
    """The faults of a goodput run: one every --every seconds, none at its end."""
    return int((args.minutes * 60 - 1) // args.every)


def goodput(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    """A run of --minutes with a failure every --every seconds, in turn: a rank killed
    (SIGKILL), a worker's host killed (its container), a rank frozen (SIGSTOP; its peers'
    collectives time out); each on a worker's host of the run then, each host set aside
    for the job afterwards, so a spare for each."""
    faults = nfaults(args)
    job = Job(sb, tmp, env, "bench-goodput", args, gloo=10, spares=faults)
    job.apply()
    svc = serve(tmp, env, job)
    killed: list[str] = []
    pat = "'^/usr/bin/python3 /opt/rec/train.py'"
    ok = True
    try:
        until(lambda: timed_steps(sb, job), 300, "the first step")
        start = time.time()
        for n in range(faults):
            time.sleep(max(0.0, start + (n + 1) * args.every - time.time()))
            st = job.status()
            here = {t["task"]: t["host"] for t in st.get("tasks", [])}
            victim = here.get(f"worker-{n % len(job.workers)}") or job.workers[0]
            kind = ("task", "host", "freeze")[n % 3]
            before = job.incidents()
            t0 = time.time()
            if kind == "task":
                sh(sb, victim, f"pkill -KILL -f {pat}")
            elif kind == "host":
                docker("kill", sb.host(victim).container)
                killed.append(victim)
            else:
                sh(sb, victim, f"pkill -STOP -f {pat}")
            try:
                inc = until(lambda b=before: job.running_again(b), args.every - 5, "the job running again", every=1.0)
            except TimeoutError as e:
                rep.say(f"goodput: fault {n + 1} ({kind} on {victim}) at {t0 - start:.0f} s: {e}")
                ok = False
                continue
            rep.say(f"goodput: fault {n + 1} at {t0 - start:.0f} s: {kind} on {victim}: detected {inc['detected'] - t0:.1f} s "
                    f"after, running again {inc['running'] - inc['detected']:.1f} s after detection; {inc['words']}")  # fmt: skip
        time.sleep(max(0.0, start + args.minutes * 60 - time.time()))
        st = job.status()
        g = st.get("goodput") or {}
        incs = (st.get("recovery") or {}).get("incidents") or []
        done = [i for i in incs if i.get("stage") == "done" and i.get("running")]
        steps = timed_steps(sb, job)
        # the trainer's own count: the steps it has at the end (each done once, the redone
        # ones not counted twice) at its median step time, over provision's wall time
        gaps = sorted(b[0] - a[0] for a, b in zip(steps, steps[1:]) if b[1] == a[1] + 1)
        step_s = gaps[len(gaps) // 2] if gaps else args.step
        useful = steps[-1][1] * step_s if steps else 0.0
        wall = float(g.get("wall_seconds") or 0.0)
        trainer = useful / wall if wall else 0.0
        ratio = float(g.get("ratio") or 0.0)
        rep.say(f"goodput: {args.minutes:g} min, {faults} faults every {args.every:g} s: provision's goodput "
                f"{ratio:.1%} of {wall:.0f} s ({g.get('lost_seconds')} s lost, {len(incs)} incidents); the trainer's "
                f"step log: step {steps[-1][1] if steps else 0} at a median {step_s:.2f} s a step = {trainer:.1%} "
                f"of the same wall time")  # fmt: skip
        for x in g.get("incidents") or []:
            rep.say(f"goodput: incident times {json.dumps(x)}")
        rep.verdict("goodput: provision's goodput >= 85 %", f"{ratio:.1%}", ratio >= 0.85)
        rep.verdict("goodput: the trainer's step log agrees within 5 points", f"{trainer:.1%} vs {ratio:.1%}",
                    abs(trainer - ratio) <= 0.05)  # fmt: skip
        rep.verdict("goodput: every failure recovered, no command typed", f"{len(done)} of {faults}",
                    ok and len(done) >= faults)  # fmt: skip
        return ok and ratio >= 0.85 and len(done) >= faults and abs(trainer - ratio) <= 0.05
    finally:
        said(rep, svc, "goodput")
        svc.stop()
        for h in killed:
            docker("start", sb.host(h).container)
        if killed:
            until(lambda: cli("status", str(job.inv), cwd=job.dir, env=env).returncode in (0, 1), 120, "hosts back")
        job.destroy()


def soak(rep: Report, sb: sandbox.Sandbox, tmp: Path, env: dict[str, str], args: argparse.Namespace) -> bool:
    """--soak minutes in which one worker's host drops its SSH port (iptables inside the
    host) for 5 s every minute: never a restart."""
    job = Job(sb, tmp, env, "bench-soak", args)
    job.apply()
    victim = job.workers[-1]
    svc = serve(tmp, env, job)
    rule = "INPUT -p tcp --dport 22 -j DROP"
    try:
        run = until(lambda: (job.status().get("run") or {}).get("number"), 120, "the run")
        until(lambda: timed_steps(sb, job), 300, "the first step")
        start, drops = time.time(), 0
        if args.by:  # as long as asked, or shorter to end by then (its exact length is said)
            args.soak = max(1.0, min(args.soak, (left(args.by) - 30) / 60))
        while time.time() - start < args.soak * 60 - 5:
            time.sleep(max(0.0, start + drops * 60 - time.time()))
            sh(sb, victim, f"iptables -I {rule}")
            time.sleep(5)
            sh(sb, victim, f"iptables -D {rule}")
            drops += 1
        time.sleep(max(0.0, start + args.soak * 60 - time.time()))
        length = time.time() - start
        st = job.status()
        same = (st.get("run") or {}).get("number") == run and all(t["state"] == "Running" for t in st["tasks"])
        stops = len([x for x in svc.output().splitlines() if "stopping it on every host" in x])
        steps = timed_steps(sb, job)
        went = [b for a, b in zip(steps, steps[1:]) if b[1] != a[1] + 1]
        rep.say(f"soak: {length / 60:.1f} min, {victim}'s port 22 dropped 5 s every minute ({drops} times): run {run} -> "
                f"{(st.get('run') or {}).get('number')}, {stops} stops; the chief's steps "
                f"{steps[0][1] if steps else '-'} -> {steps[-1][1] if steps else '-'}, {len(went)} breaks in its step log")  # fmt: skip
        rep.verdict("soak: no restart", f"{stops} stops, same run: {same}", same and stops == 0 and not went)
        return same and stops == 0 and not went
    finally:
        sh(sb, victim, f"iptables -D {rule} 2>/dev/null; true")
        said(rep, svc, "soak")
        svc.stop()
        job.destroy()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=4, help="the hosts running the job (the chief on the first)")
    ap.add_argument("--spares", type=int, default=1, help="its spares (goodput: one for each fault)")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs each task takes (sandbox hosts with stand-in GPUs)")
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--checkpoint", type=float, default=20.0)
    ap.add_argument("--blinks", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=10.0, help="goodput: the run's length")
    ap.add_argument("--every", type=float, default=120.0, help="goodput: seconds between two faults")
    ap.add_argument("--soak", type=float, default=30.0, help="soak: its minutes")
    ap.add_argument("--by", help="soak: ended by HH:MM UTC, shorter if need be")
    ap.add_argument("--only", choices=tuple(MODES), action="append")
    ap.add_argument("--name")
    args = ap.parse_args()
    modes = [m for m in MODES if m in (args.only or ("kill", "hang", "blink"))]
    # the first three in one file (as first measured), every other mode in its own
    groups = [[m for m in modes if m in OLD]] + [[m] for m in modes if m not in OLD]
    groups = [g for g in groups if g]
    faults = nfaults(args) if "goodput" in modes else 0
    sb = sandbox.up(
        "bench55rec", hosts=args.hosts + max(args.spares, faults), gpus_per_host=args.gpus, with_=("torch",),
        timeout=1800,
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PROVISION_SERVICE_DB": str(tmp / "svc" / "service.sqlite"),
           "PROVISION_OWNER": "bench@example.com"}  # fmt: skip
    ok = True
    try:
        for group in groups:
            if group == ["goodput"] and "soak" in modes and left(args.by) < args.minutes * 60 + 25 * 60:
                print("goodput: skipped: no time for it and a 10-minute soak before --by", flush=True)
                continue
            name = "recovery" + ("" if group == OLD else "-" + "-".join(group))
            rep = Report(args.name or time.strftime(f"%Y-%m-%d-{name}"), ", ".join(MODES[m] for m in group))
            spares = faults if group == ["goodput"] else args.spares
            held = (f", each task holding {args.gpus} of its host's (stand-in) GPUs: the service's rounds every "
                    f"{HELD_EVERY:g} s, as for any job that holds a GPU") if args.gpus else ""  # fmt: skip
            rep.say(f"{args.hosts} sandbox hosts run the job, {spares} spare, torch DDP over gloo on CPU{held}, a "
                    f"step {args.step:g} s, a checkpoint every {args.checkpoint:g} s; the anchors: {ANCHORS}")  # fmt: skip
            for mode in group:
                try:
                    ok = RUNS[mode](rep, sb, tmp, env, args) and ok
                except Exception as e:  # noqa: BLE001 - the bench goes on to its next mode, saying why
                    rep.verdict(f"{mode}: ran", f"{type(e).__name__}: {str(e)[:300]}", False)
                    ok = False
            rep.write()
    finally:
        sandbox.down(sb.name)
    return 0 if ok else 1


MODES = {
    "kill": "a job's host killed",
    "hang": "a rank hung",
    "blink": "SSH blinking",
    "freeze": "a host frozen off the network",
    "auto": "a rank hung under progress auto",
    "goodput": "a failure every 2 minutes",
    "soak": "SSH dropped 5 s a minute",
}
OLD = ["kill", "hang", "blink"]
RUNS = {"kill": kill, "hang": hang, "blink": blink, "freeze": freeze, "auto": auto, "goodput": goodput, "soak": soak}


if __name__ == "__main__":
    sys.exit(main())
