"""Reboots, as rules (lifecycle.py) and as the unit's commands that apply them on a host
(host/layout.py): the gate every start goes through (ExecCondition=), the exit record of a
run the shutdown ended, what status says about either. No hosts: the unit's commands run
here with sh as systemd would run them (its $$ and %% escapes undone), on a state directory
in a tmp dir, with the boot id and `systemctl is-system-running` faked (layout.boot_id and
BOOT_ID_SH, which name a boot on real hosts, are checked against each other on sandbox hosts
by tests/integration/test_reboot.py).
"""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import pytest

from provision.core.lifecycle import (
    RUN_LIVE,
    RUN_SHUTDOWN,
    JobPhase,
    RebootAction,
    TaskState,
    boot_gate,
    ended_by_reboot,
    gate,
    needs_reset_failed,
    on_reboot,
    restart_due,
    restarts,
    systemd_restart,
    task_state,
)
from provision.core.model import RestartPolicy
from provision.host import layout
from provision.host.protocol import ProbeReport
from provision.inventory.inventory import load
from provision.placement.tasks import place
from provision.render.files import FileKind, render
from provision.rules.status import job_status

JOB, TASK = "rb", "worker-0"
NEVER = RestartPolicy("Never", 0)
ON_FAILURE = RestartPolicy("OnFailure", 3)
EXIT_CODE = RestartPolicy("ExitCode", 3)
ALWAYS = RestartPolicy("Always", 2)
ON_FAILURE_0 = RestartPolicy("OnFailure", 0)
POLICIES = [NEVER, ON_FAILURE, EXIT_CODE, ALWAYS, ON_FAILURE_0]

FAIL3 = ["100", "exit-code", "exited", "3"]
FAIL200 = ["100", "exit-code", "exited", "200"]
KILLED = ["100", "signal", "killed", "KILL"]
OK = ["100", "success", "exited", "0"]
STOPPED = ["100", "success", "killed", "TERM", "stop"]
SHUTDOWN = ["100", "success", "killed", "TERM", "reboot"]  # what ExecStopPost writes at shutdown
CRASH = ["100", "reboot", "none", "-", "reboot"]  # what the gate writes after a crash

ACTIVE = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
DEAD = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}
GATED = {**DEAD, "Result": "exec-condition"}


# --------------------------------------------------------------------------- the rules


def test_on_reboot_brings_back_every_policy_with_a_budget_and_fails_never():
    assert on_reboot(NEVER) is RebootAction.FAIL
    assert on_reboot(ON_FAILURE_0) is RebootAction.FAIL  # a limit of 0 cannot absorb a restart
    for p in (ON_FAILURE, EXIT_CODE, ALWAYS):
        assert on_reboot(p) is RebootAction.RESTART


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.policy}-{p.limit}")
def test_restart_due_is_what_the_unit_tells_systemd(policy):
    """restart_due (the gate's test for a task that was waiting to restart at shutdown)
    follows the unit's Restart= and RestartPreventExitStatus= (systemd_restart)."""
    sd = systemd_restart(policy)
    prevent = set(str(sd["restart_prevent"]).split())

    def systemd_would(rec):
        if sd["restart"] == "no":
            return False
        if sd["restart"] == "always":
            return True
        return rec[1] != "success" and not (rec[2] == "exited" and rec[3] in prevent)

    for rec in (FAIL3, FAIL200, KILLED, OK, ["1", "timeout", "killed", "KILL"], ["1", "exit-code", "exited", "127"]):
        assert restart_due(policy, rec) == systemd_would(rec), rec
    for rec in (STOPPED, SHUTDOWN, CRASH):
        assert not restart_due(policy, rec), "a stop or a reboot is never a restart that was due"


def test_gate_within_one_boot_only_counts_the_budget():
    # provision's own start, and systemd's restarts: what StartLimitBurst would allow.
    assert gate(ON_FAILURE, [], rebooted=False, run=None) == (True, False)
    assert gate(ON_FAILURE, [FAIL3] * 3, rebooted=False, run=RUN_LIVE) == (True, False)
    assert gate(ON_FAILURE, [FAIL3] * 4, rebooted=False, run=RUN_LIVE) == (False, False)
    # Never has no budget to count (StartLimitIntervalSec=0): a start by hand still starts.
    assert gate(NEVER, [STOPPED], rebooted=False, run=None) == (True, False)


