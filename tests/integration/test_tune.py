"""`provision tune` on sandbox hosts with fake GPUs: trials packed onto free GPUs (never two
on one GPU: the ledger), a killed tune resumed with nothing lost or run twice, the median
rule stopping a trial that is far behind, crashing and silent trials counted and the study
stopped past max_failed_trials, and two tunes sharing one study in a real PostgreSQL.

The trainer here is tests/fixtures/tune/trainer.py (stdlib, reports as cloudml-hypertune
does); the real library and PyTorch run in test_tune_example.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from clirun import cli, ok, output_until, sh, wait_until

pytestmark = pytest.mark.integration

TRAINER = Path(__file__).resolve().parents[1] / "fixtures" / "tune" / "trainer.py"
HOSTS = ["host-1", "host-2"]  # 2 x 2 fake GPUs: 4 slots


def _study(make, sb, tmp: Path, job: str, tune: dict, *, steps: int = 4, step_seconds: float = 0.4, **extra) -> Path:
    shutil.copy(TRAINER, tmp / "trainer.py")
    inv = tmp / "study.yaml"
    make(
        sb,
        job=job,
        path=inv,
        hosts=HOSTS,
        files=[{"src": "trainer.py", "dest": f"/opt/{job}/trainer.py"}],
        pools={
            "chief": {
                "replicas": 1,
                "accelerators": 1,
                "command": ["python3", f"/opt/{job}/trainer.py", f"--steps={steps}", f"--step_seconds={step_seconds}"],
            }
        },
        tune=tune,
        **extra,
    )
    return inv


def _tune(*args, cwd: Path, env: dict | None = None, timeout: float = 600):
    return cli("tune", "--poll", "0.3", *args, cwd=cwd, env=env, timeout=timeout)


def _popen(inv: Path, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "provision", "tune", "--poll", "0.3", str(inv)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _curves(inv: Path, job: str) -> dict[int, dict[int, float]]:
    """trial number -> its reports as the study's journal keeps them (step -> value)."""
    from optuna.storages import JournalStorage  # Optuna's own reading of the journal
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    journal = str(inv.parent / ".provision" / f"{job}.tune" / "study.journal")
    storage = JournalStorage(JournalFileBackend(journal, lock_obj=JournalFileOpenLock(journal)))
    study = storage.get_study_id_from_name(job)
    return {t.number + 1: dict(t.intermediate_values) for t in storage.get_all_trials(study)}


def _trials(inv: Path, cwd: Path, env: dict | None = None) -> dict:
    return json.loads(ok(cli("tune", "--status", "--json", inv, cwd=cwd, env=env)).stdout)


class GpuWatch:
    """Polls `provision jobs --json` while a study runs: every trial job's GPUs per host."""

    def __init__(self, inv: Path, cwd: Path, prefix: str):
        self.inv, self.cwd, self.prefix = inv, cwd, prefix
        self.overlaps: list[str] = []
        self.most = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop.is_set():
            r = cli("jobs", "--json", self.inv, cwd=self.cwd)
            if r.returncode == 0:
                jobs = set()
                for host, v in json.loads(r.stdout)["hosts"].items():
                    seen: dict[int, str] = {}
                    for job, held in v.get("held", {}).items():
                        if not job.startswith(self.prefix + "-t"):
                            continue
                        jobs.add(job)
                        for g in held.get("gpus", []):
                            if g in seen:
                                self.overlaps.append(f"{host} GPU {g}: {seen[g]} and {job}")
                            seen[g] = job
                self.most = max(self.most, len(jobs))
            time.sleep(0.3)

    def done(self):
        self.stop.set()
        self.t.join(timeout=30)


