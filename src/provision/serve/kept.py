"""What the service kept of the work it followed, as the pages read it: a job's runs (the
history), its timeline (the event stream), its logs (io/servicelogs.py, for when its hosts
no longer have them), and a job's page made from those alone when no inventory names it any
more (a terminal's job seen on a shared host, work finished long ago). It decides nothing."""

from __future__ import annotations

from provision.core.answers import LogLine, LogsDoc
from provision.core.events import EventJson
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore
from provision.rules.historyview import HistoryRowJson, RowIn, row_json, why_of
from provision.rules.jobsdoc import JobJson
from provision.rules.status import JobDoc

TIMELINE = 200  # a job's last events its page shows
RUNS = 200  # a job's last history rows its page shows
KEPT_SHOWN = 2000  # the kept lines a page starts with (the newest)
KEPT_CURSOR = "kept:"  # a kept copy's cursor: its newest block's id (nothing follows them)
# How a job's page names the phase of a run the history holds.
PHASES = {
    "succeeded": "Succeeded",
    "failed": "Failed",
    "stopped": "Stopped",
    "stopped early": "Stopped",
    "cancelled": "Stopped",
    "preempted": "Preempted",
    "destroyed": "Stopped",
    "running": "Running",
    "waiting": "Pending",
}
LEDGER_PHASES = {"running": "Running", "reserved": "Pending", "queued": "Pending", "held": "Stopped"}


def row_in(r: HistoryRow) -> RowIn:
    return {
        "kind": r.kind, "job": r.job, "owner": r.owner, "started": r.started, "ended": r.ended, "how": r.how,
        "hosts": r.hosts, "gpus": r.gpus, "submission": r.submission,
    }  # fmt: skip


def rows_json(rows: list[HistoryRow], now: float) -> list[HistoryRowJson]:
    return [row_json(row_in(r), now) for r in rows]


def job_runs(store: ServiceStore, name: str, now: float) -> list[HistoryRowJson]:
    return rows_json(store.job_history(name, RUNS), now)


def job_timeline(store: ServiceStore, name: str) -> list[EventJson]:
    return [s.to_json() for s in store.job_events(name, TIMELINE)]


def remembered(name: str, ledger: JobJson | None, runs: list[HistoryRowJson], kept: bool) -> JobDoc | None:
    """A job's page when no inventory names it: its last run's words (the history) and what
    the hosts' ledgers hold of it now; None when the service knows nothing of it."""
    if not runs and ledger is None:
        return None
    last = next((r for r in reversed(runs) if r["kind"] != "wait"), runs[-1] if runs else None)
    if ledger is not None and ledger["state"] != "ended":
        phase, reason = LEDGER_PHASES.get(ledger["state"], "Unknown"), None
    elif last is not None:
        phase, reason = PHASES.get(last["state"], "Unknown"), why_of(last["how"]) or None
    else:
        phase, reason = "Unknown", None
    owner = (ledger["owner"] if ledger is not None else None) or (last["owner"] if last is not None else None)
    doc: JobDoc = {
        "format_version": 2, "job": name, "phase": phase, "reason": reason, "unreachable": [], "tasks": [],
        "left_behind": [], "owner": owner, "run": None, "setup_lines": {}, "health": [], "env": {}, "study": None,
        "actions": [], "known": "history", "kept_logs": kept,
    }  # fmt: skip
    if ledger is not None:
        doc["held"] = ledger["hosts"]
    return doc


def gone_since(doc: JobDoc, runs: list[HistoryRowJson]) -> JobDoc:
    """A job its hosts no longer have (destroyed: every task "not applied") whose last run
    the history holds: its page says how that run ended, not "Pending: not started", and
    offers no Stop."""
    last = next((r for r in reversed(runs) if r["kind"] != "wait" and r["ended"] is not None), None)
    if last is None or any(r["ended"] is None for r in runs):  # one open: it waits or runs again
        return doc
    if not doc["tasks"] or any(t["detail"] != "not applied" for t in doc["tasks"]):
        return doc
    why = why_of(last["how"])
    reason = f"{why} (its tasks are no longer on its hosts)" if why else "its tasks are no longer on its hosts"
    return {**doc, "phase": PHASES.get(last["state"], "Unknown"), "reason": reason, "actions": [], "tasks": []}


def kept_logs(store: ServiceStore, name: str, after: str | None) -> LogsDoc | None:
    """The kept copy of the job's lines (its newest KEPT_SHOWN), once: a page that has them
    asks again with their cursor and gets none; None: nothing kept."""
    if after is not None and after.startswith(KEPT_CURSOR):
        return {"lines": [], "after": after, "errors": [], "kept": True}
    got, newest = store.kept_logs(name, KEPT_SHOWN)
    if not got:
        return None
    lines: list[LogLine] = [{"time": k.time, "task": k.task, "host": k.host, "text": k.text} for k in got]
    return {"lines": lines, "after": f"{KEPT_CURSOR}{newest}", "errors": [], "kept": True}
