"""Connections are fabric's (io/connection.py): ssh_config's HostName, User, Port,
IdentityFile, ProxyJump and ProxyCommand where the inventory is silent, the inventory's
values where it is not (a table, on a temporary ssh_config; no network); one fabric.Config
shared by every connection of a Session; host keys checked on every hop."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import fabric
import paramiko
import pytest

from provision.core.errors import ProvisionError
from provision.core.target import Target
from provision.io import connection as C
from provision.io import ssh
from provision.io.connection import Connection, _Transport, new_config
from provision.io.hostkeys import KnownHosts, MissingKeyPolicy, key_id
from provision.io.ssh import Session

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
    """A fabric.Config reading the temporary ssh_config in place of ~/.ssh/config and
    /etc/ssh/ssh_config; Sessions made in the test use it too."""
    path = tmp_path / "ssh_config"
    path.write_text(SSH_CONFIG)
    config = new_config(str(path), str(tmp_path / "absent"))
    monkeypatch.setattr(ssh, "new_config", lambda: config)
    return config


def connect_to(target: Target, config: fabric.Config) -> Connection:
    return Connection.to(target, config)


HOME = os.path.expanduser("~")
ME = C._local_user()

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
    conn = connect_to(Target("h", address, port=port, user=user, identity_file=key), ssh_config)
    assert isinstance(conn, fabric.Connection)
    host, user, port, keys, name = expected
    assert (conn.host, conn.user, conn.port) == (host, user, port)
    assert conn.connect_kwargs.get("key_filename", []) == keys
    assert key_id(conn.host, conn.port) == name
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
    assert chain(connect_to(Target("h", address), ssh_config)) == expected


def test_a_proxyjump_hop_gets_its_own_identity_files(ssh_config):
    hop = connect_to(Target("h", "viajump", identity_file="/k"), ssh_config).gateway
    assert isinstance(hop, Connection)
    assert hop.connect_kwargs["key_filename"] == [f"{HOME}/.ssh/bastion_key"]  # not the target's /k


def test_the_inventorys_jump_host_wins_over_proxyjump(ssh_config):
    conn = connect_to(Target("h", "viajump", jump_host="root@alias:2022"), ssh_config)
    assert chain(conn) == [("192.0.2.5", "root", 2022)]
    assert conn.gateway.connect_kwargs["key_filename"] == [f"{HOME}/.ssh/alias_key"]


def test_every_connection_shares_one_config_and_none_edits_it(ssh_config):
    conns = [connect_to(Target("h", a), ssh_config) for a in ("alias", "viajump", "192.0.2.9")]
    assert all(c.config is ssh_config for c in conns)
    hops = conns[1].hops()
    assert len(hops) >= 2 and all(h.config is ssh_config for h in hops)  # itself and its jump host
    conns[0].connect_kwargs["sock"] = "mine"
    assert "sock" not in conns[2].connect_kwargs and "sock" not in ssh_config.connect_kwargs


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
    monkeypatch.setattr(C, "tcp", lambda host, port, timeout: dialled.append((host, port)) or "our socket")
    monkeypatch.setattr(fabric.connection, "ProxyCommand", lambda command: f"proxy: {command}")
    conn = connect_to(Target("h", address, port=2200), ssh_config)
    conn.client = FakeClient()
    conn.open()
    kwargs = conn.client.kwargs
    assert (kwargs["hostname"], kwargs["port"], kwargs["username"]) == (conn.host, 2200, conn.user)
    if own_socket:
        assert dialled == [(conn.host, 2200)] and kwargs["sock"] == "our socket"
    else:
        assert dialled == [] and kwargs["sock"] == "proxy: nc 192.0.2.6 22"  # %p: ssh_config's, as with fabric


def test_host_keys_are_checked_on_proxyjump_hops_too(ssh_config, tmp_path, monkeypatch):
    made: list[Connection] = []

    def refuse(conn):
        made.append(conn)
        raise paramiko.AuthenticationException("no")

    monkeypatch.setattr(Connection, "open", refuse)
    session = Session(KnownHosts(tmp_path / "known_hosts"))
    with pytest.raises(ssh.HostError, match="authentication failed"):
        session._dial(Target("h", "viajump", host_key_policy="strict"))
    hop = made[0].gateway
    assert isinstance(hop, Connection)
    assert isinstance(hop.client._policy, MissingKeyPolicy)


def test_ssh_config_is_read_once_per_session(tmp_path, monkeypatch):
    calls: list[object] = []
    real = ssh.new_config
    monkeypatch.setattr(ssh, "new_config", lambda: calls.append(1) or real(str(tmp_path / "a"), str(tmp_path / "b")))
    monkeypatch.setattr(Connection, "open", lambda conn: None)
    session = Session(KnownHosts(tmp_path / "known_hosts"))
    threads = [threading.Thread(target=session._dial, args=(Target(f"h{i}", f"192.0.2.{i}"),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def test_an_unreadable_ssh_config_is_one_line(tmp_path):
    path = tmp_path / "ssh_config"
    path.write_text('Host "unterminated\n    User x\n')
    with pytest.raises(ProvisionError, match="cannot read it"):
        new_config(str(path), str(tmp_path / "absent"))


def python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_commands_that_need_no_host_do_not_load_the_ssh_layer():
    """`provision validate` and `--help` start without paramiko or fabric (start-up time)."""
    code = (
        "import sys\nfrom provision.cli.app import main\n"
        "try:\n    main(['validate', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({'fabric', 'invoke', 'paramiko'} & set(sys.modules)))"
    )
    assert python(code).strip().splitlines()[-1] == "[]"


def test_connections_prefer_aes_gcm_and_idle_quietly() -> None:
    """paramiko's defaults cost the controller: CTR + an HMAC checked byte by byte in Python,
    and every idle connection's thread awake ten times a second (the service keeps 128)."""
    assert _Transport._preferred_ciphers[0].startswith("aes128-gcm")
    assert set(_Transport._preferred_ciphers) == set(paramiko.Transport._preferred_ciphers)  # type: ignore[attr-defined]
    assert _Transport._active_check_timeout >= 1.0
    conn = Connection("h", config=fabric.Config())
    assert conn.connect_kwargs["transport_factory"] is _Transport
