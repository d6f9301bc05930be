"""One SSH connection: fabric's Connection, opened the way provision needs.

fabric resolves what a connection is (ssh_config's HostName, User, Port, IdentityFile,
ProxyJump or ProxyCommand; the inventory's user, port and key win), from ONE fabric.Config
that a Session shares, so ssh_config files are read once per command, not per host.
This subclass changes only how it opens:

- its own TCP socket (TCP_NODELAY: Nagle plus delayed ACKs cost ~40 ms at authentication
  and at every command; an ASCII name looked up as bytes, which spares the idna codec's
  import);
- a ProxyJump's hops in OpenSSH's order (the first hop dialled first), every hop sharing the
  Config and getting its own host-key check (io/hostkeys), a jump host's channel bounded by
  connect_timeout;
- connect_timeout kept as given (fabric rounds it to whole seconds).

Commands then run on raw channels of the connection's transport (io/ssh.Session.run):
invoke's runner (threads and sleep-polling per command) costs more than a round trip.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import os
import socket
from collections.abc import Iterable
from typing import Any

import fabric
import paramiko

from provision.core.errors import ProvisionError
from provision.core.target import Target

MAX_HOPS = 8


def new_config(user_ssh_path: str = "~/.ssh/config", system_ssh_path: str = "/etc/ssh/ssh_config") -> fabric.Config:
    """The Config every connection of a Session shares: the user's and the system's
    ssh_config, read once; no Fabric/Invoke config files (provision's settings come from
    the inventory)."""
    config = fabric.Config(lazy=True, user_ssh_path=user_ssh_path, system_ssh_path=system_ssh_path)
    user = _local_user()
    if user is not None:
        config.user = user
    try:
        config.load_ssh_config()
    except (OSError, UnicodeDecodeError, paramiko.ssh_exception.ConfigParseError) as e:
        raise ProvisionError(f"ssh_config ({user_ssh_path} or {system_ssh_path}): cannot read it: {e}") from None
    return config


def _local_user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name (a container with an unknown uid)
        return None


# paramiko's own order (not in its type stubs: a private attribute, documented in its source).
_CIPHERS: tuple[str, ...] = paramiko.Transport._preferred_ciphers  # type: ignore[attr-defined]


class _Transport(paramiko.Transport):
    """paramiko's, with AES-GCM first among the ciphers (paramiko prefers CTR with an HMAC,
    whose check it does byte by byte in Python: ~15 % of a round trip's controller CPU; a
    server without GCM gets CTR, as before), and idle connections that sleep longer."""

    _preferred_ciphers = tuple(c for c in _CIPHERS if "-gcm@" in c) + tuple(c for c in _CIPHERS if "-gcm@" not in c)
    # How often an idle connection's thread wakes to see whether it was closed (paramiko:
    # 0.1 s). Ten wake-ups a second per host were most of an idle service's CPU (128 hosts
    # kept open); data and close() do not wait for it (close marks the packetizer closed).
    _active_check_timeout = 5.0

    def close(self) -> None:
        """paramiko's close, after waking its thread: a recv() does not return when another
        thread closes its socket, and the thread would sleep on for the timeout above (an
        evicted connection's thread outliving it: --parallelism bounds the threads)."""
        with contextlib.suppress(Exception):  # a socket or channel already closed or broken
            self.sock.shutdown(socket.SHUT_RDWR)
        super().close()


class Connection(fabric.Connection):
    """fabric.Connection that opens on provision's socket and hop order (module docstring)."""

    _hops = 0
    # A class attribute, as fabric has for its other settings: otherwise invoke's DataProxy
    # takes fabric's `self.inline_ssh_env = ...` for a config change and re-merges the
    # shared Config at every connection (~1 ms of controller CPU per host).
    inline_ssh_env = None

    def __init__(
        self,
        host: str,
        *,
        config: fabric.Config,
        user: str | None = None,
        port: int | None = None,
        key_filename: Iterable[str] = (),
        connect_timeout: float | None = None,
        gateway: Connection | None = None,
        hops: int = 0,
    ):
        object.__setattr__(self, "_hops", hops)  # read by get_gateway, during fabric's __init__
        keys = list(key_filename)
        super().__init__(
            host,
            user=user,
            port=port,
            config=config,
            gateway=gateway,
            # Never empty: fabric falls back to (and then edits) the shared Config's dict.
            connect_kwargs={"key_filename": keys} if keys else {"look_for_keys": True},
            # Given, so fabric does not look them up in the Config (each nested lookup of
            # invoke's costs ~0.1 ms): provision never forwards the agent or runs fabric's
            # runners, and the timeout is set again below (fabric rounds it to seconds).
            forward_agent=False,
            inline_ssh_env=False,
            connect_timeout=connect_timeout or 10.0,
        )
        self.connect_kwargs: dict[str, Any] = dict(self.connect_kwargs)
        self.connect_kwargs["transport_factory"] = _Transport
        self.connect_timeout = connect_timeout

    @classmethod
    def to(cls, target: Target, config: fabric.Config) -> Connection:
        """The connection to a Target: its jump host (the inventory's) as the gateway."""
        gateway = None
        if target.jump_host:
            gateway = cls.to(jump_target(target.jump_host, target), config)
        keys = [os.path.expanduser(target.identity_file)] if target.identity_file else []
        return cls(
            target.address,
            config=config,
            user=target.user,
            port=target.port,
            key_filename=keys,
            connect_timeout=target.connect_timeout,
            gateway=gateway,
        )

    def get_gateway(self) -> Connection | str | None:
        """ssh_config's ProxyJump (OpenSSH's order: the first hop is dialled first), else
        its ProxyCommand (a string)."""
        jump = self.ssh_config.get("proxyjump")
        if jump and jump.lower() != "none":
            if self._hops > MAX_HOPS:
                raise ProvisionError(f"ssh_config: ProxyJump loops at {self.original_host}")
            gateway = None
            for hop in jump.split(","):
                user, host, port = shorthand(hop.strip())
                if host == self.host:
                    return None  # a wildcard Host's ProxyJump reaching the jump host itself
                gateway = Connection(
                    host, config=self.config, user=user, port=port, gateway=gateway, hops=self._hops + 1
                )
            return gateway
        proxy: str | None = self.ssh_config.get("proxycommand")  # None for "ProxyCommand none"
        return proxy

    def hops(self) -> list[Connection]:
        """This connection and the jump hosts on its way, nearest last."""
        out: list[Connection] = []
        hop: Any = self
        while isinstance(hop, Connection):
            out.append(hop)
            hop = hop.gateway
        return out

    def open(self) -> Any:
        """fabric's open, on a socket of ours unless a gateway or ProxyCommand carries it."""
        if self.is_connected:
            return None
        if not self.gateway:
            self.connect_kwargs["sock"] = tcp(self.host, self.port, self.connect_timeout)
        try:
            return super().open()
        except BaseException:
            sock = self.connect_kwargs.pop("sock", None)
            if sock is not None:
                sock.close()
            raise

    def open_gateway(self) -> Any:
        """A ProxyCommand, or a direct-tcpip channel through the (opened) jump host, the
        channel bounded by connect_timeout (fabric's waits forever)."""
        if isinstance(self.gateway, str):
            return super().open_gateway()
        gateway = self.gateway
        if gateway.connect_timeout is None:
            gateway.connect_timeout = self.connect_timeout  # a hop from ssh_config: ours
        gateway.open()  # nothing if already open
        return gateway.transport.open_channel(
            "direct-tcpip", dest_addr=(self.host, int(self.port)), src_addr=("", 0), timeout=self.connect_timeout
        )

    def abort(self) -> None:
        """The handshake's deadline passed: close its socket (and its jump host's, if that
        is what hangs), so whatever paramiko waits on ends."""
        transport = self.client.get_transport()
        for thing in (transport, self.connect_kwargs.get("sock")):
            try:
                if thing is not None:
                    thing.close()
            except Exception:  # best effort: the caller reports the timeout
                pass
        if isinstance(self.gateway, Connection) and not self.gateway.is_connected:
            self.gateway.abort()

    def stage(self) -> str:
        """Where a handshake that timed out was: what the user should look at."""
        if isinstance(self.gateway, Connection) and not self.gateway.is_connected:
            return f"{self.gateway.stage()} to the jump host {self.gateway.host}"
        transport = self.client.get_transport()
        if transport is None:
            return "the TCP connection"
        if not getattr(transport, "remote_version", ""):
            return "the SSH banner exchange"
        if getattr(transport, "session_id", None) is None:
            return "key exchange"
        return "authentication"

    def close(self) -> None:
        """Close the connection and its jump hosts' (best effort, idempotent)."""
        for hop in self.hops():
            try:
                hop.client.close()  # the transport, and with it its socket, channel or ProxyCommand
            except Exception:  # closing is best effort
                pass

    def __repr__(self) -> str:
        return f"<Connection {self.user}@{self.host}:{self.port}>"


def shorthand(spec: str) -> tuple[str | None, str, int | None]:
    """[user@]host[:port] -> (user, host, port); an IPv6 address takes a port in brackets."""
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = int(tail[1:]) if tail.startswith(":") else None
    elif rest.count(":") == 1:
        host, _, p = rest.partition(":")
        port = int(p)
    return user or None, host, port


def jump_target(spec: str, target: Target) -> Target:
    """The inventory's jump_host ([user@]host[:port]) as a Target: the host's user, key,
    timeout and host-key policy unless it says otherwise."""
    user, host, port = shorthand(spec)
    return Target(
        name=f"jump host {spec}",
        address=host,
        port=port or 22,
        user=user or target.user,
        identity_file=target.identity_file,
        connect_timeout=target.connect_timeout,
        host_key_policy=target.host_key_policy,
    )


def tcp(host: str, port: int, timeout: float | None) -> socket.socket:
    """The TCP connection paramiko would open, with its errors (and TCP_NODELAY), opened here
    so that an ASCII host name is looked up as bytes: given a str, getaddrinfo first imports
    the idna codec (~18 ms of the controller's CPU at every command)."""
    try:
        name: str | bytes = host.encode("ascii")
    except UnicodeEncodeError:
        name = host
    errors: dict[Any, OSError] = {}
    for family, kind, proto, _, addr in socket.getaddrinfo(name, port, socket.AF_UNSPEC, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            # Nagle's algorithm (paramiko leaves it on) holds each small SSH packet until the
            # previous one is acknowledged, and hosts delay their acknowledgements: about
            # 40 ms at authentication and at every command (bench/phases.py).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            sock.connect(addr)
            return sock
        except OSError as e:
            sock.close()
            if e.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH):
                raise  # a timeout, say: as paramiko would
            errors[addr[:2]] = e
    raise paramiko.ssh_exception.NoValidConnectionsError(errors)
