"""Run the training programs under examples/ as real local processes.

Each test starts every task of a small job on 127.0.0.1 with the environment a
provision task gets (shared/spec/cluster-env.md): TF_CONFIG, CLUSTER_SPEC, the
PyTorch env:// variables and CUDA_VISIBLE_DEVICES="".  The helper
``job_envs`` below builds those from a pool layout and free local ports, the
same shapes provision writes, so a change of contract shows up here.

Checked for every job: the chief / training tasks exit 0, every task prints a
``step N loss X`` line for each step, the final weight checksums agree, and
the long-lived tasks (ps and worker servers of ParameterServerStrategy, the
evaluator, the reduction servers) are still running when the chief is done,
and stop cleanly on SIGTERM as they do when provision stops the job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provision.rules.metrics import parse_log_lines, parse_metric_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 20

# Pool order and CLUSTER_SPEC names as in cluster-env.md.
WORKERPOOL = {
    "chief": "workerpool0",
    "worker": "workerpool1",
    "ps": "workerpool2",
    "reduction_server": "workerpool2",
    "evaluator": "workerpool3",
}
# Variables a task's environment must not inherit from the test runner's.
CLUSTER_VARS = (
    "TF_CONFIG",
    "CLUSTER_SPEC",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "CHECKPOINT_DIR",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_NPROC_PER_NODE",
)


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


needs_tf = pytest.mark.skipif(
    not has_module("tensorflow"), reason="tensorflow cannot be imported here (pip install tensorflow-cpu==2.21.0)"
)
needs_torch = pytest.mark.skipif(
    not has_module("torch"), reason="torch cannot be imported here (pip install torch==2.13.0, CPU wheel)"
)
needs_numpy = pytest.mark.skipif(not has_module("numpy"), reason="numpy cannot be imported here")


# ---------------------------------------------------------------- env helper


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def job_envs(pools: dict[str, int], host: str = "127.0.0.1") -> dict[tuple[str, int], dict[str, str]]:
    """Per task (role, index): the cluster variables provision writes, per cluster-env.md.

    pools maps role (chief, worker, ps, reduction_server, evaluator) to replicas.
    """
    assert not ("ps" in pools and "reduction_server" in pools)
    ports = iter(free_ports(sum(pools.values())))
    addrs = {role: [f"{host}:{next(ports)}" for _ in range(n)] for role, n in pools.items() if n}
    # TF_CONFIG cluster: chief/worker/ps only, the same dict for every task.
    tf_cluster = {r: addrs[r] for r in ("chief", "worker", "ps") if r in addrs}
    spec_cluster = {WORKERPOOL[r]: a for r, a in addrs.items()}
    job = {"pools": {r: {"replicas": n} for r, n in pools.items()}}
    n_tasks = sum(pools.values())
    trainers = len(addrs.get("chief", [])) + len(addrs.get("worker", []))
    envs = {}
    for role, members in addrs.items():
        for index, own in enumerate(members):
            env = {
                "CLUSTER_SPEC": json.dumps(
                    {
                        "cluster": spec_cluster,
                        "environment": "cloud",
                        "task": {"type": WORKERPOOL[role], "index": index},
                        "job": job,
                    },
                    separators=(",", ":"),
                ),
                "CUDA_VISIBLE_DEVICES": "",
            }
            if n_tasks > 1 and role != "reduction_server":
                cluster = dict(tf_cluster)
                if role == "evaluator":
                    cluster["evaluator"] = [own]
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": cluster, "task": {"type": role, "index": index}, "environment": "cloud"},
                    separators=(",", ":"),
                )
            if role in ("chief", "worker"):
                # rank 0 is the chief, or worker 0 when there is no chief.
                master_host, master_port = (addrs.get("chief") or addrs["worker"])[0].rsplit(":", 1)
                rank = index + 1 if role == "worker" and "chief" in addrs else index
                env.update(
                    MASTER_ADDR=master_host,
                    MASTER_PORT=master_port,
                    WORLD_SIZE=str(trainers),
                    RANK=str(rank),
                    PET_NNODES=str(trainers),
                    PET_NODE_RANK=str(rank),
                    PET_MASTER_ADDR=master_host,
                    PET_MASTER_PORT=master_port,
                    PET_NPROC_PER_NODE="1",
                )
            envs[(role, index)] = env
    return envs


def test_job_envs_shapes():
    envs = job_envs({"chief": 1, "worker": 2, "ps": 1, "evaluator": 1})
    chief = json.loads(envs[("chief", 0)]["TF_CONFIG"])
    assert set(chief["cluster"]) == {"chief", "worker", "ps"} and chief["environment"] == "cloud"
    ev = json.loads(envs[("evaluator", 0)]["TF_CONFIG"])
    assert ev["task"] == {"type": "evaluator", "index": 0}
    assert ev["cluster"]["evaluator"] == json.loads(envs[("evaluator", 0)]["CLUSTER_SPEC"])["cluster"]["workerpool3"]
    assert {k: v for k, v in ev["cluster"].items() if k != "evaluator"} == chief["cluster"]
    assert envs[("worker", 1)]["RANK"] == "2" and envs[("worker", 1)]["WORLD_SIZE"] == "3"
    assert envs[("worker", 1)]["MASTER_PORT"] == chief["cluster"]["chief"][0].rsplit(":", 1)[1]
    no_chief = job_envs({"worker": 2})
    assert [no_chief[("worker", i)]["RANK"] for i in range(2)] == ["0", "1"]
    red = job_envs({"chief": 1, "worker": 1, "reduction_server": 2})
    assert "TF_CONFIG" not in red[("reduction_server", 0)]
    spec = json.loads(red[("reduction_server", 1)]["CLUSTER_SPEC"])
    assert spec["task"] == {"type": "workerpool2", "index": 1} and len(spec["cluster"]["workerpool2"]) == 2
    assert "ps" not in json.loads(red[("chief", 0)]["TF_CONFIG"])["cluster"]


# ------------------------------------------------------------ process helper


class Task:
    def __init__(self, name: str, proc: subprocess.Popen, log: Path):
        self.name, self.proc, self.log = name, proc, log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Job:
    """Starts task processes, remembers them, and kills what is left at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.tasks: list[Task] = []

    def start(self, name: str, script: Path, env: dict[str, str], *args: str) -> Task:
        full = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
        full.update(env)
        full.pop("PYTHONUNBUFFERED", None)  # the programs must flush by themselves
        log = self.tmp_path / f"{name.replace(':', '-')}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, str(script), *args],
                env=full,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.tmp_path,
            )
        task = Task(name, proc, log)
        self.tasks.append(task)
        return task

    def logs(self) -> str:
        return "\n".join(f"----- {t.name} (rc={t.proc.poll()})\n{t.output()[-4000:]}" for t in self.tasks)

    def wait(self, tasks: list[Task], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in tasks:
            try:
                t.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{t.name} did not finish within {timeout}s\n{self.logs()}")
        for t in tasks:
            assert t.proc.returncode == 0, f"{t.name} exited {t.proc.returncode}\n{self.logs()}"

    def wait_for_line(self, task: Task, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, task.output(), re.M)
            if m:
                return m
            if task.proc.poll() is not None:
                break
            time.sleep(0.2)
        pytest.fail(f"{task.name}: no line matching {pattern!r}\n{self.logs()}")

    def stop(self, tasks: list[Task], timeout: float = 20) -> None:
        """SIGTERM, as systemd does when provision stops a task; expect a clean exit 0."""
        for t in tasks:
            assert t.proc.poll() is None, f"long-lived task {t.name} exited early\n{self.logs()}"
            t.proc.send_signal(signal.SIGTERM)
        for t in tasks:
            try:
                rc = t.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{t.name} ignored SIGTERM for {timeout}s\n{self.logs()}")
            assert rc == 0, f"{t.name} exited {rc} on SIGTERM\n{self.logs()}"

    def kill_all(self) -> None:
        for t in self.tasks:
            if t.proc.poll() is None:
                t.proc.kill()
                t.proc.wait(timeout=10)


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.kill_all()


STEP_RE = re.compile(r"^\[(?P<label>[^\]]+)\] step (?P<step>\d+) loss (?P<loss>[0-9.eE+-]+|nan|inf)$", re.M)
DONE_RE = re.compile(
    r"^\[(?P<label>[^\]]+)\] done steps (?P<steps>\d+) "
    r"checksum (?P<sum>\S+) sha256 (?P<sha>[0-9a-f]{64})",
    re.M,
)


def check_steps(task: Task, label: str, steps: int = STEPS) -> list[float]:
    """Every step 1..steps printed once, labelled with the task's role and index, finite loss."""
    out = task.output()
    found = [m for m in STEP_RE.finditer(out)]
    assert [int(m["step"]) for m in found] == list(range(1, steps + 1)), f"{task.name} step lines:\n{out[-3000:]}"
    assert all(m["label"] == label for m in found), f"{task.name}: expected label [{label}]"
    losses = [float(m["loss"]) for m in found]
    assert all(0 <= x < 1e6 for x in losses), losses
    return losses


def final_checksum(task: Task, steps: int = STEPS) -> tuple[str, str]:
    m = DONE_RE.search(task.output())
    assert m, f"{task.name}: no 'done ... checksum' line\n{task.output()[-3000:]}"
    assert int(m["steps"]) == steps
    return m["sum"], m["sha"]


# ------------------------------------------------------------------ the jobs


@pytest.mark.slow
@needs_tf
def test_tf_multi_worker_mirrored(job):
    script = EXAMPLES / "tf_mwms" / "train.py"
    envs = job_envs({"chief": 1, "worker": 2})
    t0 = time.monotonic()
    tasks = [job.start(f"{r}:{i}", script, env, "--steps", str(STEPS)) for (r, i), env in envs.items()]
    job.wait(tasks, timeout=240)
    print(f"tf_mwms job: {time.monotonic() - t0:.1f}s")
    sums = set()
    for t in tasks:
        losses = check_steps(t, t.name)
        assert losses[-1] < losses[0], f"{t.name}: loss did not go down: {losses}"
        sums.add(final_checksum(t))
    assert len(sums) == 1, f"tasks disagree on the final weights: {sums}"


@pytest.mark.slow
@needs_tf
def test_tf_parameter_server(job, tmp_path):
    script = EXAMPLES / "tf_ps" / "train.py"
    envs = job_envs({"chief": 1, "worker": 2, "ps": 1, "evaluator": 1})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    args = ("--steps", str(STEPS), "--checkpoint-every", "5")
    t0 = time.monotonic()
    # Start order of the lifecycle: ps, then chief and workers, then evaluator.
    ps = job.start("ps:0", script, envs[("ps", 0)], *args)
    chief = job.start("chief:0", script, {**envs[("chief", 0)], "CHECKPOINT_DIR": str(ckpt)}, *args)
    workers = [job.start(f"worker:{i}", script, envs[("worker", i)], *args) for i in range(2)]
    evaluator = job.start("evaluator:0", script, {**envs[("evaluator", 0)], "CHECKPOINT_DIR": str(ckpt)}, *args)
    job.wait([chief], timeout=240)
    print(f"tf_ps chief: {time.monotonic() - t0:.1f}s")
    check_steps(chief, "chief:0")
    chief_sum = final_checksum(chief)
    for t in [ps, *workers]:
        assert re.search(rf"^\[{t.name}\] server started", t.output(), re.M), t.output()
    # The evaluator reads the checkpoints the chief wrote; the last one holds the final weights.
    m = job.wait_for_line(
        evaluator,
        rf"^\[evaluator:0\] evaluated ckpt-{STEPS} step {STEPS} eval_loss (\S+) "
        r"checksum (\S+) sha256 ([0-9a-f]{64})$",
        timeout=120,
    )
    assert (m[2], m[3]) == chief_sum, "the evaluator restored other weights than the chief ended with"
    # ps, workers and evaluator are long-lived: still up, and stop cleanly when told.
    job.stop([ps, *workers, evaluator])
    for t in [ps, *workers, evaluator]:
        assert "stopping: signal received" in t.output()
    print(f"tf_ps job incl. evaluator and stop: {time.monotonic() - t0:.1f}s")


@needs_torch
def test_torch_ddp(job):
    script = EXAMPLES / "torch_ddp" / "train.py"
    envs = job_envs({"chief": 1, "worker": 2})
    t0 = time.monotonic()
    tasks = [job.start(f"{r}:{i}", script, env, "--steps", str(STEPS)) for (r, i), env in envs.items()]
    job.wait(tasks, timeout=180)
    print(f"torch_ddp job: {time.monotonic() - t0:.1f}s")
    labels = {"chief:0": "chief:0 rank 0", "worker:0": "worker:0 rank 1", "worker:1": "worker:1 rank 2"}
    sums, curves = set(), set()
    for t in tasks:
        losses = check_steps(t, labels[t.name])
        assert losses[-1] < losses[0] / 2, losses
        curves.add(tuple(losses))
        sums.add(final_checksum(t))
    assert len(curves) == 1, "ranks printed different (all-reduced) losses"
    assert len(sums) == 1, f"ranks disagree on the final weights: {sums}"


@needs_numpy
def test_reduction_servers(job):
    d = EXAMPLES / "reduction"
    envs = job_envs({"chief": 1, "worker": 2, "reduction_server": 2})
    trainers = [("chief", 0), ("worker", 0), ("worker", 1)]
    labels = {
        ("chief", 0): "workerpool0:0 rank 0",
        ("worker", 0): "workerpool1:0 rank 1",
        ("worker", 1): "workerpool1:1 rank 2",
    }
    t0 = time.monotonic()
    # Session 1: training tasks first, reducers a moment later (the tasks must retry).
    run1 = [job.start(f"{r}:{i}", d / "train.py", envs[(r, i)], "--steps", str(STEPS)) for r, i in trainers]
    time.sleep(1.0)
    reducers = [job.start(f"reduction_server:{i}", d / "reducer.py", envs[("reduction_server", i)]) for i in range(2)]
    job.wait(run1, timeout=60)
    print(f"reduction session 1: {time.monotonic() - t0:.1f}s")
    # Session 2: the reducers are long-lived and serve a second run of the job.
    t1 = time.monotonic()
    run2 = [job.start(f"{r}:{i}-run2", d / "train.py", envs[(r, i)], "--steps", str(STEPS)) for r, i in trainers]
    job.wait(run2, timeout=60)
    print(f"reduction session 2: {time.monotonic() - t1:.1f}s")
    sums = set()
    for t, key in zip(run1 + run2, trainers + trainers):
        losses = check_steps(t, labels[key])
        assert losses[-1] < losses[0] / 10, losses
        sums.add(final_checksum(t))
    assert len(sums) == 1, f"training tasks disagree on the final weights: {sums}"
    for r in reducers:
        job.wait_for_line(r, r"session complete: 20 rounds from 3 tasks(.|\n)*session complete: 20 rounds", 10)
        assert re.search(r"^\[workerpool2:\d\] round 20 reduced \d+ values from 3 tasks", r.output(), re.M)
    job.stop(reducers)
    print(f"reduction job incl. stop: {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------- environment parsing


def load(path: Path):
    """Import an example as a module (their heavy imports happen only in main())."""
    name = "example_" + "_".join(path.relative_to(EXAMPLES).with_suffix("").parts)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PROGRAMS = {
    "tf_mwms": (EXAMPLES / "tf_mwms" / "train.py", ("chief", 0), {"chief": 1, "worker": 2}),
    "tf_ps": (EXAMPLES / "tf_ps" / "train.py", ("worker", 1), {"chief": 1, "worker": 2, "ps": 1}),
    "torch_ddp": (EXAMPLES / "torch_ddp" / "train.py", ("worker", 0), {"chief": 1, "worker": 2}),
    "reduction_train": (
        EXAMPLES / "reduction" / "train.py",
        ("worker", 1),
        {"chief": 1, "worker": 2, "reduction_server": 2},
    ),
    "reducer": (
        EXAMPLES / "reduction" / "reducer.py",
        ("reduction_server", 1),
        {"chief": 1, "worker": 2, "reduction_server": 2},
    ),
}
NEEDS = {
    "tf_mwms": ["TF_CONFIG"],
    "tf_ps": ["TF_CONFIG"],
    "reduction_train": ["CLUSTER_SPEC"],
    "reducer": ["CLUSTER_SPEC"],
    "torch_ddp": ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"],
}
CASES = [(prog, var) for prog, vs in NEEDS.items() for var in vs]


@pytest.mark.parametrize("prog", sorted(PROGRAMS))
def test_env_parsing_accepts_provision_env(prog):
    path, key, pools = PROGRAMS[prog]
    mod = load(path)
    parsed = mod.read_env(job_envs(pools)[key])
    assert parsed


@pytest.mark.parametrize("prog,var", CASES)
def test_env_parsing_names_missing_variable(prog, var):
    path, key, pools = PROGRAMS[prog]
    mod = load(path)
    env = dict(job_envs(pools)[key])
    del env[var]
    with pytest.raises(mod.EnvError, match=rf"\b{var}\b.* not set"):
        mod.read_env(env)


@pytest.mark.parametrize("prog,var", CASES)
def test_missing_variable_exits_2_with_one_line(prog, var, tmp_path):
    """Run as a task would be: no traceback, one 'error:' line naming the variable, exit 2."""
    path, key, pools = PROGRAMS[prog]
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
    env.update({k: v for k, v in job_envs(pools)[key].items() if k != var})
    r = subprocess.run(
        [sys.executable, str(path), "--steps", "2"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and var in lines[0], r.stderr


@pytest.mark.parametrize(
    "prog,mutate,expect",
    [
        ("tf_mwms", lambda e: e.update(TF_CONFIG="{not json"), "not valid JSON"),
        (
            "tf_mwms",
            lambda e: e.update(
                TF_CONFIG=json.dumps({"cluster": {"chief": ["a:1"]}, "task": {"type": "chief", "index": "0"}})
            ),
            "task.index must be a non-negative integer",
        ),
        (
            "tf_mwms",
            lambda e: e.update(
                TF_CONFIG=json.dumps(
                    {"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": 1}}
                )
            ),
            r"worker:1 has no address",
        ),
        (
            "tf_ps",
            lambda e: e.update(
                TF_CONFIG=json.dumps(
                    {"cluster": {"chief": ["a:1"], "worker": ["b:1"]}, "task": {"type": "chief", "index": 0}}
                )
            ),
            "cluster.ps is missing",
        ),
        ("torch_ddp", lambda e: e.update(RANK="3"), r"RANK must be in \[0, WORLD_SIZE=3\)"),
        ("torch_ddp", lambda e: e.update(MASTER_PORT="http"), "MASTER_PORT must be an integer"),
        (
            "reducer",
            lambda e: e.update(
                CLUSTER_SPEC=e["CLUSTER_SPEC"].replace('"workerpool2","index"', '"workerpool1","index"')
            ),
            "a reduction server is a workerpool2 task",
        ),
        (
            "reduction_train",
            lambda e: e.update(
                CLUSTER_SPEC=json.dumps(
                    {"cluster": {"workerpool0": ["a:1"]}, "task": {"type": "workerpool0", "index": 0}}
                )
            ),
            "workerpool2 is empty",
        ),
    ],
)
def test_env_parsing_rejects_malformed(prog, mutate, expect):
    path, key, pools = PROGRAMS[prog]
    mod = load(path)
    env = dict(job_envs(pools)[key])
    mutate(env)
    with pytest.raises(mod.EnvError, match=expect):
        mod.read_env(env)


def test_reduction_rank_and_world_from_cluster_spec():
    mod = load(EXAMPLES / "reduction" / "train.py")
    envs = job_envs({"chief": 1, "worker": 3, "reduction_server": 2})
    got = [mod.read_env(envs[k])["rank"] for k in [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]]
    assert got == [0, 1, 2, 3]
    assert mod.read_env(envs[("worker", 2)])["world"] == 4
    red = load(EXAMPLES / "reduction" / "reducer.py").read_env(envs[("reduction_server", 1)])
    assert red["world"] == 4 and red["index"] == 1
    assert red["address"] == json.loads(envs[("reduction_server", 1)]["CLUSTER_SPEC"])["cluster"]["workerpool2"][1]


def test_tf_ps_evaluator_without_checkpoint_dir_waits_until_stopped(job):
    """Without CHECKPOINT_DIR the evaluator side-car says so and stays up (no TensorFlow needed)."""
    envs = job_envs({"chief": 1, "worker": 2, "ps": 1, "evaluator": 1})
    ev = job.start("evaluator:0", EXAMPLES / "tf_ps" / "train.py", envs[("evaluator", 0)], "--heartbeat-seconds", "0.3")
    job.wait_for_line(ev, r"^\[evaluator:0\] waiting: CHECKPOINT_DIR is not set$", timeout=30)
    job.stop([ev])


@needs_numpy
def test_reducer_survives_a_failed_session(job):
    """A training task dies mid-run: its peers fail with a clear error, the reducer drops the
    session and serves the next run of the job in full (as after provision restarts the tasks)."""
    d = EXAMPLES / "reduction"
    envs = job_envs({"chief": 1, "worker": 1, "reduction_server": 1})
    reducer = job.start("reduction_server:0", d / "reducer.py", envs[("reduction_server", 0)], "--log-every", "1")
    chief = job.start("chief:0", d / "train.py", envs[("chief", 0)], "--steps", "100000")
    worker = job.start("worker:0", d / "train.py", envs[("worker", 0)], "--steps", "100000")
    job.wait_for_line(chief, r"^\[workerpool0:0 rank 0\] step 5 loss", timeout=30)
    chief.proc.kill()
    chief.proc.wait(timeout=10)
    try:
        rc = worker.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker kept running after its peer died\n{job.logs()}")
    assert rc == 1, job.logs()
    assert "reduction-train: error: [workerpool1:0 rank 1]" in worker.output()
    job.wait_for_line(
        reducer, r"session aborted after \d+ rounds: rank 0 (disconnected|connection lost) in round \d+", timeout=10
    )
    again = [
        job.start(f"{r}:{i}-run2", d / "train.py", envs[(r, i)], "--steps", "5")
        for r, i in [("chief", 0), ("worker", 0)]
    ]
    job.wait(again, timeout=30)
    assert len({final_checksum(t, 5) for t in again}) == 1
    job.wait_for_line(reducer, r"session 2 started(.|\n)*session complete: 5 rounds from 2 tasks", timeout=10)
    job.stop([reducer])


def test_torch_labels_follow_cluster_spec():
    mod = load(EXAMPLES / "torch_ddp" / "train.py")
    envs = job_envs({"chief": 1, "worker": 2})
    assert mod.role_label(2, envs[("worker", 1)]) == "worker:1 rank 2"
    no_chief = job_envs({"worker": 2})  # worker 0 is rank 0 then
    assert mod.role_label(0, no_chief[("worker", 0)]) == "worker:0 rank 0"
    assert mod.role_label(0, {}) == "chief:0 rank 0"


# ------------------------------------------------------- a tuning trial (tune_torch)

TUNE = EXAMPLES / "tune_torch" / "train.py"
LOG_REGEX = r"step=(?P<step>\d+) val_loss=(?P<value>\S+)"


def trial_env(tmp_path: Path, name: str, trial: int | None = None, tag: str | None = None) -> dict[str, str]:
    """The runner's environment without cluster variables, plus what a tuning job sets."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS and not k.startswith("CLOUD_ML_")}
    env["CLOUD_ML_HP_METRIC_FILE"] = str(tmp_path / name / "output.metrics")
    if trial is not None:
        env["CLOUD_ML_TRIAL_ID"] = str(trial)
        task = {"type": "chief", "index": 0, "trial": str(trial)}
        env["TF_CONFIG"] = json.dumps({"cluster": {"chief": ["127.0.0.1:2222"]}, "task": task})
    if tag is not None:
        env["CLOUD_ML_HP_METRIC_TAG"] = tag
    return env


@needs_torch
def test_tune_trial_loss_depends_on_the_learning_rate(tmp_path):
    """Three trials at once (their time is mostly importing torch): a good learning rate, one
    too small, and one that crashes; each reports through the real cloudml-hypertune."""
    pytest.importorskip("hypertune", reason="pip install cloudml-hypertune==0.1.0.dev6 (the test extra)")
    runs = {
        # As provision passes parameters (--name=value), DISCRETE ones as floats.
        "good": (["--learning_rate=0.1", "--batch_size=64.0"], trial_env(tmp_path, "good", trial=3)),
        # As Vertex's docs show them (--name value), and another metric tag.
        "small": (["--learning_rate", "0.0001"], trial_env(tmp_path, "small", trial=4, tag="loss")),
        "crash": (["--learning_rate=0.1", "--report_every=2", "--crash_at_step=5"], trial_env(tmp_path, "crash")),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(TUNE), "--steps=60", *args],
            env=env,
            cwd=tmp_path,  # any directory: the script finds nothing relative to it
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (args, env) in runs.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stdout, stderr)

    reports = {}
    for name, tag in (("good", "val_loss"), ("small", "loss")):
        rc, stdout, stderr = out[name]
        assert rc == 0, (name, stdout, stderr)
        data = Path(runs[name][1]["CLOUD_ML_HP_METRIC_FILE"]).read_bytes()
        reports[name] = parse_metric_file(data, tag)
        assert [r.step for r in reports[name]] == [20, 40, 60], data
        # The log lines say the same (to the 6 decimals they print).
        logged = parse_log_lines(stdout.splitlines(), LOG_REGEX)
        assert [(r.step, r.value) for r in logged] == [(r.step, round(r.value, 6)) for r in reports[name]]
    assert "trial 3 (TF_CONFIG task.trial), CLOUD_ML_TRIAL_ID 3, metric tag val_loss" in out["good"][1]
    assert "batch_size=64 " in out["good"][1]
    good, small = reports["good"][-1].value, reports["small"][-1].value
    assert good < 0.15 and small > 1.0 and good < small / 10, (good, small)

    rc, stdout, stderr = out["crash"]
    assert rc == 1, (stdout, stderr)
    assert "Traceback (most recent call last)" in stderr
    assert "RuntimeError: crashing at step 5 as asked (--crash_at_step 5)" in stderr
    data = Path(runs["crash"][1]["CLOUD_ML_HP_METRIC_FILE"]).read_bytes()
    assert [r.step for r in parse_metric_file(data, "val_loss")] == [2, 4]


@pytest.mark.slow
@needs_torch
def test_tune_trial_diverging_reports_a_large_finite_value(tmp_path):
    pytest.importorskip("hypertune", reason="pip install cloudml-hypertune==0.1.0.dev6 (the test extra)")
    env = trial_env(tmp_path, "diverge")
    r = subprocess.run(
        [sys.executable, str(TUNE), "--learning_rate=1.0", "--steps=60"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert re.search(r"^diverged at step \d+: .*learning rate 1.0 too large", r.stdout, re.M), r.stdout
    got = parse_metric_file(Path(env["CLOUD_ML_HP_METRIC_FILE"]).read_bytes(), "val_loss")
    assert got and got[-1].value == 1e6 and got[-1].step < 60


def test_tune_trial_arguments_and_environment():
    mod = load(TUNE)
    args = mod.parse_args(["--batch_size=256.0", "--learning_rate", "3e-2", "--steps", "10"])
    assert (args.batch_size, args.learning_rate, args.steps) == (256, 0.03, 10)
    with pytest.raises(SystemExit):
        mod.parse_args(["--batch_size=256.5"])
    assert mod.read_env({}) == {"trial": None, "trial_id": None, "tag": "val_loss"}
    tf_config = json.dumps({"cluster": {"chief": ["a:1"]}, "task": {"type": "chief", "index": 0, "trial": "7"}})
    env = {"TF_CONFIG": tf_config, "CLOUD_ML_TRIAL_ID": "7", "CLOUD_ML_HP_METRIC_TAG": "mse"}
    assert mod.read_env(env) == {"trial": "7", "trial_id": "7", "tag": "mse"}
    with pytest.raises(mod.EnvError, match="TF_CONFIG is not valid JSON"):
        mod.read_env({"TF_CONFIG": "{not json"})
