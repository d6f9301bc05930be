"""Waiting for a sandbox host to boot: sshd answering, root logging in with the sandbox's
key, systemd done starting (running or degraded); a container that exits says why."""

from __future__ import annotations

import socket
import threading
import time

import docker
import docker.errors
import docker.types
import paramiko

from provision.core.errors import ProvisionError
from provision.sandbox.hosts import (
    Sandbox,
    SandboxHost,
)

from ._util import Progress


def _sshd_banner(host: str, port: int) -> None:
    """Raise OSError unless sshd sends its banner. Docker's port proxy accepts connections
    before sshd listens and then drops them; probing with a plain socket first keeps
    paramiko from logging a traceback for each such early attempt."""
    with socket.create_connection((host, port), timeout=2) as s:
        s.settimeout(2)
        if not s.recv(4).startswith(b"SSH"):
            raise ConnectionResetError(f"{host}:{port}: no SSH banner yet")


def wait_ready(
    client: docker.DockerClient,
    sb: Sandbox,
    h: SandboxHost,
    deadline: float,
    cancel: threading.Event,
    progress: Progress,
) -> str:
    """Poll until root logs in with the key and systemd finished booting.

    Returns the host's known_hosts line (its key as seen on the first login)."""
    pkey = paramiko.Ed25519Key.from_private_key_file(str(sb.key_path))
    last = "no answer yet"
    attempt = 0
    while not cancel.is_set():
        attempt += 1
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProvisionError(f"{h.container} (127.0.0.1:{h.ssh_port}): not ready after the timeout: {last}")
        cli = paramiko.SSHClient()
        cli.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            _sshd_banner(h.ssh_host, h.ssh_port)
            cli.connect(
                h.ssh_host,
                h.ssh_port,
                username=sb.user,
                pkey=pkey,
                look_for_keys=False,
                allow_agent=False,
                timeout=5,
                banner_timeout=5,
                auth_timeout=5,
            )
            transport = cli.get_transport()
            assert transport is not None  # connect() succeeded
            key = transport.get_remote_server_key()
            # --wait blocks until boot is over; the failed units explain "degraded".
            _, out, _ = cli.exec_command(
                "systemctl is-system-running --wait; systemctl list-units --failed --plain --no-legend --no-pager",
                timeout=max(1.0, remaining),
            )
            lines = out.read().decode(errors="replace").split("\n")
            state = lines[0].strip()
            if state in ("running", "degraded"):
                if state == "degraded":
                    failed = ", ".join(ln.split()[0] for ln in lines[1:] if ln.strip())
                    progress(f"{h.container}: degraded (failed units: {failed or '?'})")
                return f"[{h.ssh_host}]:{h.ssh_port} {key.get_name()} {key.get_base64()}\n"
            last = f"systemctl is-system-running says {state!r}"
        except (paramiko.SSHException, OSError, EOFError) as e:
            last = f"{type(e).__name__}: {e}"
        finally:
            cli.close()
        if attempt % 10 == 0:  # an exited container never gets ready: say why at once
            _still_running(client, h)
        time.sleep(0.2)
    raise ProvisionError(f"{h.container}: cancelled")


def _still_running(client: docker.DockerClient, h: SandboxHost) -> None:
    """Raise, saying why, if the host's container is no longer running."""
    try:
        c = client.containers.get(h.container)
    except docker.errors.NotFound:
        raise ProvisionError(f"{h.container}: container vanished during boot") from None
    if c.status not in ("running", "created", "restarting"):
        logs = c.logs(tail=5).decode(errors="replace").strip().replace("\n", " | ")
        code = c.attrs.get("State", {}).get("ExitCode")
        raise ProvisionError(
            f"{h.container}: exited during boot (status {c.status}, exit code "
            f"{code}); last output: {logs or 'none'}; with many hosts, raise "
            "fs.inotify.max_user_instances (`sysctl -w "
            "fs.inotify.max_user_instances=8192`)"
        )
