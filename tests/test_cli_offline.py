"""`provision validate` and `provision render` as a user runs them: exit codes, one line per
problem on stderr, never a traceback, and the rendered tree on disk with its modes."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from clirun import cli, run
from provision.cli.app import main

GOOD = """\
job: demo
hosts:
  - {name: gpu-1, address: 192.0.2.11, accelerators: {type: nvidia-h100, count: 8}}
  - {name: gpu-2, address: 192.0.2.12, accelerators: {type: nvidia-h100, count: 8}}
  - {name: cpu-1, address: 192.0.2.21}
pools:
  chief: {replicas: 1, accelerators: 4, command: [/opt/venv/bin/python, /opt/job/train.py]}
  worker: {replicas: 2, accelerators: 4, command: [/opt/venv/bin/python, /opt/job/train.py]}
  ps: {replicas: 1, command: [/opt/venv/bin/python, /opt/job/train.py]}
secret_env: [WANDB_API_KEY]
files:
  - {src: job/, dest: /opt/job/}
  - {src: run.sh, dest: /usr/local/bin/run-job}
"""

# Four independent mistakes on four lines.
BAD = """\
job: Demo
hosts:
  - {name: gpu-1, address: 192.0.2.11, accelerators: {type: nvidia-h100, count: 8}}
pools:
  chief: {replicas: 2, accelerators: 4, command: [/opt/venv/bin/python, /opt/job/train.py]}
  worker: {replicas: three, command: [/opt/venv/bin/python]}
env: {TF_CONFIG: x}
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text("print('hi')\n")
    (tmp_path / "job" / "__pycache__").mkdir()
    (tmp_path / "job" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "run.sh").write_text("#!/bin/sh\nexec /opt/venv/bin/python /opt/job/train.py\n")
    os.chmod(tmp_path / "run.sh", 0o755)
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "bad.yaml").write_text(BAD)
    return tmp_path


# --------------------------------------------------------------------------- validate


