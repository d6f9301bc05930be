"""A study read for the dashboard: kept between requests, read again only where it changed
(a page or /metrics read all 10,000 trials of a study through Optuna's ORM, about
17 s and 600 MiB each time).

A StudyReader holds one study's rows. In a database (Optuna's RDB schema) it asks, at most
every `fresh` seconds, only for the trials that can have changed: those added since (a
trial id above the last seen) and those it last saw unfinished (running or waiting). A
finished trial never changes (Optuna refuses to update one), so its row is kept; a count
of the study's trials catches one committed late (two runners asking at once). Those few
trials are read with plain queries (no ORM objects) and made rows by the same function as
`tune --status` (io/study.py's trial_row). A study whose id changed (deleted, made again)
is read anew. A schema these queries do not know falls back to Optuna's own reading, on a
storage kept open (Optuna caches its finished trials too).

A journal file: the study kept open (Optuna's journal storage reads only the records
appended since), its rows made again when the file changed.

`version` changes whenever what is read changed: a cache of what is made from the rows
(the study's JSON, its page) is right while it is the same.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy
from optuna.distributions import BaseDistribution, json_to_distribution
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from provision.core.tuning import Curve, TrialRow, TrialState, Tune
from provision.io.study import ENDED_ATTR, Study, StudyUnavailable, _first_line, load_study, trial_row
from provision.io.studyimportance import importances

_Looked = tuple[tuple[TrialRow, ...], str | None, Mapping[int, Curve]]  # rows, why it ended, curves
IMPORTANCE_EVERY = 30.0  # seconds between two weighings of a study that goes on
FRESH = 1.0  # seconds a read answers before the storage is asked again (a page polls every few)


@dataclass(frozen=True)
class Snapshot:
    rows: tuple[TrialRow, ...]  # by number
    ended: str | None  # why the study ended (None: it can go on), as `tune --status` says
    version: int
    curves: Mapping[int, Curve] = field(default_factory=dict)  # trial number -> its reports (those that reported)


def ended_why(attr: Any, rows: Sequence[TrialRow]) -> str | None:
    """Study.ended's rule over the rows read: the mark counts the trials it ended with, and
    a study with a running trial goes on."""
    if not rows or any(r.state is TrialState.RUNNING for r in rows):
        return None
    why = attr.get("why") if isinstance(attr, dict) and attr.get("trials") == len(rows) else None
    return why if isinstance(why, str) else None


@dataclass
class _Seen:
    """What the database reader knows of the study."""

    study_id: int
    rows: dict[int, TrialRow] = field(default_factory=dict)  # trial id -> row (not every trial is one)
    curves: dict[int, Curve] = field(default_factory=dict)  # trial id -> its reports
    unfinished: set[int] = field(default_factory=set)  # trial ids that can still change
    ids: set[int] = field(default_factory=set)  # every trial id seen
    last: int = -1  # the highest trial id seen


class StudyReader:
    """One study's rows, read again only where they changed. Thread-safe (pages, /metrics and
    the API ask at once; one of them reads, the others wait for its answer)."""

    def __init__(self, tune: Tune, job: str, url: str | None, journal: Path, *, fresh: float | None = None):
        self.tune, self.job, self.url, self.journal = tune, job, url, journal
        self.fresh = FRESH if fresh is None else fresh
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._checked = float("-inf")  # monotonic time of the last look
        self._engine: sqlalchemy.Engine | None = None
        self._seen: _Seen | None = None
        self._study: Study | None = None  # journal (or an unknown schema): kept open
        self._stamp: tuple[int, int, int] | None = None  # the journal's (mtime, size, inode) at the last read
        self._sql = url is not None
        self._dists: dict[str, BaseDistribution] = {}  # distribution_json -> distribution (a few per study)
        self.reads = 0  # trials read from the storage, all told (the tests see what a look cost)
        self._imp: tuple[int, dict[str, float]] | None = None  # (succeeded trials weighed, the importance)
        self._imp_at = float("-inf")
        self._imp_lock = threading.Lock()

    def read(self) -> Snapshot | None:
        """The study now (at most `fresh` seconds old); None: it was never started."""
        with self._lock:
            if time.monotonic() - self._checked < self.fresh:
                return self._snap
            got = self._look()
            self._checked = time.monotonic()
            if got is None:
                self._snap = None
            else:
                rows, ended, curves = got
                old = self._snap
                if old is None or old.rows != rows or old.ended != ended or old.curves != curves:
                    self._snap = Snapshot(rows, ended, (old.version + 1) if old is not None else 1, curves)
            return self._snap

    def importance(self, snap: Snapshot) -> dict[str, float]:
        """The parameters' importance over `snap`'s succeeded trials (io/studyimportance.py),
        weighed again when more have succeeded, at most every IMPORTANCE_EVERY s while the
        study goes on (10,000 trials take ~1 s) and at once when it ended."""
        with self._imp_lock:
            done = sum(1 for r in snap.rows if r.state is TrialState.SUCCEEDED)
            kept = self._imp
            due = snap.ended is not None or time.monotonic() - self._imp_at >= IMPORTANCE_EVERY
            if kept is None or (kept[0] != done and due):
                kept = self._imp = (done, importances(self.tune, snap.rows))
                self._imp_at = time.monotonic()
            return kept[1]

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        self._study = None

    # ------------------------------------------------------------------ where it is read

    def _look(self) -> _Looked | None:
        if self._sql:
            try:
                return self._look_sql()
            except sqlalchemy.exc.SQLAlchemyError as e:
                words = _first_line(e)
                if _no_tables(words):
                    return None  # a database where no study was ever made
                if not isinstance(e, sqlalchemy.exc.ProgrammingError) and "no such column" not in words:
                    raise StudyUnavailable(f"the study's storage stopped answering: {words}") from None
                # Not the schema these queries know (another Optuna's): Optuna reads it.
                self._sql, self._seen = False, None
        return self._look_optuna()

    def _look_optuna(self) -> _Looked | None:
        if self.url is None:
            try:
                st = os.stat(self.journal)
            except FileNotFoundError:
                self._study = None
                return None
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if self._study is not None and stamp == self._stamp and self._snap is not None:
                return self._snap.rows, self._snap.ended, self._snap.curves
            self._stamp = stamp
        if self._study is None:
            self._study = load_study(self.tune, self.job, self.url, self.journal)
            if self._study is None:
                return None
        rows = tuple(self._study.rows())
        self.reads += len(rows)
        running = any(r.state is TrialState.RUNNING for r in rows)
        trials = self._study.study.get_trials(deepcopy=False)
        curves = {
            t.number + 1: curve_of(t) for t in trials if t.intermediate_values and not t.user_attrs.get("surplus")
        }
        return rows, self._study.ended(len(rows)) if rows and not running else None, curves

    # ------------------------------------------------------------------ Optuna's tables, read plainly

    def _connect(self) -> sqlalchemy.Connection:
        if self._engine is None:
            assert self.url is not None
            self._engine = sqlalchemy.create_engine(self.url, pool_pre_ping=True, pool_size=1, max_overflow=1)
        return self._engine.connect()

    def _look_sql(self) -> _Looked | None:
        with self._connect() as c:
            sid = c.execute(Q_STUDY, {"name": self.job}).scalar()
            if sid is None:
                self._seen = None
                return None
            if self._seen is None or self._seen.study_id != sid:
                self._seen = _Seen(int(sid))  # new, or deleted and made again: all of it
            seen = self._seen
            got = self._fetch(c, seen.study_id, seen.last, seen.unfinished)
            if c.execute(Q_COUNT, {"s": seen.study_id}).scalar() != len(seen.ids | {t._trial_id for t in got}):
                # A trial committed after one with a higher id (two runners asking at once) was
                # not there at the last look: the ids tell which.
                every = set(c.execute(Q_IDS, {"s": seen.study_id}).scalars())
                got += self._fetch(
                    c, seen.study_id, max(every, default=0), every - seen.ids - {t._trial_id for t in got}
                )
            ended = c.execute(Q_ENDED, {"s": seen.study_id, "k": ENDED_ATTR}).scalar()
        self.reads += len(got)
        why = json.loads(ended) if ended else None
        if not got and self._snap is not None and seen.rows and self._snap.rows:
            return self._snap.rows, ended_why(why, self._snap.rows), self._snap.curves  # nothing changed
        for t in got:
            row = trial_row(self.job, t)
            if row is None:
                seen.rows.pop(t._trial_id, None)
                seen.curves.pop(t._trial_id, None)
            else:
                seen.rows[t._trial_id] = row
                if t.intermediate_values:
                    seen.curves[t._trial_id] = curve_of(t)
            if t.state in (OptunaState.RUNNING, OptunaState.WAITING):
                seen.unfinished.add(t._trial_id)
            else:
                seen.unfinished.discard(t._trial_id)
            seen.ids.add(t._trial_id)
            seen.last = max(seen.last, t._trial_id)
        rows = tuple(sorted(seen.rows.values(), key=lambda r: r.number))
        curves = {seen.rows[i].number: c for i, c in seen.curves.items() if i in seen.rows}
        return rows, ended_why(why, rows), curves

    def _fetch(self, c: sqlalchemy.Connection, study: int, last: int, ids: set[int]) -> list[FrozenTrial]:
        """The study's trials whose id is above `last` or in `ids`, as Optuna would give them
        (what a row and its curve need: no system attributes)."""
        args = {"s": study, "last": last, "ids": sorted(ids) or [-1]}
        trials = c.execute(Q_TRIALS, args).all()
        if not trials:
            return []
        params: dict[int, list[Any]] = {t.trial_id: [] for t in trials}
        values: dict[int, float] = {}
        attrs: dict[int, dict[str, Any]] = {t.trial_id: {} for t in trials}
        # Each query sees the database as it is then: a trial added meanwhile is left for the next look.
        for p in c.execute(Q_PARAMS, args):
            params.get(p.trial_id, []).append(p)
        for v in c.execute(Q_VALUES, args):
            values[v.trial_id] = _value(v.value, v.value_type)
        for a in c.execute(Q_ATTRS, args):
            attrs.get(a.trial_id, {})[a.key] = json.loads(a.value_json)
        reports: dict[int, dict[int, float]] = {t.trial_id: {} for t in trials}
        for i in c.execute(Q_REPORTS, args):
            reports.get(i.trial_id, {})[int(i.step)] = _value(i.intermediate_value, i.intermediate_value_type)
        return [
            FrozenTrial(
                number=t.number,
                state=OptunaState[t.state],
                value=values.get(t.trial_id),
                datetime_start=_utc(t.datetime_start),
                datetime_complete=_utc(t.datetime_complete),
                params={p.param_name: self._dist(p.distribution_json).to_external_repr(p.param_value) for p in ps},
                distributions={p.param_name: self._dist(p.distribution_json) for p in ps},
                user_attrs=attrs[t.trial_id],
                system_attrs={},
                intermediate_values=reports[t.trial_id],
                trial_id=t.trial_id,
            )
            for t in trials
            for ps in (params[t.trial_id],)
        ]

    def _dist(self, text: str) -> BaseDistribution:
        d = self._dists.get(text)
        if d is None:
            d = self._dists[text] = json_to_distribution(text)
        return d


def curve_of(t: FrozenTrial) -> Curve:
    """The trial's intermediate values (what it reported at each step), by step."""
    return tuple(sorted((int(k), float(v)) for k, v in t.intermediate_values.items()))


