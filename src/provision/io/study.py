"""The study's record in Optuna's storage: the one module that touches Optuna.

Optuna does the search (TPE, random, grid samplers; io/samplers.py keeps a finite space
from repeats) and early stopping (its pruners; io/pruners.py has Vertex's median rule); its
storage keeps the study: a journal file beside the state by default (one file, appended
to; Optuna's maintainers advise against SQLite under concurrent writers or on network
filesystems), or PostgreSQL for a team (`tune.storage`, else the state's own database),
where several `provision tune` share the work. What provision adds is kept in each
trial's user attributes: who runs it (a runner id and a heartbeat on the storage's clock,
so that a later `tune` knows a trial whose runner died), its job name, how far its runner
got (`phase`), why it ended, its last step, its retry.

Trials are numbered here as provision numbers them (from 1, as TF_CONFIG's `task.trial`);
Optuna's own numbers (from 0) and trial ids never leave this module. The study loop
(run/tune.py) is the only caller that writes: one thread, so nothing here locks.

Optuna is imported by `provision tune` and `fetch --trial` only (it is slow to import).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from provision.core.errors import ProvisionError
from provision.core.trialend import Ended, Ending
from provision.core.tuning import (
    Algorithm,
    Goal,
    Param,
    ParamType,
    Scale,
    TrialRow,
    TrialState,
    Tune,
    Value,
    trial_job,
)
from provision.io.pruners import last_call, pruner, reached_rung
from provision.io.samplers import unseen
from provision.io.studyspace import distribution, same_space
from provision.rules.liveness import process_alive
from provision.rules.stopping import Call

# Optuna logs every trial at INFO on stderr: provision says what happened itself.
optuna.logging.set_verbosity(logging.WARNING)

STALE = 60.0  # seconds (storage clock) without a heartbeat after which another runner's trial is adopted
PRESENCE = "runner:"  # study attribute per runner: when it last said it is there (or 0: it left)
ENDED_ATTR = "study-ended"  # the study attribute mark_ended writes
RUNNING, ENDED = "running", "ended"  # how far a trial's runner got (user attribute `phase`)
# Its job was preempted: Optuna's trial stays RUNNING (never told: its reports
# and a pruner's rungs stay), it holds no GPU, and it resumes as the same trial.
PAUSED = "paused"

P = ParamSpec("P")
R = TypeVar("R")


class StudyUnavailable(ProvisionError):
    """The study's storage stopped answering (a database stopped, a journal unreadable)."""


def _storage_errors(f: Callable[P, R]) -> Callable[P, R]:
    """A storage that stops answering is said in one line (StudyUnavailable), not a traceback."""

    @wraps(f)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return f(*args, **kwargs)
        # Optuna turns a database's errors inside its sessions into StorageInternalError;
        # SQLAlchemy's own are known once a database's storage loaded it (never for a journal).
        except _unavailable() as e:
            raise StudyUnavailable(f"the study's storage stopped answering: {_first_line(e)}") from None

    return call


def _unavailable() -> tuple[type[Exception], ...]:
    exc = sys.modules.get("sqlalchemy.exc")
    sa = (exc.SQLAlchemyError,) if exc is not None else ()
    return (optuna.exceptions.StorageInternalError, OSError, *sa)


_STATES = {
    OptunaState.RUNNING: TrialState.RUNNING,
    OptunaState.COMPLETE: TrialState.SUCCEEDED,
    OptunaState.PRUNED: TrialState.STOPPED_EARLY,
    OptunaState.FAIL: TrialState.FAILED,
}


def storage_url(tune: Tune, state_url: str | None) -> str | None:
    """The study's database: `tune.storage`, else the state's database; None: a file."""
    url = tune.storage or state_url
    if url is None:
        return None
    scheme, rest = url.split("://", 1)
    # SQLAlchemy's name for the driver provision already has (psycopg 3).
    return f"postgresql+psycopg://{rest}" if scheme.lower() in ("postgres", "postgresql") else url


def journal_path(state_path: Path, job: str) -> Path:
    return state_path.parent / f"{job}.tune" / "study.journal"


