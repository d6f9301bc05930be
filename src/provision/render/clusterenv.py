"""What every task must see (shared/spec/cluster-env.md), as ordered (name, value) pairs.

Values are plain strings here; encoding for systemd happens in `encode.py`. Everything
job-wide (the cluster dicts, their JSON) is computed once per job, so a 1,000-task job
costs one JSON dump per task only for its small `task` part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from provision.core.model import (
    WORKERPOOL,
    Inventory,
)
from provision.host import layout
from provision.placement.tasks import PlacedTask, Placement
from provision.placement.tpu import TpuSlices, tpu_env, tpu_slices


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True)
class JobCluster:
    """Job-wide facts shared by every task's environment."""

    tf_cluster_json: str  # chief/worker/ps only, never the evaluator
    tf_cluster: dict[str, Any]
    spec_cluster_json: str  # workerpool0..3
    job_json: str  # CLUSTER_SPEC "job": the job's own description
    single_task: bool
    master: PlacedTask | None  # rank 0 for PyTorch/JAX: the chief, else worker 0
    world: int  # chief + workers
    dmlc_root: PlacedTask | None
    n_workers: int
    n_ps: int
    tpu: TpuSlices | None = None  # the processes on TPU hosts (placement/tpu.py)


def job_cluster(inv: Inventory, placement: Placement) -> JobCluster:
    chief_key = inv.tf_config.chief_name
    tf: dict[str, list[str]] = {}
    spec: dict[str, list[str]] = {}
    for role, key in (("chief", chief_key), ("worker", "worker"), ("ps", "ps")):
        addrs = [t.address for t in placement.by_role(role)]
        if addrs:
            tf[key] = addrs
    for role in ("chief", "worker", "ps", "reduction_server", "evaluator"):
        addrs = [t.address for t in placement.by_role(role)]
        if addrs:
            spec[f"workerpool{WORKERPOOL[role]}"] = addrs
    chief = placement.by_role("chief")
    workers = placement.by_role("worker")
    master = chief[0] if chief else (workers[0] if workers else None)
    return JobCluster(
        tf_cluster_json=_json(tf),
        tf_cluster=tf,
        spec_cluster_json=_json(spec),
        job_json=_json(job_description(inv)),
        single_task=len(placement.tasks) == 1,
        master=master,
        world=len(chief) + len(workers),
        dmlc_root=master,
        n_workers=len(workers),
        n_ps=len(placement.by_role("ps")),
        tpu=tpu_slices([*chief, *workers]),
    )


def job_description(inv: Inventory) -> dict[str, Any]:
    """CLUSTER_SPEC's `job`: the job as submitted, like Vertex's CustomJobSpec.

    Positions follow workerPoolSpecs (empty `{}` where a pool is absent). Env values are
    left out on purpose: they may carry secrets and every task already has them.
    An imported job (`job_spec:`) is given as the service gave it: its own spec, whole.
    """
    if inv.job_spec is not None:
        return dict(inv.job_spec)
    specs: list[dict[str, Any]] = [{} for _ in range(4)]
    for pool in inv.pools:
        if pool.replicas == 0:
            continue
        spec: dict[str, Any] = {"role": pool.role, "replicaCount": pool.replicas}
        if pool.accelerators:
            spec["machineSpec"] = {"acceleratorCount": pool.accelerators}
        if pool.image:
            spec["containerSpec"] = {"imageUri": pool.image, "args": list(pool.args)}
        else:
            spec["commandSpec"] = {"command": list(pool.command)}
        specs[WORKERPOOL[pool.role]] = spec
    while specs and not specs[-1]:
        specs.pop()
    return {"displayName": inv.job, "workerPoolSpecs": specs}


def rank(task: PlacedTask, jc: JobCluster) -> int | None:
    """PyTorch/JAX rank: chief 0, worker i → i+1 (i when there is no chief)."""
    if task.role == "chief":
        return 0
    if task.role == "worker":
        has_chief = jc.master is not None and jc.master.role == "chief"
        return task.index + 1 if has_chief else task.index
    return None


