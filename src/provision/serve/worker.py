"""One handed-over submission, driven to its end in a process of its own
(`python -m provision.serve.worker`), started by the leading service with the submitter as
owner (PROVISION_OWNER) and the submitter's state backend (PROVISION_STATE).

Why a process and not a thread of the service: who owns a run (tenancy.identity) and the
state backend are read from the process's environment, and two submitters' work must not
share them; a worker that fails cannot take the service down. The worker calls run/ as the
terminal's commands do: a study is run/tune.py's StudyLoop (a restarted one adopts the
trials its dead predecessor left), a queued apply is run/queue.py + run/apply.py.

The study's storage briefly unreachable (StudyUnavailable: its database restarting) fails
nothing: the worker looks again with growing pauses until it answers, then leaves (exit
130), and the service starts a fresh worker at once, which adopts the trials this one left
(a trial's runner is judged by its process: a retry in this process could not adopt them).
A history row the service's database could not take is kept and written later.

Signals from the service: SIGUSR1 cancels (a study asks no more trials and stops the running
ones; a queued apply stops waiting), SIGTERM leaves (the trials run on: the next worker
adopts them). The service's death kills the worker (PR_SET_PDEATHSIG): the next leader
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

from provision.core.errors import ProvisionError
from provision.core.lifecycle import JobPhase
from provision.core.model import Inventory
from provision.core.tuning import TrialRow
from provision.inventory.inventory import load
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import Kind, ServiceStore, Status, Submission
from provision.io.study import Runner, StudyUnavailable
from provision.rules.plan import Plan
from provision.run.apply import apply_plan
from provision.run.context import Context, open_context
from provision.run.jobend import end_job, look, stop_marker
from provision.run.planning import build_plan
from provision.run.preempt import Preemptor
from provision.run.queue import Queue, Stopped, ledger_marks
from provision.run.tune import StudyLoop, existing_study, open_work
from provision.run.victim import finish
from provision.serve.places import open_place
from provision.serve.service import LEFT
from provision.serve.snapshot import materialise

CANCEL = threading.Event()  # set by SIGUSR1 (the service: its owner cancelled it)
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)  # seconds between looks at a storage that does not answer


def say(line: str) -> None:
    """To the worker's log file (the service's work directory): for whoever reads it."""
    sys.stdout.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    sys.stdout.flush()


def gpus_of(inv: Inventory) -> int:
    return sum(p.replicas * p.accelerators for p in inv.pools)


def prepare(store: ServiceStore, sub: Submission, workdir: Path) -> Path:
    """The snapshot in the work directory; with a local state, `.provision` beside the
    inventory is the submitter's (its state, its study, its trials' logs), so that their
    `provision status/tune/logs` see this work as their own."""
    materialise(store, sub.manifest, workdir)
    where = workdir / sub.inventory
    if sub.backend == "local" and sub.state_path:
        link = where.parent / ".provision"
        target = Path(sub.state_path).parent
        target.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and Path(os.readlink(link)) != target:
            link.unlink()
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target, target_is_directory=True)
    return where


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
    seed = sub.options.get("seed")
    try:
        work, study = open_work(
            str(where), inv, say=say, poll=float(sub.options.get("poll", 1.0)), verbose=False, seed=seed
        )
    except StudyUnavailable as e:
        await_storage(lambda: _probe(where, inv), e.message)
        raise KeyboardInterrupt from None  # left: the next worker opens it
    history = _History(store)
    hosts = tuple(h.name for h in inv.hosts)
    gpus = gpus_of(inv)

    def row(r: TrialRow) -> None:
        say(f"trial {r.number}: {r.state.value}" + (f" ({r.why})" if r.why else ""))
        if r.state.ended:
            history.add(
                lambda ended: HistoryRow(
                    "trial", r.job, sub.owner, ended - (r.seconds or 0.0), ended, _how(r), hosts, gpus, sub.id
                )
            )

    loop = _Cancellable(work, study, Runner.here(), on_row=row)
    loop.store, loop.sid = store, sub.id
    end = loop.run()
    say(end.why)
    history.flush()
    if loop.cancelled is not None:
        return Status.CANCELLED, loop.cancelled
    if end.unavailable:
        await_storage(lambda: _probe(where, inv), "the study's storage does not answer")
        raise KeyboardInterrupt  # left: the next worker adopts the trials this one left running
    if end.code == LEFT:
        raise KeyboardInterrupt  # left: the next worker adopts its trials
    return (Status.DONE if end.code == 0 else Status.FAILED), end.why


class _History:
    """History rows for the service's database; one it cannot take now (the database
    restarting) is kept and written with the next, never failing the study."""

    def __init__(self, store: ServiceStore):
        self.store = store
        self.pending: list[tuple[float, Callable[[float], HistoryRow]]] = []

    def add(self, make: Callable[[float], HistoryRow]) -> None:
        self.pending.append((time.time(), make))
        self.flush()

    def flush(self) -> None:
        try:
            now = self.store.now()
            while self.pending:
                at, make = self.pending[0]
                self.store.record(make(now - (time.time() - at)))  # when it ended, on the database's clock
                self.pending.pop(0)
        except ProvisionError as e:
            say(f"the history waits: {e.message}")


def _how(r: TrialRow) -> str:
    value = f", {r.value:.6g}" if r.value is not None else ""
    return f"{r.state.value}{value}" + (f": {r.why}" if r.why else "")


def run_apply(store: ServiceStore, sub: Submission, where: Path) -> tuple[Status, str]:
    """Queue, apply and look once (_watch); a job preempted meanwhile goes back to the queue
    at its priority and resumes by itself when room returns (issue 42): the service's rounds
    see its tasks stop and call a worker back, which finds it Preempted and queues it again
    (a new state lock and context for each run)."""
    resuming = False
    while True:
        ctx = open_context(str(where), state_path=sub.state_path or None, operation="apply")
        try:
            if not resuming and store.open_event(sub.id, "run") is not None:
                ctx.release_lock()  # applied before: the service's rounds called us back
                got = _watch(store, sub, ctx, tuple(ctx.targets), gpus_of(ctx.inventory))
            else:
                got = _queue_and_apply(store, sub, ctx, resuming)
        finally:
            ctx.close()
        if got is not None:
            return got
        say("preempted: back in the queue at its priority; it resumes when room returns")
        resuming = True


def _queue_and_apply(
    store: ServiceStore, sub: Submission, ctx: Context, resuming: bool = False
) -> tuple[Status, str] | None:
    """Wait for room, apply, then look at the job's run once (_watch); None: it was preempted."""
    ctx.take_over = bool(sub.options.get("take_over"))
    ctx.submitted = sub.created or ctx.submitted  # the queue's order: when it was submitted, not claimed
    stop = CANCEL
    hosts = tuple(ctx.targets)
    gpus = gpus_of(ctx.inventory)
    waits: list[int] = []

    def waiting(why: str | None) -> None:
        if why is not None and not waits:
            waits.append(
                store.record(HistoryRow("wait", sub.job, sub.owner, store.now(), None, "", hosts, gpus, sub.id))
            )
        elif why is None and waits:
            store.closed(waits.pop(), store.now(), "cancelled" if stop.is_set() else "fitted")

    timeout = sub.options.get("timeout")
    q = Queue(timeout, say, ledger_marks(ctx), stop=stop, waiting=waiting)
    # A resume is planned as such (lifecycle: Reason.RESUMED), never as the first --rerun.
    rerun, checks = bool(sub.options.get("rerun")) and not resuming, not sub.options.get("skip_checks")

    pre = Preemptor(ctx, say)  # held by lower-priority work: it leaves

    def plan() -> Plan:
        return q.plan(lambda: pre.planned(lambda: build_plan(ctx, rerun=rerun, checks=checks, whole=say)))

    try:
        p = plan()
        if p.problems:
            return Status.FAILED, p.problems[0]
        outcomes = apply_plan(ctx, p, say)
        while any(o.lost_race for o in outcomes.values()) and not q.expired():
            outcomes = apply_plan(ctx, plan(), say)
        errors = [f"{o.name}: {o.error}" for o in outcomes.values() if o.error]
        if errors:
            return Status.FAILED, errors[0]
    except Stopped:
        got = store.get(sub.id)
        return Status.CANCELLED, f"taken back by {got.cancel if got and got.cancel else 'its owner'} while queued"
    finally:
        q.done()  # its queue marks, where the apply's reservation did not replace them
        if waits:
            store.closed(waits.pop(), store.now(), "left")
    ctx.release_lock()  # the job may run for days: its owner may plan meanwhile
    return _watch(store, sub, ctx, hosts, gpus)


