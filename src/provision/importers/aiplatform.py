"""AI Platform Training: a TrainingInput, or a Job with `trainingInput` (gcloud's
config.yaml) → JobPlan.

What the AI Platform pages say (seeds 000-002): the master is TF_CONFIG's `chief` when
useChiefInTfConfig is true, when the job has an evaluator, or (the pages' own example) on
runtime version 2.1 or later, else the legacy `master`; a pool without its own imageUri
runs masterConfig's; TF_CONFIG's `job` is the TrainingInput.
"""

from __future__ import annotations

import re
from dataclasses import replace

from .common import (
    JSON,
    JobPlan,
    Note,
    PoolPlan,
    Where,
    accelerators,
    boolean,
    check_json,
    check_keys,
    duration,
    entry_note,
    hosts_python,
    install_commands,
    integer,
    job_name,
    mapping,
    merge_setup,
    module_command,
    note,
    string,
    strings,
    venv,
)
from .study import Notes, from_ai_platform

INPUT_KEYS = frozenset(
    {
        "scaleTier",
        "masterType",
        "masterConfig",
        "workerType",
        "workerConfig",
        "parameterServerType",
        "parameterServerConfig",
        "evaluatorType",
        "evaluatorConfig",
        "workerCount",
        "parameterServerCount",
        "evaluatorCount",
        "packageUris",
        "pythonModule",
        "args",
        "hyperparameters",
        "region",
        "jobDir",
        "runtimeVersion",
        "pythonVersion",
        "encryptionConfig",
        "scheduling",
        "network",
        "serviceAccount",
        "useChiefInTfConfig",
        "enableWebAccess",
    }
)
CONFIG_KEYS = frozenset(
    {"acceleratorConfig", "imageUri", "containerCommand", "containerArgs", "tpuTfVersion", "diskConfig"}
)
JOB_KEYS = frozenset(
    {
        "jobId",
        "trainingInput",
        "labels",
        "etag",
        "createTime",
        "startTime",
        "endTime",
        "state",
        "errorMessage",
        "trainingOutput",
        "jobPosition",
    }
)
# (provision's pool, machine type key, config key, count key); the master is always one.
POOLS = (
    ("chief", "masterType", "masterConfig", None),
    ("worker", "workerType", "workerConfig", "workerCount"),
    ("ps", "parameterServerType", "parameterServerConfig", "parameterServerCount"),
    ("evaluator", "evaluatorType", "evaluatorConfig", "evaluatorCount"),
)
# AI Platform's legacy machine types that came with accelerators (its machine-types page).
LEGACY_ACCELERATORS = {
    "standard_gpu": (1, "NVIDIA_TESLA_K80"),
    "complex_model_m_gpu": (4, "NVIDIA_TESLA_K80"),
    "complex_model_l_gpu": (8, "NVIDIA_TESLA_K80"),
    "standard_p100": (1, "NVIDIA_TESLA_P100"),
    "complex_model_m_p100": (4, "NVIDIA_TESLA_P100"),
    "standard_v100": (1, "NVIDIA_TESLA_V100"),
    "large_model_v100": (1, "NVIDIA_TESLA_V100"),
    "complex_model_m_v100": (4, "NVIDIA_TESLA_V100"),
    "complex_model_l_v100": (8, "NVIDIA_TESLA_V100"),
    "cloud_tpu": (8, "TPU_V2"),
}
SCALE_TIERS = ("CUSTOM", "BASIC", "BASIC_GPU", "BASIC_TPU", "STANDARD_1", "PREMIUM_1")
SCHEDULING_WHY = {"maxWaitTime": "the job starts when you apply it", "priority": "no queue of the service's"}