def test_trials_pack_onto_free_gpus_and_a_killed_tune_resumes(sandbox4, sandbox_inventory, tmp_path):
    job = "tpack"
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
        "algorithm": "random",
        "max_trials": 8,
        "parallel_trials": 4,
    }
    # Trials of 5 s: the second wave starts within a second of the first's end (the
    # hand-off), so the window with some ended and some running is about one trial long,
    # and each look below is a `tune --status` (a second or two on a loaded machine).
    inv = _study(sandbox_inventory, sandbox4, tmp_path, job, tune, steps=10, step_seconds=0.5, outputs=f"/data/{job}")
    watch = GpuWatch(inv, tmp_path, job)
    p = _popen(inv, tmp_path)

    def some_ended_some_running() -> bool:
        states = [t["state"] for t in _trials(inv, tmp_path)["trials"]]  # one look, both counted in it
        return sum(s != "running" for s in states) >= 2 and "running" in states

    try:
        # Killed once some trials ended and others run: those run on, unattended.
        wait_until(some_ended_some_running, timeout=240, every=0.2, what="two trials ended and one running")
        p.send_signal(signal.SIGKILL)
        first = p.communicate(timeout=30)[0]
        again = ok(_tune(inv, cwd=tmp_path, timeout=600))
    finally:
        watch.done()
        if p.poll() is None:
            p.kill()
    doc = _trials(inv, tmp_path)
    numbers = [t["number"] for t in doc["trials"]]
    states = [(t["number"], t["state"], t["why"]) for t in doc["trials"]]
    assert numbers == list(range(1, 9)), states
    assert all(t["state"] == "succeeded" for t in doc["trials"]), (states, first, again.stdout)
    assert "adopted" in again.stdout, again.stdout
    # Each trial's task started once: its kept log has one start line, whoever followed it.
    logs = tmp_path / ".provision" / f"{job}.tune"
    for n in numbers:
        text = (logs / f"trial-{n}" / "chief-0.log").read_text()
        assert text.count("argv") == 1, (n, text)
        assert f"trial {n} argv" in text or f"trial '{n}' argv" in text, text
    # Never two trials on one GPU, at most parallel_trials at once.
    assert not watch.overlaps, watch.overlaps
    assert 2 <= watch.most <= 4, watch.most
    # Finished trials are gone from the hosts; the best is the lowest quality asked.
    j = json.loads(ok(cli("jobs", "--json", inv, cwd=tmp_path)).stdout)
    assert not [k for v in j["hosts"].values() for k in v.get("held", {}) if k.startswith(job + "-t")]
    best = doc["best"]
    assert best["value"] == min(t["value"] for t in doc["trials"])
    assert (logs / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "started" in first
    # A trial's own output directory (outputs/N/model/) back from the host it ran on, after
    # the trial is gone from the hosts.
    n = doc["trials"][2]
    ok(cli("fetch", inv, "--trial", n["number"], "-o", tmp_path / "t3", cwd=tmp_path))
    assert (tmp_path / "t3" / "model" / "model.txt").read_text() == f"quality {n['params']['quality']}\n"


def _seed_with_last(values: list[float], last: float) -> int:
    """A grid seed whose order asks `last` last (the order Optuna's GridSampler takes with
    that seed, one trial at a time)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for seed in range(200):
        s = optuna.create_study(sampler=optuna.samplers.GridSampler({"quality": values}, seed=seed))
        order = []
        for _ in values:
            t = s.ask()
            order.append(t.suggest_categorical("quality", values))
            try:
                s.tell(t, 1.0)
            except RuntimeError:  # the grid's last point: it calls Study.stop (told all the same)
                pass
        if order[-1] == last:
            return seed
    raise AssertionError("no seed puts it last")


def test_with_more_trials_at_once_than_gpus_each_is_told_as_soon_as_it_ends(sandbox4, sandbox_inventory, tmp_path):
    """6 trials at once on 4 GPUs: 2 wait for room, and when the first 4 end the 4 trials
    asked next are given their GPUs while the 2 waiting ones take 2 of them first. The ended trial is told
    (its result in the study) at once, not after the next one's start (up to 5 s later,
    HANDOFF_WAIT: "after 12s" said of a 3 s trial)."""
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
        "algorithm": "random",
        "max_trials": 10,
        "parallel_trials": 6,
    }
    # Trials of 3 s: a trial that waited for the next one's start was told ~3 s late, one
    # told at once is told within a start's time (~0.5 s here; 2 s leaves room for load).
    inv = _study(sandbox_inventory, sandbox4, tmp_path, "tlag", tune, steps=3, step_seconds=1.0)
    r = ok(_tune("--seed", "1", inv, cwd=tmp_path, env={**os.environ, "PROVISION_TUNE_TRACE": "1"}))
    assert [t["state"] for t in _trials(inv, tmp_path)["trials"]] == ["succeeded"] * 10
    seen: dict[str, dict[int, float]] = {"ended": {}, "told": {}}
    for line in r.stderr.splitlines():  # the trace: "TIME trial N: WHAT"
        at, who, n, what = (line.split(" ", 3) + ["", "", ""])[:4]
        if who == "trial" and what in seen:
            seen[what].setdefault(int(n.rstrip(":")), float(at))
    lags = {n: round(seen["told"][n] - at, 2) for n, at in seen["ended"].items() if n in seen["told"]}
    assert len(lags) == 10 and max(lags.values()) < 2.0, lags


def test_the_median_rule_stops_a_trial_far_behind(sandbox4, sandbox_inventory, tmp_path):
    values = [1.0, 1.01, 1.02, 1.03, 50.0]
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"quality": {"type": "discrete", "values": values}},
        "algorithm": "grid",
        "max_trials": 5,
        "parallel_trials": 1,
        "early_stopping": "median",
    }
    inv = _study(sandbox_inventory, sandbox4, tmp_path, "tmed", tune, steps=12, step_seconds=0.5)
    r = ok(_tune("--seed", str(_seed_with_last(values, 50.0)), inv, cwd=tmp_path))
    doc = _trials(inv, tmp_path)
    bad = next(t for t in doc["trials"] if t["params"]["quality"] == 50.0)
    assert bad["state"] == "stopped early", doc["trials"]
    assert bad["steps"] is not None and bad["steps"] < 12, bad
    assert "median" in bad["why"], bad
    assert f"trial {bad['number']} stopped early" in r.stdout, r.stdout
    # The others ran to their end, or were behind the median at some step too (1.03 after
    # 1.0, 1.01, 1.02 is): never failed.
    assert {t["state"] for t in doc["trials"]} <= {"succeeded", "stopped early"}, doc["trials"]
    # A completed trial's whole curve is the study's, the reports after its last look too (the
    # median rule averages them): those came only with the look that found its job ended.
    curves = _curves(inv, "tmed")
    for t in doc["trials"]:
        if t["state"] == "succeeded":
            assert sorted(curves[t["number"]]) == list(range(1, 13)), (t, curves[t["number"]])
        else:  # stopped where the rule decided: its curve ends at that step
            assert max(curves[t["number"]]) == t["steps"], (t, curves[t["number"]])
    # The best trial as a plain job: its arguments, no tune:, and plan takes it.
    out = ok(_tune("--promote", "best", "-o", tmp_path / "promoted" / "best.yaml", inv, cwd=tmp_path))
    assert f"trial {doc['best']['number']}" in out.stdout
    promoted = yaml.safe_load((tmp_path / "promoted" / "best.yaml").read_text())
    assert "tune" not in promoted
    assert promoted["pools"]["chief"]["command"][-1] == f"--quality={doc['best']['params']['quality']}"
    plan = cli("plan", "--detailed-exitcode", tmp_path / "promoted" / "best.yaml", cwd=tmp_path)
    assert plan.returncode == 2, plan.stdout + plan.stderr
    # A job of its own: applied, the study's destroy leaves it (it had the study's name, and
    # `destroy study.yaml` stopped and removed the promoted job).
    job = f"tmed-p{doc['best']['number']}"
    assert promoted["job"] == job and f"as job {job}" in out.stdout, out.stdout
    ok(cli("apply", "-y", tmp_path / "promoted" / "best.yaml", cwd=tmp_path))
    unit = f"provision-{job}-chief-0.service"
    on = [h for h in HOSTS if sh(sandbox4, h, f"systemctl cat {unit}").code == 0]
    assert len(on) == 1, on
    ok(cli("destroy", "-y", inv, cwd=tmp_path))
    assert sh(sandbox4, on[0], f"systemctl cat {unit}").code == 0, "the study's destroy removed the promoted job"
    ok(cli("destroy", "-y", tmp_path / "promoted" / "best.yaml", cwd=tmp_path))


def test_crashing_and_silent_trials_fail_and_stop_the_study(sandbox4, sandbox_inventory, tmp_path):
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"mode": {"type": "categorical", "values": ["crash", "silent"]}},
        "algorithm": "grid",
        "max_trials": 2,
        "parallel_trials": 1,
        "max_failed_trials": 1,
    }
    inv = _study(sandbox_inventory, sandbox4, tmp_path, "tcrash", tune, steps=3, step_seconds=0.2)
    r = _tune(inv, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "RuntimeError: the trainer crashed on purpose at step 2" in out, out
    assert "the study stopped: 2 trials failed, more than max_failed_trials (1)" in out.lower(), out
    doc = _trials(inv, tmp_path)
    why = {t["params"]["mode"]: t["why"] for t in doc["trials"]}
    assert doc["trials"] and all(t["state"] == "failed" for t in doc["trials"]), doc["trials"]
    assert "no loss reported" in why["silent"], why


def test_a_metric_file_the_host_makes_hostile_fails_its_trial_in_one_line(sandbox4, sandbox_inventory, tmp_path):
    """a metric file linked to /dev/zero grew tune to 23.9 GB; a hard link to
    another job's file was believed. Each is now refused without reading past a cap."""
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"mode": {"type": "categorical", "values": ["zero", "hardlink", "huge"]}},
        "algorithm": "grid",
        "max_trials": 3,
        "parallel_trials": 3,
        "max_failed_trials": 3,
    }
    inv = _study(sandbox_inventory, sandbox4, tmp_path, "thostile", tune, steps=20, step_seconds=0.5)
    r = _tune(inv, cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Traceback" not in out, out
    doc = _trials(inv, tmp_path)
    why = {t["params"]["mode"]: t["why"] for t in doc["trials"]}
    assert sorted(why) == ["hardlink", "huge", "zero"] and all(t["state"] == "failed" for t in doc["trials"]), doc
    assert "metric file on host-" in why["zero"] and "is a symbolic link" in why["zero"], why
    assert "is a hard link (2 names)" in why["hardlink"], why
    assert "over the cap of 1048576" in why["huge"], why
    # Refused while the trainer still ran (20 steps of 0.5 s): its job was stopped, not waited for.
    assert all(t["seconds"] < 9 for t in doc["trials"]), doc["trials"]


def test_a_trial_waiting_for_gpus_is_a_queued_apply_that_jobs_shows(sandbox4, sandbox_inventory, tmp_path):
    """a trial waiting for room waits as `apply --queue` does, its ledger mark
    on the hosts saying what for, so `provision jobs` lists it."""
    blocker = tmp_path / "blocker.yaml"
    sandbox_inventory(
        sandbox4,
        job="tblock",
        path=blocker,
        hosts=HOSTS,
        pools={
            "chief": {"replicas": 1, "accelerators": 1, "command": ["sleep", "600"]},
            "worker": {"replicas": 3, "accelerators": 1, "command": ["sleep", "600"]},
        },
    )
    ok(cli("apply", "-y", blocker, cwd=tmp_path))
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
        "max_trials": 1,
        "parallel_trials": 1,
    }
    inv = _study(sandbox_inventory, sandbox4, tmp_path, "twait", tune, steps=2, step_seconds=0.2)
    p = _popen(inv, tmp_path)
    try:

        def queued() -> dict | None:
            r = cli("jobs", "--json", inv, cwd=tmp_path)
            jobs = {j["job"]: j for j in json.loads(r.stdout)["jobs"]} if r.returncode == 0 else {}
            j = jobs.get("twait-t1")
            return j if j and j["state"] == "queued" and j["queued"] else None

        wait_until(queued, timeout=120, what="trial 1 listed as queued by provision jobs")
        assert "GPU" in (queued() or {})["queued"]["waiting_for"]
        ok(cli("destroy", "-y", blocker, cwd=tmp_path))
        out = p.communicate(timeout=300)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    assert [t["state"] for t in _trials(inv, tmp_path)["trials"]] == ["succeeded"]
    # It says what it waits for, and "started" only once its job is on the hosts.
    assert "trial 1 waits for room: " in out and "trial 1 started" in out, out
    assert out.index("trial 1 waits for room") < out.index("trial 1 started"), out
    # What it waits for, not what a failed apply would advise (it is waiting already).
    waits = next(line for line in out.splitlines() if "trial 1 waits for room: " in line)
    assert "does not fit" in waits and "apply --queue" not in waits and "below" not in waits, waits


