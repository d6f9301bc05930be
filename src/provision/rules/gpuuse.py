"""What the GPUs are doing: each GPU's utilization and memory from the facts a
probe brings back (host/hostfacts.NVIDIA_SMI's answer, parsed there), a task's share of
them, and the rule that flags a GPU held but idle.

A host's answer is untrusted: numbers outside their range are dropped, not shown."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from provision.host.protocol import ProbeReport
from provision.rules.jobsdoc import GpuAppJson, GpuUseJson
from provision.rules.status import JobStatus

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


def with_task_util(st: JobStatus, reports: Mapping[str, ProbeReport]) -> JobStatus:
    """`status` with each running task's GPU utilization, from the facts its host's probe
    brought back (None where unknown; for a task not running, its GPUs do another's work)."""
    use = {h: from_facts(_fact_gpus(r.facts)) for h, r in reports.items()}
    tasks = tuple(
        dataclasses.replace(t, gpu_util=task_util(use[t.host], t.gpus)) if t.state.live and t.host in use else t
        for t in st.tasks
    )
    return dataclasses.replace(st, tasks=tasks)


def _fact_gpus(facts: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    listed = (facts or {}).get("gpus")
    return [g for g in listed if isinstance(g, Mapping)] if isinstance(listed, list) else []


def idle_since(samples: Sequence[tuple[float, int | None]], now: float, window: float = IDLE_FOR_S) -> float | None:
    """When a held GPU went idle, if it has been below IDLE_BELOW_PCT for `window` seconds
    up to `now`: the time of the first sample of that run; else None. `samples` are (time,
    util) oldest first; a sample without a number breaks the run (nothing is known then), and
    the samples must reach back `window` (a GPU seen for 2 minutes is not idle for 10)."""
    start: float | None = None
    for t, util in samples:
        if util is not None and util < IDLE_BELOW_PCT:
            start = t if start is None else start
        else:
            start = None
    return start if start is not None and now - start >= window else None


def host_use(
    facts: Mapping[str, Any] | None, checks: Mapping[str, Any] | None, ledger: Mapping[str, Any] | None
) -> dict[str, GpuUseJson]:
    """A host's GPUs as the dashboard's `gpu_use` ({"<index>": {"utilization", "memory_mib",
    "memory_total_mib", "apps"}}) from a probe report's parts: the facts' numbers, and the
    compute processes of its GPU check, each tied to the job whose ledger entry names the
    systemd unit the process runs in (or, in a container task, its PROVISION_JOB)."""
    use = from_facts(_fact_gpus(facts))
    by_uuid = {u.uuid: u.index for u in use if u.uuid}
    unit_job = {
        unit: job
        for job, e in (ledger or {}).items()
        if isinstance(e, Mapping)
        for unit in e.get("units") or ()
        if isinstance(unit, str)
    }
    gpus = (checks or {}).get("gpus")
    listed = gpus.get("apps") if isinstance(gpus, Mapping) else None
    apps: dict[int, list[GpuAppJson]] = {}
    for a in listed if isinstance(listed, list) else ():
        index = by_uuid.get(str(a.get("gpu_uuid"))) if isinstance(a, Mapping) else None
        if index is not None:
            apps.setdefault(index, []).append(_app(a, unit_job))
    return {
        str(u.index): {
            "utilization": u.util_pct,
            "memory_mib": u.memory_used_mib,
            "memory_total_mib": u.memory_total_mib,
            "apps": apps.get(u.index, []),
        }
        for u in use
    }


def _app(a: Mapping[str, Any], unit_job: Mapping[str, str]) -> GpuAppJson:
    """A compute process as the page shows it, with the job it belongs to (None: not a job's)."""
    owner = a.get("owner")
    who: Mapping[str, Any] = owner if isinstance(owner, Mapping) else {}
    unit = who.get("unit") if isinstance(who.get("unit"), str) else None
    env_job = who.get("job") if isinstance(who.get("job"), str) else None
    name = a.get("name")
    return {
        "pid": _bounded(a.get("pid"), 1 << 31),
        "name": name[:80] if isinstance(name, str) else "",
        "used_mib": _bounded(a.get("used_mib"), MAX_MIB),
        "job": (unit_job.get(unit) if unit else None) or env_job,
        "unit": unit,
    }


def line(use: Sequence[GpuUse]) -> str:
    """GPUs as `status` shows them: "0: 87% 40.0/79.6 GiB, 1: 0% ..."."""

    def gib(m: int | None) -> str:
        return "?" if m is None else f"{m / 1024:.1f}"

    return ", ".join(
        f"{u.index}: {'?' if u.util_pct is None else f'{u.util_pct}%'} "
        f"{gib(u.memory_used_mib)}/{gib(u.memory_total_mib)} GiB"
        for u in use
    )
