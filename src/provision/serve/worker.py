"""One handed-over submission, driven to its end in a process of its own
(`python -m provision.serve.worker`), started by the leading service with the submitter as
owner (PROVISION_OWNER) and the submitter's state backend (PROVISION_STATE).

Why a process and not a thread of the service: who owns a run (tenancy.identity) and the
state backend are read from the process's environment, and two submitters' work must not
share them; a worker that fails cannot take the service down. The worker calls run/ as the
terminal's commands do: a study is run/tune.py's StudyLoop (a restarted one adopts the
trials its dead predecessor left), a queued apply is run/queue.py + run/apply.py.

Signals from the service: SIGUSR1 cancels (a study asks no more trials and stops the running
ones; a queued apply stops waiting), SIGTERM leaves (the trials run on: the next worker
adopts them). The service's death kills the worker (PR_SET_PDEATHSIG): the next leader
starts another.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from provision.core.errors import ProvisionError
from provision.core.lifecycle import JobPhase
from provision.core.model import Inventory
from provision.core.tuning import TrialRow
from provision.io.servicestore import Event, Kind, ServiceStore, Status, Submission
from provision.io.study import Runner
from provision.rules.plan import Plan
from provision.run.apply import apply_plan
from provision.run.context import Context, open_context
from provision.run.jobend import end_job, look, stop_marker
from provision.run.planning import build_plan
from provision.run.preempt import Preemptor
from provision.run.queue import Queue, Stopped, ledger_marks
from provision.run.tune import StudyLoop, open_work
from provision.serve.places import open_place
from provision.serve.snapshot import materialise
from provision.spec.inventory import load

CANCEL = threading.Event()  # set by SIGUSR1 (the service: its owner cancelled it)


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


def run_tune(store: ServiceStore, sub: Submission, where: Path) -> tuple[Status, str]:
    inv = load(where)
    seed = sub.options.get("seed")
    work, study = open_work(
        str(where), inv, say=say, poll=float(sub.options.get("poll", 1.0)), verbose=False, seed=seed
    )
    hosts = tuple(h.name for h in inv.hosts)
    gpus = gpus_of(inv)

    def row(r: TrialRow) -> None:
        say(f"trial {r.number}: {r.state.value}" + (f" ({r.why})" if r.why else ""))
        if r.state.ended:
            ended = store.now()
            store.record(
                Event("trial", r.job, sub.owner, ended - (r.seconds or 0.0), ended, _how(r), hosts, gpus, sub.id)
            )

    loop = _Cancellable(work, study, Runner.here(), on_row=row)
    loop.store, loop.sid = store, sub.id
    end = loop.run()
    say(end.why)
    if loop.cancelled is not None:
        return Status.CANCELLED, loop.cancelled
    if end.code == 130:
        raise KeyboardInterrupt  # left: the next worker adopts its trials
    return (Status.DONE if end.code == 0 else Status.FAILED), end.why


def _how(r: TrialRow) -> str:
    value = f", {r.value:.6g}" if r.value is not None else ""
    return f"{r.state.value}{value}" + (f": {r.why}" if r.why else "")


def run_apply(store: ServiceStore, sub: Submission, where: Path) -> tuple[Status, str]:
    """Queue, apply and watch; a job preempted meanwhile goes back to the queue at its
    priority and resumes by itself when room returns (issue 42): this worker watches the
    job anyway, so it is the one that notices, within WATCH seconds, and nothing else
    has to hand the job back (a new state lock and context for each run)."""
    resuming = False
    while True:
        ctx = open_context(str(where), state_path=sub.state_path or None, operation="apply")
        try:
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
    """Wait for room, apply, then follow the job's run (_watch); None: it was preempted."""
    ctx.take_over = bool(sub.options.get("take_over"))
    ctx.submitted = sub.created or ctx.submitted  # the queue's order: when it was submitted, not claimed
    stop = CANCEL
    hosts = tuple(ctx.targets)
    gpus = gpus_of(ctx.inventory)
    waits: list[int] = []

    def waiting(why: str | None) -> None:
        if why is not None and not waits:
            waits.append(store.record(Event("wait", sub.job, sub.owner, store.now(), None, "", hosts, gpus, sub.id)))
        elif why is None and waits:
            store.closed(waits.pop(), store.now(), "cancelled" if stop.is_set() else "fitted")

    timeout = sub.options.get("timeout")
    q = Queue(timeout, say, ledger_marks(ctx), stop=stop, waiting=waiting)
    # A resume is planned as such (lifecycle: Reason.RESUMED), never as the first --rerun.
    rerun, checks = bool(sub.options.get("rerun")) and not resuming, not sub.options.get("skip_checks")

    pre = Preemptor(ctx, say)  # held by lower-priority work: it leaves

    def plan() -> Plan:
        return q.plan(lambda: pre.planned(lambda: build_plan(ctx, rerun=rerun, checks=checks)))

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


WATCH = float(os.environ.get("PROVISION_SERVE_WATCH", 10))  # seconds between looks at an applied job


def _watch(
    store: ServiceStore, sub: Submission, ctx: Context, hosts: tuple[str, ...], gpus: int
) -> tuple[Status, str] | None:
    """The applied job's run, in the history until it ends (a restarted worker goes on with
    the same row); a cancel stops it as `provision stop` does. None: it was preempted (its
    run's row says by whom)."""
    row = store.open_event(sub.id, "run")
    if row is None:
        row = store.record(Event("run", sub.job, sub.owner, store.now(), None, "", hosts, gpus, sub.id))
    while True:
        try:
            st, _ = look(ctx)
        except ProvisionError as e:  # its hosts do not answer now: look again
            say(f"the job's status: {e.message}")
            CANCEL.wait(WATCH)
            continue
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
        CANCEL.wait(WATCH)


def _leave(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="provision.serve.worker")
    ap.add_argument("--place", required=True)  # "local" or the PostgreSQL URL
    ap.add_argument("--db", default="")  # the embedded file
    ap.add_argument("--id", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGUSR1, lambda signum, frame: CANCEL.set())
    store = open_place(args.place, Path(args.db) if args.db else None)
    sub = store.get(args.id)
    if sub is None or sub.status.finished:
        return 0
    say(f"submission {sub.id}: {sub.kind.value} of job {sub.job} for {sub.owner}")
    try:
        where = prepare(store, sub, Path(args.workdir))
        status, why = (run_tune if sub.kind is Kind.TUNE else run_apply)(store, sub, where)
    except KeyboardInterrupt:
        say("left: the next worker goes on from here")
        return 130
    except ProvisionError as e:
        status, why = Status.FAILED, e.message
    say(f"{status.value}: {why}")
    if sub.kind is Kind.TUNE:
        began = sub.started if sub.started is not None else sub.created
        store.record(Event("study", sub.job, sub.owner, began, store.now(), f"{status.value}: {why}", (), 0, sub.id))
    store.finish(sub.id, status, why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
