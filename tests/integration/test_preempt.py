"""preemption that keeps the checkpoint, on a real sandbox host with 2 (stand-in)
GPUs. A low-priority preemptible trainer holds both; a high-priority apply takes them within
the trainer's grace (10 s) + 5 s; the trainer saves its step on SIGTERM and, resumed by its
owner's apply (PROVISION_RESUME=1, the same AIP_CHECKPOINT_DIR), continues from it. A sampler
on the hosts (every 200 ms, the whole module) checks that no two jobs ever hold one GPU or
port: by the ledger entries of running units, and by the processes' CUDA_VISIBLE_DEVICES.
host-2 serves a job of two hosts whose preemptor knows host-1 alone: it is preempted whole
by its own side (its owner's apply, the service)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clirun import cli, ok, output_until, sh, status, wait_until
from provision.serve.gpusample import QUIET_EVERY

pytestmark = pytest.mark.integration

GRACE = 10
HOST = "host-1"
HOST2 = "host-2"

# The trainer: one step every 0.2 s, logged to AIP_CHECKPOINT_DIR/steps.log; on SIGTERM it
# saves the step it is at and leaves (argv[1] == "ignore": it ignores SIGTERM instead).
TRAINER = r"""
import os, signal, sys, time
d = os.environ["AIP_CHECKPOINT_DIR"]
os.makedirs(d, exist_ok=True)
ck, log = os.path.join(d, "step"), open(os.path.join(d, "steps.log"), "a")
def say(s):
    log.write(s + "\n"); log.flush()
step = 0
if os.environ.get("PROVISION_RESUME") == "1" and os.path.exists(ck):
    step = int(open(ck).read())
say("start %d resume %s at %s" % (step, os.environ.get("PROVISION_RESUME", "0"), os.environ.get("PROVISION_PREEMPT_AT")))
stop = []
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
while True:
    time.sleep(0.2)
    if stop:
        with open(ck + ".tmp", "w") as f:
            f.write(str(step))
        os.rename(ck + ".tmp", ck)
        say("saved %d deadline %s" % (step, open(os.environ["PROVISION_PREEMPT_AT"]).read().strip()))
        sys.exit(0)
    step += 1
    say("step %d" % step)
"""

# Every 200 ms: which jobs hold which GPU and port, by the ledger entries whose units run
# (their invocation link is there) and by the running processes' CUDA_VISIBLE_DEVICES.
SAMPLER = r"""
import glob, json, os, time
out = open("/tmp/preempt-samples.jsonl", "a")
while not os.path.exists("/tmp/preempt-sampler.stop"):
    gpus, ports, procs = {}, {}, {}
    for f in glob.glob("/var/lib/provision/.ledger/*.json"):
        try:
            e = json.load(open(f))
        except Exception:
            continue
        if not any(os.path.lexists("/run/systemd/units/invocation:" + u) for u in e.get("units") or []):
            continue
        for g in e.get("gpus") or []:
            gpus.setdefault(str(g), []).append(e["job"])
        for p in e.get("ports") or []:
            ports.setdefault(str(p), []).append(e["job"])
    for env in glob.glob("/proc/[0-9]*/environ"):
        try:
            kv = dict(x.split("=", 1) for x in open(env, "rb").read().decode("utf-8", "replace").split("\0") if "=" in x)
        except OSError:
            continue
        if "PROVISION_JOB" in kv and kv.get("CUDA_VISIBLE_DEVICES"):
            for g in kv["CUDA_VISIBLE_DEVICES"].split(","):
                procs.setdefault(g, set()).add(kv["PROVISION_JOB"])
    out.write(json.dumps({"t": time.time(), "gpus": gpus, "ports": ports, "procs": {g: sorted(j) for g, j in procs.items()}}) + "\n")
    out.flush()
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def box(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)  # host-2: a job of two hosts, preempted on one
    for h in (HOST, HOST2):
        sb.container(h).exec_run(["python3", "-c", SAMPLER], detach=True)
    yield sb
    samples = []
    for h in (HOST, HOST2):
        sh(sb, h, "touch /tmp/preempt-sampler.stop")
        samples += [
            json.loads(x) for x in sh(sb, h, "cat /tmp/preempt-samples.jsonl").splitlines() if x.startswith("{")
        ]
    sandbox_factory.down(sb)
    assert len(samples) > 50, "the sampler did not run"
    for s in samples:
        for kind in ("gpus", "ports", "procs"):
            two = {k: v for k, v in s[kind].items() if len(set(v)) > 1}
            assert not two, f"two jobs on one {kind[:-1]} at {s['t']}: {two}"


def write(sb, make, d: Path, job: str, *, gpus: int = 2, command: list[str], **extra) -> Path:
    inv = d / f"{job}.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": gpus, "command": command}}
    make(sb, job=job, pools=pools, path=inv, hosts=[HOST], **extra)
    return inv


