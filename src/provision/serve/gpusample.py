"""What the GPUs did, over time: the service samples every host it watches every
SAMPLE_EVERY seconds (the dashboard's one probe round trip per host, all hosts in parallel:
web/inventories.py), keeps the samples an hour in its database (io/servicestore.py), and
answers the Cluster page's history, the Usage page's idle GPUs and /metrics from them.

The functions are pure (samples in, the pages' JSON out); serve/rounds.py is the loop.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from provision.io.servicehistory import GpuSample
from provision.rules.gpuuse import IDLE_FOR_S, idle_since
from provision.rules.jobsdoc import GpuHistoryJson
from provision.rules.usage import IdleGpu

SAMPLE_EVERY = 10.0  # seconds between rounds while someone looks or something changes (at most 10 s)
# ... and while nobody does: a round per host costs the service ~10 ms of CPU (paramiko), so
# 128 hosts every 10 s would be 13 % of a core for samples nobody reads (< 5 %).
QUIET_EVERY = 60.0
# ... and while a GPU is held at that pace: a fatal Xid read at a round, acted on in it, must be
# told within 10 s of the kernel's line, so the wait for the next round (up to a period) and the
# round's own time (the probe of every host, the health keeper's one call to the host) fit.
HELD_EVERY = 5.0
LOOKING_S = 120.0  # seconds after a page (or /metrics) read the samples that it counts as looked at
HISTORY_POINTS = 120  # a GPU's last hour as the Cluster page draws it: a point per round while it has
# this many samples or fewer (a fresh service draws at once), a point per few rounds beyond.
# ... and fewer for a large cluster: the hosts' document carries at most about this many
# points in all (8,000 GPUs x 120 points was 20 MB of JSON every 10 s), 12 a GPU at least.
HISTORY_BUDGET = 32_000
HISTORY_FEWEST = 12
# A test knob, not a setting: the Usage page's idle window in seconds (default: the rule's 10 minutes),
# so a browser test sees a GPU flagged idle in seconds. docs/dashboard.md names it.
IDLE_WINDOW_ENV = "PROVISION_TEST_IDLE_WINDOW_S"


def idle_window() -> float:
    raw = os.environ.get(IDLE_WINDOW_ENV, "").strip()
    try:
        return max(1.0, float(raw)) if raw else float(IDLE_FOR_S)
    except ValueError:
        return float(IDLE_FOR_S)


def samples_of(doc: Mapping[str, Any], t: float) -> list[GpuSample]:
    """One round's samples from the hosts' document (`provision jobs --json` with `gpu_use`):
    every GPU of every host that answered, with the job holding it and its owner."""
    owners = {j["job"]: j.get("owner") for j in doc.get("jobs") or []}
    out = []
    for name, h in sorted((doc.get("hosts") or {}).items()):
        if h.get("error"):
            continue
        holder = {g: job for job, held in (h.get("held") or {}).items() for g in held.get("gpus", [])}
        for index, u in sorted((h.get("gpu_use") or {}).items(), key=lambda kv: int(kv[0])):
            job = holder.get(int(index))
            out.append(
                GpuSample(
                    name,
                    int(index),
                    t,
                    u.get("utilization"),
                    u.get("memory_mib"),
                    u.get("memory_total_mib"),
                    job,
                    owners.get(job) if job else None,
                )
            )
    return out


def history_step(samples: int, gpus: int) -> float | None:
    """Seconds a history point averages when each GPU has `samples` samples in the hour and
    the cluster `gpus` GPUs: None (a point per sample: one per round) while the samples fit
    the points a GPU gets (HISTORY_POINTS; fewer past HISTORY_BUDGET in all, HISTORY_FEWEST
    at least), else as many whole rounds a point as keep them within it."""
    most = max(HISTORY_FEWEST, min(HISTORY_POINTS, HISTORY_BUDGET // max(1, gpus)))
    # An hour holds a round more now and then (rounds a little over 10 s apart, the oldest
    # dropped at the next): the same step for both, not a new history every other round.
    samples = min(samples, int(3600 // SAMPLE_EVERY))
    if samples <= most:
        return None
    return SAMPLE_EVERY * -(-samples // most)


Bucket = tuple[float, float, float, int]  # a point's (slot, sum of t, sum of utilization, samples)
GpuHistoryRow = tuple[str, int, float, float, float, int]  # ServiceStore.gpu_history's (host, gpu, slot, t, util, n)


def _point(t: float, util: float) -> tuple[float, float]:
    # Whole seconds and tenths of a percent (the hosts' JSON of 8,000 GPUs is megabytes); a
    # tuple (JSON's array all the same): 850,000 points of 1,000 hosts x 8 GPUs, 16 bytes less each.
    return (round(t), round(util, 1))


Point = tuple[float, float]


class _Shared:
    """One tuple for each point of equal time and utilization: a round's GPUs share its time,
    and many their utilization (idle, full), so 8,000 GPUs' hour held ~220,000 tuples and
    their numbers apart (24 MiB) where a few thousand do. Equal is also of one type (a
    sample's 50 stays 50, an average's 50.0 stays 50.0: the JSON says what it said)."""

    def __init__(self) -> None:
        self._of: dict[tuple[float, float, bool], Point] = {}

    def __call__(self, t: float, util: float) -> Point:
        p = _point(t, util)
        return self._of.setdefault((p[0], p[1], isinstance(p[1], float)), p)

    def forget_before(self, t: float) -> None:
        """Points older than `t` are no GPU's any more (a later equal point is a tuple anew)."""
        self._of = {k: v for k, v in self._of.items() if k[0] >= t}


