"""/metrics: the dashboard's data in Prometheus' text exposition format (version 0.0.4).
Pure: built from the Source's JSON (hosts and jobs as `provision jobs --json`, studies as
`provision tune --status --json`). No secret is in these shapes, so none reaches a metric.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable, Mapping
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

HELP = {
    "provision_host_up": ("gauge", "1 when the host answered, 0 when it was unreachable."),
    "provision_gpus": ("gauge", "GPUs the inventory declares on the host."),
    "provision_gpu_held": ("gauge", "1 when a job holds the GPU."),
    "provision_gpu_utilization_percent": ("gauge", "GPU utilization as nvidia-smi reports it."),
    "provision_gpu_memory_used_mib": ("gauge", "GPU memory in use, MiB."),
    "provision_jobs": ("gauge", "Jobs on the hosts by state (running, queued, held, ended...)."),
    "provision_queue_length": ("gauge", "Applies waiting for room (apply --queue)."),
    "provision_queue_wait_seconds": ("gauge", "How long each queued apply has waited."),
    "provision_trials": ("gauge", "A study's trials by state."),
    "provision_job_goodput_ratio": ("gauge", "A watched job's share of its wall time spent progressing."),
    "provision_job_incidents": ("gauge", "A watched job's failures (its recoveries and those given up)."),
    "provision_job_lost_seconds": ("gauge", "A watched job's time lost to its failures, with the work redone."),
}


def label_value(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def sample(name: str, labels: Mapping[str, object], value: float) -> str:
    inner = ",".join(f'{k}="{label_value(v)}"' for k, v in labels.items() if v is not None)
    return f"{name}{{{inner}}} {value:g}" if inner else f"{name} {value:g}"


def _epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return float(calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def _gpu_samples(
    hosts: Mapping[str, Any], owners: Mapping[str, str | None]
) -> Iterable[tuple[str, dict[str, object], float]]:
    for name, h in sorted(hosts.items()):
        yield "provision_host_up", {"host": name}, 0.0 if h.get("error") else 1.0
        yield "provision_gpus", {"host": name}, float(h.get("gpus") or 0)
        holder = {g: job for job, held in (h.get("held") or {}).items() for g in held.get("gpus", [])}
        use = h.get("gpu_use") or {}
        for g in range(int(h.get("gpus") or 0)):
            job = holder.get(g)
            labels: dict[str, object] = {"host": name, "gpu": g, "job": job, "owner": owners.get(job) if job else None}
            yield "provision_gpu_held", labels, 1.0 if job else 0.0
            u = use.get(str(g)) or {}
            if isinstance(u.get("utilization"), int | float):
                yield "provision_gpu_utilization_percent", labels, float(u["utilization"])
            if isinstance(u.get("memory_mib"), int | float):
                yield "provision_gpu_memory_used_mib", labels, float(u["memory_mib"])


def _goodput_samples(jobs: Iterable[Mapping[str, Any]]) -> Iterable[tuple[str, dict[str, object], float]]:
    """A watched job's goodput (core/recovery.goodput, as the service's rounds put it)."""
    for j in jobs:
        g = j.get("goodput")
        if isinstance(g, dict) and isinstance(g.get("ratio"), int | float):
            labels: dict[str, object] = {"job": j["job"], "owner": j.get("owner")}
            yield "provision_job_goodput_ratio", labels, float(g["ratio"])
            yield "provision_job_incidents", labels, float(len(g.get("incidents") or []))
            yield "provision_job_lost_seconds", labels, float(g.get("lost_seconds") or 0)


def exposition(jobs_doc: Mapping[str, Any], studies: Mapping[str, Mapping[str, Any]], now: float) -> str:
    """jobs_doc: `provision jobs --json`; studies: name -> its study document."""
    jobs = jobs_doc.get("jobs") or []
    owners = {j["job"]: j.get("owner") for j in jobs}
    out: dict[str, list[str]] = {k: [] for k in HELP}
    for name, labels, value in _gpu_samples(jobs_doc.get("hosts") or {}, owners):
        out[name].append(sample(name, labels, value))
    by_state: dict[str, int] = {}
    for j in jobs:
        by_state[j["state"]] = by_state.get(j["state"], 0) + 1
    for state, n in sorted(by_state.items()):
        out["provision_jobs"].append(sample("provision_jobs", {"state": state}, n))
    for name, labels, value in _goodput_samples(jobs):
        out[name].append(sample(name, labels, value))
    queued = [j for j in jobs if j.get("queued")]
    out["provision_queue_length"].append(sample("provision_queue_length", {}, len(queued)))
    for j in queued:
        since = _epoch(j["queued"].get("since"))
        if since is not None:
            labels = {"job": j["job"], "owner": j.get("owner")}
            out["provision_queue_wait_seconds"].append(
                sample("provision_queue_wait_seconds", labels, max(0.0, now - since))
            )
    for study, doc in sorted(studies.items()):
        for state, n in (doc.get("counts") or {}).items():
            out["provision_trials"].append(sample("provision_trials", {"study": study, "state": state}, n))
    lines = []
    for name, (kind, text) in HELP.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *out[name]]
    return "\n".join(lines) + "\n"
