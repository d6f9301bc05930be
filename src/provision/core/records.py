"""What the local state keeps of a host and its tasks: how to reach it again and what
provision put there (plan, programs and apply read these; io/state stores them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TaskRecord:
    unit: str
    inputs: str  # keyed digest
    phase: int


@dataclass(frozen=True)
class HostRecord:
    """A host the job was applied to: how to reach it again (it may leave the inventory)
    and what provision put there."""

    address: str
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    jump_host: str | None = None
    connect_timeout: float = 10.0
    host_key_policy: str = "accept-new"
    files: dict[str, str] = field(default_factory=dict)  # path → keyed digest
    tasks: dict[str, TaskRecord] = field(default_factory=dict)
    pending: bool = False  # being written: what is there is not known yet
    applied_at: str = ""
    # The interface that held the host's cluster address (interface_address) when it was
    # last resolved there: NCCL's and Gloo's interface in the env files. Plan renders with
    # it and resolves again only on a host where something changes (engine.settled).
    interface: str = ""
    interface_address: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HostRecord:
        tasks = {
            n: TaskRecord(str(t["unit"]), str(t["inputs"]), int(t["phase"])) for n, t in data.get("tasks", {}).items()
        }
        return cls(
            address=str(data["address"]),
            port=data.get("port"),
            user=data.get("user"),
            identity_file=data.get("identity_file"),
            jump_host=data.get("jump_host"),
            connect_timeout=float(data.get("connect_timeout", 10.0)),
            host_key_policy=str(data.get("host_key_policy", "accept-new")),
            files={str(k): str(v) for k, v in data.get("files", {}).items()},
            tasks=tasks,
            pending=bool(data.get("pending", False)),
            applied_at=str(data.get("applied_at", "")),
            interface=str(data.get("interface", "")),
            interface_address=str(data.get("interface_address", "")),
        )

    def units(self) -> list[str]:
        return sorted(t.unit for t in self.tasks.values())