# --------------------------------------------------------------------------- who runs a trial


@dataclass(frozen=True)
class Runner:
    """A `provision tune` process, as trials name their runner."""

    host: str
    pid: int
    nonce: str

    @classmethod
    def here(cls) -> Runner:
        return cls(socket.gethostname(), os.getpid(), uuid.uuid4().hex[:8])

    @classmethod
    def parse(cls, runner_id: str) -> Runner:
        host, _, rest = runner_id.partition(":")
        pid, _, nonce = rest.partition(":")
        return cls(host, int(pid) if pid.isdigit() else 0, nonce)

    @property
    def id(self) -> str:
        return f"{self.host}:{self.pid}:{self.nonce}"


@dataclass(frozen=True)
class Asked:
    """A trial asked of the search: its number and parameters (a retry's are the lost one's)."""

    number: int
    params: dict[str, Value]
    retry_of: int | None = None


@dataclass(frozen=True)
class TrialInfo:
    """A trial another runner left: enough for this runner to go on where it was."""

    number: int
    params: dict[str, Value]
    runner: str
    phase: str  # "" (not started yet), RUNNING, PAUSED or ENDED
    told: bool  # its outcome is in the study: only its removal from the hosts is left
    recorded: Ended | None = None  # phase ENDED: the outcome its runner recorded
    doing: str = ""  # where it was, in words (a paused one: why)


class _Grid(optuna.samplers.GridSampler):
    """The grid sampler without its Study.stop() at the last point: that is meant for
    optimize() and raises outside it. The loop asks `exhausted()` instead."""

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: OptunaState, values: Sequence[float] | None
    ) -> None:
        return None


def _sampler(tune: Tune, seed: int | None) -> optuna.samplers.BaseSampler:
    if tune.algorithm is Algorithm.GRID:
        return _Grid({p.name: list(p.grid()) for p in tune.params}, seed=seed)
    base: optuna.samplers.BaseSampler
    if tune.algorithm is Algorithm.RANDOM:
        base = optuna.samplers.RandomSampler(seed=seed)
    else:
        # constant_liar: parallel trials do not all get the same suggestion while others run.
        base = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    # A finite space: no point twice while unseen ones remain (io/samplers.py).
    return unseen(base, tune.params, {p.name: distribution(p) for p in tune.params}, seed)


def _pruner(tune: Tune) -> optuna.pruners.BasePruner:
    return pruner(tune.early_stopping)


def _direction(tune: Tune) -> Literal["minimize", "maximize"]:
    return "maximize" if tune.metric.goal is Goal.MAXIMIZE else "minimize"


