"""What the local state keeps of a host and its tasks: how to reach it again and what
provision put there (plan, programs and apply read these; io/state stores them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class TaskRecord:
    unit: str
    inputs: str  # keyed digest
    phase: int


@dataclass(frozen=True)
class Applied:
    """Who applied a file's content on a host, and when: a teammate's apply that
    would replace it is told so (rules/provenance.py). `digest` (the first 16 hex digits of
    the content's keyed digest) tells whether the host still has that content."""

    who: str  # tenancy.identity() of the apply
    at: str  # ISO 8601, UTC
    serial: int  # the state's serial that recorded it
    digest: str

    @classmethod
    def from_json(cls, d: Any) -> Applied | None:
        try:
            return cls(str(d["who"]), str(d["at"]), int(d["serial"]), str(d["digest"]))
        except (KeyError, TypeError, ValueError):
            return None  # a provenance that cannot be read only loses the warning


def short(keyed: str) -> str:
    """The part of a keyed digest (State.keyed) an Applied keeps."""
    return keyed.rsplit(":", 1)[-1][:16]


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
    # path -> who applied the content there (added in format 2: a state without it loads
    # with none, and a release without it drops it)
    applied: dict[str, Applied] = field(default_factory=dict)

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
            applied={str(k): a for k, v in (data.get("applied") or {}).items() if (a := Applied.from_json(v))},
        )

    def units(self) -> list[str]:
        return sorted(t.unit for t in self.tasks.values())


def stamped(old: HostRecord | None, new: HostRecord, who: str, at: str, serial: int) -> HostRecord:
    """`new` with who applied each of its files: the content a file had before keeps its
    applier (none, when it was applied before appliers were recorded); new content is `who`'s. A pending record (being written: the host still has
    what it had) keeps the old appliers, and names none for what it is about to write."""
    before = old.applied if old is not None else {}
    if new.pending:
        return replace(new, applied=dict(before))
    applied = {}
    for path, digest in new.files.items():
        d, prev = short(digest), before.get(path)
        if prev is not None and prev.digest == d:
            applied[path] = prev
        elif prev is None and old is not None and not old.pending and old.files.get(path) == digest:
            continue  # the same content, applied before this was recorded: whose is not known
        else:
            applied[path] = Applied(who, at, serial, d)
    return replace(new, applied=applied)
