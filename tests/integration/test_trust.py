"""items 1-5: provision's directories on a host that another user could change are
refused, in one line naming the path, its owner and mode, before anything runs as root;
the env file is read as data. On real sandbox hosts, with a non-root user made there."""

from __future__ import annotations

import pytest

from clirun import cli, ok, sh

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]


@pytest.fixture(scope="module")
def host(sandbox_factory):
    sb = sandbox_factory(hosts=1)
    sh(sb, "host-1", "id alice >/dev/null 2>&1 || useradd alice", check=True)
    yield sb
    sandbox_factory.down(sb)


SPOILED = [
    # (what the user could change, how it got so, how it is put back)
    ("/var/cache/provision", "chown alice /var/cache/provision", "chown root /var/cache/provision"),
    ("/var/lib/provision", "chown alice /var/lib/provision", "chown root /var/lib/provision"),
    ("/etc/provision/trust", "chown alice /etc/provision/trust", "chown root /etc/provision/trust"),
    ("/var/lib/provision/trust", "chown alice /var/lib/provision/trust", "chown root /var/lib/provision/trust"),
    ("/var/lib/provision/.ledger", "chmod 0777 /var/lib/provision/.ledger", "chmod 0755 /var/lib/provision/.ledger"),
]


@pytest.mark.parametrize("path,spoil,repair", SPOILED, ids=[p for p, _, _ in SPOILED])
def test_a_directory_another_user_could_change_is_refused(host, sandbox_inventory, tmp_path, path, spoil, repair):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(host, job="trust", pools={"chief": {"replicas": 1, "command": LONG}}, path=inv)
    ok(cli("apply", "-y", inv, cwd=tmp_path))
    sh(host, "host-1", spoil, check=True)
    try:
        # Every command that runs something as root there refuses, naming the path.
        for args in (["facts", inv], ["apply", "-y", "--replace", "chief-0", inv], ["destroy", "-y", inv]):
            r = cli(*args, cwd=tmp_path)
            assert r.returncode != 0, (args, r.stdout, r.stderr)
            out = r.stdout + r.stderr  # facts shows a host's error in its table
            assert path in out and ("owned by uid" in out or "writable by group" in out), out
            assert "Traceback" not in out
        # The task was left as it was.
        assert sh(host, "host-1", "systemctl is-active provision-trust-chief-0").strip() == "active"
        if path.startswith("/etc/provision"):
            r = cli("exec", inv, "chief-0", "--", "true", cwd=tmp_path)
            assert r.returncode != 0 and path in r.stderr, r.stderr
    finally:
        sh(host, "host-1", repair, check=True)
        ok(cli("destroy", "-y", inv, cwd=tmp_path))


def test_a_planted_env_file_is_data_not_shell(host, sandbox_inventory, tmp_path):
    """exec sourced the env file with sh as root; a line of shell in it ran."""
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(host, job="trust", pools={"chief": {"replicas": 1, "command": LONG}}, path=inv)
    ok(cli("apply", "-y", inv, cwd=tmp_path))
    try:
        env = "/etc/provision/trust/chief-0.env"
        sh(host, "host-1", f"echo 'touch /tmp/pwned' >> {env}", check=True)
        r = cli("exec", inv, "chief-0", "--", "true", cwd=tmp_path)
        assert r.returncode != 0 and "is not KEY=" in r.stderr, r.stderr
        assert sh(host, "host-1", "test -e /tmp/pwned").code != 0
    finally:
        ok(cli("destroy", "-y", inv, cwd=tmp_path))


