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
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from provision.core.answers import ActionAnswer, LogLine, LogsDoc
from provision.core.errors import ProvisionError
from provision.core.events import EVENTS_FORMAT, EventsDoc, Kind
from provision.core.lifecycle import STOP_PHASE, TaskState
from provision.core.model import Inventory
from provision.core.tuning import Curve, TrialRow, Tune, promoted_job
from provision.io.journal import Entry
from provision.io.ssh import Session
from provision.rules.healthlog import HealthReportDoc
from provision.rules.historyview import HISTORY_FORMAT, HistoryDoc, HistoryQuery
from provision.rules.jobsdoc import JobsDoc
from provision.rules.priority import Policy
from provision.rules.quotas import QuotasDoc, quotas
from provision.rules.status import JobDoc
from provision.rules.studyview import StudyCurves, StudyDoc, ended_trial_status, space_json, study_json
from provision.rules.usage import UsageDoc
from provision.run.context import Context, open_context
from provision.run.jobend import collect, end_job, look
from provision.run.logs import log_entries
from provision.run.survey import Inventories, survey
from provision.web.recent import Recent
from provision.web.source import NotFound, masked_env

if TYPE_CHECKING:  # the reader imports Optuna: loaded at the first study asked
    from provision.io.studyread import Snapshot, StudyReader

LOG_TAIL = 200  # lines of each task a page starts with
# Bytes the log keeper reads from one host when a run ends, at most: its tasks' last lines may
# be 48 KiB each (journald's LineMax), and the store keeps 8 MiB of a job anyway.
KEEP_READ_LIMIT = 64 << 20
KEPT = "kept"  # the cursor after a kept copy's lines (nothing follows them)
# A trial's job: its study's job, "-t", its number (core/tuning.trial_job).
TRIAL_NAME = re.compile(r"^(?P<study>[a-z0-9][a-z0-9-]*?)-t(?P<number>[1-9][0-9]{0,8})$")


@dataclass(frozen=True)
class Trial:
    """A study's trial as its page shows it: the study's inventory (and file), its row, its reports."""

    path: str
    study: Inventory
    row: TrialRow
    curve: Curve


# A probe of every host answers the pages for HOSTS_FRESH s, then while the next is asked
# behind it, up to HOSTS_STALE s old: a page waits for a probe only after 4 s without one.
HOSTS_FRESH, HOSTS_STALE = 2.0, 4.0
# A job's status (a probe of its hosts): answered from one probe for JOB_FRESH s, then while
# the next is asked behind it, up to JOB_STALE s old (its logs are asked apart: live).
JOB_FRESH, JOB_STALE = 1.0, 2.0


