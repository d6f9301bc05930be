"""The log keeper: a subscriber of the event stream (serve/stream.py) that keeps a job's last
lines when one of its runs ends (`job.ended`), read from its hosts while they still have
them, into the service's database (io/servicelogs.py, bounded: docs/dashboard.md). The
pages read that copy once the hosts no longer have it (the job destroyed, a host gone, the
work finished and forgotten). A trial's lines are its runner's to keep (beside its study:
run/studylogs.py reads them), and a job no inventory names cannot be asked (no way to
reach its hosts): neither is kept here.

Each run is kept once (a repeat of the event, a restarted service: its run is there
already). A host that does not answer gives what the others gave; nothing raises (the
stream would hand the same events again and again)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from provision.core.answers import LogLine
from provision.core.errors import ProvisionError
from provision.core.events import Kind, Stored
from provision.io.servicestore import ServiceStore

TAIL = 20_000  # lines of each task read when a run ends (the store keeps at most its bound of them)


class LogKeeper:
    name = "kept logs"
    from_start = False  # a new keeper begins at the stream's end: the runs before it ended long ago

    def __init__(
        self, store: ServiceStore, tail: Callable[[str, int], list[LogLine] | None], say: Callable[[str], None]
    ):
        self.store, self.tail, self.say = store, tail, say

    def handle(self, events: Sequence[Stored]) -> None:
        for s in events:
            e = s.event
            if e.kind is not Kind.JOB_ENDED or not e.job:
                continue
            if e.run in self.store.kept_runs(e.job) or (e.run is None and self.store.has_kept_logs(e.job)):
                continue  # kept already (a repeat)
            try:
                lines = self.tail(e.job, TAIL)
            except ProvisionError as err:
                self.say(f"kept logs: job {e.job}: its hosts did not give its lines ({err.message})")
                continue
            if lines:
                self.store.keep_logs(e.job, e.run, lines)