def trainer(sb, make, d: Path, job: str, mode: str = "save") -> Path:
    return write(
        sb,
        make,
        d,
        job,
        command=["/usr/bin/python3", "-c", TRAINER, mode],
        priority="low",
        preemptible=True,
        preemption={"grace": f"{GRACE}s"},
        outputs=f"/data/{job}",
    )


def high(sb, make, d: Path, job: str, seconds: int) -> Path:
    return write(sb, make, d, job, command=["/bin/sh", "-c", f"sleep {seconds}"], priority="high")


def steps_log(sb, job: str, host: str = HOST) -> list[str]:
    return sh(sb, host, f"cat /data/{job}/checkpoints/steps.log 2>/dev/null").splitlines()


def steps(sb, job: str, host: str = HOST) -> int:
    return max((int(x.split()[1]) for x in steps_log(sb, job, host) if x.startswith("step ")), default=0)


def as_owner(who: str) -> dict[str, str]:
    return {"PROVISION_OWNER": who, "PROVISION_QUEUE_POLL": "1"}


def destroy(*invs: Path) -> None:
    for inv in invs:
        cli("destroy", "-y", inv, cwd=inv.parent)


def test_preempted_saves_then_resumes_from_its_checkpoint(box, sandbox_inventory, tmp_path):
    low = trainer(box, sandbox_inventory, tmp_path, "pre-low")
    hi = high(box, sandbox_inventory, tmp_path, "pre-high", 12)
    try:
        ok(cli("apply", "-y", low, cwd=tmp_path, env=as_owner("bob@lab")))
        wait_until(lambda: steps(box, "pre-low") >= 5, 60, what="the trainer to take 5 steps")
        env = sh(box, HOST, "cat /etc/provision/pre-low/chief-0.env")
        assert 'PROVISION_PREEMPT_AT="/var/lib/provision/pre-low/preempt-at"' in env

        t0 = time.monotonic()
        r = ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
        took = time.monotonic() - t0
        assert took <= GRACE + 5, f"the high apply's tasks ran {took:.1f} s after it began"
        assert "preempted job pre-low (bob@lab, priority low) on host-1: GPUs 0, 1" in r.stderr, r.stderr
        assert status(tmp_path, hi)["phase"] == "Running"

        st = status(tmp_path, low)
        assert st["phase"] == "Preempted", st
        assert re.fullmatch(
            r"at \d\d:\d\d by pre-high \(ana@lab, priority high\): 2 GPUs on host-1; resumes when 2 GPUs are free"
            r" \(1st in the queue\)",
            st["reason"],
        ), st["reason"]
        text = ok(cli("status", low, cwd=tmp_path)).stdout
        assert "Job pre-low: Preempted at " in text and "by pre-high (ana@lab, priority high)" in text, text
        log = steps_log(box, "pre-low")
        saved = [x for x in log if x.startswith("saved ")]
        assert len(saved) == 1, log
        at = int(saved[0].split()[1])
        assert float(saved[0].split()[3]) > time.time() - 60  # the deadline it read (the host's clock)

        # Its owner's apply (queued until the high job ends) resumes it: PROVISION_RESUME=1,
        # from the step it saved; no step lost beyond the one interrupted.
        r = ok(cli("apply", "-y", "--queue", "--timeout", "120", low, cwd=tmp_path, env=as_owner("bob@lab")))
        assert "resumes after preemption" in r.stdout, r.stdout
        assert status(tmp_path, hi)["phase"] == "Succeeded"
        wait_until(lambda: steps(box, "pre-low") >= at + 3, 60, what="the resumed trainer to go on")
        log = steps_log(box, "pre-low")
        starts = [x for x in log if x.startswith("start ")]
        assert starts[-1].startswith(f"start {at} resume 1 "), log
        after = [int(x.split()[1]) for x in log[log.index(starts[-1]) :] if x.startswith("step ")]
        assert after[0] == at + 1, log
        assert status(tmp_path, low)["phase"] == "Running"
        assert not sh(box, HOST, "cat /var/lib/provision/pre-low/preempt-at 2>/dev/null").strip()
    finally:
        destroy(hi, low)


