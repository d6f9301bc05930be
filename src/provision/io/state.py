"""Local state beside the inventory: what was applied where, and a lock.

`.provision/<job>.state.json` holds format_version, serial, lineage and per host a HostRecord
(how to reach it, the files and tasks provision put there) plus the placement that growing
pools must keep. Rules:
- It is never absent once it existed: every save writes a temp file, fsyncs it and renames
  it over the old one. `.backup` is a copy of the state as this run read it, written once,
  before the run's first save.
- A host is recorded before anything is written to it (as pending), so an apply killed at
  any point leaves every host it touched known; a no-op apply records (adopts) hosts whose
  manifest names the job but the state does not know.
- Checksums are keyed (HMAC-SHA256, key in `<state>.key`, 0600): with the state and the
  inventory, a guessed secret value cannot be confirmed by re-rendering an env file.
- The lock is taken before the state is read, so two applies cannot both start from the same
  serial; its content is written before it exists (link of a complete temp file).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import getpass
import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.records import HostRecord
from provision.spec.placement import Slot

FORMAT_VERSION = 2


def default_state_path(inventory_path: Path, job: str) -> Path:
    return inventory_path.resolve().parent / ".provision" / f"{job}.state.json"


def writable_dir(state_path: Path) -> None:
    """The state's directory exists and takes a new file (the state, its lock, its key and
    the host keys learnt go there): else one line naming it, before any host is asked."""
    d = state_path.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".provision-write-check.{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        raise ProvisionError(
            f"{d}: cannot write there ({e.strerror}): provision keeps the job's state and learnt host keys "
            "in it; make it writable, or give --state a path elsewhere"
        ) from None


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Temp file, fsync, rename, fsync the directory: old or new content, never none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- records


# --------------------------------------------------------------------------- state


class State:
    def __init__(
        self,
        path: Path,
        *,
        lineage: str,
        serial: int,
        job: str,
        hosts: dict[str, HostRecord],
        placement: dict[str, Slot],
        original: bytes | None,
    ):
        self.path = path
        self.lineage = lineage
        self.serial = serial
        self.job = job
        self.hosts = hosts
        self.placement = placement
        self._original = original  # the file as read: the backup, written before the first save
        self._lock = threading.Lock()
        self._key: bytes | None = None
        self._deferred = 0  # inside deferred(): changes are saved once, at its end
        self._dirty = False

    @classmethod
    def load(cls, path: Path, job: str) -> State:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(path, lineage=str(uuid.uuid4()), serial=0, job=job, hosts={}, placement={}, original=None)
        except OSError as e:
            raise ProvisionError(f"{path}: cannot read the state: {e.strerror}") from None
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise ProvisionError(
                f"{path}: state file unreadable ({e}); restore it from {path.name}.backup or move it away"
            ) from None
        if not isinstance(data, dict) or data.get("format_version") not in (1, FORMAT_VERSION):
            version = data.get("format_version") if isinstance(data, dict) else "?"
            raise ProvisionError(
                f"{path}: state format {version} is not {FORMAT_VERSION}; this provision cannot read it"
            )
        if data.get("job") != job:
            raise ProvisionError(
                f"{path}: state belongs to job {data.get('job')!r}, not {job!r}; use --state to point elsewhere"
            )
        try:
            hosts = {str(n): HostRecord.from_json(h) for n, h in data.get("hosts", {}).items()}
            placement = {
                str(n): Slot(str(s["host"]), int(s["port"]), tuple(int(a) for a in s.get("accelerators", ())))
                for n, s in data.get("placement", {}).items()
            }
            return cls(
                path,
                lineage=str(data["lineage"]),
                serial=int(data.get("serial", 0)),
                job=job,
                hosts=hosts,
                placement=placement,
                original=raw,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProvisionError(
                f"{path}: state file has the wrong shape ({type(e).__name__}: {e}); restore it from "
                f"{path.name}.backup or move it away (the next apply adopts what the hosts report)"
            ) from None

    @property
    def known_hosts_path(self) -> Path:
        return self.path.parent / "known_hosts"

    @property
    def key_path(self) -> Path:
        return self.path.with_name(self.path.name.removesuffix(".json") + ".key")

    def keyed(self, digest: str) -> str:
        """A checksum as kept here: HMAC-SHA256 under this state's key."""
        if self._key is None:
            try:
                self._key = bytes.fromhex(self.key_path.read_text().strip())
            except (OSError, ValueError):
                self._key = secrets.token_bytes(32)
                _write_atomic(self.key_path, self._key.hex().encode() + b"\n")
        return "hmac-sha256:" + hmac.new(self._key, digest.encode(), hashlib.sha256).hexdigest()

    def previous_placement(self) -> dict[str, Slot]:
        return dict(self.placement)

    # -- changes: each saves at once (thread-safe), called as hosts finish; inside
    # deferred(), once at its end

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Save the changes made inside once, when it ends (an apply step: its hosts finish
        at about the same time, and a save per host costs an fsync and the whole file each,
        O(hosts²) bytes: seconds at 128 hosts). Safe because what a kill must find on disk
        is saved before the step: every host about to be written, recorded pending."""
        with self._lock:
            self._deferred += 1
        try:
            yield
        finally:
            with self._lock:
                self._deferred -= 1
                if not self._deferred and self._dirty:
                    self._save()

    def _changed(self) -> None:
        if self._deferred:
            self._dirty = True
        else:
            self._save()

    def record_host(self, name: str, record: HostRecord) -> None:
        with self._lock:
            self.hosts[name] = replace(record, applied_at=_now())
            self._changed()

    def record_hosts(self, records: Mapping[str, HostRecord]) -> None:
        """Several hosts in one save (apply names every host it is about to write at once)."""
        if not records:
            return
        with self._lock:
            now = _now()
            for name, record in records.items():
                self.hosts[name] = replace(record, applied_at=now)
            self._changed()

    def forget_host(self, name: str) -> None:
        with self._lock:
            if self.hosts.pop(name, None) is not None:
                self._changed()

    def set_placement(self, placement: Mapping[str, Slot]) -> None:
        with self._lock:
            if dict(placement) != self.placement:
                self.placement = dict(placement)
                self._changed()

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "serial": self.serial,
            "lineage": self.lineage,
            "job": self.job,
            "updated_at": _now(),
            "hosts": {n: asdict(h) for n, h in sorted(self.hosts.items())},
            "placement": {
                n: {"host": s.host, "port": s.port, "accelerators": list(s.accelerators)}
                for n, s in sorted(self.placement.items())
            },
        }

    def _save(self) -> None:
        self._dirty = False
        if self._original is not None:
            _write_atomic(self.path.with_name(self.path.name + ".backup"), self._original)
            self._original = None
        self.serial += 1
        _write_atomic(self.path, (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode())


# --------------------------------------------------------------------------- lock


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


def lock_path(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".lock")


class StateLock:
    """An exclusive lock file next to the state, like Terraform's local backend lock.

    The file appears with its content already in it (a complete temp file is hard-linked
    to the lock's name, which fails if the name exists). A lock whose holder died on this
    machine is stale and is taken over with a notice; any other lock (alive, elsewhere, or
    unreadable) needs `provision force-unlock`.
    """

    def __init__(self, state_path: Path, operation: str):
        self.path = lock_path(state_path)
        self.operation = operation
        self.info: LockInfo | None = None
        self.notice: str | None = None

    def try_acquire(self) -> LockInfo | None:
        """Take the lock, or return who holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = LockInfo(str(uuid.uuid4()), getpass.getuser(), os.getpid(), socket.gethostname(), self.operation, _now())
        tmp = self.path.with_name(f".{self.path.name}.{me.id}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(me), f)
            f.flush()
            os.fsync(f.fileno())
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                    self.info = me
                    return None
                except FileExistsError:
                    holder = read_lock(self.path)
                    if holder is None or not _stale(holder):
                        return holder or LockInfo("?", "?", 0, "?", "an operation that is still writing its lock", "?")
                    self.notice = f"took over a stale lock ({holder.describe()})"
                    _unlink_if(self.path, holder.id)
            raise ProvisionError(f"{self.path}: could not take the lock")
        finally:
            tmp.unlink(missing_ok=True)

    def acquire(self) -> StateLock:
        holder = self.try_acquire()
        if holder is not None:
            raise ProvisionError(
                f"state is locked: {holder.describe()}. Wait for it to finish; if it is gone, "
                f"run `provision force-unlock INVENTORY {holder.id}`"
            )
        return self

    def release(self) -> None:
        if self.info is not None:
            _unlink_if(self.path, self.info.id)
        self.info = None

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _unlink_if(path: Path, lock_id: str) -> None:
    """Remove the lock file only if it is still the one with lock_id."""
    holder = read_lock(path)
    if holder is not None and holder.id == lock_id:
        path.unlink(missing_ok=True)


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
    path = lock_path(state_path)
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
