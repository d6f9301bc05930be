"""What a notification sends, over the network: an HTTP(S) POST to a webhook (a burst on
one kept connection), and mail through the team's SMTP relay. Both bounded: TIMEOUT
seconds for a whole POST (a receiver that trickles its answer is cut off too), at most
MAX_ANSWER bytes of an answer read, no redirect followed (a 3xx is an answer that did not
take the event).

A failure is a ProvisionError in words that never hold the URL (a secret) nor the
password: what went wrong, never where.
"""

from __future__ import annotations

import http.client
import ipaddress
import itertools
import smtplib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from email.message import EmailMessage
from urllib.parse import urlsplit

from provision.core.errors import ProvisionError
from provision.core.notify import Relay

TIMEOUT = 10.0  # seconds: a POST, or one exchange with the relay
MAX_ANSWER = 64 * 1024  # bytes of a webhook's answer read (the rest is dropped with the connection)
IMPLICIT_TLS = 465  # the port where the relay speaks TLS from the first byte (SMTPS)


class _Watchdog:
    """Every request's deadline, kept by one thread (a thread per request cost more than
    the request): at its deadline a request's socket is shut, which ends whatever read or
    write it waits in. Looked at every WATCH_EVERY seconds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watched: dict[int, tuple[float, Callable[[], None]]] = {}
        self.keys = itertools.count()
        self.thread: threading.Thread | None = None

    def watch(self, seconds: float, cut: Callable[[], None]) -> int:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="notify deadlines", daemon=True)
                self.thread.start()
            key = next(self.keys)
            self.watched[key] = (time.monotonic() + seconds, cut)
            return key

    def done(self, key: int) -> None:
        with self.lock:
            self.watched.pop(key, None)

    def run(self) -> None:
        while True:
            time.sleep(WATCH_EVERY)
            now = time.monotonic()
            with self.lock:
                due = [k for k, (at, _) in self.watched.items() if at <= now]
                cuts = [self.watched.pop(k)[1] for k in due]
            for cut in cuts:
                cut()


WATCH_EVERY = 0.2  # seconds: how late a deadline may be seen
_WATCHDOG = _Watchdog()


class _Stale(Exception):
    """A kept connection the receiver had closed: the request goes again on a new one."""


class Poster:
    """POSTs to one URL, on one connection while the receiver keeps it open (HTTP/1.1): a
    burst costs one connection (and one TLS handshake), not one per event."""

    def __init__(self, url: str, timeout: float = TIMEOUT, context: ssl.SSLContext | None = None):
        parts = urlsplit(url)
        self.https, self.host, self.port = parts.scheme == "https", parts.hostname or "", parts.port
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout, self.context = timeout, context
        self.conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes, headers: dict[str, str]) -> int:
        """POST `body`; its status when it is 2xx, else ProvisionError (words without the URL)."""
        try:
            status = self._post(body, headers)
        except _Stale:
            status = self._post(body, headers)
        if not 200 <= status < 300:
            raise ProvisionError(f"answered {status}")
        return status

    def _post(self, body: bytes, headers: dict[str, str]) -> int:
        reused = self.conn is not None
        conn = self.conn = self.conn or self._connect()
        cut = threading.Event()

        def cut_off() -> None:  # the whole exchange's deadline, not each read's
            cut.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        key = _WATCHDOG.watch(self.timeout, cut_off)
        try:
            conn.request("POST", self.target, body=body, headers=headers)
            answer = conn.getresponse()
            answer.read(MAX_ANSWER)
            if answer.will_close or not answer.isclosed():  # closing, or more than we read: not kept
                self.close()
            return answer.status
        except Exception as e:  # every way a connection fails, in words without the URL
            self.close()
            if cut.is_set() or isinstance(e, TimeoutError):  # the deadline, or one read's as long
                raise ProvisionError(f"no answer within {self.timeout:g} s") from None
            if reused and isinstance(e, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError):
                raise _Stale() from None
            raise ProvisionError(_words(e)) from None
        finally:
            _WATCHDOG.done(key)

    def _connect(self) -> http.client.HTTPConnection:
        if self.https:
            ctx = self.context or ssl.create_default_context()
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=ctx)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


def post(
    url: str, body: bytes, headers: dict[str, str], timeout: float = TIMEOUT, context: ssl.SSLContext | None = None
) -> int:
    """One POST on a connection of its own (Poster.post)."""
    p = Poster(url, timeout, context)
    try:
        return p.post(body, headers)
    finally:
        p.close()


def _words(e: BaseException) -> str:
    if isinstance(e, TimeoutError | socket.timeout):
        return "no answer in time"
    if isinstance(e, ssl.SSLCertVerificationError):
        return "its TLS certificate could not be verified"
    if isinstance(e, ssl.SSLError):
        return "TLS failed"
    if isinstance(e, socket.gaierror):
        return "its host name does not resolve"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, http.client.HTTPException):
        return f"a malformed answer ({type(e).__name__})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return type(e).__name__


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Mailer:
    """One connection to the relay: TLS from the start on port 465, else STARTTLS where the
    relay offers it; the login, when the relay has a user. A password never crosses the
    network in clear: a relay off loopback that offers no STARTTLS is refused."""

    def __init__(
        self, relay: Relay, password: str | None, timeout: float = TIMEOUT, context: ssl.SSLContext | None = None
    ):
        self.relay, self.password, self.timeout = relay, password, timeout
        self.context = context or ssl.create_default_context()
        self.smtp: smtplib.SMTP | None = None

    def __enter__(self) -> Mailer:
        r = self.relay
        try:
            if r.port == IMPLICIT_TLS:
                smtp: smtplib.SMTP = smtplib.SMTP_SSL(r.host, r.port, timeout=self.timeout, context=self.context)
            else:
                smtp = smtplib.SMTP(r.host, r.port, timeout=self.timeout)
            self.smtp = smtp
            smtp.ehlo()
            tls = r.port == IMPLICIT_TLS
            if not tls and smtp.has_extn("starttls"):
                smtp.starttls(context=self.context)
                smtp.ehlo()
                tls = True
            if r.user:
                if not tls and not _loopback(r.host):
                    raise ProvisionError("the relay offers no STARTTLS: its password would cross the network in clear")
                smtp.login(r.user, self.password or "")
        except BaseException as e:
            self.__exit__()
            if isinstance(e, ProvisionError):
                raise
            if isinstance(e, Exception):
                raise ProvisionError(_smtp_words(e, r)) from None
            raise
        return self

    def send(self, msg: EmailMessage) -> None:
        assert self.smtp is not None
        try:
            self.smtp.send_message(msg)
        except Exception as e:  # words without the password
            raise ProvisionError(_smtp_words(e, self.relay)) from None

    def __exit__(self, *exc: object) -> None:
        smtp, self.smtp = self.smtp, None
        if smtp is None:
            return
        try:
            smtp.quit()
        except Exception:  # it is going anyway
            smtp.close()


def _smtp_words(e: Exception, r: Relay) -> str:
    if isinstance(e, smtplib.SMTPAuthenticationError):
        return f"the relay refused the login of {r.user} ({e.smtp_code})"
    if isinstance(e, smtplib.SMTPNotSupportedError):
        return "the relay offers no login (AUTH)"
    if isinstance(e, smtplib.SMTPRecipientsRefused):
        return "the relay refused the address"
    if isinstance(e, smtplib.SMTPSenderRefused):
        return f"the relay refused the sender ({e.smtp_code})"
    if isinstance(e, smtplib.SMTPResponseException):
        return f"the relay answered {e.smtp_code}"
    if isinstance(e, smtplib.SMTPServerDisconnected):
        return "the relay hung up"
    if isinstance(e, smtplib.SMTPException):
        return f"the relay: {type(e).__name__}"
    return f"the relay: {_words(e)}"
