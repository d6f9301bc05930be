"""`provision state`: a job's state as its backend keeps it (show, history), and moving it
from one backend to another (migrate). Nothing here reaches a host.

migrate copies the document as it is (lineage and serial kept, so the hosts' ledgers still
name this state as the job's owner and the next plan has nothing to do), with its checksum
key and its history, under both backends' locks; then the source is retired: the local file
is renamed JOB.state.json.migrated, a database row is marked moved. A retired source
refuses to be used (one line saying where the state went), so no one goes on applying from
the old place; pointing `state:` or PROVISION_STATE at the new one is the user's step.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
from dataclasses import asdict
from typing import Any

from provision.core.errors import ProvisionError
from provision.io.state import State
from provision.io.statestore import MOVED_TO, Change, Store

SHOW_FORMAT_VERSION = 1


def backend_json(store: Store) -> dict[str, Any]:
    return {"type": store.backend.kind, "where": store.where, "source": store.backend.source}


def show_json(store: Store, state: State) -> dict[str, Any]:
    """`provision state show --json`."""
    held = store.held()
    last = store.history(1)
    return {
        "format_version": SHOW_FORMAT_VERSION,
        "job": state.job,
        "backend": backend_json(store),
        "exists": state.exists,
        "lineage": state.lineage if state.exists else None,
        "serial": state.serial,
        "hosts": {
            n: {
                "address": h.address,
                "port": h.port,
                "pending": h.pending,
                "tasks": sorted(h.tasks),
                "files": len(h.files),
                "applied_at": h.applied_at or None,
            }
            for n, h in sorted(state.hosts.items())
        },
        "placement": {
            n: {"host": s.host, "port": s.port, "accelerators": list(s.accelerators)}
            for n, s in sorted(state.placement.items())
        },
        "lock": asdict(held) if held else None,
        "last_change": last[0].to_json() if last else None,
    }


def show_lines(doc: dict[str, Any]) -> list[str]:
    b = doc["backend"]
    src = "" if b["source"] == "default" else f" (from {b['source']})"
    out = [f"Job {doc['job']}: state in {b['where']}{src}"]
    if not doc["exists"]:
        out.append("No state yet: nothing was applied from this backend.")
        return out
    out.append(f"Lineage {doc['lineage']}, serial {doc['serial']}")
    hosts = doc["hosts"]
    out.append(f"Hosts: {len(hosts)}" + ("" if hosts else " (nothing applied, or all destroyed)"))
    rows = [("  HOST", "ADDRESS", "TASKS", "APPLIED")]
    for n, h in hosts.items():
        addr = f"{h['address']}:{h['port']}" if h["port"] else h["address"]
        rows.append(
            (f"  {n}", addr, ",".join(h["tasks"]) or "-", "pending" if h["pending"] else h["applied_at"] or "-")
        )
    if hosts:
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lock = doc["lock"]
    out.append(
        "Lock: free" if lock is None else f"Lock: held by {lock['operation']} of {lock['who']} on {lock['machine']}"
    )
    last = doc["last_change"]
    if last:
        out.append(f"Last change: {change_line(Change(**last))}")
    return out


def change_line(c: Change) -> str:
    return f"{c.at}  {c.who}  {c.operation} (serial {c.serial})" + (f": {c.summary}" if c.summary else "")


def history_json(store: Store, job: str, changes: list[Change]) -> dict[str, Any]:
    return {
        "format_version": SHOW_FORMAT_VERSION,
        "job": job,
        "backend": backend_json(store),
        "changes": [c.to_json() for c in changes],
    }


def _doc(store: Store, raw: bytes) -> tuple[str, int]:
    """A stored document's lineage and serial (read as State.load reads it)."""
    try:
        data = json.loads(raw)
        return str(data["lineage"]), int(data.get("serial", 0))
    except (ValueError, KeyError, TypeError) as e:
        raise ProvisionError(f"{store.where}: {store.noun} cannot be read ({e}); {store.unreadable_hint}") from None


def migrate(source: Store, target: Store, who: str) -> tuple[str, int]:
    """Copy the job's state from source to target, then retire the source. Returns the
    lineage and the serial (both kept)."""
    job = source.job
    with contextlib.ExitStack() as held:
        for store in (source, target):
            held.enter_context(store.lock("migrate"))
        state = State.load(source, job)  # refuses what this provision cannot read (a newer format)
        raw, _ = source.peek()
        if raw is None or not state.exists:
            raise ProvisionError(f"{source.where}: no state of job {job} here: nothing to migrate")
        there, moved = target.peek()
        if there is not None:
            lineage, serial = _doc(target, there)
            if lineage != state.lineage:
                raise ProvisionError(
                    f"{target.where}: already holds a state of job {job} with another lineage ({lineage}, not "
                    f"{state.lineage}): another job of that name, or one applied anew; nothing was changed"
                )
            if serial > state.serial and moved is None:
                raise ProvisionError(
                    f"{target.where}: already holds job {job}'s state at serial {serial}, newer than "
                    f"{source.where}'s ({state.serial}); nothing was changed"
                )
        target.adopt(raw, lineage=state.lineage, serial=state.serial, key=source.key(), history=source.history(1000))
        at = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        target.record(Change(at, who, "migrate", state.serial, f"Migrated from {source.where}."))
        to = target.where if not target.backend.local else f"local ({target.where})"
        source.record(Change(at, who, "migrate", state.serial, f"{MOVED_TO}{to}."))
        source.retire(to)
    return state.lineage, state.serial
