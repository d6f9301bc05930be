"""One handed-over submission, driven to its end in a process of its own
(`python -m provision.serve.worker`), started by the leading service with the submitter as
owner (PROVISION_OWNER) and the submitter's state backend (PROVISION_STATE).

Why a process and not a thread of the service: who owns a run (tenancy.identity) and the
state backend are read from the process's environment, and two submitters' work must not
share them; a worker that fails cannot take the service down. The worker calls run/ as the
terminal's commands do: a study is run/tune.py's StudyLoop (a restarted one adopts the
trials its dead predecessor left), a queued apply is run/queue.py + run/apply.py.

A queued apply that finds no room within ROOM_WAIT seconds goes back to the database as a
QUEUED row and its worker ends: waiting work costs a row, not a process; the service admits
it again when a round says it may fit (rules/admission.py).

The study's storage briefly unreachable (StudyUnavailable: its database restarting) fails
nothing: the worker looks again with growing pauses until it answers, then leaves (exit
130), and the service starts a fresh worker at once, which adopts the trials this one left
(a trial's runner is judged by its process: a retry in this process could not adopt them).
A history row the service's database could not take is kept and written later.

Signals from the service: SIGUSR1 cancels (a study asks no more trials and stops the running
ones; a queued apply stops waiting), SIGTERM leaves (the trials run on: the next worker
adopts them). Leaving is an outcome like the others (`Left`), not an exception raised from
a signal handler. The service's death kills the worker (PR_SET_PDEATHSIG): the next leader
starts another.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from provision.core.errors import EXIT_TIMEOUT, ProvisionError
from provision.core.events import Event, How, best_key
from provision.core.events import Kind as EventKind
from provision.core.lifecycle import JobPhase
from provision.core.model import Inventory
from provision.core.submission import Kind, Status
from provision.core.tuning import TrialRow, TrialState, new_best
from provision.inventory.inventory import load
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore, Submission
from provision.io.study import Runner, Study, StudyUnavailable
from provision.rules.events import of_status
from provision.rules.plan import Plan
from provision.rules.recovery import awaits
from provision.run.apply import apply_plan
from provision.run.context import Context, open_context
from provision.run.jobend import end_job, look, stop_marker
from provision.run.planning import build_plan
from provision.run.preempt import Preemptor
from provision.run.queue import Queue, Stopped, ledger_marks
from provision.run.tune import StudyLoop, existing_study, open_work
from provision.run.victim import preempt_whole
from provision.serve.ends import LEFT, SERVICE_ENV, record_end
from provision.serve.places import open_place
from provision.serve.snapshot import prepare

CANCEL = threading.Event()  # set by SIGUSR1 (the service: its owner cancelled it)
LEAVE = threading.Event()  # set by SIGTERM (the service stops or lost the lead): the work goes on with another
STOP_WAITING = threading.Event()  # set by either: a queued apply stops waiting at once
ROOM_WAIT = 20.0  # seconds a queued apply's worker waits for room before it goes back to a row
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)  # seconds between looks at a storage that does not answer


class Left(Exception):
    """The worker leaves its work to the next one (asked to, or its storage does not answer):
    exit LEFT, the submission unchanged."""


def say(line: str) -> None:
    """To the worker's log file (the service's work directory): for whoever reads it."""
    sys.stdout.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    sys.stdout.flush()


def gpus_of(inv: Inventory) -> int:
    return sum(p.replicas * p.accelerators for p in inv.pools)


class _Cancellable(StudyLoop):
    """The study's loop, which a cancel ends: no more trials asked, the running ones stopped
    (their worker ends their job, as early stopping does)."""

    cancelled: str | None = None
    store: ServiceStore | None = None
    sid: str = ""

    def _start_more(self, rows: list[TrialRow], cap: int) -> bool:
        if CANCEL.is_set() and self.cancelled is None:
            got = self.store.get(self.sid) if self.store is not None else None
            self.cancelled = f"cancelled by {got.cancel if got and got.cancel else 'its owner'}"
            self.w.say(self.cancelled)
        if self.cancelled is not None:
            for h in self.mine.handles.values():
                if h.stop_early is None:
                    h.stop_early = self.cancelled
            return False
        return super()._start_more(rows, cap)

    def _asked_all(self, rows: list[TrialRow], cap: int) -> bool:
        return self.cancelled is not None or super()._asked_all(rows, cap)


def await_storage(probe: Callable[[], object], why: str, wait: Callable[[float], bool] = CANCEL.wait) -> float:
    """Until probe() stops raising StudyUnavailable, looked at after BACKOFF's growing
    pauses (its last one repeated); the seconds waited. A cancel ends the wait (the next
    worker acts on it). Said in two lines: when it stopped answering, and when it answers."""
    say(f"{why}; looking again in {BACKOFF[0]:g} s, then less and less often (every {BACKOFF[-1]:g} s at most)")
    waited = 0.0
    for n in itertools.count():
        delay = BACKOFF[min(n, len(BACKOFF) - 1)]
        if wait(delay):
            say("cancelled while the study's storage did not answer: the next worker stops it")
            break
        waited += delay
        try:
            probe()
        except StudyUnavailable:
            continue
        say(f"the study's storage answers again (after {waited:g} s): a fresh worker adopts the trials")
        break
    return waited


def _probe(where: Path, inv: Inventory) -> None:
    study = existing_study(str(where), inv)
    if study is not None:
        study.rows()


def run_tune(store: ServiceStore, sub: Submission, where: Path) -> tuple[Status, str]:
    inv = load(where)
    try:
        work, study = open_work(str(where), inv, say=say, poll=sub.options.poll, verbose=False, seed=sub.options.seed)
    except StudyUnavailable as e:
        await_storage(lambda: _probe(where, inv), e.message)
        raise Left from None  # the next worker opens it
    history = _History(store)
    gpus = gpus_of(inv)

    def row(r: TrialRow) -> None:
        say(f"trial {r.number}: {r.state.value}" + (f" ({r.why})" if r.why else ""))
        if r.state.ended:
            history.add(
                lambda ended: HistoryRow(
                    "trial", r.job, sub.owner, ended - (r.seconds or 0.0), ended, _how(r), r.hosts, gpus, sub.id
                )
            )
            history.tell(trial_ended(r, sub.owner, gpus))
            if (best := _new_best(study, r, inv, sub.owner)) is not None:
                history.tell(best)

    loop = _Cancellable(work, study, Runner.here(), on_row=row, leave=LEAVE)
    loop.store, loop.sid = store, sub.id
    end = loop.run()
    say(end.why)
    history.flush()
    if loop.cancelled is not None:
        return Status.CANCELLED, loop.cancelled
    if end.unavailable:
        await_storage(lambda: _probe(where, inv), "the study's storage does not answer")
        raise Left  # the next worker adopts the trials this one left running
    if end.code == LEFT:
        raise Left  # the next worker adopts its trials
    return (Status.DONE if end.code == 0 else Status.FAILED), end.why


class _History:
    """History rows and events for the service's database; what it cannot take now (the
    database restarting) is kept and written with the next, never failing the study."""

    def __init__(self, store: ServiceStore):
        self.store = store
        self.pending: list[tuple[float, Callable[[float], HistoryRow]]] = []
        self.events: list[Event] = []

    def add(self, make: Callable[[float], HistoryRow]) -> None:
        self.pending.append((time.time(), make))
        self.flush()

    def tell(self, event: Event) -> None:
        self.events.append(event)
        self.flush()

    def flush(self) -> None:
        try:
            now = self.store.now()
            while self.pending:
                at, make = self.pending[0]
                self.store.record(make(now - (time.time() - at)))  # when it ended, on the database's clock
                self.pending.pop(0)
            if self.events:
                self.store.emit(self.events)  # by key: one told twice is stored once
                self.events.clear()
        except ProvisionError as e:
            say(f"the history waits: {e.message}")


def trial_ended(r: TrialRow, owner: str, gpus: int) -> Event:
    """A trial's end as the event stream keeps it (once per trial, by its job's name)."""
    how = {TrialState.SUCCEEDED: How.SUCCEEDED, TrialState.STOPPED_EARLY: How.STOPPED}.get(r.state, How.FAILED)
    hosts = r.hosts
    return Event(
        EventKind.TRIAL_ENDED, f"trial:{r.job}", r.job, owner, hosts[0] if hosts else "", f"trial {r.number} {_how(r)}",
        how, hosts=hosts, gpus=gpus,
    )  # fmt: skip


def _new_best(study: Study, r: TrialRow, inv: Inventory, owner: str) -> Event | None:
    """A study's new best (its trial beat every one before it), as the stream keeps it:
    once per trial number; None when it is not (or the storage cannot say now)."""
    if inv.tune is None or r.state is not TrialState.SUCCEEDED or r.value is None:
        return None
    try:
        rows = study.rows()
    except StudyUnavailable:  # the loop says so and leaves; its successor tells the next best
        return None
    if not new_best(rows, r, inv.tune.metric):
        return None
    words = f"study {inv.job}: trial {r.number} is the best so far ({inv.tune.metric.name} {r.value:.6g})"
    host = r.hosts[0] if r.hosts else ""
    return Event(EventKind.STUDY_BEST, best_key(inv.job, r.number), inv.job, owner, host, words, hosts=r.hosts)


def _how(r: TrialRow) -> str:
    value = f", {r.value:.6g}" if r.value is not None else ""
    return f"{r.state.value}{value}" + (f": {r.why}" if r.why else "")


def run_apply(store: ServiceStore, sub: Submission, where: Path) -> tuple[Status, str]:
    """Queue, apply and look once (_watch); a job preempted meanwhile goes back to the queue
    at its priority and resumes by itself when room returns: the service's rounds see its
    tasks stop and call a worker back, which finds it Preempted and queues it again (a new
    state lock and context for each run). No room within ROOM_WAIT s: QUEUED (a row)."""
    resuming = False
    while True:
        ctx = open_context(
            str(where), state_path=sub.state_path or None, operation="apply",
            take_over=sub.options.take_over, submitted=sub.created or None,
        )  # fmt: skip
        try:
            if not resuming and store.open_event(sub.id, "run") is not None:
                ctx.release_lock()  # applied before: the service's rounds called us back
                got = _watch(store, sub, ctx, _hosts(ctx), gpus_of(ctx.inventory))
            else:
                got = _queue_and_apply(store, sub, ctx, resuming)
        finally:
            ctx.close()
        if got is not None:
            return got
        say("preempted: back in the queue at its priority; it resumes when room returns")
        resuming = True


def _hosts(ctx: Context) -> tuple[str, ...]:
    """The hosts the job's tasks run on (its placement's), not every host its inventory lists."""
    return tuple(sorted({t.host.name for t in ctx.rendered.placement.tasks}))


def _queue_and_apply(
    store: ServiceStore, sub: Submission, ctx: Context, resuming: bool = False
) -> tuple[Status, str] | None:
    """Wait for room (at most ROOM_WAIT s here, and the submission's --timeout in all), apply,
    then look at the job's run once (_watch); None: it was preempted."""
    hosts, gpus = _hosts(ctx), gpus_of(ctx.inventory)
    wait = _Wait(store, sub, hosts, gpus)
    timeout = sub.options.timeout
    left = None if timeout is None else max(0.0, timeout - (store.now() - sub.created))
    q = Queue(
        ROOM_WAIT if left is None else min(ROOM_WAIT, left),
        say,
        ledger_marks(ctx),
        stop=STOP_WAITING,
        waiting=wait.said,
    )
    # A resume is planned as such (lifecycle: Reason.RESUMED), never as the first --rerun.
    rerun, checks = sub.options.rerun and not resuming, not sub.options.skip_checks
    pre = Preemptor(ctx, say)  # held by lower-priority work: it leaves

    def plan() -> Plan:
        return q.plan(lambda: pre.planned(lambda: build_plan(ctx, rerun=rerun, checks=checks, whole=say)))

    try:
        p = plan()
        wait.close("fitted")
        if p.problems:
            return Status.FAILED, p.problems[0]
        outcomes = apply_plan(ctx, p, say)
        while any(o.lost_race for o in outcomes.values()) and not q.expired():
            outcomes = apply_plan(ctx, plan(), say)
        errors = [f"{o.name}: {o.error}" for o in outcomes.values() if o.error]
        if errors:
            return Status.FAILED, errors[0]
    except Stopped:
        if LEAVE.is_set():
            raise Left from None  # its wait row stays open: the next worker goes on with it
        wait.close("cancelled")
        got = store.get(sub.id)
        return Status.CANCELLED, f"taken back by {got.cancel if got and got.cancel else 'its owner'} while queued"
    except ProvisionError as e:
        if e.exit_code == EXIT_TIMEOUT and (left is None or left > ROOM_WAIT):
            return Status.QUEUED, _no_room(e.message)  # no room for now: a row until a round admits it
        wait.close("gave up" if e.exit_code == EXIT_TIMEOUT else "failed")
        raise
    finally:
        q.done()  # its queue marks, where the apply's reservation did not replace them
    ctx.release_lock()  # the job may run for days: its owner may plan meanwhile
    return _watch(store, sub, ctx, hosts, gpus, resuming)


class _Wait:
    """The submission's queue wait in the history: one row from its first wait (a worker
    before this one may have begun it) until it fits, is cancelled or gives up."""

    def __init__(self, store: ServiceStore, sub: Submission, hosts: tuple[str, ...], gpus: int):
        self.store, self.sub, self.hosts, self.gpus = store, sub, hosts, gpus
        self.row: int | None = store.open_event(sub.id, "wait")

    def said(self, why: str | None) -> None:
        if why is not None and self.row is None:
            s = self.sub
            self.row = self.store.record(
                HistoryRow("wait", s.job, s.owner, self.store.now(), None, "", self.hosts, self.gpus, s.id)
            )

    def close(self, how: str) -> None:
        if self.row is not None:
            self.store.closed(self.row, self.store.now(), how)
            self.row = None


def _no_room(message: str) -> str:
    """A queued apply's why while it waits as a row: what it waits for."""
    _, _, why = message.partition(": ")
    return f"queued: {why or message}"


def _watch(
    store: ServiceStore, sub: Submission, ctx: Context, hosts: tuple[str, ...], gpus: int, resumed: bool = False
) -> tuple[Status, str] | None:
    """One look at the applied job's run: ended (its history row closed), cancelled (stopped
    as `provision stop` does), preempted (None: its row says by whom), or WATCHING: the
    service's one round per host watches it from here and calls a worker back when the hosts
    say it ended or stopped (rules/watch.py): a process per watched job would cost the
    service ~80 MiB a job."""
    row = store.open_event(sub.id, "run")
    started = row is None
    if row is None:
        row = store.record(HistoryRow("run", sub.job, sub.owner, store.now(), None, "", hosts, gpus, sub.id))
    try:
        st, _ = look(ctx)
        if preempt_whole(ctx, st.rest, say):  # preempted on some hosts: on all, and its tasks ended (run/victim.py)
            st, _ = look(ctx)
    except ProvisionError as e:  # its hosts do not answer now: the service's rounds look again
        return Status.WATCHING, f"applied; its hosts do not answer now ({e.message})"
    store.emit(of_status(st, sub.owner, gpus, started, resumed))  # its start and end, as the rounds would say them
    if CANCEL.is_set() and not st.phase.ended:
        got = store.get(sub.id)
        who = got.cancel if got and got.cancel else "its owner"
        end_job(ctx, st, marker=stop_marker(ctx))
        store.closed(row, store.now(), f"stopped by {who}")
        return Status.CANCELLED, f"stopped by {who}"
    if awaits(ctx.inventory, st, ctx.state.recovery):  # the service's recoveries act on it (serve/recovery.py)
        return Status.WATCHING, f"applied; the job broke ({st.broke or st.reason}): the service recovers it"
    if st.phase.ended:
        how = st.phase.value + (f": {st.reason}" if st.reason else "")
        store.closed(row, store.now(), how)
        return Status.DONE, f"applied; the job {how}"
    if st.phase is JobPhase.PREEMPTED and not any(t.state.live for t in st.tasks):
        store.closed(row, store.now(), f"{st.phase.value} {st.reason}")
        return None
    return Status.WATCHING, f"applied; the job is {st.phase.value}: the service watches it"


CLAIM_EVERY = 5.0  # seconds between two looks at whose the work is


def _watch_claim(store: ServiceStore, sid: str, service: str) -> None:
    """Leave when another service has claimed the work (this one's leader froze, and a
    follower took over and started a worker of its own): one worker per submission."""
    if not service:
        return

    def watch() -> None:
        while not LEAVE.wait(CLAIM_EVERY):
            try:
                got = store.get(sid)
            except ProvisionError:
                continue  # the database away: its own outage, said elsewhere
            if got is not None and got.claimed_by and got.claimed_by != service and not got.status.finished:
                say(f"the service {got.claimed_by} has taken this work over: leaving it to its worker")
                _leave(signal.SIGTERM, None)
                return

    threading.Thread(target=watch, name="claim", daemon=True).start()


def _handed(args: argparse.Namespace) -> bool:
    """A spare's submission: one JSON line from the service, read once this process's imports
    are done; from then on it is the worker any other is (its owner, its backend, its log)."""
    line = sys.stdin.readline()
    if not line:
        return False
    job = json.loads(line)
    os.environ.update(job["env"])
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    args.id, args.workdir = job["id"], job["workdir"]
    return True


def _leave(signum: int, frame: FrameType | None) -> None:
    LEAVE.set()
    STOP_WAITING.set()


def _cancel(signum: int, frame: FrameType | None) -> None:
    CANCEL.set()
    STOP_WAITING.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="provision.serve.worker")
    ap.add_argument("--place", required=True)  # "local" or the PostgreSQL URL
    ap.add_argument("--db", default="")  # the embedded file
    ap.add_argument("--id", default="")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--warm", action="store_true")  # a spare: its submission comes on stdin
    args = ap.parse_args(argv)
    if args.warm and not _handed(args):
        return 0  # the service left (or dropped its spare) before handing it anything
    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGUSR1, _cancel)
    store = open_place(args.place, Path(args.db) if args.db else None)
    sub = store.get(args.id)
    if sub is None or sub.status.finished:
        return 0
    say(f"submission {sub.id}: {sub.kind.value} of job {sub.job} for {sub.owner}")
    _watch_claim(store, sub.id, os.environ.get(SERVICE_ENV, ""))
    if sub.cancel:  # asked before this worker started (a watched job's cancel starts one)
        _cancel(signal.SIGUSR1, None)
    try:
        where = prepare(store, sub, Path(args.workdir))
        status, why = (run_tune if sub.kind is Kind.TUNE else run_apply)(store, sub, where)
    except Left:
        say("left: the next worker goes on from here")
        return LEFT
    except ProvisionError as e:
        status, why = Status.FAILED, e.message
    say(f"{status.value}: {why}")
    try:
        record_end(store, sub, status, why)
    except ProvisionError as e:  # the service's database is away: the next worker ends it again
        say(f"could not record the end ({e.message}): left to the next worker")
        return LEFT
    return 0


if __name__ == "__main__":
    sys.exit(main())
