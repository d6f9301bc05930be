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

State reads and saves through a Store (io/statestore.py): LocalStore here is the file above;
with `state:` or PROVISION_STATE naming a PostgreSQL URL, io/pgstate.py keeps the same
document in a database the team shares (open_store picks it).
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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.records import HostRecord, stamped
from provision.core.recovery import RecoveryRecord
from provision.inventory.statebackend import Backend
from provision.io.statestore import (
    FORMAT_VERSION,
    MOVED_TO,
    Change,
    LockInfo,
    Store,
    history_path,
    locked_error,
    migrated_path,
)
from provision.placement.tasks import Slot
from provision.rules.liveness import process_alive
from provision.rules.tenancy import identity


def default_state_path(inventory_path: Path, job: str) -> Path:
    return inventory_path.resolve().parent / ".provision" / f"{job}.state.json"


def writable_dir(state_path: Path) -> None:
    """The state's directory exists and takes a new file (the state, its lock, its key and
    the host keys learnt go there): else one line naming it, before any host is asked."""
    d = state_path.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".provision-write-check.{os.getpid()}.{threading.get_ident()}"  # a study opens trials side by side
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
        store: Store | None = None,
        recovery: RecoveryRecord | None = None,
    ):
        self.path = path  # the local file (with another backend: where it would be; known_hosts beside it)
        self.store: Store = store or LocalStore(path)
        self._stored: int | None = serial if original is not None else None  # the serial as stored
        self.lineage = lineage
        self.serial = serial
        self.job = job
        self.hosts = hosts
        self.placement = placement
        self.recovery = recovery or RecoveryRecord()  # hosts set aside for the job, its incidents
        self._original = original  # the file as read: the backup, written before the first save
        self._lock = threading.Lock()
        self._key: bytes | None = None
        self._deferred = 0  # inside deferred(): changes are saved once, at its end
        self._dirty = False
        self.who = ""  # who applies (tenancy.identity()): each file's new content is recorded as theirs

    @classmethod
    def load(cls, where: Path | Store, job: str) -> State:
        """The job's state from a local file (a path) or any store; a new one when there is none."""
        store = where if isinstance(where, Store) else LocalStore(where)
        path = store.local_path
        raw = store.read()
        if raw is None:
            return cls(
                path, lineage=str(uuid.uuid4()), serial=0, job=job, hosts={}, placement={}, original=None, store=store
            )
        where_ = store.where
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise ProvisionError(f"{where_}: {store.noun} unreadable ({e}); {store.unreadable_hint}") from None
        if not isinstance(data, dict) or data.get("format_version") not in (1, FORMAT_VERSION):
            version = data.get("format_version") if isinstance(data, dict) else "?"
            raise ProvisionError(
                f"{where_}: state format {version} is not {FORMAT_VERSION}; this provision cannot read it"
            )
        if data.get("job") != job:
            raise ProvisionError(
                f"{where_}: state belongs to job {data.get('job')!r}, not {job!r}; use --state to point elsewhere"
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
                store=store,
                recovery=RecoveryRecord.from_json(data.get("recovery")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProvisionError(
                f"{where_}: {store.noun} has the wrong shape ({type(e).__name__}: {e}); {store.unreadable_hint} "
                "(the next apply adopts what the hosts report)"
            ) from None

    @property
    def known_hosts_path(self) -> Path:
        return self.path.parent / "known_hosts"

    @property
    def key_path(self) -> Path:
        return key_path(self.path)

    @property
    def exists(self) -> bool:
        """The backend has this job's state (it was read, or saved since)."""
        return self._stored is not None

    def keyed(self, digest: str) -> str:
        """A checksum as kept here: HMAC-SHA256 under this state's key (the backend's)."""
        if self._key is None:
            self._key = self.store.key()
        return "hmac-sha256:" + hmac.new(self._key, digest.encode(), hashlib.sha256).hexdigest()

    def note(self, who: str, operation: str, summary: str) -> None:
        """Add a change to the backend's history (`provision state history`)."""
        self.store.record(Change(_now(), who, operation, self.serial, summary))

    def close(self) -> None:
        self.store.close()

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

    def _stamped(self, name: str, record: HostRecord, now: str) -> HostRecord:
        """The record with who applied each file (the serial: the next save's, made under the lock)."""
        if not self.who:
            self.who = identity(socket.gethostname())
        return stamped(self.hosts.get(name), replace(record, applied_at=now), self.who, now, self.serial + 1)

    def record_host(self, name: str, record: HostRecord) -> None:
        with self._lock:
            self.hosts[name] = self._stamped(name, record, _now())
            self._changed()

    def record_hosts(self, records: Mapping[str, HostRecord]) -> None:
        """Several hosts in one save (apply names every host it is about to write at once)."""
        if not records:
            return
        with self._lock:
            now = _now()
            for name, record in records.items():
                self.hosts[name] = self._stamped(name, record, now)
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

    def set_recovery(self, record: RecoveryRecord) -> None:
        """The job's recoveries (core/recovery.py), saved at once: a service killed in the
        middle of one, or the owner's next apply, goes on from what is here."""
        with self._lock:
            if record != self.recovery:
                self.recovery = record
                self._changed()

    def to_json(self) -> dict[str, Any]:
        out = self._json()
        if self.recovery != RecoveryRecord():
            out["recovery"] = self.recovery.to_json()
        return out

    def _json(self) -> dict[str, Any]:
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
        self.serial += 1
        data = (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()
        try:
            self.store.write(data, serial=self.serial, lineage=self.lineage, expect=self._stored, backup=self._original)
        except BaseException:
            self.serial -= 1  # not saved: the next save tries again from what is stored
            self._dirty = True
            raise
        self._original = None
        self._stored = self.serial


# --------------------------------------------------------------------------- the local file


def key_path(state_path: Path) -> Path:
    return state_path.with_name(state_path.name.removesuffix(".json") + ".key")


class LocalStore(Store):
    """The state file beside the inventory (module docstring), its key, lock and history."""

    def __init__(self, path: Path):
        self.path = self.local_path = path
        self.backend = Backend()
        self.job = path.name.removesuffix(".state.json")
        self.where = str(path)
        self.noun = "state file"
        self.unreadable_hint = f"restore it from {path.name}.backup or move it away"

    @property
    def owner_ref(self) -> str:
        return str(Path(self.path).resolve())

    def read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            moved = migrated_path(self.path)
            if moved.exists():
                last = next((c.summary for c in self.history(1) if c.summary.startswith(MOVED_TO)), "")
                to = last.removeprefix(MOVED_TO).removesuffix(".") or "another backend"
                raise ProvisionError(
                    f"{self.path}: this job's state was moved to {to} by `provision state migrate` (the old file is "
                    f"kept as {moved.name}); point `state:` in the inventory or PROVISION_STATE there, or move "
                    f"{moved.name} away to start a new local state"
                ) from None
            return None
        except OSError as e:
            raise ProvisionError(f"{self.path}: cannot read the state: {e.strerror}") from None

    def write(self, data: bytes, *, serial: int, lineage: str, expect: int | None, backup: bytes | None) -> None:
        # The lock keeps others out: no compare-and-set (one rename, as it always was).
        if backup is not None:
            _write_atomic(self.path.with_name(self.path.name + ".backup"), backup)
        _write_atomic(self.path, data)

    def key(self) -> bytes:
        kp = key_path(self.path)
        try:
            return bytes.fromhex(kp.read_text().strip())
        except (OSError, ValueError):
            key = secrets.token_bytes(32)
            _write_atomic(kp, key.hex().encode() + b"\n")
            return key

    def lock(self, operation: str) -> StateLock:
        return StateLock(self.path, operation)

    def held(self) -> LockInfo | None:
        return read_lock(lock_path(self.path))

    def force_unlock(self, lock_id: str) -> LockInfo:
        return force_unlock(self.path, lock_id)

    def record(self, change: Change) -> None:
        hp = history_path(self.path)
        fd = os.open(hp, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(change.to_json(), sort_keys=True) + "\n")

    def history(self, n: int) -> list[Change]:
        try:
            lines = history_path(self.path).read_text().splitlines()
        except FileNotFoundError:
            return []
        except OSError as e:
            raise ProvisionError(f"{history_path(self.path)}: cannot read the history: {e.strerror}") from None
        out: list[Change] = []
        for line in reversed(lines):
            if len(out) >= n:
                break
            try:
                c = Change.from_json(json.loads(line))
            except ValueError:
                c = None
            if c is not None:
                out.append(c)
        return out

    def peek(self) -> tuple[bytes | None, str | None]:
        try:
            return self.path.read_bytes(), None
        except FileNotFoundError:
            return None, None
        except OSError as e:
            raise ProvisionError(f"{self.path}: cannot read the state: {e.strerror}") from None

    def adopt(self, data: bytes, *, lineage: str, serial: int, key: bytes, history: list[Change]) -> None:
        _write_atomic(key_path(self.path), key.hex().encode() + b"\n")
        old, _ = self.peek()
        if old is not None:
            _write_atomic(self.path.with_name(self.path.name + ".backup"), old)
        _write_atomic(self.path, data)
        have = set(self.history(10**6))
        for c in reversed(history):  # oldest first; what is here already is not repeated
            if c not in have:
                self.record(c)

    def retire(self, to: str) -> None:
        os.replace(self.path, migrated_path(self.path))


def open_store(backend: Backend, state_path: Path, job: str) -> Store:
    """The job's store in `backend`: the file at state_path, or the database (connected:
    one line naming it when it cannot be reached)."""
    if backend.local:
        return LocalStore(state_path)
    # Start-up: psycopg and the database code load only for a PostgreSQL state (~40 ms).
    from provision.io.pgstate import PgStore

    return PgStore(backend, job, state_path)


# --------------------------------------------------------------------------- lock


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
            raise ProvisionError(locked_error(holder, server_frees=False))
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
    """A lock whose holder is gone (a lock file never beats: only a holder on this machine can be judged)."""
    return not process_alive(info.machine, info.pid, None, 0.0, None)


def force_unlock(state_path: Path, lock_id: str) -> LockInfo:
    path = lock_path(state_path)
    holder = read_lock(path)
    if holder is None:
        if path.exists():
            path.unlink(missing_ok=True)
            raise ProvisionError(f"{path}: lock file was unreadable; removed it")
        raise ProvisionError(f"{path}: no lock is held")
    if holder.id != lock_id:
        raise ProvisionError(f"lock id {lock_id} does not match the lock held: {holder.describe()}")
    # Two teammates at once: one rename wins; the other removed nothing and says so. What
    # was moved aside goes only if it is the lock named (a new one taken meanwhile goes back).
    aside = path.with_name(f".{path.name}.removing-{uuid.uuid4()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        raise ProvisionError(f"{path}: no lock is held (someone removed it just now)") from None
    moved = read_lock(aside)
    if moved is None or moved.id != lock_id:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        raise ProvisionError(f"{path}: lock {lock_id} is not held (someone removed it just now)")
    aside.unlink(missing_ok=True)
    return holder