def _first_line(e: BaseException) -> str:
    """The words of the error that started it (SQLAlchemy wraps the driver's: "connection
    refused" is the cause of "an exception is raised during the commit")."""
    while True:
        inner = e.__cause__ or e.__context__
        if inner is None or isinstance(inner, AssertionError):
            break
        e = inner
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass
class Study:
    """One study in its storage. Open it with `open_study` (creates it) or `load_study`
    (read-only commands: creates nothing)."""

    tune: Tune
    job: str
    study: optuna.Study
    offset: float = 0.0  # the storage's clock minus this machine's
    _ids: dict[int, int] = field(default_factory=dict)  # provision number -> Optuna trial id

    # -- the storage's clock

    def now(self) -> float:
        return time.time() + self.offset

    # -- asking

    @_storage_errors
    def exhausted(self) -> bool:
        """A grid whose every point has run or runs (the sampler says so)."""
        sampler = self.study.sampler
        return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(self.study)

    @_storage_errors
    def ask(self, cap: int) -> Asked | None:
        """The next trial, or None when another runner asked the last one first."""
        trial = self.study.ask()
        number = trial.number + 1
        self._ids[number] = trial._trial_id
        if number > cap:
            # Not a trial: marked so that nobody counts or shows it.
            self.study._storage.set_trial_user_attr(trial._trial_id, "surplus", True)
            self.study.tell(trial, state=OptunaState.FAIL)
            return None
        retry_of = trial.user_attrs.get("retry_of")
        return Asked(number, _suggest(trial, self.tune), retry_of if isinstance(retry_of, int) else None)

    @_storage_errors
    def retry(self, params: Mapping[str, Value], of: int) -> None:
        """A lost trial's parameters run again as the next trial asked."""
        self.study.enqueue_trial(dict(params), user_attrs={"retry_of": of}, skip_if_exists=False)

    # -- one trial's bookkeeping

    def _id(self, number: int) -> int:
        if number not in self._ids:
            for t in self.study.get_trials(deepcopy=False):
                self._ids[t.number + 1] = t._trial_id
        return self._ids[number]

    @contextlib.contextmanager
    def _unless_told(self, number: int) -> Iterator[None]:
        """A write to the trial that Optuna refuses because it is finished (its
        UpdateFinishedTrialError, a RuntimeError) is dropped: another runner told it first,
        and theirs stands (tell says so)."""
        try:
            yield
        except RuntimeError:
            if self.is_running(number):
                raise

    def _set(self, number: int, attrs: Mapping[str, Any]) -> None:
        tid = self._id(number)
        with self._unless_told(number):
            for k, v in attrs.items():
                self.study._storage.set_trial_user_attr(tid, k, v)

    @_storage_errors
    def claim(self, number: int, me: Runner, job: str, **attrs: Any) -> None:
        self._set(number, {"runner": me.id, "heartbeat": self.now(), "job": job, **attrs})

    @_storage_errors
    def beat(self, number: int, **attrs: Any) -> None:
        """The trial's runner is alive (and what it learnt: phase, hosts, steps, value)."""
        self._set(number, {"heartbeat": self.now(), **attrs})

    @_storage_errors
    def report(self, number: int, value: float, step: int) -> None:
        if step < 0:
            return  # not a step Optuna's pruners know (a host's file says what it likes)
        with self._unless_told(number):
            self.study._storage.set_trial_intermediate_value(self._id(number), step, value)

    @_storage_errors
    def steps(self, number: int) -> set[int]:
        """The steps the study holds reports at (an adopted trial's, from its dead runner)."""
        return set(self.study._storage.get_trial(self._id(number)).intermediate_values)

    @_storage_errors
    def should_prune(self, number: int) -> bool:
        trial = self.study._storage.get_trial(self._id(number))
        return self.study.pruner.prune(self.study, trial)

    def stop_call(self) -> Call | None:
        """The numbers of the pruner's last decision (`should_prune` just before, on this
        thread): what a stopped trial's `why` says."""
        return last_call(self.study.pruner)

    @_storage_errors
    def rung_reached(self, number: int) -> int | None:
        """The highest rung the trial reached (hyperband, asha: the pruner records each in
        the trial's system attributes); None: none yet, or a rule without rungs (no query)."""
        if not self.tune.early_stopping.has_rungs:
            return None
        return reached_rung(self.study._storage.get_trial(self._id(number)).system_attrs)

    @_storage_errors
    def is_running(self, number: int) -> bool:
        return self.study._storage.get_trial(self._id(number)).state is OptunaState.RUNNING

    @_storage_errors
    def tell(self, number: int, ended: Ended) -> bool:
        """Record how the trial ended and tell the search. False: another runner (a racing
        adopter) told it first; theirs stands."""
        # Only what is there: each attribute is one write (with a journal, an fsync).
        said: dict[str, Any] = {"why": ended.why, "value": ended.value, "steps": ended.steps}
        self.beat(
            number,
            phase=ENDED,
            ending=ended.ending.value,
            **{k: v for k, v in said.items() if v not in (None, "")},
            **({"lines": list(ended.lines)[-20:]} if ended.lines else {}),
        )
        if not self.is_running(number):
            return False
        try:
            if ended.ending is Ending.SUCCEEDED:
                self.study.tell(number - 1, ended.value)
            elif ended.ending is Ending.STOPPED_EARLY:
                self.study.tell(number - 1, state=OptunaState.PRUNED)
            else:
                self.study.tell(number - 1, state=OptunaState.FAIL)
        except (RuntimeError, ValueError):
            if self.is_running(number):
                raise
            return False
        return True

    @_storage_errors
    def mark_removed(self, number: int) -> None:
        """The trial is gone from the hosts. A study attribute: a told trial's own
        attributes cannot change any more."""
        self.study.set_user_attr(f"removed-{number}", True)

    @_storage_errors
    def removed(self) -> set[int]:
        """The trials gone from the hosts: their logs were kept before (`logs STUDY`)."""
        return {int(k[8:]) for k, v in self.study.user_attrs.items() if k[8:].isdigit() and k[:8] == "removed-" and v}

    @_storage_errors
    def mark_ended(self, why: str) -> None:
        """The study ended (`why`, in words): a study attribute, with how many trials it had,
        so that `--status` says it until a resumed study (max_trials raised) runs more."""
        n = sum(1 for t in self.study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus"))
        self.study.set_user_attr(ENDED_ATTR, {"why": why, "trials": n})

    @_storage_errors
    def ended(self, trials: int) -> str | None:
        """Why the study ended, when it did with `trials` trials (the rows seen now); None
        while it can go on."""
        got = self.study.user_attrs.get(ENDED_ATTR)
        why = got.get("why") if isinstance(got, dict) and got.get("trials") == trials else None
        return why if isinstance(why, str) else None

    # -- runners

    def _alive(self, runner_id: str, beat_at: float | None, me: Runner, now: float) -> bool:
        if runner_id == me.id:
            return True
        r = Runner.parse(runner_id)
        return process_alive(r.host, r.pid, beat_at, now, STALE)

    @_storage_errors
    def announce(self, me: Runner, *, leaving: bool = False) -> None:
        """This runner is on the study (every few seconds), so the others leave it its share."""
        self.study.set_user_attr(PRESENCE + me.id, 0.0 if leaving else self.now())

    @_storage_errors
    def runners(self, me: Runner) -> int:
        """Runners on the study now, this one included."""
        now = self.now()
        others = [
            k
            for k, at in self.study.user_attrs.items()
            if k.startswith(PRESENCE)
            and k != PRESENCE + me.id
            and isinstance(at, (int, float))
            and at > 0
            and self._alive(k[len(PRESENCE) :], float(at), me, now)
        ]
        return 1 + len(others)

    @_storage_errors
    def running_anywhere(self, me: Runner) -> int:
        """Trials that hold GPUs now, over every live runner (a paused one holds none)."""
        now = self.now()
        return sum(
            1
            for t in self.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,))
            if not t.user_attrs.get("surplus")
            and t.user_attrs.get("phase") != PAUSED
            and self._alive(*_runner_of(t), me, now)
        )

    @_storage_errors
    def abandoned(self, me: Runner) -> list[TrialInfo]:
        """Trials whose runner is gone: running ones (a killed or interrupted `tune`), and
        told ones it did not remove from the hosts."""
        now = self.now()
        removed = self.study.user_attrs
        out = []
        for t in self.study.get_trials(deepcopy=False):
            ua = t.user_attrs
            if ua.get("surplus") or t.state not in _STATES:
                continue
            told = t.state is not OptunaState.RUNNING
            if told and (ua.get("phase") != ENDED or removed.get(f"removed-{t.number + 1}")):
                continue
            if self._alive(*_runner_of(t), me, now):
                continue
            self._ids[t.number + 1] = t._trial_id
            out.append(
                TrialInfo(
                    number=t.number + 1,
                    params=dict(_params(t)),
                    runner=str(ua.get("runner", "unknown")),
                    phase=str(ua.get("phase", "")),
                    told=told,
                    recorded=_recorded(ua) if ua.get("phase") == ENDED else None,
                    doing=str(ua.get("doing", "")),
                )
            )
        return out

    # -- reading it back

    @_storage_errors
    def rows(self) -> list[TrialRow]:
        """Every trial of the study (surplus asks of racing runners left out), by number."""
        rows = (trial_row(self.job, t) for t in self.study.get_trials(deepcopy=False))
        return sorted((r for r in rows if r is not None), key=lambda r: r.number)

    @_storage_errors
    def record_of(self, number: int) -> tuple[dict[str, Value], dict[str, str]] | None:
        """Trial `number`'s parameters and where its tasks ran (None: no such trial)."""
        for t in self.study.get_trials(deepcopy=False):
            if t.number + 1 == number and not t.user_attrs.get("surplus"):
                hosts = t.user_attrs.get("hosts")
                return dict(_params(t)), dict(hosts) if isinstance(hosts, dict) else {}
        return None


