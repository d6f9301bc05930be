"""Vertex AI: a CustomJob, CustomJobSpec (gcloud --config) or HyperparameterTuningJob → JobPlan.

The mapping is the one Vertex AI's distributed-training page gives (seed 004):
workerPoolSpecs[0] the primary replica (provision's chief), [1] workers, [2] parameter
servers -- or reduction servers when its image is Google's reductionserver image -- and
[3] evaluators. An empty `{}` keeps a position free. TF_CONFIG's chief is always `chief`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from provision.render.clusterenv import OUTPUT_DIRS

from .common import (
    JSON,
    OUTPUT_FIELDS,
    JobPlan,
    Note,
    PoolPlan,
    StudyPlan,
    Where,
    accelerators,
    boolean,
    check_json,
    check_keys,
    duration,
    entry_note,
    env_list,
    framework_requirement,
    hosts_python,
    install_commands,
    integer,
    items,
    job_name,
    mapping,
    merge_setup,
    module_command,
    note,
    string,
    strings,
    venv,
)
from .study import Notes, from_vertex

ROLES = ("chief", "worker", "ps", "evaluator")  # by position; [2] may be reduction servers
# baseOutputDirectory naming a directory on the hosts (as the inventory's `outputs:` takes it).
LOCAL_DIR = re.compile(r"^(/[A-Za-z0-9._-]+)+$")
REDUCTION_SERVER = re.compile(r"(^|/)vertex-ai-restricted/training/reductionserver([:@]|$)")

SPEC_KEYS = frozenset(
    {
        "workerPoolSpecs",
        "scheduling",
        "serviceAccount",
        "network",
        "reservedIpRanges",
        "baseOutputDirectory",
        "protectedArtifactLocationId",
        "tensorboard",
        "enableWebAccess",
        "enableDashboardAccess",
        "experiment",
        "experimentRun",
        "models",
        "persistentResourceId",
        "pscInterfaceConfig",
    }
)
POOL_KEYS = frozenset({"containerSpec", "pythonPackageSpec", "machineSpec", "replicaCount", "diskSpec", "nfsMounts"})
MACHINE_KEYS = frozenset({"machineType", "acceleratorType", "acceleratorCount", "tpuTopology", "reservationAffinity"})
CONTAINER_KEYS = frozenset({"imageUri", "command", "args", "env"})
PYTHON_KEYS = frozenset({"executorImageUri", "packageUris", "pythonModule", "args", "env"})
SCHEDULING_KEYS = frozenset({"timeout", "restartJobOnWorkerRestart", "disableRetries", "maxWaitDuration", "strategy"})
JOB_KEYS = frozenset({"displayName", "jobSpec", "labels", "encryptionSpec"})
TUNING_KEYS = frozenset(
    {
        "displayName",
        "trialJobSpec",
        "studySpec",
        "maxTrialCount",
        "parallelTrialCount",
        "maxFailedTrialCount",
        "labels",
        "encryptionSpec",
    }
)
# What the study (study.py) and the trial job read; the rest is named in the notes.
TUNING_HANDLED = frozenset(
    {"displayName", "trialJobSpec", "studySpec", "maxTrialCount", "parallelTrialCount", "maxFailedTrialCount"}
)
SCHEDULING_WHY = {
    "disableRetries": "provision never retries a whole job; a pool's `restart:` retries its tasks",
    "maxWaitDuration": "the job starts when you apply it",
    "strategy": "no spot or flex-start capacity: the hosts are yours",
}


@dataclass(frozen=True)
class LocalPackage:
    """A gcloud `local-package-path`: gcloud built an image from it; provision pushes it."""

    path: Path  # the local directory, resolved
    module: str | None
    script: str | None
    requirements: tuple[str, ...] = ()
    extra_packages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Source:
    """Where a CustomJobSpec came from, and what surrounds it."""

    origin: str  # for the header: "a CustomJob", "a `gcloud ai custom-jobs create` command (line 3)"
    name: str | None  # displayName, if any
    trial: str | None  # --trial (none for a tuning job: `provision tune` numbers its trials)
    notes: tuple[Note, ...] = ()  # not applied, found around the spec
    partly: tuple[Note, ...] = ()
    local: dict[int, LocalPackage] = field(default_factory=dict, hash=False, compare=False)
    name_path: str = "displayName"  # where the name was, for the note when it changes
    study: StudyPlan | None = None  # a tuning job's search


def from_data(data: JSON, display: str, *, job: str | None, trial: str | None, default_name: str) -> JobPlan:
    """A parsed JSON/YAML file: CustomJob, HyperparameterTuningJob or CustomJobSpec."""
    top = Where(display)
    if not isinstance(data, dict):
        top.fail(
            f"expected a CustomJob (jobSpec.workerPoolSpecs) or a CustomJobSpec (workerPoolSpecs), got {_what(data)}"
        )
    if "trainingInput" in data:
        top.fail("this is an AI Platform Training job (trainingInput): use `provision import ai-platform`")
    if "trialJobSpec" in data or "studySpec" in data:
        return from_tuning_job(data, top, job=job, default_name=default_name)
    if "jobSpec" in data:
        unknown = check_keys(data, top, JOB_KEYS)
        notes = [
            note(top / key, value, "not known to provision import" if key in unknown else None)
            for key, value in data.items()
            if key not in ("jobSpec", "displayName") and value
        ]
        spec = mapping(data["jobSpec"], top / "jobSpec")
        name = string(data["displayName"], top / "displayName") if "displayName" in data else None
        src = Source("a CustomJob", name, trial, tuple(notes))
        return from_spec(spec, top / "jobSpec", src, job=job, default_name=default_name)
    if "workerPoolSpecs" in data:
        return from_spec(data, top, Source("a CustomJobSpec", None, trial), job=job, default_name=default_name)
    keys = ", ".join(str(k) if str(k).isprintable() else repr(k) for k in list(data)[:6]) or "none"
    top.fail(f"expected a CustomJob (jobSpec.workerPoolSpecs) or a CustomJobSpec (workerPoolSpecs); keys found: {keys}")


def from_tuning_job(
    data: dict[str, JSON],
    top: Where,
    *,
    job: str | None,
    default_name: str,
    origin: str = "a HyperparameterTuningJob",
    notes: tuple[Note, ...] = (),
    name_path: str = "displayName",
) -> JobPlan:
    """A HyperparameterTuningJob: its trialJobSpec is the job, as for a CustomJob; its study
    becomes `tune:`, and `provision tune` numbers the trials (no task.trial here)."""
    unknown = check_keys(data, top, TUNING_KEYS | OUTPUT_FIELDS)
    found = Notes(list(notes))
    for key, value in data.items():
        if key not in TUNING_HANDLED and value:
            found.dropped.append(note(top / key, value, "not known to provision import" if key in unknown else None))
    if "trialJobSpec" not in data:
        top.fail("missing 'trialJobSpec' (the CustomJobSpec every trial runs)")
    study = from_vertex(data, top, found)
    spec = mapping(data["trialJobSpec"], top / "trialJobSpec")
    name = string(data["displayName"], top / "displayName") if "displayName" in data else None
    src = Source(origin, name, None, tuple(found.dropped), tuple(found.changed), name_path=name_path, study=study)
    return from_spec(spec, top / "trialJobSpec", src, job=job, default_name=default_name)


def _what(value: JSON) -> str:
    if isinstance(value, (dict, list, str)):
        return {dict: "a mapping", list: "a list", str: "text"}[type(value)]
    return repr(value)


def from_spec(spec: dict[str, JSON], at: Where, src: Source, *, job: str | None, default_name: str) -> JobPlan:  # noqa: C901  one branch per field of Vertex's CustomJobSpec
    """A CustomJobSpec (at `at`) → JobPlan."""
    check_json(spec, at)
    unknown = check_keys(spec, at, SPEC_KEYS)
    name = job or job_name(src.name or default_name)
    notes = list(src.notes)
    partly = list(src.partly)
    if src.name is not None and job is None and name != src.name:
        partly.append(Note(src.name_path, src.name, f"job names are DNS-1035 labels: job {name}"))

    raw_pools = spec.get("workerPoolSpecs")
    if isinstance(raw_pools, dict):  # gcloud's --config example gives the one pool as a mapping
        raw_pools = [raw_pools]
    listed = items(raw_pools, at / "workerPoolSpecs")
    if len(listed) > 4:
        (at / "workerPoolSpecs").fail(
            f"at most 4 worker pools (primary, workers, servers, evaluators), got {len(listed)}"
        )
    if not listed or not listed[0]:
        (at / "workerPoolSpecs" / 0).fail(
            "the first worker pool, the primary replica, is required and may not be empty"
        )

    restart = None
    timeout = None
    sched_at = at / "scheduling"
    sched = mapping(spec.get("scheduling"), sched_at)
    sched_unknown = check_keys(sched, sched_at, SCHEDULING_KEYS)
    for key, value in sched.items():
        if key == "timeout":
            timeout = duration(value, sched_at / key)
            partly.append(
                note(
                    sched_at / key,
                    value,
                    f"provision does not stop a job after a time: `provision wait INVENTORY --timeout {timeout}` exits 124 after that long, then `provision destroy` stops it",
                )
            )
        elif key == "restartJobOnWorkerRestart":
            if boolean(value, sched_at / key):
                restart = "OnFailure"
                partly.append(
                    note(
                        sched_at / key,
                        value,
                        "chief and workers get `restart: {policy: OnFailure}`: provision restarts the task that failed, not the whole job (`provision apply --rerun` restarts it whole)",
                    )
                )
        elif value:
            notes.append(
                note(
                    sched_at / key,
                    value,
                    "not known to provision import" if key in sched_unknown else SCHEDULING_WHY.get(key),
                )
            )

    env: list[tuple[str, str]] = []
    outputs: str | None = None
    for key, value in spec.items():
        if key == "baseOutputDirectory":
            bo_at = at / key
            prefix = string(mapping(value, bo_at).get("outputUriPrefix", ""), bo_at / "outputUriPrefix").rstrip("/")
            if prefix:
                outputs, env, why = _outputs(prefix, name, study=src.study is not None)
                partly.append(note(bo_at, value, why))
        elif key not in ("workerPoolSpecs", "scheduling") and value:
            notes.append(note(at / key, value, "not known to provision import" if key in unknown else None))

    pools: list[PoolPlan] = []
    setups: list[tuple[str, ...]] = []
    files: list[tuple[str, str]] = []
    for i, raw in enumerate(listed):
        if not raw:
            continue
        pool, pool_notes, pool_partly, setup, pool_files = _pool(
            i, raw, at / "workerPoolSpecs" / i, name, src.local.get(i)
        )
        if restart and pool.role in ("chief", "worker"):
            pool = replace(pool, restart=restart)
        pools.append(pool)
        notes += pool_notes
        partly += pool_partly
        setups.append(setup)
        files += [f for f in pool_files if f not in files]

    return JobPlan(
        service="Vertex AI",
        origin=src.origin,
        job=name,
        pools=tuple(pools),
        job_spec=spec,
        chief_name="chief",
        chief_why="Vertex AI names the primary replica `chief` in TF_CONFIG",
        trial=src.trial,
        env=tuple(env),
        outputs=outputs,
        files=tuple(files),
        setup=merge_setup(*setups),
        not_applied=tuple(notes),
        partly=tuple(partly),
        timeout=timeout,
        study=src.study,
    )


def _outputs(prefix: str, job: str, *, study: bool) -> tuple[str | None, list[tuple[str, str]], str]:
    """baseOutputDirectory's prefix → `outputs:`, or the env Vertex sets, and the note.

    A directory on the hosts is `outputs:` (AIP_MODEL_DIR and the rest under it; a trial's
    under BASE/N/, as Vertex gives trial N). A gs:// prefix: the three variables as they are
    for one job; a study's trials would share them and overwrite one another's model, so a
    study gets a directory on the hosts instead, and the note says so."""
    if LOCAL_DIR.match(prefix) and ".." not in prefix.split("/"):
        each = " (trial N's under BASE/N/, as Vertex gives it)" if study else ""
        return (
            prefix,
            [],
            f"outputs: {prefix}: AIP_MODEL_DIR, AIP_CHECKPOINT_DIR and AIP_TENSORBOARD_LOG_DIR under it{each}, as Vertex AI sets them",
        )
    if study:
        local = f"/data/{job}"
        return (
            local,
            [],
            f"outputs: {local}, a directory on the hosts: trial N gets AIP_MODEL_DIR={local}/N/model/ (and checkpoints/, logs/) "
            f"as Vertex gave it {prefix}/N/model/, and `provision fetch FILE --trial N` brings it back; "
            "one fixed gs:// path would be every trial's, each overwriting the others' model",
        )
    env = [(var, f"{prefix}/{sub}/") for var, sub in OUTPUT_DIRS]
    return (
        None,
        env,
        "set as AIP_MODEL_DIR, AIP_CHECKPOINT_DIR and AIP_TENSORBOARD_LOG_DIR, as Vertex AI does; gs:// paths need Cloud Storage credentials on the hosts (secret_env), or change them to local paths",
    )


def _pool(  # noqa: C901  one branch per field of Vertex's WorkerPoolSpec
    i: int, raw: JSON, at: Where, job: str, local: LocalPackage | None
) -> tuple[PoolPlan, list[Note], list[Note], tuple[str, ...], list[tuple[str, str]]]:
    """One workerPoolSpecs entry → the pool, its notes, setup commands and pushed files."""
    m = mapping(raw, at)
    unknown = check_keys(m, at, POOL_KEYS)
    notes: list[Note] = []
    partly: list[Note] = []
    for key, value in m.items():
        if key not in ("containerSpec", "pythonPackageSpec", "machineSpec", "replicaCount") and value:
            notes.append(note(at / key, value, "not known to provision import" if key in unknown else None))

    comments: list[str] = []
    if "replicaCount" in m:
        replicas = integer(m["replicaCount"], at / "replicaCount")
    else:
        replicas = 1
        comments.append("replicaCount not given: 1")
    if i == 0 and replicas != 1:
        (at / "replicaCount").fail(
            f"the primary replica pool runs exactly one replica (replicaCount 1), got {replicas}"
        )
    if i == 3 and replicas > 1:
        partly.append(
            note(
                at / "replicaCount",
                m["replicaCount"],
                "provision runs one evaluator (TensorFlow expects at most one): replicas 1",
            )
        )
        replicas = 1

    ms_at = at / "machineSpec"
    ms = mapping(m.get("machineSpec"), ms_at)
    ms_unknown = check_keys(ms, ms_at, MACHINE_KEYS)
    count, acc_type = accelerators(ms, ms_at, "acceleratorCount", "acceleratorType")
    for key, value in ms.items():
        if key not in ("acceleratorType", "acceleratorCount") and value:
            notes.append(note(ms_at / key, value, "not known to provision import" if key in ms_unknown else None))
    machine = str(ms.get("machineType") or "machine type not given")
    shape = f"{machine} with {count} x {acc_type}" if count else str(machine)

    has_container, has_python = "containerSpec" in m, "pythonPackageSpec" in m
    if has_container == has_python:
        at.fail("give containerSpec or pythonPackageSpec (one of them: what does this pool run?)")
    role = ROLES[i]
    what = ("the primary replica", "workers", "parameter servers", "evaluators")[i]
    setup: tuple[str, ...] = ()
    files: list[tuple[str, str]] = []
    image = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    if has_container:
        c_at = at / "containerSpec"
        c = mapping(m["containerSpec"], c_at)
        c_unknown = check_keys(c, c_at, CONTAINER_KEYS)
        for key in c_unknown:
            notes.append(note(c_at / key, c[key], "not known to provision import"))
        if "imageUri" not in c:
            c_at.fail("missing 'imageUri'")
        image = string(c["imageUri"], c_at / "imageUri")
        entry = strings(c.get("command"), c_at / "command")
        args = entry + strings(c.get("args"), c_at / "args")
        env = env_list(c.get("env"), c_at / "env")
        if entry:
            partly.append(entry_note(c_at / "command", entry, "Vertex AI"))
        if i == 2 and REDUCTION_SERVER.search(image):
            role, what = "reduction_server", "reduction servers"
            comments.append(
                "Vertex AI's reduction server image is not public outside Google Cloud: run your own "
                "program here (command:, see inventories/reduction-server.yaml) or an image with "
                "google-reduction-server installed"
            )
    else:
        p_at = at / "pythonPackageSpec"
        p = mapping(m["pythonPackageSpec"], p_at)
        p_unknown = check_keys(p, p_at, PYTHON_KEYS)
        for key in p_unknown:
            notes.append(note(p_at / key, p[key], "not known to provision import"))
        if "executorImageUri" not in p:
            p_at.fail("missing 'executorImageUri'")
        executor = string(p["executorImageUri"], p_at / "executorImageUri")
        packages = strings(p.get("packageUris"), p_at / "packageUris")
        env = env_list(p.get("env"), p_at / "env")
        py_args = strings(p.get("args"), p_at / "args")
        framework = framework_requirement(executor)
        python = f"{venv(job)}/bin/python"
        if local is not None:
            dest = f"/opt/{job}/{local.path.name}"
            files.append((str(local.path), dest))
            command = (
                (python, f"{dest}/{local.script}", *py_args)
                if local.script
                else module_command(job, str(local.module), py_args)
            )
            env = (("PYTHONPATH", dest), *env)  # `python -m` finds the package as in gcloud's image
            reqs = ((framework,) if framework else ()) + local.requirements
            pkgs = tuple(f"{dest}/{e}" for e in local.extra_packages)
            if (local.path / "requirements.txt").is_file():
                pkgs = ("-r", f"{dest}/requirements.txt", *pkgs)
            if (local.path / "setup.py").is_file() or (local.path / "pyproject.toml").is_file():
                pkgs = (*pkgs, dest)
            setup = install_commands(job, pkgs, reqs)
            comments.append(
                f"gcloud built an image from {local.path.name}/ on {executor}; here files: pushes it "
                f"to {dest} and the hosts' Python runs it in {venv(job)} (the setup block below)"
            )
        else:
            if "pythonModule" not in p:
                p_at.fail("missing 'pythonModule'")
            module = string(p["pythonModule"], p_at / "pythonModule")
            command = module_command(job, module, py_args)
            setup = install_commands(job, packages, (framework,) if framework else ())
            comments.append(
                f"Vertex AI ran `python -m {module}` in {executor} with the packages installed; {hosts_python(job)}"
            )
        why = (
            f"not run: the module runs with the hosts' Python; the setup block installs {framework} as this image had"
            if framework
            else "not run: the module runs with the hosts' Python; install what this image had in the setup block"
        )
        partly.append(note(p_at / "executorImageUri", executor, why))

    comments.insert(0, f"workerPoolSpecs[{i}], {what}: {shape}")
    return (
        PoolPlan(
            role,
            f"workerPoolSpecs[{i}]",
            replicas,
            count,
            acc_type,
            image,
            command,
            args,
            env,
            None,
            tuple(comments),
        ),
        notes,
        partly,
        setup,
        files,
    )
