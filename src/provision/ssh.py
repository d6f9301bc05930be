"""The only module that talks to the network.

Fabric opens the connections (it honours ~/.ssh/config where the inventory is silent, the
ssh-agent, and ProxyJump through `gateway`); commands then run on raw paramiko channels,
because invoke's runner (threads plus sleep-polling per command) costs more than the whole
round trip on a LAN. One connection per host, opened once and reused for the command; at
most `parallelism` stay open (the least recently used idle one is closed to make room).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import errno
import logging
import os
import resource
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import paramiko

from .errors import ProvisionError

# paramiko logs errors of its transport thread (a hung host's "No existing session"); with
# no handler Python prints them with tracebacks. provision reports each host in one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

T = TypeVar("T")
_CHUNK = 1 << 18


@dataclass(frozen=True)
class Target:
    """Where and how to reach one host."""

    name: str
    address: str
    port: int | None = None  # None: from ~/.ssh/config, else 22
    user: str | None = None  # None: from ~/.ssh/config, else the local user
    identity_file: str | None = None
    jump_host: str | None = None
    connect_timeout: float = 10.0
    host_key_policy: str = "accept-new"

    @property
    def where(self) -> str:
        a = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.name} ({a}:{self.port or 22})"

    @classmethod
    def from_host(cls, host) -> Target:
        s = host.ssh
        return cls(
            host.name, host.address, s.port, s.user, s.identity_file, s.jump_host, s.connect_timeout, s.host_key_policy
        )


class HostError(Exception):
    """A failure on one host; the others carry on. `unreachable` decides exit code 3."""

    def __init__(self, target: Target, message: str, *, unreachable: bool = False):
        super().__init__(f"{target.where}: {message}")
        self.target = target
        self.message = message
        self.unreachable = unreachable


@dataclass(frozen=True)
class Result:
    exit_status: int
    stdout: bytes
    stderr: bytes


# --------------------------------------------------------------------------- host keys


def _key_id(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def _fingerprint(key: paramiko.PKey) -> str:
    digest = __import__("hashlib").sha256(key.asbytes()).digest()
    return f"{key.get_name()} SHA256:{base64.b64encode(digest).decode().rstrip('=')}"


class KnownHosts:
    """Host keys provision has learnt, kept beside the state (`known_hosts`, OpenSSH format).

    The user's ~/.ssh/known_hosts is read too, never written.
    """

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.keys = paramiko.HostKeys()
        if path.exists():
            try:
                self.keys.load(str(path))
            except (OSError, paramiko.SSHException) as e:
                raise ProvisionError(f"{path}: cannot read known host keys: {e}") from None
        self.system = paramiko.HostKeys()
        user_file = Path("~/.ssh/known_hosts").expanduser()
        if user_file.exists():
            try:
                self.system.load(str(user_file))
            except (OSError, paramiko.SSHException):
                pass  # the user's file is best effort; ours is authoritative

    def lookup(self, key_id: str) -> Any:
        return self.keys.lookup(key_id) or self.system.lookup(key_id)

    def learn(self, key_id: str, key: paramiko.PKey) -> None:
        with self.lock:
            self.keys.add(key_id, key.get_name(), key)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            self.keys.save(str(tmp))
            os.replace(tmp, self.path)


class _Policy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for keys it does not know (changed keys never get here)."""

    def __init__(self, known: KnownHosts, policy: str):
        self.known = known
        self.policy = policy

    def missing_host_key(self, client, hostname, key):
        if self.policy == "off":
            return
        if self.policy == "accept-new":
            self.known.learn(hostname, key)
            return
        raise _UnknownKey(hostname, key)


class _UnknownKey(Exception):
    def __init__(self, key_id: str, key: paramiko.PKey):
        super().__init__(key_id)
        self.key_id = key_id
        self.key = key


# --------------------------------------------------------------------------- connections


