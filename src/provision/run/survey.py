"""A survey: every host of a set of inventories asked once (one tenancy probe round trip each,
all at once, each host once whatever inventories name it), as `provision jobs --json` asks:
the service's rounds (serve/rounds.py) and the dashboard's own look at the hosts
(web/inventories.py) are both one.

`Inventories` reads the files, again only when one changed (the service asks for a hundred
handed-over snapshots every round); `KeptContexts` keeps each inventory's Context while its
file is unchanged (a round opens no state and renders nothing).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager

from provision.core.model import Inventory
from provision.core.recovery import goodput
from provision.core.target import HostError
from provision.host.protocol import ProbeReport
from provision.inventory.inventory import load
from provision.io.steps import GroupResult
from provision.rules.gpuuse import host_use
from provision.rules.jobsdoc import GpuUseJson, JobsDoc
from provision.rules.priority import Policy
from provision.rules.progress import Seen as ProgressSeen
from provision.rules.progress import Watched, watched
from provision.rules.progress import seen as progress_seen
from provision.rules.rounds import HostSeen, JobWatch, Round, host_seen, unreachable
from provision.rules.tenancy import jobs_json
from provision.run.context import Ask, Context, open_context, probe

Stamp = tuple[int, int, int] | None  # a file's (mtime_ns, size, inode); None: it cannot be read
Found = Mapping[str, tuple[str, Inventory]]  # job -> (its file, the inventory)
# A Context for one inventory (job, file) for the length of a with block.
Contexts = Callable[[str, str], AbstractContextManager[Context]]

# What a survey asks each host: the ledger (who holds what), what its GPUs do, their
# health (rules/health.py), and who is logged in to its dev sessions.
# A bench knob, not a setting: PROVISION_BENCH_NO_HEALTH=1 leaves the health read out (what
# the read costs the idle service, measured with it and without; docs/health.md names it).
SURVEY_ASK = Ask(
    facts="check",
    files=False,
    tenancy=True,
    gpu_apps=True,
    health=os.environ.get("PROVISION_BENCH_NO_HEALTH") != "1",
    logins=True,
)


def stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Inventories:
    """The inventories at `paths` (settable), each read again only when its file changed.
    Thread-safe: the rounds, the pages and the service's loop read at once."""

    def __init__(self, paths: Sequence[str] = ()):
        self.paths = [str(p) for p in paths]
        self._loaded: dict[str, tuple[Stamp, Inventory]] = {}
        self.lock = threading.RLock()

    def read(self) -> dict[str, tuple[str, Inventory]]:
        """job -> (its file, the inventory); the first file of a job wins."""
        with self.lock:
            out: dict[str, tuple[str, Inventory]] = {}
            for p in self.paths:
                now = stamp(p)
                got = self._loaded.get(p)
                if got is None or now is None or got[0] != now:
                    got = (now, load(p))
                    self._loaded[p] = got
                out.setdefault(got[1].job, (p, got[1]))
            for gone in set(self._loaded) - set(self.paths):
                del self._loaded[gone]
            return out

    def stamp_of(self, path: str) -> Stamp:
        got = self._loaded.get(path)
        return got[0] if got is not None else None


class KeptContexts:
    """Each inventory's Context, kept while its file is unchanged (for one thread: the
    rounds'), closed when the file changes or leaves."""

    def __init__(self, invs: Inventories):
        self.invs = invs
        self._kept: dict[str, tuple[Stamp, Context]] = {}
        self._stale: set[str] = set()  # paths whose Context is opened again at its next use

    @contextmanager
    def __call__(self, job: str, path: str) -> Iterator[Context]:
        now = self.invs.stamp_of(path)
        got = self._kept.get(path)
        stale = path in self._stale
        self._stale.discard(path)
        if got is None or got[0] != now or now is None or stale:
            if got is not None:
                got[1].close()
            got = (now, open_context(path, render_secrets=False))
            self._kept[path] = got
        for gone in set(self._kept) - set(self.invs.paths):
            self._kept.pop(gone)[1].close()
        yield got[1]

    def forget(self, path: str) -> None:
        """Open the inventory's Context again at its next use: its state changed (a
        recovery moved its tasks). From any thread: the rounds' own thread closes it."""
        self._stale.add(path)

    def close(self) -> None:
        for _, ctx in self._kept.values():
            ctx.close()
        self._kept.clear()