def test_two_high_applies_race_for_one_victim(box, sandbox_inventory, tmp_path):
    low = trainer(box, sandbox_inventory, tmp_path, "race-low")
    a, b = (high(box, sandbox_inventory, tmp_path, f"race-hi-{x}", 600) for x in "ab")
    try:
        ok(cli("apply", "-y", low, cwd=tmp_path, env=as_owner("bob@lab")))
        wait_until(lambda: steps(box, "race-low") >= 3, 60, what="the trainer to take 3 steps")
        procs = {
            inv: subprocess.Popen(
                [sys.executable, "-m", "provision", "apply", "-y", "--queue", "--timeout", "60", str(inv)],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **as_owner("ana@lab")},
            )
            for inv in (a, b)
        }
        running = wait_until(
            lambda: [inv for inv in (a, b) if status(tmp_path, inv)["phase"] == "Running"] or None,
            GRACE + 30,
            what="one high job to run",
        )
        assert len(running) == 1
        winner = running[0]
        loser = b if winner == a else a
        assert procs[loser].poll() is None, "the other must wait"
        out, err = procs[winner].communicate(timeout=60)
        assert procs[winner].returncode == 0, out + err
        assert "preempted job race-low" in err
        # Preempted once, by the winner.
        assert len([x for x in steps_log(box, "race-low") if x.startswith("saved ")]) == 1
        assert f"by {winner.stem} " in status(tmp_path, low)["reason"]
        # The winner leaves: the loser gets the GPUs (the victim holds none), nothing preempted again.
        destroy(winner)
        out, err = procs[loser].communicate(timeout=90)
        assert procs[loser].returncode == 0, out + err
        assert not any(x.lstrip(" .").startswith("preempted job") for x in err.splitlines()), err
        assert status(tmp_path, loser)["phase"] == "Running"
        assert len([x for x in steps_log(box, "race-low") if x.startswith("saved ")]) == 1
    finally:
        for p in locals().get("procs", {}).values():
            if p.poll() is None:
                p.kill()
        destroy(a, b, low)


def test_a_task_ignoring_sigterm_is_killed_at_the_deadline(box, sandbox_inventory, tmp_path):
    low = trainer(box, sandbox_inventory, tmp_path, "deaf-low", mode="ignore")
    hi = high(box, sandbox_inventory, tmp_path, "deaf-high", 600)
    try:
        ok(cli("apply", "-y", low, cwd=tmp_path, env=as_owner("bob@lab")))
        wait_until(lambda: steps(box, "deaf-low") >= 3, 60, what="the trainer to take 3 steps")
        t0 = time.monotonic()
        ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
        took = time.monotonic() - t0
        # It waited for the grace, and not for the task (which never ends by itself): the rest is
        # the apply's own start-up, plan and start of the high job, seconds on a loaded machine.
        assert GRACE - 1 <= took <= GRACE + 12, took
        st = status(tmp_path, low)
        assert st["phase"] == "Preempted"
        chief = st["tasks"][0]
        assert "killed at the preemption's deadline" in chief["detail"], chief
    finally:
        destroy(hi, low)


def test_the_preemptor_killed_on_the_way_leaves_no_gpu_held(box, sandbox_inventory, tmp_path):
    low = trainer(box, sandbox_inventory, tmp_path, "kill-low")
    hi = high(box, sandbox_inventory, tmp_path, "kill-high", 600)
    try:
        ok(cli("apply", "-y", low, cwd=tmp_path, env=as_owner("bob@lab")))
        wait_until(lambda: steps(box, "kill-low") >= 3, 60, what="the trainer to take 3 steps")
        # The preemptor looks again only a minute after preempting: killed meanwhile.
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(hi)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **as_owner("ana@lab"), "PROVISION_PREEMPT_TICK": "60"},
        )
        wait_until(
            lambda: (
                any(x.startswith("saved ") for x in steps_log(box, "kill-low"))
                and status(tmp_path, low)["tasks"][0]["state"] != "Running"
            ),
            GRACE + 20,
            what="the victim to save and stop",
        )
        p.kill()
        p.wait(30)
        # The next look: the victim is Preempted and holds nothing, its GPUs are free.
        st = status(tmp_path, low)
        assert st["phase"] == "Preempted", st
        view = json.loads(ok(cli("jobs", "--json", low, cwd=tmp_path)).stdout)
        assert view["hosts"][HOST]["free_gpus"] == [0, 1], view
        assert "kill-low" not in view["hosts"][HOST]["held"], view
        # The preemptor's re-run takes them at once.
        t0 = time.monotonic()
        ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
        assert time.monotonic() - t0 < GRACE
        assert status(tmp_path, hi)["phase"] == "Running"
    finally:
        destroy(hi, low)


