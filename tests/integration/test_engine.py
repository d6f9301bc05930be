"""Plan, apply and destroy on real sshd+systemd hosts.

Every test drives the real `provision` command in a subprocess against sandbox hosts and
checks the hosts themselves (through `docker exec`, not through provision).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clirun import cli, sh, unit_props, wait_until
from provision.host.taskenv import parse_env

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "echo started $PROVISION_TASK; exec sleep 600"]


def proc_environ(sb, host: str, pid: str) -> dict:
    out = sh(sb, host, f"cat /proc/{pid}/environ | base64 -w0")
    import base64

    raw = base64.b64decode(out.strip())
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def placement(tmp: Path, inv: Path) -> dict:
    state = json.loads((tmp / ".provision" / f"{json_job(inv)}.state.json").read_text())
    return state["placement"]


def json_job(inv: Path) -> str:
    import yaml

    return yaml.safe_load(inv.read_text())["job"]


def host_of(sb, hostname: str):
    return next(h for h in sb.hosts if h.name == hostname)


def marked(out: str, mark: str) -> int:
    """The plan's lines with this marker ("+", "~", "-"): what its summary counts."""
    return sum(line.startswith(f"  {mark} ") for line in out.splitlines())


# --------------------------------------------------------------------------- converge


def test_apply_converges_and_second_apply_does_nothing(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "accelerators": 1, "command": LONG},
        "worker": {"replicas": 3, "accelerators": 1, "command": LONG},
        "ps": {"replicas": 1, "command": LONG},
    }
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv, env={"HOSTILE": 'a "b" $c `d` \\e %f #g\nline2'})
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    added, changed = marked(r.stdout, "+"), marked(r.stdout, "~")
    assert added >= 5 * 3, r.stdout  # each task, its env and unit files, and more
    assert f"Plan: {added} to add, {changed} to change, 0 to destroy." in r.stdout
    assert f"Apply complete! Resources: {added} added, {changed} changed, 0 destroyed." in r.stdout

    # Every task runs with exactly the rendered environment, read back from the process.
    out = tmp_path / "rendered"
    assert cli("render", inv, "-o", out, cwd=tmp_path).returncode == 0
    seen = 0
    for task, slot in placement(tmp_path, inv).items():
        props = unit_props(sandbox4, slot["host"], job_name, task)
        assert props["ActiveState"] == "active", (task, props)
        env = proc_environ(sandbox4, slot["host"], props["MainPID"])
        rendered = dict(parse_env((out / slot["host"] / f"etc/provision/{job_name}/{task}.env").read_text()))
        for k, v in rendered.items():
            assert env.get(k) == v, (task, k)
        assert env["HOSTILE"] == 'a "b" $c `d` \\e %f #g\nline2'
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, slot["accelerators"]))
        seen += 1
    assert seen == 5

    # Env files are root-only; units are not.
    mode = sh(sandbox4, "host-1", f"stat -c '%a %U' /etc/provision/{job_name}/*.env")
    code = mode.code
    assert code == 0 and set(mode.split("\n")) - {""} == {"600 root"}

    r = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No changes" in r.stdout
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0 and "No changes" in r.stdout, r.stdout + r.stderr

    r = cli("plan", "--json", inv, cwd=tmp_path)
    data = json.loads(r.stdout)
    assert data["changes"] is False and data["summary"] == {"add": 0, "change": 0, "destroy": 0}

    r = cli("destroy", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for h in sandbox4.hosts:
        code = sh(
            sandbox4,
            h.name,
            f"ls /etc/provision/{job_name} /var/lib/provision/{job_name} /etc/systemd/system/provision-{job_name}*",
        ).code
        assert code != 0
    r = cli("destroy", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0 and "No changes" in r.stdout


def test_destroy_needs_no_daemon_reload_and_the_next_apply_runs_its_new_command(
    sandbox4, sandbox_inventory, job_name, tmp_path
):
    """destroy removes an ended job's units without a daemon-reload (PID 1 busy for
    0.1-0.5 s, every systemctl of the host waiting: a study's trials start there): systemd
    let the stopped units go, so they are "not-found" once their files are gone. A new
    apply of the same job then runs what its new unit file says, not the old one."""
    inv = tmp_path / "inv.yaml"
    task = "chief-0"
    pools = {"chief": {"replicas": 1, "command": ["/bin/sh", "-c", "echo run-one"]}}
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    host = placement(tmp_path, inv)[task]["host"]
    wait_until(lambda: unit_props(sandbox4, host, job_name, task)["ActiveState"] != "active", what="the task ended")
    since = sh(sandbox4, host, "date +%s", check=True).strip()
    r = cli("destroy", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    reloads = sh(sandbox4, host, f"journalctl _PID=1 --since=@{since} -o cat | grep -c '^Reloading'")
    assert reloads.strip() == "0", reloads
    unit = f"provision-{job_name}-{task}.service"
    assert sh(sandbox4, host, f"systemctl show -p LoadState --value {unit}").strip() == "not-found"

    pools = {"chief": {"replicas": 1, "command": ["/bin/sh", "-c", "echo run-two; exec sleep 600"]}}
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    since = sh(sandbox4, host, "date +%s", check=True).strip()
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    host = placement(tmp_path, inv)[task]["host"]
    ran = f"journalctl -u {unit} --since=@{since} -o cat"
    wait_until(lambda: "run-two" in sh(sandbox4, host, ran), what="the new command ran")
    assert "run-one" not in sh(sandbox4, host, ran)
    r = cli("destroy", "-y", inv, cwd=tmp_path)  # a running task: stopped, then let go too
    assert r.returncode == 0, r.stdout + r.stderr
    assert sh(sandbox4, host, f"systemctl show -p LoadState --value {unit}").strip() == "not-found"


def test_drift_is_planned_and_repaired(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 2, "command": LONG}}
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
    slots = placement(tmp_path, inv)
    chief_host, w1_host = slots["chief-0"]["host"], slots["worker-1"]["host"]
    env_file = f"/etc/provision/{job_name}/chief-0.env"
    sh(sandbox4, chief_host, f"sed -i 's/^PROVISION_TASK=.*/PROVISION_TASK=\"evil\"/' {env_file}")
    sh(sandbox4, w1_host, f"systemctl stop provision-{job_name}-worker-1.service")

    r = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{env_file} (edited by hand) [drift]" in r.stdout
    assert "task worker-1: start (drift: stopped by hand)" in r.stdout
    assert "- PROVISION_TASK='evil'" in r.stdout and "+ PROVISION_TASK='chief-0'" in r.stdout

    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert unit_props(sandbox4, w1_host, job_name, "worker-1")["ActiveState"] == "active"
    text = sh(sandbox4, chief_host, f"cat {env_file}")
    assert 'PROVISION_TASK="chief-0"' in text
    assert "No changes" in cli("plan", inv, cwd=tmp_path).stdout
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_unit_file_removed_under_a_running_task_restarts_it(sandbox4, sandbox_inventory, job_name, tmp_path):
    # systemd then reports the unit not-found but still active: apply must not take it for
    # a never-loaded unit (plain start, a no-op) but stop the old run and start a new one.
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(sandbox4, job=job_name, pools={"chief": {"replicas": 1, "command": LONG}}, path=inv)
    assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
    host = placement(tmp_path, inv)["chief-0"]["host"]
    unit = f"provision-{job_name}-chief-0.service"
    before = unit_props(sandbox4, host, job_name, "chief-0")
    sh(sandbox4, host, f"rm /etc/systemd/system/{unit} && systemctl daemon-reload")
    load = sh(sandbox4, host, f"systemctl show -p LoadState,ActiveState {unit}")
    assert "LoadState=not-found" in load and "ActiveState=active" in load, load
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    after = unit_props(sandbox4, host, job_name, "chief-0")
    assert after["ActiveState"] == "active" and after["InvocationID"] != before["InvocationID"]
    assert sh(sandbox4, host, f"test -f /etc/systemd/system/{unit}").code == 0
    assert "No changes" in cli("plan", inv, cwd=tmp_path).stdout
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_changing_worker_command_restarts_only_workers(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "command": LONG},
        "worker": {"replicas": 1, "command": LONG},
        "ps": {"replicas": 1, "command": LONG},
    }
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
    slots = placement(tmp_path, inv)
    before = {t: unit_props(sandbox4, s["host"], job_name, t) for t, s in slots.items()}

    pools["worker"]["command"] = ["/bin/sh", "-c", "echo changed; exec sleep 600"]
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "task worker-0: restart" in r.stdout
    assert "task chief-0" not in r.stdout and "task ps-0" not in r.stdout
    after = {t: unit_props(sandbox4, s["host"], job_name, t) for t, s in slots.items()}
    assert after["worker-0"]["MainPID"] != before["worker-0"]["MainPID"]
    for t in ("chief-0", "ps-0"):
        assert after[t]["InvocationID"] == before[t]["InvocationID"], t
        assert after[t]["ActiveState"] == "active"
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_shrink_and_grow_moves_no_task(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "accelerators": 1, "command": LONG},
        "worker": {"replicas": 3, "accelerators": 1, "command": LONG},
        "ps": {"replicas": 1, "command": LONG},
    }
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
    first = placement(tmp_path, inv)
    w2_host = first["worker-2"]["host"]

    pools["worker"]["replicas"] = 2
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "task worker-2: stop and remove" in r.stdout
    code = sh(
        sandbox4,
        w2_host,
        f"ls /etc/provision/{job_name}/worker-2.env /etc/systemd/system/provision-{job_name}-worker-2.service",
    ).code
    assert code != 0
    state = sh(sandbox4, w2_host, f"systemctl is-active provision-{job_name}-worker-2.service")
    assert state.strip() != "active"
    shrunk = placement(tmp_path, inv)
    assert {t: s for t, s in first.items() if t != "worker-2"} == shrunk

    pools["worker"]["replicas"] = 3
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    grown = placement(tmp_path, inv)
    for t, s in shrunk.items():
        assert grown[t] == s, t  # nobody moved
    cli("destroy", "-y", inv, cwd=tmp_path)


