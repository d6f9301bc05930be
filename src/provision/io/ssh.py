"""The only module that talks to the network.

paramiko opens the connections (`Connection`: ~/.ssh/config where the inventory is silent,
the ssh-agent, a jump host, ProxyJump or ProxyCommand, as fabric did before; importing
fabric and invoke cost ~50 ms of every command's start-up); commands then run on raw
paramiko channels, because invoke's runner (threads plus sleep-polling per command) costs
more than the whole round trip on a LAN. One connection per host, opened once and reused
for the command; at most `parallelism` stay open (the least recently used idle one is
closed to make room).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import errno
import getpass
import io
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

from provision.core.errors import ProvisionError
from provision.core.target import HostError, Target

# paramiko.config imports invoke (~45 ms, half of paramiko's import) only to run the `Match
# exec` lines of an ssh_config: kept out here, and given back to paramiko when an ssh_config
# has such a line (_load_ssh_config). Not when something imported invoke already (fabric).
_INVOKE_BLOCKED = "invoke" not in sys.modules and "paramiko" not in sys.modules
if _INVOKE_BLOCKED:
    sys.modules["invoke"] = None  # type: ignore[assignment]
try:
    import paramiko
finally:
    if _INVOKE_BLOCKED and "invoke" in sys.modules and sys.modules["invoke"] is None:
        del sys.modules["invoke"]

# paramiko logs errors of its transport thread (a hung host's "No existing session"); with
# no handler Python prints them with tracebacks. provision reports each host in one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

T = TypeVar("T")
_CHUNK = 1 << 18


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


# The ssh_config files fabric read for us, in its order: the first value of a key wins, so the
# user's file comes first.
_SSH_CONFIG_FILES = ("~/.ssh/config", "/etc/ssh/ssh_config")
_ssh_config: paramiko.SSHConfig | None = None
_ssh_config_lock = threading.Lock()


def _load_ssh_config(paths: Iterable[str]) -> paramiko.SSHConfig:
    """The ssh_config files that exist among paths, parsed into one (first value wins)."""
    config = paramiko.SSHConfig()
    match_exec = False
    for p in paths:
        path = os.path.expanduser(p)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                text = f.read()
            config.parse(io.StringIO(text))
        except (OSError, UnicodeDecodeError, paramiko.ssh_exception.ConfigParseError) as e:
            raise ProvisionError(f"{path}: cannot read this ssh_config file: {e}") from None
        words = (line.lower().split() for line in text.splitlines())
        match_exec = match_exec or any(w[:1] == ["match"] and "exec" in w for w in words)
    if match_exec and _INVOKE_BLOCKED:
        # `Match exec` runs its command with invoke: paramiko needs it after all.
        try:
            import invoke
        except ImportError:  # paramiko says so at the lookup, as it would have
            pass
        else:
            setattr(paramiko.config, "invoke", invoke)  # noqa: B010 (paramiko's stubs omit it)
    return config


def _ssh_lookup(host: str) -> paramiko.SSHConfigDict:
    """ssh_config's settings for host (HostName always set). ~/.ssh/config and
    /etc/ssh/ssh_config are parsed once per process; lookups only read the result, so every
    thread shares it."""
    global _ssh_config
    with _ssh_config_lock:
        if _ssh_config is None:
            _ssh_config = _load_ssh_config(_SSH_CONFIG_FILES)
        config = _ssh_config
    return config.lookup(host)


def _local_user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name (a container with an unknown uid)
        return None


def _shorthand(spec: str) -> tuple[str | None, str, int | None]:
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


class Connection:
    """One SSH connection: what fabric's Connection did for us, on paramiko alone.

    As fabric resolved them: ssh_config's HostName replaces the address (`host`, the name
    host keys are looked up by); the inventory's user and port win over ssh_config's User
    and Port (then the local user and 22); the inventory's identity file is tried first,
    then ssh_config's IdentityFiles (then the agent and ~/.ssh/id_*, paramiko's defaults);
    `gateway` is the inventory's jump host, else ssh_config's ProxyJump (each hop resolved
    the same way), else its ProxyCommand (a string; a command, not a socket, then carries
    the connection).
    """

    def __init__(
        self,
        address: str,
        *,
        user: str | None = None,
        port: int | None = None,
        key_filename: Iterable[str] = (),
        connect_timeout: float | None = None,
        gateway: Connection | None = None,
        _hops: int = 0,
    ):
        self.ssh_config = _ssh_lookup(address)
        self.original_host = address
        self.host: str = self.ssh_config.get("hostname", address)
        self.user = user or self.ssh_config.get("user") or _local_user()
        self.port = port or int(self.ssh_config.get("port", 22))
        keys = [*key_filename, *self.ssh_config.get("identityfile", [])]
        self.connect_kwargs: dict[str, Any] = {"key_filename": keys} if keys else {}
        self.connect_timeout = connect_timeout
        self.gateway: Connection | str | None = gateway if gateway is not None else self._configured_gateway(_hops)
        self.client = paramiko.SSHClient()
        self.client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        self.transport: paramiko.Transport | None = None

    def _configured_gateway(self, hops: int) -> Connection | str | None:
        jump = self.ssh_config.get("proxyjump")
        if jump and jump.lower() != "none":
            if hops > 8:
                raise ProvisionError(f"ssh_config: ProxyJump loops at {self.original_host}")
            gateway = None
            for hop in jump.split(","):  # as ssh: the first hop is dialled first
                user, host, port = _shorthand(hop.strip())
                if host == self.host:
                    return None  # a wildcard Host's ProxyJump reaching the jump host itself
                gateway = Connection(host, user=user, port=port, gateway=gateway, _hops=hops + 1)
            return gateway
        return self.ssh_config.get("proxycommand")  # None for "ProxyCommand none"

    @property
    def is_connected(self) -> bool:
        return self.transport.is_active() if self.transport else False

    def open(self) -> None:
        """The handshake (paramiko's SSHClient.connect), through the gateway if any; a socket
        of our own, if any, is in connect_kwargs["sock"] (see _open)."""
        if self.is_connected:
            return
        if self.gateway:
            self.connect_kwargs["sock"] = self._open_gateway()
        kwargs = dict(self.connect_kwargs, username=self.user, hostname=self.host, port=self.port)
        if self.connect_timeout:
            kwargs["timeout"] = self.connect_timeout
        self.client.connect(**kwargs)
        self.transport = self.client.get_transport()

    def _open_gateway(self) -> Any:
        """A ProxyCommand, or a direct-tcpip channel through the (opened) jump host."""
        if isinstance(self.gateway, str):
            return paramiko.ProxyCommand(self.gateway)
        gateway = self.gateway
        assert gateway is not None
        if gateway.connect_timeout is None:
            gateway.connect_timeout = self.connect_timeout  # a hop from ssh_config: ours
        _open(gateway, gateway.connect_timeout)  # nothing if already open
        assert gateway.transport is not None
        return gateway.transport.open_channel(
            "direct-tcpip", dest_addr=(self.host, self.port), src_addr=("", 0), timeout=self.connect_timeout
        )

    def close(self) -> None:
        """Close the connection and its gateway's (best effort, idempotent)."""
        try:
            self.client.close()  # the transport, and with it its socket, channel or ProxyCommand
        finally:
            if isinstance(self.gateway, Connection):
                self.gateway.close()

    def __repr__(self) -> str:
        return f"<Connection {self.user}@{self.host}:{self.port}>"


def _connection(target: Target, gateway: Connection | None = None) -> Connection:
    keys = [os.path.expanduser(target.identity_file)] if target.identity_file else []
    return Connection(
        target.address,
        user=target.user,
        port=target.port,
        key_filename=keys,
        connect_timeout=target.connect_timeout,
        gateway=gateway,
    )


def _tcp(host: str, port: int, timeout: float | None) -> socket.socket:
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


def _open(conn, timeout: float | None) -> None:
    """conn.open(), on a socket of our own unless a gateway or ProxyCommand carries it."""
    if conn.is_connected:
        return
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
    """The handshake's deadline passed: close its socket (and its jump host's, if that is what
    hangs), so whatever paramiko waits on ends."""
    client = getattr(conn, "client", None)
    transport = client.get_transport() if client is not None else None
    sock = conn.connect_kwargs.get("sock")
    for thing in (transport, sock):
        try:
            if thing is not None:
                thing.close()
        except Exception:  # best effort: the caller reports the timeout
            pass
    gateway = getattr(conn, "gateway", None)
    if isinstance(gateway, Connection) and not gateway.is_connected:
        _abort(gateway)


def _stage(conn: Any) -> str:
    """Where a handshake that timed out was: what the user should look at."""
    gateway = getattr(conn, "gateway", None)
    if isinstance(gateway, Connection) and not gateway.is_connected:
        return f"{_stage(gateway)} to the jump host {gateway.host}"
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
            gateway = _connection(_parse_jump(target.jump_host, target))
        conn = _connection(target, gateway)
        hop: Any = conn
        while isinstance(hop, Connection):  # the host, then its jump hosts (ours or ProxyJump)
            self._prepare(hop, target)
            hop = hop.gateway
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
                    f"({e.hostname}) from that file and run again; "
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

    from provision.host import bundle
    from provision.host import protocol as P

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
