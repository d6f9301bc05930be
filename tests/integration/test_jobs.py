"""Real training jobs end to end on sandbox hosts: the example inventories in
inventories/sandbox/ (TensorFlow MultiWorkerMirroredStrategy and ParameterServerStrategy,
PyTorch DDP, reduction servers) run to Succeeded, their logs hold every task's training
output, the long-lived tasks were stopped, and destroy leaves nothing of the job behind.
Plus container pools, through a `docker` stand-in (no Docker engine runs on the hosts).

The sandbox mounts the tensorflow and torch layers (`--with`), so the hosts' own
/usr/bin/python3 imports both; the first run on a machine installs the layers (minutes),
later runs reuse them.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from clirun import cli, sh
from provision import sandbox
from provision.cli.sandboxcmd import job_from_file
from provision.host.taskenv import parse_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "inventories" / "sandbox"
STEP = re.compile(r"\] step (\d+) loss -?\d+\.\d+")
DONE = re.compile(r"\] done steps (\d+) checksum (-?\d+\.\d+) sha256 ([0-9a-f]{64})")


@pytest.fixture(scope="module")
def frameworks_sandbox(sandbox_frameworks):
    return sandbox_frameworks  # the session's (tests/conftest.py)


def nothing_left(sb, job: str, pushed: str) -> None:
    """No unit, env file, job or state directory, pushed file or unit in systemd's memory."""
    for h in sb.hosts:
        out = sh(
            sb,
            h.name,
            (
                f"ls /etc/systemd/system | grep -F provision-{job}; "
                f"ls -d /etc/provision/{job} /var/lib/provision/{job} {pushed} 2>/dev/null; "
                f"systemctl list-units --all --plain --no-legend 'provision-{job}*'; "
                f"systemctl list-unit-files --plain --no-legend 'provision-{job}*'; "
                f"ls /etc/provision /var/lib/provision 2>/dev/null"
            ),
        )
        assert out.strip() == "", f"{h.name} still has:\n{out}"


EXAMPLES = {
    # example: (training tasks that print steps, long-lived tasks stopped at the end)
    "torch_ddp": (["chief-0", "worker-0", "worker-1"], []),
    "reduction": (["chief-0", "worker-0", "worker-1"], ["reduction_server-0", "reduction_server-1"]),
    "tf_mwms": (["chief-0", "worker-0", "worker-1"], []),
    "tf_ps": (["chief-0"], ["worker-0", "worker-1", "ps-0", "evaluator-0"]),
}


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_job_runs_to_succeeded(example, frameworks_sandbox, tmp_path):
    sb = frameworks_sandbox
    spec = job_from_file(JOBS / f"{example}.yaml")
    job = spec["job"]
    inv = sandbox.write_inventory(sb, tmp_path / "inv.yaml", **spec)
    training, long_lived = EXAMPLES[example]

    t0 = time.monotonic()
    r = cli("apply", "-y", "--wait", "--timeout", "480", inv, cwd=tmp_path)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert "job Succeeded: chief-0 exited 0" in r.stderr

    st = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)
    assert st["phase"] == "Succeeded"
    rows = {t["task"]: t for t in st["tasks"]}
    assert rows["chief-0"]["state"] == "Succeeded"
    for t in long_lived:
        assert rows[t]["state"] == "Stopped", rows[t]
        assert rows[t]["detail"].startswith("stopped by provision: job succeeded"), rows[t]
    for t in training:
        assert rows[t]["state"] in ("Succeeded", "Stopped"), rows[t]

    out = tmp_path / "logs"
    lg = cli("logs", inv, "-o", out, cwd=tmp_path)
    assert lg.returncode == 0, lg.stderr
    digests = set()
    for t in training:
        text = (out / f"{t}.log").read_text()
        steps = sorted({int(m.group(1)) for m in STEP.finditer(text)})
        assert steps == list(range(1, 21)), f"{t}: steps {steps}\n{text[-2000:]}"
        done = DONE.search(text)
        assert done and done.group(1) == "20", text[-2000:]
        digests.add(done.group(3))
    assert len(digests) == 1, f"the tasks ended with different weights: {digests}"
    for t in long_lived:
        text = (out / f"{t}.log").read_text()
        assert "stopping: signal received" in text, text[-2000:]
    if example == "tf_ps":  # the evaluator restored the chief's final checkpoint
        ev = (out / "evaluator-0.log").read_text()
        assert re.search(r"evaluated ckpt-\d+ step 20 .* sha256 " + digests.pop(), ev), ev[-2000:]
    # Another call fetches nothing new (cursors in the directory).
    lg2 = cli("logs", inv, "-o", out, cwd=tmp_path)
    assert lg2.returncode == 0 and "chief-0@host-1: 0 new lines" in lg2.stderr, lg2.stderr

    d = cli("destroy", "-y", inv, cwd=tmp_path)
    assert d.returncode == 0, d.stdout + d.stderr
    nothing_left(sb, job, f"/opt/provision-examples/{example}")
    print(f"{example}: apply --wait took {took:.1f} s")


