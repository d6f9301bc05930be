"""`apply --queue`: wait until the job fits on shared hosts, then apply (like a batch queue).

Waiting is re-planning: every POLL seconds the hosts are probed again (one round trip each),
and as soon as placement finds room (another job ended or was destroyed) the plan goes
ahead. Only "does not fit because other jobs hold it" is waited for; any other error ends
the wait at once.

A queued apply is visible: the job's ledger entry on each host says it waits, since when
and for what (`provision jobs` shows it), rewritten only when what it waits for changes,
and taken away when the wait ends, however it ends (once it fits: by the apply's
reservation, or done() after the apply: work behind it never sees a gap between the
two). Progress says the same, once per change (the holders' ages are not a change).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from provision.core.errors import EXIT_TIMEOUT, ProvisionError
from provision.core.target import Target
from provision.core.text import duration
from provision.host.protocol import QueueReport, QueueRequest
from provision.io.ssh import call_agent
from provision.io.steps import Step, run_step
from provision.placement.tasks import PlacementError
from provision.rules.queueorder import need_on
from provision.run.context import Context

T = TypeVar("T")
POLL = float(os.environ.get("PROVISION_QUEUE_POLL", 5))  # seconds between looks


_AGE = re.compile(r"\b\d+[smhd]\b")  # "running 2h": an age, not a change of reason


class Stopped(Exception):
    """The wait was called off (`stop` was set: a study's Ctrl-C)."""


class Queue:
    def __init__(
        self,
        timeout: float | None,
        progress: Callable[[str], None],
        mark: Callable[[str | None], None] = lambda waiting: None,
        *,
        poll: float | None = None,
        stop: threading.Event | None = None,
        waiting: Callable[[str | None], None] = lambda why: None,
    ):
        self.start = time.monotonic()
        self.deadline = self.start + timeout if timeout else None
        self.progress = progress
        self.mark = mark  # the hosts' ledger marks: what the apply waits for, or None
        self.poll = POLL if poll is None else poll
        self.stop = stop or threading.Event()  # set: the wait ends at once (Stopped)
        self.waiting = waiting  # what it waits for now, in one line (None: no longer)
        self.marked = False  # plan() fitted after waiting: its marks stay until done()

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def plan(self, make: Callable[[], T]) -> T:
        """make()'s plan once it fits. The hosts' marks stay on success until done(): the
        apply's reservation replaces them, so no apply behind this one in the queue takes
        the GPUs in between (rules/queueorder)."""
        said = None
        ok = False
        try:
            while True:
                try:
                    plan = make()
                    ok = True
                    return plan
                except PlacementError as e:
                    if not e.held:
                        raise
                    waited = duration(int(time.monotonic() - self.start))
                    if self.expired():
                        raise ProvisionError(
                            f"--queue: gave up after {waited}: {e.waiting}",
                            details=list(e.details),
                            exit_code=EXIT_TIMEOUT,
                        ) from None
                    now = _AGE.sub("", "; ".join((e.waiting, *e.details)))
                    if now != said:
                        self.progress(f"queued ({waited} so far): {e.waiting}")
                        for line in e.details:
                            self.progress(f"  waiting for {line}")
                        self.mark("; ".join((e.waiting, *e.details)))
                        self.waiting(e.waiting)
                        said = now
                    left = self.poll if self.deadline is None else self.deadline - time.monotonic()
                    if self.stop.wait(max(0.0, min(self.poll, left))):
                        raise Stopped() from None
        finally:
            if said is not None:
                self.waiting(None)
                if ok:
                    self.marked = True
                else:
                    self.mark(None)

    def done(self) -> None:
        """The apply after plan() is over (however it ended): take the marks it left away
        (where it reserved, its reservation has replaced them already)."""
        if self.marked:
            self.marked = False
            self.mark(None)


def ledger_marks(ctx: Context) -> Callable[[str | None], None]:
    """Queue's `mark` for ctx's job: the hosts' ledger entries say what the apply waits
    for (best effort: a host that does not answer only misses the mark)."""

    def mark(waiting: str | None) -> None:
        turn, inv = ctx.turn, ctx.inventory

        def one(t: Target) -> QueueReport:
            gpus = need_on(inv, t.name)
            req = QueueRequest(inv.job, ctx.owner.to_json(), waiting, turn.priority, turn.submitted, gpus)
            rep: QueueReport = call_agent(ctx.session, t, req)
            return rep

        run_step(ctx.session, Step.QUEUE, one, list(ctx.targets.values()))

    return mark
