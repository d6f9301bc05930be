"""The only module that runs commands on hosts: a Session of SSH connections for one command.

Connections are fabric's (io/connection.py: ssh_config, jump hosts, auth; one shared
fabric.Config), host keys checked on every hop (io/hostkeys.py). Commands run on raw
paramiko channels of each connection's transport. One connection per host, opened once
and reused; at most `parallelism` stay open (the least recently used idle one is closed
to make room).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import resource
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import fabric
import paramiko

from provision.core.target import HostError, Target
from provision.host import bundle
from provision.host import protocol as P
from provision.io.connection import Connection, new_config
from provision.io.hostkeys import KnownHosts, UnknownKey, fingerprint

# paramiko logs errors of its transport thread (a hung host's "No existing session"); with
# no handler Python prints them with tracebacks. provision reports each host in one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

T = TypeVar("T")
_CHUNK = 1 << 18
STDERR_KEPT = 1 << 20  # bytes of a command's stderr kept (the rest is read and dropped)


@dataclass(frozen=True)
class Result:
    exit_status: int
    stdout: bytes
    stderr: bytes


ANSWER_LIMIT = 64 << 20  # bytes: the agent's and the probe's answers are kilobytes


class _TooMuch(Exception):
    """A host's answer went past the bound its caller set."""


# --------------------------------------------------------------------------- connections


