"""The event stream's subscribers: each on a thread of its own, reading the events after its
cursor (io/serviceevents.py) in order, and moving the cursor once it has dealt with them.
A subscriber killed between the two (kill -9 of the service), or a new leader, goes on from
the cursor: every event reaches it at least once, and the event's id lets it drop a repeat.
One that fails (an endpoint down) is given the same events again after a pause that grows;
it never holds up the others or the service's round.

Only the leading service delivers. A new subscriber begins at the stream's end (`from_start`:
at its beginning), so one added to a service that ran for months is not handed months.

Adding a subscriber (docs/architecture.md: "a new event subscriber"): a class with a `name`
(its cursor's), `from_start`, and `handle(events)`, given to `Delivery` in cli/servecmd.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from provision.core.errors import ProvisionError
from provision.core.events import Kind, Stored
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore

BATCH = 200  # events handed at once
RETRY = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)  # seconds before a failed batch is handed again


class Handler(Protocol):
    name: str
    from_start: bool

    def handle(self, events: Sequence[Stored]) -> None:
        """Deal with the events (in order); raise to have them handed again later."""
        ...


class Delivery:
    """One subscriber's thread: the events after its cursor, in batches, while leading."""

    def __init__(
        self,
        store: ServiceStore,
        handler: Handler,
        leading: threading.Event,
        say: Callable[[str], None],
        every: float = 1.0,
        retry: Sequence[float] = RETRY,
    ):
        self.store, self.handler, self.leading, self.say, self.every = store, handler, leading, say, every
        self.retry = tuple(retry) or RETRY  # the pauses after each failure in a row (its last repeated)
        self.stopping = threading.Event()
        self.woken = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"events:{handler.name}", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.woken.set()
        self.thread.join(timeout=30)

    def wake(self) -> None:
        """New events were stored: deliver now, not at the next tick."""
        self.woken.set()

    def run(self) -> None:
        while not self.stopping.is_set():
            pause, failed = self.every, False
            if self.leading.is_set():
                try:
                    while self.once() and not self.stopping.is_set():
                        pass  # a full batch: there may be more
                except Exception as e:  # the handler or the database: the same events again later
                    if self.stopping.is_set():
                        break  # stopped mid-batch: the next leader goes on from the cursor
                    pause, failed = self.retry[min(self.failures, len(self.retry) - 1)], True
                    if not self.failures:
                        why = e.message if isinstance(e, ProvisionError) else f"{type(e).__name__}: {e}"
                        self.say(
                            f"events to {self.handler.name}: not delivered ({why}); trying again, less and less often"
                        )
                    self.failures += 1
                else:
                    if self.failures:
                        self.say(f"events to {self.handler.name}: delivered again")
                    self.failures = 0
            if failed:  # new events do not cut a failing endpoint's pause short
                self.stopping.wait(pause)
            else:
                self.woken.wait(pause)
            self.woken.clear()

    def once(self) -> bool:
        """One batch after the cursor, handled, the cursor moved; whether it was full."""
        name = self.handler.name
        after = self.store.cursor(name)
        if after is None:  # a new subscriber: from the stream's end (or its start)
            after = 0 if self.handler.from_start else self.store.last_event_id()
            self.store.advance(name, after)
        got = self.store.events(after=after, limit=BATCH)
        if not got:
            return False
        self.handler.handle(got)
        self.store.advance(name, got[-1].id)
        return len(got) == BATCH


class HistoryWriter:
    """The history of jobs nobody handed to the service (run from a terminal): a run row at
    each job.started (or resumed), closed at its job.ended, so `provision history` and the
    Usage page's GPU-hours count them too. Handed-over work keeps its own rows (its worker
    writes them). Each row names the event it began with: a repeat writes nothing."""

    name = "history"
    from_start = True

    def __init__(self, store: ServiceStore):
        self.store = store

    def handle(self, events: Sequence[Stored]) -> None:
        for s in events:
            e = s.event
            if e.kind not in (Kind.JOB_STARTED, Kind.JOB_RESUMED, Kind.JOB_ENDED) or not e.job:
                continue
            if self._handed(e.job, s.time):
                continue  # handed over: its worker writes its history
            if e.kind is Kind.JOB_ENDED:
                row = self.store.open_row_of(e.job, "run", "event:")
                if row is not None:
                    self.store.closed(row, s.time, e.words or (e.how.value if e.how else "ended"))
                continue
            mark = f"event:{s.id}"
            if self.store.has_rows(mark):
                continue
            self.store.record(HistoryRow("run", e.job, e.owner, s.time, None, "", e.hosts, e.gpus, mark))

    def _handed(self, job: str, t: float) -> bool:
        """Whether a submission of `job` was being driven at time `t`: unfinished, or one that
        ran then (a job that ended in seconds: its submission finished before this event came)."""
        for sub in self.store.submissions(job=job):
            if not sub.status.finished:
                return True
            if sub.started is not None and sub.started - 1.0 <= t <= (sub.ended or t) + 60.0:
                return True
        return False