def test_gate_after_a_reboot():
    # Running when the host shut down: back, counted, under OnFailure, ExitCode and Always.
    for p in (ON_FAILURE, EXIT_CODE, ALWAYS):
        assert gate(p, [SHUTDOWN], rebooted=True, run=RUN_SHUTDOWN) == (True, False)
        assert restarts(ACTIVE, [SHUTDOWN]) == 1
    # ... after a crash the gate writes the record the shutdown could not.
    assert gate(ON_FAILURE, [], rebooted=True, run=RUN_LIVE) == (True, True)
    assert gate(ON_FAILURE, [FAIL3], rebooted=True, run=RUN_LIVE) == (True, True)
    # Never: stays down.
    assert gate(NEVER, [SHUTDOWN], rebooted=True, run=RUN_SHUTDOWN) == (False, False)
    assert gate(NEVER, [], rebooted=True, run=RUN_LIVE) == (False, True)
    # The budget holds across the boot (systemd's own counter started again).
    assert gate(ON_FAILURE, [FAIL3] * 3 + [SHUTDOWN], rebooted=True, run=RUN_SHUTDOWN) == (False, False)
    assert gate(ON_FAILURE, [FAIL3] * 3, rebooted=True, run=RUN_LIVE) == (False, True)
    # The job ended (its marker is on the host): nothing starts, whatever was running.
    assert gate(ALWAYS, [SHUTDOWN], rebooted=True, run=RUN_SHUTDOWN, job_ended=True) == (False, False)
    # Ended before the reboot: stays ended...
    for ended in ([OK], [STOPPED], [FAIL3] * 4, []):
        assert gate(ON_FAILURE, ended, rebooted=True, run=None)[0] is False, ended
    assert gate(EXIT_CODE, [FAIL3], rebooted=True, run=None)[0] is False  # exit code 3: its own verdict
    # ... unless it was waiting to restart when the host went down (systemd ran no ExecStopPost).
    assert gate(ON_FAILURE, [FAIL3], rebooted=True, run=None) == (True, False)
    assert gate(EXIT_CODE, [KILLED], rebooted=True, run=None) == (True, False)
    assert gate(ALWAYS, [OK], rebooted=True, run=None) == (True, False)


# --------------------------------------------------------------------------- status


def test_a_run_the_reboot_ended_is_never_stopped_by_hand_nor_pending():
    for rec in (SHUTDOWN, CRASH):
        out = task_state(DEAD, [rec], None, 0)  # Never
        assert out.state is TaskState.FAILED
        assert out.detail == "host rebooted at 1970-01-01 00:01:40 UTC"
        assert out.exit_code is None
        assert restarts(DEAD, [rec], out.state) == 0


def test_back_after_a_reboot_names_it_and_counts_the_restart():
    out = task_state(ACTIVE, [SHUTDOWN], None, 3)
    assert out.state is TaskState.RUNNING
    assert out.detail == "running; host rebooted at 1970-01-01 00:01:40 UTC"
    assert restarts(ACTIVE, [SHUTDOWN], out.state) == 1


def test_on_its_way_back_and_out_of_budget():
    # The boot has not reached the unit's gate yet: Restarting, the restart already counted.
    out = task_state(DEAD, [FAIL3, SHUTDOWN], None, 3)
    assert (out.state, out.detail) == (TaskState.RESTARTING, "host rebooted at 1970-01-01 00:01:40 UTC; starting again")
    assert restarts(DEAD, [FAIL3, SHUTDOWN], out.state) == 2
    # The gate refused: the budget was spent.
    out = task_state(GATED, [FAIL3] * 3 + [SHUTDOWN], None, 3)
    assert out.state is TaskState.FAILED
    assert out.detail == "host rebooted at 1970-01-01 00:01:40 UTC, restart limit (3) reached"
    # The job ended meanwhile: not restarted, and not a failure of the task's own...
    out = task_state(GATED, [SHUTDOWN], {"phase": "Failed"}, 3)
    assert (out.state, out.detail) == (
        TaskState.STOPPED,
        "host rebooted at 1970-01-01 00:01:40 UTC; not restarted: job failed",
    )
    # ... unless the reboot was the task's own end for good (what may have ended the job).
    out = task_state(GATED, [SHUTDOWN], {"phase": "Failed"}, 0)
    assert (out.state, out.detail) == (TaskState.FAILED, "host rebooted at 1970-01-01 00:01:40 UTC")


def test_a_budget_the_gate_enforced_after_a_boot_reads_as_the_limit():
    out = task_state(GATED, [SHUTDOWN, FAIL3, FAIL3, FAIL3], None, 3)
    assert (out.state, out.exit_code, out.detail) == (TaskState.FAILED, 3, "exit code 3, restart limit (3) reached")


