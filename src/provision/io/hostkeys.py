"""Host keys: the ones provision has learnt (`known_hosts` beside the state, OpenSSH's
format), the user's ~/.ssh/known_hosts (read, never written), and the policy for a key
neither knows: accept-new learns it, strict refuses it, off takes any. A changed key is
never accepted (paramiko raises BadHostKeyException before a policy is asked)."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import paramiko

from provision.core.errors import ProvisionError


def key_id(address: str, port: int) -> str:
    """The name a host's key is kept under (OpenSSH's: `[host]:port` off port 22)."""
    return address if port == 22 else f"[{address}]:{port}"


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
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

    def lookup(self, name: str) -> Any:
        return self.keys.lookup(name) or self.system.lookup(name)

    def learn(self, name: str, key: paramiko.PKey) -> None:
        with self.lock:
            self.keys.add(name, key.get_name(), key)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Its own temporary name: a study's trials each have a KnownHosts on one file.
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            self.keys.save(str(tmp))
            os.replace(tmp, self.path)

    def prepare(self, client: paramiko.SSHClient, host: str, port: int, policy: str) -> None:
        """Give one connection's client (a host or a jump host on the way) the keys known
        for it and the policy for a key it has never seen."""
        if policy == "off":
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
            return
        name = key_id(host, port)  # paramiko's own lookup name (after ssh_config)
        for typ, key in (self.lookup(name) or {}).items():
            client.get_host_keys().add(name, typ, key)
        client.set_missing_host_key_policy(MissingKeyPolicy(self, policy))


class MissingKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for keys it does not know (changed keys never get here)."""

    def __init__(self, known: KnownHosts, policy: str):
        self.known = known
        self.policy = policy

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if self.policy == "off":
            return
        if self.policy == "accept-new":
            self.known.learn(hostname, key)
            return
        raise UnknownKey(hostname, key)


class UnknownKey(Exception):
    def __init__(self, name: str, key: paramiko.PKey):
        super().__init__(name)
        self.key_id = name
        self.key = key
