"""Quotas at a glance, as Kueue shows a ClusterQueue's usage: for each owner (or the group
whose guarantee they share: the team's policy), the GPUs guaranteed, in use, borrowed (in
use beyond the guarantee) and asked for by its waiting work; and, for a quota with room left
in its guarantee, what would happen if it asked for that room now: whether it fits in the
free GPUs, else which running work rules/preemption.decide would preempt first. Pure."""

from __future__ import annotations

import calendar
import time
from collections.abc import Mapping, Sequence
from typing import TypedDict

from provision.rules.jobrows import shown_state
from provision.rules.jobsdoc import JobJson, JobsDoc
from provision.rules.preemption import Replica, Running, Waiting, decide
from provision.rules.priority import Policy
from provision.rules.tenancy import NORMAL

QUOTAS_FORMAT = 1
HOLDING_STATES = ("running", "reserved", "held")
ASKED = "(asked now)"  # the name of the work a quota would ask for


class VictimJson(TypedDict):
    job: str
    owner: str
    why: str


class AskJson(TypedDict):
    """What a quota asking for its guarantee's room now would get."""

    gpus: int
    fits: bool  # in the free GPUs, nobody preempted
    possible: bool  # false: not even with every candidate gone
    victims: list[VictimJson]  # in the order they would be taken


class QuotaJson(TypedDict):
    quota: str  # an owner, or the group whose guarantee its members share
    members: list[str]
    guaranteed: int
    used: int  # GPUs its running work holds now
    borrowed: int  # used beyond the guarantee (preemptible first when a guaranteed owner asks)
    waiting: int  # GPUs its queued (or preempted) work asks for
    waiting_jobs: list[str]
    if_asked: AskJson | None  # for a quota with room left in its guarantee


class QuotasDoc(TypedDict):
    format_version: int
    guarantees: bool  # the team's policy names some guarantee
    quotas: list[QuotaJson]
    free: int  # GPUs free now on the hosts that answered (drained ones left out)


def _epoch(iso: str | None) -> float:
    try:
        return float(calendar.timegm(time.strptime(str(iso), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return 0.0


def running_of(jobs: Sequence[JobJson]) -> list[Running]:
    """The work that holds GPUs now, as rules/preemption weighs it."""
    out = []
    for j in jobs:
        if shown_state(j) not in HOLDING_STATES:
            continue
        gpus = tuple((h, len(v.get("gpus") or ())) for h, v in sorted(j["hosts"].items()) if v.get("gpus"))
        if gpus:
            out.append(
                Running(
                    j["job"],
                    j.get("owner") or "",
                    j.get("priority_level", NORMAL),
                    j.get("preemptible", False),
                    _epoch(j.get("since")),
                    gpus,
                )  # fmt: skip
            )
    return out


def free_of(doc: JobsDoc) -> dict[str, int]:
    return {
        name: len(h.get("free_gpus") or ())
        for name, h in doc["hosts"].items()
        if h.get("error") is None and not h.get("drain")
    }


def quotas(doc: JobsDoc, policy: Policy, asks: Mapping[str, int]) -> QuotasDoc:
    """Every quota with a guarantee, in use or waiting. `asks`: job -> the GPUs a waiting
    job asks for (its inventory's; else what its hosts' entries name)."""
    running = running_of(doc["jobs"])
    free = free_of(doc)
    rows = _Rows(policy)
    for name, _ in (*policy.guarantees, *policy.groups):
        rows.of(name)
    for r in running:
        rows.of(r.owner)["used"] += sum(n for _, n in r.gpus)
    for j in doc["jobs"]:
        if shown_state(j) in ("queued", "preempted"):
            got = rows.of(j.get("owner") or "")
            got["waiting"] += asks.get(j["job"], 1)
            got["waiting_jobs"].append(j["job"])
    for q in rows.rows.values():
        q["members"].sort()
        q["borrowed"] = max(0, q["used"] - q["guaranteed"])
        room = q["guaranteed"] - q["used"]
        if room > 0:
            q["if_asked"] = _ask(q, room, running, free, policy)
    ordered = sorted(rows.rows.values(), key=lambda q: (q["guaranteed"] == 0, -q["used"], q["quota"]))
    return {
        "format_version": QUOTAS_FORMAT,
        "guarantees": bool(policy.guarantees),
        "quotas": ordered,
        "free": sum(free.values()),
    }


class _Rows:
    """Each quota's row, made when one of its owners is first met."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.rows: dict[str, QuotaJson] = {}

    def of(self, owner: str) -> QuotaJson:
        q = self.policy.quota_of(owner)
        if q not in self.rows:
            self.rows[q] = {
                "quota": q, "members": [], "guaranteed": self.policy.guarantee(owner), "used": 0, "borrowed": 0,
                "waiting": 0, "waiting_jobs": [], "if_asked": None,
            }  # fmt: skip
        if owner and owner != q and owner not in self.rows[q]["members"]:
            self.rows[q]["members"].append(owner)
        return self.rows[q]


def _ask(q: QuotaJson, room: int, running: Sequence[Running], free: Mapping[str, int], policy: Policy) -> AskJson:
    """The quota asks for `room` GPUs now (one GPU a replica, on any host that answered)."""
    owner = q["members"][0] if q["members"] else q["quota"]  # a group's: one of its members asks
    hosts = tuple(sorted(free))
    w = Waiting(ASKED, owner, NORMAL, tuple(Replica(1, hosts) for _ in range(room)))
    got = decide(w, running, free, policy)
    if got is None:
        return {"gpus": room, "fits": False, "possible": False, "victims": []}
    victims: list[VictimJson] = [{"job": v.job, "owner": v.owner, "why": v.why.value} for v in got]
    return {"gpus": room, "fits": not victims, "possible": True, "victims": victims}
