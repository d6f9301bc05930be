"""`provision tune`: the study's loop, as Optuna's `_optimize` and Ray Tune's controller run
theirs. One thread (this loop) asks, tells and decides; each trial's worker
(run/trialrun.py) runs on a thread of its own and posts what happened to a queue.

Trials that a dead runner left are adopted first (and whenever a runner dies). Then, while
fewer than `parallel_trials` run (counted over every runner of the study, each runner
taking its share) and the search has trials left, the next trial is asked and its worker
started; as soon as a trial's job ends (its worker posts it, before its logs are kept and
it is removed) Optuna is told and the next one starts on what it freed. Past
`max_failed_trials` failures no new trial starts and the study ends with why. Ctrl-C leaves
the running trials running: the next `tune` adopts them.

A trial whose job was preempted is paused (its worker posts `Paused`): not told
(Optuna's trial stays running: its reports and a pruner's rungs stay), not counted among
the trials that hold GPUs, and resumed as the same trial by its worker when room returns.
The study ends only when no trial is paused; a paused trial a dead runner left is adopted
paused (the study records the phase).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from provision.core.errors import EXIT_ERROR, EXIT_INTERRUPTED, ProvisionError
from provision.core.model import Inventory
from provision.core.trialend import Ended, Ending
from provision.core.tuning import Algorithm, EarlyStopping, Report, TrialRow, TrialState, Tune, trial_job
from provision.inventory.statebackend import backend_of
from provision.io.hostkeys import KnownHosts
from provision.io.ssh import Session
from provision.io.state import default_state_path
from provision.io.study import (
    PAUSED,
    Runner,
    Study,
    StudyUnavailable,
    TrialInfo,
    journal_path,
    load_study,
    open_study,
    storage_url,
)
from provision.placement.tasks import Slot
from provision.rules.stopping import words as stop_words
from provision.run.trialposts import (
    Freed,
    JobEnded,
    Paused,
    Post,
    Removed,
    Reported,
    SettingUp,
    Started,
    Waiting,
)
from provision.run.trialrun import (
    Handle,
    TrialWork,
    run_trial,
    trace,
)

BEAT_EVERY = 3.0  # seconds between a runner's "still here" on the study and its trials' heartbeats
# Where a trial is, as its row's why says while it runs (`tune --status`): this, then
# "waiting for GPUs: ...", "setting up on HOSTS", "running on HOSTS", "stopping: WHY".
STARTING_WORDS = "starting (placing it and writing its files)"


@dataclass(frozen=True)
class StudyEnd:
    code: int  # the exit code
    why: str  # in words: how the study ended (or why this runner left it)
    unavailable: bool = False  # it left because the study's storage stopped answering (the service retries)


def trial_cap(tune: Tune) -> int:
    """max_trials, or fewer for a grid that has fewer points (each point runs once)."""
    if tune.algorithm is not Algorithm.GRID:
        return tune.max_trials
    return min(tune.max_trials, math.prod(len(p.grid()) for p in tune.params))


@dataclass
class _Mine:
    """This runner's trials and what the loop knows of each."""

    handles: dict[int, Handle] = field(default_factory=dict)  # number -> handle, until its worker is done
    told_steps: dict[int, set[int]] = field(default_factory=dict)
    rungs: dict[int, int] = field(default_factory=dict)  # the rung each reached (hyperband, asha)
    progress: dict[int, tuple[int | None, float | None]] = field(default_factory=dict)  # last (steps, value) seen
    written: dict[int, tuple[int | None, float | None]] = field(default_factory=dict)  # last progress written
    asked: dict[int, TrialRow] = field(default_factory=dict)  # asked, not yet on the hosts: its "started" line
    # Trials told since the last look, with where they ran: the next trials asked go there.
    freed: list[tuple[Handle, Mapping[str, Slot]]] = field(default_factory=list)
    paused: dict[int, str] = field(default_factory=dict)  # preempted trials waiting to resume: why

    def _untold(self) -> list[Handle]:
        """Trials the study counts running: not yet told, nor paused."""
        return [h for n, h in self.handles.items() if not h.told_event.is_set() and not h.told and n not in self.paused]

    def holding(self) -> int:
        """Trials that hold GPUs (untold, and their places not freed)."""
        return sum(not h.freed for h in self._untold())

    def freed_untold(self) -> int:
        """Trials whose places were freed but which the study still counts running."""
        return sum(h.freed for h in self._untold())