# --------------------------------------------------------------------------- failures


def test_unreachable_host_others_converge_exit_3(sandbox4, sandbox_inventory, job_name, tmp_path, docker_engine):
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 3, "command": LONG}}
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv, ssh={"connect_timeout": 2})
    # Learn the host keys and placement first, then pause one host (its sshd stops answering).
    assert cli("plan", inv, cwd=tmp_path).returncode == 0
    container = docker_engine.containers.get(host_of(sandbox4, "host-3").container)
    container.pause()
    try:
        t0 = time.monotonic()
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 3, r.stdout + r.stderr
        assert "Unreachable: host-3" in r.stderr
        assert time.monotonic() - t0 < 60
        for h in ("host-1", "host-2", "host-4"):
            out = sh(sandbox4, h, f"systemctl is-active 'provision-{job_name}-*'")
            assert "active" in out.split(), (h, out)
    finally:
        container.unpause()
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "+ task " in r.stdout and f"Resources: {marked(r.stdout, '+')} added" in r.stdout
    assert "No changes" in cli("plan", inv, cwd=tmp_path).stdout
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_sigkill_mid_apply_then_converges(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    payload = tmp_path / "payload"
    payload.mkdir()
    for i in range(4):  # enough bytes that the write step takes a while
        (payload / f"blob{i}.bin").write_bytes(os.urandom(6 * 2**20))
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 3, "command": LONG}}
    sandbox_inventory(
        sandbox4, job=job_name, pools=pools, path=inv, files=[{"src": "payload/", "dest": f"/opt/{job_name}/"}]
    )

    killed = 0
    for delay in (0.6, 1.2, 2.0):
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            killed += 1
        p.wait()
        for h in sandbox4.hosts:  # never a half-written file in place (the directory may be there alone)
            out = sh(sandbox4, h.name, f"cd /opt/{job_name} 2>/dev/null && sha256sum *.bin 2>/dev/null")
            for line in out.strip().splitlines():
                digest, name = line.split()
                assert digest == __import__("hashlib").sha256((payload / name).read_bytes()).hexdigest(), (h.name, name)
    assert killed >= 1

    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No changes" in cli("plan", inv, cwd=tmp_path).stdout
    for h in sandbox4.hosts:
        out = sh(
            sandbox4,
            h.name,
            f"find /opt/{job_name} /etc/provision/{job_name} /etc/systemd/system -name '*.provision-tmp'",
        )
        assert out.strip() == "", out
    cli("destroy", "-y", inv, cwd=tmp_path)
    for h in sandbox4.hosts:
        code = sh(sandbox4, h.name, f"test -e /opt/{job_name}").code
        assert code != 0