def test_a_racing_swap_of_the_agent_cache_never_runs_planted_code(host, sandbox_inventory, tmp_path):
    """Item 1 as the round did it: /var/cache/provision owned by a user, who swaps a planted
    `agent` directory in and out in a loop while provision runs. The agent refuses the
    host (its cache's parent fails the check) and no planted code ever runs."""
    import marshal

    from provision.host import bundle

    inv = tmp_path / "inv.yaml"
    sandbox_inventory(host, job="trust", pools={"chief": {"replicas": 1, "command": LONG}}, path=inv)
    ok(cli("facts", inv, cwd=tmp_path))  # the real cache is there
    tag = sh(host, "host-1", "python3 -c 'import sys; print(sys.implementation.cache_tag)'", check=True).strip()
    evil = marshal.dumps(compile("open('/tmp/canary', 'w').close()\n", "evil", "exec"))
    names = [f"provision.host.{m}-{bundle._key(m)}.{tag}" for m in bundle.MODULES]
    files = {f"/var/cache/provision/planted/{n}": evil.hex() for n in names}
    plant = (
        "import binascii, os, sys; os.makedirs('/var/cache/provision/planted', exist_ok=True)\n"
        f"for p, h in {files!r}.items():\n    open(p, 'wb').write(binascii.unhexlify(h))\n"
    )
    swap = (
        "cd /var/cache/provision; end=$(($(date +%s) + 20)); while [ $(date +%s) -lt $end ]; do "
        "mv agent real 2>/dev/null; mv planted agent 2>/dev/null; mv agent planted 2>/dev/null; "
        "mv real agent 2>/dev/null; done"
    )
    try:
        sh(host, "host-1", "rm -f /tmp/canary; chown alice /var/cache/provision", check=True)
        code, out = host.docker_exec("host-1", ["runuser", "-u", "alice", "--", "python3", "-c", plant])
        assert code == 0, out
        racer = host.docker_exec("host-1", ["runuser", "-u", "alice", "--", "sh", "-c", f"setsid sh -c '{swap}' &"])
        assert racer[0] == 0, racer
        assert sh(host, "host-1", "pgrep -u alice").code == 0  # the racer runs
        for _ in range(5):
            r = cli("facts", inv, cwd=tmp_path)
            assert r.returncode != 0 and "/var/cache/provision is owned by uid" in r.stdout + r.stderr
        assert sh(host, "host-1", "test -e /tmp/canary").code != 0
    finally:
        sh(
            host,
            "host-1",
            "pkill -u alice; sleep 0.2; cd /var/cache/provision && "
            "{ [ -d real ] && rm -rf agent && mv real agent; rm -rf planted; chown root /var/cache/provision; }",
        )