def test_two_tunes_share_one_study_in_postgresql(sandbox4, sandbox_inventory, tmp_path, postgres):
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
        "algorithm": "random",
        "max_trials": 8,
        "parallel_trials": 4,
        "storage": postgres.url(),
    }
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    # 8 s trials: b is on the study, and a has seen it at a heartbeat (every 3 s), before
    # a's first ones end (4 s trials left that to a second or less once hand-offs got
    # faster); from then on each runs its share (parallel_trials split between the two).
    inv_a = _study(sandbox_inventory, sandbox4, a, "tpg", tune, steps=4, step_seconds=2.0)
    inv_b = _study(sandbox_inventory, sandbox4, b, "tpg", tune, steps=4, step_seconds=2.0)
    env = postgres.env()
    pa = _popen(inv_a, a, env)
    early_a = output_until(pa, "trial 1 started", 120)  # b asks while a's first trials run
    pb = _popen(inv_b, b, env)
    out_a = early_a + pa.communicate(timeout=600)[0]
    out_b = pb.communicate(timeout=600)[0]
    assert pa.returncode == 0 and pb.returncode == 0, out_a + out_b

    def started(out: str) -> list[int]:
        return [
            int(line.split()[1].rstrip(":"))
            for line in out.splitlines()
            if line.startswith("trial ") and " started" in line
        ]

    sa, sb_ = started(out_a), started(out_b)
    assert sa and sb_, (out_a, out_b)
    assert not set(sa) & set(sb_), (sa, sb_)
    assert sorted(sa + sb_) == list(range(1, 9)), (sa, sb_)
    doc = _trials(inv_a, a, env)
    assert [t["state"] for t in doc["trials"]] == ["succeeded"] * 8, json.dumps(
        [(t["number"], t["state"], t["why"]) for t in doc["trials"]]
    )


