"""The preemption step: an apply (queued or not) that does not fit because other
jobs hold what it needs asks rules/preemption.decide which running work leaves for it, and
preempts that work on its hosts (host/preempt.py), then plans again until the victims'
tasks have ended (within their grace) and their GPUs are its own.

- Each victim is preempted host by host in name order, so two preemptors racing for it
  meet on the same first host: the ledger's lock lets one mark it, the other is refused and
  waits (nothing is preempted twice).
- A victim's GPUs stay reserved for its preemptor (tenancy.Hold.PREEMPTED) until the
  preemptor's reserve takes them; a preemptor that dies on the way lets them go (its pid,
  or its renewals of the mark, stop), and its own re-run finds its victims by their mark
  and goes on with them.
- A host that does not answer is not preempted: its GPUs are not given away, and the next
  look (the queue's, or the next apply's) preempts there once it answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from provision.core.target import HostError
from provision.host.protocol import PreemptReport, PreemptRequest
from provision.io.ssh import call_agent
from provision.placement.tasks import Held, PlacementError, place
from provision.rules.preemption import Victim, Waiting, decide
from provision.rules.priority import name_of
from provision.rules.queueorder import waits_behind
from provision.rules.tenancy import Holder, holders
from provision.rules.victims import Candidates, candidates, held_without, replicas
from provision.run.context import Ask, Context, probe
from provision.run.victim import MARGIN, TICK  # the victims' grace is waited for as their own side waits

T = TypeVar("T")
RENEW = 15.0  # seconds between renewals of the preemptor's mark (its heartbeat: tenancy.judge)


@dataclass(frozen=True)
class Taken:
    """One victim preempted on one host, for the apply's output."""

    job: str
    owner: str
    priority: str
    host: str
    gpus: tuple[int, ...]
    grace: float


def said(t: Taken) -> str:
    gpus = ", ".join(map(str, t.gpus)) or "none"
    return (
        f"preempted job {t.job} ({t.owner}, priority {t.priority}) on {t.host}: GPUs {gpus}; "
        f"its tasks have {int(t.grace)} s to save a checkpoint"
    )


