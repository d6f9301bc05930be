"""A study's record in Optuna's storage: opening it, asking for a trial's parameters,
telling how a trial ended, and reading it back as `TrialRow`s.

Optuna does the search (TPE, random, grid samplers) and the median rule (MedianPruner); its
storage keeps the study: a journal file beside the state by default (one file, appended
to; Optuna's maintainers advise against SQLite under concurrent writers or on network
filesystems), or PostgreSQL for a team (`tune.storage`, else the state's own database),
where several `provision tune` share the work. What provision adds is kept in each
trial's user attributes: who runs it (a runner id and a heartbeat, so that a later `tune`
knows a trial whose runner died), its job name, why it ended, its last step, its retry.

Optuna is imported by `provision tune` only (it is slow to import): this module is.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from provision.core.errors import ProvisionError
from provision.core.tuning import (
    Algorithm,
    EarlyStopping,
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

# Optuna logs every trial at INFO on stderr: provision says what happened itself.
optuna.logging.set_verbosity(logging.WARNING)

STALE = 60.0  # seconds without a heartbeat after which another runner's trial is adopted
MEDIAN_STARTUP = 3  # trials that must end before the median rule stops anyone

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


def open_storage(url: str | None, journal: Path) -> optuna.storages.BaseStorage:
    if url is None:
        journal.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # The open(2)-based lock: the symlink one leaves a link behind when tune is killed.
        return JournalStorage(JournalFileBackend(str(journal), lock_obj=JournalFileOpenLock(str(journal))))
    try:
        return RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
    except Exception as e:  # SQLAlchemy's and the driver's errors alike: say where, not a traceback
        where = url.split("@")[-1]
        raise ProvisionError(f"tune.storage: cannot open the study's database at {where}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def sampler(tune: Tune, seed: int | None = None) -> optuna.samplers.BaseSampler:
    if tune.algorithm is Algorithm.RANDOM:
        return optuna.samplers.RandomSampler(seed=seed)
    if tune.algorithm is Algorithm.GRID:
        return optuna.samplers.GridSampler({p.name: list(p.grid()) for p in tune.params}, seed=seed)
    # constant_liar: parallel trials do not all get the same suggestion while others run.
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def pruner(tune: Tune) -> optuna.pruners.BasePruner:
    if tune.early_stopping is EarlyStopping.MEDIAN:
        return optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP)
    return optuna.pruners.NopPruner()


def open_study(tune: Tune, job: str, storage: optuna.storages.BaseStorage, seed: int | None = None) -> optuna.Study:
    direction: Literal["minimize", "maximize"] = "maximize" if tune.metric.goal is Goal.MAXIMIZE else "minimize"
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=job,
            direction=direction,
            sampler=sampler(tune, seed),
            pruner=pruner(tune),
            load_if_exists=True,
        )
    except Exception as e:
        raise ProvisionError(f"the study {job}: {_first_line(e)}") from None
    if study.direction.name.lower() != direction:
        raise ProvisionError(
            f"the study {job} in its storage was made to {study.direction.name.lower()} "
            f"{tune.metric.name}; tune.metric.goal says {direction}"
        )
    return study


def suggest(trial: optuna.Trial, tune: Tune) -> dict[str, Value]:
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


# --------------------------------------------------------------------------- who runs a trial


@dataclass(frozen=True)
class Runner:
    """This `provision tune` process, as trials name their runner."""

    host: str
    pid: int
    nonce: str

    @classmethod
    def here(cls) -> Runner:
        return cls(socket.gethostname(), os.getpid(), uuid.uuid4().hex[:8])

    @property
    def id(self) -> str:
        return f"{self.host}:{self.pid}:{self.nonce}"


def runner_alive(runner_id: str, heartbeat: float, now: float, me: Runner) -> bool:
    """Whether a trial's runner still runs: itself; a process on this machine whose pid is
    gone is dead at once; any other after STALE seconds without a heartbeat."""
    if runner_id == me.id:
        return True
    host, _, rest = runner_id.partition(":")
    pid = rest.partition(":")[0]
    if host == me.host and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
    return now - heartbeat < STALE


PRESENCE = "runner:"  # study attribute per runner: when it last said it is there (or 0: it left)


def announce(study: optuna.Study, me: Runner, *, leaving: bool = False) -> None:
    """This runner is on the study (every few seconds), so the others leave it its share."""
    study.set_user_attr(PRESENCE + me.id, 0.0 if leaving else time.time())


def runners(study: optuna.Study, me: Runner) -> int:
    """Runners on the study now, this one included."""
    now = time.time()
    others = [
        k[len(PRESENCE) :]
        for k, at in study.user_attrs.items()
        if k.startswith(PRESENCE)
        and k != PRESENCE + me.id
        and isinstance(at, (int, float))
        and at > 0
        and runner_alive(k[len(PRESENCE) :], float(at), now, me)
    ]
    return 1 + len(others)


def claim(study: optuna.Study, trial_id: int, me: Runner, job: str) -> None:
    s = study._storage
    s.set_trial_user_attr(trial_id, "runner", me.id)
    s.set_trial_user_attr(trial_id, "heartbeat", time.time())
    s.set_trial_user_attr(trial_id, "job", job)


def beat(study: optuna.Study, trial_id: int, **attrs: Any) -> None:
    s = study._storage
    s.set_trial_user_attr(trial_id, "heartbeat", time.time())
    for k, v in attrs.items():
        s.set_trial_user_attr(trial_id, k, v)


def orphans(study: optuna.Study, me: Runner) -> list[FrozenTrial]:
    """Running trials whose runner is gone (a killed or interrupted `tune`)."""
    now = time.time()
    out = []
    for t in study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,)):
        ua = t.user_attrs
        if ua.get("surplus"):
            continue
        if not runner_alive(str(ua.get("runner", "")), float(ua.get("heartbeat", 0) or 0), now, me):
            out.append(t)
    return out


def mark_removed(study: optuna.Study, number: int) -> None:
    """The trial is gone from the hosts. A study attribute: a told trial's own attributes
    cannot change any more."""
    study.set_user_attr(f"removed-{number}", True)


def leftovers(study: optuna.Study, me: Runner) -> list[FrozenTrial]:
    """Trials told by a runner that died before removing them from the hosts."""
    now = time.time()
    out = []
    removed = study.user_attrs
    for t in study.get_trials(deepcopy=False, states=(OptunaState.COMPLETE, OptunaState.PRUNED, OptunaState.FAIL)):
        ua = t.user_attrs
        if ua.get("phase") != "ended" or removed.get(f"removed-{t.number + 1}") or ua.get("surplus"):
            continue
        if not runner_alive(str(ua.get("runner", "")), float(ua.get("heartbeat", 0) or 0), now, me):
            out.append(t)
    return out


# --------------------------------------------------------------------------- reading it back


def rows(study: optuna.Study, job: str) -> list[TrialRow]:
    """Every trial of the study (surplus asks of racing runners left out), by number."""
    out = []
    for t in study.get_trials(deepcopy=False):
        if t.state not in _STATES or t.user_attrs.get("surplus"):
            continue
        ua = t.user_attrs
        start = t.datetime_start.timestamp() if t.datetime_start else None
        end = t.datetime_complete.timestamp() if t.datetime_complete else time.time()
        out.append(
            TrialRow(
                number=t.number + 1,
                params=tuple((k, _plain(v)) for k, v in t.params.items()),
                state=_STATES[t.state],
                value=t.value if t.state is OptunaState.COMPLETE else _float(ua.get("value")),
                steps=ua.get("steps"),
                seconds=(end - start) if start is not None else None,
                why=str(ua.get("why", "")),
                job=str(ua.get("job", trial_job(job, t.number + 1))),
                retry_of=ua.get("retry_of"),
            )
        )
    return sorted(out, key=lambda r: r.number)


def _plain(v: Any) -> Value:
    return v if isinstance(v, (str, int, float)) else str(v)


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None


def params_of(t: FrozenTrial) -> Mapping[str, Value]:
    return {k: _plain(v) for k, v in t.params.items()}


def trial_record(study: optuna.Study, number: int) -> tuple[dict[str, Value], dict[str, str]] | None:
    """Trial `number`'s parameters and where its tasks ran (None: no such trial)."""
    for t in study.get_trials(deepcopy=False):
        if t.number + 1 == number and not t.user_attrs.get("surplus"):
            hosts = t.user_attrs.get("hosts")
            return dict(params_of(t)), dict(hosts) if isinstance(hosts, dict) else {}
    return None
