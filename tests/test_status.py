"""Task states and the job phase from what hosts report (status.py). No hosts.

The unit properties and exit records below are the shapes systemd 252 and the unit's
ExecStop/ExecStopPost lines produce (checked on sandbox hosts by tests/integration/).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from provision.core.lifecycle import restarts, task_state
from provision.core.model import Host, Inventory, Pool, RestartPolicy, SSHSettings
from provision.host.layout import unit_name
from provision.host.protocol import ProbeReport
from provision.placement.tasks import place
from provision.rules.status import job_status

ACTIVE = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
AUTO_RESTART = {"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart"}
FAILED = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
DEAD = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}
NOT_FOUND = {"LoadState": "not-found", "ActiveState": "inactive"}


def rec(t, result, kind, status, stop=False):
    return [str(t), result, kind, status] + (["stop"] if stop else [])


# ------------------------------------------------------------------ one task


def test_never_applied_and_never_started():
    assert task_state(None) == ("Pending", None, "not applied")
    assert task_state(NOT_FOUND, [])[0] == "Pending"
    assert task_state({**DEAD, "ExecMainCode": "0"}, [])[:2] == ("Pending", None)


def test_running_and_starting():
    assert task_state(ACTIVE, [])[0] == "Running"
    assert task_state({**ACTIVE, "ActiveState": "activating", "SubState": "start"}, [])[0] == "Running"
    assert task_state({**ACTIVE, "ActiveState": "deactivating"}, [])[2] == "stopping"


def test_exit_0_is_succeeded():
    assert task_state(DEAD, [rec(1, "success", "exited", "0")]) == ("Succeeded", 0, "exited 0")


def test_exit_code_is_failed_with_the_code():
    assert task_state(FAILED, [rec(1, "exit-code", "exited", "3")]) == ("Failed", 3, "exit code 3")


def test_killed_by_a_signal_it_did_not_ask_for():
    state, code, detail = task_state({**FAILED, "Result": "signal"}, [rec(1, "signal", "killed", "KILL")])
    assert (state, code) == ("Failed", None)
    assert detail == "killed by SIGKILL (out of memory, or killed by hand: see `dmesg` on the host)"


def test_stop_mark_makes_a_clean_exit_on_sigterm_stopped():
    # A server that catches SIGTERM and exits 0 (tf.distribute.Server in the examples).
    ex = [rec(5, "success", "exited", "0", stop=True)]
    assert task_state(DEAD, ex) == ("Stopped", 0, "stopped by hand (exited 0)")
    assert task_state(DEAD, ex, {"phase": "Succeeded"}) == (
        "Stopped",
        0,
        "stopped by provision: job succeeded (exited 0)",
    )


def test_killed_by_sigterm_on_stop():
    ex = [rec(5, "success", "killed", "TERM", stop=True)]
    assert task_state(DEAD, ex, {"phase": "Failed"}) == (
        "Stopped",
        None,
        "stopped by provision: job failed (killed by SIGTERM)",
    )
    # Records written before the stop mark existed: killed with result success is a stop.
    assert task_state(DEAD, [rec(5, "success", "killed", "TERM")])[0] == "Stopped"


def test_stop_while_waiting_to_restart():
    ex = [rec(1, "exit-code", "exited", "1"), rec(2, "success", "none", "-", stop=True)]
    assert task_state(FAILED, ex, {"phase": "Succeeded"}) == (
        "Stopped",
        None,
        "stopped by provision: job succeeded (between tries)",
    )


def test_restarting_until_the_limit_then_failed():
    one = [rec(1, "exit-code", "exited", "3")]
    assert task_state(AUTO_RESTART, one, None, 2) == ("Restarting", 3, "last try: exit code 3")
    two = one + [rec(2, "exit-code", "exited", "3")]
    assert task_state(AUTO_RESTART, two, None, 2)[0] == "Restarting"
    three = two + [rec(3, "exit-code", "exited", "3")]
    # systemd still waits RestartSec before refusing the 4th start: the budget is spent now.
    assert task_state(AUTO_RESTART, three, None, 2) == ("Failed", 3, "exit code 3, restart limit (2) reached")
    # ...and after the refused start (systemd 252 keeps Result=exit-code).
    assert task_state(FAILED, three, None, 2) == ("Failed", 3, "exit code 3, restart limit (2) reached")
    assert task_state({**FAILED, "Result": "start-limit-hit"}, three)[2].endswith("restart limit (?) reached")
    # Without the limit (plan's view) it is still Restarting.
    assert task_state(AUTO_RESTART, three)[0] == "Restarting"


def test_never_policy_failure_does_not_mention_a_limit():
    assert task_state(FAILED, [rec(1, "exit-code", "exited", "1")], None, 0) == ("Failed", 1, "exit code 1")


def test_unit_file_gone_but_outcome_recorded():
    assert task_state(NOT_FOUND, [rec(1, "success", "exited", "0")])[0] == "Succeeded"


def test_no_record_falls_back_to_systemd():
    u = {**FAILED, "ExecMainCode": "1", "ExecMainStatus": "7"}
    assert task_state(u, []) == ("Failed", 7, "exit code 7")


def test_restart_count():
    three = [rec(i, "exit-code", "exited", "3") for i in range(3)]
    assert restarts(ACTIVE, three) == 3  # running its 4th try
    assert restarts(AUTO_RESTART, three[:2]) == 2  # the 2nd restart is under way
    assert restarts(FAILED, three) == 2  # the 3rd exit was the last
    assert restarts(DEAD, []) == 0


# ------------------------------------------------------------------ the job


def _inv(pools: dict[str, tuple[int, RestartPolicy]], success="chief") -> Inventory:
    ssh = SSHSettings()
    hosts = tuple(Host(f"h{i}", f"10.0.0.{i}", ssh, f"h{i}") for i in range(1, 4))
    order = ("chief", "worker", "ps", "reduction_server", "evaluator")
    ps = tuple(
        Pool(r, n, command=("/bin/true",), restart=rp)
        for r, (n, rp) in sorted(pools.items(), key=lambda kv: order.index(kv[0]))
    )
    return Inventory(Path("/x/inv.yaml"), "j", ssh, hosts, ps, success=success)


def _status(inv, states: dict[str, tuple[dict, list]], ended=None, unreachable=()):
    placement = place(inv)
    reports: dict[str, ProbeReport] = {}
    for t in placement.tasks:
        unit = unit_name(inv.job, t.name)
        if t.host.name in unreachable:
            continue
        r = reports.setdefault(t.host.name, ProbeReport(lifecycle=ended, now=100, now_monotonic_us=1))
        u, ex = states.get(t.name, (None, []))
        if u is not None:
            r.units[unit] = u
        r.exits[unit] = ex
    return job_status(inv, list(placement.tasks), reports, {h: "connection refused" for h in unreachable})


NEVER = RestartPolicy("Never", 0)


def test_chief_exit_0_succeeds_and_long_lived_tasks_stop():
    inv = _inv({"chief": (1, NEVER), "worker": (1, NEVER), "ps": (1, NEVER)})
    st = _status(
        inv, {"chief-0": (DEAD, [rec(10, "success", "exited", "0")]), "worker-0": (ACTIVE, []), "ps-0": (ACTIVE, [])}
    )
    assert (st.phase, st.reason) == ("Succeeded", "chief-0 exited 0")
    st = _status(
        inv,
        {
            "chief-0": (DEAD, [rec(10, "success", "exited", "0")]),
            "worker-0": (DEAD, [rec(11, "success", "exited", "0", stop=True)]),
            "ps-0": (DEAD, [rec(12, "success", "killed", "TERM", stop=True)]),
        },
        ended={"phase": "Succeeded"},
    )
    assert st.phase == "Succeeded"
    assert [t.state for t in st.tasks] == ["Succeeded", "Stopped", "Stopped"]
    assert st.task("ps-0").detail == "stopped by provision: job succeeded (killed by SIGTERM)"


def test_failure_after_success_does_not_undo_it():
    # A DDP worker that loses its peers as the chief leaves, before provision stops it.
    inv = _inv({"chief": (1, NEVER), "worker": (1, NEVER)})
    st = _status(
        inv,
        {
            "chief-0": (DEAD, [rec(10, "success", "exited", "0")]),
            "worker-0": (FAILED, [rec(11, "exit-code", "exited", "1")]),
        },
    )
    assert st.phase == "Succeeded"
    st = _status(
        inv,
        {
            "chief-0": (DEAD, [rec(10, "success", "exited", "0")]),
            "worker-0": (FAILED, [rec(9, "exit-code", "exited", "1")]),
        },
    )
    assert (st.phase, st.reason) == ("Failed", "worker-0 on h2 failed: exit code 1")


def test_worker_out_of_restarts_fails_the_job_and_says_who_and_how():
    inv = _inv({"chief": (1, NEVER), "worker": (1, RestartPolicy("OnFailure", 2))})
    three = [rec(i, "exit-code", "exited", "3") for i in range(3)]
    st = _status(inv, {"chief-0": (ACTIVE, []), "worker-0": (FAILED, three)})
    assert st.phase == "Failed"
    assert st.reason == "worker-0 on h2 failed: exit code 3, restart limit (2) reached"
    w = st.task("worker-0")
    assert (w.exit_code, w.restarts, w.ended_at) == (3, 2, 2.0)
    st = _status(inv, {"chief-0": (ACTIVE, []), "worker-0": (AUTO_RESTART, three[:1])})
    assert (st.phase, st.task("worker-0").state, st.task("worker-0").restarts) == ("Running", "Restarting", 1)


def test_all_workers_policy_and_no_chief():
    inv = _inv({"worker": (2, NEVER)}, success="all_workers")
    ok = (DEAD, [rec(1, "success", "exited", "0")])
    assert _status(inv, {"worker-0": ok, "worker-1": (ACTIVE, [])}).phase == "Running"
    assert _status(inv, {"worker-0": ok, "worker-1": ok}).reason == "every worker exited 0"
    inv = _inv({"worker": (2, NEVER)})
    assert _status(inv, {"worker-0": ok, "worker-1": (ACTIVE, [])}).reason == "worker-0 exited 0"


def test_pending_unknown_and_everything_stopped_by_hand():
    inv = _inv({"chief": (1, NEVER), "worker": (1, NEVER)})
    assert _status(inv, {}).phase == "Pending"
    st = _status(inv, {"worker-0": (ACTIVE, [])}, unreachable=("h1",))
    assert st.phase == "Running" and st.task("chief-0").state == "Unknown"
    st = _status(inv, {}, unreachable=("h1", "h2"))
    assert st.phase == "Unknown"
    stopped = (DEAD, [rec(1, "success", "killed", "TERM", stop=True)])
    st = _status(inv, {"chief-0": stopped, "worker-0": stopped})
    assert st.phase == "Failed" and "stopped by hand" in st.reason


def test_provision_stop_makes_the_job_stopped_unless_it_had_ended_before():
    inv = _inv({"chief": (1, NEVER), "worker": (1, NEVER)})
    stop = {"phase": "Stopped", "reason": "stopped by ana@lab (provision stop)", "host_time": 20}
    stopped = (DEAD, [rec(21, "success", "killed", "TERM", stop=True)])
    st = _status(inv, {"chief-0": stopped, "worker-0": stopped}, ended=stop)
    assert (st.phase, st.reason) == ("Stopped", "stopped by ana@lab (provision stop)")
    assert st.task("chief-0").detail == "stopped by provision: job stopped (killed by SIGTERM)"
    assert st.to_json()["phase"] == "Stopped" and st.phase.ended
    # Marked, not yet stopped (the stop is under way): Stopped already, so no apply restarts it.
    assert _status(inv, {"chief-0": (ACTIVE, []), "worker-0": (ACTIVE, [])}, ended=stop).phase == "Stopped"
    # A worker that fails as its peers are stopped does not make the job Failed...
    late = (FAILED, [rec(22, "exit-code", "exited", "1")])
    assert _status(inv, {"chief-0": stopped, "worker-0": late}, ended=stop).phase == "Stopped"
    # ... one that failed before the stop does, and so does a success before it.
    early = (FAILED, [rec(15, "exit-code", "exited", "1")])
    assert _status(inv, {"chief-0": stopped, "worker-0": early}, ended=stop).phase == "Failed"
    done = (DEAD, [rec(15, "success", "exited", "0")])
    assert _status(inv, {"chief-0": done, "worker-0": stopped}, ended=stop).phase == "Succeeded"


@pytest.mark.parametrize(
    "policy, limit, expect",
    [
        ("Never", 0, {"restart": "no", "start_limit_burst": 0}),
        ("OnFailure", 2, {"restart": "on-failure", "start_limit_burst": 3, "restart_prevent": ""}),
        ("Always", 1, {"restart": "always", "start_limit_burst": 2}),
        ("ExitCode", 4, {"restart": "on-failure", "start_limit_burst": 5}),
    ],
)
def test_restart_policy_mapping(policy, limit, expect):
    from provision.core.lifecycle import systemd_restart

    got = systemd_restart(RestartPolicy(policy, limit))
    for k, v in expect.items():
        assert got[k] == v
    if policy == "ExitCode":
        assert got["restart_prevent"].split() == [str(i) for i in range(1, 128)]


# ------------------------------------------------------------------ the runnable jobs


@pytest.mark.parametrize("name", ["tf_mwms", "tf_ps", "torch_ddp", "reduction"])
def test_sandbox_jobs_validate_on_sandbox_hosts_without_docker(name, tmp_path):
    """inventories/sandbox/<name>.yaml + a sandbox's hosts (`sandbox up --from`) is a valid
    inventory whose files exist and whose tasks land where the comments say."""
    from provision import sandbox
    from provision.cli.sandboxcmd import job_from_file
    from provision.inventory.inventory import load

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "id_ed25519").write_text("not a real key\n")
    sb = sandbox.Sandbox(
        name="fake",
        network="provision-sandbox-fake",
        key_path=tmp_path / "id_ed25519",
        known_hosts_path=tmp_path / "known_hosts",
        hosts=[sandbox.SandboxHost(f"host-{i}", f"fake-host-{i}", 40000 + i, f"fake-host-{i}") for i in (1, 2, 3)],
    )
    spec = job_from_file(root / "inventories" / "sandbox" / f"{name}.yaml")
    assert spec["files"][0]["src"] == str(root / "examples" / name) + "/"
    inv = load(sandbox.write_inventory(sb, tmp_path / "inv.yaml", **spec))
    placed = {t.name: t.host.name for t in place(inv).tasks}
    for pool in inv.pools:
        for arg in pool.command:
            if arg.startswith("/opt/provision-examples/"):
                assert (root / "examples" / arg.removeprefix("/opt/provision-examples/")).is_file(), arg
    if name == "tf_ps":  # one directory for the checkpoint: chief, ps and evaluator together
        assert placed["chief-0"] == placed["ps-0"] == placed["evaluator-0"] == "host-1"
        assert set(placed) == {"chief-0", "worker-0", "worker-1", "ps-0", "evaluator-0"}
    if name == "reduction":
        assert {t for t in placed if t.startswith("reduction_server")} == {"reduction_server-0", "reduction_server-1"}
    assert job_from_file(root / "inventories" / "sandbox" / f"{name}.yaml", "other")["job"] == "other"


def test_tasks_held_back_by_the_hosts_setup_say_so():
    """item 21: after a failed setup, status said only "Pending (not started)"."""
    from provision.host.layout import setup_unit
    from provision.rules.status import job_status

    inv = _inv({"chief": (1, NEVER), "worker": (1, NEVER)})
    placement = place(inv)
    setup = setup_unit("a" * 64)
    failed = {**FAILED, "ExecMainCode": "1", "ExecMainStatus": "7"}
    running = {"LoadState": "loaded", "ActiveState": "activating", "SubState": "start"}
    reports = {}
    for t, unit in zip(placement.tasks, (failed, running)):
        reports[t.host.name] = ProbeReport(now=100, now_monotonic_us=1, units={setup: unit})
    st = job_status(inv, list(placement.tasks), reports, {})
    chief, worker = (st.task(t.name) for t in placement.tasks)
    assert chief.state.value == worker.state.value == "Pending"
    assert chief.detail == "setup failed: exit code 7 (provision logs --setup shows its output)"
    assert worker.detail == "waiting for the host's setup (running)"
    assert st.phase.value == "Pending"
    assert st.reason == f"setup failed on {chief.host}: exit code 7 (provision logs --setup shows its output)"
    # A setup that succeeded changes nothing: the tasks are simply not started yet.
    ok = {"LoadState": "loaded", "ActiveState": "inactive", "Result": "success", "ExecMainCode": "1"}
    reports = {h: ProbeReport(now=100, now_monotonic_us=1, units={setup: ok}) for h in reports}
    st = job_status(inv, list(placement.tasks), reports, {})
    assert st.reason == "not started" and {t.detail for t in st.tasks} == {"not applied"}


def test_a_host_the_job_left_is_named_while_it_holds_some_of_it():
    from provision.rules.status import left_behind

    units = {"provision-j-worker-1.service": "worker-1"}
    line, running = left_behind("h3", units, None, "timed out")  # type: ignore[misc]
    assert line.startswith("h3 left the job while it could not be reached (timed out): its tasks (worker-1) may start")
    assert not running
    live = ProbeReport(units={"provision-j-worker-1.service": ACTIVE})
    assert left_behind("h3", units, live, None) == (
        "h3 left the job but still runs worker-1: the next apply stops them",
        True,
    )
    files = ProbeReport(manifest={"job": "j"}, units={"provision-j-worker-1.service": DEAD})
    assert left_behind("h3", units, files, None) == (
        "h3 left the job; its files are still there: the next apply removes them",
        False,
    )
    assert left_behind("h3", units, ProbeReport(), None) is None


def test_each_running_task_shows_its_gpus_utilization():
    """status shows each task's GPU utilization, from the facts its probe brings
    back (the mean over the task's GPUs); "-" (None) where unknown or not running."""
    from provision.cli.output import status_lines
    from provision.core.model import Accelerators
    from provision.rules.gpuuse import with_task_util

    ssh = SSHSettings()
    host = Host("h1", "10.0.0.1", ssh, "h1", accelerators=Accelerators("nvidia-h100", 4))
    pools = (
        Pool("chief", 1, command=("/bin/true",), accelerators=2),
        Pool("worker", 1, command=("/bin/true",), accelerators=2),
    )
    inv = Inventory(Path("/x/inv.yaml"), "j", ssh, (host,), pools)
    placement = place(inv)
    gpus = [
        {"index": i, "uuid": f"GPU-{i}", "util_pct": u, "memory_used_mib": 1, "memory_mib": 2}
        for i, u in enumerate((90, 70, 3, None))
    ]
    units = {unit_name("j", t.name): ACTIVE if t.role == "chief" else DEAD for t in placement.tasks}
    rep = ProbeReport(now=100, now_monotonic_us=1, units=units, facts={"gpus": gpus})
    st = with_task_util(job_status(inv, list(placement.tasks), {"h1": rep}, {}), {"h1": rep})
    chief, worker = (st.task(t.name) for t in placement.tasks)
    assert chief.gpus == [0, 1] and chief.gpu_util == 80 and chief.to_json()["gpu_util_pct"] == 80
    assert worker.gpu_util is None and worker.to_json()["gpu_util_pct"] is None  # not running: another's work
    lines = status_lines(st)
    assert "GPU%" in lines[1] and "80%" in lines[2]
    # No facts (a host that was not asked, or no nvidia-smi): unknown, not 0.
    bare = {"h1": ProbeReport(now=100, now_monotonic_us=1, units=units)}
    st = with_task_util(job_status(inv, list(placement.tasks), bare, {}), bare)
    assert st.task(placement.tasks[0].name).gpu_util is None
