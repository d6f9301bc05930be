"""When a dev session ends, and when its person is warned: a pure decision per session per
round of the service (serve/devreaper.py acts on it through run/devend.py).

A session ends at its hours (DevTerms.until), or once it has been idle for its idle time:
every GPU it holds below its threshold and nobody logged in to it, round after round. A
GPU that says no number (MIG, a host that did not answer it) is not idle: nothing is
known then. Whichever end comes first is announced `lead` seconds before (ten minutes):
to the session's terminals, on the event stream (`dev.ending`, a key per session and
end), on the dashboard; and the end comes no sooner than `lead` after its warning, so a
person always has the time they were told. A warning holds for the end it named: a busy
GPU or a login after it (an idle end moving later), or an `--extend`, calls it off, and
the next end is warned of again. A session with a busy GPU or someone logged in is never
ended for idleness.

What the service remembers of a session between rounds (Kept) is stored with its rounds;
after a gap in them (the service was down) nothing is known of the time missed, so the
idle time counts from the round after it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from provision.core.devsession import WARN_BEFORE_S, DevTerms
from provision.core.text import duration
from provision.rules.rounds import Round
from provision.rules.tenancy import Hold

SLACK = 1.0  # seconds: a stored end and the same end worked out again compare equal


class Why(StrEnum):
    IDLE = "idle"
    HOURS = "hours"


class Do(StrEnum):
    WARN = "warn"
    END = "end"


@dataclass(frozen=True)
class SessionNow:
    """A running session as a round sees it."""

    job: str
    terms: DevTerms
    host: str
    units: tuple[str, ...]
    utils: tuple[int | None, ...]  # each GPU it holds, as the round read it
    logins: tuple[str, ...]

    @property
    def busy(self) -> bool:
        """A GPU at or above its threshold, or one whose number is not known."""
        return any(u is None or u >= self.terms.idle_below for u in self.utils)


@dataclass(frozen=True)
class Kept:
    """What the service remembers of a session: when it was last busy or had someone logged
    in (its start, at first), and the end it warned of (why, that end, when it comes)."""

    active_at: float
    why: Why | None = None
    due: float | None = None  # the end as it was worked out when warned
    end_at: float | None = None  # ... and when it comes: no sooner than `lead` after the warning

    def to_json(self) -> dict[str, Any]:
        return {"active_at": self.active_at, "why": self.why, "due": self.due, "end_at": self.end_at}

    @classmethod
    def from_json(cls, d: Any) -> Kept | None:
        if not isinstance(d, dict) or not isinstance(d.get("active_at"), (int, float)):
            return None
        why = d.get("why")
        due, end_at = d.get("due"), d.get("end_at")
        if why not in (Why.IDLE.value, Why.HOURS.value) or not isinstance(due, (int, float)):
            return cls(float(d["active_at"]))
        if not isinstance(end_at, (int, float)):
            return cls(float(d["active_at"]))
        return cls(float(d["active_at"]), Why(str(why)), float(due), float(end_at))


@dataclass(frozen=True)
class Act:
    do: Do
    job: str
    why: Why
    at: float  # when it ends (a warning: the end it names)
    words: str


def running_sessions(r: Round) -> list[SessionNow]:
    """Every dev session a round sees running, with its GPUs' numbers and its logins."""
    out = []
    for name, hs in sorted(r.hosts.items()):
        if not hs.answered:
            continue
        seen = r.doc["hosts"].get(name)
        use = (seen.get("gpu_use") if seen is not None else None) or {}
        for h in hs.view.holders:
            if h.dev is None or h.hold is not Hold.RUNNING:
                continue
            utils = tuple(_util(u["utilization"] if (u := use.get(str(g))) else None) for g in h.gpus)
            logins = tuple(x for u in h.units for x in hs.logins.get(u, ()))
            out.append(SessionNow(h.job, h.dev, name, h.units, utils, logins))
    return out


def _util(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 100 else None


def ending(s: SessionNow, active_at: float) -> tuple[Why, float]:
    """The session's next end: its idle end or its hours, whichever is first."""
    idle_end = active_at + s.terms.idle_s
    return (Why.IDLE, idle_end) if idle_end < s.terms.until else (Why.HOURS, s.terms.until)


def decide(s: SessionNow, k: Kept | None, now: float, lead: float = WARN_BEFORE_S) -> tuple[Kept, Act | None]:
    """This round's act for one running session (None: nothing now), and what to keep."""
    active = k.active_at if k is not None else s.terms.started
    if s.busy or s.logins:
        active = now
    active = min(active, now)
    why, due = ending(s, active)
    kept = Kept(active)
    if k is not None and k.why is why and k.due is not None and abs(k.due - due) <= SLACK and k.end_at is not None:
        kept = replace(kept, why=why, due=k.due, end_at=k.end_at)  # the warning given holds
        if now >= k.end_at:
            return kept, Act(Do.END, s.job, why, k.end_at, end_words(s, why, now - active))
        return kept, None
    if now < due - lead:
        return kept, None
    end_at = max(due, now + lead)
    return replace(kept, why=why, due=due, end_at=end_at), Act(Do.WARN, s.job, why, end_at, warn_words(s, why, end_at))


def decide_all(
    now_seen: Sequence[SessionNow], kept: Mapping[str, Kept], now: float, lead: float, gap: bool
) -> tuple[dict[str, Kept], list[Act]]:
    """Every running session's act and what to keep. `gap`: the rounds before were not seen
    (the service was down): each session counts as active now. Sessions not in this round
    (their host did not answer) keep what was kept; ended ones are forgotten."""
    out: dict[str, Kept] = {}
    acts: list[Act] = []
    for s in now_seen:
        before = kept.get(s.job)
        if gap:
            before = Kept(now)
        k, act = decide(s, before, now, lead)
        out[s.job] = k
        if act is not None:
            acts.append(act)
    return out, acts


def held_over(kept: Mapping[str, Kept], unseen: Iterable[str]) -> dict[str, Kept]:
    """What is kept of the sessions a round could not see (their host did not answer)."""
    return {j: kept[j] for j in unseen if j in kept}


def _clock(t: float) -> str:
    return time.strftime("%H:%M", time.localtime(t))


def _reason(s: SessionNow, why: Why, idle_for: float) -> str:
    if why is Why.HOURS:
        hours = (s.terms.until - s.terms.started) / 3600
        return f"its {hours:.3g} h are up"
    return (
        f"its GPUs below {s.terms.idle_below} % with nobody logged in for {duration(int(max(0, idle_for)))}"
        f" (its limit: {duration(s.terms.idle_s)})"
    )


def warn_words(s: SessionNow, why: Why, end_at: float) -> str:
    what = "idle" if why is Why.IDLE else "its hours"
    return f"dev session {s.terms.name} of {s.terms.owner} on {s.host} ends at {_clock(end_at)} ({what}): " + (
        "use a GPU or log in to keep it" if why is Why.IDLE else f"`provision dev --extend 2h {s.terms.name}` keeps it"
    )


def end_words(s: SessionNow, why: Why, idle_for: float) -> str:
    return f"ended by the service: {_reason(s, why, idle_for)}"
