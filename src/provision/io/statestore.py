"""Where a job's state is kept, as State and the commands see it: one interface, two
backends. The local file beside the inventory (io/state.py: LocalStore, the default) and a
PostgreSQL database a team shares (io/pgstate.py: PgStore, loaded only when used).

Both keep the same JSON document (format_version, serial, lineage, hosts, placement), the
key of its checksums, a lock taken before the document is read, and the history of the
changes made through it (who, when, what, the summary line). A backend's save is
compare-and-set where others can write (PostgreSQL: on the serial this run read); the
local file relies on its lock, as before.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from provision.inventory.statebackend import Backend

# The state document's format, the same in every backend (the file's JSON, the database's
# column): io/state.py reads 1 and 2 and writes 2. A field added with a default that the
# older reader ignores (HostRecord.applied) keeps the version: both releases read each
# other's states (a release without the field drops it on its next save). A change an older
# release would misread bumps it.
FORMAT_VERSION = 2
MOVED_TO = "Moved to "  # the summary `state migrate` leaves in the old place's history


@dataclass(frozen=True)
class LockInfo:
    id: str
    who: str
    pid: int
    machine: str
    operation: str
    created: str

    def describe(self) -> str:
        return (
            f"{self.operation} by {self.who} on {self.machine} (pid {self.pid}) since {self.created}, lock id {self.id}"
        )


@dataclass(frozen=True)
class Change:
    """One change made through a backend: `provision state history`'s row."""

    at: str  # ISO 8601, UTC
    who: str  # tenancy.identity(): PROVISION_OWNER, git's user.email, or user@host
    operation: str  # apply, destroy, stop, migrate
    serial: int  # the state's serial after the change
    summary: str  # the command's last line (`Apply complete! Resources: ...`)

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "who": self.who,
            "operation": self.operation,
            "serial": self.serial,
            "summary": self.summary,
        }

    @classmethod
    def from_json(cls, d: Any) -> Change | None:
        if not isinstance(d, dict):
            return None
        try:
            return cls(str(d["at"]), str(d["who"]), str(d["operation"]), int(d.get("serial", 0)), str(d["summary"]))
        except (KeyError, TypeError, ValueError):
            return None


class Lock(Protocol):
    """The state's lock (StateLock, PgLock): taken before the state is read."""

    info: LockInfo | None
    notice: str | None

    def try_acquire(self) -> LockInfo | None: ...

    def acquire(self) -> Lock: ...

    def release(self) -> None: ...

    def __enter__(self) -> Lock: ...

    def __exit__(self, *exc: object) -> None: ...


def locked_error(holder: LockInfo, *, server_frees: bool) -> str:
    """The line for a lock someone else holds (`provision force-unlock` takes the id)."""
    if server_frees:
        return (
            f"state is locked: {holder.describe()}. Wait for it to finish (the database frees the lock when "
            f"that process ends, however it ends); if it hangs, `provision force-unlock INVENTORY {holder.id}` "
            "ends its database session"
        )
    return (
        f"state is locked: {holder.describe()}. Wait for it to finish; if it is gone, "
        f"run `provision force-unlock INVENTORY {holder.id}`"
    )


class Store(abc.ABC):
    """One job's state in one backend."""

    backend: Backend
    job: str
    local_path: Path  # the local state file, or where it would be: known_hosts are kept beside it
    where: str  # how messages name it: the file's path, or the URL (never a password)
    noun: str  # "state file", "state of job J"
    unreadable_hint: str  # what to do with a document that cannot be read

    @property
    @abc.abstractmethod
    def owner_ref(self) -> str:
        """What the hosts' ledgers record as the owner's state (tenancy.Owner.state)."""

    @abc.abstractmethod
    def read(self) -> bytes | None:
        """The document as stored, None when the job has none here."""

    @abc.abstractmethod
    def write(self, data: bytes, *, serial: int, lineage: str, expect: int | None, backup: bytes | None) -> None:
        """Store `data` (serial `serial`): only over the serial `expect` this run read (None:
        there was none); `backup`: the document as this run read it (its first save)."""

    @abc.abstractmethod
    def key(self) -> bytes:
        """The checksums' HMAC key, created on first use; never shown."""

    @abc.abstractmethod
    def lock(self, operation: str) -> Lock: ...

    @abc.abstractmethod
    def held(self) -> LockInfo | None:
        """Who holds the lock now, if anyone."""

    @abc.abstractmethod
    def force_unlock(self, lock_id: str) -> LockInfo: ...

    @abc.abstractmethod
    def record(self, change: Change) -> None: ...

    @abc.abstractmethod
    def history(self, n: int) -> list[Change]:
        """The last n changes, newest first."""

    @abc.abstractmethod
    def peek(self) -> tuple[bytes | None, str | None]:
        """For `state migrate`: the document, and where it was moved to (or None), without
        refusing a moved one."""

    @abc.abstractmethod
    def adopt(self, data: bytes, *, lineage: str, serial: int, key: bytes, history: list[Change]) -> None:
        """For `state migrate`: take a document from another backend as it is, with its key
        and history."""

    @abc.abstractmethod
    def retire(self, to: str) -> None:
        """For `state migrate`: the job's state now lives at `to`; this one says so."""

    def close(self) -> None:  # noqa: B027 - only a connection needs closing
        """Let go of what the store holds open."""


def history_path(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".history")


def migrated_path(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".migrated")
