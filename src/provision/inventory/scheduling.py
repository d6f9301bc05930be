"""The inventory's `priority:`, `preemptible:` and `preemption:` keys, checked as
the rest of the inventory is: every problem one line naming its place."""

from __future__ import annotations

import re
from typing import Any

from provision.core.scheduling import DEFAULT_GRACE_S, DEFAULT_PRIORITY, PreemptSignal, Scheduling
from provision.inventory.yamldoc import Checker, show_value

KEYS = ("priority", "preemptible", "preemption")
# A class name as the policy names it: a short plain word.
CLASS_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
PRIORITY_BOUND = 1_000_000
_DURATION = re.compile(r"(\d{1,7})(s|m|h)?")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, None: 1}
MAX_GRACE_S = 24 * 3600


def duration_s(value: Any) -> int | None:
    """`120`, `120s`, `2m`, `1h` -> seconds; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if not isinstance(value, str):
        return None
    m = _DURATION.fullmatch(value.strip())
    return int(m.group(1)) * _UNIT_S[m.group(2)] if m else None


def priority(c: Checker, value: Any) -> int | str:
    if value is None:
        return DEFAULT_PRIORITY
    if isinstance(value, int) and not isinstance(value, bool):
        if -PRIORITY_BOUND <= value <= PRIORITY_BOUND:
            return value
    elif isinstance(value, str) and CLASS_NAME.fullmatch(value):
        return value
    c.add(
        ("priority",),
        f"expected an integer from {-PRIORITY_BOUND} to {PRIORITY_BOUND} or a class name "
        f"(low, normal, high, or one of the team's policy), got {show_value(value)}",
    )
    return DEFAULT_PRIORITY


def preemption(c: Checker, value: Any) -> tuple[int, PreemptSignal]:
    path = ("preemption",)
    m = c.mapping(value, path)
    if not m:
        return DEFAULT_GRACE_S, PreemptSignal.SIGTERM
    c.keys(m, path, ("grace", "signal"))
    grace = DEFAULT_GRACE_S
    if "grace" in m:
        g = duration_s(m["grace"])
        if g is None or g > MAX_GRACE_S:
            c.add(path + ("grace",), f"expected a duration up to 24h (120, 120s, 2m, 1h), got {show_value(m['grace'])}")
        else:
            grace = g
    signal = PreemptSignal.SIGTERM
    if "signal" in m:
        try:
            signal = PreemptSignal(str(m["signal"]).upper())
        except ValueError:
            allowed = ", ".join(s.value for s in PreemptSignal)
            c.add(path + ("signal",), f"expected one of {allowed}, got {show_value(m['signal'])}")
    return grace, signal


def scheduling(c: Checker, top: dict[str, Any]) -> Scheduling:
    prio = priority(c, top.get("priority"))
    preemptible: bool | None = None
    if "preemptible" in top:
        v = top["preemptible"]
        if isinstance(v, bool):
            preemptible = v
        else:
            c.add(("preemptible",), f"expected true or false, got {show_value(v)}")
    grace, signal = preemption(c, top.get("preemption"))
    return Scheduling(prio, preemptible, grace, signal)
