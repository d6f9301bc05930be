"""What the GPUs did, over time (issue 41): the service samples every host it watches every
SAMPLE_EVERY seconds (the dashboard's one probe round trip per host, all hosts in parallel:
web/inventories.py), keeps the samples an hour in its database (io/servicestore.py), and
answers the Cluster page's history, the Usage page's idle GPUs and /metrics from them.

The functions are pure (samples in, the pages' JSON out); `Sampler` is the loop.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from provision.core.errors import ProvisionError
from provision.io.servicestore import GpuSample
from provision.rules.gpuuse import IDLE_FOR_S, idle_since

SAMPLE_EVERY = 10.0  # seconds between rounds while someone looks or something changes (issue 41: at most 10 s)
# ... and while nobody does: a round per host costs the service ~10 ms of CPU (paramiko), so
# 128 hosts every 10 s would be 13 % of a core for samples nobody reads (issue 40: < 5 %).
QUIET_EVERY = 60.0
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


def history_json(samples: Iterable[GpuSample], most: int = HISTORY_POINTS) -> dict[str, dict[str, list[list[float]]]]:
    """host -> {"<gpu>": [[t, utilization %], ...]} (the hosts' `gpu_history`), oldest first,
    at most `most` points a GPU (runs of consecutive samples averaged: a page of many GPUs
    stays small); samples without a number are left out (nothing to draw there)."""
    out: dict[str, dict[str, list[list[float]]]] = {}
    for s in samples:
        if s.util is not None:
            out.setdefault(s.host, {}).setdefault(str(s.gpu), []).append([s.t, float(s.util)])
    for gpus in out.values():
        for g, points in gpus.items():
            if len(points) > most:
                k = -(-len(points) // most)
                runs = [points[i : i + k] for i in range(0, len(points), k)]
                gpus[g] = [[sum(p[0] for p in r) / len(r), sum(p[1] for p in r) / len(r)] for r in runs]
    return out


def history_step(samples: int, gpus: int) -> float | None:
    """Seconds a history point averages when each GPU has `samples` samples in the hour and
    the cluster `gpus` GPUs: None (a point per sample: one per round) while the samples fit
    the points a GPU gets (HISTORY_POINTS; fewer past HISTORY_BUDGET in all, HISTORY_FEWEST
    at least), else as many whole rounds a point as keep them within it."""
    most = max(HISTORY_FEWEST, min(HISTORY_POINTS, HISTORY_BUDGET // max(1, gpus)))
    if samples <= most:
        return None
    return SAMPLE_EVERY * -(-samples // most)


def history_of(rows: Iterable[tuple[str, int, float, float]]) -> dict[str, dict[str, list[list[float]]]]:
    """history_json's shape from points averaged already (ServiceStore.gpu_history), in order;
    whole seconds and tenths of a percent (the hosts' JSON of 8,000 GPUs is megabytes)."""
    out: dict[str, dict[str, list[list[float]]]] = {}
    for host, gpu, t, util in rows:
        out.setdefault(host, {}).setdefault(str(gpu), []).append([round(t), round(util, 1)])
    return out


def idle_json(samples: Sequence[GpuSample], now: float, window: float) -> list[dict[str, Any]]:
    """GPUs held by a job and below 5 % for `window` seconds up to the latest sample, with the
    job and owner (the Usage page's list). Only the samples under the current holder count:
    a GPU that just changed hands has not been idle for its new job."""
    by_gpu: dict[tuple[str, int], list[GpuSample]] = {}
    for s in samples:
        by_gpu.setdefault((s.host, s.gpu), []).append(s)
    out = []
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


def round_every(looked_ago: float, busy: bool) -> float:
    """Seconds from one round to the next: SAMPLE_EVERY while pages read the samples or the
    last round saw work that changes (a job not simply running: ending, preempted, new to
    the watch), QUIET_EVERY otherwise (the pages probe for themselves when they come)."""
    return SAMPLE_EVERY if busy or looked_ago < LOOKING_S else QUIET_EVERY


class Sampler:
    """A round every `every()` seconds while `leading()` (one service samples a team's
    hosts): `sample()` (ServiceSource.sample: probe, store). A round that fails (the
    database or a host away) is said and the next one comes as usual. The period is asked
    again every second: a page opened during a quiet minute gets its rounds at once."""

    def __init__(
        self,
        sample: Callable[[], int],
        leading: Callable[[], bool],
        say: Callable[[str], None],
        every: Callable[[], float] = lambda: SAMPLE_EVERY,
    ):
        self.sample, self.leading, self.say, self.every = sample, leading, say, every
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="gpu-sampler", daemon=True)
        self._failing = False

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)

    def run(self) -> None:
        last = -math.inf
        while not self.stopping.is_set():
            if not self.leading():  # a follower: look again soon (it may lead in a moment)
                last = -math.inf
                self.stopping.wait(1.0)
                continue
            due = last + self.every() - time.monotonic()
            if due > 0:
                self.stopping.wait(min(1.0, due))
                continue
            last = time.monotonic()
            self.round()

    def round(self) -> None:
        try:
            self.sample()
        except Exception as e:  # the database away, an inventory unreadable: say it once, sample again next round
            if not self._failing:
                why = e.message if isinstance(e, ProvisionError) else f"{type(e).__name__}: {e}"
                self.say(f"GPU samples not stored: {why}")
            self._failing = True
            return
        if self._failing:
            self.say("GPU samples stored again")
        self._failing = False
