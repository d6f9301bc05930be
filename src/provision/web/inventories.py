"""A Source over inventory files (what the service hands the dashboard until it has its own):
each answer from the run/ functions the CLI's `--json` calls (`jobs`, `status`, `logs -o`,
`tune --status`, `stop`, `apply --rerun`, `tune --promote`), one inventory per job.

The hosts' SSH connections are kept per job (a Session shared by every request's Context,
each opened fresh so another operator's apply is seen) and used by one request at a time.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.lifecycle import STOP_PHASE, TaskState
from provision.core.model import Inventory
from provision.core.target import HostError
from provision.core.tuning import TrialRow, TrialState
from provision.io.ssh import Session
from provision.rules.studyview import space_json, study_json
from provision.rules.tenancy import HostView, host_view, jobs_json
from provision.run.context import Ask, Context, open_context, probe
from provision.run.jobend import collect, end_job, look
from provision.run.logs import log_entries
from provision.spec.inventory import load
from provision.web.source import NotFound, masked_env

LOG_TAIL = 200  # lines of each task a page starts with
HOSTS_FRESH = 2.0  # seconds a probe of the hosts answers the pages that ask meanwhile


class InventorySource:
    def __init__(self, paths: Sequence[str | Path]):
        self.paths = [str(p) for p in paths]
        self._sessions: dict[str, Session] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._hosts: tuple[float, dict[str, Any]] | None = None

    # ------------------------------------------------------------------ plumbing

    def _inventories(self) -> dict[str, tuple[str, Inventory]]:
        """job -> (its file, the inventory); read each time: a file may have changed."""
        out: dict[str, tuple[str, Inventory]] = {}
        for p in self.paths:
            inv = load(p)
            out.setdefault(inv.job, (p, inv))
        return out

    def _find(self, name: str, *, study: bool = False) -> tuple[str, Inventory]:
        invs = self._inventories()
        known = sorted(j for j, (_, inv) in invs.items() if not study or inv.tune is not None)
        found = invs.get(name)
        if found is None or (study and found[1].tune is None):
            raise NotFound(f"{'study' if study else 'job'} {name}", known)
        return found

    @contextmanager
    def _ctx(self, job: str, path: str, operation: str | None = None, secrets: bool = False) -> Iterator[Context]:
        """A fresh Context on the job's kept connections, for one request at a time."""
        with self._guard:
            lock = self._locks.setdefault(job, threading.Lock())
        with lock:
            ctx = open_context(path, render_secrets=secrets, operation=operation, session=self._sessions.get(job))
            if job not in self._sessions:
                self._sessions[job] = ctx.session
                ctx.own_session = False  # kept for the next request; close() ends it
            try:
                yield ctx
            finally:
                ctx.close()

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()

    # ------------------------------------------------------------------ reading

    def hosts(self) -> dict[str, Any]:
        """`provision jobs --json` over every inventory's hosts (each host once), with its labels."""
        cached = self._hosts
        if cached is not None and time.monotonic() - cached[0] < HOSTS_FRESH:
            return cached[1]
        views: dict[str, HostView] = {}
        extra: dict[str, dict[str, Any]] = {}
        now = time.time()
        policy = None
        for job, (path, inv) in self._inventories().items():
            with self._ctx(job, path) as ctx:
                policy = policy or ctx.policy  # the priorities' names (one team, one policy)
                res = probe(ctx, Ask(files=False, tenancy=True), fast=True)
                for h in inv.hosts:
                    if h.name in views:
                        continue
                    r = res.get(h.name)
                    if isinstance(r, HostError) or r is None:
                        why = r.message if r is not None else "not asked"
                        views[h.name] = HostView(h.name, h.accelerator_count, error=why)
                    else:
                        views[h.name] = host_view(h.name, h.accelerator_count, r, now)
                    extra[h.name] = {"labels": h.label_map, "drain": h.drain}
        doc = jobs_json(list(views.values()), now, policy)
        for name, more in extra.items():
            doc["hosts"][name].update(more)
        self._hosts = (time.monotonic(), doc)
        return doc

    def jobs(self) -> dict[str, Any]:
        return self.hosts()

    def job(self, name: str) -> dict[str, Any]:
        """`provision status --json`, with the env (secrets masked), its study and its actions."""
        path, inv = self._find(name)
        with self._ctx(name, path) as ctx:
            st = collect(ctx)
        doc = st.to_json()
        live = any(t.state.live or t.state is TaskState.PENDING for t in st.tasks)
        actions = (["stop"] if live else []) + (["rerun"] if st.phase.ended else [])
        doc.update(env=masked_env(inv.env, inv.secret_env), study=name if inv.tune else None, actions=actions)
        return doc

    def logs(self, name: str, after: str | None) -> dict[str, Any]:
        path, _ = self._find(name)
        cursors = _cursors(after)
        with self._ctx(name, path) as ctx:
            entries, cursors, errors = log_entries(ctx, tail=LOG_TAIL, cursors=cursors)
        lines = [
            {"time": _iso(e.ts / 1e6), "task": e.task, "host": e.host, "text": e.text.replace("\x1b", "\\e")}
            for e in entries
        ]
        return {"lines": lines, "after": _token(cursors), "errors": errors}

    def studies(self) -> list[str]:
        return sorted(j for j, (_, inv) in self._inventories().items() if inv.tune is not None)

    def study(self, name: str) -> dict[str, Any]:
        """`provision tune --status --json` (picture: none, the page draws its own), with its space."""
        path, inv = self._find(name, study=True)
        assert inv.tune is not None
        rows, ended = _trials(path, inv)
        doc = study_json(name, inv.tune, rows, ended=ended, picture=None)
        return {**doc, "space": space_json(inv.tune)}

    def usage(self) -> dict[str, Any]:
        # No history here (the service keeps it): what the hosts hold now is all there is.
        return {"format_version": 1, "days": [], "weeks": [], "idle": []}

    def owner(self, name: str) -> str | None:
        """The job's owner as the hosts' ledgers name it; a study's: its trials' owner."""
        jobs: dict[str, str | None] = {j["job"]: j.get("owner") for j in self.hosts()["jobs"]}
        if name in jobs:
            return jobs[name]
        return next((o for j, o in sorted(jobs.items()) if j.startswith(f"{name}-t") and o), None)

    # ------------------------------------------------------------------ actions

    def stop(self, name: str, who: str) -> dict[str, Any]:
        """`provision stop -y`: the end marker names `who`; the state's history too."""
        path, _ = self._find(name)
        with self._ctx(name, path, operation="stop") as ctx:
            st, foreign = look(ctx)
            if foreign is not None:
                return {"ok": False, "message": foreign}
            if not any(t.state.live or t.state is TaskState.PENDING for t in st.tasks):
                return {"ok": False, "message": f"nothing to stop: job {st.phase}"}
            marker = None if st.phase.ended else _marker(who)
            stopped = end_job(ctx, st, marker=marker)
            msg = f"Stopped {len(stopped)} task{'s' if len(stopped) != 1 else ''} (by {who}, from the dashboard)."
            ctx.state.note(who, "stop", msg)
        self._hosts = None
        return {"ok": True, "message": msg, "stopped": stopped}

    def rerun(self, name: str, who: str) -> dict[str, Any]:
        """`provision apply --rerun -y`: the job's secrets come from this process's environment."""
        # Lazy: apply's planning and steps (start-up of a dashboard that only reads).
        from provision.run.apply import apply_plan
        from provision.run.planning import build_plan

        path, _ = self._find(name)
        try:
            with self._ctx(name, path, operation="apply", secrets=True) as ctx:
                plan = build_plan(ctx, rerun=True, checks=True)
                if plan.problems:
                    return {"ok": False, "message": "; ".join(plan.problems)}
                outcomes = apply_plan(ctx, plan)
                bad = [f"{h}: {o.error}" for h, o in outcomes.items() if o.error]
                msg = "; ".join(bad) or f"Started job {name} again (by {who}, from the dashboard)."
                ctx.state.note(who, "apply", msg)
        except ProvisionError as e:
            return {"ok": False, "message": e.message}
        self._hosts = None
        return {"ok": not bad, "message": msg}

    def cancel(self, name: str, who: str) -> dict[str, Any]:
        return {"ok": False, "message": "cancel is the service's: these inventories have no queue of its own"}

    def promote(self, name: str, trial: int, who: str) -> dict[str, Any]:
        """`provision tune --promote N`: the inventory text (shown, not written anywhere)."""
        from provision.spec.promote import promoted  # (start-up: only a promotion needs it)

        path, inv = self._find(name, study=True)
        assert inv.tune is not None
        row = next((r for r in _trials(path, inv)[0] if r.number == trial), None)
        if row is None:
            return {"ok": False, "message": f"study {name} has no trial {trial}"}
        value = f"{inv.tune.metric.name}={row.value:.6g}" if row.value is not None else "no value"
        here = Path(path).resolve().parent
        text = promoted(
            Path(path).read_text(encoding="utf-8"),
            inv.tune,
            dict(row.params),
            number=row.number,
            why=f"{row.state.value}, {value}",
            src_dir=here,
            out_dir=here,
        )
        return {"ok": True, "message": f"trial {row.number} ({value}) as job {name}", "inventory": text}