VERTEX_STUDY = {
    "displayName": "imported",
    "maxTrialCount": 3,
    "parallelTrialCount": 2,
    "maxFailedTrialCount": 1,
    "studySpec": {
        "metrics": [{"metricId": "loss", "goal": "MINIMIZE"}],
        "parameters": [
            {
                "parameterId": "quality",
                "doubleValueSpec": {"minValue": 0.1, "maxValue": 2.0},
                "scaleType": "UNIT_LOG_SCALE",
            }
        ],
        "algorithm": "RANDOM_SEARCH",
    },
    "trialJobSpec": {
        "workerPoolSpecs": [
            {
                "machineSpec": {"machineType": "n1-standard-4"},
                "replicaCount": "1",
                "containerSpec": {"imageUri": "gcr.io/p/t:1"},
            }
        ]
    },
}
AIP_STUDY = {
    "jobId": "imported",
    "trainingInput": {
        "scaleTier": "BASIC",
        "masterConfig": {"imageUri": "gcr.io/p/t:1"},
        "hyperparameters": {
            "goal": "MINIMIZE",
            "hyperparameterMetricTag": "loss",
            "maxTrials": 3,
            "maxParallelTrials": 2,
            "params": [
                {
                    "parameterName": "quality",
                    "type": "DOUBLE",
                    "minValue": 0.1,
                    "maxValue": 2.0,
                    "scaleType": "UNIT_LOG_SCALE",
                }
            ],
        },
    },
}