def test_ended_by_reboot():
    assert ended_by_reboot(SHUTDOWN) and ended_by_reboot(CRASH)
    assert not ended_by_reboot(STOPPED) and not ended_by_reboot(FAIL3) and not ended_by_reboot(None)


def _inventory(tmp_path: Path, chief_policy: str = "Never"):
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        f"job: {JOB}\n"
        "hosts: [{name: h1, address: 10.0.0.1}, {name: h2, address: 10.0.0.2}]\n"
        "pools:\n"
        f"  chief: {{replicas: 1, command: [/bin/true], hosts: [h1], restart: {{policy: {chief_policy}}}}}\n"
        "  worker: {replicas: 1, command: [/bin/true], hosts: [h2], restart: {policy: OnFailure, limit: 3}}\n"
    )
    return load(inv)


def test_job_status_names_the_reboot(tmp_path):
    """The issue's two cases: the chief's host rebooted (Never): the job Failed, saying so;
    the worker's host rebooted (OnFailure, 3): Running, the worker back with one restart."""
    inv = _inventory(tmp_path)
    tasks = list(place(inv).tasks)
    chief, worker = layout.unit_name(JOB, "chief-0"), layout.unit_name(JOB, "worker-0")
    up = {"h1": ProbeReport(units={chief: ACTIVE}), "h2": ProbeReport(units={worker: ACTIVE})}

    rebooted_chief = {**up, "h1": ProbeReport(units={chief: GATED}, exits={chief: [SHUTDOWN]})}
    st = job_status(inv, tasks, rebooted_chief, {})
    assert st.phase is JobPhase.FAILED
    assert st.reason == "chief-0 on h1 failed: host rebooted at 1970-01-01 00:01:40 UTC"
    assert st.task("chief-0").state is TaskState.FAILED

    rebooted_worker = {**up, "h2": ProbeReport(units={worker: ACTIVE}, exits={worker: [SHUTDOWN]})}
    st = job_status(inv, tasks, rebooted_worker, {})
    assert st.phase is JobPhase.RUNNING
    w = st.task("worker-0")
    assert (w.state, w.restarts) == (TaskState.RUNNING, 1)
    assert "host rebooted at" in w.detail


# --------------------------------------------------------------------------- the unit's commands


def _unit(tmp_path: Path, policy: RestartPolicy) -> dict[str, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    restart = f"{{policy: {policy.policy}, limit: {policy.limit}}}" if policy.policy != "Never" else "{policy: Never}"
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        f"job: {JOB}\nhosts: [{{name: h1, address: 10.0.0.1}}]\n"
        f"pools: {{worker: {{replicas: 1, command: [/bin/true], restart: {restart}}}}}\n"
    )
    bundle = render(load(inv)).hosts["h1"]
    unit = next(f for f in bundle.files if f.kind is FileKind.UNIT).data().decode()
    target = next(f for f in bundle.files if f.kind is FileKind.TARGET).data().decode()
    lines = {k: v for k, _, v in (line.partition("=") for line in unit.splitlines()) if k.startswith("Exec")}
    lines["target"] = target
    return lines


class Host:
    """A state dir in a tmp dir, the unit's commands run on it as systemd would."""

    def __init__(self, tmp: Path, policy: RestartPolicy):
        self.lines = _unit(tmp / "render", policy)
        self.sd, self.etc = tmp / "state", tmp / "etc"
        self.sd.mkdir()
        self.etc.mkdir()
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.system_state = tmp / "system-state"
        self.system_state.write_text("running\n")
        fake = self.bin / "systemctl"  # is-system-running: "stopping" during a shutdown
        fake.write_text(f"#!/bin/sh\ncat {self.system_state}\n")
        fake.chmod(0o755)

    def path(self, suffix: str) -> Path:
        return self.sd / f"{TASK}.{suffix}"

    def run(self, key: str, env: dict[str, str] | None = None, boot: str = "boot-1") -> int:
        cmd = self.lines[key].removeprefix("-").replace("%%", "%").replace("$$", "$")
        cmd = cmd.replace(layout.BOOT_ID_SH, "b=$FAKE_BOOT")
        cmd = cmd.replace(layout.state_dir(JOB), str(self.sd)).replace(layout.job_dir(JOB), str(self.etc))
        script = cmd.split(" -c ", 1)[1][1:-1]
        full_env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", "FAKE_BOOT": boot, **(env or {})}
        return subprocess.run(["/bin/sh", "-c", script], env=full_env).returncode

    def records(self) -> list[list[str]]:
        p = self.path("exits")
        return layout.parse_exits(p.read_text()) if p.exists() else []

    def stop(self, shutdown: bool, result="success", code="killed", status="TERM") -> None:
        """A stop that was asked for while the task ran (by hand, or by the shutdown)."""
        self.system_state.write_text("stopping\n" if shutdown else "running\n")
        self.run("ExecStop", {"MAINPID": "42"})
        self.run("ExecStopPost", {"SERVICE_RESULT": result, "EXIT_CODE": code, "EXIT_STATUS": status})
        self.system_state.write_text("running\n")

    def exit(self, result="exit-code", code="exited", status="3") -> None:
        """The task exited by itself."""
        self.run("ExecStop", {"MAINPID": ""})
        self.run("ExecStopPost", {"SERVICE_RESULT": result, "EXIT_CODE": code, "EXIT_STATUS": status})