def trial_row(job: str, t: FrozenTrial) -> TrialRow | None:
    """A trial as provision shows it (None: a surplus ask of a racing runner, or one not
    begun). Study.rows and the dashboard's reader (io/studyread.py) both read trials so."""
    if t.state not in _STATES or t.user_attrs.get("surplus"):
        return None
    ua = t.user_attrs
    start = t.datetime_start.timestamp() if t.datetime_start else None
    end = t.datetime_complete.timestamp() if t.datetime_complete else time.time()
    return TrialRow(
        number=t.number + 1,
        params=tuple((k, _plain(v)) for k, v in t.params.items()),
        state=_STATES[t.state],
        value=t.value if t.state is OptunaState.COMPLETE else _float(ua.get("value")),
        steps=ua.get("steps"),
        seconds=(end - start) if start is not None else None,
        # A running trial's: where it is (waiting for GPUs, setting up, running, stopping).
        why=str(ua.get("why") or (ua.get("doing", "") if t.state is OptunaState.RUNNING else "")),
        job=str(ua.get("job", trial_job(job, t.number + 1))),
        retry_of=ua.get("retry_of"),
        rung=ua["rung"] if isinstance(ua.get("rung"), int) else None,
        hosts=tuple(sorted({str(h) for h in ua["hosts"].values()})) if isinstance(ua.get("hosts"), dict) else (),
    )


