"""`setup:` on real sandbox hosts: runs once per host and change, before the tasks;
builds a venv from a pushed wheel directory (no internet); a failing setup starts nothing."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from clirun import cli, ok, sh

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]
COUNT = "/var/tmp/setup-runs"


@pytest.fixture(scope="module")
def two(sandbox3):
    """host-1 and host-2 of the session's sandbox3: inventories list these two only."""
    return dataclasses.replace(sandbox3, hosts=sandbox3.hosts[:2])


def runs(sb, host: str) -> int:
    return int(sb.docker_exec(host, ["/bin/sh", "-c", f"cat {COUNT} 2>/dev/null | wc -l"])[1].strip())


def setup_plan(inv: Path) -> dict[str, str | None]:
    r = cli("plan", "--json", inv, cwd=inv.parent)
    assert r.returncode in (0, 2), r.stdout + r.stderr
    return {n: (h["setup"] or {}).get("why") for n, h in json.loads(r.stdout)["hosts"].items()}


def test_setup_runs_once_per_change_and_when_forced(two, sandbox_inventory, tmp_path):
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 1, "command": LONG}}
    inv = tmp_path / "inv.yaml"

    def write(marker: str) -> None:
        setup = {"commands": [f'echo "$MARK" >> {COUNT}', "test -d /etc/provision"], "env": {"MARK": marker}}
        sandbox_inventory(two, job="setup", pools=pools, path=inv, setup=setup)

    write("one")
    try:
        assert setup_plan(inv) == {"host-1": "new", "host-2": "new"}
        r = ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert "setup: run (new)" in r.stdout
        assert [runs(two, h) for h in ("host-1", "host-2")] == [1, 1]
        # No-op apply: nothing runs again.
        assert "No changes" in ok(cli("apply", "-y", inv, cwd=tmp_path)).stdout
        assert [runs(two, h) for h in ("host-1", "host-2")] == [1, 1]
        # Changed: runs again, and the tasks restart with it.
        pid = two.docker_exec("host-1", "systemctl show -p MainPID --value provision-setup-chief-0")[1].strip()
        write("two")
        assert setup_plan(inv) == {"host-1": "changed", "host-2": "changed"}
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert [runs(two, h) for h in ("host-1", "host-2")] == [2, 2]
        assert two.docker_exec("host-1", "systemctl show -p MainPID --value provision-setup-chief-0")[1].strip() != pid
        # Forced.
        ok(cli("apply", "-y", "--force-setup", inv, cwd=tmp_path))
        assert [runs(two, h) for h in ("host-1", "host-2")] == [3, 3]
        # Its output is in journald (the unit's identifier).
        units = sh(two, "host-1", "ls /etc/systemd/system | grep -E '^provision-setup-[0-9a-f]{32}[.]service$'")
        ident = units.strip().split(".")[0]  # the setup's (the job is named "setup": its tasks' start so too)
        out = two.docker_exec("host-1", f"journalctl -t {ident} -o cat --no-pager")[1]
        assert "test -d" not in out  # the commands are not echoed; their output would be
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        for h in ("host-1", "host-2"):
            two.docker_exec(h, f"rm -f {COUNT}")


def _wheel(d: Path) -> Path:
    """A tiny pure-Python wheel, made by hand (no build backend, no network)."""
    name, ver = "hello_provision", "1.0"
    files = {
        f"{name}/__init__.py": b"GREETING = 'hello from the setup venv'\n",
        f"{name}-{ver}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n".encode(),
        f"{name}-{ver}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: provision-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}\n"
        for p, b in files.items()
    )
    record += f"{name}-{ver}.dist-info/RECORD,,\n"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
        z.writestr(f"{name}-{ver}.dist-info/RECORD", record)
    return path