def fd_safe_parallelism() -> int:
    """Hosts at once without running out of file descriptors (a socket or two each)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, min(512, (soft - 64) // 4))


def _timed_out(target: Target, stage: str) -> str:
    return f"timed out during {stage} (connect_timeout {target.connect_timeout:g}s): is the host hung or overloaded?"


def _read_stderr(chan: paramiko.Channel, into: list[bytes]) -> None:
    """A command's stderr, its first STDERR_KEPT bytes kept and the rest read and dropped
    (a host that streams it endlessly cannot fill the controller's memory)."""
    f = chan.makefile_stderr("rb")
    kept = 0
    try:
        while chunk := f.read(1 << 16):
            if kept < STDERR_KEPT:
                into.append(chunk[: STDERR_KEPT - kept])
                kept += len(into[-1])
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the channel closed or timed out: the command's own reader says so


def _close(conn: Connection) -> None:
    conn.close()  # best effort, jump hosts included


class Session:
    """Connections to many hosts for the length of one command."""

    def __init__(self, known_hosts: KnownHosts, *, parallelism: int | None = None, verbose: bool = False):
        self.known = known_hosts
        self.parallelism = parallelism or fd_safe_parallelism()
        self.verbose = verbose
        # Open connections, least recently used first. At most `parallelism` stay open: a new
        # one past that closes the least recently used idle one (reopened later if needed), so
        # sockets and paramiko transport threads are bounded by parallelism, not by host count.
        self._conns: OrderedDict[str, Connection] = OrderedDict()
        self._holders: dict[int, str] = {}  # thread ident -> the host whose connection it uses
        self._dialling = 0  # connections being opened now (counted against parallelism too)
        self._users: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._print_lock = threading.Lock()
        self._config: fabric.Config | None = None  # read at the first dial

    # -- connect

    def connect(self, target: Target) -> Connection:
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

    def _make_room(self, name: str) -> list[Connection]:
        """Take out of the pool, least recently used first, idle connections (no thread uses
        them) until one more fits within parallelism, and count that one as being opened; the
        caller closes what comes back."""
        out: list[Connection] = []
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

    def _dial(self, target: Target) -> Connection:
        """Open a new connection to target (handshake, retries, errors as HostError)."""
        with self._lock:  # once per Session, when the first host is dialled
            if self._config is None:
                self._config = new_config()
            config = self._config
        conn = Connection.to(target, config)
        for hop in conn.hops():  # the host, then its jump hosts (ours or ProxyJump): each checked
            self.known.prepare(hop.client, hop.host, hop.port, target.host_key_policy)
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
            watchdog = threading.Timer(left, conn.abort)
            watchdog.daemon = True
            watchdog.start()
            try:
                conn.open()
                return conn
            except Exception as e:  # sorted into a HostError, or a reason to try again
                err = self._failed(target, conn, e, deadline)
            finally:
                watchdog.cancel()
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay *= 2

    def _failed(self, target: Target, conn: Connection, e: Exception, deadline: float) -> str:  # noqa: C901  one branch per way an SSH handshake fails, each its own message
        """Why a handshake failed: raises the HostError that ends the dial, or returns the
        reason to show if the retries run out (refused: sshd may be starting)."""
        late = time.monotonic() >= deadline - 0.05
        if isinstance(e, paramiko.BadHostKeyException):
            raise HostError(
                target,
                f"host key changed: it now offers {fingerprint(e.key)}, but {self.known.path} "
                f"has {fingerprint(e.expected_key)}. If the host was reinstalled, delete its line "
                f"({e.hostname}) from that file and run again; "
                "otherwise someone may be intercepting the connection.",
            ) from None
        if isinstance(e, UnknownKey):
            raise HostError(
                target,
                f"unknown host key {fingerprint(e.key)} and host_key_policy is strict: add it to "
                f"{self.known.path} or ~/.ssh/known_hosts after checking it (or use accept-new)",
            ) from None
        if isinstance(e, paramiko.AuthenticationException):
            if "timeout" in str(e).lower() or late:
                raise HostError(target, _timed_out(target, "authentication"), unreachable=True) from None
            raise HostError(target, f"authentication failed for user {conn.user}: {e}") from None
        if isinstance(e, FileNotFoundError):
            raise HostError(target, f"identity file not found: {e.filename}") from None
        if isinstance(e, TimeoutError):  # not retried: the host already had the whole timeout
            raise HostError(target, _timed_out(target, conn.stage()), unreachable=True) from None
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
            # paramiko's wrapper when every address of the host failed; say why plainly.
            causes = list(e.errors.values())
            if causes and all(isinstance(c, ConnectionRefusedError) for c in causes):
                return "connection refused"
            return "; ".join(sorted({getattr(c, "strerror", None) or str(c) for c in causes})) or "cannot connect"
        if isinstance(e, socket.gaierror):
            raise HostError(target, f"cannot resolve address: {e.strerror}", unreachable=True) from None
        if isinstance(e, (OSError, EOFError, paramiko.SSHException)):
            if late or "timeout" in str(e).lower() or "banner" in str(e):
                raise HostError(target, _timed_out(target, conn.stage()), unreachable=True) from None
            if isinstance(e, EOFError):
                return "the SSH server closed the connection during the handshake"
            return str(e) or type(e).__name__
        raise e

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

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- run

    def run(
        self,
        target: Target,
        command: str,
        *,
        stdin: bytes = b"",
        timeout: float | None = 600,
        sudo: bool = True,
        limit: int | None = None,
    ) -> Result:
        """Run one command; stdout and stderr collected; never raises for a non-zero exit.
        `limit`: at most this many bytes of stdout are believed (what a host sends back is
        untrusted: a larger answer is a HostError, not the controller's memory)."""
        out: list[bytes] = []
        size = 0

        def keep(data: bytes) -> None:
            nonlocal size
            size += len(data)
            if limit is not None and size > limit:
                raise _TooMuch()
            out.append(data)

        try:
            status, err = self._exec(target, command, keep, stdin, timeout, sudo, "command timed out after")
        except _TooMuch:
            raise HostError(target, f"sent more than {limit} bytes in answer to one command: refused") from None
        return Result(status, b"".join(out), err)

    def download(
        self, target: Target, command: str, sink: Callable[[bytes], None], *, stdin: bytes = b"", timeout: float = 600
    ) -> Result:
        """Run a command whose stdout may be large (a tar of a model): each chunk goes to sink
        as it arrives, never all of it in memory. Result.stdout is empty. The sink may raise
        to stop reading: the channel is closed and its exception raised as it was (an
        OSError of the sink's own is not taken for a lost connection)."""
        status, err = self._exec(target, command, sink, stdin, timeout, True, "no data for")
        return Result(status, b"", err)

    def _exec(  # noqa: C901  one channel's life: send, receive, the sink's own failure apart from the host's, close
        self,
        target: Target,
        command: str,
        sink: Callable[[bytes], None],
        stdin: bytes,
        timeout: float | None,
        sudo: bool,
        timed_out: str,
    ) -> tuple[int, bytes]:
        """One command on a channel of the host's connection: stdin sent, stdout to sink as it
        arrives (timeout: between chunks), stderr collected (its first STDERR_KEPT bytes: a
        host's complaint, not a stream); (exit status, stderr). A lost connection is dropped
        from the pool and raised as unreachable; what the sink raises, raised as it was."""
        conn = self.connect(target)
        sink_failed: BaseException | None = None
        status = -1
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
            reader = threading.Thread(target=_read_stderr, args=(chan, err_chunks), daemon=True)
            reader.start()
            # In slices: paramiko's sendall re-slices what is left after every packet, which
            # for one large bytes object is quadratic (a 40 MB push took 22 s).
            view = memoryview(stdin)
            for i in range(0, len(view), _CHUNK):
                chan.sendall(bytes(view[i : i + _CHUNK]))
            chan.shutdown_write()
            while data := chan.recv(1 << 20):
                try:
                    sink(data)
                except BaseException as e:  # the caller's own failure (or Ctrl-C), not the host's
                    sink_failed = e
                    break
            if sink_failed is None:
                status = chan.recv_exit_status()
                reader.join(timeout)
            chan.close()
        except TimeoutError:
            raise HostError(target, f"{timed_out} {timeout:g}s") from None
        except (OSError, EOFError, paramiko.SSHException) as e:
            with self._lock:
                if self._conns.get(target.name) is conn:
                    del self._conns[target.name]
            _close(conn)
            raise HostError(target, f"connection lost: {e or type(e).__name__}", unreachable=True) from None
        if sink_failed is not None:
            raise sink_failed
        return status, b"".join(err_chunks)

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

        def call(t: Target) -> T | HostError:
            try:
                return fn(t)
            except HostError as e:
                return e

        pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ssh")
        try:
            futures = [pool.submit(call, t) for t in targets]
            for t, f in zip(targets, futures):
                results[t.name] = _result(f)
        finally:
            # Ctrl-C here must end the command now, not after every host's call returns (a
            # setup may run for an hour): what is still running is left to the process's end.
            pool.shutdown(wait=False, cancel_futures=True)
        return results


def _result(f: cf.Future[T]) -> T:
    """f's result, waited for in slices: Linux may hand a Ctrl-C to any thread, and a wait
    without a timeout would see it only when the host's call returns (a setup may run for
    hours); a timed wait gives the main thread back to Python, which raises it."""
    while True:
        try:
            return f.result(timeout=0.25)
        except cf.TimeoutError:
            if f.done():
                raise  # the call's own TimeoutError, not the wait's


# --------------------------------------------------------------------------- the host agent


def call_agent(session: Session, target: Target, request: Any, *, timeout: float = 600) -> Any:
    """One request (host/protocol.py) to the agent on the host: one SSH round trip. Returns
    the request's report type."""
    stdin = bundle.payload() + json.dumps(P.to_wire(request)).encode()
    res = session.run(target, bundle.boot_command(), stdin=stdin, timeout=timeout, limit=ANSWER_LIMIT)
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
