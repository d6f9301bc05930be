"""What a sandbox is: its hosts (containers with systemd and sshd, reached over SSH on
127.0.0.1), how to reach them, and the record of it kept under the sandbox directory."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import docker
import docker.errors
import docker.types
import paramiko
from docker.models.containers import Container

from provision.core.errors import ProvisionError

from . import engine
from ._util import write_private

if TYPE_CHECKING:
    import fabric  # the real import is connection()'s: only tests use it

DEFAULT_NAME = "sandbox"


GPU_LABEL = "provision.sandbox.gpus"


SSH_USER = "root"


ACCELERATOR_TYPE = "nvidia-h100"  # what the image's nvidia-smi stand-in reports


_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")


@dataclass
class SandboxHost:
    name: str  # inventory name: host-1, host-2, ...
    container: str  # Docker container name, also its hostname
    ssh_port: int  # published on ssh_host
    cluster_address: str  # how the other hosts reach it (= container name)
    gpus: int = 0  # fake GPUs reported by the image's nvidia-smi stand-in
    ssh_host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.ssh_host}:{self.ssh_port}"


@dataclass
class Sandbox:
    name: str
    network: str
    key_path: Path
    known_hosts_path: Path
    hosts: list[SandboxHost]
    image: str = ""
    frameworks: tuple[str, ...] = ()
    created: float = 0.0
    user: str = SSH_USER
    status: str = "ready"

    @property
    def state_dir(self) -> Path:
        return self.key_path.parent

    @property
    def gpus_per_host(self) -> int:
        return self.hosts[0].gpus if self.hosts else 0

    def host(self, which: str | int) -> SandboxHost:
        """A host by inventory name ("host-2"), container name, or 1-based number."""
        for h in self.hosts:
            if which in (h.name, h.container) or (isinstance(which, int) and h.name == f"host-{which}"):
                return h
        raise KeyError(f"sandbox {self.name!r} has no host {which!r}")

    def _h(self, host: SandboxHost | str | int) -> SandboxHost:
        return host if isinstance(host, SandboxHost) else self.host(host)

    # -- access -----------------------------------------------------------------------
    def ssh_command(self, host: SandboxHost | str | int) -> list[str]:
        """An OpenSSH command line that logs in as root, checking the host's own key."""
        h = self._h(host)
        return [
            "ssh",
            "-i",
            str(self.key_path),
            "-p",
            str(h.ssh_port),
            "-o",
            f"UserKnownHostsFile={self.known_hosts_path}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "IdentitiesOnly=yes",
            f"{self.user}@{h.ssh_host}",
        ]

    def connection(self, host: SandboxHost | str | int, **kwargs: Any) -> fabric.Connection:
        """A fabric.Connection to the host, with the sandbox key and known host keys.

        Unknown or changed host keys are refused (the sandbox recorded each host's key
        when it came up); ~/.ssh/config is not read; `run` does not forward stdin."""
        import fabric  # lazy: fabric's import time (invoke, its tasks) only for who connects

        h = self._h(host)
        connect_kwargs = {
            "key_filename": str(self.key_path),
            "look_for_keys": False,
            "allow_agent": False,
            **kwargs.pop("connect_kwargs", {}),
        }
        conn = fabric.Connection(
            host=h.ssh_host,
            port=h.ssh_port,
            user=self.user,
            connect_kwargs=connect_kwargs,
            connect_timeout=kwargs.pop("connect_timeout", 10),
            # No stdin forwarding: tests and CI have none to give (pytest refuses reads).
            config=fabric.Config(overrides={"load_ssh_configs": False, "run": {"in_stream": False}}),
            **kwargs,
        )
        if self.known_hosts_path.exists():
            conn.client.load_host_keys(str(self.known_hosts_path))
            conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        return conn

    def container(self, host: SandboxHost | str | int, client: docker.DockerClient | None = None) -> Container:
        """The docker SDK Container object of a host (for fault injection in tests)."""
        return (client or engine.client()).containers.get(self._h(host).container)

    def docker_exec(
        self, host: SandboxHost | str | int, cmd: str | list[str], client: docker.DockerClient | None = None
    ) -> tuple[int, str]:
        """Run a command in the host through Docker, bypassing SSH: (exit code, output)."""
        res = self.container(host, client).exec_run(cmd)
        # Neither streamed nor detached: the exit code is there and the output is bytes.
        return cast(int, res.exit_code), cast(bytes, res.output).decode(errors="replace")

    # -- (de)serialisation ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["key_path"] = str(self.key_path)
        d["known_hosts_path"] = str(self.known_hosts_path)
        d["frameworks"] = list(self.frameworks)
        d["version"] = 1
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sandbox:
        return cls(
            name=d["name"],
            network=d["network"],
            key_path=Path(d["key_path"]),
            known_hosts_path=Path(d["known_hosts_path"]),
            hosts=[SandboxHost(**h) for h in d.get("hosts", [])],
            image=d.get("image", ""),
            frameworks=tuple(d.get("frameworks", ())),
            created=d.get("created", 0.0),
            user=d.get("user", SSH_USER),
            status=d.get("status", "ready"),
        )

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        write_private(self.state_dir / "sandbox.json", json.dumps(self.to_dict(), indent=2) + "\n", 0o644)


@dataclass
class SandboxSummary:
    name: str
    hosts: int  # hosts in the metadata (0 when it is gone)
    containers: int  # containers labelled with the sandbox's name
    running: int
    gpus_per_host: int = 0
    frameworks: tuple[str, ...] = ()
    created: float = 0.0
    metadata: bool = False
    status: str = ""


@dataclass
class DownResult:
    name: str
    containers: int = 0
    networks: int = 0
    state_removed: bool = False
    errors: list[str] = field(default_factory=list)
    # Networks Docker would not remove for endpoints of containers already gone (a dockerd
    # bug, moby#17217; a dockerd restart clears them). Harmless: `up` then uses another name.
    stale_networks: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.containers or self.networks or self.state_removed or self.stale_networks)


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ProvisionError(
            f"sandbox name {name!r}: use 1-40 characters a-z, 0-9 and '-', starting with a "
            "letter (it becomes part of the hosts' DNS names)"
        )
    return name


def container_name(sandbox: str, index: int) -> str:
    return f"{sandbox}-host-{index}"


def network_name(sandbox: str) -> str:
    return f"provision-sandbox-{sandbox}"