def test_the_unit_wires_the_gate_and_the_target_wants_every_task(tmp_path):
    lines = _unit(tmp_path, ON_FAILURE)
    assert lines["ExecCondition"] == layout.exec_condition_command(JOB, TASK, **boot_gate(ON_FAILURE))
    assert f"Wants={layout.unit_name(JOB, TASK)}" in lines["target"]
    assert layout.wants_link(JOB) == f"/etc/systemd/system/multi-user.target.wants/provision-{JOB}.target"


def test_a_shutdown_records_a_reboot_and_a_stop_by_hand_a_stop(tmp_path):
    h = Host(tmp_path, ON_FAILURE)
    assert h.run("ExecCondition") == 0  # provision's start
    assert h.path("run").read_text() == "" and h.path("boot").read_text().strip() == "boot-1"
    h.stop(shutdown=True)
    assert [r[1:] for r in h.records()] == [["success", "killed", "TERM", "reboot"]]
    assert h.path("run").read_text().strip() == RUN_SHUTDOWN
    assert not h.path("stopping").exists()
    # The next boot: back, counted.
    assert h.run("ExecCondition", boot="boot-2") == 0
    assert h.path("run").read_text() == "" and h.path("boot").read_text().strip() == "boot-2"
    assert restarts(ACTIVE, h.records()) == 1
    # A stop by hand ends the run: the next boot leaves it stopped.
    h.stop(shutdown=False)
    assert h.records()[-1][1:] == ["success", "killed", "TERM", "stop"]
    assert not h.path("run").exists()
    assert h.run("ExecCondition", boot="boot-3") == 1
    assert task_state(DEAD, h.records(), None, 3).state is TaskState.STOPPED


def test_a_start_the_gate_refused_writes_no_record(tmp_path):
    h = Host(tmp_path, NEVER)
    h.run("ExecStopPost", {"SERVICE_RESULT": "exec-condition", "EXIT_CODE": "", "EXIT_STATUS": ""})
    assert not h.path("exits").exists()


def test_never_after_a_crash_and_after_a_shutdown(tmp_path):
    h = Host(tmp_path, NEVER)
    assert h.run("ExecCondition") == 0
    # A crash: no shutdown, no record; the boot's gate writes it and keeps the task down.
    assert h.run("ExecCondition", boot="boot-2") == 1
    [rec] = h.records()
    assert rec[1:] == ["reboot", "none", "-", "reboot"]
    out = task_state(GATED, h.records(), None, 0)
    assert out.state is TaskState.FAILED and out.detail.startswith("host rebooted at ")
    # A start by hand afterwards is a start like any other (Never counts nothing).
    assert h.run("ExecCondition", boot="boot-2") == 0


def test_a_finished_job_never_comes_back(tmp_path):
    h = Host(tmp_path, ALWAYS)
    assert h.run("ExecCondition") == 0
    h.stop(shutdown=True)
    (h.etc / "lifecycle.json").write_text('{"phase": "Succeeded"}')
    assert h.run("ExecCondition", boot="boot-2") == 1
    assert not h.path("run").exists()
    h2 = Host(tmp_path / "b", ON_FAILURE)
    assert h2.run("ExecCondition") == 0
    h2.exit("success", "exited", "0")  # the task succeeded, the job is still running elsewhere
    assert h2.run("ExecCondition", boot="boot-2") == 1
    assert task_state(DEAD, h2.records(), None, 3).state is TaskState.SUCCEEDED