class Preemptor:
    """The step for one apply: `planned(make)` is `make()`, preempting when it is held."""

    def __init__(self, ctx: Context, progress: Callable[[str], None]):
        self.ctx, self.progress = ctx, progress
        self.renewed: dict[tuple[str, str], float] = {}  # (victim, host) -> when last marked
        self.taken: list[Taken] = []
        self.said_away: tuple[str, ...] = ()  # the hosts it needs that did not answer, as last said

    def planned(self, make: Callable[[], T], held: PlacementError | None = None) -> T:
        """held: what make() just raised (the caller's first try), to go on from."""
        until: float | None = None
        while True:
            if held is None:
                try:
                    return make()
                except PlacementError as e:
                    held = e
            err, held = held, None
            if not err.held:
                raise err
            grace = self.step()
            if grace is None:
                raise err
            until = until or time.monotonic() + grace + MARGIN
            if time.monotonic() > until:
                raise err  # the victims did not leave in time: wait as any held apply does
            time.sleep(TICK)

    def step(self) -> float | None:
        """One look and what it calls for: the grace to wait for victims leaving for this
        job (already preempted, or preempted now), or None (nothing will make room)."""
        ctx = self.ctx
        job, inv = ctx.inventory.job, ctx.inventory
        reports = probe(ctx, Ask(facts="none", files=False, tenancy=True), fast=True)
        now = time.time()
        by_host = {n: holders(n, r, now) for n, r in reports.ok.items()}
        listening = {n: (r.listening or [], r.listening_local or []) for n, r in reports.ok.items()}

        def place_without(held: Mapping[str, Held]) -> dict[str, int] | None:
            try:
                placement = place(inv, ctx.state.previous_placement(), held)
            except PlacementError:
                return None
            need: dict[str, int] = {}
            for t in placement.tasks:
                need[t.host.name] = need.get(t.host.name, 0) + len(t.accelerators)
            return {h: n for h, n in need.items() if n}

        gpus = {h.name: h.accelerator_count for h in inv.hosts if h.name in ctx.targets}
        seen = candidates(job, gpus, by_host, place_without, listening, now)
        if seen.need is None:
            return None
        turn, free = ctx.turn, dict(seen.free)
        # Where it goes is part of the decision (rules/preemption): any host its pools may use.
        w = Waiting(job, ctx.owner.who, turn.priority, replicas(inv, free))
        victims = decide(w, seen.running, free, ctx.policy)
        need = self._need(w, victims, seen, by_host, listening, now, place_without)
        if need is None:  # placement would not find that room: as placed with every candidate gone
            need = dict(seen.need)
            victims = decide(Waiting.placed(job, w.owner, w.priority, need), seen.running, free, ctx.policy)
        submitted = turn.submitted if turn.submitted is not None else now
        if victims and waits_behind(job, turn.priority, submitted, {h: range(n) for h, n in need.items()}, by_host):
            victims = ()  # waiting work ahead of it goes first (rules/queueorder), and preempts for itself
        if victims is None:
            self.away(reports.errors, seen.need)  # the likely why, when a host it needs did not answer
        if victims is None or (not victims and not seen.leaving):
            return None
        grace = self.preempt(victims, by_host, need)
        return grace if grace is not None or not seen.leaving else self.renew(seen.leaving, need)

    @staticmethod
    def _need(
        w: Waiting,
        victims: tuple[Victim, ...] | None,
        seen: Candidates,
        by_host: Mapping[str, list[Holder]],
        listening: Mapping[str, tuple[list[int], list[int]]],
        now: float,
        place_without: Callable[[Mapping[str, Held]], dict[str, int] | None],
    ) -> dict[str, int] | None:
        """Where the job takes GPUs once the victims (and those leaving for it) left, as the
        placement itself puts it: None when there is no decision, or when placement (first
        fit, not a search) would not find the room the decision counted on."""
        if victims is None:
            return None
        gone = {v.job for v in victims} | {j for j, _ in seen.leaving}
        return place_without(held_without(w.job, by_host, gone, listening, now))

    def away(self, errors: Mapping[str, HostError], need: Iterable[tuple[str, int]]) -> None:
        """Say (once per change) which hosts it needs did not answer: nothing is preempted
        for it until they do, and their GPUs are not given away."""
        hosts = tuple(sorted(h for h, _ in need if h in errors))
        for h in hosts if hosts != self.said_away else ():
            self.progress(
                f"{h}: cannot be reached ({errors[h].message}): nothing is preempted for this job until it answers"
            )
        self.said_away = hosts

    def preempt(
        self, victims: Iterable[Victim], by_host: Mapping[str, list[Holder]], need: dict[str, int]
    ) -> float | None:
        """Preempt each victim on every host it holds GPUs on (name order); the longest
        grace, or None when none could be preempted (another preemptor was first)."""
        longest: float | None = None
        for v in victims:
            hosts = sorted(h for h, hs in by_host.items() if any(x.job == v.job for x in hs))
            for host in hosts:
                rep = self._ask(v.job, host, need.get(host, 0))
                if rep is None:
                    continue
                if rep.refused:
                    self.progress(f"job {v.job} is being preempted by {rep.refused} already: waiting")
                    break
                hold = next(x for x in by_host[host] if x.job == v.job)
                t = Taken(v.job, v.owner, name_of(hold.priority, self.ctx.policy), host, tuple(rep.gpus), rep.grace)
                self.taken.append(t)
                self.progress(said(t) + f" ({v.why.value})")
                longest = max(longest or 0.0, rep.grace)
        return longest

    def renew(self, leaving: Iterable[tuple[str, str]], need: dict[str, int]) -> float:
        """Victims already leaving for this job (preempted by it, maybe by an earlier run of
        it): renew the mark now and then (the preemptor's heartbeat), and wait for them."""
        longest = 0.0
        for job, host in leaving:
            if time.monotonic() - self.renewed.get((job, host), -RENEW) < RENEW:
                continue
            rep = self._ask(job, host, need.get(host, 0))
            if rep is not None and not rep.refused:
                longest = max(longest, rep.grace)
        return longest

    def _ask(self, victim: str, host: str, gpus: int) -> PreemptReport | None:
        ctx = self.ctx
        turn = ctx.turn
        req = PreemptRequest(
            victim, ctx.inventory.job, ctx.owner.to_json(), turn.priority, name_of(turn.priority, ctx.policy), gpus
        )
        try:
            rep: PreemptReport = call_agent(ctx.session, ctx.targets[host], req)
        except HostError as e:  # not given away: the next look asks again
            self.progress(f"{host}: cannot preempt job {victim} there now: {e.message}")
            return None
        if rep.errors:
            self.progress(f"{host}: preempting job {victim}: {'; '.join(rep.errors)}")
        self.renewed[(victim, host)] = time.monotonic()
        return rep