def from_data(data: JSON, display: str, *, job: str | None, trial: str | None, default_name: str) -> JobPlan:
    top = Where(display)
    if not isinstance(data, dict):
        top.fail(
            f"expected a TrainingInput, or a job with trainingInput, got {'a list' if isinstance(data, list) else repr(data)[:40]}"
        )
    notes: list[Note] = []
    name: str | None = None
    if "trainingInput" in data:
        unknown = check_keys(data, top, JOB_KEYS)
        for key, value in data.items():
            if key not in ("trainingInput", "jobId") and value:
                notes.append(note(top / key, value, "not known to provision import" if key in unknown else None))
        name = string(data["jobId"], top / "jobId") if "jobId" in data else None
        at = top / "trainingInput"
        ti = mapping(data["trainingInput"], at)
    elif INPUT_KEYS & set(data):
        at, ti = top, data
    elif "workerPoolSpecs" in data or "jobSpec" in data:
        top.fail("this is a Vertex AI job (workerPoolSpecs): use `provision import vertex`")
    else:
        keys = ", ".join(str(k) if str(k).isprintable() else repr(k) for k in list(data)[:6]) or "none"
        top.fail(
            f"expected a TrainingInput (scaleTier, masterType, ...) or a job with trainingInput; keys found: {keys}"
        )
    return from_input(
        ti, at, notes, job=job or job_name(name or default_name), named=name, explicit=job is not None, trial=trial
    )


