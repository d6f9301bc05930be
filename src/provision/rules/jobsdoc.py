"""`provision jobs --json` as typed documents: the hosts' document (JobsDoc) that
rules/tenancy.jobs_json writes and the CLI, the dashboard and the service pass around."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from provision.core.recovery import GoodputJson
from provision.rules.health import HealthSummary

JOBS_FORMAT_VERSION = 1


class QueuedJson(TypedDict):
    since: str | None
    waiting_for: str


class JobHostJson(TypedDict):
    state: str
    gpus: list[int]
    ports: list[int]
    preempted_by: str | None  # its entry there is marked


class DevEndingJson(TypedDict):
    why: str
    at: float | None


class DevSeenJson(TypedDict):
    """What the service's watch of a dev session adds (serve/devreaper.py)."""

    idle_seconds: int
    logins: int
    ending: DevEndingJson | None


class DevJson(TypedDict):
    """A dev session's terms (rules/tenancy.dev_json), and what the service sees of it."""

    name: str
    user: str | None
    image: str | None
    until: str
    left_seconds: int
    idle_limit_seconds: int
    idle_below_pct: int
    idle_seconds: NotRequired[int]
    logins: NotRequired[int]
    ending: NotRequired[DevEndingJson | None]


class JobJson(TypedDict):
    """A job of `provision jobs --json`; the dashboard's service adds what its history and
    the job's inventory know (docs/dashboard.md)."""

    job: str
    owner: str | None
    lineage: str | None
    state: str
    since: str | None
    age_seconds: int | None
    queued: QueuedJson | None
    priority: str
    priority_level: int
    preemptible: bool
    submitted: str | None
    hosts: dict[str, JobHostJson]
    dev: DevJson | None  # a dev session's terms (`provision dev`)
    goodput: NotRequired[GoodputJson]  # a job with progress: or recovery: (the service's rounds)
    gpus: NotRequired[int]
    gpu_hours: NotRequired[float | None]
    ended: NotRequired[str | None]


class HeldJson(TypedDict):
    gpus: list[int]
    ports: list[int]


class GpuAppJson(TypedDict):
    """A compute process on a GPU, with the job it belongs to (None: not a job's)."""

    pid: int | None
    name: str | None
    used_mib: int | None
    job: str | None
    unit: str | None


class GpuUseJson(TypedDict):
    """A GPU now, as the host's nvidia-smi said (rules/gpuuse.host_use)."""

    utilization: int | None
    memory_mib: int | None
    memory_total_mib: int | None
    apps: list[GpuAppJson]


GpuHistoryJson = dict[str, list[tuple[float, float]]]  # "<gpu>" -> [[epoch seconds, utilization %], ...] in JSON


class HostJson(TypedDict):
    error: str | None
    gpus: int
    free_gpus: list[int] | None
    held: dict[str, HeldJson]
    foreign_ports: list[int]
    unreadable: list[str]
    health: HealthSummary
    # What a survey of the hosts adds (run/survey.py), and the service's last hour.
    labels: NotRequired[dict[str, str]]
    drain: NotRequired[bool]
    gpu_use: NotRequired[dict[str, GpuUseJson]]
    gpu_history: NotRequired[GpuHistoryJson]


class JobsDoc(TypedDict):
    """`provision jobs --json`: the hosts' document."""

    format_version: int
    jobs: list[JobJson]
    hosts: dict[str, HostJson]