def _watch(
    store: ServiceStore, sub: Submission, ctx: Context, hosts: tuple[str, ...], gpus: int
) -> tuple[Status, str] | None:
    """One look at the applied job's run: ended (its history row closed), cancelled (stopped
    as `provision stop` does), preempted (None: its row says by whom), or WATCHING: the
    service's one round per host watches it from here and calls a worker back when the hosts
    say it ended or stopped (serve/watch.py): a process per watched job would cost the
    service ~80 MiB a job."""
    row = store.open_event(sub.id, "run")
    if row is None:
        row = store.record(HistoryRow("run", sub.job, sub.owner, store.now(), None, "", hosts, gpus, sub.id))
    try:
        st, _ = look(ctx)
        if finish(ctx, st.rest, say):  # preempted on some hosts: on all, and its tasks ended (run/victim.py)
            st, _ = look(ctx)
    except ProvisionError as e:  # its hosts do not answer now: the service's rounds look again
        return Status.WATCHING, f"applied; its hosts do not answer now ({e.message})"
    if CANCEL.is_set() and not st.phase.ended:
        got = store.get(sub.id)
        who = got.cancel if got and got.cancel else "its owner"
        end_job(ctx, st, marker=stop_marker(ctx))
        store.closed(row, store.now(), f"stopped by {who}")
        return Status.CANCELLED, f"stopped by {who}"
    if st.phase.ended:
        how = st.phase.value + (f": {st.reason}" if st.reason else "")
        store.closed(row, store.now(), how)
        return Status.DONE, f"applied; the job {how}"
    if st.phase is JobPhase.PREEMPTED and not any(t.state.live for t in st.tasks):
        store.closed(row, store.now(), f"{st.phase.value} {st.reason}")
        return None
    return Status.WATCHING, f"applied; the job is {st.phase.value}: the service watches it"


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
    raise KeyboardInterrupt


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
    signal.signal(signal.SIGUSR1, lambda signum, frame: CANCEL.set())
    store = open_place(args.place, Path(args.db) if args.db else None)
    sub = store.get(args.id)
    if sub is None or sub.status.finished:
        return 0
    say(f"submission {sub.id}: {sub.kind.value} of job {sub.job} for {sub.owner}")
    if sub.cancel:  # asked before this worker started (a watched job's cancel starts one)
        CANCEL.set()
    try:
        where = prepare(store, sub, Path(args.workdir))
        status, why = (run_tune if sub.kind is Kind.TUNE else run_apply)(store, sub, where)
    except KeyboardInterrupt:
        say("left: the next worker goes on from here")
        return LEFT
    except ProvisionError as e:
        status, why = Status.FAILED, e.message
    say(f"{status.value}: {why}")
    try:
        if sub.kind is Kind.TUNE:
            began = sub.started if sub.started is not None else sub.created
            ended = HistoryRow("study", sub.job, sub.owner, began, store.now(), f"{status.value}: {why}", (), 0, sub.id)
            store.record(ended)
        if status is Status.WATCHING:
            store.watching(sub.id, why)
        else:
            store.finish(sub.id, status, why)
    except ProvisionError as e:  # the service's database is away: the next worker ends it again
        say(f"could not record the end ({e.message}): left to the next worker")
        return LEFT
    return 0


if __name__ == "__main__":
    sys.exit(main())
