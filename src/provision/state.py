"""Local state beside the inventory: what was applied where, and a lock.

`.provision/<job>.state.json` holds format_version, serial, lineage and per host what was
applied (file checksums, tasks and their inputs, how to reach the host) plus the placement
that growing pools must keep. It is rewritten atomically after every host finishes, so a
killed apply leaves the last complete write. Secret values are never in it: only checksums.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import ProvisionError
from .placement import Slot

FORMAT_VERSION = 1


def default_state_path(inventory_path: Path, job: str) -> Path:
    return inventory_path.resolve().parent / ".provision" / f"{job}.state.json"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class State:
    def __init__(self, path: Path, data: dict):
        self.path = path
        self.data = data
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path, job: str) -> "State":
        if not path.exists():
            return cls(path, {"format_version": FORMAT_VERSION, "serial": 0, "lineage": str(uuid.uuid4()), "job": job, "hosts": {}, "placement": {}})
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ProvisionError(f"{path}: state file unreadable ({e}); restore it from {path.name}.backup or move it away") from None
        if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
            raise ProvisionError(f"{path}: state format {data.get('format_version') if isinstance(data, dict) else '?'} is not {FORMAT_VERSION}; this provision cannot read it")
        if data.get("job") != job:
            raise ProvisionError(f"{path}: state belongs to job {data.get('job')!r}, not {job!r}; use --state to point elsewhere")
        return cls(path, data)

    @property
    def known_hosts_path(self) -> Path:
        return self.path.parent / "known_hosts"

    def previous_placement(self) -> dict[str, Slot]:
        return {
            name: Slot(s["host"], int(s["port"]), tuple(s.get("accelerators", ())))
            for name, s in self.data.get("placement", {}).items()
        }

    def hosts(self) -> dict[str, dict]:
        return self.data.get("hosts", {})

    def update(self, *, host: str | None = None, entry: dict | None = None, remove_host: str | None = None, placement: dict | None = None) -> None:
        """Change and save at once (thread-safe): called after every host finishes."""
        with self._lock:
            hosts = self.data.setdefault("hosts", {})
            if host is not None and entry is not None:
                hosts[host] = {**entry, "applied_at": _now()}
            if remove_host is not None:
                hosts.pop(remove_host, None)
            if placement is not None:
                self.data["placement"] = placement
            self._save()

    def _save(self) -> None:
        self.data["serial"] = int(self.data.get("serial", 0)) + 1
        self.data["updated_at"] = _now()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if self.path.exists():
            os.replace(self.path, self.path.with_name(self.path.name + ".backup"))
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------- lock


@dataclass
class LockInfo:
    id: str
    who: str
    pid: int
    machine: str
    operation: str
    created: str

    def describe(self) -> str:
        return f"{self.operation} by {self.who} on {self.machine} (pid {self.pid}) since {self.created}, lock id {self.id}"


class StateLock:
    """An exclusive lock file next to the state, like Terraform's local backend lock.

    A lock whose holder died on this machine (SIGKILL, power loss) is stale and is taken
    over with a notice; a lock held elsewhere needs `provision force-unlock`.
    """

    def __init__(self, state_path: Path, operation: str):
        self.path = state_path.with_name(state_path.name + ".lock")
        self.operation = operation
        self.info: LockInfo | None = None
        self.notice: str | None = None

    def acquire(self) -> "StateLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = LockInfo(str(uuid.uuid4()), getpass.getuser(), os.getpid(), socket.gethostname(), self.operation, _now())
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                holder = read_lock(self.path)
                if holder is not None and not _stale(holder):
                    raise ProvisionError(
                        f"state is locked: {holder.describe()}. Wait for it to finish; if it is gone, "
                        f"run `provision force-unlock INVENTORY {holder.id}`"
                    )
                self.notice = f"took over a stale lock ({holder.describe() if holder else 'unreadable lock file'})"
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me.__dict__, f)
            self.info = me
            return self
        raise ProvisionError(f"{self.path}: could not take the lock")

    def release(self) -> None:
        if self.info is None:
            return
        holder = read_lock(self.path)
        if holder is not None and holder.id == self.info.id:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.info = None

    def __enter__(self) -> "StateLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def read_lock(path: Path) -> LockInfo | None:
    try:
        return LockInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _stale(info: LockInfo) -> bool:
    if info.machine != socket.gethostname():
        return False
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def force_unlock(state_path: Path, lock_id: str) -> LockInfo:
    path = state_path.with_name(state_path.name + ".lock")
    holder = read_lock(path)
    if holder is None:
        if path.exists():
            path.unlink()
            raise ProvisionError(f"{path}: lock file was unreadable; removed it")
        raise ProvisionError(f"{path}: no lock is held")
    if holder.id != lock_id:
        raise ProvisionError(f"lock id {lock_id} does not match the lock held: {holder.describe()}")
    path.unlink()
    return holder
