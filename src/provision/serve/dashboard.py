"""The dashboard's HTTP server: uvicorn's h11 protocol, with what it does not bound bounded
(docs/dashboard.md, "Limits"). web/guard.py checks each request; this, each connection.

uvicorn arms no timer on a new connection: its keep-alive timer starts after a response,
and the next byte cancels it. A client that never finished its headers was held for good,
and 1,100 of them took every descriptor of a unit's 1,024. Here a connection has
`header_seconds` to send a request's headers, from when it connects and again after each
answer; one that stops reading its answer for `write_seconds` is dropped; at most
`max_connections` are open (at the cap the one waiting longest for its headers makes room,
and with none waiting the newcomer gets a 503). What uvicorn and asyncio log is one line
per kind per `LOG_EVERY` seconds.

    stop = start(make_app(source, auth=auth, site=site), sock, Limits.for_descriptors(soft_limit()))
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import os
import resource
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

LOG_EVERY = 60.0  # seconds: one line of each kind (uvicorn's, asyncio's, ours) per this
LOGGERS = ("uvicorn.error", "asyncio")
BUSY_WORDS = b"refused: too many connections at once; try again soon\n"
BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
BUSY += b"content-length: %d\r\n\r\n%s" % (len(BUSY_WORDS), BUSY_WORDS)
log = logging.getLogger("uvicorn.error")  # uvicorn's handler: its lines and ours in one place


@dataclass(frozen=True)
class Limits:
    header_seconds: float = 10.0  # to send a request's headers (from connecting, or the last answer)
    write_seconds: float = 30.0  # a client may leave its answer unread this long
    max_connections: int = 256  # open at once

    @classmethod
    def for_descriptors(cls, soft: int) -> Limits:
        """A quarter of the process's open-files limit (the service's database, SSH and
        workers need the rest), from 16 to 1,024."""
        return cls(max_connections=max(16, min(1024, soft // 4)))


def soft_limit() -> int:
    """The process's open-files limit (RLIMIT_NOFILE's soft value; unlimited: 4,096)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 4096 if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


class OncePer(logging.Filter):
    """One record of a kind (its logger and its message's first line) per `every` seconds;
    the next one of that kind says how many were left out."""

    KINDS = 1000  # kinds remembered (a message that names a socket is a new kind each time)

    def __init__(self, every: float):
        super().__init__()
        self.every = every
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()  # the dashboard's thread and the service's log here

    def clear(self) -> None:
        with self._lock:
            self._last.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg).split("\n", 1)[0][:60])
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get(key, (-math.inf, 0))
            if now - last < self.every:
                self._last[key] = (last, skipped + 1)
                return False
            if len(self._last) >= self.KINDS:
                self._last.clear()
            self._last[key] = (now, 0)
        if skipped:
            record.msg, record.args = f"{record.getMessage()} ({skipped} more like it in {self.every:g} s)", None
        return True


QUIET = OncePer(LOG_EVERY)