def test_outputs_a_user_could_redirect_are_refused(host, sandbox_inventory, tmp_path):
    """as found: a user who owns /data makes /data/runs a link to root's
    directory; apply made model/ checkpoints/ logs/ there as root, and fetch brought root's
    files back. Now apply refuses in one line naming the host and the path (exit 1, nothing
    written), a task's start refuses too (its unit's guard), and so does fetch."""
    inv = tmp_path / "inv.yaml"
    unit = "provision-trust-out-chief-0.service"
    setup = (
        "rm -rf /data-alice /data-ok /root/x; mkdir -p /data-alice /data-ok /root/x; echo secret > /root/x/key; "
        "chown alice /data-alice"
    )
    sh(host, "host-1", setup, check=True)
    sh(host, "host-1", "runuser -u alice -- ln -s /root/x /data-alice/runs", check=True)
    try:
        sandbox_inventory(
            host,
            job="trust-out",
            path=inv,
            outputs="/data-alice/runs",
            pools={"chief": {"replicas": 1, "command": LONG}},
        )
        r = cli("apply", "-y", inv, cwd=tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        assert "host-1" in out and "/data-alice is owned by uid" in out and "Traceback" not in out, out
        assert sh(host, "host-1", "ls /root/x").strip() == "key"
        assert sh(host, "host-1", f"test -e /etc/systemd/system/{unit}").code != 0  # nothing half-made

        # Root's directory, then given to the user, who swaps runs for the link.
        sandbox_inventory(
            host, job="trust-out", path=inv, outputs="/data-ok/runs", pools={"chief": {"replicas": 1, "command": LONG}}
        )
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert sh(host, "host-1", "ls /data-ok/runs").split() == ["checkpoints", "logs", "model"]
        sh(host, "host-1", "chown alice /data-ok", check=True)
        sh(host, "host-1", "runuser -u alice -- sh -c 'mv /data-ok/runs /data-ok/old; ln -s /root/x /data-ok/runs'")
        r = cli("fetch", inv, "-o", tmp_path / "out", cwd=tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and "/data-ok is owned by uid" in out and "Traceback" not in out, out
        assert not (tmp_path / "out" / "key").exists()
        # The unit's guard, at a start apply did not see (systemd's, a reboot's).
        assert sh(host, "host-1", f"systemctl restart {unit}").code != 0
        assert sh(host, "host-1", "ls /root/x").strip() == "key"
        assert "/data-ok is owned by uid" in sh(host, "host-1", f"journalctl -u {unit} -n 20 --no-pager")
    finally:
        sh(host, "host-1", "rm -f /data-ok/runs; chown root /data-ok")
        cli("destroy", "-y", inv, cwd=tmp_path)
        sh(host, "host-1", "rm -rf /data-alice /data-ok /root/x")


def test_a_drop_in_that_replaces_what_a_task_runs_is_drift(host, sandbox_inventory, tmp_path):
    """as found: a drop-in beside a task's unit replaced its ExecStart=, and
    `plan` said "No changes" while the host ran something else. Now plan shows each drop-in
    of the job's units as drift (one beside the unit, one for every provision unit by a name
    prefix, in /run) and apply removes them, reloads systemd and restarts the task."""
    inv = tmp_path / "inv.yaml"
    unit = "provision-trust-drop-chief-0.service"
    beside = f"/etc/systemd/system/{unit}.d/override.conf"
    prefix = "/run/systemd/system/provision-trust-drop-.service.d/env.conf"
    sandbox_inventory(host, job="trust-drop", path=inv, pools={"chief": {"replicas": 1, "command": LONG}})
    try:
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert "No changes" in ok(cli("plan", inv, cwd=tmp_path)).stdout
        plant = (
            f"mkdir -p {beside.rsplit('/', 1)[0]} {prefix.rsplit('/', 1)[0]}; "
            f"printf '[Service]\\nExecStart=\\nExecStart=/bin/sh -c \"exec sleep 601\"\\n' > {beside}; "
            f"printf '[Service]\\nEnvironment=PLANTED=1\\n' > {prefix}; "
            f"systemctl daemon-reload; systemctl restart {unit}"
        )
        sh(host, "host-1", plant, check=True)
        assert "sleep 601" in sh(host, "host-1", f"systemctl show -p ExecStart {unit}")
        r = cli("plan", inv, cwd=tmp_path)
        out = r.stdout + r.stderr
        assert "No changes" not in out, out
        for path in (beside, prefix):
            assert f"- unit {path} (a drop-in provision did not write: it changes what {unit} runs) [drift]" in out
        assert "task chief-0: restart" in out, out
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert sh(host, "host-1", f"ls {beside} {prefix}").code != 0
        shown = sh(host, "host-1", f"systemctl show -p ExecStart -p DropInPaths -p Environment {unit}")
        assert "sleep 601" not in shown and "PLANTED" not in shown and "sleep 600" in shown, shown
        assert sh(host, "host-1", f"systemctl is-active {unit}").strip() == "active"
        assert "No changes" in ok(cli("plan", inv, cwd=tmp_path)).stdout
    finally:
        sh(host, "host-1", f"rm -rf {beside.rsplit('/', 1)[0]} {prefix.rsplit('/', 1)[0]}; systemctl daemon-reload")
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_a_planted_agent_cache_does_not_survive_an_ownership_fix(host, sandbox_inventory, tmp_path):
    """as found: while a user owned the agent's cache directory they
    replaced its files with their own code; an administrator gave the directories back to
    root; the agent then loaded the user's files as root. Each file is checked now (root's,
    one link, only root may write), and a planted one is compiled again in its place."""
    import marshal

    from provision.host import bundle

    inv = tmp_path / "inv.yaml"
    sandbox_inventory(host, job="trust", pools={"chief": {"replicas": 1, "command": LONG}}, path=inv)
    ok(cli("facts", inv, cwd=tmp_path))  # the real cache is there
    tag = sh(host, "host-1", "python3 -c 'import sys; print(sys.implementation.cache_tag)'", check=True).strip()
    evil = marshal.dumps(compile("open('/tmp/canary', 'w').close()\n", "evil", "exec"))
    cache = "/var/cache/provision/agent"
    files = [f"{cache}/provision.host.{m}-{bundle._key(m)}.{tag}" for m in bundle.MODULES if m != "trust"]
    plant = (
        "import binascii, os\n"
        f"for p in {files!r}:\n"
        "    os.unlink(p)\n"
        f"    open(p, 'wb').write(binascii.unhexlify({evil.hex()!r}))\n"
    )
    try:
        sh(host, "host-1", f"rm -f /tmp/canary; chown alice /var/cache/provision {cache}", check=True)
        code, out = host.docker_exec("host-1", ["runuser", "-u", "alice", "--", "python3", "-c", plant])
        assert code == 0, out
        sh(host, "host-1", f"chown root /var/cache/provision {cache}", check=True)  # the administrator's fix
        ok(cli("facts", inv, cwd=tmp_path))
        assert sh(host, "host-1", "test -e /tmp/canary").code != 0, "the planted code ran as root"
        owners = sh(host, "host-1", f"stat -c %U {' '.join(files)}", check=True).split()
        assert owners == ["root"] * len(files), owners  # compiled again in their place
    finally:
        sh(host, "host-1", "chown -R root /var/cache/provision; rm -f /tmp/canary")
