"""A teammate's newer apply is not reverted in silence. Pure.

The state records, per host and file, who applied the content there and when
(core/records.Applied, written by io/state). The rule, one sentence: a change that replaces
or removes content the host has as another identity (tenancy.identity()) applied it is
*theirs*. Plan says so on the change's line ("replaces ana@lab's content applied
2026-11-27 14:02 UTC (serial 7)"); apply asks before it, even with -y, unless
--force-conflicts (kubectl's name for taking over what another manager applied).

Whose content it is, not whose checkout is older: the state cannot see checkouts. A file
the applier's own apply wrote, a file edited by hand since (drift: the host's content is
not the one recorded) and a state written before the record existed are not theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from provision.core.records import Applied, HostRecord, short
from provision.render.files import FileKind
from provision.rules.plan import FileAction, FileChange, HostPlan, Plan


def mark(plan: Plan, recorded: Mapping[str, HostRecord], keyed: Callable[[str], str], me: str) -> Plan:
    """The plan with each change that is theirs carrying who applied what it replaces.
    recorded: the state's hosts; keyed: the state's checksum (State.keyed); me: who applies."""

    def one(hp: HostPlan) -> HostPlan:
        rec = recorded.get(hp.name)
        if hp.error is not None or hp.report is None or rec is None or not rec.applied:
            return hp
        files = tuple(_marked(f, rec, hp, keyed, me) for f in hp.files)
        return replace(hp, files=files) if files != hp.files else hp

    return replace(plan, hosts=tuple(one(hp) for hp in plan.hosts))


def _marked(f: FileChange, rec: HostRecord, hp: HostPlan, keyed: Callable[[str], str], me: str) -> FileChange:
    if f.action is FileAction.CREATE or f.kind is FileKind.MANIFEST:
        return f  # nothing of anyone's is there to replace
    applied = rec.applied.get(f.path)
    there = hp.report.files.get(f.path) if hp.report is not None else None
    if applied is None or applied.who == me or there is None or there.type != "file" or not there.sha256:
        return f
    if short(keyed(there.sha256)) != applied.digest:
        return f  # changed since it was recorded (by hand: drift), so not what they applied
    return replace(f, replaces=applied)


def theirs(plan: Plan) -> list[tuple[HostPlan, FileChange]]:
    """The changes that replace another identity's content, host by host."""
    return [(hp, f) for hp in plan.hosts if hp.error is None for f in hp.files if f.replaces is not None]


def when(a: Applied) -> str:
    """`2026-11-27 14:02 UTC` from the recorded ISO time."""
    day, _, clock = a.at.partition("T")
    return f"{day} {clock[:5]} UTC" if clock else a.at


def describe(f: FileChange) -> str:
    """What the plan's line adds: whose content the change replaces (or removes)."""
    a = f.replaces
    assert a is not None
    verb = "removes" if f.action is FileAction.DELETE else "replaces"
    return f"{verb} {a.who}'s content applied {when(a)} (serial {a.serial})"


def whose(plan: Plan) -> list[str]:
    """Who applied the content the plan replaces, each once, in order."""
    return list(dict.fromkeys(f.replaces.who for _, f in theirs(plan) if f.replaces is not None))


def summary(plan: Plan) -> str | None:
    """The line under the plan's summary when some changes are theirs, else None."""
    found = theirs(plan)
    if not found:
        return None
    n = len(found)
    return (
        f"{n} change{'s' if n != 1 else ''} replace{'s' if n == 1 else ''} content {', '.join(whose(plan))} applied: "
        "apply asks before replacing it (-y does not answer that), or --force-conflicts replaces it."
    )


def question(plan: Plan) -> str:
    """apply's question before replacing it."""
    return f"Replace {' and '.join(whose(plan))}'s newer content?"


def refusal(plan: Plan) -> str:
    """apply's one line when it cannot ask (no terminal) and was not told to replace it."""
    hp, f = theirs(plan)[0]
    more = len(theirs(plan)) - 1
    first = f"{f.path} on {hp.name}: {describe(f)}" + (f", and {more} more" if more else "")
    return (
        f"apply would replace content {', '.join(whose(plan))} applied ({first}); "
        "run with --force-conflicts to replace it, or bring your checkout up to date (nothing was changed)"
    )