def survey(found: Found, contexts: Contexts, number: int = 0) -> Round:
    """Every host of `found` asked once (all at once), as one Round."""
    began = time.time()
    mine: dict[str, set[str]] = {}  # job -> the hosts its probe asks: each host once
    seen: set[str] = set()
    for job, (_, inv) in found.items():
        mine[job] = {h.name for h in inv.hosts} - seen
        seen |= mine[job]
    asked = [(job, *found[job]) for job, names in mine.items() if names]
    watch = _watched(found, contexts)
    more = _paths_by_host(watch)

    def one(a: tuple[str, str, Inventory]) -> tuple[GroupResult[ProbeReport], Policy | None]:
        with contexts(a[0], a[1]) as ctx:
            return probe(ctx, SURVEY_ASK, fast=True, only=mine[a[0]], more=more), ctx.policy

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(asked)))) as pool:
        got = list(pool.map(one, asked))
    policy = next((p for _, p in got if p is not None), None)  # the priorities' names (one team, one policy)
    hosts: dict[str, HostSeen] = {}
    extra: dict[str, tuple[dict[str, str], bool, dict[str, GpuUseJson] | None]] = {}
    for (job, _, inv), (res, _) in zip(asked, got, strict=True):
        for h in inv.hosts:
            if h.name not in mine[job]:
                continue
            r = res.get(h.name)
            if isinstance(r, ProbeReport):
                team = policy or Policy()
                hosts[h.name] = host_seen(h.name, h.accelerator_count, r, began, job, team.health, inv.outputs)
            else:
                why = r.message if isinstance(r, HostError) else "not asked"
                hosts[h.name] = unreachable(h.name, h.accelerator_count, why)
            use = host_use(r.facts, r.checks, r.ledger) if isinstance(r, ProbeReport) else None
            extra[h.name] = (h.label_map, h.drain, use)
    reports = {n: r for res, _ in got for n, r in res.ok.items()}
    doc = jobs_json([hs.view for hs in hosts.values()], began, policy)
    for name, (labels, drain, use) in extra.items():
        host = doc["hosts"][name]
        host["labels"], host["drain"] = labels, drain
        if use is not None:
            host["gpu_use"] = use
    _with_goodput(doc, {j: w for j, (_, w) in watch.items()}, hosts, began)
    return Round(
        number,
        began,
        hosts,
        doc,
        studies=frozenset(j for j, (_, inv) in found.items() if inv.tune is not None),
        success={j: inv.success for j, (_, inv) in found.items()},
        jobs={j: frozenset(h.name for h in inv.hosts) for j, (_, inv) in found.items()},
        demand={j: demand_of(inv) for j, (_, inv) in found.items()},
        watch={j: dataclasses.replace(w, seen=progress_seen(paths, reports, began)) for j, (paths, w) in watch.items()},
        policy=policy,
    )


Paths = dict[str, list[Watched]]  # host -> what shows a job's progress there


def _with_goodput(doc: JobsDoc, watch: Mapping[str, JobWatch], hosts: Mapping[str, HostSeen], now: float) -> None:
    """A watched job's goodput (core/recovery.goodput) in its row: the pages, /metrics."""
    for j in doc["jobs"]:
        w = watch.get(j["job"])
        if w is not None:
            starts = [t for h in set(w.tasks.values()) if h in hosts and (t := hosts[h].run_started(j["job"]))]
            if (g := goodput(w.record, max(starts) if starts else None, now)) is not None:
                j["goodput"] = g


def _watched(found: Found, contexts: Contexts) -> dict[str, tuple[Paths, JobWatch]]:
    """The jobs watched for progress or recovered: what the probe stats for each on its
    hosts, and the job as the round carries it (its placement as its state has it now)."""
    out: dict[str, tuple[Paths, JobWatch]] = {}
    for job, (path, inv) in found.items():
        if inv.progress is None and inv.recovery is None:
            continue
        with contexts(job, path) as ctx:
            placement = ctx.rendered.placement
            paths = {h: watched(ctx.inventory, [t.name for t in placement.on_host(h)]) for h in placement_hosts(ctx)}
            tasks = {t.name: t.host.name for t in placement.tasks}
            record = ctx.state.recovery
        out[job] = (
            {h: ws for h, ws in paths.items() if ws},
            JobWatch(
                path,
                inv.progress,
                inv.recovery,
                tasks,
                ProgressSeen(),
                record.aside,
                record,
                elastic=_elastic(inv),
                checkpoint=inv.checkpoint,
            ),  # fmt: skip
        )
    return out


def _elastic(inv: Inventory) -> str:
    return next((p.role for p in inv.pools if p.elastic is not None), "")


def _paths_by_host(watch: Mapping[str, tuple[Paths, JobWatch]]) -> dict[str, set[str]]:
    """host -> every watched job's progress paths there (one probe asks for them all)."""
    more: dict[str, set[str]] = {}
    for paths, _ in watch.values():
        for host, ws in paths.items():
            more.setdefault(host, set()).update(w.path for w in ws)
    return more


def placement_hosts(ctx: Context) -> list[str]:
    return sorted({t.host.name for t in ctx.rendered.placement.tasks})


def demand_of(inv: Inventory) -> tuple[tuple[int, frozenset[str]], ...]:
    """Each replica's GPUs and the hosts it may run on (a replica is never split)."""
    return tuple(
        (pool.accelerators, frozenset(h.name for h in inv.hosts if pool.eligible(h) and not h.drain))
        for pool in inv.pools
        for _ in range(pool.replicas)
    )