def test_setup_builds_a_venv_from_pushed_wheels_and_the_task_imports_it(two, sandbox_inventory, tmp_path):
    _wheel(tmp_path / "wheels")
    venv = "/opt/venvs/hello"
    script = "import hello_provision, sys; print(hello_provision.GREETING, sys.prefix)"
    pools = {"chief": {"replicas": 1, "command": [f"{venv}/bin/python", "-c", script]}}
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        two,
        job="venv",
        pools=pools,
        path=inv,
        hosts=["host-1"],
        files=[{"src": "wheels/", "dest": "/opt/hello/wheels/"}],
        setup={
            "commands": [
                f"python3 -m venv {venv}",
                f"{venv}/bin/pip install --no-index --find-links /opt/hello/wheels hello_provision",
            ],
            "env": {"PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        },
    )
    try:
        # --wait --logs: the setup's output as it runs, then the task's.
        a = ok(cli("apply", "-y", "--wait", "--logs", "--timeout", "240", inv, cwd=tmp_path, timeout=300))
        assert "setup@host-1 | Looking in links: /opt/hello/wheels" in a.stdout, a.stdout
        assert "setup@host-1 | Successfully installed hello" in a.stdout, a.stdout
        assert a.stdout.index("setup@host-1 |") < a.stdout.index("hello from the setup venv"), a.stdout
        out = ok(cli("logs", inv, cwd=tmp_path)).stdout
        assert f"hello from the setup venv {venv}" in out
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        two.docker_exec("host-1", f"rm -rf {venv}")


def test_a_failing_setup_names_host_and_code_and_starts_nothing(two, sandbox_inventory, tmp_path):
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 1, "command": LONG}}
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        two,
        job="badsetup",
        pools=pools,
        path=inv,
        setup={"commands": ["echo preparing the environment", "echo it broke >&2", "exit 7"]},
    )
    try:
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        err = r.stderr
        assert "host-1" in err and "host-2" in err and "setup failed (exit code 7)" in err, err
        assert "it broke" in err and "Traceback" not in err
        for h in ("host-1", "host-2"):
            states = two.docker_exec(h, "systemctl show -p ActiveState --value 'provision-badsetup-*-0'")[1]
            assert "active" not in states.replace("inactive", ""), (h, states)
        assert setup_plan(inv) == {"host-1": "new", "host-2": "new"}  # not recorded as done
        out = ok(cli("logs", "--setup", inv, cwd=tmp_path)).stdout
        assert "setup@host-1 | preparing the environment" in out and "setup@host-2 | it broke" in out
        # status says why nothing started, not only "not started".
        st = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)
        why = "setup failed: exit code 7 (provision logs --setup shows its output)"
        assert st["phase"] == "Pending" and st["reason"] == "setup failed on host-1, host-2: " + why[14:], st
        assert {t["detail"] for t in st["tasks"]} == {why}, st
        # ... with the setup's last lines, in status and in wait, which ends.
        lines = st["setup_lines"]["host-1"]
        assert "preparing the environment" in lines and lines[-1].endswith("it broke"), st
        text = ok(cli("status", inv, cwd=tmp_path)).stdout
        assert "setup@host-1 failed, last lines" in text and "  | it broke" in text, text
        w = cli("wait", "--timeout", "60", inv, cwd=tmp_path)
        assert w.returncode == 1 and "setup@host-2 failed, last lines" in w.stderr, w.stderr
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_destroy_ends_a_setup_its_interrupted_apply_left_running(two, sandbox_inventory, tmp_path):
    """item 11: an apply killed while its setup runs left the setup unit running
    (as root) after `destroy -y` said "Destroy complete!"."""
    import signal
    import subprocess
    import sys

    from clirun import sh, wait_until
    from provision.inventory.inventory import parse
    from provision.render.files import render

    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        two,
        job="setuphang",
        pools={"chief": {"replicas": 1, "hosts": ["host-1"], "command": LONG}},
        path=inv,
        setup={"commands": ["exec sleep 100000"]},
    )
    rendered = render(parse(inv.read_text(), inv))
    unit = rendered.hosts["host-1"].setup.unit
    p = subprocess.Popen(
        [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: sh(two, "host-1", f"systemctl is-active {unit}").strip() == "activating", 120, what="setup")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    ok(cli("destroy", "-y", inv, cwd=tmp_path))
    assert sh(two, "host-1", f"systemctl is-active {unit}").strip() in ("inactive", "unknown")
    assert "sleep 100000" not in sh(two, "host-1", "ps -eo args")


def test_a_hanging_setup_is_bounded_shows_progress_and_one_ctrl_c_ends_the_wait(two, sandbox_inventory, tmp_path):
    """item 16: TimeoutStartSec=infinity, nothing printed after "setup running",
    and the first Ctrl-C swallowed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from clirun import output_until

    pools = {"chief": {"replicas": 1, "command": LONG}}
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(two, job="hang", pools=pools, path=inv, setup={"commands": ["sleep 100000"], "timeout": 4})
    try:
        t0 = time.monotonic()
        r = cli("apply", "-y", inv, cwd=tmp_path, env={"PROVISION_SETUP_TICK": "1"})
        assert r.returncode == 1, r.stdout + r.stderr
        assert "timed out: it ran longer than its setup.timeout" in r.stderr, r.stderr
        assert "setup still running" in r.stdout + r.stderr  # progress while it ran
        assert time.monotonic() - t0 < 120
        # Without a bound that ends it soon, one Ctrl-C ends the apply at once.
        sandbox_inventory(two, job="hang", pools=pools, path=inv, setup={"commands": ["sleep 100000"], "timeout": 3600})
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PROVISION_SETUP_TICK": "1"},
        )
        output_until(p, "setup running", 120)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)  # one Ctrl-C, no second
        assert p.returncode == 130 and "Interrupted" in err, (p.returncode, out, err)
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_no_warning_for_a_program_the_setup_makes(two, sandbox_inventory, tmp_path):
    """item 5: plan warned `... no such file on the host; systemd would fail to
    start it (exit status 203/EXEC)` for the interpreter the job's own setup creates."""
    venv = "/opt/venvs/made-by-setup"
    pools = {"chief": {"replicas": 1, "command": [f"{venv}/bin/python", "-c", "import time; time.sleep(600)"]}}
    inv = tmp_path / "inv.yaml"
    setup = {"commands": [f"mkdir -p {venv}/bin", f"ln -sf /usr/bin/python3 {venv}/bin/python"]}
    sandbox_inventory(two, job="venv", pools=pools, path=inv, setup=setup)
    try:
        p = cli("plan", inv, cwd=tmp_path)
        assert p.returncode == 0 and "203/EXEC" not in p.stderr and "Warning" not in p.stderr, p.stdout + p.stderr
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0 and "Warning" not in r.stderr, r.stdout + r.stderr
        assert (
            sh(two, "host-1", "systemctl is-active provision-venv-chief-0").strip() == "active"
            or sh(two, "host-2", "systemctl is-active provision-venv-chief-0").strip() == "active"
        )
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        for h in ("host-1", "host-2"):
            sh(two, h, f"rm -rf {venv}")


def test_setup_runs_again_for_its_inputs_not_for_the_code(two, sandbox_inventory, tmp_path):
    """item 4: any edit to train.py re-ran setup; now only its named inputs do."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text("print('one')\n")
    (job / "requirements.txt").write_text("numpy\n")
    pools = {"chief": {"replicas": 1, "command": LONG}}
    inv = tmp_path / "inv.yaml"
    setup = {"commands": [f"echo run >> {COUNT}"], "inputs": ["/opt/setupjob/requirements.txt"]}
    files = [{"src": "job/", "dest": "/opt/setupjob/"}]
    sandbox_inventory(two, job="inputs", pools=pools, path=inv, setup=setup, files=files, hosts=["host-1"])
    try:
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert runs(two, "host-1") == 1
        (job / "train.py").write_text("print('two')\n")
        assert setup_plan(inv) == {"host-1": None}  # the code changed, not the setup's inputs
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert runs(two, "host-1") == 1
        (job / "requirements.txt").write_text("numpy\ntorch\n")
        assert setup_plan(inv) == {"host-1": "changed"}
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert runs(two, "host-1") == 2
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        two.docker_exec("host-1", f"rm -f {COUNT}")