class _Leaving(Exception):
    """The loop was asked to leave (StudyLoop.leave): as Ctrl-C, the trials run on."""


class StudyLoop:
    def __init__(
        self,
        work: TrialWork,
        study: Study,
        me: Runner,
        on_row: Callable[[TrialRow], None],
        on_tick: Callable[[list[TrialRow]], None] = lambda rows: None,
        run: Callable[[TrialWork, Handle], None] = run_trial,
        leave: threading.Event | None = None,
    ):
        self.w = work
        self.leave = leave or threading.Event()  # set: leave as Ctrl-C does (the trials run on)
        self.study = study
        self.me = me
        self.on_row = on_row  # a trial started or ended: one line
        self.on_tick = on_tick  # between events: the live view on a terminal, the PNG
        self.run_trial = run  # a trial's worker (tests give a fake one)
        self.posts: queue.Queue[Post] = queue.Queue()
        work.post = self.posts.put
        self.pool = ThreadPoolExecutor(max_workers=work.tune.parallel_trials + 8, thread_name_prefix="trial")
        self.mine = _Mine()
        self.waiting: dict[int, str] = {}  # trial number -> what it waits for (the live line)
        self.beaten = -BEAT_EVERY  # when this runner last said it is here (monotonic)
        self.others = 1  # runners seen on the study, this one included

    # -- the loop

    def run(self) -> StudyEnd:
        try:
            end = self._loop()  # the study's own end (max_trials, or max_failed_trials passed)
            self.study.mark_ended(end.why)
            return end
        except (KeyboardInterrupt, _Leaving):
            self.w.stop.set()
            n = len(self.mine.handles)
            return StudyEnd(
                EXIT_INTERRUPTED,
                f"interrupted: {n} trial{'s' if n != 1 else ''} still run{'s' if n == 1 else ''} on the hosts; "
                f"`provision tune {self.w.where}` again adopts {'them' if n != 1 else 'it'} and goes on",
            )
        except StudyUnavailable as e:
            self.w.stop.set()
            return StudyEnd(
                EXIT_ERROR,
                f"{e.message}; the trials run on: `provision tune {self.w.where}` again once it answers "
                "adopts them and goes on",
                unavailable=True,
            )
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
            if not self.mine.handles:
                try:
                    self.study.announce(self.me, leaving=True)
                except StudyUnavailable:
                    pass  # said above: the storage is gone
                if self.w.session is not None:
                    self.w.session.close()

    def _loop(self) -> StudyEnd:
        tune = self.w.tune
        cap = trial_cap(tune)
        while True:
            if self.leave.is_set():
                raise _Leaving
            self._beat()
            rows = self.study.rows()  # once per look: with PostgreSQL, a query
            self.on_tick(rows)
            failed = sum(r.state is TrialState.FAILED for r in rows)
            stopping = failed > tune.max_failed_trials
            if not stopping and self._start_more(rows, cap):
                continue  # started one: look again (another may fit)
            if not self.mine.handles:
                if stopping:
                    return StudyEnd(
                        EXIT_ERROR,
                        f"the study stopped: {failed} trials failed, more than max_failed_trials ({tune.max_failed_trials})",
                    )
                if not any(r.state is TrialState.RUNNING for r in rows) and self._asked_all(rows, cap):
                    return StudyEnd(0, f"the study ended: {sum(r.state.ended for r in rows)} trials")
            self._wait()

    def _wait(self) -> None:
        """Until a worker posts (then everything posted is handled) or a poll passes."""
        self._hand_off()
        try:
            post = self.posts.get(timeout=self.w.poll)
        except queue.Empty:
            return
        self._handle(post)
        while True:
            try:
                self._handle(self.posts.get_nowait())
            except queue.Empty:
                return

    def _asked_all(self, rows: list[TrialRow], cap: int) -> bool:
        return len(rows) >= cap or self.study.exhausted()

    def _beat(self) -> None:
        """Every few seconds: this runner is here, its trials' heartbeats, the runners on
        the study, and any trial a dead runner left (adopted)."""
        now = time.monotonic()
        if now - self.beaten < BEAT_EVERY:
            return
        self.beaten = now
        self.study.announce(self.me)
        for number, h in self.mine.handles.items():
            if not h.told and not h.told_event.is_set():
                progress = self.mine.progress.get(number)
                if progress is not None and progress != self.mine.written.get(number):
                    self.mine.written[number] = progress
                    self.study.beat(number, steps=progress[0], value=progress[1])
                else:
                    self.study.beat(number)
        self.others = self.study.runners(self.me)
        for info in self.study.abandoned(self.me):
            if info.number not in self.mine.handles:
                self._adopt(info)

    def _share(self) -> int:
        """How many trials this runner runs at once: parallel_trials split among the runners
        on the study (two teammates' tunes each take half)."""
        return max(1, math.ceil(self.w.tune.parallel_trials / self.others))

    def _start_more(self, rows: list[TrialRow], cap: int) -> bool:
        """Ask for one more trial and start it, if there is room. True: one was started."""
        if self.mine.holding() >= self._share() or self._asked_all(rows, cap):
            return False
        if self.study.running_anywhere(self.me) - self.mine.freed_untold() >= self.w.tune.parallel_trials:
            return False
        asked = self.study.ask(cap)
        if asked is None:
            return False
        job = trial_job(self.w.inv.job, asked.number)
        self.study.claim(asked.number, self.me, job, doing=STARTING_WORDS)
        # Said when its job is on the hosts (Started), not while it still waits for room.
        self.mine.asked[asked.number] = TrialRow(
            asked.number, tuple(asked.params.items()), TrialState.RUNNING, job=job, retry_of=asked.retry_of
        )
        # Where a trial just ended (its GPUs and ports free): the new one goes there.
        before, hint = self.mine.freed.pop(0) if self.mine.freed else (None, None)
        self._submit(Handle(asked.number, asked.params, hint=hint, after=before))
        return True

    def _hand_off(self) -> None:
        """Trials told whose place no new trial took (none was started): their wind-up (logs
        kept, removal) need not wait for one."""
        for h, _ in self.mine.freed:
            h.handed_off.set()
        self.mine.freed.clear()

    def _adopt(self, info: TrialInfo) -> None:
        if not info.told:
            paused = f" ({info.doing})" if info.phase == PAUSED else ""
            self.w.say(f"trial {info.number}: its runner ({info.runner}) is gone: adopted{paused}")
            self.study.claim(info.number, self.me, trial_job(self.w.inv.job, info.number))
        if info.phase == PAUSED:  # it waits to resume: no GPU, its place not counted
            self.mine.paused[info.number] = info.doing.removeprefix("paused: ")
            self.waiting[info.number] = info.doing
        self._submit(
            Handle(info.number, info.params, phase=info.phase, told=info.told, recorded=info.recorded, adopt=True)
        )

    def _submit(self, h: Handle) -> None:
        trace(h.number, "submitted" + (f" after {h.after.number}" if h.after is not None else ""))
        self.mine.handles[h.number] = h
        self.pool.submit(self.run_trial, self.w, h)

    # -- what workers post

    def _handle(self, post: Post) -> None:
        h = self.mine.handles.get(post.number)
        if h is None:
            return
        if isinstance(post, Started):
            self._started(post)
        elif isinstance(post, (Waiting, SettingUp)):
            self._where(post)
        elif isinstance(post, Reported):
            self._reported(h, post.reports, final=post.final)
        elif isinstance(post, Paused):
            self._paused(post)
        elif isinstance(post, Freed):
            h.freed = True
            self.mine.freed.append((h, post.slots))  # its place goes to the next trial asked
        elif isinstance(post, JobEnded):
            self._ended(h, post.ended, post.slots)
        elif isinstance(post, Removed):
            del self.mine.handles[post.number]
            self.mine.asked.pop(post.number, None)
            self.mine.paused.pop(post.number, None)
            self.waiting.pop(post.number, None)
            if not post.left:
                self.study.mark_removed(post.number)

    def _started(self, post: Started) -> None:
        """Its job is on the hosts: a new trial's "started" line, or a paused one resumed."""
        h = self.mine.handles.get(post.number)
        if h is not None:
            h.freed = False  # it holds its (new) place again
        on = ", ".join(sorted(set(post.hosts.values())))
        self.study.beat(post.number, phase="running", hosts=post.hosts, doing=f"running on {on}" if on else "running")
        row = self.mine.asked.pop(post.number, None)
        if row is not None:
            self.on_row(row)
        if self.mine.paused.pop(post.number, None) is not None:
            self.waiting.pop(post.number, None)
            self.w.say(f"trial {post.number} resumed on {on or 'its hosts'} (from its checkpoint)")

    def _paused(self, post: Paused) -> None:
        """Its job was preempted: not told (its reports and rungs stay in the study), its
        place not counted while it waits in the queue to resume as the same trial."""
        self.mine.paused[post.number] = post.why
        self.waiting[post.number] = f"paused: {post.why}"
        self.study.beat(post.number, phase=PAUSED, doing=f"paused: {post.why}")
        self.w.say(f"trial {post.number} paused: {post.why}")

    def _where(self, post: Waiting | SettingUp) -> None:
        """Where a trial is before it runs, said once per change and kept on the study (its
        row's why while it runs: `tune --status`). A paused trial's wait is its pause."""
        if post.number in self.mine.paused and isinstance(post, Waiting):
            if post.why is None:
                self.study.beat(post.number, doing="resuming (room returned)")
            return
        if isinstance(post, SettingUp):
            words = f"setting up on {', '.join(post.hosts)}"
            self.waiting[post.number] = words
            self.w.say(f"trial {post.number} is {words} (its tasks start when the setup is done)")
        elif post.why is None:
            self.waiting.pop(post.number, None)
            words = STARTING_WORDS
        else:
            words = f"waiting for GPUs: {post.why}"
            self.waiting[post.number] = words
            self.w.say(f"trial {post.number} waits for room: {post.why}")
        self.study.beat(post.number, doing=words)

    def _reported(self, h: Handle, reports: tuple[Report, ...], *, final: bool = False) -> None:
        """New steps go to the study (its learning curve), and the rule judges the trial at
        each step past the last it was judged at, in order, as if they came one by one (a
        look may bring several): the first that stops it is where it stopped (its words, its
        step and value), and the study keeps none after it, unless the job ended first
        (`final`: its whole curve counts, as a completed trial's, and successive halving
        records the rungs it passed; no answer is taken). The last step and value are
        written with the next heartbeat: each write is an fsync of the journal, and the live
        line can wait a beat."""
        last = reports[-1]
        self.mine.progress[h.number] = (last.step, last.value)
        if h.stop_early is not None and not final:
            return
        # Without early stopping the steps still go to the study (the dashboard's learning
        # curves), one write each, but none is judged.
        judging = self.w.tune.early_stopping is not EarlyStopping.NONE
        told = self._told_steps(h.number)
        before = top = max(told, default=-1)  # a step at or below one judged is kept, not judged again
        for r in reports:
            if r.step in told:
                continue
            told.add(r.step)
            self.study.report(h.number, r.value, r.step)
            if not judging or r.step <= top or (final and not self.w.tune.early_stopping.has_rungs):
                continue
            top = r.step
            if self.study.should_prune(h.number) and not final:
                h.stop_at = r
                h.stop_early = self._median_words(r)
                self.mine.progress[h.number] = (r.step, r.value)
                self.study.beat(h.number, doing=f"stopping: {h.stop_early}")
                break
        if judging and top > before:  # a rung is passed only where a step was judged
            self._rung(h.number)

    def _told_steps(self, number: int) -> set[int]:
        """The steps of the trial the study holds: at this runner's first sight of it, those
        it holds already (an adopted trial's dead runner reported them: not again, and not
        judged again at steps below its last)."""
        told = self.mine.told_steps.get(number)
        if told is None:
            told = self.mine.told_steps[number] = self.study.steps(number)
        return told

    def _rung(self, number: int) -> None:
        """hyperband's and asha's: the rung the trial reached, written when it is a new one
        (`tune --status` shows it). One read per look, not per step."""
        rung = self.study.rung_reached(number)
        if rung is not None and self.mine.rungs.get(number) != rung:
            self.mine.rungs[number] = rung
            self.study.beat(number, rung=rung)

    def _median_words(self, last: Report) -> str:
        """Why the early-stopping rule stopped it, with the numbers that decided (the
        pruner's, asked just before)."""
        call = self.study.stop_call()
        if call is None:
            return f"{self.w.tune.early_stopping} early stopping at step {last.step}"
        return stop_words(call, self.w.tune.metric.name)

    def _ended(self, h: Handle, ended: Ended, slots: Mapping[str, Slot]) -> None:
        """The trial's job ended: told once, whatever posted it. Where it ran goes to the
        next trial asked."""
        if h.told or h.told_event.is_set():
            return
        if slots and not h.freed:
            self.mine.freed.append((h, slots))
        told = self.study.tell(h.number, ended)
        h.told_event.set()  # its worker may remove it now
        if not told:
            self.w.say(f"trial {h.number}: already told by another runner")
            return
        rows = self.study.rows()
        if (
            ended.ending is Ending.LOST
            and sum(r.state is TrialState.FAILED for r in rows) <= self.w.tune.max_failed_trials
        ):
            self.study.retry(h.params, of=h.number)
            self.w.say(f"trial {h.number}: lost; its parameters run again as a new trial")
        row = next((r for r in rows if r.number == h.number), None)
        if row is not None:
            self.on_row(row)
            for line in ended.lines[-10:]:
                self.w.say(f"  trial {h.number} | {line}")


