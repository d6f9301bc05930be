"""The validated, typed inventory: frozen dataclasses, no I/O.

`inventory.py` builds these from YAML; everything downstream (placement, cluster env,
rendering, plan) reads only these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from provision.core.recovery import CheckpointSpec, Elastic, ProgressSpec, RecoverySpec
from provision.core.scheduling import Scheduling
from provision.core.tuning import Tune

# Pool roles in Vertex `workerPoolSpecs` order. The position is the workerpool number in
# CLUSTER_SPEC (ps and reduction_server share workerpool2; validation forbids both).
ROLES = ("chief", "worker", "ps", "reduction_server", "evaluator")
WORKERPOOL = {"chief": 0, "worker": 1, "ps": 2, "reduction_server": 2, "evaluator": 3}
# Start and stop order, restart budgets: lifecycle.py.

RESTART_POLICIES = ("Never", "OnFailure", "Always", "ExitCode")
HOST_KEY_POLICIES = ("strict", "accept-new", "off")
SUCCESS_POLICIES = ("chief", "all_workers")
DEFAULT_PORT = 2222
TPU_PROCESS_PORT = 8476  # libtpu's port: the default of a pool's tasks on TPU hosts (placement/tpu.py)


def default_port(host: Host) -> int:
    acc = host.accelerators
    return TPU_PROCESS_PORT if acc is not None and acc.kind == "tpu" else DEFAULT_PORT


@dataclass(frozen=True)
class Accelerators:
    type: str
    count: int

    @property
    def kind(self) -> str:
        """'tpu' for TPU hosts (TPU_VISIBLE_CHIPS), 'gpu' otherwise (CUDA_VISIBLE_DEVICES)."""
        return "tpu" if self.type.lower().startswith("tpu") else "gpu"


@dataclass(frozen=True)
class SSHSettings:
    # None: not in the inventory, so ~/.ssh/config (then OpenSSH's defaults) decides.
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    host_key_policy: str = "accept-new"
    jump_host: str | None = None
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    ssh: SSHSettings
    cluster_address: str
    accelerators: Accelerators | None = None
    labels: tuple[tuple[str, str], ...] = ()
    drain: bool = False  # `drain: true`: its tasks move away while it is still up
    # GPUs no task of this job is given: a recovery set them aside for it (the job's state,
    # core/recovery.RecoveryRecord), the host's other GPUs still the job's to use.
    withheld: tuple[int, ...] = ()

    @property
    def accelerator_count(self) -> int:
        return self.accelerators.count if self.accelerators else 0

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass(frozen=True)
class RestartPolicy:
    policy: str = "Never"
    limit: int = 0


# Seconds a stopped task has between SIGTERM and SIGKILL (Kubernetes' default), per pool.
GRACE_PERIOD = 30
# At most: the host agent's `systemctl stop` waits for it within one SSH round trip.
MAX_GRACE_PERIOD = 300


@dataclass(frozen=True)
class Pool:
    role: str
    replicas: int
    accelerators: int = 0
    command: tuple[str, ...] = ()
    image: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    host_names: tuple[str, ...] | None = None  # `hosts: [a, b]`
    host_selector: tuple[tuple[str, str], ...] | None = None  # `hosts: {rack: r1}`
    port: int | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    setup: Setup | None = None  # runs after the job's setup, on hosts with a task of this pool
    grace_period: int = GRACE_PERIOD
    elastic: Elastic | None = None  # `elastic: {min, max}`: torchrun's c10d rendezvous (core/recovery.py)

    def eligible(self, host: Host) -> bool:
        if host.drain:
            return False
        if self.host_names is not None and host.name not in self.host_names:
            return False
        if self.host_selector is not None:
            labels = host.label_map
            return all(labels.get(k) == v for k, v in self.host_selector)
        return True


@dataclass(frozen=True)
class Setup:
    """`setup:` shell lines run once per host (per change) before the tasks start there."""

    commands: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    timeout: int = 3600  # seconds systemd gives it (TimeoutStartSec=), then it is stopped and failed
    # Pushed files (host paths: a `files:` dest, or a directory of them) whose change runs it
    # again; other pushed files (the training code) do not.
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class FileSpec:
    src: Path  # absolute, resolved against the inventory's directory
    dest: str  # absolute path on the host
    is_dir: bool
    replace: bool = False  # may overwrite a host file provision does not manage (kept, put back by destroy)


@dataclass(frozen=True)
class TFConfigOptions:
    chief_name: str = "chief"
    trial: str | None = None


@dataclass(frozen=True)
class Preference:
    """`placement: {prefer_same: [label, ...]}`: a job's replicas on as few distinct values of
    these host labels as fit them (a switch, an NVLink domain), the first label counting most."""

    prefer_same: tuple[str, ...] = ()


@dataclass(frozen=True)
class Inventory:
    path: Path
    job: str
    ssh: SSHSettings
    hosts: tuple[Host, ...]
    pools: tuple[Pool, ...]  # in ROLES order, only the pools the file names
    env: tuple[tuple[str, str], ...] = ()
    secret_env: tuple[str, ...] = ()
    files: tuple[FileSpec, ...] = ()
    tf_config: TFConfigOptions = field(default_factory=TFConfigOptions)
    success: str = "chief"
    # The service's own job description (`provision import` fills it: a Vertex CustomJobSpec,
    # an AI Platform TrainingInput), given as TF_CONFIG's and CLUSTER_SPEC's `job`. JSON
    # values only; a dict, so it takes no part in hashing or equality.
    job_spec: dict[str, object] | None = field(default=None, hash=False, compare=False)
    setup: Setup | None = None
    # `outputs:` the base of Vertex's output directories on every host (AIP_MODEL_DIR ...).
    outputs: str | None = None
    # Where the job's state lives: "local" (beside the inventory) or a PostgreSQL URL
    # without a password (inventory/statebackend.py; PROVISION_STATE wins over it).
    state: str = "local"
    # `tune:` a hyperparameter study over this job (core/tuning.py; `provision tune`).
    tune: Tune | None = None
    # `priority:`, `preemptible:`, `preemption:` (core/scheduling.py).
    scheduling: Scheduling = field(default_factory=Scheduling)
    # When its hardware fails (core/recovery.py, docs/recovery.md): how its progress is
    # watched, how often it is recovered, the hosts kept as spares.
    progress: ProgressSpec | None = None
    recovery: RecoverySpec | None = None
    spares: tuple[str, ...] = ()
    # `checkpoint:` where its newest checkpoint is kept off its host (None: not copied).
    checkpoint: CheckpointSpec | None = None
    # `placement:` what placement prefers (placement/tasks.py).
    placement: Preference = field(default_factory=Preference)

    def pool(self, role: str) -> Pool | None:
        for p in self.pools:
            if p.role == role:
                return p
        return None

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    @property
    def task_count(self) -> int:
        return sum(p.replicas for p in self.pools)
