"""Issue 28, items 1-5: provision's directories on a host that another user could change are
refused, in one line naming the path, its owner and mode, before anything runs as root;
the env file is read as data. On real sandbox hosts, with a non-root user made there."""

from __future__ import annotations

import pytest

from .clirun import cli, ok, sh

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