def from_input(  # noqa: C901  one branch per field of AI Platform's TrainingInput
    ti: dict[str, JSON], at: Where, notes: list[Note], *, job: str, named: str | None, explicit: bool, trial: str | None
) -> JobPlan:
    check_json(ti, at)
    unknown = check_keys(ti, at, INPUT_KEYS)
    partly: list[Note] = []
    if named is not None and not explicit and job != named:
        partly.append(Note("jobId", named, f"job names are DNS-1035 labels: job {job}"))

    tier = string(
        ti.get("scaleTier", "CUSTOM" if "masterType" in ti or "masterConfig" in ti else "BASIC"), at / "scaleTier"
    )
    if tier not in SCALE_TIERS:
        (at / "scaleTier").fail(f"expected one of {', '.join(SCALE_TIERS)}, got {tier!r}")
    if tier in ("STANDARD_1", "PREMIUM_1", "BASIC_TPU"):
        (at / "scaleTier").fail(
            f"{tier} does not say which machines and how many it ran: write the job as CUSTOM "
            "with masterType, workerCount, parameterServerCount and their configs"
        )
    counts = {"chief": 1}
    for role, _, _, count_key in POOLS[1:]:
        assert count_key is not None
        counts[role] = integer(ti[count_key], at / count_key) if count_key in ti else 0
        if counts[role] and tier != "CUSTOM":
            notes.append(
                note(at / count_key, ti[count_key], f"scaleTier {tier} runs the master alone (CUSTOM uses the counts)")
            )
            counts[role] = 0
    if counts["evaluator"] > 1:
        partly.append(
            note(
                at / "evaluatorCount",
                ti["evaluatorCount"],
                "provision runs one evaluator (TensorFlow expects at most one): replicas 1",
            )
        )
        counts["evaluator"] = 1

    # chief or master: exactly the AI Platform pages' rule (see the module's docstring).
    use_chief = boolean(ti["useChiefInTfConfig"], at / "useChiefInTfConfig") if "useChiefInTfConfig" in ti else False
    runtime = string(ti["runtimeVersion"], at / "runtimeVersion") if "runtimeVersion" in ti else None
    m = re.fullmatch(r"(\d+)\.(\d+)", runtime or "")
    new_runtime = m is not None and (int(m.group(1)), int(m.group(2))) >= (2, 1)
    if use_chief:
        chief_name, chief_why = "chief", "useChiefInTfConfig is true: AI Platform named the master `chief`"
    elif counts["evaluator"]:
        chief_name, chief_why = "chief", "the job has an evaluator: AI Platform named the master `chief`"
    elif new_runtime:
        chief_name, chief_why = (
            "chief",
            f"runtime version {runtime} (2.1 or later): AI Platform named the master `chief`",
        )
    else:
        chief_name, chief_why = (
            "master",
            (
                "no useChiefInTfConfig, no evaluator: AI Platform used the legacy `master` "
                "(TensorFlow 2 rejects it; set chief_name: chief if your code is TF2)"
            ),
        )

    master_image = _image(ti, at, "masterConfig")
    python_module = string(ti["pythonModule"], at / "pythonModule") if "pythonModule" in ti else None
    packages = strings(ti.get("packageUris"), at / "packageUris")
    args = strings(ti.get("args"), at / "args")
    job_dir = string(ti["jobDir"], at / "jobDir") if ti.get("jobDir") else None
    if job_dir:
        args += ("--job-dir", job_dir)
        partly.append(
            note(
                at / "jobDir",
                job_dir,
                "appended to every task's arguments as `--job-dir VALUE`, as AI Platform passed it; a gs:// path needs Cloud Storage credentials on the hosts",
            )
        )
    if master_image is None and python_module is None:
        at.fail(
            "neither masterConfig.imageUri (a custom container) nor pythonModule (a training package): what does this job run? "
            "(When a `gcloud ai-platform jobs submit training --config` command says it, import the script with the command.)"
        )

    pools: list[PoolPlan] = []
    for role, type_key, config_key, _ in POOLS:
        if counts[role] == 0:
            continue
        pools.append(
            _pool(
                ti, at, role, type_key, config_key, counts[role], master_image, python_module, args, job, notes, partly
            )
        )
    if tier == "BASIC_GPU":
        pools[0] = replace(pools[0], accelerators=1, accelerator_type="NVIDIA_TESLA_K80")
        partly.append(
            note(at / "scaleTier", tier, "one master with one GPU (AI Platform's BASIC_GPU had an NVIDIA_TESLA_K80)")
        )

    setup: tuple[str, ...] = ()
    if master_image is None:
        framework = (f"tensorflow~={runtime}.0",) if runtime and m else ()
        setup = install_commands(job, packages, framework)
        if runtime:
            partly.append(
                note(
                    at / "runtimeVersion",
                    runtime,
                    f"the setup block installs {framework[0]} in {venv(job)}"
                    if framework
                    else "install this runtime's packages in the setup block",
                )
            )
    elif counts["worker"] or counts["ps"] or counts["evaluator"]:
        partly.append(
            Note(
                "CLUSTER_SPEC",
                "master/worker/ps/evaluator",
                "provision writes Vertex AI's form (workerpool0..3) for every job; code that parses CLUSTER_SPEC's task.type must read workerpoolN (TF_CONFIG is as AI Platform wrote it)",
            )
        )

    timeout = None
    s_at = at / "scheduling"
    sched = mapping(ti.get("scheduling"), s_at)
    for key, value in sched.items():
        if key == "maxRunningTime":
            timeout = duration(value, s_at / key)
            partly.append(
                note(
                    s_at / key,
                    value,
                    f"provision does not stop a job after a time: `provision wait INVENTORY --timeout {timeout}` exits 124 after that long, then `provision destroy` stops it",
                )
            )
        elif value:
            notes.append(note(s_at / key, value, SCHEDULING_WHY.get(key, "not known to provision import")))

    study = None
    if ti.get("hyperparameters"):  # the search becomes tune:; `provision tune` numbers the trials
        found = Notes()
        study = from_ai_platform(ti["hyperparameters"], at / "hyperparameters", found)
        notes += found.dropped
        partly += found.changed
    if ti.get("pythonVersion"):
        partly.append(note(at / "pythonVersion", ti["pythonVersion"], "the setup block's venv uses the hosts' python3"))
    handled = {
        "scaleTier",
        "workerCount",
        "parameterServerCount",
        "evaluatorCount",
        "useChiefInTfConfig",
        "runtimeVersion",
        "pythonModule",
        "packageUris",
        "args",
        "jobDir",
        "scheduling",
        "hyperparameters",
        "pythonVersion",
        *(p[1] for p in POOLS),
        *(p[2] for p in POOLS),
    }
    for key, value in ti.items():
        if key not in handled and value:
            notes.append(note(at / key, value, "not known to provision import" if key in unknown else None))

    return JobPlan(
        service="AI Platform Training",
        origin="a TrainingInput" if at.path == "" else "a job with trainingInput",
        job=job,
        pools=tuple(pools),
        job_spec=ti,
        chief_name=chief_name,
        chief_why=chief_why,
        trial=trial,
        setup=merge_setup(setup),
        not_applied=tuple(notes),
        partly=tuple(partly),
        timeout=timeout,
        study=study,
    )


