"""The fabric's baselines (`provision check --bandwidth`), kept in the state backend: a file
beside the local state (`.provision/fabric-baselines.json`, shared by the inventories whose
state lives in that directory) or a table of the team's PostgreSQL
(provision_fabric_baselines, the team's whole cluster). One record per host class and tool:
the first healthy measurement; a later one replaces it only when asked (--new-baseline).
What is read back is checked as the hosts' numbers are (rules/fabric.Baseline.from_json)."""

from __future__ import annotations

import fcntl
import json
import socket
from pathlib import Path
from typing import Any

from provision.core.errors import ProvisionError
from provision.io.state import _write_atomic
from provision.io.statestore import Store
from provision.rules.fabric import Baseline
from provision.rules.tenancy import identity

FILE = "fabric-baselines.json"
FORMAT_VERSION = 1
MAX_BYTES = 1 << 20
MAX_RECORDS = 1000
TABLE = "provision_fabric_baselines"
DDL = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    class text NOT NULL,
    tool text NOT NULL,
    doc text NOT NULL,
    measured_at timestamptz NOT NULL DEFAULT now(),
    measured_by text NOT NULL DEFAULT '',
    PRIMARY KEY (class, tool))"""


class Baselines:
    """Where the baselines are, read and kept."""

    where: str

    def read(self) -> list[Baseline]:
        raise NotImplementedError

    def keep(self, b: Baseline, *, replace: bool) -> bool:
        """Store b as its class's and tool's baseline: only where there is none, unless
        `replace`. True when it was stored."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what it holds open (the database's connection is the state's)."""


def of(store: Store) -> Baselines:
    if store.backend.local:
        return LocalBaselines(store.local_path.parent / FILE)
    return PgBaselines(store)


def who() -> str:
    return identity(socket.gethostname())


class LocalBaselines(Baselines):
    def __init__(self, path: Path):
        self.path = path
        self.where = str(path)

    def _load(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise ProvisionError(f"{self.where}: cannot read the fabric's baselines: {e.strerror}") from None
        try:
            if len(data) > MAX_BYTES:
                raise ValueError(f"larger than {MAX_BYTES} bytes")
            doc = json.loads(data)
            if not isinstance(doc, dict) or not isinstance(doc.get("baselines"), dict):
                raise ValueError("not a baselines document")
        except (ValueError, RecursionError) as e:
            raise ProvisionError(
                f"{self.where}: the fabric's baselines cannot be read ({e}); move the file away to start new ones"
            ) from None
        return dict(doc["baselines"])

    def read(self) -> list[Baseline]:
        out = []
        for d in list(self._load().values())[:MAX_RECORDS]:
            b = Baseline.from_json(d)
            if b is not None:
                out.append(b)
        return out

    def keep(self, b: Baseline, *, replace: bool) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two checks at once: the first healthy one is kept
            records = self._load()
            key = f"{b.host_class}|{b.tool}"
            if key in records and Baseline.from_json(records[key]) is not None and not replace:
                return False
            if key not in records and len(records) >= MAX_RECORDS:
                raise ProvisionError(f"{self.where}: {MAX_RECORDS} baselines already; remove some to keep another")
            records[key] = b.to_json()
            doc = {"format_version": FORMAT_VERSION, "baselines": records}
            _write_atomic(self.path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(), 0o644)
        return True


class PgBaselines(Baselines):
    """The team's baselines in its PostgreSQL state, through the state's own connection."""

    def __init__(self, store: Store):
        self.store = store
        self.where = store.where
        self._ready = False

    def _run(self, what: str, sql: str, args: tuple[Any, ...]) -> Any:
        """sql on the state's connection (the table made sure of first); a database error
        is one line naming the URL and `what`."""
        # Start-up time: psycopg loads only for a PostgreSQL state (open_store's rule).
        import psycopg

        from provision.io.pgstate import PgStore, why  # start-up time: psycopg's, as above

        assert isinstance(self.store, PgStore)
        try:
            conn = self.store.conn
            if not self._ready:
                conn.execute(DDL)
                self._ready = True
            return conn.execute(sql, args)
        except psycopg.Error as e:
            raise ProvisionError(f"{self.where}: cannot {what}: {why(e)}") from None

    def read(self) -> list[Baseline]:
        rows = self._run(
            "read the fabric's baselines", f"SELECT doc FROM {TABLE} ORDER BY class, tool LIMIT %s", (MAX_RECORDS,)
        )
        docs = [str(r[0]) for r in rows.fetchall()]
        out = []
        for text in docs:
            try:
                b = Baseline.from_json(json.loads(text[:MAX_BYTES]))
            except (ValueError, RecursionError):
                b = None
            if b is not None:
                out.append(b)
        return out

    def keep(self, b: Baseline, *, replace: bool) -> bool:
        doc = json.dumps(b.to_json(), sort_keys=True)
        on = "DO UPDATE SET doc = EXCLUDED.doc, measured_at = now(), measured_by = EXCLUDED.measured_by"
        cur = self._run(
            "keep the fabric's baseline",
            f"INSERT INTO {TABLE} (class, tool, doc, measured_by) VALUES (%s, %s, %s, %s) "
            f"ON CONFLICT (class, tool) {on if replace else 'DO NOTHING'}",
            (b.host_class, b.tool, doc, who()),
        )
        return bool(cur.rowcount == 1)
