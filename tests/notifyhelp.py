"""Receivers for the notification tests (tests/test_notify.py, and the real service's in
tests/integration/test_notify_serve.py), all on loopback:

Receiver(answer=...)      # an HTTP server in a thread: every POST kept (headers, body), answered by `answer`
self_signed(tmp)          # a certificate for 127.0.0.1 and localhost, and its key (PEM files)
SmtpSink(cert, key, ...)  # a real SMTP server (aiosmtpd): STARTTLS required, a login, the mail kept
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Got:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered

    @property
    def doc(self) -> Any:
        return json.loads(self.body)

    def signed_by(self, key: bytes) -> bool:
        want = "sha256=" + hmac.new(key, self.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(self.headers.get("x-provision-signature", ""), want)


class Receiver:
    """An HTTP server on 127.0.0.1 (a port of its own); `answer(n)` is the status of the
    n-th POST (from 0), after `hang` (an Event the POST waits on, when given)."""

    def __init__(
        self, answer: Callable[[int], int] = lambda n: 200, hang: threading.Event | None = None, keep: str = ""
    ):
        self.got: list[Got] = []
        self.arrived = 0  # POSTs read, answered or not yet
        self.connections: set[int] = set()  # the client ports they came from
        self.lock = threading.Lock()
        self.answer, self.hang = answer, hang
        outer = self

        class Handler(BaseHTTPRequestHandler):
            # keep="yes": HTTP/1.1, connections kept; keep="drop": kept as far as the client
            # knows, but closed after each answer (as a server's idle timeout closes them)
            protocol_version = "HTTP/1.1" if keep else "HTTP/1.0"

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                with outer.lock:
                    outer.arrived += 1
                if outer.hang is not None:
                    outer.hang.wait(120)
                with outer.lock:
                    status = outer.answer(len(outer.got))
                    outer.got.append(Got(self.path, {k.lower(): v for k, v in self.headers.items()}, body, status))
                    outer.connections.add(self.client_address[1])
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
                if keep == "drop":
                    self.close_connection = True

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/hook/SECRET-PATH-TOKEN") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def taken(self) -> list[Got]:
        """The POSTs answered 2xx, in order."""
        with self.lock:
            return [g for g in self.got if 200 <= g.status < 300]

    def close(self) -> None:
        if self.hang is not None:
            self.hang.set()
        self.server.shutdown()
        self.server.server_close()


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem): a certificate for 127.0.0.1 and localhost, signed by itself."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    tmp.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SmtpSink:
    """A real SMTP server on 127.0.0.1 (aiosmtpd): STARTTLS with the self-signed
    certificate, required before anything else (`tls`: else none offered); a login of
    `user` with `password` required; every message kept (parsed)."""

    def __init__(self, cert: Path, key: Path, user: str = "bot", password: str = "s3cret-pw", tls: bool = True):
        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult, LoginPassword

        self.messages: list[Any] = []
        self.logins: list[tuple[str, bool]] = []
        outer = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                import email
                from email import policy

                outer.messages.append(email.message_from_bytes(envelope.content, policy=policy.default))
                return "250 OK"

        def auth(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
            good = (
                isinstance(data, LoginPassword) and data.login == user.encode() and data.password == password.encode()
            )
            outer.logins.append((data.login.decode() if isinstance(data, LoginPassword) else "?", good))
            return AuthResult(success=good, handled=False)

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        self.port = free_port()
        self.controller = Controller(
            Handler(),
            hostname="127.0.0.1",
            port=self.port,
            tls_context=context if tls else None,
            require_starttls=tls,
            auth_required=True,
            auth_require_tls=tls,
            authenticator=auth,
            server_hostname="localhost",
        )
        self.controller.start()

    def close(self) -> None:
        self.controller.stop()
