"""item 1: a setup is done once per host for everyone who needs the same one, on
real sandbox hosts: a study's trials, a variant of a job and a teammate's job share one run
(counted on the hosts: the setup appends a line to a file); it goes with the last job using
it (a study's, when the study is destroyed); a failed run is not reused.

Two hosts with 2 (stand-in) GPUs each, shared by the module. Each test destroys what it applied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clirun import cli, ok, sh

pytestmark = pytest.mark.integration

HOSTS = ("host-1", "host-2")
LONG = ["/bin/sh", "-c", "exec sleep 600"]
TRAINER = Path(__file__).resolve().parents[1] / "fixtures" / "tune" / "trainer.py"


@pytest.fixture(scope="module")
def two(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


def runs(sb, count: str) -> list[int]:
    """How many times the setup ran on each host (the lines it appended to `count`)."""
    return [int(sh(sb, h, f"cat {count} 2>/dev/null | wc -l").strip()) for h in HOSTS]


def setup_there(sb) -> list[bool]:
    """Each host has a shared setup: its unit file (and its directory of script and env)."""
    return [sh(sb, h, "ls /etc/systemd/system/ | grep -c '^provision-setup-'").strip() != "0" for h in HOSTS]


def job(sb, make, d: Path, name: str, setup: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    inv = d / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "hosts": ["host-1"], "command": LONG},
        "worker": {"replicas": 1, "hosts": ["host-2"], "command": LONG},
    }
    make(sb, job=name, pools=pools, path=inv, setup=setup)
    return inv


def test_a_variant_and_a_teammates_job_share_the_setup_until_the_last_one_leaves(two, sandbox_inventory, tmp_path):
    count = "/var/tmp/sshare-runs"
    setup = {"commands": [f"echo ran >> {count}"], "env": {"PIP_NO_INDEX": "1"}}
    a = job(two, sandbox_inventory, tmp_path / "a", "sshare-a", setup)
    b = job(two, sandbox_inventory, tmp_path / "b", "sshare-b", setup)  # a variant: another name
    c = job(two, sandbox_inventory, tmp_path / "c", "sshare-c", setup)  # a teammate's, own state
    teammate = {"PROVISION_OWNER": "bo@lab"}
    try:
        assert "setup: run (new)" in ok(cli("apply", "-y", a, cwd=a.parent)).stdout
        assert runs(two, count) == [1, 1]
        plan = ok(cli("plan", b, cwd=b.parent)).stdout
        assert "= setup: done on this host, shared with 1 other job (sshare-a) (not run again)" in plan, plan
        said = json.loads(ok(cli("plan", "--json", b, cwd=b.parent)).stdout)["hosts"]["host-1"]["setup"]
        assert said == {"run": False, "done": "done on this host, shared with 1 other job (sshare-a)"}
        ok(cli("apply", "-y", b, cwd=b.parent))
        assert "setup: run" not in ok(cli("apply", "-y", c, cwd=c.parent, env=teammate)).stdout
        assert runs(two, count) == [1, 1]
        # Destroyed one after the other: the setup stays while a job uses it, not after.
        for inv, left in ((a, True), (c, True), (b, False)):
            ok(cli("destroy", "-y", inv, cwd=inv.parent, env=teammate if inv is c else None))
            assert setup_there(two) == [left, left], inv
        for h in HOSTS:
            assert sh(two, h, "ls -A /var/lib/provision/.setups /etc/provision/.setups 2>/dev/null").strip() == ""
        # Removed with its last user: the next job with it runs it again.
        ok(cli("apply", "-y", a, cwd=a.parent))
        assert runs(two, count) == [2, 2]
    finally:
        for inv in (a, b, c):
            cli("destroy", "-y", inv, cwd=inv.parent, env=teammate if inv is c else None)
        for h in HOSTS:
            sh(two, h, f"rm -f {count}")


def test_a_failed_setup_is_run_again_by_the_next_job(two, sandbox_inventory, tmp_path):
    count, flag = "/var/tmp/sshare-fail-runs", "/var/tmp/sshare-fixed"
    setup = {"commands": [f"echo try >> {count}", f"test -e {flag}"]}
    a = job(two, sandbox_inventory, tmp_path / "a", "sshare-fa", setup)
    b = job(two, sandbox_inventory, tmp_path / "b", "sshare-fb", setup)
    try:
        r = cli("apply", "-y", a, cwd=a.parent)
        assert r.returncode == 1 and "setup failed (exit code 1)" in r.stderr, r.stdout + r.stderr
        assert runs(two, count) == [1, 1]
        for h in HOSTS:
            sh(two, h, f"touch {flag}", check=True)
        assert "setup: run (new)" in ok(cli("apply", "-y", b, cwd=b.parent)).stdout
        assert runs(two, count) == [2, 2]
        # ... and the job whose run failed takes the result now.
        assert "setup: run" not in ok(cli("apply", "-y", a, cwd=a.parent)).stdout
        assert runs(two, count) == [2, 2]
    finally:
        for inv in (a, b):
            cli("destroy", "-y", inv, cwd=inv.parent)
        for h in HOSTS:
            sh(two, h, f"rm -f {count} {flag}")


def test_a_studys_trials_run_their_setup_once_per_host(two, sandbox_inventory, tmp_path):
    study, count = "sshare-study", "/var/tmp/sshare-study-runs"
    shutil.copy(TRAINER, tmp_path / "trainer.py")
    inv = tmp_path / "study.yaml"
    sandbox_inventory(
        two,
        job=study,
        path=inv,
        hosts=list(HOSTS),
        files=[{"src": "trainer.py", "dest": f"/opt/{study}/trainer.py"}],
        setup={"commands": [f"echo ran >> {count}"]},
        pools={
            "chief": {
                "replicas": 1,
                "accelerators": 1,
                "command": ["python3", f"/opt/{study}/trainer.py", "--steps=2", "--step_seconds=0.2"],
            }
        },
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
            "algorithm": "random",
            "max_trials": 8,
            "parallel_trials": 4,
        },
    )
    try:
        ok(cli("tune", "--poll", "0.3", inv, cwd=tmp_path, timeout=600))
        trials = json.loads(ok(cli("tune", "--status", "--json", inv, cwd=tmp_path)).stdout)["trials"]
        assert len(trials) == 8, trials
        assert runs(two, count) == [1, 1]  # 8 trials on 4 GPUs of 2 hosts: one run per host
        # The trials are gone; the study holds their setup until it is destroyed.
        assert setup_there(two) == [True, True]
        out = ok(cli("destroy", "-y", inv, cwd=tmp_path)).stdout
        assert f"/var/lib/provision/.setups/holds/{study} (destroy)" in out, out
        assert setup_there(two) == [False, False]
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        for h in HOSTS:
            sh(two, h, f"rm -f {count}")