def test_the_budget_holds_across_boots(tmp_path):
    h = Host(tmp_path, ON_FAILURE)  # limit 3
    assert h.run("ExecCondition") == 0
    for _ in range(3):
        h.exit()
        assert h.run("ExecCondition") == 0  # systemd's restarts 1..3
    h.stop(shutdown=True)  # the 4th run, ended by the shutdown: a 4th restart is one too many
    assert h.run("ExecCondition", boot="boot-2") == 1
    out = task_state(GATED, h.records(), None, 3)
    assert out.state is TaskState.FAILED and out.detail.endswith("restart limit (3) reached")


RECORD_SETS = [[], [FAIL3], [FAIL200], [KILLED], [OK], [STOPPED], [SHUTDOWN], [FAIL3] * 3, [FAIL3] * 4]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.policy}-{p.limit}")
def test_the_gate_on_the_host_is_the_rule(tmp_path, policy):
    """The unit's gate (sh) decides as lifecycle.gate does, case by case: no boot recorded
    (provision's start), the same boot, another boot; every .run state; the job ended or not."""
    h = Host(tmp_path, policy)
    cases = itertools.product(
        range(len(RECORD_SETS)), ("none", "same", "other"), (None, RUN_LIVE, RUN_SHUTDOWN), (0, 1)
    )
    for i, boot, run, ended in cases:
        if ended and boot != "other":
            continue
        records = RECORD_SETS[i]
        for suffix in ("exits", "run", "boot"):
            h.path(suffix).unlink(missing_ok=True)
        (h.etc / "lifecycle.json").unlink(missing_ok=True)
        if records:
            h.path("exits").write_text("".join(" ".join(r) + "\n" for r in records))
        if run is not None:
            h.path("run").write_text(run + "\n" if run else "")
        if boot != "none":
            h.path("boot").write_text("boot-1\n" if boot == "same" else "boot-0\n")
        if ended:
            (h.etc / "lifecycle.json").write_text("{}")
        start, add = gate(policy, records, rebooted=boot == "other", run=run, job_ended=bool(ended))
        code = h.run("ExecCondition", boot="boot-1")
        case = f"records={records} boot={boot} run={run!r} ended={ended}"
        assert code == (0 if start else 1), case
        got = h.records()
        assert got[: len(records)] == [list(r) for r in records], case
        assert len(got) == len(records) + add, case
        if add:
            assert got[-1][1:] == ["reboot", "none", "-", "reboot"], case
        if start:
            assert h.path("run").read_text() == "" and h.path("boot").read_text().strip() == "boot-1", case


@pytest.mark.parametrize(
    "unit,policy,reset",
    [
        ({"ActiveState": "active"}, NEVER, False),  # no start limit, not failed: nothing to reset
        ({"ActiveState": "inactive"}, NEVER, False),
        ({"ActiveState": "failed"}, NEVER, True),  # leave the failed state
        ({"ActiveState": "active"}, ON_FAILURE, True),  # zero the start counter (StartLimitBurst=)
        ({"ActiveState": "active"}, EXIT_CODE, True),
        ({"ActiveState": "active"}, RestartPolicy("OnFailure", 0), False),  # a zero budget renders no limit
        (None, NEVER, False),
    ],
)
def test_reset_failed_only_where_it_changes_something(unit, policy, reset):
    assert needs_reset_failed(unit, policy) is reset
    # ... which is exactly where the unit template gets a start limit, or systemd a failure.
    limited = systemd_restart(policy)["start_limit_burst"] != 0
    assert reset == (limited or (unit or {}).get("ActiveState") == "failed")


def test_plan_and_status_judge_a_task_the_reboot_ended_by_one_rule():
    """item 13: status said Failed for a `Never` chief that a reboot ended, while
    plan (deciding without the pool's budget) took it for on its way back, and `apply
    --rerun` refused the job as still running."""
    from provision.core.lifecycle import Action, Reason, decide, finished

    for rec in (SHUTDOWN, CRASH):
        assert task_state(DEAD, [rec], None, 0).state is TaskState.FAILED  # what status says
        d = decide("chief-0", True, False, [], DEAD, [rec], None, False, restart_limit=0)
        assert (d.action, d.reason) == (Action.NONE, Reason.FAILED)
        assert finished({"chief-0": d})
        # A pool with a budget left is on its way back, for both.
        d = decide("chief-0", True, False, [], DEAD, [rec], None, False, restart_limit=3)
        assert task_state(DEAD, [rec], None, 3).state is TaskState.RESTARTING
        assert (d.action, d.reason) == (Action.NONE, Reason.RUNNING) and not finished({"chief-0": d})
