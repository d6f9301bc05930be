"""The variables provision sets for every task (render/clusterenv.py sets them): an
inventory may not set them itself (inventory/ refuses them), or tasks would disagree about
the cluster."""

from __future__ import annotations

# What task_env sets for TPU processes: an inventory may not override them.
TPU_KEYS = frozenset(
    {
        "TPU_SKIP_MDS_QUERY",
        "TPU_NAME",
        "TPU_WORKER_ID",
        "TPU_WORKER_HOSTNAMES",
        "TPU_PROCESS_ADDRESSES",
        "TPU_PROCESS_PORT",
        "JAX_COORDINATOR_PORT",
        "TPU_CHIPS_PER_PROCESS_BOUNDS",
        "TPU_PROCESS_BOUNDS",
        "CLOUD_TPU_TASK_ID",
        "MEGASCALE_COORDINATOR_ADDRESS",
        "MEGASCALE_NUM_SLICES",
        "MEGASCALE_SLICE_ID",
    }
)


# Variables provision itself sets for every task; an inventory may not override them,
# or tasks would disagree about the cluster.
RESERVED_ENV = frozenset(
    {
        "TF_CONFIG",
        "CLUSTER_SPEC",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "PET_NNODES",
        "PET_NODE_RANK",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "PET_NPROC_PER_NODE",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "DMLC_ROLE",
        "DMLC_PS_ROOT_URI",
        "DMLC_PS_ROOT_PORT",
        "DMLC_NUM_WORKER",
        "DMLC_NUM_SERVER",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "TPU_VISIBLE_CHIPS",
        *TPU_KEYS,
        "PROVISION_JOB",
        "PROVISION_TASK",
        "PROVISION_TASK_TYPE",
        "PROVISION_TASK_INDEX",
        "PROVISION_PREEMPT_AT",
        "PROVISION_RESUME",
        "PROVISION_HEARTBEAT",
        "CLOUD_ML_TRIAL_ID",
        "CLOUD_ML_HP_METRIC_FILE",
        "CLOUD_ML_HP_METRIC_TAG",
    }
)