def fd_safe_parallelism() -> int:
    """Hosts at once without running out of file descriptors (a socket or two each)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, min(512, (soft - 64) // 4))


_ssh_config = None
_fabric_lock = threading.Lock()


def _config():
    """A fabric Config for one connection. ~/.ssh/config and /etc/ssh/ssh_config are parsed
    once per process and shared (lookups only read them), but each connection gets its own
    Config: fabric's Connection() writes into its config and re-merges it, so connections
    made at once from several threads sharing one could see it empty mid-merge
    ("No attribute or config key found for 'gateway'")."""
    global _ssh_config
    from fabric import Config

    with _fabric_lock:
        if _ssh_config is None:
            _ssh_config = Config().base_ssh_config
    return Config(ssh_config=_ssh_config)


def _connection(target: Target, gateway=None):
    from fabric import Connection

    kwargs: dict = {}
    if target.identity_file:
        kwargs["key_filename"] = [os.path.expanduser(target.identity_file)]
    return Connection(
        host=target.address,
        user=target.user,
        port=target.port,
        config=_config(),
        connect_timeout=target.connect_timeout,
        connect_kwargs=kwargs,
        gateway=gateway,
    )


def _tcp(host: str, port: int, timeout: float) -> socket.socket:
    """The TCP connection paramiko would open, with its errors (and TCP_NODELAY), opened here
    so that an ASCII host name is looked up as bytes: given a str, getaddrinfo first imports the idna codec
    (~18 ms of the controller's CPU at every command)."""
    try:
        name: str | bytes = host.encode("ascii")
    except UnicodeEncodeError:
        name = host
    errors: dict = {}
    candidates = socket.getaddrinfo(name, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    for family, kind, proto, _, addr in candidates:
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


def _open(conn, timeout: float) -> None:
    """conn.open(), on a socket of our own unless a gateway or ProxyCommand carries it."""
    if conn.gateway is None:
        conn.connect_kwargs["sock"] = _tcp(conn.host, conn.port, timeout)
    try:
        conn.open()
    except BaseException:
        sock = conn.connect_kwargs.pop("sock", None)
        if sock is not None:
            sock.close()
        raise


def _parse_jump(spec: str, target: Target) -> Target:
    user, _, rest = spec.rpartition("@")
    host, port = rest, 22
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = int(tail[1:]) if tail.startswith(":") else 22
    elif ":" in rest:
        host, _, p = rest.rpartition(":")
        port = int(p)
    return Target(
        name=f"jump host {spec}",
        address=host,
        port=port,
        user=user or target.user,
        identity_file=target.identity_file,
        connect_timeout=target.connect_timeout,
        host_key_policy=target.host_key_policy,
    )


def _abort(conn: Any) -> None:
    """The handshake's deadline passed: close its socket, so whatever paramiko waits on ends."""
    client = getattr(conn, "client", None)
    transport = client.get_transport() if client is not None else None
    sock = conn.connect_kwargs.get("sock")
    for thing in (transport, sock):
        try:
            if thing is not None:
                thing.close()
        except Exception:  # best effort: the caller reports the timeout
            pass


def _stage(conn: Any) -> str:
    """Where a handshake that timed out was: what the user should look at."""
    client = getattr(conn, "client", None)
    transport = client.get_transport() if client is not None else None
    if transport is None:
        return "the TCP connection"
    if not getattr(transport, "remote_version", ""):
        return "the SSH banner exchange"
    if getattr(transport, "session_id", None) is None:
        return "key exchange"
    return "authentication"


def _timed_out(target: Target, stage: str) -> str:
    return f"timed out during {stage} (connect_timeout {target.connect_timeout:g}s): is the host hung or overloaded?"


def _close(conn: Any) -> None:
    """Close a connection and its jump host's, if any (best effort)."""
    for c in (conn, getattr(conn, "gateway", None)):
        try:
            if c is not None and hasattr(c, "close"):
                c.close()
        except Exception:  # closing is best effort
            pass


class Session:
    """Connections to many hosts for the length of one command."""

    def __init__(self, known_hosts: KnownHosts, *, parallelism: int | None = None, verbose: bool = False):
        self.known = known_hosts
        self.parallelism = parallelism or fd_safe_parallelism()
        self.verbose = verbose
        # Open connections, least recently used first. At most `parallelism` stay open: a new
        # one past that closes the least recently used idle one (reopened later if needed), so
        # sockets and paramiko transport threads are bounded by parallelism, not by host count.
        self._conns: OrderedDict[str, Any] = OrderedDict()
        self._holders: dict[int, str] = {}  # thread ident -> the host whose connection it uses
        self._dialling = 0  # connections being opened now (counted against parallelism too)
        self._users: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._print_lock = threading.Lock()

    # -- connect

    def _prepare(self, conn, target: Target) -> None:
        client = conn.client
        if target.host_key_policy == "off":
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
            return
        key_id = _key_id(conn.host, conn.port)  # paramiko's own lookup name (after ssh config)
        for typ, key in (self.known.lookup(key_id) or {}).items():
            client.get_host_keys().add(key_id, typ, key)
        client.set_missing_host_key_policy(_Policy(self.known, target.host_key_policy))

    def connect(self, target: Target):
        """The open connection to target, opened now if there is none. The calling thread uses
        it until it asks for another host's: until then it is never closed to make room."""
        with self._lock:
            self._holders[threading.get_ident()] = target.name
            conn = self._conns.get(target.name)
            if conn is not None:
                self._conns.move_to_end(target.name)
        if conn is not None and conn.is_connected:
            return conn
        if conn is not None:  # lost (the host rebooted, say): free its socket before reopening
            with self._lock:
                if self._conns.get(target.name) is conn:
                    del self._conns[target.name]
            _close(conn)
        for idle in self._make_room(target.name):
            _close(idle)
        try:
            conn = self._dial(target)
        finally:
            with self._lock:
                self._dialling -= 1
        with self._lock:
            self._conns[target.name] = conn
            self._conns.move_to_end(target.name)
            self._users[target.name] = conn.user
        return conn

    def _make_room(self, name: str) -> list[Any]:
        """Take out of the pool, least recently used first, idle connections (no thread uses
        them) until one more fits within parallelism, and count that one as being opened; the
        caller closes what comes back."""
        out: list[Any] = []
        with self._lock:
            self._dialling += 1
            if len(self._conns) + self._dialling <= self.parallelism:
                return out
            alive = {t.ident for t in threading.enumerate()}
            for ident in [i for i in self._holders if i not in alive]:
                del self._holders[ident]  # a finished thread uses nothing
            busy = set(self._holders.values())
            for host in list(self._conns):
                if len(self._conns) + self._dialling <= self.parallelism:
                    break
                if host != name and host not in busy:
                    out.append(self._conns.pop(host))
        return out

    def _dial(self, target: Target):
        """Open a new connection to target (handshake, retries, errors as HostError)."""
        gateway = None
        if target.jump_host:
            jt = _parse_jump(target.jump_host, target)
            gateway = _connection(jt)
            self._prepare(gateway, jt)
        conn = _connection(target, gateway)
        self._prepare(conn, target)
        # The whole handshake (TCP, banner, key exchange, auth, retries) gets connect_timeout:
        # a hung host (paused, or an sshd that accepts and never answers) costs that, no more.
        deadline = time.monotonic() + target.connect_timeout
        delay = 0.3
        err = "cannot connect"
        while True:
            left = deadline - time.monotonic()
            if left <= 0.05:
                raise HostError(target, err, unreachable=True)
            conn.connect_timeout = left
            for k in ("banner_timeout", "auth_timeout", "channel_timeout"):
                conn.connect_kwargs[k] = left
            watchdog = threading.Timer(left, _abort, (conn,))
            watchdog.daemon = True
            watchdog.start()
            try:
                _open(conn, left)
                break
            except paramiko.BadHostKeyException as e:
                raise HostError(
                    target,
                    f"host key changed: it now offers {_fingerprint(e.key)}, but {self.known.path} "
                    f"has {_fingerprint(e.expected_key)}. If the host was reinstalled, delete its line "
                    f"({_key_id(conn.host, conn.port)}) from that file and run again; "
                    "otherwise someone may be intercepting the connection.",
                ) from None
            except _UnknownKey as e:
                raise HostError(
                    target,
                    f"unknown host key {_fingerprint(e.key)} and host_key_policy is strict: add it to "
                    f"{self.known.path} or ~/.ssh/known_hosts after checking it (or use accept-new)",
                ) from None
            except paramiko.AuthenticationException as e:
                if "timeout" in str(e).lower() or time.monotonic() >= deadline - 0.05:
                    raise HostError(target, _timed_out(target, "authentication"), unreachable=True) from None
                raise HostError(target, f"authentication failed for user {conn.user}: {e}") from None
            except FileNotFoundError as e:
                raise HostError(target, f"identity file not found: {e.filename}") from None
            except TimeoutError:
                # Not retried: the host already had the whole timeout to answer.
                raise HostError(target, _timed_out(target, _stage(conn)), unreachable=True) from None
            except ConnectionRefusedError:
                err = "connection refused"
            except paramiko.ssh_exception.NoValidConnectionsError as e:
                # paramiko's wrapper when every address of the host failed; say why plainly.
                causes = list(e.errors.values())
                if causes and all(isinstance(c, ConnectionRefusedError) for c in causes):
                    err = "connection refused"
                else:
                    err = (
                        "; ".join(sorted({getattr(c, "strerror", None) or str(c) for c in causes})) or "cannot connect"
                    )
            except socket.gaierror as e:
                raise HostError(target, f"cannot resolve address: {e.strerror}", unreachable=True) from None
            except (OSError, EOFError, paramiko.SSHException) as e:
                if time.monotonic() >= deadline - 0.05 or "timeout" in str(e).lower() or "banner" in str(e):
                    raise HostError(target, _timed_out(target, _stage(conn)), unreachable=True) from None
                err = str(e) or type(e).__name__
                if isinstance(e, EOFError):
                    err = "the SSH server closed the connection during the handshake"
            finally:
                watchdog.cancel()
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay *= 2
        return conn

    def is_root(self, target: Target) -> bool:
        with self._lock:
            return self._users.get(target.name, target.user) == "root"

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), OrderedDict()
            self._holders.clear()
        for c in conns:
            _close(c)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- run

    def run(
        self, target: Target, command: str, *, stdin: bytes = b"", timeout: float | None = 600, sudo: bool = True
    ) -> Result:
        """Run one command; stdout and stderr collected; never raises for a non-zero exit."""
        conn = self.connect(target)
        if sudo and not self.is_root(target):
            command = "sudo -n " + command
        if self.verbose:
            with self._print_lock:
                shown = command if len(command) < 200 else command[:200] + "..."
                print(f"[{target.name}] $ {shown}", file=sys.stderr)
        try:
            chan = conn.client.get_transport().open_session(timeout=target.connect_timeout)
            chan.settimeout(timeout)
            chan.exec_command(command)
            err_chunks: list[bytes] = []
            reader = threading.Thread(target=lambda: err_chunks.append(chan.makefile_stderr("rb").read()), daemon=True)
            reader.start()
            # In slices: paramiko's sendall re-slices what is left after every packet, which
            # for one large bytes object is quadratic (a 40 MB push took 22 s).
            view = memoryview(stdin)
            for i in range(0, len(view), _CHUNK):
                chan.sendall(bytes(view[i : i + _CHUNK]))
            chan.shutdown_write()
            out = chan.makefile("rb").read()
            status = chan.recv_exit_status()
            reader.join(timeout)
            chan.close()
        except TimeoutError:
            raise HostError(target, f"command timed out after {timeout:g}s") from None
        except (OSError, EOFError, paramiko.SSHException) as e:
            with self._lock:
                if self._conns.get(target.name) is conn:
                    del self._conns[target.name]
            _close(conn)
            raise HostError(target, f"connection lost: {e or type(e).__name__}", unreachable=True) from None
        return Result(status, out, b"".join(err_chunks))

    def stream(
        self, target: Target, command: str, on_line: Callable[[bytes], None], *, stop: threading.Event | None = None
    ) -> int:
        """Run a long command (journalctl --follow), calling on_line per stdout line."""
        conn = self.connect(target)
        if not self.is_root(target):
            command = "sudo -n " + command
        chan = conn.client.get_transport().open_session(timeout=target.connect_timeout)
        chan.settimeout(0.5)
        chan.exec_command(command)
        buf = b""
        try:
            while not (stop and stop.is_set()):
                try:
                    data = chan.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    on_line(line)
            if buf:
                on_line(buf)
        finally:
            chan.close()
        return chan.exit_status if chan.exit_status_ready() else -1

    def map(self, fn: Callable[[Target], T], targets: Iterable[Target]) -> dict[str, T | HostError]:
        """fn on every target in parallel; a HostError for one host never stops the others."""
        targets = list(targets)
        results: dict[str, T | HostError] = {}
        if not targets:
            return results
        workers = min(len(targets), self.parallelism)

        def call(t: Target):
            try:
                return fn(t)
            except HostError as e:
                return e

        with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ssh") as pool:
            for t, r in zip(targets, pool.map(call, targets)):
                results[t.name] = r
        return results


# --------------------------------------------------------------------------- the host agent


def call_agent(session: Session, target: Target, request: Any, *, timeout: float = 600) -> Any:
    """One request (host/protocol.py) to the agent on the host: one SSH round trip. Returns
    the request's report type."""
    import json

    from .host import bundle
    from .host import protocol as P

    stdin = bundle.payload() + json.dumps(P.to_wire(request)).encode()
    res = session.run(target, bundle.boot_command(), stdin=stdin, timeout=timeout)
    if res.exit_status != 0:
        err = res.stderr.decode("utf-8", "replace").strip().splitlines()
        if res.exit_status == 127:
            raise HostError(target, "python3 is not installed; provision needs it on every host")
        if not session.is_root(target) and any("sudo" in line for line in err):
            raise HostError(
                target, f"sudo -n failed (provision needs root, or passwordless sudo): {err[-1] if err else ''}"
            )
        raise HostError(target, f"host agent failed (exit {res.exit_status}): {err[-1] if err else 'no output'}")
    try:
        out = json.loads(res.stdout)
    except ValueError:
        raise HostError(target, f"host agent gave no answer: {res.stdout[:200]!r}") from None
    if isinstance(out, dict) and "fatal" in out:
        raise HostError(target, f"on the host: {out['fatal']}")
    try:
        if isinstance(request, P.BatchRequest):
            return P.batch_from_wire(request, out)
        return P.report_from_wire(request.op, out)
    except (P.WireError, TypeError) as e:
        raise HostError(target, f"host agent answered something else: {e}") from None
