"""Idle GPUs go back: the service's watch of dev sessions, a subscriber of its rounds.

Each round carries every watched host's ledger (a session's terms, DevTerms, are in its
entry), each GPU's utilization and who is logged in to each session (the probe's
`logins`). rules/devidle.decide says, per session, whether to warn or to end it now;
this acts through run/devend.py on the session's host (over the rounds' own Context for a
known inventory that names the host), and stores, in one transaction, the `dev.ending`
events of its warnings and what it keeps of each session (io/serviceevents' `seen`, as
"dev"): a restart, or another service taking the lead, goes on from there. The end
itself reaches the stream as any job's (`job.ended`, stopped, with why) from the next
round. While an act is due within the next quiet minute the rounds come every 10 s
(`hurry`), so an idle session's GPUs are free within one round of its limit.

Test knobs, not settings (as PROVISION_TEST_IDLE_WINDOW_S): PROVISION_TEST_DEV_IDLE_S,
every session's idle time, and PROVISION_TEST_DEV_WARN_S, how long before an end its
warning comes (default: ten minutes).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from provision.core.devsession import WARN_BEFORE_S
from provision.core.errors import ProvisionError
from provision.core.events import Event, Kind
from provision.core.target import HostError
from provision.io.servicestore import ServiceStore
from provision.rules.devidle import Act, Do, Kept, SessionNow, decide_all, held_over, running_sessions
from provision.rules.jobsdoc import DevSeenJson
from provision.rules.rounds import Round
from provision.run import devend
from provision.run.survey import Found, KeptContexts
from provision.serve.gpusample import QUIET_EVERY, SAMPLE_EVERY

SEEN = "dev"  # what is kept of the sessions, under this name
GAP = 3 * QUIET_EVERY  # seconds without a round after which what happened meanwhile is unknown
IDLE_ENV, WARN_ENV = "PROVISION_TEST_DEV_IDLE_S", "PROVISION_TEST_DEV_WARN_S"


def _knob(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    try:
        return max(1.0, float(raw)) if raw else None
    except ValueError:
        return None


def ending_key(job: str, at: float) -> str:
    """A warning's key: one per session and end (a later end is warned of again)."""
    return f"dev.ending:{job}:{int(at)}"


class DevReaper:
    name = "dev sessions"

    def __init__(
        self,
        store: ServiceStore,
        found: Callable[[], Found],
        contexts: KeptContexts,
        say: Callable[[str], None],
        wake: Callable[[], None] = lambda: None,
    ):
        self.store, self.found, self.contexts, self.say, self.wake = store, found, contexts, say, wake
        self.lead = _knob(WARN_ENV) or float(WARN_BEFORE_S)
        self.idle = _knob(IDLE_ENV)
        self._kept: dict[str, Kept] | None = None  # as stored last (read at the first round)
        self._at: float | None = None  # the round it was stored with
        self.next_act: float | None = None  # (this machine's clock) the soonest act due
        self.view: dict[str, DevSeenJson] = {}  # job -> what the dashboard shows of it
        self._failing: set[str] = set()

    def view_of(self) -> dict[str, DevSeenJson]:
        """job -> its idle time, logins and ending as the last round saw them (the dashboard's)."""
        return self.view

    def forget(self) -> None:
        """Another service may have kept them since (the lead changed hands): read again."""
        self._kept = None

    def hurry(self) -> bool:
        """An act is due before the next quiet round: rounds at the full rate."""
        return self.next_act is not None and self.next_act - time.time() < QUIET_EVERY + SAMPLE_EVERY

    def _read(self) -> dict[str, Kept]:
        doc = self.store.seen(SEEN)
        doc = doc if isinstance(doc, dict) else {}
        at = doc.get("at")
        self._at = float(at) if isinstance(at, (int, float)) else None
        sessions = doc.get("sessions")
        if not isinstance(sessions, dict):
            return {}
        return {str(j): k for j, v in sessions.items() if (k := Kept.from_json(v)) is not None}

    def on_round(self, r: Round) -> None:
        kept = self._read() if self._kept is None else self._kept
        now = r.began
        seen = running_sessions(r)
        if self.idle is not None:  # the test knob: every session's idle time
            seen = [dataclasses.replace(s, terms=dataclasses.replace(s.terms, idle_s=int(self.idle))) for s in seen]
        gap = self._at is not None and now - self._at > GAP
        new, acts = decide_all(seen, kept, now, self.lead, gap)
        away = any(not h.answered for h in r.hosts.values())
        new |= held_over(kept, [j for j in kept if j not in new]) if away else {}
        by_job = {s.job: s for s in seen}
        events = []
        for act in acts:
            s = by_job[act.job]
            if self._act(s, act) and act.do is Do.END:
                new.pop(act.job, None)
            elif act.do is Do.WARN:
                events.append(
                    Event(Kind.DEV_ENDING, ending_key(s.job, act.at), s.job, s.terms.owner, s.host, act.words)
                )
        if new or kept:
            self.store.emit(events, (SEEN, {"at": now, "sessions": {j: k.to_json() for j, k in sorted(new.items())}}))
            if events:
                self.wake()
        self._kept, self._at = new, now
        self._publish(seen, new, now)

    def _act(self, s: SessionNow, act: Act) -> bool:
        """Warn or end on the session's host; whether it was done (a failure is said once)."""
        try:
            target, session = self._reach(s.host)
            if act.do is Do.WARN:
                devend.warn(session, target, s.job, s.units, act.words)
            else:
                errors = devend.end(session, target, s.job, s.units, act.words)
                if errors:
                    raise ProvisionError(errors[0])
        except (HostError, ProvisionError) as e:
            if s.job not in self._failing:
                self.say(f"dev session {s.terms.name} ({s.job}) on {s.host}: could not {act.do.value} it: {e.message}")
            self._failing.add(s.job)
            return False
        self._failing.discard(s.job)
        done = "warned" if act.do is Do.WARN else "ended"
        self.say(f"dev session {s.terms.name} ({s.job}) on {s.host} {done}: {act.words}")
        return True

    def _reach(self, host: str) -> tuple[Any, Any]:
        """A Target for the host and the session to reach it with: a known inventory's."""
        for job, (path, inv) in self.found().items():
            if any(h.name == host for h in inv.hosts):
                with self.contexts(job, path) as ctx:
                    return ctx.targets[host], ctx.session
        raise ProvisionError(f"no inventory the service knows names {host}")

    def _publish(self, seen: list[SessionNow], kept: dict[str, Kept], now: float) -> None:
        view: dict[str, DevSeenJson] = {}
        due: list[float] = []
        for s in seen:
            k = kept.get(s.job)
            if k is None:
                continue
            idle_end = k.active_at + s.terms.idle_s
            nxt = k.end_at if k.end_at is not None else min(idle_end, s.terms.until) - self.lead
            due.append(time.time() + (nxt - now))
            view[s.job] = {
                "idle_seconds": int(max(0, now - k.active_at)),
                "logins": len(s.logins),
                "ending": {"why": k.why.value, "at": k.end_at} if k.why is not None else None,
            }
        self.view, self.next_act = view, min(due, default=None)
