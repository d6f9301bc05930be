"""What a preempted job's status says, from the end markers host/preempt.py wrote
on its hosts: who preempted it, when, for what, and when it resumes; and, preempted on some
of its hosts only, where it must be stopped too (a job is preempted whole: rest). Pure.

    Preempted at 14:02 by deadline-run (ana, priority high): 2 GPUs on gpu-3; resumes when
    2 GPUs are free (3rd in the queue)
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from provision.core.lifecycle import PREEMPT_PHASE
from provision.core.scheduling import PreemptMark

# The exit record's SERVICE_RESULT of a task systemd killed at TimeoutStopSec=.
KILLED_AT_DEADLINE = "timeout"


def marks(lifecycles: Mapping[str, Any]) -> list[tuple[str, PreemptMark]]:
    """(host, the mark its end marker holds) for every host whose end marker says
    Preempted, in host order."""
    out = []
    for host, lc in sorted(lifecycles.items()):
        mark = PreemptMark.of_marker(lc, PREEMPT_PHASE)
        if mark is not None:
            out.append((host, mark))
    return out


@dataclass(frozen=True)
class Rest:
    """A job preempted on some of its hosts, not yet on all: a synchronous job is preempted
    whole, so whoever acts for it (the service watching it, its owner's status or apply)
    stops its tasks on the others. Its preemptor does not: it may not know those hosts, and
    must not connect to hosts another host's ledger names (host-sent data is untrusted)."""

    first: str  # the first host (in name order) whose marker says Preempted
    mark: PreemptMark  # that marker's: by whom, at what priority
    stop: tuple[str, ...]  # hosts where its tasks run with no Preempted marker: to preempt
    stopping: tuple[str, ...]  # hosts marked Preempted whose tasks have not ended yet


def to_stop(marked: Collection[str], live: Mapping[str, bool]) -> tuple[str, ...]:
    """The rule: once any host marks the job Preempted, every other host where its tasks
    still run is preempted too (name order)."""
    return tuple(sorted(h for h, running in live.items() if running and h not in marked)) if marked else ()


def rest(lifecycles: Mapping[str, Any], live: Mapping[str, bool]) -> Rest | None:
    """`lifecycles`: host -> the job's end marker there; `live`: host -> do its tasks there
    run (or stop: not ended yet). None when no host marks it Preempted, or when it has
    stopped everywhere."""
    found = marks(lifecycles)
    marked = {h for h, _ in found}
    stop = to_stop(marked, live)
    stopping = tuple(sorted(h for h in marked if live.get(h)))
    if not found or not (stop or stopping):
        return None
    first, mark = _preemptors(found)[0]
    return Rest(first, mark, stop, stopping)


def _preemptors(found: Sequence[tuple[str, PreemptMark]]) -> list[tuple[str, PreemptMark]]:
    """The markers its preemptor wrote first, then those its own side wrote following them."""
    return sorted(found, key=lambda hm: (bool(hm[1].follows), hm[0]))


def rest_words(r: Rest | None) -> str:
    """What status adds to a job preempted on part of its hosts: '; still running on
    host-2 (...)' or '; stopping on host-2'."""
    if r is None:
        return ""
    out = ""
    if r.stop:
        out += (
            f"; still running on {', '.join(r.stop)}: not preempted there yet (a job is preempted whole: "
            "the service watching it, or its owner's status or apply, stops it there)"
        )
    if r.stopping:
        out += f"; stopping on {', '.join(r.stopping)} (its tasks save a checkpoint)"
    return out


def _n(x: int, word: str) -> str:
    return f"{x} {word}{'' if x == 1 else 's'}"


def _by(first: PreemptMark) -> str:
    """'by deadline-run (ana, priority high)'."""
    prio = first.priority_name or first.priority
    who = ", ".join(str(x) for x in (first.who, f"priority {prio}" if prio not in (None, "") else None) if x)
    return f"by {first.by or '?'}" + (f" ({who})" if who else "")


def _resumes(gpus: int, place: int | None) -> str:
    when = (
        f"resumes when {_n(gpus, 'GPU')} {'is' if gpus == 1 else 'are'} free" if gpus else "resumes when room returns"
    )
    return when + (f" ({ordinal(place)} in the queue)" if place is not None else "")


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ... 11th, 12th, 13th, ... 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def reason(found: Sequence[tuple[str, PreemptMark]], clock: Any = time.localtime, place: int | None = None) -> str:
    """The status line's reason (after "Preempted "): at, by whom, what it held where, and
    (`place`: rules/queueorder.place_in_queue) its place in the queue."""
    if not found:
        return "preempted"
    first = _preemptors(found)[0][1]  # when and by whom: as its preemptor marked it
    when = f"at {time.strftime('%H:%M', clock(first.at))} " if first.at is not None else ""
    held = [(h, len(m.gpus)) for h, m in found]
    where = ", ".join(f"{_n(n, 'GPU')} on {h}" for h, n in held if n) or "its hosts"
    return f"{when}{_by(first)}: {where}; {_resumes(sum(n for _, n in held), place)}"


def paused(mark: PreemptMark | None, gpus: int) -> str:
    """A tuning trial's words when its job was preempted (`mark`: its end marker's; `gpus`:
    what the trial takes): 'preempted by deadline-run (ana, priority high); resumes when 1
    GPU is free'."""
    by = _by(mark) if mark is not None else "by higher-priority work"
    return f"preempted {by}; {_resumes(gpus, None)}"


def killed_at_deadline(found: Sequence[tuple[str, PreemptMark]], last_exit: Sequence[str] | None) -> str | None:
    """The detail of a task systemd killed at the preemption's deadline (it did not exit
    within the grace after the signal), else None."""
    if not found or not last_exit or len(last_exit) < 2 or last_exit[1] != KILLED_AT_DEADLINE:
        return None
    m = found[0][1]
    grace = f" {int(m.deadline - m.at)} s" if m.at is not None and m.deadline is not None else ""
    return f"killed at the preemption's deadline: it had not exited{grace} after the preemption's signal"
