"""Run-time UX on sandbox hosts: why a task ended (a missing program, from plan to wait),
`logs --follow` that ends with the job in time order, progress lines when not a terminal,
Ctrl-C's 130, and `provision exec`."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from clirun import cli, first_output, wait_until

pytestmark = pytest.mark.integration

MISSING = "/opt/venv/bin/torchrun"
REASON = f"the program could not be started: {MISSING}: No such file or directory (exit status 203/EXEC)"


def steps(n: int, pause: float) -> list[str]:
    return ["/bin/sh", "-c", f'for i in $(seq 1 {n}); do echo "step $i of $PROVISION_TASK"; sleep {pause}; done']


def test_missing_program_is_named_by_plan_apply_status_logs_and_wait(sandbox3, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job="ux-missing",
        path=inv,
        pools={
            "chief": {"replicas": 1, "hosts": ["host-1"], "command": [MISSING, "train.py"]},
            "worker": {"replicas": 1, "hosts": ["host-2"], "command": ["/bin/sh", "-c", "exec sleep 600"]},
        },
    )
    try:
        # plan warns (and does not refuse).
        p = cli("plan", inv, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert f"Warning: pools.chief.command[0]: {MISSING} (chief-0 on host-1): no such file on the host" in p.stderr

        # apply --wait: the start fails; the error says why, with the path, and names the task.
        a = cli("apply", "-y", "--wait", "--timeout", "60", inv, cwd=tmp_path)
        assert a.returncode == 1, a.stdout + a.stderr
        assert f"chief-0 did not start: {REASON}; see `provision logs inv.yaml chief-0`" in a.stderr
        assert "TASK`" not in a.stderr and "Job for provision-" not in a.stderr  # no systemctl boilerplate

        # status: the reason in DETAIL and in the job's reason; the journal's last lines below.
        s = cli("status", inv, cwd=tmp_path)
        assert s.returncode == 0, s.stderr
        assert f"Job ux-missing: Failed (chief-0 on host-1 failed: {REASON})" in s.stdout
        assert f"chief-0@host-1, last lines (all of them: provision logs {inv} chief-0):" in s.stdout
        assert re.search(rf"\| \[systemd\] .*{re.escape(MISSING)}: No such file or directory", s.stdout), s.stdout
        j = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)
        chief = next(t for t in j["tasks"] if t["task"] == "chief-0")
        assert (chief["state"], chief["exit_code"], chief["detail"]) == ("Failed", 203, REASON)
        assert any(MISSING in line for line in chief["last_lines"])
        assert dt.datetime.strptime(chief["ended_at"], "%Y-%m-%dT%H:%M:%SZ")

        # logs: systemd's lines about the unit, labelled.
        lg = cli("logs", inv, "chief-0", cwd=tmp_path)
        assert lg.returncode == 0, lg.stderr
        assert re.search(rf"chief-0@host-1 \| \[systemd\] .*{re.escape(MISSING)}: No such file or directory", lg.stdout)
        assert "[systemd] Main process exited, code=exited, status=203/EXEC" in lg.stdout

        # wait: exit 1, the reason, and the last lines.
        w = cli("wait", inv, cwd=tmp_path)
        assert w.returncode == 1
        assert f"job Failed: chief-0 on host-1 failed: {REASON}" in w.stderr
        assert "chief-0@host-1, last lines" in w.stderr

        # logs --follow on a job that has ended: the lines, then the job's outcome at once.
        t0 = time.monotonic()
        f = cli("logs", "-f", "--tail", "2", inv, cwd=tmp_path, timeout=60)
        assert f.returncode == 1, f.stderr
        assert f"job Failed: chief-0 on host-1 failed: {REASON}" in f.stderr
        assert time.monotonic() - t0 < 30
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_follow_prints_the_tail_then_new_lines_in_time_order_and_ends_with_the_job(
    sandbox3, sandbox_inventory, tmp_path
):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job="ux-follow",
        path=inv,
        pools={
            "chief": {"replicas": 1, "hosts": ["host-1"], "command": steps(40, 0.2)},
            "worker": {"replicas": 2, "hosts": ["host-2", "host-3"], "command": steps(40, 0.2)},
        },
    )
    try:
        assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
        wait_until(
            lambda: "step 5 of worker-1" in cli("logs", inv, cwd=tmp_path).stdout,
            30,
            what="worker-1's step 5 in the logs",
        )
        t0 = time.monotonic()
        f = cli("logs", "-f", "--tail", "3", "--timestamps", inv, cwd=tmp_path, timeout=120)
        took = time.monotonic() - t0
        assert f.returncode == 0, f.stderr
        assert "job Succeeded: chief-0 exited 0" in f.stderr
        assert took < 30  # it ended with the job (40 x 0.2 s), not at a timeout
        lines = [l for l in f.stdout.splitlines() if " | " in l]
        stamps = [l.split(" ", 1)[0] for l in lines]
        assert stamps == sorted(stamps), "out of time order:\n" + f.stdout
        for task in ("chief-0", "worker-0", "worker-1"):
            mine = [int(m.group(1)) for l in lines if (m := re.search(rf"\| step (\d+) of {task}$", l))]
            # Exactly the last 3 of what was there, then every new line once, to the end.
            assert mine == list(range(mine[0], 41)), f"{task}: {mine}"
            assert mine[0] > 1
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_progress_lines_when_not_a_terminal_and_wait_logs(sandbox3, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"

    def inventory(chief: list[str]) -> None:
        sandbox_inventory(
            sandbox3,
            job="ux-progress",
            path=inv,
            pools={
                "chief": {"replicas": 1, "hosts": ["host-1"], "command": chief},
                "worker": {"replicas": 1, "hosts": ["host-2"], "command": ["/bin/sh", "-c", "sleep 3; exit 0"]},
            },
        )

    inventory(steps(18, 1))
    try:
        a = cli("apply", "-y", "--wait", inv, cwd=tmp_path)
        assert a.returncode == 0, a.stderr
        err = a.stderr.splitlines()
        assert "[0s] job Running" in err
        assert "[0s] chief-0@host-1 Running" in err
        assert any(re.fullmatch(r"\[\d+s\] worker-0@host-2 Succeeded: exited 0", l) for l in err), a.stderr
        # Nothing changed for 10 s: a summary line says the job is alive.
        assert any(re.fullmatch(r"\[\d+s\] job Running: .*1 Running.*", l) for l in err), a.stderr
        assert any(re.fullmatch(r"\[\d+s\] job Succeeded: chief-0 exited 0", l) for l in err), a.stderr

        # --logs: this run's output on stdout while waiting (a shorter run: the first's 18
        # lines would show as extra ones); progress on stderr.
        inventory(steps(5, 0.2))
        r = cli("apply", "-y", "--rerun", "--wait", "--logs", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        out = [l for l in r.stdout.splitlines() if " | " in l]
        chief = [l.split(" | ", 1)[1] for l in out if l.startswith("chief-0@host-1")]
        assert chief == [f"step {i} of chief-0" for i in range(1, 6)], r.stdout
        assert "job Succeeded: chief-0 exited 0" in r.stderr
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_ctrl_c_exits_130_in_logs_follow_and_wait(sandbox3, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job="ux-ctrlc",
        path=inv,
        pools={
            "chief": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", "echo started; exec sleep 600"]}
        },
    )
    try:
        assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
        for args in (["logs", "-f"], ["wait"], ["status", "--watch"]):
            p = subprocess.Popen(
                [sys.executable, "-m", "provision", *args, str(inv)],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
            first_output(p)  # under way: the chief's line (logs), progress (wait), the table (status)
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=30)
            assert p.returncode == 130, (args, err)
            assert "Interrupted." in err and "Traceback" not in err, (args, err)
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_exec_runs_in_the_task_environment_and_passes_the_exit_code(sandbox3, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job="ux-exec",
        path=inv,
        ssh={"connect_timeout": 4},  # the paused host below costs this, not the default 10 s
        env={"GREETING": 'hello "there" $HOME'},
        pools={
            "chief": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", "exec sleep 600"]},
            "worker": {"replicas": 1, "hosts": ["host-2"], "command": ["/bin/sh", "-c", "exec sleep 600"]},
        },
    )
    try:
        r = cli("exec", inv, "worker-0", "--", "true", cwd=tmp_path)
        assert r.returncode == 1 and "is the job applied?" in r.stderr, r.stderr
        assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
        r = cli("exec", inv, "worker-0", "--", "printenv", "GREETING", "PROVISION_TASK", "TF_CONFIG", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        greeting, task, tf_config = r.stdout.splitlines()
        assert (greeting, task) == ('hello "there" $HOME', "worker-0")
        assert json.loads(tf_config)["task"] == {"type": "worker", "index": 0}
        # Output streamed to the right streams, the exit code passed through, words kept whole.
        r = cli(
            "exec", inv, "chief-0", "--", "sh", "-c", 'echo "out $1"; echo err >&2; exit 42', "-", "a b", cwd=tmp_path
        )
        assert (r.returncode, r.stdout, r.stderr) == (42, "out a b\n", "err\n")
        assert cli("exec", inv, "chief-0", "--", "false", cwd=tmp_path).returncode == 1
        assert "no task named nope" in cli("exec", inv, "nope", "--", "true", cwd=tmp_path).stderr
        # ssh reaches the same host as provision does (known host keys, key, port).
        r = cli("ssh", inv, "worker-0", "--", "cat", "/etc/hostname", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == sandbox3.docker_exec("host-2", ["cat", "/etc/hostname"])[1].strip()
        # ... in the task's environment, its words passed as given.
        r = cli("ssh", inv, "worker-0", "--", "printenv", "PROVISION_TASK", cwd=tmp_path)
        assert (r.returncode, r.stdout) == (0, "worker-0\n"), r.stderr
        r = cli("ssh", inv, "chief-0", "--", "printf", "%s\\n", "a b", "$(id -un)", cwd=tmp_path)
        assert (r.returncode, r.stdout) == (0, "a b\n$(id -un)\n"), r.stdout + r.stderr
        # exec: a word that is not UTF-8 arrives as its bytes; no traceback anywhere.
        env = {**os.environ}
        p = subprocess.run(
            [sys.executable, "-m", "provision", "exec", str(inv), "chief-0", "--", "printf", "%s", b"\xff\xfe-x"],
            cwd=tmp_path,
            capture_output=True,
            env=env,
            timeout=120,
        )
        assert (p.returncode, p.stdout) == (0, b"\xff\xfe-x"), p.stderr
        # A host that does not answer: exit 3 and one line, like every other command.
        sandbox3.container("host-2").pause()
        try:
            r = cli("exec", inv, "worker-0", "--", "true", cwd=tmp_path)
        finally:
            sandbox3.container("host-2").unpause()
        assert r.returncode == 3 and len(r.stderr.splitlines()) == 1 and "host-2" in r.stderr, r.stderr
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_fetch_brings_the_chiefs_outputs_back_only_what_changed(sandbox3, sandbox_inventory, tmp_path):
    """`outputs:` gives the task Vertex's AIP_* directories; `provision fetch` copies the
    chief's back, then only what changed."""
    inv = tmp_path / "inv.yaml"
    write = (
        'printf weights > "$AIP_MODEL_DIR/model.bin"; printf step1 > "$AIP_CHECKPOINT_DIR/ckpt-1"; '
        'printf events > "$AIP_TENSORBOARD_LOG_DIR/events.out"; echo wrote; exec sleep 600'
    )
    sandbox_inventory(
        sandbox3,
        job="ux-fetch",
        path=inv,
        outputs="/data/ux-fetch",
        pools={"chief": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", write]}},
    )
    out = tmp_path / "out"
    try:
        assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
        wait_until(lambda: "wrote" in cli("logs", inv, cwd=tmp_path).stdout, what="the chief wrote its outputs")
        r = cli("fetch", inv, "-o", out, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "chief-0@host-1:/data/ux-fetch: 3 of 3 files changed" in r.stderr, r.stderr
        assert (out / "model" / "model.bin").read_text() == "weights"
        assert (out / "checkpoints" / "ckpt-1").read_text() == "step1"
        assert (out / "logs" / "events.out").read_text() == "events"
        # Nothing changed: nothing sent. One file changed on the host: only that one.
        r = cli("fetch", inv, "-o", out, cwd=tmp_path)
        assert "0 of 3 files changed" in r.stderr, r.stderr
        sandbox3.docker_exec("host-1", ["/bin/sh", "-c", "printf step2 > /data/ux-fetch/checkpoints/ckpt-2"])
        r = cli("fetch", inv, "-o", out, cwd=tmp_path)
        assert "1 of 4 files changed" in r.stderr and (out / "checkpoints" / "ckpt-2").read_text() == "step2"
        assert not list(out.glob(".provision-fetch-*"))  # the transfer file is gone
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        sandbox3.docker_exec("host-1", ["/bin/sh", "-c", "rm -rf /data/ux-fetch"])