class InventorySource:
    """A Source over inventory files (`invs`: their paths may change between requests)."""

    def __init__(self, paths: Sequence[str | Path] | Inventories):
        self.invs = paths if isinstance(paths, Inventories) else Inventories([str(p) for p in paths])
        self._sessions: dict[str, Session] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._hosts: Recent[JobsDoc] = Recent(HOSTS_FRESH, HOSTS_STALE)
        self._jobs: Recent[JobDoc] = Recent(JOB_FRESH, JOB_STALE)
        # Each study's reader, kept (io/studyread.py: read again only where it changed), and
        # the JSON made from its last snapshot: (snapshot, tune, document) by study.
        self._readers: dict[tuple[str | None, str, str], StudyReader] = {}
        self._study_docs: dict[str, tuple[Snapshot | None, Tune, StudyDoc]] = {}
        self._policy: Policy | None = None  # the team's, as the last survey's inventories' state names it

    # ------------------------------------------------------------------ plumbing

    def _inventories(self) -> dict[str, tuple[str, Inventory]]:
        """job -> (its file, the inventory)."""
        return self.invs.read()

    def _find(self, name: str, *, study: bool = False) -> tuple[str, Inventory]:
        invs = self._inventories()
        known = sorted(j for j, (_, inv) in invs.items() if not study or inv.tune is not None)
        found = invs.get(name)
        if found is None or (study and found[1].tune is None):
            raise NotFound(f"{'study' if study else 'job'} {name}", known)
        return found

    @contextmanager
    def _ctx(
        self,
        job: str,
        path: str,
        operation: str | None = None,
        secrets: bool = False,
        lane: str = "",
        trial: tuple[Inventory, str | None] | None = None,
    ) -> Iterator[Context]:
        """A fresh Context on the job's kept connections, for one request at a time. `lane`:
        connections of their own (a look at every host never makes a page's logs wait);
        `trial`: a study's trial (its inventory, its state file) instead of `path`'s job."""
        key = f"{job}\0{lane}" if lane else job
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            kept = self._sessions.get(key)
            loaded, state = trial if trial is not None else (None, None)
            ctx = open_context(
                path, state_path=state, loaded=loaded, render_secrets=secrets, operation=operation, session=kept,
                keep_session=True,
            )  # fmt: skip
            self._sessions.setdefault(key, ctx.session)  # kept for the next request; close() ends it
            try:
                yield ctx
            finally:
                ctx.close()

    def _survey_ctx(self, job: str, path: str) -> AbstractContextManager[Context]:
        return self._ctx(job, path, lane="hosts")

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    # ------------------------------------------------------------------ reading

    def hosts(self) -> JobsDoc:
        """`provision jobs --json` over every inventory's hosts (each host once), with its
        labels and what its GPUs do (`gpu_use`, from the same round trip): one look at every
        host (run/survey.py) answers the requests of the next HOSTS_FRESH s."""
        return self._hosts.get("", self._survey)

    def _survey(self) -> JobsDoc:
        r = survey(self._inventories(), self._survey_ctx)
        self._policy = r.policy
        return r.doc.copy()

    def jobs(self) -> JobsDoc:
        return self.hosts()

    def latest(self) -> JobsDoc:
        """The hosts as /metrics reports them (here: as hosts(); the service: its last sample)."""
        return self.hosts()

    def job(self, name: str) -> JobDoc:
        """`provision status --json`, with the env (secrets masked), its study and its actions:
        one probe of its hosts answers the requests of the next JOB_FRESH s (Recent)."""
        return self._jobs.get(name, lambda: self._job(name))

    def _job(self, name: str) -> JobDoc:
        try:
            path, inv = self._find(name)
        except NotFound:
            t = self.trial(name)
            if t is None:
                raise
            return self._trial_job(t)
        with self._ctx(name, path) as ctx:
            st = collect(ctx)
        live = any(t.state.live or t.state is TaskState.PENDING for t in st.tasks)
        actions = (["stop"] if live else []) + (["rerun"] if st.phase.ended else [])
        env, study = masked_env(inv.env, inv.secret_env), name if inv.tune else None
        return {**st.to_json(), "env": env, "study": study, "actions": actions}

    def logs(self, name: str, after: str | None) -> LogsDoc:
        try:
            path, _ = self._find(name)
        except NotFound:
            t = self.trial(name)
            if t is None:
                raise
            return self._trial_logs(t, after)
        cursors = _cursors(after)
        with self._ctx(name, path) as ctx:
            entries, cursors, errors = log_entries(ctx, tail=LOG_TAIL, cursors=cursors)
        return {"lines": [log_line(e) for e in entries], "after": _token(cursors), "errors": errors}

    def tail(self, name: str, lines: int) -> list[LogLine] | None:
        """The job's last `lines` lines of each task, in time order (the service keeps them
        when a run ends); None: no inventory names the job."""
        try:
            path, _ = self._find(name)
        except NotFound:
            return None
        with self._ctx(name, path, lane="keep") as ctx:
            entries, _, errors = log_entries(ctx, tail=lines, cursors={}, limit=KEEP_READ_LIMIT)
        if errors and not entries:
            raise ProvisionError("; ".join(errors))  # said by the keeper; its hosts' lines not kept
        return [log_line(e) for e in entries]

    # ------------------------------------------------------------------ a study's trials (STUDY-tN)

    def trial(self, name: str) -> Trial | None:
        """The trial `name` names (a study's job, a dash, t, its number), as its study has it."""
        m = TRIAL_NAME.match(name)
        found = self._inventories().get(m["study"]) if m else None
        if m is None or found is None or found[1].tune is None:
            return None
        snap = self._snapshot(*found)
        row = next((r for r in snap.rows if r.number == int(m["number"])), None) if snap is not None else None
        if snap is None or row is None:
            return None
        return Trial(found[0], found[1], row, snap.curves.get(row.number, ()))

    def _trial_ctx(self, t: Trial) -> AbstractContextManager[Context]:
        """A Context of the trial's own job (its state beside the study's, as its runner keeps it)."""
        from provision.inventory.trial import trial_inventory  # (start-up: only a trial's page needs it)
        from provision.run.tune import study_dir, study_storage  # (start-up: run/tune imports Optuna)

        inv = trial_inventory(t.study, t.row.number, dict(t.row.params))
        local = study_storage(t.path, t.study)[2]
        state = str(study_dir(t.path, t.study.job) / f"{inv.job}.state.json") if local else None
        return self._ctx(inv.job, t.path, trial=(inv, state))

    def _trial_job(self, t: Trial) -> JobDoc:
        """The trial's page: its tasks while it runs (a probe of its hosts), how it ended after;
        its row of the study, what it reported, the study's env (secrets masked)."""
        if t.row.state.ended:
            base = ended_trial_status(t.row)
        else:
            with self._trial_ctx(t) as ctx:
                base = collect(ctx).to_json()
        env = masked_env(t.study.env, t.study.secret_env)
        reports = [[float(step), value] for step, value in t.curve]
        return {**base, "env": env, "study": t.study.job, "actions": [], "trial": t.row.to_json(), "reports": reports}

    def _trial_logs(self, t: Trial, after: str | None) -> LogsDoc:
        """A trial's lines: those its runner kept (beside the study: trial-N/TASK.log) once it
        ended, else its hosts' (followed as a job's)."""
        from provision.run.studylogs import kept_entries  # (start-up: run/tune imports Optuna)
        from provision.run.tune import study_dir  # (start-up, as above)

        kept = study_dir(t.path, t.study.job) / f"trial-{t.row.number}"
        if t.row.state.ended and kept.is_dir():
            if after == KEPT:
                return {"lines": [], "after": KEPT, "errors": [], "kept": True}
            lines = [log_line(e) for e in kept_entries(kept, (), LOG_TAIL)]
            return {"lines": lines, "after": KEPT, "errors": [], "kept": True}
        with self._trial_ctx(t) as ctx:
            entries, cursors, errors = log_entries(ctx, tail=LOG_TAIL, cursors=_cursors(after))
        return {"lines": [log_line(e) for e in entries], "after": _token(cursors), "errors": errors}

    def studies(self) -> list[str]:
        return sorted(j for j, (_, inv) in self._inventories().items() if inv.tune is not None)

    def study(self, name: str) -> StudyDoc:
        """`provision tune --status --json` (picture: none, the page draws its own), with its space."""
        path, inv = self._find(name, study=True)
        assert inv.tune is not None
        snap = self._snapshot(path, inv)
        got = self._study_docs.get(name)
        if got is not None and got[0] is snap and got[1] == inv.tune:
            return got[2]  # nothing changed since: the same document (the pages cache what they make of it)
        rows, ended = (snap.rows, snap.ended) if snap is not None else ((), None)
        doc: StudyDoc = {**study_json(name, inv.tune, rows, ended=ended, picture=None), "space": space_json(inv.tune)}
        if snap is not None:
            doc["importance"] = self._reader(path, inv).importance(snap)
        self._study_docs[name] = (snap, inv.tune, doc)
        return doc

    def curves(self, name: str) -> StudyCurves:
        """Each trial's reports (its learning curve), as the study's reader last read them."""
        path, inv = self._find(name, study=True)
        snap = self._snapshot(path, inv)
        return StudyCurves(snap.curves if snap is not None else {})

    def _snapshot(self, path: str, inv: Inventory) -> Snapshot | None:
        """The study's trials now (at most studyread.FRESH s old), from its kept reader."""
        return self._reader(path, inv).read()

    def _reader(self, path: str, inv: Inventory) -> StudyReader:
        # Lazy: the reader imports Optuna (about a second of start-up).
        from provision.io.studyread import StudyReader
        from provision.run.tune import study_storage

        assert inv.tune is not None
        url, journal, _ = study_storage(path, inv)
        key = (url, str(journal), inv.job)
        with self.invs.lock:
            reader = self._readers.get(key)
            if reader is None:
                reader = self._readers[key] = StudyReader(inv.tune, inv.job, url, journal)
                known = {j for j, (_, i) in self._inventories().items() if i.tune is not None}
                for gone in [k for k in self._readers if k[2] not in known]:
                    self._readers.pop(gone).close()
            reader.tune = inv.tune
        return reader

    def events(self, after: int, job: str | None = None, kinds: Sequence[Kind] = ()) -> EventsDoc:
        # No stream here (the service keeps it): nothing happened that anyone recorded.
        return {"format_version": EVENTS_FORMAT, "events": [], "after": after}

    def usage(self) -> UsageDoc:
        # No history here (the service keeps it): what the hosts hold now is all there is.
        return {"format_version": 1, "days": [], "weeks": [], "idle": []}

    def history(self, q: HistoryQuery) -> HistoryDoc:
        # No history here (the service keeps it).
        return {"format_version": HISTORY_FORMAT, "rows": [], "total": 0, "as_of": _iso(time.time())}

    def policy(self) -> Policy | None:
        """The team's policy as the last look at the hosts' inventories named it."""
        return self._policy

    def quotas(self) -> QuotasDoc:
        """What each owner holds and waits for on these hosts (the policy their state names)."""
        doc = self.hosts()
        return quotas(doc, self._policy or Policy(), {})

    def incidents(self) -> HealthReportDoc:
        # No health history here (the service keeps it); each GPU's state is on the Cluster page.
        return {"format_version": 1, "now": None, "since": None, "ranked": [], "incidents": []}

    def owner(self, name: str, recent: bool = False) -> str | None:
        """The job's owner as the hosts' ledgers name it; a study's: its trials' owner.
        recent: from the last look at the hosts however old (one asked behind it), never
        waiting for one (a study page waited seconds for a look at every host)."""
        return owner_in(self._hosts.last("", self._survey) if recent else self.hosts(), name)

    # ------------------------------------------------------------------ actions

    def stop(self, name: str, who: str) -> ActionAnswer:
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
        self._hosts.forget("")
        self._jobs.forget(name)
        return {"ok": True, "message": msg, "stopped": stopped}

    def rerun(self, name: str, who: str) -> ActionAnswer:
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
        self._hosts.forget("")
        self._jobs.forget(name)
        return {"ok": not bad, "message": msg}

    def cancel(self, name: str, who: str) -> ActionAnswer:
        return {"ok": False, "message": "cancel is the service's: these inventories have no queue of its own"}

    def promote(self, name: str, trial: int, who: str) -> ActionAnswer:
        """`provision tune --promote N`: the inventory text (shown, not written anywhere)."""
        from provision.inventory.promote import promoted  # (start-up: only a promotion needs it)

        path, inv = self._find(name, study=True)
        assert inv.tune is not None
        snap = self._snapshot(path, inv)
        row = next((r for r in (snap.rows if snap is not None else ()) if r.number == trial), None)
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
        job = promoted_job(inv.job, row.number)
        return {"ok": True, "message": f"trial {row.number} ({value}) as job {job}", "inventory": text}


def log_line(e: Entry) -> LogLine:
    return {"time": _iso(e.ts / 1e6), "task": e.task, "host": e.host, "text": e.text.replace("\x1b", "\\e")}


def owner_in(doc: JobsDoc, name: str) -> str | None:
    """The owner the hosts' document names for job `name`, or for a study's trials."""
    jobs: dict[str, str | None] = {j["job"]: j.get("owner") for j in doc.get("jobs") or []}
    if name in jobs:
        return jobs[name]
    return next((o for j, o in sorted(jobs.items()) if j.startswith(f"{name}-t") and o), None)


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
