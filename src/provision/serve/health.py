"""The hosts' health, acted on: a subscriber of the service's rounds (serve/rounds.py).

At each round, on the rounds' thread, its first subscriber (a quarantine waits for no other's work):
1. each host that answered: its signals and marks (the round's health read, rules/rounds)
   judged (rules/health.decide: a fatal signal quarantines its GPU, a bad host drains...);
2. the changes sent, one agent call per host that has any (run/health.send; the host
   applies each under its ledger's lock, or refuses one that finds the mark otherwise), with
   the time of the last kernel line dealt with;
3. what changed since the last round told (rules/healthlog.transitions): the events
   (`gpu.quarantined`, `gpu.released`, `host.drained`, `host.released`; with the job that
   held the GPU and its owner: the hook for whoever recovers the job), stored with what is
   known now in one transaction; every mark and outage an incident of the health history.

`doc` is each host's health after the round's changes, for the pages (the round itself
shows what the hosts said before them).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping

from provision.core.target import HostError
from provision.host.protocol import HealthReport, HealthRequest
from provision.io.servicestore import ServiceStore
from provision.rules import health as hl
from provision.rules.healthlog import Known, transitions
from provision.rules.rounds import Round
from provision.run import health as acting
from provision.run.survey import Contexts, Found

SEEN = "health"  # what the keeper knows, kept under this name with the events it led to


def service_by() -> str:
    return f"provision serve ({socket.gethostname()})"


class HealthKeeper:
    name = "health"

    def __init__(
        self,
        store: ServiceStore,
        found: Callable[[], Found],
        contexts: Contexts,
        wake: Callable[[], None] = lambda: None,
    ):
        self.store, self.found, self.contexts, self.wake = store, found, contexts, wake
        self.by = service_by()
        self._known: dict[str, Known] | None = None
        self.doc: dict[
            str, hl.HealthSummary
        ] = {}  # host -> {"host": mark, "gpus": {"0": mark, ...}}, after the changes
        self.changed = 0  # changes the hosts took (tests and the bench read it)
        self.failed: dict[str, str] = {}  # host -> why its changes could not be sent this round

    def forget(self) -> None:
        """Read what is known from the store again (the lead changed hands)."""
        self._known = None

    def _read(self) -> dict[str, Known]:
        got = self.store.seen(SEEN)
        return {str(h): Known.from_json(d) for h, d in got.items()} if isinstance(got, dict) else {}

    def on_round(self, r: Round) -> None:
        known = self._known if self._known is not None else self._read()
        requests: dict[str, HealthRequest] = {}
        for name, hs in r.hosts.items():
            if not hs.answered:
                continue
            changes = hl.decide(hs.health, hs.signals, hs.clock or r.began, self.by, hl.holders_of(hs.view))
            if changes or hs.xid_after is not None:
                requests[name] = HealthRequest(changes=[c.to_wire() for c in changes], xid_after=hs.xid_after)
        sent = self._send(r, requests) if requests else {}
        events, opened, closed, now = [], [], [], dict(known)
        for name, hs in sorted(r.hosts.items()):
            cur = hs.health
            rep = sent.get(name)
            if isinstance(rep, HealthReport):
                cur = hl.HostHealth.from_record(rep.record)
                self.changed += len(requests[name].changes) - len(rep.refused)
            ev, op, cl, k = transitions(name, known.get(name), cur, hs.view.gpus, hs.clock or r.began, hs.answered)
            events += ev
            opened += op
            closed += cl
            now[name] = k
            self.doc[name] = hl.summary(k.health(), range(hs.view.gpus))
        if opened:
            self.store.opened(opened)
        if closed:
            self.store.ended(closed)
        doc = {h: k.to_json() for h, k in sorted(now.items())}
        if events or now != known:
            if self.store.emit(events, (SEEN, doc)):
                self.wake()
        self._known = now

    def _send(self, r: Round, requests: Mapping[str, HealthRequest]) -> dict[str, HealthReport | HostError]:
        """Each host's request through the Context of an inventory that names it (one agent
        call per host; the inventories' at once, as the survey asks them)."""
        found = self.found()
        by_job: dict[str, dict[str, HealthRequest]] = {}
        for host, req in requests.items():
            job = next((j for j in sorted(r.jobs) if host in r.jobs[j] and j in found), None)
            if job is not None:
                by_job.setdefault(job, {})[host] = req
        out: dict[str, HealthReport | HostError] = {}
        for job, reqs in by_job.items():
            with self.contexts(job, found[job][0]) as ctx:
                res = acting.send(ctx, reqs)
            out.update(res.ok)
            out.update(res.errors)
        self.failed = {h: e.message for h, e in out.items() if isinstance(e, HostError)}
        return out
