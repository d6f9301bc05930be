"""A TPU slice's processes: what JAX's cluster detection and libtpu read to find each other.
Pure.

A pool whose tasks are placed on TPU hosts (`accelerators: {type: tpu-…}`) is a TPU job's
processes: chief and workers in rank order, usually one per host owning all its chips. On
TPU VMs JAX asks the metadata server for the slice (`agent-worker-number`,
`worker-network-endpoints`) unless TPU_SKIP_MDS_QUERY is set; then it reads what
Kubernetes' LeaderWorkerSet sets (jax `_src/clusters/cloud_tpu_cluster.py`, GkeTpuCluster):

- TPU_WORKER_ID: the process's id within its slice;
- TPU_PROCESS_ADDRESSES (read first) / TPU_WORKER_HOSTNAMES: the slice's processes, by id;
  the first is the coordinator;
- TPU_PROCESS_PORT: libtpu's port on each host (8476 by default: a TPU pool's default port);
- the coordinator's port is JAX_COORDINATOR_PORT (JAX's default 8482 = 8476 + 6: provision
  takes the highest process port on the coordinator's host + 6, and reserves it in the
  host's ledger);
- several slices (hosts labelled `tpu_slice: NAME`, slices in order of their first process):
  MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID; JAX then numbers
  processes slice by slice (slice id x processes per slice + id in slice), so slices must be
  the same size.

Several processes on one host (a pool's `accelerators` below the host's chips) get
libtpu's process bounds: TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 and TPU_PROCESS_BOUNDS for the
host's chips (2,2,1 for 4), one chip each, as Google documents for a single TPU VM; across
several hosts the bounds depend on the slice's topology, which provision does not know:
refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from provision.core.errors import ProvisionError
from provision.placement.tasks import PlacedTask

COORDINATOR_OFFSET = 6  # JAX's default coordinator port 8482 = 8476 + 6
SLICE_LABEL = "tpu_slice"
# Chips on one host -> TPU_PROCESS_BOUNDS for one process per chip (a single TPU VM).
PROCESS_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


def is_tpu(task: PlacedTask) -> bool:
    acc = task.host.accelerators
    return acc is not None and acc.kind == "tpu"


@dataclass(frozen=True)
class TpuSlices:
    """The job's TPU processes: per slice, in id order (JAX's numbering)."""

    slices: tuple[tuple[PlacedTask, ...], ...]

    @property
    def coordinator(self) -> PlacedTask:
        return self.slices[0][0]

    @property
    def coordinator_port(self) -> int:
        """JAX's coordinator port: above every process port on the coordinator's host (8482
        for one process per host, JAX's own default)."""
        here = [t.port for procs in self.slices for t in procs if t.host.name == self.coordinator.host.name]
        return max(here) + COORDINATOR_OFFSET

    def process_id(self, task: PlacedTask) -> int | None:
        for s, procs in enumerate(self.slices):
            if task in procs:
                return s * len(procs) + procs.index(task)
        return None

    @property
    def count(self) -> int:
        return sum(len(p) for p in self.slices)


def coordinator_ports(ranked: Iterable[PlacedTask]) -> dict[str, int]:
    """host -> the JAX coordinator port the job's ledger entry there must hold too."""
    ts = tpu_slices(ranked)
    return {ts.coordinator.host.name: ts.coordinator_port} if ts is not None else {}


def tpu_slices(ranked: Iterable[PlacedTask]) -> TpuSlices | None:
    """The TPU processes among the job's ranked tasks (chief and workers, in rank order),
    grouped into slices; None when none runs on a TPU host. Raises ProvisionError for a
    layout JAX or libtpu cannot take."""
    procs = [t for t in ranked if is_tpu(t)]
    if not procs:
        return None
    groups: dict[str, list[PlacedTask]] = {}
    for t in procs:
        groups.setdefault(t.host.label_map.get(SLICE_LABEL, ""), []).append(t)
    slices = tuple(tuple(g) for g in groups.values())
    if len({len(s) for s in slices}) > 1:
        sizes = ", ".join(f"{name or '(unlabelled)'}: {len(g)}" for name, g in groups.items())
        raise ProvisionError(
            f"TPU slices ({SLICE_LABEL} labels) must hold the same number of processes, as JAX numbers them "
            f"slice by slice; got {sizes}"
        )
    hosts = {t.host.name for t in procs}
    if len(hosts) > 1 and len(hosts) < len(procs):
        raise ProvisionError(
            "TPU processes sharing a host are supported on a single host only (libtpu's process bounds "
            "across hosts depend on the slice's topology): give each process all of its host's chips"
        )
    if len(hosts) == 1 and len(procs) > 1:
        chips = procs[0].host.accelerator_count
        if any(len(t.accelerators) != 1 for t in procs) or chips not in PROCESS_BOUNDS:
            raise ProvisionError(
                "several TPU processes on one host: one chip each, on a host of "
                f"{', '.join(map(str, PROCESS_BOUNDS))} chips (libtpu's process bounds); got "
                f"{len(procs)} processes on {chips} chips"
            )
    return TpuSlices(slices)


def tpu_env(task: PlacedTask, ts: TpuSlices, job: str) -> list[tuple[str, str]]:
    """The variables of one TPU process (module docstring); [] for a task that is not one."""
    pid = ts.process_id(task)
    if pid is None:
        return []
    s = next(i for i, procs in enumerate(ts.slices) if task in procs)
    procs = ts.slices[s]
    coord = ts.coordinator
    env = [
        ("TPU_SKIP_MDS_QUERY", "true"),
        ("TPU_NAME", job),
        ("TPU_WORKER_ID", str(procs.index(task))),
        ("TPU_WORKER_HOSTNAMES", ",".join(t.host.cluster_address for t in procs)),
        ("TPU_PROCESS_ADDRESSES", ",".join(f"{t.host.cluster_address}:{t.port}" for t in procs)),
        ("TPU_PROCESS_PORT", str(task.port)),
        ("JAX_COORDINATOR_PORT", str(ts.coordinator_port)),
        ("JAX_COORDINATOR_ADDRESS", f"{coord.host.cluster_address}:{ts.coordinator_port}"),
        ("JAX_NUM_PROCESSES", str(ts.count)),
        ("JAX_PROCESS_ID", str(pid)),
    ]
    if len({t.host.name for t in procs}) == 1 and len(procs) > 1:
        env += [
            ("TPU_CHIPS_PER_PROCESS_BOUNDS", "1,1,1"),
            ("TPU_PROCESS_BOUNDS", PROCESS_BOUNDS[task.host.accelerator_count]),
            ("CLOUD_TPU_TASK_ID", str(procs.index(task))),
        ]
    if len(ts.slices) > 1:
        env += [
            ("MEGASCALE_COORDINATOR_ADDRESS", coord.host.cluster_address),
            ("MEGASCALE_NUM_SLICES", str(len(ts.slices))),
            ("MEGASCALE_SLICE_ID", str(s)),
        ]
    return env
