"""The bisection that finds a slow host between hosts (pure), fed with each round's figures.

Round 1 is the ring of every host (the job-wide figure). Each next round splits every group
of the round before into halves and measures every half's ring at once, down to pairs:
ceil(log2 N) rounds, every host in every round. A slow half is seen next to its fine
sibling; its pair is slow next to the fine pairs. One last round then pairs each host of a
slow pair with a known-good host (one of a fine pair), and each host no pair held yet (an
odd split's leftover) with another: a host still slow with a known-good one is the slow
host; a slow pair whose hosts are each fine with another is a slow link. At most
ceil(log2 N) + 1 rounds.

A figure is slow below SLOW of its reference: its peers' (the figures of its kind measured
in its round: on a fabric as loaded), the median of those not slow against it (the median
taken again without the slow ones: slow groups up to half of them never drag the reference
down, and a fast outlier moves it little); with fewer than two peers, the
baseline of the hosts' class (its pairs' figure for a pair, its job-wide figure for a ring
of as many hosts). Each figure is also held against that baseline on its own (`below`): a
fabric slower everywhere than it was is no one host's fault, and says so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from provision.rules.fabric import SLOW, Baseline, Figure, Judged


def levels(hosts: Sequence[str]) -> list[list[tuple[str, ...]]]:
    """The rounds of rings: every host, then every group halved (the first half the
    larger), down to pairs; a host left alone by an odd split waits for the last round."""
    out: list[list[tuple[str, ...]]] = []
    groups = [tuple(hosts)]
    while any(len(g) >= 2 for g in groups):
        out.append([g for g in groups if len(g) >= 2])
        nxt: list[tuple[str, ...]] = []
        for g in groups:
            if len(g) > 2:
                half = (len(g) + 1) // 2
                nxt += [g[:half], g[half:]]
        groups = nxt
    return out


def max_rounds(n: int) -> int:
    return math.ceil(math.log2(n)) + 1 if n >= 2 else 0


def reference_of(values: Sequence[float]) -> float | None:
    """The median of the figures that are not slow against it: the median, taken again
    without those below SLOW of it until none is left out (None for fewer than two figures:
    nothing to compare). One fast outlier moves it little; slow groups up to half of them
    do not drag it down."""
    if len(values) < 2:
        return None
    ref = statistics.median(values)
    while True:
        rest = [v for v in values if v >= SLOW * ref]  # never empty: the largest stays
        again = statistics.median(rest)
        if again == ref:
            return ref
        ref = again


def judge_one(f: Figure, baseline: Baseline | None, peers: Sequence[Figure]) -> Judged:
    """Slow against its peers (one slow host is an outlier among them), or against the
    baseline when it has fewer than two; below the baseline or not, apart."""
    base = None
    if baseline is not None:  # a ring's figure is compared with one of as many hosts only
        base = baseline.pair if len(f.hosts) == 2 else baseline.ring if len(f.hosts) == baseline.ring_hosts else None
    ref = reference_of([p.gbps for p in peers if p.gbps is not None and not p.at_most])
    against = "peers"
    if ref is None and base is not None:
        ref, against = base, "baseline"
    slow = f.gbps is not None and ref is not None and f.gbps < SLOW * ref
    below = f.gbps is not None and base is not None and f.gbps < SLOW * base
    return Judged(f, ref, slow, against if ref is not None else "", base, below)


@dataclass(frozen=True)
class Verdict:
    slow: list[str]  # hosts slow with a known-good host (or with two others)
    cleared: list[str]  # hosts of a slow pair fine with another host
    untested: list[str]  # hosts of a slow pair that nothing tells apart
    links: list[tuple[str, str]]  # slow pairs whose hosts were each fine with another


def pair_verdict(pairs: Sequence[Judged]) -> Verdict:
    """Who is slow, from every pair judged: a host in no fine pair is slow when a slow pair
    of it holds a known-good host (one of a fine pair), or it was slow with two others."""
    fine = {h for j in pairs if j.figure.gbps is not None and not j.slow for h in j.figure.hosts}
    slow_pairs = [j.figure.hosts for j in pairs if j.slow]
    order = list(dict.fromkeys(h for p in slow_pairs for h in p))
    slow = []
    for h in order:
        partners = {x for p in slow_pairs if h in p for x in p if x != h}
        if h not in fine and (partners & fine or len(partners) >= 2):
            slow.append(h)
    untested = [
        h
        for h in order
        if h not in fine and h not in slow and any(x not in slow for p in slow_pairs if h in p for x in p if x != h)
    ]
    cleared = [h for h in order if h in fine]
    links = [(p[0], p[1]) for p in slow_pairs if p[0] in fine and p[1] in fine]
    return Verdict(slow, cleared, untested, links)


def final_pairs(bad: Sequence[str], good: Sequence[str], alone: Sequence[str]) -> list[tuple[str, str]]:
    """The last round, the host under test first: each suspect with a known-good host, a
    suspect left over with a host no pair held, then those left with known-good ones."""
    partners = [g for g in good if g not in alone and g not in bad]
    pairs = list(zip(bad, partners))
    left_bad = list(bad[len(pairs) :])
    rest = partners[len(pairs) :]
    alone = list(alone)
    while left_bad and alone:
        pairs.append((left_bad.pop(0), alone.pop(0)))
    pairs += list(zip(alone, rest))
    return pairs


class Bisection:
    """The rounds as a value: `next()` says what the next round measures (its kind, "rings"
    or "pairs", and its groups) until there is nothing left to measure; `record()` takes
    its figures and the hosts that did not answer (they take no part after)."""

    def __init__(self, hosts: Sequence[str], baseline: Baseline | None):
        self.hosts = tuple(hosts)
        self.baseline = baseline
        self.rounds: list[tuple[str, list[Figure]]] = []
        self.gone: set[str] = set()
        self._levels = levels(self.hosts)
        self._finished = False

    def judged(self) -> list[list[Judged]]:
        """Every round's figures, each judged against its round's figures of its kind
        (measured at the same time, on a fabric as loaded). A round of fewer than two pairs
        has its pairs judged against the baseline, or without one against the other such
        rounds' pairs and every pair found fine in a fuller round."""

        def measured(figs: list[Figure]) -> list[Figure]:
            return [f for f in figs if len(f.hosts) == 2 and f.gbps is not None]

        full: dict[Figure, Judged] = {}
        for _, figs in self.rounds:
            if len(measured(figs)) >= 2:
                full.update((f, judge_one(f, self.baseline, measured(figs))) for f in measured(figs))
        fine = [f for f, j in full.items() if j.reference is not None and not j.slow]
        thin = [f for _, figs in self.rounds if len(measured(figs)) < 2 for f in measured(figs)]
        out = []
        for _, figs in self.rounds:
            rings = [f for f in figs if len(f.hosts) > 2]
            judged = []
            for f in figs:
                if len(f.hosts) > 2:
                    judged.append(judge_one(f, self.baseline, rings))
                elif f in full:
                    judged.append(full[f])
                else:
                    judged.append(judge_one(f, self.baseline, [] if self.baseline else thin + fine))
            out.append(judged)
        return out

    def pairs(self) -> list[Judged]:
        return [j for js in self.judged() for j in js if len(j.figure.hosts) == 2]

    def next(self) -> tuple[str, list[tuple[str, ...]]] | None:
        while self._levels:
            level = self._levels.pop(0)
            groups = [g for g in (tuple(h for h in grp if h not in self.gone) for grp in level) if len(g) >= 2]
            if groups:
                return "rings", groups
        if self._finished:
            return None
        self._finished = True
        pairs = self.pairs()
        fine = [j for j in pairs if j.figure.gbps is not None and not j.slow]
        fine.sort(key=lambda j: -(j.share or 0.0))  # the best evidenced first (unjudged ones last)
        good = [h for j in fine for h in j.figure.hosts if h not in self.gone]
        bad = [h for j in pairs if j.slow for h in j.figure.hosts if h not in self.gone and h not in good]
        held = {h for j in pairs if j.figure.gbps is not None for h in j.figure.hosts}
        alone = [h for h in self.hosts if h not in held and h not in self.gone]
        chosen = final_pairs(list(dict.fromkeys(bad)), list(dict.fromkeys(good)), alone)
        return ("pairs", [tuple(p) for p in chosen]) if chosen else None

    def record(self, figures: Sequence[Figure], gone: Iterable[str] = ()) -> None:
        self.gone |= set(gone)
        self.rounds.append(("pairs" if self._finished else "rings", list(figures)))

    def verdict(self) -> Verdict:
        return pair_verdict(self.pairs())