def _image(ti: dict[str, JSON], at: Where, config_key: str) -> str | None:
    cfg = mapping(ti.get(config_key), at / config_key)
    return string(cfg["imageUri"], at / config_key / "imageUri") if cfg.get("imageUri") else None


def _pool(  # noqa: C901  one branch per field of a ReplicaConfig
    ti: dict[str, JSON],
    at: Where,
    role: str,
    type_key: str,
    config_key: str,
    replicas: int,
    master_image: str | None,
    python_module: str | None,
    args: tuple[str, ...],
    job: str,
    notes: list[Note],
    partly: list[Note],
) -> PoolPlan:
    c_at = at / config_key
    cfg = mapping(ti.get(config_key), c_at)
    for key in check_keys(cfg, c_at, CONFIG_KEYS):
        notes.append(note(c_at / key, cfg[key], "not known to provision import"))
    for key in ("tpuTfVersion", "diskConfig"):
        if cfg.get(key):
            notes.append(note(c_at / key, cfg[key]))
    machine = string(ti[type_key], at / type_key) if ti.get(type_key) else None

    what = {"chief": "the master", "worker": "workers", "ps": "parameter servers", "evaluator": "evaluators"}[role]
    comments = [f"{config_key} ({what}): {machine or 'machine type not given'}"]
    a_at = c_at / "acceleratorConfig"
    acc = mapping(cfg.get("acceleratorConfig"), a_at)
    count, acc_type = accelerators(acc, a_at, "count", "type")
    if not acc and machine in LEGACY_ACCELERATORS:
        count, acc_type = LEGACY_ACCELERATORS[machine]
        partly.append(
            note(
                at / type_key,
                machine,
                f"this legacy machine type came with {count} x {acc_type}: accelerators {count}; for its CPUs and memory, pick the hosts",
            )
        )
    elif machine:
        notes.append(note(at / type_key, machine, WHY_MACHINE))

    image = _image(ti, at, config_key)
    if image is None and master_image is not None and role != "chief":
        image = master_image
        comments.append("no imageUri of its own: masterConfig's, as AI Platform does")
    elif image is not None and master_image is None:
        (c_at / "imageUri").fail(
            "set, but masterConfig has no imageUri: a job runs containers in every pool or in none"
        )
    entry = strings(cfg.get("containerCommand"), c_at / "containerCommand")
    container_args = strings(cfg.get("containerArgs"), c_at / "containerArgs")
    if container_args and ti.get("args"):
        (c_at / "containerArgs").fail("AI Platform takes containerArgs or trainingInput.args, not both")
    if (entry or container_args) and image is None:
        (c_at / ("containerCommand" if entry else "containerArgs")).fail(
            "set, but the job runs no container (no imageUri)"
        )
    if entry:
        partly.append(entry_note(c_at / "containerCommand", entry, "AI Platform"))

    if image is not None:
        return PoolPlan(
            role,
            config_key,
            replicas,
            count,
            acc_type,
            image=image,
            args=entry + (container_args or args),
            comments=tuple(comments),
        )
    comments.append(
        f"AI Platform ran `python -m {python_module}` with the training packages installed; {hosts_python(job)}"
    )
    return PoolPlan(
        role,
        config_key,
        replicas,
        count,
        acc_type,
        command=module_command(job, str(python_module), args),
        comments=tuple(comments),
    )


WHY_MACHINE = "the hosts you list are the machines: pick them for the CPUs and memory this type had"
