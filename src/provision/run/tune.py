"""`provision tune`: the study's loop. Trials that a dead runner left running are adopted
first; then, while fewer than `parallel_trials` run (counted over every runner of the
study) and fewer than `max_trials` were asked, the next trial is asked of Optuna and run on
its own thread (run/trialrun.py); when one ends, Optuna is told and the next one starts on
what it freed. Past `max_failed_trials` failures no new trial starts and the study ends
with why. Ctrl-C leaves the running trials running: the next `tune` adopts them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from optuna.trial import TrialState as OptunaState

from provision.core.errors import EXIT_ERROR, EXIT_INTERRUPTED
from provision.core.model import Inventory
from provision.core.tuning import Algorithm, TrialRow, TrialState, Tune, Value
from provision.io.hostkeys import KnownHosts
from provision.io.ssh import Session
from provision.io.state import default_state_path
from provision.run import study as st
from provision.run.trialrun import Ended, Ending, TrialWork, run_trial, trace
from provision.spec.statebackend import backend_of

ANNOUNCE_EVERY = 3.0  # seconds between a runner's "still here" on the study


@dataclass(frozen=True)
class StudyEnd:
    code: int  # the exit code
    why: str  # in words: how the study ended (or why this runner left it)


def trial_cap(tune: Tune) -> int:
    """max_trials, or fewer for a grid that has fewer points (each point runs once)."""
    if tune.algorithm is not Algorithm.GRID:
        return tune.max_trials
    return min(tune.max_trials, math.prod(len(p.grid()) for p in tune.params))


class StudyLoop:
    def __init__(
        self,
        work: TrialWork,
        me: st.Runner,
        on_row: Callable[[TrialRow], None],
        on_tick: Callable[[list[TrialRow]], None] = lambda rows: None,
    ):
        self.w = work
        self.me = me
        self.on_row = on_row  # a trial started or ended: one line
        self.on_tick = on_tick  # between events: the live view on a terminal, the PNG
        self.pool = ThreadPoolExecutor(max_workers=work.tune.parallel_trials + 8, thread_name_prefix="trial")
        self.mine: dict[Future[Ended], tuple[int, int, dict[str, Value]]] = {}  # -> (trial id, number, params)
        self.lock = threading.Lock()
        self.told: set[int] = set()  # trials told (their threads may still be removing them)
        self.wake = threading.Event()  # a trial ended: look again now, not at the next poll
        work.on_ended = self._ended
        self.announced, self.others = -ANNOUNCE_EVERY, 1  # when this runner last said it is here; runners seen

    # -- the loop

    def run(self) -> StudyEnd:
        try:
            self._adopt()
            return self._loop()
        except KeyboardInterrupt:
            self.w.stop.set()
            n = len(self.mine)
            return StudyEnd(
                EXIT_INTERRUPTED,
                f"interrupted: {n} trial{'s' if n != 1 else ''} still run{'s' if n == 1 else ''} on the hosts; "
                f"`provision tune {self.w.where}` again adopts {'them' if n != 1 else 'it'} and goes on",
            )
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            if not self.mine:
                st.announce(self.w.study, self.me, leaving=True)
            if self.w.session is not None and not self.mine:
                self.w.session.close()

    def _loop(self) -> StudyEnd:
        tune, study = self.w.tune, self.w.study
        cap = trial_cap(tune)
        while True:
            rows = st.rows(study, self.w.inv.job)  # once per look: with PostgreSQL, a query
            self.on_tick(rows)
            failed = sum(r.state is TrialState.FAILED for r in rows)
            stopping = failed > tune.max_failed_trials
            if not stopping:
                self._start_more(rows, cap)
            if not self.mine:  # nothing was started above: `rows` is still the study
                if stopping:
                    return StudyEnd(
                        EXIT_ERROR,
                        f"the study stopped: {failed} trials failed, more than max_failed_trials ({tune.max_failed_trials})",
                    )
                if sum(r.state.ended for r in rows) >= cap:
                    return StudyEnd(0, f"the study ended: {cap} trials")
                if any(r.state is TrialState.RUNNING for r in rows):
                    # Another runner's trials: wait for them (or for their runner to die).
                    time.sleep(self.w.poll)
                    self._adopt()
                    continue
            self.wake.wait(timeout=self.w.poll)
            self.wake.clear()
            for f in [f for f in self.mine if f.done()]:
                self._finish(f)

    def _running_anywhere(self) -> int:
        now = time.time()
        n = 0
        for t in self.w.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,)):
            ua = t.user_attrs
            if not ua.get("surplus") and st.runner_alive(
                str(ua.get("runner", "")), float(ua.get("heartbeat", 0) or 0), now, self.me
            ):
                n += 1
        return n

    def _share(self) -> int:
        """How many trials this runner runs at once: parallel_trials split among the runners
        on the study (two teammates' tunes each take half), said again every few seconds."""
        now = time.monotonic()
        if now - self.announced >= ANNOUNCE_EVERY:
            st.announce(self.w.study, self.me)
            self.announced = now
            self.others = st.runners(self.w.study, self.me)
        return max(1, math.ceil(self.w.tune.parallel_trials / self.others))

    def _start_more(self, rows: list[TrialRow], cap: int) -> None:
        tune, study = self.w.tune, self.w.study
        while self._busy() < self._share() and self._running_anywhere() < tune.parallel_trials:
            if len(rows) >= cap:
                return
            trial = study.ask()
            if trial.number >= cap:
                # Another runner asked the last one first: this ask is not a trial.
                study._storage.set_trial_user_attr(trial._trial_id, "surplus", True)
                study.tell(trial, state=OptunaState.FAIL)
                return
            params = st.suggest(trial, tune)
            retry_of = trial.user_attrs.get("retry_of")
            self._submit(trial._trial_id, trial.number + 1, params, adopt=False, retry_of=retry_of)
            rows = st.rows(study, self.w.inv.job)

    def _adopt(self) -> None:
        for t in st.leftovers(self.w.study, self.me):
            self.told.add(t.number + 1)
            self._submit(t._trial_id, t.number + 1, dict(st.params_of(t)), adopt=True, retry_of=None)
        for t in st.orphans(self.w.study, self.me):
            self.w.say(f"trial {t.number + 1}: its runner ({t.user_attrs.get('runner', 'unknown')}) is gone: adopted")
            self._submit(
                t._trial_id, t.number + 1, dict(st.params_of(t)), adopt=True, retry_of=t.user_attrs.get("retry_of")
            )

    def _submit(self, trial_id: int, number: int, params: dict[str, Value], *, adopt: bool, retry_of: object) -> None:
        job = f"{self.w.inv.job}-t{number}"
        if number not in self.told:  # a told trial's attributes are final: only its removal is left
            st.claim(self.w.study, trial_id, self.me, job)
        if not adopt:
            self.on_row(
                TrialRow(
                    number,
                    tuple(params.items()),
                    TrialState.RUNNING,
                    job=job,
                    retry_of=retry_of if isinstance(retry_of, int) else None,
                )
            )
        trace(number, "submitted")
        f = self.pool.submit(run_trial, self.w, trial_id, number, params, adopt=adopt)
        self.mine[f] = (trial_id, number, params)

    def _finish(self, f: Future[Ended]) -> None:
        trial_id, number, params = self.mine.pop(f)
        try:
            ended = f.result()
        except Exception as e:  # a bug, not the user's: the trial fails with it, the study goes on
            ended = Ended(Ending.FAILED, f"provision: {type(e).__name__}: {e}")
        if ended.ending is Ending.LEFT_RUNNING:
            return
        self._ended(trial_id, number, params, ended)

    def _ended(self, trial_id: int, number: int, params: dict[str, Value], ended: Ended) -> None:
        """Told once, from the trial's thread as soon as its job ended or from its future."""
        with self.lock:
            if number in self.told:
                return
            self.told.add(number)
            if self.w.study._storage.get_trial(trial_id).state is not OptunaState.RUNNING:
                return  # a dead runner's trial, told before it was removed: only removed now
            self._tell(trial_id, number, params, ended)
        self.wake.set()

    def _busy(self) -> int:
        """This runner's trials that hold GPUs (not yet told)."""
        return sum(1 for _, n, _ in self.mine.values() if n not in self.told)

    def _tell(self, trial_id: int, number: int, params: dict[str, Value], ended: Ended) -> None:
        study, s = self.w.study, self.w.study._storage
        s.set_trial_user_attr(trial_id, "why", ended.why)
        if ended.steps is not None:
            s.set_trial_user_attr(trial_id, "steps", ended.steps)
        if ended.value is not None:
            s.set_trial_user_attr(trial_id, "value", ended.value)
        if ended.lines:
            s.set_trial_user_attr(trial_id, "lines", list(ended.lines)[-20:])
        try:
            if ended.ending is Ending.SUCCEEDED:
                study.tell(number - 1, ended.value)
            elif ended.ending is Ending.STOPPED_EARLY:
                study.tell(number - 1, state=OptunaState.PRUNED)
            else:
                study.tell(number - 1, state=OptunaState.FAIL)
        except (RuntimeError, ValueError) as e:
            # The grid sampler stops the study when its last point is told (Study.stop, meant
            # for optimize(); the trial is told all the same). Else another runner adopted
            # and told it first (a race of two adopters): theirs stands.
            if study._storage.get_trial(trial_id).state is OptunaState.RUNNING:
                raise
            if "Study.stop" not in str(e):
                self.w.say(f"trial {number}: already told by another runner")
                return
        if ended.ending is Ending.LOST and self._failures() <= self.w.tune.max_failed_trials:
            study.enqueue_trial(params, user_attrs={"retry_of": number}, skip_if_exists=False)
            self.w.say(f"trial {number}: lost; its parameters run again as a new trial")
        row = next((r for r in st.rows(study, self.w.inv.job) if r.number == number), None)
        if row is not None:
            self.on_row(row)
            for line in ended.lines[-10:]:
                self.w.say(f"  trial {number} | {line}")

    def _failures(self) -> int:
        return sum(r.state is TrialState.FAILED for r in st.rows(self.w.study, self.w.inv.job))


def open_work(
    where: str, inv: Inventory, *, say: Callable[[str], None], poll: float, verbose: bool, seed: int | None = None
) -> TrialWork:
    """The study opened in its storage (a journal beside the state, or a database), and
    what each trial's thread needs."""
    assert inv.tune is not None
    backend = backend_of(inv, where, None)
    base = default_state_path(Path(where), inv.job)
    url = st.storage_url(inv.tune, None if backend.local else backend.url)
    study = st.open_study(inv.tune, inv.job, st.open_storage(url, st.journal_path(base, inv.job)), seed)
    return TrialWork(
        where=where,
        inv=inv,
        tune=inv.tune,
        study=study,
        logs_dir=study_dir(where, inv.job),
        stop=threading.Event(),
        say=say,
        poll=poll,
        verbose=verbose,
        session=Session(KnownHosts(base.parent / "known_hosts"), verbose=verbose),
        local_state=backend.local,
    )


def study_dir(where: str, job: str) -> Path:
    """Beside the state: the journal, the picture and the trials' logs."""
    return st.journal_path(default_state_path(Path(where), job), job).parent
