"""Where a host is and how to reach it (Target), and a failure on one host (HostError):
the types every layer passes around, defined below the SSH code that uses them most."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model is the spec's; a Target needs only its host's SSH settings
    from provision.core.model import Host


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
    def from_host(cls, host: Host) -> Target:
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