def test_the_service_resumes_a_preempted_job_by_itself(box, sandbox_inventory, tmp_path):
    svc = tmp_path / "svc"
    svc.mkdir()
    env = {
        "PROVISION_SERVICE_DB": str(svc / "service.sqlite"),
        "PROVISION_OWNER": "bob@lab",
        "PROVISION_QUEUE_POLL": "1",
    }
    serve = _serve(svc, env)
    low = trainer(box, sandbox_inventory, tmp_path, "svc-low")
    hi = high(box, sandbox_inventory, tmp_path, "svc-high", 10)
    try:
        ok(cli("apply", "--queue", "--detach", low, cwd=tmp_path, env=env))
        wait_until(lambda: steps(box, "svc-low") >= 3, 120, what="the handed-over trainer to take 3 steps")
        r = ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
        assert "preempted job svc-low" in r.stderr, r.stderr
        assert status(tmp_path, low)["phase"] == "Preempted"
        wait_until(lambda: status(tmp_path, hi)["phase"] == "Succeeded", 60, 0.25, what="the high job to end")
        free = time.monotonic()
        wait_until(
            lambda: any(x.startswith("start ") and " resume 1 " in x for x in steps_log(box, "svc-low")),
            60,
            0.25,
            what="the service to resume the trainer",
        )
        assert time.monotonic() - free <= 30
        saved = int(next(x for x in steps_log(box, "svc-low") if x.startswith("saved ")).split()[1])
        assert any(x.startswith(f"start {saved} resume 1 ") for x in steps_log(box, "svc-low"))
        h = json.loads(ok(cli("history", "--json", cwd=svc, env=env)).stdout)
        runs = [e for e in h["events"] if e["kind"] == "run" and e["job"] == "svc-low"]
        assert any(e["how"].startswith("Preempted at ") and "by svc-high" in e["how"] for e in runs), runs
        assert len(runs) == 2, runs  # the preempted run, and the resumed one
        # The event stream says it once each: preempted (and how its run ended), resumed.
        ev = json.loads(ok(cli("events", "--json", "--job", "svc-low", cwd=svc, env=env)).stdout)["events"]
        kinds = [(e["kind"], e["run"], e["how"]) for e in ev if e["kind"] != "task.failed"]
        assert kinds == [
            ("job.started", 1, None),
            ("job.preempted", 1, None),
            ("job.ended", 1, "preempted"),
            ("job.resumed", 2, None),
        ], ev
        assert "by svc-high" in next(e["words"] for e in ev if e["kind"] == "job.preempted"), ev
    finally:
        cli("cancel", low, cwd=tmp_path, env=env)
        _unserve(serve, svc)
        destroy(hi, low)


def _serve(svc: Path, env: dict[str, str]) -> subprocess.Popen:
    """`provision serve` in `svc` (its log there), once it leads."""
    log = open(svc / "serve.log", "wb")  # noqa: SIM115 - the process keeps it
    serve = subprocess.Popen(
        [sys.executable, "-m", "provision", "serve", "--poll", "0.5", "--listen", "none"],
        cwd=svc,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    log.close()
    wait_until(lambda: "leading" in (svc / "serve.log").read_text(errors="replace"), 60, what="the service")
    return serve


def _unserve(serve: subprocess.Popen, svc: Path) -> None:
    serve.send_signal(signal.SIGTERM)
    try:
        serve.wait(60)
    except subprocess.TimeoutExpired:
        serve.kill()
    print((svc / "serve.log").read_text(errors="replace"))


# A study's trainer: one step every 0.25 s up to 30, each reported as
# cloudml-hypertune does (its file rewritten whole with this run's reports), logged to
# AIP_CHECKPOINT_DIR/steps.log; on SIGTERM it saves its step and leaves; resumed
# (PROVISION_RESUME=1) it goes on from that step. Its first run waits at step 10 for its
# preemption (the tests preempt it after 4 steps: on a loaded machine the preemptor's
# apply may take longer than the 26 steps left, and the trial would end first).
TRIAL_TRAINER = r"""
import json, os, signal, sys, time
d = os.environ["AIP_CHECKPOINT_DIR"]
os.makedirs(d, exist_ok=True)
ck, log = os.path.join(d, "step"), open(os.path.join(d, "steps.log"), "a")
metric = os.environ["CLOUD_ML_HP_METRIC_FILE"]
os.makedirs(os.path.dirname(metric), exist_ok=True)
last = 30
step = int(open(ck).read()) if os.environ.get("PROVISION_RESUME") == "1" and os.path.exists(ck) else 0
log.write("start %d resume %s\n" % (step, os.environ.get("PROVISION_RESUME", "0"))); log.flush()
stop, lines = [], []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
while step < last:
    time.sleep(0.25)
    if stop:
        open(ck + ".tmp", "w").write(str(step)); os.rename(ck + ".tmp", ck)
        log.write("saved %d\n" % step); log.flush()
        sys.exit(0)
    if step >= 10 and os.environ.get("PROVISION_RESUME") != "1":
        continue
    step += 1
    lines.append(json.dumps({"global_step": str(step), "loss": str(1.0 / step), "timestamp": time.time()}))
    open(metric, "w").write("\n".join(lines) + "\n")
    log.write("step %d\n" % step); log.flush()
"""


def sweep(box, sandbox_inventory, tmp_path, job):
    """A low-priority study of one trial (TRIAL_TRAINER: it saves its step when told to
    stop, and goes on from it), preemptible with a grace of 5 s."""
    return write(
        box,
        sandbox_inventory,
        tmp_path,
        job,
        command=["/usr/bin/python3", "-c", TRIAL_TRAINER],
        priority="low",
        preemption={"grace": "5s"},
        outputs=f"/data/{job}",
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"lr": {"type": "double", "min": 0.1, "max": 0.2}},
            "max_trials": 1,
            "parallel_trials": 1,
        },
    )