def _no_tables(words: str) -> bool:
    """PostgreSQL's and SQLite's words for a table that is not there."""
    return ("relation" in words and "does not exist" in words) or "no such table" in words


def _value(value: float | None, kind: str) -> float:
    """Optuna's stored value (infinities have their own kind)."""
    if kind == "INF_POS":
        return float("inf")
    if kind == "INF_NEG":
        return float("-inf")
    return float(value) if value is not None else float("nan")


def _utc(t: dt.datetime | None) -> dt.datetime | None:
    # Optuna stores naive UTC in a database (models.TrialModel): a row's seconds need only the instant.
    return t.replace(tzinfo=dt.UTC) if t is not None and t.tzinfo is None else t


# The trials that can have changed: above the last id seen, or seen unfinished.
_CHANGED = "t.study_id = :s AND (t.trial_id > :last OR t.trial_id IN :ids)"
_IDS: sqlalchemy.BindParameter[list[int]] = sqlalchemy.bindparam("ids", expanding=True)
Q_STUDY = sqlalchemy.text("SELECT study_id FROM studies WHERE study_name = :name")
Q_TRIALS = (
    sqlalchemy.text(
        f"SELECT t.trial_id, t.number, t.state, t.datetime_start, t.datetime_complete FROM trials t WHERE {_CHANGED}"
    )
    .bindparams(_IDS)
    # SQLite keeps a timestamp as text: SQLAlchemy's type reads it back as a datetime.
    .columns(
        sqlalchemy.column("trial_id", sqlalchemy.Integer),
        sqlalchemy.column("number", sqlalchemy.Integer),
        sqlalchemy.column("state", sqlalchemy.String),
        sqlalchemy.column("datetime_start", sqlalchemy.DateTime),
        sqlalchemy.column("datetime_complete", sqlalchemy.DateTime),
    )
)
Q_PARAMS = sqlalchemy.text(
    "SELECT p.trial_id, p.param_name, p.param_value, p.distribution_json FROM trial_params p "
    f"JOIN trials t ON t.trial_id = p.trial_id WHERE {_CHANGED} ORDER BY p.param_id"
).bindparams(_IDS)
Q_VALUES = sqlalchemy.text(
    "SELECT v.trial_id, v.value, v.value_type FROM trial_values v "
    f"JOIN trials t ON t.trial_id = v.trial_id WHERE v.objective = 0 AND {_CHANGED}"
).bindparams(_IDS)
Q_ATTRS = sqlalchemy.text(
    "SELECT a.trial_id, a.key, a.value_json FROM trial_user_attributes a "
    f"JOIN trials t ON t.trial_id = a.trial_id WHERE {_CHANGED}"
).bindparams(_IDS)
Q_REPORTS = sqlalchemy.text(
    "SELECT i.trial_id, i.step, i.intermediate_value, i.intermediate_value_type FROM trial_intermediate_values i "
    f"JOIN trials t ON t.trial_id = i.trial_id WHERE {_CHANGED}"
).bindparams(_IDS)
Q_COUNT = sqlalchemy.text("SELECT count(*) FROM trials WHERE study_id = :s")
Q_IDS = sqlalchemy.text("SELECT trial_id FROM trials WHERE study_id = :s")
Q_ENDED = sqlalchemy.text("SELECT value_json FROM study_user_attributes WHERE study_id = :s AND key = :k")