# --------------------------------------------------------------------------- opening


def study_storage(where: str, inv: Inventory) -> tuple[str | None, Path, bool]:
    """The study's database URL (None: a journal file), its journal, and whether the
    state is local."""
    assert inv.tune is not None
    backend = backend_of(inv, where, None)
    base = default_state_path(Path(where), inv.job)
    url = storage_url(inv.tune, None if backend.local else backend.url)
    return url, journal_path(base, inv.job), backend.local


def open_work(
    where: str, inv: Inventory, *, say: Callable[[str], None], poll: float, verbose: bool, seed: int | None = None
) -> tuple[TrialWork, Study]:
    """The study opened (created if new) in its storage, and what each trial's thread needs."""
    assert inv.tune is not None
    url, journal, local = study_storage(where, inv)
    study = open_study(inv.tune, inv.job, url, journal, seed)
    base = default_state_path(Path(where), inv.job)
    work = TrialWork(
        where=where,
        inv=inv,
        tune=inv.tune,
        logs_dir=study_dir(where, inv.job),
        stop=threading.Event(),
        say=say,
        poll=poll,
        verbose=verbose,
        session=Session(KnownHosts(base.parent / "known_hosts"), verbose=verbose),
        local_state=local,
    )
    return work, study


def existing_study(where: str, inv: Inventory) -> Study | None:
    """The study as it is in its storage, creating nothing (None: never started)."""
    if inv.tune is None:
        raise ProvisionError(f"{where}: no tune: section, so no study (see docs/tuning.md)")
    url, journal, _ = study_storage(where, inv)
    return load_study(inv.tune, inv.job, url, journal)


def study_dir(where: str, job: str) -> Path:
    """Beside the state: the journal, the picture and the trials' logs."""
    return journal_path(default_state_path(Path(where), job), job).parent