def test_a_preempted_trial_pauses_and_resumes_as_the_same_trial(box, sandbox_inventory, tmp_path):
    """A low-priority study's trial holds both GPUs; a high-priority apply preempts it: the
    trial is paused (not failed, not told), resumes as trial 1 from its checkpoint once the
    high job is gone, and the study ends with it succeeded, its step count going on."""
    study = sweep(box, sandbox_inventory, tmp_path, "pt-sweep")
    hi = high(box, sandbox_inventory, tmp_path, "pt-high", 600)
    env = as_owner("bob@lab")
    tune = subprocess.Popen(
        [sys.executable, "-m", "provision", "tune", "--poll", "0.3", str(study)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    log = "pt-sweep/1"
    try:
        wait_until(lambda: steps(box, log) >= 4, 60, 0.25, what="trial 1 to take 4 steps")
        r = ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
        assert "preempted job pt-sweep-t1 (bob@lab, priority low)" in r.stderr, r.stderr
        said = output_until(
            tune,
            "trial 1 paused: preempted by pt-high (ana@lab, priority high); resumes when 2 GPUs are free",
            30,
        )
        trials = json.loads(ok(cli("tune", "--status", "--json", study, cwd=tmp_path)).stdout)["trials"]
        assert [(t["number"], t["state"]) for t in trials] == [(1, "running")], trials
        assert trials[0]["why"].startswith("paused: preempted by pt-high"), trials[0]
        saved = int(next(x for x in steps_log(box, log) if x.startswith("saved ")).split()[1])

        destroy(hi)  # room returns: the trial resumes as trial 1, from its checkpoint
        said += output_until(tune, "trial 1 resumed on host-1", 60)
        out, _ = tune.communicate(timeout=90)
        said += out.decode(errors="replace")
        assert tune.returncode == 0, said
        lines = steps_log(box, log)
        assert f"start {saved} resume 1" in lines, lines
        after = [int(x.split()[1]) for x in lines[lines.index(f"start {saved} resume 1") :] if x.startswith("step ")]
        assert after[0] == saved + 1 and after[-1] == 30, lines
        trials = json.loads(ok(cli("tune", "--status", "--json", study, cwd=tmp_path)).stdout)["trials"]
        assert [(t["number"], t["state"], t["steps"]) for t in trials] == [(1, "succeeded", 30)], trials
        assert trials[0]["value"] == pytest.approx(1 / 30), trials[0]
        assert "trial 1 succeeded: loss=0.0333333 at step 30" in said, said
        assert "1 trial: 1 succeeded, 0 stopped early, 0 failed, 0 running" in said, said  # no retry
    finally:
        if tune.poll() is None:
            tune.kill()
            tune.wait(30)
        destroy(hi)  # (a trial left by a failure goes with the module's sandbox)


def test_a_handed_over_study_followed_says_when_its_trial_pauses_and_resumes(box, sandbox_inventory, tmp_path):
    """`provision tune STUDY` following a study the service runs prints the paused and
    resumed lines the terminal that runs a study prints (as `tune --status` shows them)."""
    svc = tmp_path / "svc"
    svc.mkdir()
    env = {"PROVISION_SERVICE_DB": str(svc / "service.sqlite"), **as_owner("bob@lab")}
    study = sweep(box, sandbox_inventory, tmp_path, "pf-sweep")
    hi = high(box, sandbox_inventory, tmp_path, "pf-high", 600)
    serve = _serve(svc, env)
    follow: subprocess.Popen | None = None
    try:
        ok(cli("tune", "--detach", "--poll", "0.3", study, cwd=tmp_path, env=env))
        wait_until(lambda: steps(box, "pf-sweep/1") >= 4, 120, 0.25, what="trial 1 to take 4 steps")
        follow = subprocess.Popen(
            [sys.executable, "-m", "provision", "tune", str(study)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        said = output_until(follow, "following it", 60)
        ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
        paused = "trial 1 paused: preempted by pf-high (ana@lab, priority high); resumes when 2 GPUs are free"
        said += output_until(follow, paused, 60)
        destroy(hi)  # room returns: the service resumes the trial
        said += output_until(follow, "trial 1 resumed on host-1 (from its checkpoint)", 90)
        out, _ = follow.communicate(timeout=120)
        said += out.decode(errors="replace")
        assert follow.returncode == 0, said
        assert said.count(paused) == 1 and "trial 1 succeeded: loss=0.0333333 at step 30" in said, said
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.wait(30)
        cli("cancel", study, cwd=tmp_path, env=env)
        _unserve(serve, svc)
        destroy(hi)


# --------------------------------------------------------------------------- a job of two hosts

WHOLE_GRACE = 5  # seconds: the two-host job's preemption grace


def two_hosts(sb, make, d: Path, job: str) -> Path:
    """A synchronous job of two tasks of 2 GPUs, one on each host (the trainer on both)."""
    cmd = ["/usr/bin/python3", "-c", TRAINER, "save"]
    inv = d / f"{job}.yaml"
    make(
        sb,
        job=job,
        pools={r: {"replicas": 1, "accelerators": 2, "command": cmd} for r in ("chief", "worker")},
        path=inv,
        hosts=[HOST, HOST2],
        priority="low",
        preemptible=True,
        preemption={"grace": f"{WHOLE_GRACE}s"},
        outputs=f"/data/{job}",
    )
    return inv


def saved_on(sb, job: str, host: str) -> list[str]:
    return [x for x in steps_log(sb, job, host) if x.startswith("saved ")]


def resumed_on(sb, job: str, host: str) -> list[str]:
    return [x for x in steps_log(sb, job, host) if x.startswith("start ") and " resume 1 " in x]


def preempted_on_host_1(box, tmp_path, low: Path, hi: Path) -> None:
    """The job runs on both hosts; a high-priority apply naming host-1 alone preempts it there."""
    wait_until(lambda: steps(box, low.stem) >= 3 and steps(box, low.stem, HOST2) >= 3, 120, what="both tasks to step")
    r = ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
    assert f"preempted job {low.stem} (bob@lab, priority low) on host-1: GPUs 0, 1" in r.stderr, r.stderr
    assert HOST2 not in r.stderr, r.stderr  # its preemptor knows host-1 alone
    assert saved_on(box, low.stem, HOST)


def test_a_job_preempted_on_one_host_is_preempted_whole_by_its_owners_apply(box, sandbox_inventory, tmp_path):
    """Its preemptor stops it on host-1 only; its task on host-2 runs on until someone acting
    for the job looks: here its owner's apply, which stops it there (the same signal and
    grace) before it resumes the job as one run on both hosts."""
    low = two_hosts(box, sandbox_inventory, tmp_path, "whole-low")
    hi = high(box, sandbox_inventory, tmp_path, "whole-high", 20)
    try:
        ok(cli("apply", "-y", low, cwd=tmp_path, env=as_owner("bob@lab")))
        preempted_on_host_1(box, tmp_path, low, hi)
        at = steps(box, "whole-low", HOST2)
        wait_until(lambda: steps(box, "whole-low", HOST2) >= at + 3, 10, 0.25, what="host-2's task to run on")
        # Read from another state (it may not change the job): status says what is left, honestly.
        other = tmp_path / "elsewhere.state.json"
        r = ok(cli("status", "--json", "--state", other, low, cwd=tmp_path, env=as_owner("eve@lab")))
        st = json.loads(r.stdout)
        assert st["phase"] == "Preempted", st
        assert "still running on host-2: not preempted there yet" in st["reason"], st["reason"]
        assert not saved_on(box, "whole-low", HOST2)

        r = ok(cli("apply", "-y", "--queue", "--timeout", "120", low, cwd=tmp_path, env=as_owner("bob@lab")))
        assert (
            f"job whole-low was preempted on host-1 by whole-high: preempted whole, its tasks on host-2 have "
            f"{WHOLE_GRACE} s to save a checkpoint" in r.stderr
        ), r.stderr
        assert "resumes after preemption" in r.stdout, r.stdout
        assert status(tmp_path, hi)["phase"] == "Succeeded"  # it waited for the GPUs on host-1
        saved = saved_on(box, "whole-low", HOST2)
        assert len(saved) == 1, steps_log(box, "whole-low", HOST2)
        assert float(saved[0].split()[3]) > time.time() - 120  # host-2's own deadline, read from PROVISION_PREEMPT_AT
        # One run on both hosts, each from its own checkpoint.
        for h in (HOST, HOST2):
            wait_until(lambda h=h: resumed_on(box, "whole-low", h), 60, what=f"the task on {h} to resume")
            step = saved_on(box, "whole-low", h)[0].split()[1]
            assert resumed_on(box, "whole-low", h)[0].startswith(f"start {step} resume 1 "), steps_log(
                box, "whole-low", h
            )
        assert status(tmp_path, low)["phase"] == "Running"
    finally:
        destroy(hi, low)


def test_a_job_resumed_after_a_preemption_in_part_can_be_preempted_again(box, sandbox_inventory, tmp_path):
    """Preempted on host-1 only, stopped on host-2 by its own side, resumed by its owner's
    apply as one new run: that run carries no mark of the earlier preemption on either
    host, so a higher-priority job that needs host-2's GPUs preempts it there at once."""
    low = two_hosts(box, sandbox_inventory, tmp_path, "again-low")
    hi = high(box, sandbox_inventory, tmp_path, "again-high", 15)
    hi2 = tmp_path / "again-high2.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": 2, "command": ["/bin/sh", "-c", "sleep 600"]}}
    sandbox_inventory(box, job="again-high2", pools=pools, path=hi2, hosts=[HOST2], priority="high")
    try:
        ok(cli("apply", "-y", low, cwd=tmp_path, env=as_owner("bob@lab")))
        preempted_on_host_1(box, tmp_path, low, hi)
        r = ok(cli("apply", "-y", "--queue", "--timeout", "120", low, cwd=tmp_path, env=as_owner("bob@lab")))
        assert "resumes after preemption" in r.stdout, r.stdout
        for h in (HOST, HOST2):
            wait_until(lambda h=h: resumed_on(box, "again-low", h), 60, what=f"the task on {h} to resume")
        view = json.loads(ok(cli("jobs", "--json", low, cwd=tmp_path)).stdout)
        marks = {h: v["preempted_by"] for h, v in {j["job"]: j for j in view["jobs"]}["again-low"]["hosts"].items()}
        assert marks == {HOST: None, HOST2: None}, view

        r = cli("apply", "-y", hi2, cwd=tmp_path, env=as_owner("ana@lab"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "preempted job again-low (bob@lab, priority low) on host-2: GPUs 0, 1" in r.stderr, r.stderr
        assert "being preempted by" not in r.stderr, r.stderr
        assert status(tmp_path, hi2)["phase"] == "Running"
        wait_until(lambda: len(saved_on(box, "again-low", HOST2)) == 2, 30, what="host-2's task to save again")
    finally:
        destroy(hi2, hi, low)


def test_a_host_unreachable_during_preemption_is_preempted_when_it_returns(box, sandbox_inventory, tmp_path):
    """The victim runs on both hosts; the preemptor needs both, and host-2 does not answer
    (paused): nothing is preempted for nothing, on host-1 either (the victim's GPUs there
    would not let it start), and the queued apply says what it waits for. host-2 answers
    again: its next look preempts the victim on both hosts and its tasks run."""
    low = two_hosts(box, sandbox_inventory, tmp_path, "unr-low")
    hi = tmp_path / "unr-high.yaml"
    sleep = {"replicas": 1, "accelerators": 2, "command": ["/bin/sh", "-c", "sleep 600"]}
    sandbox_inventory(
        box,
        job="unr-high",
        pools={"chief": sleep, "worker": sleep},
        path=hi,
        hosts=[HOST, HOST2],
        priority="high",
        ssh={"connect_timeout": 3},  # each look at the paused host costs this
    )
    p = None
    paused = False
    try:
        ok(cli("apply", "-y", low, cwd=tmp_path, env=as_owner("bob@lab")))
        wait_until(lambda: steps(box, "unr-low") >= 3 and steps(box, "unr-low", HOST2) >= 3, 120, what="both to step")
        box.container(HOST2).pause()
        paused = True
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", "--queue", "--timeout", "180", str(hi)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **as_owner("ana@lab")},
        )
        said = output_until(p, "waiting for", 60)
        assert "queued (" in said, said
        assert "host-2: cannot be reached (" in said and "nothing is preempted for this job until it answers" in said
        assert "preempted job" not in said, said
        # A few looks while host-2 is away: the victim runs on, on host-1 too; nothing taken.
        at = steps(box, "unr-low")
        wait_until(lambda: steps(box, "unr-low") >= at + 30, 30, what="host-1's task to run on for 6 s")
        assert p.poll() is None, said
        assert not saved_on(box, "unr-low", HOST), steps_log(box, "unr-low")
        view = json.loads(ok(cli("jobs", "--json", "--target", HOST, hi, cwd=tmp_path)).stdout)
        assert view["hosts"][HOST]["held"]["unr-low"]["gpus"] == [0, 1], view
        assert not view["hosts"][HOST]["held"].get("unr-high", {}).get("gpus"), view
        jobs = {j["job"]: j for j in view["jobs"]}
        assert jobs["unr-low"]["hosts"][HOST]["preempted_by"] is None, jobs
        assert jobs["unr-high"]["queued"], jobs  # host-2 itself is frozen: nothing can change there

        box.container(HOST2).unpause()
        paused = False
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=120)
        said += out.decode(errors="replace")
        took = time.monotonic() - t0
        assert p.returncode == 0, said
        for h in (HOST, HOST2):
            assert f"preempted job unr-low (bob@lab, priority low) on {h}: GPUs 0, 1" in said, said
            assert len(saved_on(box, "unr-low", h)) == 1, steps_log(box, "unr-low", h)
        assert took <= WHOLE_GRACE + 15, f"the high job ran {took:.1f} s after host-2 answered again"
        st = status(tmp_path, hi)
        assert st["phase"] == "Running", st
        assert status(tmp_path, low)["phase"] == "Preempted"
    finally:
        if paused:
            box.container(HOST2).unpause()
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(30)
        destroy(hi, low)


def test_the_service_preempts_a_watched_job_whole(box, sandbox_inventory, tmp_path):
    """Applied through the service and watched: the round after its preemption on host-1
    sends a worker, which stops it on host-2 (within the grace + one round), waits for its
    tasks to end, and queues it; it resumes as one run on both hosts when room returns."""
    svc = tmp_path / "svc"
    svc.mkdir()
    env = {"PROVISION_SERVICE_DB": str(svc / "service.sqlite"), **as_owner("bob@lab")}
    serve = _serve(svc, env)
    low = two_hosts(box, sandbox_inventory, tmp_path, "svcw-low")
    hi = high(box, sandbox_inventory, tmp_path, "svcw-high", 600)
    try:
        ok(cli("apply", "--queue", "--detach", low, cwd=tmp_path, env=env))
        preempted_on_host_1(box, tmp_path, low, hi)
        t0 = time.monotonic()
        wait_until(
            lambda: saved_on(box, "svcw-low", HOST2), WHOLE_GRACE + QUIET_EVERY + 30, 0.5, what="host-2's task to stop"
        )
        took = time.monotonic() - t0
        assert took <= WHOLE_GRACE + QUIET_EVERY + 15, f"host-2's task stopped {took:.1f} s after the preemption"
        st = status(tmp_path, low)
        assert st["phase"] == "Preempted" and "2 GPUs on host-1, 2 GPUs on host-2" in st["reason"], st
        assert not resumed_on(box, "svcw-low", HOST)  # the GPUs on host-1 are the high job's
        destroy(hi)  # room returns: one run on both hosts
        for h in (HOST, HOST2):
            wait_until(lambda h=h: resumed_on(box, "svcw-low", h), 60, 0.5, what=f"the service to resume it on {h}")
        h = json.loads(ok(cli("history", "--json", cwd=svc, env=env)).stdout)
        runs = [e for e in h["events"] if e["kind"] == "run" and e["job"] == "svcw-low"]
        assert len(runs) == 2, runs  # the preempted run, and the resumed one
        # The event stream says it once each: preempted (and how its run ended), resumed.
        ev = json.loads(ok(cli("events", "--json", "--job", "svcw-low", cwd=svc, env=env)).stdout)["events"]
        kinds = [(e["kind"], e["run"], e["how"]) for e in ev if e["kind"] != "task.failed"]
        assert kinds == [
            ("job.started", 1, None),
            ("job.preempted", 1, None),
            ("job.ended", 1, "preempted"),
            ("job.resumed", 2, None),
        ], ev
        assert "by svcw-high" in next(e["words"] for e in ev if e["kind"] == "job.preempted"), ev
    finally:
        cli("cancel", low, cwd=tmp_path, env=env)
        _unserve(serve, svc)
        destroy(hi, low)


def test_a_paused_trial_is_adopted_by_the_next_runner(box, sandbox_inventory, tmp_path):
    """A low-priority study's trial is preempted and paused; its runner is killed (SIGKILL)
    meanwhile. `provision tune` again adopts the paused trial, which resumes as trial 1 from
    its checkpoint when the GPUs free, and the study ends with no trial run twice."""
    study = sweep(box, sandbox_inventory, tmp_path, "ptk-sweep")
    hi = high(box, sandbox_inventory, tmp_path, "ptk-high", 600)
    env = {**os.environ, **as_owner("bob@lab")}
    argv = [sys.executable, "-m", "provision", "tune", "--poll", "0.3", str(study)]
    first = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    second = None
    log = "ptk-sweep/1"
    try:
        wait_until(lambda: steps(box, log) >= 4, 60, 0.25, what="trial 1 to take 4 steps")
        ok(cli("apply", "-y", hi, cwd=tmp_path, env=as_owner("ana@lab")))
        output_until(first, "trial 1 paused: preempted by ptk-high", 30)
        first.kill()  # SIGKILL while the trial is paused
        first.wait(30)
        saved = int(next(x for x in steps_log(box, log) if x.startswith("saved ")).split()[1])

        second = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        said = output_until(second, "trial 1: its runner", 60)
        trials = json.loads(ok(cli("tune", "--status", "--json", study, cwd=tmp_path)).stdout)["trials"]
        assert [(t["number"], t["state"]) for t in trials] == [(1, "running")], trials
        assert not [x for x in steps_log(box, log) if x.startswith("start ")][1:]  # not started again while held

        destroy(hi)  # room returns: the adopted trial resumes as trial 1, from its checkpoint
        said += output_until(second, "trial 1 resumed on host-1", 60)
        out, _ = second.communicate(timeout=90)
        said += out.decode(errors="replace")
        assert second.returncode == 0, said
        lines = steps_log(box, log)
        starts = [x for x in lines if x.startswith("start ")]
        assert starts == ["start 0 resume 0", f"start {saved} resume 1"], lines  # no trial run twice
        after = [int(x.split()[1]) for x in lines[lines.index(starts[-1]) :] if x.startswith("step ")]
        assert after[0] == saved + 1 and after[-1] == 30, lines
        trials = json.loads(ok(cli("tune", "--status", "--json", study, cwd=tmp_path)).stdout)["trials"]
        assert [(t["number"], t["state"], t["steps"]) for t in trials] == [(1, "succeeded", 30)], trials
        assert "1 trial: 1 succeeded, 0 stopped early, 0 failed, 0 running" in said, said
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
        destroy(hi)