@pytest.mark.parametrize("service, spec", [("vertex", VERTEX_STUDY), ("ai-platform", AIP_STUDY)])
def test_an_imported_tuning_job_runs(sandbox4, sandbox_inventory, tmp_path, service, spec):
    """The study part of a Vertex HyperparameterTuningJob / an AI Platform TrainingInput, as
    `provision import` writes it, runs as it is (the trial's pools: this file's trainer)."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    ok(cli("import", service, "spec.json", "-o", "imported.yaml", cwd=tmp_path))
    imported = yaml.safe_load((tmp_path / "imported.yaml").read_text())
    tune = imported["tune"]
    assert tune["max_trials"] == 3 and tune["parallel_trials"] == 2, tune
    job = "timp-" + service.split("-")[0][:3]
    inv = _study(sandbox_inventory, sandbox4, tmp_path, job, tune, steps=2, step_seconds=0.3)
    ok(_tune(inv, cwd=tmp_path))
    doc = _trials(inv, tmp_path)
    assert [t["state"] for t in doc["trials"]] == ["succeeded"] * 3, doc["trials"]
    assert all(0.1 <= t["params"]["quality"] <= 2.0 for t in doc["trials"])


def test_a_categorical_value_with_spaces_is_one_argument_of_the_trial(sandbox4, sandbox_inventory, tmp_path):
    """item 7: an AI Platform config's `hidden_units: '1024 512 256'` reaches the
    trainer as ONE argument, `--hidden_units=1024 512 256`, replacing the one its command
    had; quotes, `$`, `%`, `;` and backslashes arrive as written (no shell, no expansion)."""
    import ast

    values = ["1024 512 256", 'it\'s "$HOME"; 100% \\n']
    job = "tcat"
    shutil.copy(TRAINER, tmp_path / "trainer.py")
    inv = tmp_path / "study.yaml"
    sandbox_inventory(
        sandbox4,
        job=job,
        path=inv,
        hosts=HOSTS,
        files=[{"src": "trainer.py", "dest": f"/opt/{job}/trainer.py"}],
        pools={
            "chief": {
                "replicas": 1,
                "accelerators": 1,
                "command": [
                    "python3",
                    f"/opt/{job}/trainer.py",
                    "--steps=2",
                    "--step_seconds=0.2",
                    "--hidden_units=64 32",
                ],
            }
        },
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"hidden_units": {"type": "categorical", "values": values}},
            "algorithm": "grid",
            "max_trials": 2,
            "parallel_trials": 2,
        },
    )
    ok(_tune(inv, cwd=tmp_path))
    doc = _trials(inv, tmp_path)
    assert [t["state"] for t in doc["trials"]] == ["succeeded"] * 2, doc["trials"]
    assert sorted(t["params"]["hidden_units"] for t in doc["trials"]) == sorted(values)
    logs = tmp_path / ".provision" / f"{job}.tune"
    for t in doc["trials"]:
        text = (logs / f"trial-{t['number']}" / "chief-0.log").read_text()
        line = next(ln for ln in text.splitlines() if " argv [" in ln)
        argv = ast.literal_eval(line[line.index(" argv [") + len(" argv ") :])
        assert argv == ["--steps=2", "--step_seconds=0.2", f"--hidden_units={t['params']['hidden_units']}"], (
            line,
            argv,
        )


def test_an_imported_vertex_studys_trials_each_have_their_own_outputs(sandbox4, sandbox_inventory, tmp_path):
    """item 4: the tuning job's baseOutputDirectory (gs://, as Vertex users have it)
    gave every trial one AIP_MODEL_DIR, each overwriting the others' model, and `fetch
    --trial N` found no outputs:. Now trial N writes BASE/N/model/ as on Vertex; fetch
    --trial N brings back trial N's files only; the promoted inventory's outputs are its."""
    job = "tout"
    spec = json.loads(json.dumps(VERTEX_STUDY))
    spec["displayName"] = job
    spec["trialJobSpec"]["baseOutputDirectory"] = {"outputUriPrefix": "gs://example-bucket/hpt/"}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    ok(cli("import", "vertex", "spec.json", "-o", "imported.yaml", cwd=tmp_path))
    imported = yaml.safe_load((tmp_path / "imported.yaml").read_text())
    base = imported["outputs"]
    assert base == f"/data/{job}" and "AIP_MODEL_DIR" not in (imported.get("env") or {}), imported
    for h in HOSTS:
        sh(sandbox4, h, f"rm -rf {base}")
    inv = _study(sandbox_inventory, sandbox4, tmp_path, job, imported["tune"], steps=2, step_seconds=0.3, outputs=base)
    ok(_tune(inv, cwd=tmp_path))
    doc = _trials(inv, tmp_path)
    assert [t["state"] for t in doc["trials"]] == ["succeeded"] * 3, doc["trials"]
    assert doc["ended"] == "the study ended: 3 trials", doc
    assert all(t["why"] == "chief-0 exited 0" for t in doc["trials"]), doc["trials"]
    # On the hosts: one model per trial, under its own number.
    found = {}
    for h in HOSTS:
        out = sh(sandbox4, h, f'cd {base} 2>/dev/null && for f in */model/model.txt; do echo "$f $(cat $f)"; done')
        for line in out.splitlines():
            if line.endswith("model/model.txt"):  # the glob matched nothing
                continue
            path, text = line.split(" ", 1)
            found[int(path.split("/")[0])] = text
    quality = {t["number"]: t["params"]["quality"] for t in doc["trials"]}
    assert found == {n: f"quality {q}" for n, q in quality.items()}, (found, quality)
    for n, q in quality.items():
        got = tmp_path / f"t{n}"
        ok(cli("fetch", inv, "--trial", n, "-o", got, cwd=tmp_path))
        assert (got / "model" / "model.txt").read_text() == f"quality {q}\n"
        files = [str(f.relative_to(got)) for f in got.rglob("*") if f.is_file()]
        assert files == ["model/model.txt"], files  # its own only: no other trial's directory
    ok(cli("tune", inv, "--promote", "2", "-o", tmp_path / "best.yaml", cwd=tmp_path))
    promoted = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert promoted["outputs"] == f"{base}/2", promoted


def test_check_says_a_study_host_has_no_hypertune_and_how_to_bring_it(sandbox4, sandbox_inventory, tmp_path):
    """item 6: a bare host's python has no cloudml-hypertune (the sandbox hosts' has
    it only with the torch layer): `provision check` of the study says so, with the fix,
    before any trial fails with 'No module named hypertune'; with the library on the
    task's PYTHONPATH, it passes."""
    job = "thyp"
    tune = {
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
        "max_trials": 2,
    }
    inv = _study(sandbox_inventory, sandbox4, tmp_path, job, tune)

    def check() -> tuple[int, list[tuple[str, str, str]]]:
        r = cli("check", "--json", "--skip-network", inv, cwd=tmp_path)
        assert r.returncode in (0, 1), r.stdout + r.stderr
        data = json.loads(r.stdout)
        return r.returncode, [
            (h, c["status"], c["detail"])
            for h, v in data["hosts"].items()
            for c in v["checks"]
            if c["check"] == "hypertune"
        ]

    code, found = check()
    assert code == 1 and found, found
    # Every host a trial could run on is asked, not only the plain job's (its one chief's).
    assert {h for h, _, _ in found} == set(HOSTS), found
    for _, status, detail in found:
        assert status == "fail", found
        assert detail.startswith("python3 cannot import hypertune (ModuleNotFoundError: No module named 'hypertune')")
        assert "pip install cloudml-hypertune" in detail and "PYTHONPATH" in detail and "metric.regex" in detail
    # The library on the task's PYTHONPATH (as an air-gapped host gets it: pushed, see
    # docs/tuning.md): the check passes.
    lib = f"/opt/{job}-lib"
    for h in HOSTS:
        sh(sandbox4, h, f"mkdir -p {lib}/hypertune && : > {lib}/hypertune/__init__.py", check=True)
    _study(sandbox_inventory, sandbox4, tmp_path, job, tune, env={"PYTHONPATH": lib})
    try:
        code, found = check()
        assert [s for _, s, _ in found] == ["pass"] * len(found) and found, found
        assert all(
            d == f"python3 (PYTHONPATH={lib}) imports hypertune: {lib}/hypertune/__init__.py" for _, _, d in found
        )
    finally:
        for h in HOSTS:
            sh(sandbox4, h, f"rm -rf {lib}")
