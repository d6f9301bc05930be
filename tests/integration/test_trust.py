"""Issue 28, items 1-5: provision's directories on a host that another user could change are
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