class GpuHistory:
    """Each GPU's last hour as the pages draw it (`doc`: host -> {"<gpu>": [[t, utilization
    %], ...]}, the hosts' `gpu_history`), from the database's points (history_step's slots),
    then kept round by round: a round's samples join each GPU's last point or start one,
    and the points whose slot ended over an hour ago go. Made again from the database each
    round instead, 8,000 GPUs' points held the GIL ~0.5 s a round (every page's p95). `doc`
    is a new dict each round and a GPU's list of points a new list when it changed: a page
    reading the last one is never changed under it."""

    def __init__(self, step: float | None, rows: Iterable[GpuHistoryRow], rounds: Iterable[float]):
        self.step = step
        self.rounds = sorted(rounds)  # when the hour's rounds were (history_step counts them)
        self._last: dict[tuple[str, int], Bucket] = {}  # each GPU's last point's sums (only it changes)
        self._points: dict[tuple[str, int], list[Point]] = {}
        self._shared = _Shared()
        for host, gpu, slot, t, util, n in rows:
            self._last[(host, gpu)] = (slot, t * n, util * n, n)
            self._points.setdefault((host, gpu), []).append(self._shared(t, util))
        self.doc = self._publish()

    def rounds_after(self, since: float) -> int:
        """How many rounds the hour from `since` holds with the round being added."""
        return sum(1 for r in self.rounds if r >= since) + 1

    def add(self, samples: Sequence[GpuSample], since: float) -> None:
        """A round's samples (all of one time), and the hour now from `since`."""
        self.rounds = [r for r in self.rounds if r >= since] + [s.t for s in samples[:1]]
        got = {(s.host, s.gpu): s for s in samples if s.util is not None}
        for key in self._points.keys() | got.keys():
            p = self._points.get(key, [])
            drop = 0
            while drop < len(p) and self._ended(p[drop][0], since):
                drop += 1
            s = got.get(key)
            if not drop and s is None:
                continue
            p = p[drop:]  # a new list: the published one stays as it was
            if s is not None and s.util is not None:
                slot = s.t if self.step is None else float(s.t // self.step)
                last = self._last.get(key) if self.step is not None and p else None
                if last is None or last[0] != slot:  # a new point (always, a point a round)
                    self._last[key] = (slot, s.t, float(s.util), 1)
                    p.append(self._shared(s.t, s.util))
                else:
                    n = last[3] + 1
                    self._last[key] = (slot, last[1] + s.t, last[2] + s.util, n)
                    p[-1] = self._shared((last[1] + s.t) / n, (last[2] + s.util) / n)
            if p:
                self._points[key] = p
            else:
                self._points.pop(key, None)
                self._last.pop(key, None)
        # A live point's time is within its slot, which ends after `since`.
        self._shared.forget_before(since - (self.step or 0.0) - 1)
        self.doc = self._publish()

    def _ended(self, t: float, since: float) -> bool:
        """Whether the point at `t` (in its slot: an average of its samples' times) ended before `since`."""
        return t < since if self.step is None else (t // self.step + 1) * self.step <= since

    def _publish(self) -> dict[str, GpuHistoryJson]:
        out: dict[str, GpuHistoryJson] = {}
        for (host, gpu), points in sorted(self._points.items()):
            out.setdefault(host, {})[str(gpu)] = points
        return out


def idle_json(samples: Sequence[GpuSample], now: float, window: float) -> list[IdleGpu]:
    """GPUs held by a job and below 5 % for `window` seconds up to the latest sample, with the
    job and owner (the Usage page's list). Only the samples under the current holder count:
    a GPU that just changed hands has not been idle for its new job."""
    by_gpu: dict[tuple[str, int], list[GpuSample]] = {}
    for s in samples:
        by_gpu.setdefault((s.host, s.gpu), []).append(s)
    out: list[IdleGpu] = []
    for (host, gpu), got in sorted(by_gpu.items()):
        got.sort(key=lambda s: s.t)
        last = got[-1]
        if last.job is None:
            continue
        run = [(s.t, s.util) for s in got if s.job == last.job]
        since = idle_since(run, now, window)
        if since is not None:
            minutes = int((now - since) // 60)
            out.append({"host": host, "gpu": gpu, "job": last.job, "owner": last.owner, "idle_minutes": minutes})
    return out


def idle_of(runs: Iterable[tuple[str, int, str, str | None, float]], now: float, window: float) -> list[IdleGpu]:
    """idle_json's list from each candidate's run below 5 % (ServiceStore.gpu_idle_runs:
    host, gpu, job, owner, when the run began): those idle for `window` seconds by now."""
    return [
        {"host": host, "gpu": gpu, "job": job, "owner": owner, "idle_minutes": int((now - since) // 60)}
        for host, gpu, job, owner, since in sorted(runs)
        if now - since >= window
    ]


def round_every(looked_ago: float, busy: bool, held: bool = False) -> float:
    """Seconds from one round to the next: SAMPLE_EVERY while pages read the samples or the
    last round saw work that changes (a job not simply running: ending, preempted, new to
    the watch), HELD_EVERY then if a job holds a GPU, QUIET_EVERY otherwise (the pages probe
    for themselves when they come)."""
    if busy or looked_ago < LOOKING_S:
        return HELD_EVERY if held else SAMPLE_EVERY
    return QUIET_EVERY


def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to give back this way
        return None


_TRIM = _libc_trim()
M_ARENA_MAX = -8  # glibc's mallopt parameters
M_MMAP_THRESHOLD = -3
# A block this large or larger is mapped on its own and unmapped when freed. glibc's own
# threshold grows with each such block freed (to 32 MiB), after which a page's megabytes
# of JSON, a round's documents and the database's results were carved out of the heap and
# left it in pieces, resident; a fixed one also stops glibc's adjusting.
MMAP_AT = 256 << 10


def few_arenas(n: int = 2) -> None:
    """At most n malloc arenas for the service's threads (glibc makes up to 8 a core, each
    holding its own freed memory: the rounds', the deliveries' and the pages' threads kept
    tens of MiB resident apart), and large blocks mapped apart (MMAP_AT). Called before the
    threads start."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_ARENA_MAX, n)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_AT)
    except (OSError, AttributeError):
        pass


def give_back_memory() -> None:
    """The heap a round freed, given back to the system (glibc's malloc_trim): a round's
    documents of 8,000 GPUs left tens of MiB free but resident (the service's memory
    <= 300 MiB). A few ms."""
    if _TRIM is not None:
        _TRIM(0)