def test_second_concurrent_apply_is_refused(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "blob.bin").write_bytes(os.urandom(16 * 2**20))
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 3, "command": LONG}}
    sandbox_inventory(
        sandbox4, job=job_name, pools=pools, path=inv, files=[{"src": "payload/", "dest": f"/opt/{job_name}/"}]
    )
    lock = tmp_path / ".provision" / f"{job_name}.state.json.lock"
    first = subprocess.Popen(
        [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lock.exists, 20, 0.02, what=f"the first apply to take the lock ({lock})")
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 1
        holder = json.loads(lock.read_text())
        assert "state is locked: apply by" in r.stderr and f"pid {holder['pid']}" in r.stderr
        assert "Traceback" not in r.stderr
    finally:
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, out + err
    assert not lock.exists()
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_changed_host_key_is_refused(sandbox4, sandbox_inventory, tmp_path):
    sb, host = sandbox4, "host-4"  # the session's host, its own keys put back at the end
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}}
    sandbox_inventory(sb, job="keys", pools=pools, path=inv, hosts=[host])
    assert cli("plan", inv, cwd=tmp_path).returncode == 0  # accept-new learns the key
    known = (tmp_path / ".provision" / "known_hosts").read_text()
    assert "ssh-ed25519" in known

    # The host is "reinstalled": new host keys.
    keep = "/var/tmp/test-engine-host-keys"
    sh(sb, host, f"rm -rf {keep} && mkdir {keep} && cp -a /etc/ssh/ssh_host_* {keep}/", check=True)
    try:
        out = sh(sb, host, "rm -f /etc/ssh/ssh_host_* && ssh-keygen -A >/dev/null && systemctl restart ssh")
        code = out.code
        assert code == 0, out
        r = cli("plan", inv, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "host key changed" in r.stdout + r.stderr and "known_hosts" in r.stdout + r.stderr
        assert (tmp_path / ".provision" / "known_hosts").read_text() == known  # not silently replaced

        sandbox_inventory(sb, job="keys", pools=pools, path=inv, hosts=[host], ssh={"host_key_policy": "strict"})
        r = cli("plan", inv, cwd=tmp_path)
        assert r.returncode == 1 and "host key changed" in r.stdout + r.stderr
        # strict refuses a key it has never seen, too.
        (tmp_path / ".provision" / "known_hosts").unlink()
        r = cli("plan", inv, cwd=tmp_path)
        assert r.returncode == 1 and "unknown host key" in r.stdout + r.stderr and "strict" in r.stdout + r.stderr
    finally:
        cmd = f"rm -f /etc/ssh/ssh_host_* && cp -a {keep}/. /etc/ssh/ && rm -rf {keep} && systemctl restart ssh"
        sh(sb, host, cmd, check=True)


def test_user_errors_are_one_line(sandbox4, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox4,
        job="errs",
        pools={"chief": {"replicas": 1, "command": LONG}},
        path=inv,
        ssh={"identity_file": str(tmp_path / "missing_key")},
    )
    r = cli("plan", inv, cwd=tmp_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr + r.stdout
    assert "identity file not found" in r.stdout + r.stderr

    sandbox_inventory(
        sandbox4,
        job="errs",
        pools={"chief": {"replicas": 1, "command": LONG}},
        path=inv,
        secret_env=["PROVISION_TEST_SECRET"],
    )
    os.environ.pop("PROVISION_TEST_SECRET", None)
    r = cli("plan", inv, cwd=tmp_path)
    assert r.returncode == 1 and "secret_env[0]: PROVISION_TEST_SECRET is not set in this shell" in r.stderr
    r = cli("plan", "--target", "nope", inv, cwd=tmp_path, env={"PROVISION_TEST_SECRET": "s3cret"})
    assert r.returncode == 1 and "--target: no host named nope" in r.stderr


def test_secrets_reach_the_task_but_are_never_printed(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    secret = "hunter2-$ecret\"'`"
    sandbox_inventory(
        sandbox4, job=job_name, pools={"chief": {"replicas": 1, "command": LONG}}, path=inv, secret_env=["API_TOKEN"]
    )
    r = cli("apply", "-y", inv, cwd=tmp_path, env={"API_TOKEN": secret})
    assert r.returncode == 0, r.stdout + r.stderr
    host = placement(tmp_path, inv)["chief-0"]["host"]
    props = unit_props(sandbox4, host, job_name, "chief-0")
    assert proc_environ(sandbox4, host, props["MainPID"])["API_TOKEN"] == secret
    r = cli("plan", inv, cwd=tmp_path, env={"API_TOKEN": secret + "-rotated"})
    assert "API_TOKEN=(sensitive value)" in r.stdout
    everything = r.stdout + r.stderr + (tmp_path / ".provision" / f"{job_name}.state.json").read_text()
    assert "hunter2" not in everything
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_jump_host(sandbox4, sandbox_inventory, tmp_path):
    """host-2 is reached only through host-1 (ProxyJump): its address is a name that only
    resolves inside the sandbox network."""
    sb = sandbox4
    h1, h2 = sb.hosts[:2]
    inv = tmp_path / "inv.yaml"
    data = sandbox_inventory(sb, job="jump", pools={"chief": {"replicas": 1, "command": LONG}}, hosts=["host-2"])
    data["hosts"][0].update(address=h2.container, port=22)
    data["ssh"]["jump_host"] = f"root@127.0.0.1:{h1.ssh_port}"
    import yaml

    inv.write_text(yaml.safe_dump(data))
    try:
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        out = sh(sb, "host-2", "systemctl is-active provision-jump-chief-0.service")
        assert out.strip() == "active"
        known = (tmp_path / ".provision" / "known_hosts").read_text()
        assert h2.container in known and f"[127.0.0.1]:{h1.ssh_port}" in known  # both keys checked
    finally:
        assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0


def test_facts_mismatch_stops_apply_before_anything_is_written(sandbox4, sandbox_inventory, job_name, tmp_path):
    import yaml

    inv = tmp_path / "inv.yaml"
    data = sandbox_inventory(
        sandbox4,
        job=job_name,
        pools={
            "chief": {"replicas": 1, "accelerators": 1, "command": LONG},
            "worker": {"replicas": 3, "command": LONG},
        },
    )
    data["hosts"][1]["accelerators"]["count"] = 4  # host-2 has 2 (nvidia-smi says so)
    inv.write_text(yaml.safe_dump(data))
    r = cli("facts", inv, cwd=tmp_path)
    assert r.returncode == 1 and "declares 4 nvidia-h100, but nvidia-smi reports 2" in r.stdout
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "host-2 (127.0.0.1:" in r.stderr and "nvidia-smi reports 2" in r.stderr and "nothing was changed" in r.stderr
    for h in sandbox4.hosts:
        code = sh(sandbox4, h.name, f"test -e /etc/provision/{job_name}").code
        assert code != 0, h.name
    r = cli("facts", "--json", inv, cwd=tmp_path)
    facts = json.loads(r.stdout)["hosts"]
    assert facts["host-1"]["gpus"] == 2 and len(facts["host-1"]["gpu_uuids"]) == 2


def test_host_leaving_the_job_is_cleaned(sandbox4, sandbox_inventory, job_name, tmp_path):
    """A host that no longer runs any task loses everything of the job; so does one
    removed from the inventory altogether (the state remembers how to reach it)."""
    inv = tmp_path / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "command": LONG, "hosts": ["host-1"]},
        "worker": {"replicas": 2, "command": LONG, "hosts": ["host-2", "host-3"]},
    }
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
    pools["worker"] = {"replicas": 1, "command": LONG, "hosts": ["host-2"]}
    data = sandbox_inventory(sandbox4, job=job_name, pools=pools)
    data["hosts"] = [h for h in data["hosts"] if h["name"] != "host-3"]  # gone from the file
    import yaml

    inv.write_text(yaml.safe_dump(data))
    r = cli("plan", inv, cwd=tmp_path)
    assert "host-3 (127.0.0.1:" in r.stdout and "(the job leaves this host)" in r.stdout, r.stdout
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = sh(
        sandbox4,
        "host-3",
        f"ls /etc/provision/{job_name} /var/lib/provision/{job_name} /etc/systemd/system/provision-{job_name}* 2>&1; systemctl is-active provision-{job_name}-worker-1.service",
    )
    assert "No such file" in out and "active" not in out.split(), out
    state = json.loads((tmp_path / ".provision" / f"{job_name}.state.json").read_text())
    assert "host-3" not in state["hosts"]
    assert "No changes" in cli("plan", inv, cwd=tmp_path).stdout
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_a_converged_host_is_settled_with_or_without_its_interface(sandbox4, sandbox_inventory, job_name, tmp_path):
    # After an apply, every host holds what the state says: the next plan asks it only the
    # settled probe (engine.settled), whether the tasks' env takes the host's interface
    # (found at the apply and kept in the state) or the inventory sets it.
    from provision.run import context as engine

    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 3, "command": LONG}}
    for env in ({}, {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}):
        inv = tmp_path / "inv.yaml"
        sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv, env=env)
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        ctx = engine.open_context(str(inv))
        try:
            names = sorted(ctx.rendered.hosts)
            assert len(names) == 4 and all(engine.settled(ctx, n) for n in names), (env, ctx.ifnames)
        finally:
            ctx.close()
        r = cli("destroy", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
