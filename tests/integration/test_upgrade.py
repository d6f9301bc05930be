"""Upgrading provision does not restart training: a job applied by the
previous release (its source as committed, taken from this repository's history) is applied
again by this version, and neither its setup nor its tasks run again.

PREVIOUS is the last release before this round's work; move it forward when a release
lands. A change that fails this test changes what is on the hosts for running jobs: keep
the files valid across versions, or migrate them in place without a restart."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from clirun import cli, ok, sh, status, wait_until

pytestmark = pytest.mark.integration

PREVIOUS = "1a5e7ca"  # main before this round (tuning round 1 landed)
REPO = Path(__file__).resolve().parents[2]


def _previous_release(dest: Path) -> Path:
    """The previous release's src/ and templates/, unpacked from git (no work tree touched)."""
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", PREVIOUS + "^{commit}"], capture_output=True)
    assert have.returncode == 0, f"commit {PREVIOUS} is not in this clone's history: a full clone is needed"
    tar = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS, "src", "templates"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    return dest / "src"


def test_an_upgrade_restarts_no_task_and_runs_no_setup_again(sandbox3, sandbox_inventory, tmp_path):
    old_src = _previous_release(tmp_path / "previous")
    old = {"PYTHONPATH": str(old_src)}
    job = "upgrade"
    (tmp_path / "train.sh").write_text('echo "$PROVISION_TASK started"; exec sleep 600\n')
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job=job,
        path=inv,
        hosts=["host-1", "host-2"],
        files=[{"src": "train.sh", "dest": f"/opt/{job}/train.sh"}],
        setup={"commands": [f"echo ran >> /var/tmp/{job}-setup-runs"]},
        outputs=f"/var/tmp/{job}-outputs",  # its unit's lines changed this round
        pools={
            "chief": {"replicas": 1, "command": ["/bin/sh", f"/opt/{job}/train.sh"]},
            "worker": {"replicas": 1, "command": ["/bin/sh", f"/opt/{job}/train.sh"]},
        },
    )
    version = ok(cli("--version", cwd=tmp_path, env=old)).stdout
    ok(cli("apply", "-y", inv, cwd=tmp_path, env=old))
    wait_until(lambda: status(tmp_path, inv)["phase"] == "Running", timeout=60, what="the job running")
    pids = _main_pids(sandbox3, job)
    assert len(pids) == 2, pids

    plan = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)  # this version
    ok(cli("apply", "-y", inv, cwd=tmp_path))
    assert _main_pids(sandbox3, job) == pids, f"a task was restarted by the upgrade from {version}:\n{plan.stdout}"
    for host in ("host-1", "host-2"):
        runs = sh(sandbox3, host, f"cat /var/tmp/{job}-setup-runs")
        assert runs.count("ran") == 1, f"{host}: the setup ran again after the upgrade: {runs!r}\n{plan.stdout}"
    assert plan.returncode in (0, 2), plan.stdout + plan.stderr
    # Converged: this version's files are on the hosts now, and the next plan is empty.
    again = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    ok(cli("destroy", "-y", inv, cwd=tmp_path))


def _main_pids(sb, job: str) -> dict[str, str]:
    """(host, task) -> the task's main process, wherever placement put it."""
    out = {}
    for host in ("host-1", "host-2"):
        for task in ("chief-0", "worker-0"):
            got = sh(sb, host, f"systemctl show -p MainPID --value provision-{job}-{task}.service").strip()
            if got and got != "0":
                out[f"{host} {task}"] = got
    return out