def _runner_of(t: FrozenTrial) -> tuple[str, float | None]:
    beat = t.user_attrs.get("heartbeat")
    return str(t.user_attrs.get("runner", "")), float(beat) if isinstance(beat, (int, float)) else None


def _recorded(attrs: Mapping[str, object]) -> Ended:
    value, steps = attrs.get("value"), attrs.get("steps")
    try:
        ending = Ending(str(attrs.get("ending")))
    except ValueError:
        ending = Ending.FAILED
    return Ended(
        ending,
        str(attrs.get("why", "")),
        float(value) if isinstance(value, (int, float)) else None,
        steps if isinstance(steps, int) else None,
    )


# --------------------------------------------------------------------------- opening


def _storage(url: str | None, journal: Path, *, create: bool) -> optuna.storages.BaseStorage | None:
    if url is None:
        if not create and not journal.exists():
            return None
        if create:
            journal.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            # The open(2)-based lock: the symlink one leaves a link behind when tune is killed.
            return JournalStorage(JournalFileBackend(str(journal), lock_obj=JournalFileOpenLock(str(journal))))
        except OSError as e:
            raise ProvisionError(f"{journal}: the study's journal cannot be opened: {e.strerror}") from None
        except Exception as e:  # Optuna asserts on a record it does not know: say which file, not a traceback
            why = "a record this Optuna does not know" if isinstance(e, AssertionError) else _first_line(e)
            raise ProvisionError(
                f"{journal}: the study's journal cannot be read ({why}): written by another version of Optuna, "
                "or damaged; move it away to start the study anew"
            ) from None
    import sqlalchemy  # here: its import time (a quarter of a second, start-up) for a database only
    from optuna.storages import RDBStorage  # (start-up, as above)

    try:
        return RDBStorage(url, engine_kwargs={"pool_pre_ping": True}, skip_table_creation=not create)
    except Exception as e:  # SQLAlchemy's and the driver's errors alike: say where, not a traceback
        if not create and any(w in _first_line(e) for w in ("does not exist", "no such table")):
            return None  # a team's database where no study was ever made: no tables, no study
        where = url.split("@")[-1]
        # A server that does not answer (StudyUnavailable) may answer later: the service retries.
        error = StudyUnavailable if isinstance(e, sqlalchemy.exc.OperationalError) else ProvisionError
        raise error(f"tune.storage: cannot open the study's database at {where}: {_first_line(e)}") from None


