"""ssh.Connection resolves a host as fabric's Connection did for us: ssh_config's HostName,
User, Port, IdentityFile, ProxyJump and ProxyCommand where the inventory is silent, the
inventory's values where it is not (a table, on a temporary ssh_config; no network). And
importing provision.io.ssh imports neither fabric nor invoke (issue 17: ~50 ms of start-up)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import paramiko
import pytest

from provision.core.target import Target
from provision.io import ssh
from provision.io.ssh import Connection, KnownHosts, Session

SRC = Path(__file__).resolve().parent.parent / "src"

SSH_CONFIG = """\
Host alias
    HostName 192.0.2.5
    User alice
    Port 2222
    IdentityFile ~/.ssh/alias_key

Host viacmd
    HostName 192.0.2.6
    ProxyCommand nc %h %p

Host nocmd
    ProxyCommand none

Host viajump
    HostName 10.0.0.7
    ProxyJump ops@bastion:2200

Host bastion
    HostName 192.0.2.1
    User bastionuser
    IdentityFile ~/.ssh/bastion_key

Host twohops
    ProxyJump first,second:2022

Host *.internal
    ProxyJump gw.internal
"""


@pytest.fixture
def ssh_config(tmp_path, monkeypatch):
    """The temporary ssh_config in place of ~/.ssh/config and /etc/ssh/ssh_config."""
    path = tmp_path / "ssh_config"
    path.write_text(SSH_CONFIG)
    monkeypatch.setattr(ssh, "_SSH_CONFIG_FILES", (str(path), str(tmp_path / "absent")))
    monkeypatch.setattr(ssh, "_ssh_config", None)
    return path


HOME = os.path.expanduser("~")
ME = ssh._local_user()

# address, inventory's (user, port, identity_file) -> host, user, port, key files, the name
# host keys are looked up by
RESOLUTION = [
    ("192.0.2.9", (None, None, None), ("192.0.2.9", ME, 22, [], "192.0.2.9")),
    ("192.0.2.9", ("root", 2200, "/k"), ("192.0.2.9", "root", 2200, ["/k"], "[192.0.2.9]:2200")),
    ("alias", (None, None, None), ("192.0.2.5", "alice", 2222, [f"{HOME}/.ssh/alias_key"], "[192.0.2.5]:2222")),
    # the inventory wins over User and Port; its identity file is tried before IdentityFile
    ("alias", ("root", 22, "/k"), ("192.0.2.5", "root", 22, ["/k", f"{HOME}/.ssh/alias_key"], "192.0.2.5")),
    ("alias", ("root", None, None), ("192.0.2.5", "root", 2222, [f"{HOME}/.ssh/alias_key"], "[192.0.2.5]:2222")),
    ("alias", (None, 2022, None), ("192.0.2.5", "alice", 2022, [f"{HOME}/.ssh/alias_key"], "[192.0.2.5]:2022")),
    ("ALIAS", (None, None, None), ("ALIAS", ME, 22, [], "ALIAS")),  # Host patterns are case-sensitive
]


@pytest.mark.parametrize(("address", "given", "expected"), RESOLUTION)
def test_ssh_config_fills_what_the_inventory_leaves_out(ssh_config, address, given, expected):
    user, port, key = given
    conn = ssh._connection(Target("h", address, port=port, user=user, identity_file=key))
    host, user, port, keys, key_id = expected
    assert (conn.host, conn.user, conn.port) == (host, user, port)
    assert conn.connect_kwargs.get("key_filename", []) == keys
    assert ssh._key_id(conn.host, conn.port) == key_id
    assert conn.gateway is None


# address -> the gateway: None, a ProxyCommand string, or the chain of jump hosts (nearest
# to the target first) as (host, user, port)
GATEWAYS = [
    ("alias", None),
    ("viacmd", "nc 192.0.2.6 22"),
    ("nocmd", None),  # "ProxyCommand none"
    ("viajump", [("192.0.2.1", "ops", 2200)]),  # the hop is resolved through ssh_config too
    ("twohops", [("second", ME, 2022), ("first", ME, 22)]),  # as ssh: `first` is dialled first
    ("db.internal", [("gw.internal", ME, 22)]),
    ("gw.internal", None),  # a wildcard's ProxyJump to the jump host itself
]


def chain(conn: Connection) -> list[tuple[str, str | None, int]] | str | None:
    if not isinstance(conn.gateway, Connection):
        return conn.gateway
    hops = []
    g: object = conn.gateway
    while isinstance(g, Connection):
        hops.append((g.host, g.user, g.port))
        g = g.gateway
    return hops


@pytest.mark.parametrize(("address", "expected"), GATEWAYS)
def test_proxyjump_and_proxycommand_from_ssh_config(ssh_config, address, expected):
    assert chain(ssh._connection(Target("h", address))) == expected


def test_a_proxyjump_hop_gets_its_own_identity_files(ssh_config):
    hop = ssh._connection(Target("h", "viajump", identity_file="/k")).gateway
    assert isinstance(hop, Connection)
    assert hop.connect_kwargs["key_filename"] == [f"{HOME}/.ssh/bastion_key"]  # not the target's /k


def test_the_inventorys_jump_host_wins_over_proxyjump(ssh_config):
    target = Target("h", "viajump", jump_host="root@alias:2022")
    jump = ssh._connection(ssh._parse_jump("root@alias:2022", target))
    conn = ssh._connection(target, jump)
    assert chain(conn) == [("192.0.2.5", "root", 2022)]
    assert jump.connect_kwargs["key_filename"] == [f"{HOME}/.ssh/alias_key"]


class FakeClient:
    def __init__(self) -> None:
        self.kwargs: dict = {}

    def connect(self, **kwargs) -> None:
        self.kwargs = kwargs

    def get_transport(self) -> None:
        return None

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("address", "own_socket"), [("alias", True), ("viacmd", False), ("nocmd", True)])
def test_only_a_direct_connection_gets_a_socket_of_our_own(ssh_config, monkeypatch, address, own_socket):
    dialled: list[tuple[str, int]] = []
    monkeypatch.setattr(ssh, "_tcp", lambda host, port, timeout: dialled.append((host, port)) or "our socket")
    monkeypatch.setattr(ssh.paramiko, "ProxyCommand", lambda command: f"proxy: {command}")
    conn = ssh._connection(Target("h", address, port=2200))
    conn.client = FakeClient()
    ssh._open(conn, 5.0)
    kwargs = conn.client.kwargs
    assert (kwargs["hostname"], kwargs["port"], kwargs["username"]) == (conn.host, 2200, conn.user)
    if own_socket:
        assert dialled == [(conn.host, 2200)] and kwargs["sock"] == "our socket"
    else:
        assert dialled == [] and kwargs["sock"] == "proxy: nc 192.0.2.6 22"  # %p: ssh_config's, as with fabric


def test_host_keys_are_checked_on_proxyjump_hops_too(ssh_config, tmp_path, monkeypatch):
    made: list[Connection] = []
    real = ssh._connection
    monkeypatch.setattr(ssh, "_connection", lambda *a: made.append(real(*a)) or made[-1])

    def refuse(conn, timeout):
        raise paramiko.AuthenticationException("no")

    monkeypatch.setattr(ssh, "_open", refuse)
    session = Session(KnownHosts(tmp_path / "known_hosts"))
    with pytest.raises(ssh.HostError, match="authentication failed"):
        session._dial(Target("h", "viajump", host_key_policy="strict"))
    hop = made[0].gateway
    assert isinstance(hop, Connection)
    assert isinstance(hop.client._policy, ssh._Policy)


def test_ssh_config_is_parsed_once_for_all_threads(ssh_config, monkeypatch):
    calls: list[object] = []
    real = ssh._load_ssh_config

    def load(paths):
        calls.append(paths)
        return real(paths)

    monkeypatch.setattr(ssh, "_load_ssh_config", load)
    threads = [threading.Thread(target=ssh._ssh_lookup, args=("alias",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert ssh._ssh_lookup("alias")["hostname"] == "192.0.2.5"


def test_an_unreadable_ssh_config_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "ssh_config"
    path.write_text('Host "unterminated\n    User x\n')
    with pytest.raises(ssh.ProvisionError, match="cannot read this ssh_config file"):
        ssh._load_ssh_config([str(path)])


def python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_importing_provision_ssh_imports_neither_fabric_nor_invoke():
    out = python("import sys, provision.io.ssh; print(sorted({'fabric', 'invoke'} & set(sys.modules)))")
    assert out.strip() == "[]"


def test_match_exec_still_works_and_fabric_still_imports_after(tmp_path):
    path = tmp_path / "ssh_config"
    path.write_text('Match exec "true"\n    HostName 192.0.2.77\n')
    code = (
        "import provision.io.ssh as s, fabric\n"
        f"print(s._load_ssh_config([{str(path)!r}]).lookup('x')['hostname'], fabric.Connection.__name__)"
    )
    assert python(code).split() == ["192.0.2.77", "Connection"]