def _device_env(
    inv: Inventory, task: PlacedTask, jc: JobCluster, gpu_uuids: Mapping[str, list[str]] | None
) -> list[tuple[str, str]]:
    """Accelerators: exactly the devices placed on this task (and a TPU slice's variables)."""
    acc = task.host.accelerators
    if acc is not None and acc.kind == "tpu":
        env = [("TPU_VISIBLE_CHIPS", ",".join(map(str, task.accelerators))), ("CUDA_VISIBLE_DEVICES", "")]
        if jc.tpu is not None:  # the slice, as JAX's cluster detection and libtpu read it
            env += tpu_env(task, jc.tpu, inv.job)
        return env
    uuids = (gpu_uuids or {}).get(task.host.name)
    if uuids and task.accelerators and max(task.accelerators) < len(uuids):
        devices = ",".join(uuids[i] for i in task.accelerators)
    else:
        devices = ",".join(map(str, task.accelerators))
    return [("CUDA_VISIBLE_DEVICES", devices), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")]


SOCKET_IFNAME_KEYS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Vertex AI sets these for a job with a baseOutputDirectory: provision under `outputs:`.
OUTPUT_DIRS = (("AIP_MODEL_DIR", "model"), ("AIP_CHECKPOINT_DIR", "checkpoints"), ("AIP_TENSORBOARD_LOG_DIR", "logs"))


def output_dirs(inv: Inventory) -> list[str]:
    """The directories a task's unit makes under `outputs:` (host/outdirs.py checks them)."""
    return [f"{inv.outputs}/{sub}" for _, sub in OUTPUT_DIRS] if inv.outputs else []


def _own_keys(inv: Inventory, role: str) -> set[str]:
    """The env keys the inventory sets for a pool's tasks (job env and the pool's own)."""
    pool = inv.pool(role)
    return {k for k, _ in inv.env} | {k for k, _ in (pool.env if pool is not None else ())}


def uses_socket_ifname(inv: Inventory) -> bool:
    """Does any task's env take its host's interface (task_env's socket_ifname)? Not when
    the inventory sets both keys for every pool: then plan need not ask hosts for it."""
    return any(not set(SOCKET_IFNAME_KEYS) <= _own_keys(inv, p.role) for p in inv.pools)


def preemptible(inv: Inventory) -> bool:
    """May the job be preempted: `preemptible:`, else yes for a study's trial."""
    return inv.scheduling.may_be_preempted(inv.tf_config.trial is not None)


def resumable(inv: Inventory) -> bool:
    """Is the job stopped with the preemption's signal and grace and resumed with
    PROVISION_RESUME=1: a preemptible job, and one provision recovers (`recovery:`)."""
    return preemptible(inv) or inv.recovery is not None


ELASTIC_RESTARTS = 3  # torchrun's --max-restarts for an elastic job: each node lost is one


def torchrun_env(inv: Inventory, jc: JobCluster, r: int, nproc: int) -> list[tuple[str, str]]:
    """torchrun's own settings (its PET_ variables): a static rendezvous at the master for
    a job of fixed size; with a pool's `elastic: {min, max}`, torchrun's c10d rendezvous:
    --nnodes=MIN:MAX counted with the job's other nodes (its chief), its endpoint the
    master's address and port (where the job's chief stays: the same across restarts), the
    job's name its id, restarts enough for torchrun to go on when a node is lost, and each
    round's workers' store where that round's rank 0 is."""
    m = jc.master
    assert m is not None
    pool = next((p for p in inv.pools if p.elastic is not None), None)
    if pool is None or pool.elastic is None:
        return [
            ("PET_NNODES", str(jc.world)),
            ("PET_NODE_RANK", str(r)),
            ("PET_MASTER_ADDR", m.host.cluster_address),
            ("PET_MASTER_PORT", str(m.port)),
            ("PET_NPROC_PER_NODE", str(nproc)),
        ]
    spec, others = pool.elastic, jc.world - pool.replicas
    return [
        ("PET_NNODES", f"{others + spec.min}:{others + spec.max}"),
        ("PET_RDZV_BACKEND", "c10d"),
        ("PET_RDZV_ENDPOINT", f"{m.host.cluster_address}:{m.port}"),
        ("PET_RDZV_ID", inv.job),
        ("PET_MAX_RESTARTS", str(ELASTIC_RESTARTS)),
        ("PET_NPROC_PER_NODE", str(nproc)),
        # torchrun (2.4 on) keeps the workers' store where its first round's rank 0 put
        # it and never moves it: after a node is lost and one joins, the nodes' workers
        # look for each other in different stores and every round times out. Off, each
        # round's rank 0 says where its workers meet (tests/integration/test_recovery.py).
        ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
    ]


def task_env(  # noqa: C901  one branch per variable family provision sets (docs/environment.md)
    inv: Inventory,
    task: PlacedTask,
    jc: JobCluster,
    *,
    secrets: Mapping[str, str] | None = None,
    gpu_uuids: Mapping[str, list[str]] | None = None,
    socket_ifname: str | None = None,
) -> list[tuple[str, str]]:
    """Ordered environment of one task: provision's variables, then job env, pool env, secrets."""
    env: list[tuple[str, str]] = [
        ("PROVISION_JOB", inv.job),
        ("PROVISION_TASK", task.name),
        ("PROVISION_TASK_TYPE", task.role),
        ("PROVISION_TASK_INDEX", str(task.index)),
        # Logs reach journald as they are printed, not when a buffer fills; env may override.
        ("PYTHONUNBUFFERED", "1"),
    ]
    if resumable(inv):  # where a preemption's (or a recovery's) deadline is written (host/preempt.py)
        env.append(("PROVISION_PREEMPT_AT", layout.preempt_at_path(inv.job)))
    if inv.progress is not None:  # a file the task may touch to show it progresses
        env.append(("PROVISION_HEARTBEAT", layout.heartbeat_path(inv.job, task.name)))
    trial = inv.tf_config.trial

    # TF_CONFIG: not for single-task jobs, and reduction servers are not TF tasks.
    if not jc.single_task and task.role != "reduction_server":
        tf_type = inv.tf_config.chief_name if task.role == "chief" else task.role
        cluster = jc.tf_cluster_json
        if task.role == "evaluator":
            cluster = _json({**jc.tf_cluster, "evaluator": [task.address]})
        t: dict[str, Any] = {"type": tf_type, "index": task.index}
        if trial is not None:
            t["trial"] = trial
        # The services put their job spec in TF_CONFIG too; only an imported job has one.
        # Written exactly as in CLUSTER_SPEC (`,"job":` + job_json): render strips both alike.
        job = f',"job":{jc.job_json}' if inv.job_spec is not None else ""
        env.append(("TF_CONFIG", f'{{"cluster":{cluster},"task":{_json(t)},"environment":"cloud"{job}}}'))

    t = {"type": f"workerpool{WORKERPOOL[task.role]}", "index": task.index}
    if trial is not None:
        t["trial"] = trial
    env.append(
        (
            "CLUSTER_SPEC",
            f'{{"cluster":{jc.spec_cluster_json},"environment":"cloud","task":{_json(t)},"job":{jc.job_json}}}',
        )
    )

    r = rank(task, jc)
    if r is not None and jc.master is not None:
        m = jc.master
        pool = inv.pool(task.role)
        nproc = max(1, pool.accelerators if pool else 0)
        env += [
            ("MASTER_ADDR", m.host.cluster_address),
            ("MASTER_PORT", str(m.port)),
            ("WORLD_SIZE", str(jc.world)),
            ("RANK", str(r)),
            *torchrun_env(inv, jc, r, nproc),
            ("JAX_COORDINATOR_ADDRESS", m.address),
            ("JAX_NUM_PROCESSES", str(jc.world)),
            ("JAX_PROCESS_ID", str(r)),
        ]

    # MXNet / BytePS / ps-lite: chief = scheduler, workers, ps = servers (seed 001).
    dmlc_role = {"chief": "scheduler", "worker": "worker", "ps": "server"}.get(task.role)
    if dmlc_role and jc.dmlc_root is not None and jc.n_ps:
        env += [
            ("DMLC_ROLE", dmlc_role),
            ("DMLC_PS_ROOT_URI", jc.dmlc_root.host.cluster_address),
            ("DMLC_PS_ROOT_PORT", str(jc.dmlc_root.port)),
            ("DMLC_NUM_WORKER", str(jc.n_workers)),
            ("DMLC_NUM_SERVER", str(jc.n_ps)),
        ]

    env += _device_env(inv, task, jc, gpu_uuids)

    # NCCL and Gloo talk on the interface that holds the host's cluster address (the host
    # reports it at plan time: checks.py), not on whichever one they would guess; the
    # inventory's own values win, in their own place: a key the inventory sets is not added
    # here at all, so the file is the same whether or not the interface was known (offline
    # `render` does not know it).
    if socket_ifname:
        own = _own_keys(inv, task.role)
        env += [(k, socket_ifname) for k in SOCKET_IFNAME_KEYS if k not in own]

    # Vertex AI's output directories (its baseOutputDirectory), under `outputs:`.
    if inv.outputs is not None:
        env += [(var, f"{inv.outputs}/{sub}/") for var, sub in OUTPUT_DIRS]
    # A trial of a study (`provision tune`): where cloudml-hypertune writes, read back by tune.
    if inv.tune is not None and trial is not None:
        env += [
            ("CLOUD_ML_TRIAL_ID", trial),
            ("CLOUD_ML_HP_METRIC_FILE", layout.metric_file(inv.job, task.name)),
            ("CLOUD_ML_HP_METRIC_TAG", inv.tune.metric.name),
        ]

    env += list(inv.env)
    pool = inv.pool(task.role)
    if pool is not None:
        env += list(pool.env)
    for key in inv.secret_env:
        if secrets is not None and key in secrets:
            env.append((key, secrets[key]))
    # Later entries win (pool over job); keep the first position for stable output.
    merged: dict[str, str] = {}
    for k, v in env:
        merged[k] = v
    return list(merged.items())