def _offset(storage: optuna.storages.BaseStorage) -> float:
    """The database's clock against this machine's (0 for a journal file: written here)."""
    engine = getattr(storage, "engine", None)  # RDBStorage's (SQLAlchemy loaded with it)
    try:
        with engine.connect() as c:  # type: ignore[union-attr]  # None: the except's 0
            db_now = c.execute(sys.modules["sqlalchemy"].text("SELECT EXTRACT(EPOCH FROM CURRENT_TIMESTAMP)")).scalar()
    except Exception:  # a journal file, another database, or none answering: this machine's clock it is
        return 0.0
    return float(db_now) - time.time() if db_now is not None else 0.0


def open_study(tune: Tune, job: str, url: str | None, journal: Path, seed: int | None = None) -> Study:
    """The study, created in its storage if it is not there yet (`provision tune`)."""
    storage = _storage(url, journal, create=True)
    assert storage is not None
    direction = _direction(tune)
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=job,
            direction=direction,
            sampler=_sampler(tune, seed),
            pruner=_pruner(tune),
            load_if_exists=True,
        )
    except Exception as e:
        raise ProvisionError(f"the study {job}: {_first_line(e)}") from None
    _same_direction(study, job, tune)
    same_space(study, job, tune)
    return Study(tune, job, study, _offset(storage))


def memory_study(tune: Tune, job: str, seed: int | None = None) -> Study:
    """A study kept in this process only (Optuna's in-memory storage): the loop's tests."""
    study = optuna.create_study(
        storage=optuna.storages.InMemoryStorage(),
        study_name=job,
        direction=_direction(tune),
        sampler=_sampler(tune, seed),
        pruner=_pruner(tune),
    )
    return Study(tune, job, study)


def load_study(tune: Tune, job: str, url: str | None, journal: Path) -> Study | None:
    """The study as it is, or None when it was never started; creates nothing (`tune
    --status`, `--promote`, `fetch --trial`)."""
    storage = _storage(url, journal, create=False)
    if storage is None:
        return None
    try:
        study = optuna.load_study(storage=storage, study_name=job, sampler=_sampler(tune, None), pruner=_pruner(tune))
    except KeyError:
        return None  # no such study in this storage
    except Exception as e:
        if url is not None and "does not exist" in str(e):
            return None  # a database where no study was ever made (no tables)
        raise ProvisionError(f"the study {job}: {_first_line(e)}") from None
    return Study(tune, job, study)


def _same_direction(study: optuna.Study, job: str, tune: Tune) -> None:
    if study.direction.name.lower() != _direction(tune):
        raise ProvisionError(
            f"the study {job} in its storage was made to {study.direction.name.lower()} "
            f"{tune.metric.name}; tune.metric.goal says {_direction(tune)}"
        )


# --------------------------------------------------------------------------- parameters


def _suggest(trial: optuna.Trial, tune: Tune) -> dict[str, Value]:
    """The trial's parameters, in `tune.params` order; a conditional one only when its
    parent took one of its values (define-by-run: Optuna learns each space apart)."""
    out: dict[str, Value] = {}
    for p in tune.params:
        if p.parent is not None and out.get(p.parent) not in p.parent_values:
            continue
        out[p.name] = _suggest_one(trial, p)
    return out


def _suggest_one(trial: optuna.Trial, p: Param) -> Value:
    assert p.type is ParamType.CATEGORICAL or p.type is ParamType.DISCRETE or p.min is not None
    log = p.scale is Scale.LOG
    if p.type is ParamType.DOUBLE:
        return trial.suggest_float(p.name, float(p.min or 0), float(p.max or 0), log=log)
    if p.type is ParamType.INTEGER:
        return trial.suggest_int(p.name, int(p.min or 0), int(p.max or 0), log=log)
    return _plain(trial.suggest_categorical(p.name, list(p.values)))


def _plain(v: Any) -> Value:
    return v if isinstance(v, (str, int, float)) else str(v)


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None


def _params(t: FrozenTrial) -> Mapping[str, Value]:
    return {k: _plain(v) for k, v in t.params.items()}