def _trials(path: str, inv: Inventory) -> tuple[list[TrialRow], str | None]:
    """The study's trials as `tune --status` reads them, and why it ended (None: it goes on)."""
    # Lazy: the study's storage imports Optuna (about a second of start-up).
    from provision.run.tune import existing_study

    study = existing_study(path, inv)
    if study is None:
        return [], None
    rows = study.rows()
    running = any(r.state is TrialState.RUNNING for r in rows)
    return rows, study.ended(len(rows)) if rows and not running else None


def _marker(who: str) -> dict[str, str]:
    return {"phase": STOP_PHASE, "reason": f"stopped by {who} (provision dashboard)", "at": _iso(time.time())}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _token(cursors: dict[str, dict[str, str]]) -> str:
    """The cursors as the opaque `after` a page sends back."""
    return base64.urlsafe_b64encode(json.dumps(cursors, sort_keys=True).encode()).decode()


def _cursors(after: str | None) -> dict[str, dict[str, str]]:
    if not after:
        return {}
    try:
        data = json.loads(base64.urlsafe_b64decode(after.encode()))
    except (ValueError, binascii.Error):
        return {}  # a stale or forged cursor: start again from the last lines
    if not isinstance(data, dict):
        return {}
    return {str(h): {str(t): str(c) for t, c in v.items()} for h, v in data.items() if isinstance(v, dict)}