# --------------------------------------------------------------------------- containers

STANDIN = r"""#!/usr/bin/python3
# provision test stand-in for /usr/bin/docker: records each call's argv and the values of
# the variables named by -e, as this process received them from systemd's environment.
import json, os, sys, time
names = [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "-e"]
rec = {"argv": sys.argv, "env": {n: os.environ.get(n) for n in names}}
os.makedirs("/var/tmp/docker-standin", exist_ok=True)
with open("/var/tmp/docker-standin/%d-%d.json" % (time.time_ns(), os.getpid()), "w") as f:
    json.dump(rec, f)
if sys.argv[1:2] == ["run"]:
    print("stand-in: docker run " + sys.argv[sys.argv.index("--name") + 1], flush=True)
"""

HOSTILE = "a \"b\" $c ${d} `e` \\f %g #h 'i' ; & | > <\nsecond line\ttab \u00e9\u4e2d"
ARGS = ["--flag=$HOME", "%h %%", "two words", "'single'", '"double"', ";", "back\\slash", "", "--end"]


@pytest.fixture(scope="module")
def gpu_host(sandbox_factory):
    sb = sandbox_factory(hosts=1, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


def test_container_pool_runs_docker_with_exact_words_and_env(gpu_host, tmp_path):
    """What runs with `image:`: `docker run --rm --name provision-J-T --network host --gpus
    "device=…" -e VAR… IMAGE ARGS`, each variable's value passed through from systemd's
    environment. No Docker engine runs on the sandbox hosts (and no registry is reachable),
    so a stand-in at /usr/bin/docker records what it was given."""
    sb = gpu_host
    sh(
        sb,
        "host-1",
        f"cat > /usr/bin/docker <<'EOF'\n{STANDIN}EOF\nchmod 755 /usr/bin/docker; rm -rf /var/tmp/docker-standin",
    )
    job = "ctr"
    inv = sandbox.write_inventory(
        sb,
        tmp_path / "inv.yaml",
        job=job,
        pools={
            "chief": {
                "replicas": 1,
                "accelerators": 2,
                "image": "registry.local/trainer:1.4",
                "args": ARGS,
                "env": {"HOSTILE": HOSTILE},
            },
        },
        env={"EMPTY": "", "DOLLAR": "$$ $1 %% \\$"},
    )
    try:
        r = cli("apply", "-y", "--wait", "--timeout", "60", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        calls = sh(
            sb, "host-1", "for f in $(ls /var/tmp/docker-standin | sort); do cat /var/tmp/docker-standin/$f; echo; done"
        )
        calls = [json.loads(line) for line in calls.splitlines() if line.strip()]
        # (plan's `docker image inspect`: the stand-in answers nothing, so nothing is shipped)
        calls = [c for c in calls if c["argv"][1:3] != ["image", "inspect"]]
        # ExecStartPre removes a leftover container of the same name, then the run.
        assert [c["argv"][1:] for c in calls[:1]] == [["rm", "-f", f"provision-{job}-chief-0"]]
        run = calls[1]["argv"]
        env_file = sh(sb, "host-1", f"cat /etc/provision/{job}/chief-0.env")
        env = dict(parse_env(env_file))
        keys = list(env)
        expected = [
            "/usr/bin/docker",
            "run",
            "--rm",
            "--name",
            f"provision-{job}-chief-0",
            "--network",
            "host",
            "--gpus",
            '"device=0,1"',
        ]
        for k in keys:
            expected += ["-e", k]
        expected += ["registry.local/trainer:1.4", *ARGS]
        assert run == expected
        got = calls[1]["env"]
        assert got == env  # every -e variable, exactly as the env file says
        assert got["HOSTILE"] == HOSTILE and got["EMPTY"] == "" and got["DOLLAR"] == "$$ $1 %% \\$"
        assert "TF_CONFIG" not in got  # a one-task job gets none (cluster-env.md)
        assert json.loads(got["CLUSTER_SPEC"])["task"]["type"] == "workerpool0"
        assert got["CUDA_VISIBLE_DEVICES"] == "0,1"
        lg = cli("logs", inv, cwd=tmp_path)
        assert f"chief-0@host-1 | stand-in: docker run provision-{job}-chief-0" in lg.stdout
        st = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)
        assert st["phase"] == "Succeeded"
        d = cli("destroy", "-y", inv, cwd=tmp_path)
        assert d.returncode == 0, d.stdout + d.stderr
        nothing_left(sb, job, "/nonexistent")
    finally:
        sh(sb, "host-1", "rm -rf /usr/bin/docker /var/tmp/docker-standin")