def bounded(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits` (a class per server: uvicorn makes each
    connection's protocol from a class)."""

    class Bounded(_Bounded):
        LIMITS = limits

    return Bounded


class _Bounded(H11Protocol):
    LIMITS: ClassVar[Limits] = Limits()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._headers_due: asyncio.TimerHandle | None = None  # armed while waiting for a request's headers
        self._waiting_since = 0.0
        self._write_due: asyncio.TimerHandle | None = None  # armed while the answer's writing is paused
        self._turned_away = False
        self._lost = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        no_delay(transport)
        if len(self.connections) >= self.LIMITS.max_connections and not self._make_room():
            self._turned_away = True
            log.warning("refused connections: %d are open, all with a request under way", len(self.connections))
            _drain(transport)
            transport.write(BUSY)
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def _make_room(self) -> bool:
        """Drop the connection waiting longest for its headers; False when none waits."""
        waiting = [p for p in self.connections if isinstance(p, _Bounded) and p._headers_due is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda p: p._waiting_since)
        log.warning("at %d connections: dropped the one waiting longest for its request", len(self.connections))
        oldest._drop()
        return True

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = self.loop.time()
        self._headers_due = self._after(self.LIMITS.header_seconds, self._late)

    def _after(self, seconds: float, then: Callable[[int], None]) -> asyncio.TimerHandle:
        """`then(unsent)` in `seconds`: with the bytes of the answer not yet taken now."""
        return self.loop.call_later(seconds, then, self._unsent())

    def _taking(self, unsent: int) -> bool:
        """Whether the client took some of what is left of its answer since `unsent`."""
        return 0 < self._unsent() < unsent

    def _unsent(self) -> int:
        """The answer's bytes the client has not taken: the transport's, and the kernel's
        (megabytes on a fast link: they go out at the client's pace before the transport's
        do)."""
        held = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, AttributeError, ValueError):
            queued = 0  # no such ioctl here (or the socket is gone): the transport's alone
        return int(held) + int(queued)

    def _disarm(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _late(self, unsent: int) -> None:
        self._headers_due = None
        if self._taking(unsent):  # the last answer is still going out: the time starts when it is out
            self._headers_due = self._after(self.LIMITS.header_seconds, self._late)
            return
        log.warning(
            "dropped clients idle for %g s (no request, or their answer left unread)", self.LIMITS.header_seconds
        )
        self._drop()

    def _drop(self) -> None:
        """Reset the connection now, also one closing (uvicorn's close waits until what it
        wrote is taken: forever, for a client that reads nothing)."""
        self._disarm()
        if self.transport is None or self._lost:
            return
        # What this process still holds of the answer goes; what the kernel took it still
        # sends (a slow reader gets its whole last answer), the descriptor is free at once.
        self.transport.abort()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers came in: its answer is the app's
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before uvicorn reads a pipelined request's headers, which disarm it; closing too
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_due is None:
            self._write_due = self._after(self.LIMITS.write_seconds, self._unread)

    def resume_writing(self) -> None:
        if self._write_due is not None:
            self._write_due.cancel()
            self._write_due = None
        super().resume_writing()

    def _unread(self, unsent: int) -> None:
        self._write_due = None
        if self._taking(unsent):
            self._write_due = self._after(self.LIMITS.write_seconds, self._unread)
            return
        log.warning("dropped clients that read nothing of their answer for %g s", self.LIMITS.write_seconds)
        self._drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        if self._write_due is not None:
            self._write_due.cancel()
            self._write_due = None
        if self._turned_away:
            return  # never counted, nothing of it started
        super().connection_lost(exc)


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Each write out at once (TCP_NODELAY). asyncio sets it only on sockets made with proto
    IPPROTO_TCP, and socket.create_server's (and so what it accepts) have proto 0: uvicorn
    writes an answer's headers and its body apart, Nagle held the body until the client's
    delayed ACK, and every answer smaller than a segment took 40 ms more."""
    sock = transport.get_extra_info("socket")
    try:
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # the client is gone already: its connection_lost follows


def _drain(transport: asyncio.BaseTransport) -> None:
    """Read what the client sent so far: a socket closed with unread bytes is reset, and
    the reset can beat the 503 to the client."""
    sock = transport.get_extra_info("socket")
    try:
        os.read(sock.fileno(), 65536)  # the socket is non-blocking: what is there, at once
    except (OSError, AttributeError, ValueError):
        pass  # nothing there yet (or no socket): the 503 goes first


def start(app: ASGIApp, sock: socket.socket, limits: Limits) -> Callable[[], None]:
    """Serve `app` on the bound `sock` in a thread of this process; returns what stops it."""
    config = uvicorn.Config(app, http=bounded(limits), ws="none", log_level="warning")
    for name in LOGGERS:  # after the Config: it sets uvicorn's logging up
        logging.getLogger(name).addFilter(QUIET)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dashboard", daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return stop
