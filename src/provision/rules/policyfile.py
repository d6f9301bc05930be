"""The team's policy file (`provision policy set FILE`), checked as the inventory
is: every problem one line naming its place.

    classes: {low: 100, normal: 500, high: 1000}   # priority classes: name -> integer
    guarantees: {ana@lab: 4, vision: 8}            # owner or group -> guaranteed GPUs
    groups: {bob@lab: vision, carol@lab: vision}   # owner -> the group whose guarantee it shares
    health:                                        # rules/health.py, docs/health.md
      xids: {31: fatal, 43: warn}                  # an Xid's class: fatal, program, warn, ignore
      test_before_release: true                    # a quarantined GPU passes a test first
    dev: {priority: normal, hours: 8, idle_minutes: 60, idle_below: 5}   # `provision dev` sessions

An owner named in `guarantees:` or `groups:` must be one the team knows (`known`: who
appears in the state backend's records; None: not checked), so a typo does not give a
guarantee to no one."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from provision.core.devsession import MAX_HOURS, MAX_IDLE_S
from provision.core.errors import ValidationError
from provision.inventory.scheduling import CLASS_NAME, PRIORITY_BOUND
from provision.inventory.yamldoc import SYNTAX_ERRORS, Checker, KeyPath, compose, show_value, syntax_error
from provision.rules.health import HealthPolicy
from provision.rules.priority import DEFAULT_CLASSES, DevPolicy, Policy
from provision.rules.xids import MAX_XID, XidClass

KEYS = ("classes", "guarantees", "groups", "health", "dev")
HEALTH_KEYS = ("xids", "test_before_release")
DEV_KEYS = ("priority", "hours", "idle_minutes", "idle_below")
MAX_GPUS = 1_000_000


def parse(text: str, display: str, known: Collection[str] | None = None, known_from: str = "") -> Policy:
    """The policy in `text`, or ValidationError listing every problem. known_from: where
    the known owners were taken from (said when one is not among them)."""
    yaml_problems: list[tuple[KeyPath, str, int | None]] = []
    try:
        doc = compose(text, yaml_problems)
    except SYNTAX_ERRORS as e:
        raise ValidationError([syntax_error(display, e)]) from None
    c = Checker(doc, display)
    for p, msg, line in yaml_problems:
        c.add(p, msg, line)
    top = doc.data
    if top is None:
        top = {}
    if not isinstance(top, dict):
        c.add((), f"expected a mapping with classes, guarantees and groups, got {show_value(top)}")
        raise ValidationError([m for _, _, m in sorted(c.problems)])
    c.keys(top, (), KEYS)
    classes = _classes(c, top.get("classes")) if "classes" in top else dict(DEFAULT_CLASSES)
    groups = _names(c, top.get("groups"), ("groups",))
    guarantees: dict[str, int] = {}
    for who, n in (c.mapping(top.get("guarantees"), ("guarantees",)) or {}).items():
        got = c.integer(n, ("guarantees", who), 0, MAX_GPUS)
        if got is not None:
            guarantees[str(who)] = got
    if known is not None:
        _known(c, groups, guarantees, known, known_from)
    health = _health(c, top.get("health"))
    dev = _dev(c, top.get("dev"), classes)
    if c.problems:
        raise ValidationError([m for _, _, m in sorted(c.problems)])
    return Policy(
        tuple(sorted(classes.items(), key=lambda kv: (kv[1], kv[0]))),
        tuple(sorted(guarantees.items())),
        tuple(sorted(groups.items())),
        health,
        dev,
    )


def _dev(c: Checker, value: Any, classes: Mapping[str, int]) -> DevPolicy:
    """`dev:` the terms of `provision dev` sessions; each key left out keeps its default."""
    d = DevPolicy()
    m = c.mapping(value, ("dev",))
    if not m:
        return d
    c.keys(m, ("dev",), DEV_KEYS)
    priority: int | str = d.priority
    if "priority" in m:
        p = m["priority"]
        if isinstance(p, str) and p in classes:
            priority = p
        elif isinstance(p, int) and not isinstance(p, bool) and -PRIORITY_BOUND <= p <= PRIORITY_BOUND:
            priority = p
        else:
            known = ", ".join(sorted(classes))
            c.add(("dev", "priority"), f"expected a class of classes: ({known}) or an integer, got {show_value(p)}")
    elif d.priority not in classes:
        c.add(("dev",), f"no priority: given, and the default class {d.priority!r} is not among classes:")
    hours = c.number(m["hours"], ("dev", "hours"), 0) if "hours" in m else d.hours
    if hours is not None and hours > MAX_HOURS:
        c.add(("dev", "hours"), f"at most {MAX_HOURS:g}, got {hours:g}")
    idle = c.integer(m["idle_minutes"], ("dev", "idle_minutes"), 1, MAX_IDLE_S // 60) if "idle_minutes" in m else None
    below = c.integer(m["idle_below"], ("dev", "idle_below"), 0, 100) if "idle_below" in m else None
    return DevPolicy(
        priority,
        hours if hours is not None and hours <= MAX_HOURS else d.hours,
        idle if idle is not None else d.idle_minutes,
        below if below is not None else d.idle_below,
    )


def _health(c: Checker, value: Any) -> HealthPolicy:
    """health: {xids: {NUMBER: fatal|program|warn|ignore}, test_before_release: BOOL}."""
    m = c.mapping(value, ("health",))
    if not m:
        return HealthPolicy()
    c.keys(m, ("health",), HEALTH_KEYS)
    table: dict[int, XidClass] = {}
    for code, cls in (c.mapping(m.get("xids"), ("health", "xids")) or {}).items():
        path = ("health", "xids", code)
        text = str(code).strip()
        if isinstance(code, bool) or not text.isdigit() or not 0 < int(text) <= MAX_XID:
            c.add(path, f"an Xid is a number from 1 to {MAX_XID}, got {show_value(code)}")
            continue
        got = c.choice(cls, path, tuple(x.value for x in XidClass))
        if got is not None:
            table[int(text)] = XidClass(got)
    test = m.get("test_before_release", True)
    if not isinstance(test, bool):
        c.add(("health", "test_before_release"), f"expected true or false, got {show_value(test)}")
        test = True
    return HealthPolicy(tuple(sorted(table.items())), test)


def _known(
    c: Checker, groups: Mapping[str, str], guarantees: Mapping[str, int], known: Collection[str], known_from: str
) -> None:
    """Owners named in groups: and guarantees: (a group's name aside) are the team's."""
    source = f" (known owners, from {known_from}: {_few(sorted(known))})" if known_from else ""
    for owner in groups:
        if owner not in known:
            c.add(("groups", owner), f"{owner!r} is not an owner the team knows{source}")
    for who in guarantees:
        if who not in set(groups.values()) and who not in known:
            c.add(("guarantees", who), f"{who!r} is neither an owner the team knows nor a group of groups:{source}")


def _few(names: list[str], n: int = 8) -> str:
    if not names:
        return "none yet"
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _classes(c: Checker, value: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    m = c.mapping(value, ("classes",))
    if not m:
        if m is not None:
            c.add(("classes",), "expected at least one class (name: integer)")
        return out
    for name, n in m.items():
        path = ("classes", name)
        if not isinstance(name, str) or not CLASS_NAME.fullmatch(name):
            c.add(path, f"a class name is a short plain word (a-z, 0-9, '_', '-'), got {show_value(name)}")
            continue
        got = c.integer(n, path, -PRIORITY_BOUND, PRIORITY_BOUND)
        if got is not None:
            out[name] = got
    return out


def _names(c: Checker, value: Any, path: KeyPath) -> dict[str, str]:
    out: dict[str, str] = {}
    for owner, group in (c.mapping(value, path) or {}).items():
        got = c.string(group, path + (owner,))
        if got is not None and got.strip():
            out[str(owner)] = got
        elif got is not None:
            c.add(path + (owner,), "expected a group name, got an empty string")
    return out


def to_json(p: Policy) -> dict[str, Any]:
    health = {"xids": {str(k): v.value for k, v in p.health.xids}, "test_before_release": p.health.test_before_release}
    return {
        "classes": dict(p.classes),
        "guarantees": dict(p.guarantees),
        "groups": dict(p.groups),
        "health": health,
        "dev": dev_json(p.dev),
    }


def dev_json(d: DevPolicy) -> dict[str, Any]:
    return {"priority": d.priority, "hours": d.hours, "idle_minutes": d.idle_minutes, "idle_below": d.idle_below}


def from_json(d: Mapping[str, Any]) -> Policy:
    """The stored form back (written by to_json: trusted as far as its types; anything else
    in it is a ValueError, said by the caller in one line)."""

    def pairs(key: str, kind: type) -> tuple[tuple[str, Any], ...]:
        m = d.get(key) or {}
        if not isinstance(m, dict) or not all(isinstance(k, str) and isinstance(v, kind) for k, v in m.items()):
            raise ValueError(f"{key}: not a mapping of names to {kind.__name__}")
        return tuple(sorted(m.items()))

    classes = pairs("classes", int) or tuple(DEFAULT_CLASSES.items())
    h = d.get("health") or {}
    if not isinstance(h, dict):
        raise ValueError("health: not a mapping")
    table = tuple(sorted((int(k), XidClass(str(v))) for k, v in (h.get("xids") or {}).items()))
    health = HealthPolicy(table, h.get("test_before_release", True) is not False)
    return Policy(
        tuple(sorted(classes, key=lambda kv: (kv[1], kv[0]))),
        pairs("guarantees", int),
        pairs("groups", str),
        health,
        _dev_from_json(d.get("dev")),
    )


def _dev_from_json(v: Any) -> DevPolicy:
    """The stored `dev:` (absent in policies stored before it: the defaults)."""
    if v is None:
        return DevPolicy()
    if not isinstance(v, dict):
        raise ValueError("dev: not a mapping")
    prio, hours, idle, below = (v.get(k) for k in DEV_KEYS)
    if isinstance(prio, bool) or not isinstance(prio, (int, str)):
        raise ValueError("dev.priority: not a class or an integer")
    if isinstance(hours, bool) or not isinstance(hours, (int, float)) or not 0 < hours <= MAX_HOURS:
        raise ValueError("dev.hours: not a number of hours")
    for key, n in (("idle_minutes", idle), ("idle_below", below)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"dev.{key}: not a whole number")
    assert isinstance(idle, int) and isinstance(below, int)
    return DevPolicy(prio, float(hours), idle, below)
