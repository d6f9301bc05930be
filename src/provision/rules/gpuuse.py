"""What the GPUs are doing (issue 41): each GPU's utilization and memory from the facts a
probe brings back (host/hostfacts.NVIDIA_SMI's answer, parsed there), a task's share of
them, and the rule that flags a GPU held but idle.

A host's answer is untrusted: numbers outside their range are dropped, not shown."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IDLE_BELOW_PCT = 5  # a held GPU below this ...
IDLE_FOR_S = 600  # ... for this long is flagged idle
MAX_MIB = 1 << 24  # 16 TiB: no GPU's memory is larger; more is a corrupt answer


@dataclass(frozen=True)
class GpuUse:
    index: int
    uuid: str
    util_pct: int | None  # None: the GPU does not say (MIG, some vGPUs)
    memory_used_mib: int | None
    memory_total_mib: int | None


def _bounded(v: Any, hi: int) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi else None


def from_facts(gpus: Iterable[Mapping[str, Any]]) -> tuple[GpuUse, ...]:
    """The `gpus` fact list (hostfacts.gpu_report) as GpuUse, by index, bad entries dropped."""
    out: dict[int, GpuUse] = {}
    for g in gpus:
        index = _bounded(g.get("index"), 1023)
        if index is None:
            continue
        uuid = g.get("uuid")
        out[index] = GpuUse(
            index,
            uuid[:80] if isinstance(uuid, str) else "",
            _bounded(g.get("util_pct"), 100),
            _bounded(g.get("memory_used_mib"), MAX_MIB),
            _bounded(g.get("memory_mib"), MAX_MIB),
        )
    return tuple(out[i] for i in sorted(out))


def task_util(use: Sequence[GpuUse], gpus: Iterable[int]) -> int | None:
    """A task's GPU utilization: the mean over the GPUs it holds that report one."""
    by = {u.index: u.util_pct for u in use}
    vals = [v for g in gpus if (v := by.get(g)) is not None]
    return round(sum(vals) / len(vals)) if vals else None


def idle_since(samples: Sequence[tuple[float, int | None]], now: float) -> float | None:
    """When a held GPU went idle, if it has been below IDLE_BELOW_PCT for IDLE_FOR_S up to
    `now`: the time of the first sample of that run; else None. `samples` are (time, util)
    oldest first; a sample without a number breaks the run (nothing is known then), and the
    samples must reach back IDLE_FOR_S (a GPU seen for 2 minutes is not idle for 10)."""
    start: float | None = None
    for t, util in samples:
        if util is not None and util < IDLE_BELOW_PCT:
            start = t if start is None else start
        else:
            start = None
    return start if start is not None and now - start >= IDLE_FOR_S else None


def line(use: Sequence[GpuUse]) -> str:
    """GPUs as `status` shows them: "0: 87% 40.0/79.6 GiB, 1: 0% ..."."""

    def gib(m: int | None) -> str:
        return "?" if m is None else f"{m / 1024:.1f}"

    return ", ".join(
        f"{u.index}: {'?' if u.util_pct is None else f'{u.util_pct}%'} "
        f"{gib(u.memory_used_mib)}/{gib(u.memory_total_mib)} GiB"
        for u in use
    )