def test_validate_ok(project, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x")  # its secret_env: set, so nothing to warn of
    code, out, err = run("validate", "good.yaml", cwd=project)
    assert code == 0, err
    assert out.startswith(
        "good.yaml: valid; job demo: 4 tasks (chief 1, worker 2, ps 1) on 3 of 3 hosts, 12 accelerators placed"
    )
    assert err == ""


def test_validate_warns_of_what_this_machine_lacks(project, monkeypatch):
    """Valid (exit 0), with a warning per unset secret_env variable and missing identity
    file: line, key and what to do."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    text = (project / "good.yaml").read_text()
    (project / "keyed.yaml").write_text(text.replace("job: demo", "job: demo\nssh: {identity_file: ~/nope/id_x}", 1))
    code, out, err = run("validate", "keyed.yaml", cwd=project)
    assert code == 0, err
    lines = err.splitlines()
    assert any(
        re.fullmatch(
            r"Warning: keyed\.yaml:\d+: secret_env\[0\]: WANDB_API_KEY is not set in this shell; .*export WANDB_API_KEY=.*",
            l,
        )
        for l in lines
    ), err
    assert "Warning: keyed.yaml:2: ssh.identity_file: identity file not found: ~/nope/id_x (no such file)" in err


def test_validate_names_a_job_file(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("job: j\npools:\n  chief: {replicas: 1, command: [python3, x.py]}\n")
    code, _, err = run("validate", str(job), cwd=tmp_path)
    assert code == 1
    assert f"Error: {job}:1: (top level): missing required key 'hosts'" in err
    assert f"Hint: {job} has pools but no hosts: it is a job file. Run it on local sandbox hosts with " in err
    assert f"`provision sandbox up --from {job}`" in err


def test_h_is_help_everywhere_and_plurals(project):
    from provision.core.text import plural

    for args in (["-h"], ["validate", "-h"], ["logs", "-h"], ["sandbox", "up", "-h"]):
        code, out, _ = run(*args, cwd=project)
        assert code == 0 and out.startswith("Usage: "), args
    assert (plural(1, "file"), plural(2, "file"), plural(0, "host")) == ("1 file", "2 files", "0 hosts")


def test_validate_placement_table(project):
    code, out, _ = run("validate", "good.yaml", "--placement", cwd=project)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:]]
    assert rows[0] == ["TASK", "HOST", "ADDRESS", "ACCELERATORS"]
    assert rows[1:] == [
        ["chief-0", "gpu-1", "192.0.2.11:2222", "0,1,2,3"],
        ["worker-0", "gpu-2", "192.0.2.12:2222", "0,1,2,3"],
        ["worker-1", "gpu-1", "192.0.2.11:2223", "4,5,6,7"],
        ["ps-0", "cpu-1", "192.0.2.21:2222", "-"],
    ]


def test_validate_every_problem_one_line_each(project):
    code, out, err = run("validate", "bad.yaml", cwd=project)
    assert code == 1
    assert out == ""
    assert err.splitlines() == [
        "Error: bad.yaml:1: job: expected a DNS-1035 label (a-z, 0-9, '-', starting with a letter, at most 40 characters), got 'Demo'",
        "Error: bad.yaml:5: pools.chief.replicas: a job has at most one chief, got 2",
        "Error: bad.yaml:6: pools.worker.replicas: expected an integer from 0 to 100000, got 'three'",
        "Error: bad.yaml:7: env.TF_CONFIG: is set by provision for every task (see cluster-env) and cannot be overridden",
    ]


def test_validate_real_entry_point_no_traceback(project):
    """The console script itself: exit status 1, the same lines, no traceback."""
    p = cli("validate", "bad.yaml", cwd=project)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert len(p.stderr.splitlines()) == 4
    assert all(line.startswith("Error: bad.yaml:") for line in p.stderr.splitlines())


@pytest.mark.parametrize(
    "setup, message",
    [
        ("missing", "Error: inv.yaml: no such file"),
        ("not-utf8", "Error: inv.yaml: not UTF-8 text (invalid start byte at byte 9)"),
        ("empty", "Error: inv.yaml: (top level): expected a mapping with job, hosts and pools, got nothing (null)"),
        ("binary", "Error: inv.yaml: invalid YAML: unacceptable character #x007f: control characters are not allowed"),
        ("unreadable", "Error: inv.yaml: cannot read: Permission denied"),
    ],
)
def test_validate_unreadable_inputs_one_line(project, setup, message):
    f = project / "inv.yaml"
    if setup == "not-utf8":
        f.write_bytes(b"job: demo\xff\n")
    elif setup == "empty":
        f.write_text("")
    elif setup == "binary":
        f.write_bytes(b"\x7fELF\x02\x01\x01\x00")
    elif setup == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads every file")
        f.write_text(GOOD)
        f.chmod(0)
    p = cli("validate", "inv.yaml", cwd=project)
    assert (p.returncode, p.stdout, p.stderr) == (1, "", message + "\n")


def test_validate_directory_one_line(project):
    (project / "inv.yaml").mkdir()
    p = cli("validate", "inv.yaml", cwd=project)
    assert (p.returncode, p.stderr) == (1, "Error: inv.yaml: is a directory, expected an inventory YAML file\n")


@pytest.mark.parametrize("args", [["validate"], ["render", "good.yaml"], ["validate", "good.yaml", "--bogus"]])
def test_usage_errors_exit_1_not_2(project, args):
    """Exit 2 means 'plan found changes' (interface.md): usage errors must not use it."""
    p = cli(*args, cwd=project)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr


# --------------------------------------------------------------------------- render


def _tree(root: Path) -> dict[str, int]:
    return {
        "/" + p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_render_tree_paths_and_modes(project):
    code, out, err = run("render", "good.yaml", "-o", "out", cwd=project)
    assert code == 0, err
    assert out.splitlines()[-1] == "Wrote 20 files for 3 hosts under out/"
    root = project / "out"
    assert sorted(p.name for p in root.iterdir()) == ["cpu-1", "gpu-1", "gpu-2"]
    gpu1 = _tree(root / "gpu-1")
    assert gpu1 == {
        "/etc/provision/demo/chief-0.env": 0o600,
        "/etc/provision/demo/manifest.json": 0o600,
        "/etc/provision/demo/worker-1.env": 0o600,
        "/etc/systemd/system/provision-demo-chief-0.service": 0o644,
        "/etc/systemd/system/provision-demo-worker-1.service": 0o644,
        "/etc/systemd/system/provision-demo.target": 0o644,
        "/opt/job/train.py": 0o644,  # __pycache__ left out
        "/usr/local/bin/run-job": 0o755,  # executable bit kept
    }
    assert set(_tree(root / "cpu-1")) == {
        "/etc/provision/demo/ps-0.env",
        "/etc/provision/demo/manifest.json",
        "/etc/systemd/system/provision-demo-ps-0.service",
        "/etc/systemd/system/provision-demo.target",
        "/opt/job/train.py",
        "/usr/local/bin/run-job",
    }
    assert (root / "gpu-1/opt/job/train.py").read_text() == "print('hi')\n"
    manifest = json.loads((root / "gpu-1/etc/provision/demo/manifest.json").read_text())
    assert sorted(manifest["tasks"]) == ["chief-0", "worker-1"]
    assert manifest["tasks"]["chief-0"]["accelerators"] == [0, 1, 2, 3]
    env = (root / "gpu-1/etc/provision/demo/chief-0.env").read_text()
    assert "WANDB_API_KEY" not in env  # secret_env values are never rendered offline
    unit = (root / "gpu-1/etc/systemd/system/provision-demo-chief-0.service").read_text()
    assert "EnvironmentFile=/etc/provision/demo/chief-0.env\n" in unit
    assert 'ExecStart=/opt/venv/bin/python "/opt/job/train.py"\n' in unit


def test_render_twice_is_identical(project):
    run("render", "good.yaml", "-o", "a", cwd=project)
    run("render", "good.yaml", "-o", "b", cwd=project)
    a, b = project / "a", project / "b"
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_render_invalid_inventory_writes_nothing(project):
    code, _, err = run("render", "bad.yaml", "-o", "out", cwd=project)
    assert code == 1
    assert len(err.splitlines()) == 4
    assert not (project / "out").exists()


def test_render_unwritable_output_one_line(project):
    (project / "blocker").write_text("")
    p = cli("render", "good.yaml", "-o", "blocker/sub", cwd=project)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert len(p.stderr.splitlines()) == 1
    assert p.stderr.startswith("Error: blocker/sub: cannot write: Not a directory")


def _console(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """provision as its console script runs it (cli.app.run: no interpreter teardown)."""
    return cli(*args, cwd=cwd, env={"COLUMNS": "80", "NO_COLOR": "1"})


def test_the_console_script_keeps_exit_codes_and_every_byte_it_printed(tmp_path):
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "bad.yaml").write_text(BAD)
    (tmp_path / "job").mkdir()
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    ok = _console("validate", "good.yaml", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = _console("validate", "bad.yaml", cwd=tmp_path)
    assert bad.returncode == 1 and bad.stderr.count("Error:") >= 4 and "Traceback" not in bad.stderr
    usage = _console("plan", cwd=tmp_path)  # click's usage error: 1, not its 2 (2 = changes)
    assert usage.returncode == 1 and "Usage:" in usage.stderr
    # What it prints arrives whole through a pipe although the process skips its teardown:
    # the same bytes as the command run in-process.
    for args in (["--version"], ["validate", str(tmp_path / "good.yaml")]):
        in_process = CliRunner().invoke(
            main, args, prog_name="provision", catch_exceptions=False, env={"NO_COLOR": "1"}
        )
        console = _console(*args, cwd=tmp_path)
        assert console.stdout == in_process.stdout and console.stdout


def test_the_console_script_ends_quietly_when_its_reader_goes(tmp_path):
    """`provision render --help | head -1`: the reader leaves early; no traceback, exit 1."""
    p = subprocess.Popen(
        [sys.executable, "-m", "provision", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # nobody reads: the flush at exit meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) in (0, 1) and "Traceback" not in err
