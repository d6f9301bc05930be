"""`provision import`: a Vertex AI / AI Platform Training job as an inventory, checked the
whole way -- the CLI writes the file, `inventory.load` validates it, `render` writes every
task's env file, and each task's TF_CONFIG is read back by TensorFlow's own
TFConfigClusterResolver with the type, index and cluster the service would have given,
while CLUSTER_SPEC and TF_CONFIG carry the imported spec as `job`.

Seeds: the reduction-server `gcloud` command of Vertex AI's distributed-training page
(tests/fixtures/import/reduction_server.sh) and the job behind the TF_CONFIG example of AI
Platform's page (census_hptuning.yaml). Then a table of specs, every error a user can hit
(one line, exit 1), and the inventory's `job_spec:` key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from clirun import run
from provision.host.taskenv import parse_env
from provision.inventory.inventory import load, parse
from provision.placement.tasks import place
from provision.render.files import render

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "import"
RS_IMAGE = "us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver:latest"

HOSTS = """\
ssh: {user: root}
hosts:
  - {name: gpu-1, address: 192.0.2.11, accelerators: {type: nvidia-t4, count: 8}}
  - {name: gpu-2, address: 192.0.2.12, accelerators: {type: nvidia-t4, count: 8}}
  - {name: gpu-3, address: 192.0.2.13, accelerators: {type: nvidia-t4, count: 8}}
  - {name: gpu-4, address: 192.0.2.14, accelerators: {type: nvidia-t4, count: 8}}
  - {name: cpu-1, address: 192.0.2.21}
  - {name: cpu-2, address: 192.0.2.22}
  - {name: cpu-3, address: 192.0.2.23}
"""


@pytest.fixture(scope="module")
def tf() -> Any:
    """TensorFlow when importable (CI installs tensorflow-cpu); the JSON checks run without it."""
    try:
        import tensorflow as tf
    except ImportError:
        return None
    return tf


def task_envs(inv: Any) -> dict[str, dict[str, str]]:
    """Every task's env file, rendered and read back."""
    out: dict[str, dict[str, str]] = {}
    for bundle in render(inv).hosts.values():
        files = {f.path: f for f in bundle.files}
        for unit in bundle.tasks:
            out[unit.task.name] = dict(parse_env(files[unit.env_path].data().decode()))
    return out


def check_cluster(
    tf: Any, monkeypatch: pytest.MonkeyPatch, inv: Any, job: dict[str, Any], trial: str | None
) -> dict[str, dict[str, Any]]:
    """Every task's TF_CONFIG and CLUSTER_SPEC as the service would have set them; returns
    the TF_CONFIG documents by task name."""
    placement = place(inv)
    chief = inv.tf_config.chief_name
    training: dict[str, list[str]] = {}
    for role, key in (("chief", chief), ("worker", "worker"), ("ps", "ps")):
        if placement.by_role(role):
            training[key] = [t.address for t in placement.by_role(role)]
    pools: dict[str, list[str]] = {}
    for role, n in (("chief", 0), ("worker", 1), ("ps", 2), ("reduction_server", 2), ("evaluator", 3)):
        if placement.by_role(role):
            pools[f"workerpool{n}"] = [t.address for t in placement.by_role(role)]
    envs = task_envs(inv)
    assert set(envs) == {t.name for t in placement.tasks}
    docs: dict[str, dict[str, Any]] = {}
    for t in placement.tasks:
        env = envs[t.name]
        spec = json.loads(env["CLUSTER_SPEC"])
        want_task = {
            "type": f"workerpool{ {'chief': 0, 'worker': 1, 'ps': 2, 'reduction_server': 2, 'evaluator': 3}[t.role] }",
            "index": t.index,
        }
        if trial is not None:
            want_task["trial"] = trial
        assert spec == {"cluster": pools, "environment": "cloud", "task": want_task, "job": job}, t.name
        if len(placement.tasks) == 1 or t.role == "reduction_server":
            assert "TF_CONFIG" not in env, t.name  # the services set none for these
            continue
        doc = json.loads(env["TF_CONFIG"])
        want_type = chief if t.role == "chief" else t.role
        want_cluster = dict(training, **({"evaluator": [t.address]} if t.role == "evaluator" else {}))
        want = {"type": want_type, "index": t.index, **({"trial": trial} if trial is not None else {})}
        assert doc == {"cluster": want_cluster, "task": want, "environment": "cloud", "job": job}, t.name
        if tf is not None:
            monkeypatch.setenv("TF_CONFIG", env["TF_CONFIG"])
            r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            assert (r.task_type, r.task_id) == (want_type, t.index), t.name
            assert r.cluster_spec().as_dict() == want_cluster, t.name
        docs[t.name] = doc
    return docs


def _unwrapped(text: str) -> str:
    """Comment text as one line: a long comment is wrapped at any word."""
    return " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())


def do_import(tmp: Path, service: str, spec: str, *extra: str, hosts: str | None = HOSTS) -> tuple[Path, str, str]:
    args = ["import", service, spec, "-o", "out.yaml", *extra]
    if hosts is not None:
        (tmp / "hosts.yaml").write_text(hosts)
        args += ["--hosts", "hosts.yaml"]
    code, out, err = run(*args, cwd=tmp)
    assert code == 0, err
    assert "Traceback" not in err
    return tmp / "out.yaml", out, err


# --------------------------------------------------------------------------- the seeds


def test_vertex_reduction_server_gcloud_command(tmp_path: Path, tf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Vertex AI's reduction-server command: one chief and four workers with 8 V100s each,
    sixteen n1-highcpu-16 reduction servers (workerpool2, never TF tasks)."""
    code, _, err = run(
        "import",
        "vertex",
        str(FIXTURES / "reduction_server.sh"),
        "--hosts",
        str(FIXTURES / "hosts-v100.yaml"),
        "-o",
        "job.yaml",
        cwd=tmp_path,
    )
    assert code == 0, err
    assert err.startswith("Wrote job.yaml: job job-name (chief 1, worker 4, reduction_server 16)")
    assert "warning" not in err  # V100 on hosts that declare nvidia-v100: the same type

    code, out, err = run("validate", "job.yaml", cwd=tmp_path)
    assert code == 0, err
    inv = load(tmp_path / "job.yaml")
    pools = {p.role: p for p in inv.pools}
    assert [(p.role, p.replicas, p.accelerators, p.image) for p in inv.pools] == [
        ("chief", 1, 8, "CUSTOM_CONTAINER_IMAGE_URI"),
        ("worker", 4, 8, "CUSTOM_CONTAINER_IMAGE_URI"),
        ("reduction_server", 16, 0, RS_IMAGE),
    ]
    assert pools["chief"].args == () and inv.tf_config.chief_name == "chief"
    spec = {
        "workerPoolSpecs": [
            {
                "machineSpec": {
                    "machineType": "n1-highmem-96",
                    "acceleratorType": "NVIDIA_TESLA_V100",
                    "acceleratorCount": 8,
                },
                "replicaCount": "1",
                "containerSpec": {"imageUri": "CUSTOM_CONTAINER_IMAGE_URI"},
            },
            {
                "machineSpec": {
                    "machineType": "n1-highmem-96",
                    "acceleratorType": "NVIDIA_TESLA_V100",
                    "acceleratorCount": 8,
                },
                "replicaCount": "4",
                "containerSpec": {"imageUri": "CUSTOM_CONTAINER_IMAGE_URI"},
            },
            {
                "machineSpec": {"machineType": "n1-highcpu-16"},
                "replicaCount": "16",
                "containerSpec": {"imageUri": RS_IMAGE},
            },
        ]
    }
    assert inv.job_spec == spec

    docs = check_cluster(tf, monkeypatch, inv, spec, None)
    assert set(docs) == {"chief-0", "worker-0", "worker-1", "worker-2", "worker-3"}
    assert set(docs["worker-3"]["cluster"]) == {"chief", "worker"}  # reduction servers are no TF tasks
    envs = task_envs(inv)
    placement = place(inv)
    assert json.loads(envs["chief-0"]["CLUSTER_SPEC"])["cluster"]["workerpool2"] == [
        t.address for t in placement.by_role("reduction_server")
    ]
    assert len(placement.by_role("reduction_server")) == 16
    assert all(not t.host.accelerators for t in placement.by_role("reduction_server"))  # the CPU hosts
    assert envs["worker-3"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"

    text = (tmp_path / "job.yaml").read_text()
    assert "# Not applied, and why:\n#   - --region: LOCATION\n#       your hosts are where they are\n" in text
    assert "#   - workerPoolSpecs[2].machineSpec.machineType: n1-highcpu-16\n" in text
    assert "#   - --display-name: JOB_NAME\n#       job names are DNS-1035 labels: job job-name\n" in text
    assert "reduction server image is not public outside Google Cloud" in text


def test_reduction_server_on_other_gpus_warns(tmp_path: Path) -> None:
    hosts = (FIXTURES / "hosts-v100.yaml").read_text().replace("nvidia-v100", "nvidia-h100")
    (tmp_path / "h100.yaml").write_text(hosts)
    code, _, err = run(
        "import",
        "vertex",
        str(FIXTURES / "reduction_server.sh"),
        "--hosts",
        "h100.yaml",
        "-o",
        "job.yaml",
        cwd=tmp_path,
    )
    assert code == 0, err
    assert err.splitlines()[0].startswith(
        "warning: pools.chief: Vertex AI gave it NVIDIA_TESLA_V100; the hosts have nvidia-h100 (gpu-1, gpu-2, gpu-3, ...)"
    )
    assert "  # CHECK: Vertex AI gave it NVIDIA_TESLA_V100" in (tmp_path / "job.yaml").read_text()


def test_ai_platform_tf_config_example(tmp_path: Path, tf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job of AI Platform's TF_CONFIG example: runtime 2.1, a master, two workers and a
    parameter server, a tuning job. Worker 0 sees what the page shows but task.trial, which
    `provision tune` sets for each trial (the study is tune:, tests/test_import_tuning.py)."""
    out, _, err = do_import(tmp_path, "ai-platform", str(FIXTURES / "census_hptuning.yaml"))
    assert "applied in part" in err
    inv = load(out)
    ti = yaml.safe_load((FIXTURES / "census_hptuning.yaml").read_text())["trainingInput"]
    assert inv.job_spec == ti and inv.job == "census-hptuning"
    assert (inv.tf_config.chief_name, inv.tf_config.trial) == ("chief", None)
    docs = check_cluster(tf, monkeypatch, inv, ti, None)
    worker0 = docs["worker-0"]
    # The page's example, with its addresses: the same keys, lengths and task.
    assert {k: len(v) for k, v in worker0["cluster"].items()} == {"chief": 1, "ps": 1, "worker": 2}
    assert worker0["task"] == {"index": 0, "type": "worker"}
    assert worker0["environment"] == "cloud" and worker0["job"] == ti
    cmd = (
        "/opt/venvs/census-hptuning/bin/python",
        "-m",
        "trainer.task",
        "--train-files",
        "gs://example-bucket/census/adult.data.csv",
        "--num-epochs",
        "5",
        "--job-dir",
        "gs://example-bucket/census/job",
    )
    assert inv.pools and all(p.command == cmd for p in inv.pools)  # AI Platform ran the same program everywhere
    text = out.read_text()
    assert "#     - /opt/venvs/census-hptuning/bin/pip install 'tensorflow~=2.1.0'\n" in text
    assert "# runtime version 2.1 (2.1 or later): AI Platform named the master `chief`.\n" in text


def test_ai_platform_legacy_master(tmp_path: Path, tf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same job without runtime 2.1, useChiefInTfConfig or an evaluator: `master`. Its
    third trial as a plain job: without hyperparameters, with --trial."""
    doc = yaml.safe_load((FIXTURES / "census_hptuning.yaml").read_text())
    del doc["trainingInput"]["runtimeVersion"]
    del doc["trainingInput"]["hyperparameters"]
    (tmp_path / "job.json").write_text(json.dumps(doc))
    out, _, _ = do_import(tmp_path, "ai-platform", "job.json", "--trial", "3")
    inv = load(out)
    assert (inv.tf_config.chief_name, inv.tf_config.trial) == ("master", "3")
    docs = check_cluster(tf, monkeypatch, inv, doc["trainingInput"], "3")
    assert docs["chief-0"]["task"] == {"type": "master", "index": 0, "trial": "3"}
    assert "master" in docs["ps-0"]["cluster"] and "chief" not in docs["ps-0"]["cluster"]


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    id: str
    service: str
    file: str
    text: str
    pools: dict[str, dict[str, Any]]  # role -> Pool attributes it must have
    spec_at: tuple[str, ...] = ()  # where the spec is in the file (job_spec)
    job_spec: dict[str, Any] | None = None  # when not in the file (gcloud)
    job: str = ""
    chief_name: str = "chief"
    trial: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # written beside the spec
    in_text: tuple[str, ...] = ()  # lines the output must have

    def spec(self) -> dict[str, Any]:
        if self.job_spec is not None:
            return self.job_spec
        doc = json.loads(self.text) if self.file.endswith(".json") else yaml.safe_load(self.text)
        for key in self.spec_at:
            doc = doc[key]
        return doc


IMG = "us-docker.pkg.dev/example/train/mnist:1.4"
T4 = {"machineType": "n1-standard-8", "acceleratorType": "NVIDIA_TESLA_T4", "acceleratorCount": 1}
PY_SPEC = {
    "executorImageUri": "us-docker.pkg.dev/vertex-ai/training/tf-gpu.2-12.py310:latest",
    "packageUris": ["gs://example-bucket/trainer-0.2.tar.gz"],
    "pythonModule": "trainer.task",
    "args": ["--epochs=10"],
    "env": [{"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"}],
}
TORCH = "us-docker.pkg.dev/vertex-ai/training/pytorch-gpu.1-13.py310:latest"
TF_CPU = "us-docker.pkg.dev/vertex-ai/training/tf-cpu.2-12.py310:latest"

CASES = [
    Case(
        "vertex-customjob-json-container-env-args",
        "vertex",
        "mnist.json",
        json.dumps(
            {
                "displayName": "MNIST multi-worker",
                "jobSpec": {
                    "workerPoolSpecs": [
                        {
                            "machineSpec": {**T4, "acceleratorCount": 2},
                            "replicaCount": "1",
                            "diskSpec": {"bootDiskType": "pd-ssd", "bootDiskSizeGb": 100},
                            "containerSpec": {
                                "imageUri": IMG,
                                "command": ["python3", "-m", "mnist.train"],
                                "args": ["--epochs", "3", '--note=a "quoted" value: #1 ünï'],
                                "env": [{"name": "LOG_LEVEL", "value": "info"}, {"name": "EMPTY", "value": ""}],
                            },
                        },
                        {
                            "machineSpec": {**T4, "acceleratorCount": 2},
                            "replicaCount": "2",
                            "containerSpec": {"imageUri": IMG, "args": ["--epochs", "3"]},
                        },
                    ],
                    "scheduling": {"timeout": "3600s", "restartJobOnWorkerRestart": True},
                    "serviceAccount": "trainer@example.iam.gserviceaccount.com",
                    "baseOutputDirectory": {"outputUriPrefix": "gs://example-bucket/mnist/"},
                },
            },
            indent=2,
        ),
        {
            "chief": {
                "replicas": 1,
                "accelerators": 2,
                "image": IMG,
                "args": ("python3", "-m", "mnist.train", "--epochs", "3", '--note=a "quoted" value: #1 ünï'),
                "env": (("LOG_LEVEL", "info"), ("EMPTY", "")),
                "restart.policy": "OnFailure",
            },
            "worker": {"replicas": 2, "accelerators": 2, "args": ("--epochs", "3"), "restart.policy": "OnFailure"},
        },
        spec_at=("jobSpec",),
        job="mnist-multi-worker",
        env={
            "AIP_MODEL_DIR": "gs://example-bucket/mnist/model/",
            "AIP_CHECKPOINT_DIR": "gs://example-bucket/mnist/checkpoints/",
            "AIP_TENSORBOARD_LOG_DIR": "gs://example-bucket/mnist/logs/",
        },
        in_text=(
            "# Vertex AI stopped this job after 3600 s; provision does not: `provision wait FILE --timeout 3600`",
            "#   - jobSpec.serviceAccount: trainer@example.iam.gserviceaccount.com",
            '#   - jobSpec.workerPoolSpecs[0].diskSpec: {"bootDiskType": "pd-ssd", "bootDiskSizeGb": 100}',
            "#   - jobSpec.scheduling.restartJobOnWorkerRestart: true",
        ),
    ),
    Case(
        "vertex-gcloud-config-yaml-one-pool-mapping",
        "vertex",
        "config.yaml",
        # gcloud's own --config example: workerPoolSpecs as one mapping
        "workerPoolSpecs:\n  machineSpec:\n    machineType: n1-highmem-2\n  replicaCount: 1\n  containerSpec:\n"
        "    imageUri: gcr.io/ucaip-test/ucaip-training-test\n    args:\n    - port=8500\n    command:\n    - start\n",
        {"chief": {"replicas": 1, "image": "gcr.io/ucaip-test/ucaip-training-test", "args": ("start", "port=8500")}},
        job="config",
    ),
    Case(
        "vertex-spec-empty-slots-evaluator",
        "vertex",
        "slots.json",
        json.dumps(
            {
                "workerPoolSpecs": [
                    {
                        "machineSpec": {"machineType": "n1-standard-4"},
                        "replicaCount": "1",
                        "containerSpec": {"imageUri": "registry.example/trainer:2", "args": ["--role=coordinator"]},
                    },
                    {},
                    {},
                    {
                        "machineSpec": {"machineType": "n1-standard-4"},
                        "replicaCount": "1",
                        "containerSpec": {"imageUri": "registry.example/trainer:2", "args": ["--role=evaluator"]},
                    },
                ]
            }
        ),
        {
            "chief": {"replicas": 1, "args": ("--role=coordinator",)},
            "evaluator": {"replicas": 1, "args": ("--role=evaluator",)},
        },
        job="slots",
    ),
    Case(
        "vertex-customjob-yaml-ps-evaluator",
        "vertex",
        "census.yaml",
        """\
displayName: census-ps
jobSpec:
  workerPoolSpecs:
    - machineSpec: {machineType: n1-standard-4}
      replicaCount: 1
      containerSpec: {imageUri: registry.example/census:3, args: [--mode, coordinator]}
    - machineSpec: {machineType: n1-standard-4}
      replicaCount: 2
      containerSpec: {imageUri: registry.example/census:3, args: [--mode, worker]}
    - machineSpec: {machineType: n1-highmem-8}
      replicaCount: 1
      containerSpec:
        imageUri: registry.example/census:3
        args: [--mode, ps]
        env: [{name: GRPC_VERBOSITY, value: ERROR}]
    - machineSpec: {machineType: n1-standard-4}
      replicaCount: 1
      containerSpec: {imageUri: registry.example/census:3, args: [--mode, evaluator]}
  enableWebAccess: true
labels: {team: ads}
""",
        {
            "chief": {"args": ("--mode", "coordinator")},
            "worker": {"replicas": 2, "args": ("--mode", "worker")},
            "ps": {"replicas": 1, "env": (("GRPC_VERBOSITY", "ERROR"),)},
            "evaluator": {"args": ("--mode", "evaluator")},
        },
        spec_at=("jobSpec",),
        job="census-ps",
        in_text=('#   - labels: {"team": "ads"}', "#   - jobSpec.enableWebAccess: true"),
    ),
    Case(
        "vertex-python-package",
        "vertex",
        "python_package.json",
        json.dumps(
            {
                "workerPoolSpecs": [
                    {"machineSpec": T4, "replicaCount": "1", "pythonPackageSpec": PY_SPEC},
                    {"machineSpec": T4, "replicaCount": "3", "pythonPackageSpec": PY_SPEC},
                ]
            }
        ),
        {
            "chief": {
                "command": ("/opt/venvs/python-package/bin/python", "-m", "trainer.task", "--epochs=10"),
                "image": None,
                "env": (("TF_CPP_MIN_LOG_LEVEL", "2"),),
                "accelerators": 1,
            },
            "worker": {
                "replicas": 3,
                "command": ("/opt/venvs/python-package/bin/python", "-m", "trainer.task", "--epochs=10"),
            },
        },
        job="python-package",
        in_text=(
            "#     - python3 -m venv /opt/venvs/python-package",
            "#     - 'gcloud storage cp gs://example-bucket/trainer-0.2.tar.gz /opt/venvs/python-package/packages/'",
            "#     - /opt/venvs/python-package/bin/pip install 'tensorflow~=2.12.0'",
            "#     - /opt/venvs/python-package/bin/pip install /opt/venvs/python-package/packages/trainer-0.2.tar.gz",
        ),
    ),
    Case(
        "vertex-hyperparameter-tuning-job",
        "vertex",
        "tune.json",
        json.dumps(
            {
                "displayName": "tune-lr",
                "maxTrialCount": 8,
                "parallelTrialCount": 2,
                "studySpec": {
                    "metrics": [{"metricId": "accuracy", "goal": "MAXIMIZE"}],
                    "parameters": [{"parameterId": "lr", "doubleValueSpec": {"minValue": 0.001, "maxValue": 0.1}}],
                },
                "trialJobSpec": {
                    "workerPoolSpecs": [
                        {
                            "machineSpec": {"machineType": "n1-standard-4"},
                            "replicaCount": "1",
                            "containerSpec": {"imageUri": "registry.example/tune:1"},
                        },
                        {
                            "machineSpec": {"machineType": "n1-standard-4"},
                            "replicaCount": "1",
                            "containerSpec": {"imageUri": "registry.example/tune:1"},
                        },
                    ]
                },
            }
        ),
        {"chief": {"replicas": 1}, "worker": {"replicas": 1}},
        spec_at=("trialJobSpec",),
        job="tune-lr",
        in_text=(
            "tf_config: {chief_name: chief}\n",
            "tune:\n  metric: {name: accuracy, goal: maximize}\n  parameters:\n    lr: {type: double, min: 0.001, max: 0.1}\n",
            "  max_trials: 8\n  parallel_trials: 2\n  early_stopping: none\n",
        ),
    ),
    Case(
        "gcloud-python-module-variables-args",
        "vertex",
        "train.sh",
        f"""\
#!/bin/bash
set -euo pipefail
REGION=us-central1
EXECUTOR="{TORCH}"
export PACKAGE=gs://example-bucket/pkgs/trainer-1.0.tar.gz
STAMP=$(date +%s)  # not used by the command: fine

gcloud ai custom-jobs create --region="$REGION" --display-name=torch_ddp \\
  --python-package-uris="$PACKAGE" \\
  --worker-pool-spec=machine-type=n1-standard-8,replica-count=1,accelerator-type=NVIDIA_TESLA_T4,accelerator-count=1,executor-image-uri=$EXECUTOR,python-module=trainer.ddp \\
  --worker-pool-spec=machine-type=n1-standard-8,replica-count=2,accelerator-type=NVIDIA_TESLA_T4,accelerator-count=1,executor-image-uri=${{EXECUTOR}},python-module=trainer.ddp \\
  --args=--epochs=2,--backend=nccl   # two arguments: gcloud splits them at the comma
echo "submitted $STAMP"
""",
        {
            "chief": {
                "command": ("/opt/venvs/torch-ddp/bin/python", "-m", "trainer.ddp", "--epochs=2", "--backend=nccl"),
                "accelerators": 1,
            },
            "worker": {
                "replicas": 2,
                "command": ("/opt/venvs/torch-ddp/bin/python", "-m", "trainer.ddp", "--epochs=2", "--backend=nccl"),
            },
        },
        job_spec={
            "workerPoolSpecs": [
                {
                    "machineSpec": T4,
                    "replicaCount": n,
                    "pythonPackageSpec": {
                        "executorImageUri": TORCH,
                        "packageUris": ["gs://example-bucket/pkgs/trainer-1.0.tar.gz"],
                        "pythonModule": "trainer.ddp",
                        "args": ["--epochs=2", "--backend=nccl"],
                    },
                }
                for n in ("1", "2")
            ]
        },
        job="torch-ddp",
        in_text=("#     - /opt/venvs/torch-ddp/bin/pip install 'torch~=1.13.0'", "#   - --region: us-central1"),
    ),
    Case(
        "gcloud-local-package-script",
        "vertex",
        "local.sh",
        f"""\
gcloud ai custom-jobs create \\
  --region=europe-west4 \\
  --display-name='local pkg' \\
  --worker-pool-spec=machine-type=n1-standard-4,replica-count=1,executor-image-uri={TF_CPU},local-package-path=trainer_pkg,script=task.py \\
  --worker-pool-spec=machine-type=n1-standard-4,replica-count=2,executor-image-uri={TF_CPU},local-package-path=trainer_pkg,script=task.py
""",
        {
            "chief": {
                "command": ("/opt/venvs/local-pkg/bin/python", "/opt/local-pkg/trainer_pkg/task.py"),
                "env": (("PYTHONPATH", "/opt/local-pkg/trainer_pkg"),),
            },
            "worker": {
                "replicas": 2,
                "command": ("/opt/venvs/local-pkg/bin/python", "/opt/local-pkg/trainer_pkg/task.py"),
            },
        },
        job_spec={
            "workerPoolSpecs": [
                {
                    "machineSpec": {"machineType": "n1-standard-4"},
                    "replicaCount": n,
                    "pythonPackageSpec": {"executorImageUri": TF_CPU, "packageUris": [], "pythonModule": "task"},
                }
                for n in ("1", "2")
            ]
        },
        job="local-pkg",
        files={"trainer_pkg/task.py": "print('training')\n", "trainer_pkg/requirements.txt": "numpy\n"},
        in_text=(
            "  - {src: trainer_pkg/, dest: /opt/local-pkg/trainer_pkg/}",
            "#     - /opt/venvs/local-pkg/bin/pip install -r /opt/local-pkg/trainer_pkg/requirements.txt",
        ),
    ),
    Case(
        "ai-platform-containers-master-image-inherited",
        "ai-platform",
        "census_containers.json",
        json.dumps(
            {
                "scaleTier": "CUSTOM",
                "masterType": "n1-highmem-8",
                "masterConfig": {
                    "imageUri": "gcr.io/example/census:latest",
                    "acceleratorConfig": {"count": "1", "type": "NVIDIA_TESLA_T4"},
                },
                "workerType": "n1-highmem-8",
                "workerCount": "2",
                "workerConfig": {"acceleratorConfig": {"count": "1", "type": "NVIDIA_TESLA_T4"}},
                "args": ["--epochs", "4", "--bucket", "gs://example-bucket"],
                "region": "us-central1",
            }
        ),
        {
            "chief": {
                "image": "gcr.io/example/census:latest",
                "accelerators": 1,
                "args": ("--epochs", "4", "--bucket", "gs://example-bucket"),
            },
            "worker": {
                "replicas": 2,
                "image": "gcr.io/example/census:latest",
                "accelerators": 1,
                "args": ("--epochs", "4", "--bucket", "gs://example-bucket"),
            },
        },
        job="census-containers",
        chief_name="master",
        in_text=("  # no imageUri of its own: masterConfig's, as AI Platform does",),
    ),
    Case(
        "ai-platform-job-yaml-evaluator-container-command",
        "ai-platform",
        "estimator.yaml",
        """\
jobId: estimator_eval
trainingInput:
  scaleTier: CUSTOM
  masterType: n1-standard-8
  masterConfig:
    imageUri: gcr.io/example/estimator:1
    containerCommand: [python3, -m, est.main]
    containerArgs: [--train-steps, "1000"]
  workerType: n1-standard-8
  workerCount: 2
  workerConfig: {imageUri: gcr.io/example/estimator:1, containerArgs: [--role, worker]}
  parameterServerType: n1-standard-4
  parameterServerCount: 1
  evaluatorType: n1-standard-4
  evaluatorCount: 1
  scheduling: {maxRunningTime: 7200s}
""",
        {
            "chief": {"args": ("python3", "-m", "est.main", "--train-steps", "1000")},
            "worker": {"replicas": 2, "args": ("--role", "worker")},
            "ps": {"image": "gcr.io/example/estimator:1", "args": ()},
            "evaluator": {"replicas": 1, "args": ()},
        },
        spec_at=("trainingInput",),
        job="estimator-eval",
        in_text=(
            "# the job has an evaluator: AI Platform named the master `chief`.",
            "# AI Platform Training stopped this job after 7200 s; provision does not: `provision wait FILE --timeout",
        ),
    ),
    Case(
        "ai-platform-use-chief-legacy-gpu-machine",
        "ai-platform",
        "legacy.json",
        json.dumps(
            {
                "jobId": "legacy_v100",
                "trainingInput": {
                    "scaleTier": "CUSTOM",
                    "masterType": "complex_model_m_v100",
                    "workerType": "complex_model_m_v100",
                    "workerCount": "1",
                    "useChiefInTfConfig": True,
                    "masterConfig": {"imageUri": "gcr.io/example/tf2:latest"},
                },
            }
        ),
        {"chief": {"accelerators": 4}, "worker": {"replicas": 1, "accelerators": 4}},
        spec_at=("trainingInput",),
        job="legacy-v100",
        in_text=("#   - trainingInput.masterType: complex_model_m_v100", "    accelerators: 4  # NVIDIA_TESLA_V100"),
    ),
    Case(
        "ai-platform-basic-gpu-runtime-package",
        "ai-platform",
        "basic.yaml",
        """\
scaleTier: BASIC_GPU
packageUris: [gs://example-bucket/pkg/trainer-0.1.tar.gz, gs://example-bucket/pkg/util-0.3.tar.gz]
pythonModule: trainer.task
args: [--steps, "100"]
runtimeVersion: "1.15"
pythonVersion: "3.7"
region: us-east1
""",
        {
            "chief": {
                "replicas": 1,
                "accelerators": 1,
                "command": ("/opt/venvs/basic/bin/python", "-m", "trainer.task", "--steps", "100"),
            }
        },
        job="basic",
        chief_name="master",
        in_text=(
            "#     - /opt/venvs/basic/bin/pip install /opt/venvs/basic/packages/trainer-0.1.tar.gz /opt/venvs/basic/packages/util-0.3.tar.gz",
        ),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_round_trip(case: Case, tmp_path: Path, tf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / case.file).write_text(case.text)
    for rel, content in case.files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content)
    out, _, _ = do_import(tmp_path, case.service, case.file)
    text = out.read_text()
    for line in case.in_text:
        assert line in text or _unwrapped(line) in _unwrapped(text), line
    assert run("validate", "out.yaml", cwd=tmp_path)[0] == 0
    inv = load(out)
    assert inv.job == case.job
    assert (inv.tf_config.chief_name, inv.tf_config.trial) == (case.chief_name, case.trial)
    assert inv.job_spec == case.spec()
    assert dict(inv.env) == case.env
    assert {p.role for p in inv.pools} == set(case.pools)
    for role, want in case.pools.items():
        pool = inv.pool(role)
        assert pool is not None
        for attr, value in want.items():
            got = pool.restart.policy if attr == "restart.policy" else getattr(pool, attr)
            assert got == value, (role, attr)
    check_cluster(tf, monkeypatch, inv, case.spec(), case.trial)
    # The file reads back to the same inventory as a person would edit it: YAML, comments and all.
    assert yaml.safe_load(text)["job_spec"] == case.spec()


def test_table_is_wide_enough() -> None:
    """At least eight specs, with containers, Python packages, evaluators, empty slots, env and args."""
    assert len(CASES) >= 8
    joined = " ".join(c.text for c in CASES)
    for needle in ("containerSpec", "pythonPackageSpec", "evaluatorCount", "{}, {}", '"env"', "args", "python-module"):
        assert needle in joined, needle


def test_without_hosts_a_placeholder_list(tmp_path: Path) -> None:
    code, _, err = run("import", "vertex", str(FIXTURES / "reduction_server.sh"), "-o", "job.yaml", cwd=tmp_path)
    assert code == 0, err
    assert "Next: replace the example hosts with yours" in err
    text = (tmp_path / "job.yaml").read_text()
    assert "# Training ran" not in text
    assert "Vertex AI ran this job on 5 machines with 8 x nvidia-v100 and 16 machines without accelerators" in " ".join(
        line.lstrip("# ") for line in text.splitlines()
    )
    assert "  # - {name: gpu-1, address: 192.0.2.1, accelerators: {type: nvidia-v100, count: 8}}\n" in text
    assert "  # - {name: cpu-16, address: 192.0.2.21}\n" in text
    code, _, err = run("validate", "job.yaml", cwd=tmp_path)
    assert code == 1 and "hosts: expected a non-empty list of hosts" in err
    # Uncommenting the example lines gives a valid inventory.
    live = "\n".join(line.replace("  # - {name:", "  - {name:") for line in text.splitlines())
    inv = parse(live, tmp_path / "job.yaml")
    assert len(place(inv).tasks) == 21


def test_stdout_when_no_output(tmp_path: Path) -> None:
    code, out, err = run("import", "ai-platform", str(FIXTURES / "census_hptuning.yaml"), cwd=tmp_path)
    assert code == 0, err
    assert out.startswith("# AI Platform Training job imported by `provision import ai-platform")
    assert "job_spec:\n  scaleTier: CUSTOM\n" in out
    assert err.startswith("Imported: job census-hptuning (chief 1, worker 2, ps 1);")


def test_output_that_does_not_validate_is_written_and_says_why(tmp_path: Path) -> None:
    """Vertex AI's own example of a primary replica and a parameter-server pool (no
    workers): provision's validation refuses that shape, and the import says so."""
    (tmp_path / "ps.json").write_text(
        json.dumps(
            {
                "workerPoolSpecs": [
                    {
                        "machineSpec": {"machineType": "n1-standard-4"},
                        "replicaCount": 1,
                        "containerSpec": {"imageUri": "registry.example/t:1"},
                    },
                    {},
                    {
                        "machineSpec": {"machineType": "n1-standard-4"},
                        "replicaCount": 1,
                        "containerSpec": {"imageUri": "registry.example/t:1"},
                    },
                ]
            }
        )
    )
    (tmp_path / "hosts.yaml").write_text(HOSTS)
    code, _, err = run("import", "vertex", "ps.json", "--hosts", "hosts.yaml", "-o", "out.yaml", cwd=tmp_path)
    assert code == 1
    lines = err.splitlines()
    assert lines[0] == "Error: out.yaml: written, but it does not validate yet: fix these, then `provision validate`"
    assert (
        lines[1].startswith("Error: out.yaml:")
        and "pools.ps: parameter-server training needs a chief (coordinator) and workers; this job has no worker"
        in lines[1]
    )
    assert (tmp_path / "out.yaml").exists()


# --------------------------------------------------------------------------- errors: one line, exit 1

CJ = {
    "displayName": "x",
    "jobSpec": {
        "workerPoolSpecs": [
            {
                "machineSpec": {"machineType": "n1-standard-4"},
                "replicaCount": "1",
                "containerSpec": {"imageUri": "r.example/t:1"},
            },
            {
                "machineSpec": {"machineType": "n1-standard-4"},
                "replicaCount": "many",
                "containerSpec": {"imageUri": "r.example/t:1"},
            },
        ]
    },
}
GOOD_POOL = "--worker-pool-spec=machine-type=n1-standard-4,replica-count=1,container-image-uri=r.example/t:1"


def _with(path: list[Any], value: Any) -> str:
    doc = json.loads(json.dumps(CJ))
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return json.dumps(doc)


ERRORS = [
    (
        "vertex",
        "bad.json",
        json.dumps(CJ),
        "bad.json: jobSpec.workerPoolSpecs[1].replicaCount: expected an integer, got 'many'",
    ),
    (
        "vertex",
        "bad.json",
        '{"jobSpec": {\n  "workerPoolSpecs": [,]\n}}',
        "bad.json:2: invalid JSON: Expecting value (column 23)",
    ),
    ("vertex", "bad.yaml", "jobSpec:\n  workerPoolSpecs: [a\n  b: c\n", "bad.yaml:3: invalid YAML: "),
    (
        "vertex",
        "job.sh",
        "#!/bin/sh\ngcloud ai-platform jobs submit training x --config c.yaml\n",
        "job.sh:2: `gcloud ai-platform jobs submit training` submits an AI Platform Training job: use `provision import ai-platform`",
    ),
    (
        "vertex",
        "job.sh",
        "#!/bin/sh\ngcloud ai-platform jobs list\n",
        "job.sh: neither a CustomJob / CustomJobSpec (JSON or YAML with workerPoolSpecs) nor a shell script with a `gcloud ai custom-jobs create` command (or `hp-tuning-jobs create`)",
    ),
    (
        "vertex",
        "job.sh",
        f"gcloud ai custom-jobs create {GOOD_POOL} \\\n  --worker-pool-spec=replica-count=many,container-image-uri=r/t:1\n",
        "job.sh:2: --worker-pool-spec[1].replica-count: expected an integer, got 'many'",
    ),
    (
        "vertex",
        "job.sh",
        f"gcloud ai custom-jobs create {GOOD_POOL},gpu=2\n",
        "job.sh:1: --worker-pool-spec[0].gpu: unknown key (known: machine-type, replica-count, accelerator-type, ",
    ),
    (
        "vertex",
        "job.sh",
        "gcloud ai custom-jobs create --worker-pool-spec=replica-count=1,container-image-uri=$IMAGE_URI_UNSET_X\n",
        "job.sh:1: $IMAGE_URI_UNSET_X is not set in this file or in the environment: set it above the command, or write the value",
    ),
    (
        "vertex",
        "job.sh",
        "gcloud ai custom-jobs create \\\n  --display-name=$(date +%s) " + GOOD_POOL + "\n",
        "job.sh:2: $(date +%s): only the shell can work this out: write the value (or set a variable above the command)",
    ),
    (
        "vertex",
        "job.sh",
        "gcloud ai custom-jobs create --region=x '" + GOOD_POOL + "\n",
        "job.sh:1: a single quote that is never closed",
    ),
    (
        "vertex",
        "job.sh",
        "gcloud ai custom-jobs create --region=x\n",
        "job.sh:1: the command has neither --worker-pool-spec nor --config: no worker pools to import",
    ),
    (
        "vertex",
        "two.sh",
        f"gcloud ai custom-jobs create {GOOD_POOL}\ngcloud beta ai custom-jobs create {GOOD_POOL}\n",
        "two.sh: 2 `gcloud ai custom-jobs create` commands (lines 1, 2): import one at a time (one per file)",
    ),
    (
        "vertex",
        "job.sh",
        "gcloud ai custom-jobs create --worker-pool-spec=replica-count=2,container-image-uri=r/t:1\n",
        "job.sh:1: --worker-pool-spec[0].replica-count: the first worker pool, the primary replica, runs exactly one replica, got 2",
    ),
    (
        "vertex",
        "c.json",
        _with(["jobSpec", "workerPoolSpecs", 1, "replicaCount"], 3).replace('"replicaCount": "1"', '"replicaCount": 2'),
        "c.json: jobSpec.workerPoolSpecs[0].replicaCount: the primary replica pool runs exactly one replica (replicaCount 1), got 2",
    ),
    (
        "vertex",
        "c.json",
        _with(["jobSpec", "workerPoolSpecs"], [{"replicaCount": 1, "containerSpec": {"imageUri": "a"}}] * 5),
        "c.json: jobSpec.workerPoolSpecs: at most 4 worker pools (primary, workers, servers, evaluators), got 5",
    ),
    (
        "vertex",
        "c.json",
        _with(["jobSpec", "workerPoolSpecs"], [{}, {"replicaCount": 1}]),
        "c.json: jobSpec.workerPoolSpecs[0]: the first worker pool, the primary replica, is required and may not be empty",
    ),
    (
        "vertex",
        "c.json",
        _with(["jobSpec", "workerPoolSpecs", 1], {"replicaCount": 1, "machineSpec": {}}),
        "c.json: jobSpec.workerPoolSpecs[1]: give containerSpec or pythonPackageSpec (one of them: what does this pool run?)",
    ),
    (
        "vertex",
        "c.json",
        _with(["jobSpec", "workerPoolSpecs", 1], {"replica_count": 1}),
        "c.json: jobSpec.workerPoolSpecs[1].replica_count: write the key in camelCase, 'replicaCount', as the API and gcloud --config do",
    ),
    (
        "vertex",
        "c.json",
        _with(
            ["jobSpec", "workerPoolSpecs", 1],
            {"containerSpec": {"imageUri": "a", "env": [{"name": "TF_CONFIG", "value": "{}"}]}},
        ),
        "c.json: jobSpec.workerPoolSpecs[1].containerSpec.env[0].name: TF_CONFIG is set by provision for every task (as the services set it) and cannot be given",
    ),
    (
        "vertex",
        "c.json",
        _with(["jobSpec", "scheduling"], {"timeout": "two hours"}),
        "c.json: jobSpec.scheduling.timeout: expected a duration such as '7200s', got 'two hours'",
    ),
    (
        "vertex",
        "c.json",
        _with(["jobSpec", "workerPoolSpecs", 1, "machineSpec"], {"acceleratorType": "NVIDIA_L4"}).replace(
            '"many"', "1"
        ),
        "c.json: jobSpec.workerPoolSpecs[1].machineSpec.acceleratorCount: missing or 0, but acceleratorType is NVIDIA_L4",
    ),
    (
        "vertex",
        "ti.json",
        json.dumps({"trainingInput": {"scaleTier": "BASIC"}}),
        "ti.json: (top level): this is an AI Platform Training job (trainingInput): use `provision import ai-platform`",
    ),
    (
        "vertex",
        "list.yaml",
        "- a\n- b\n",
        "list.yaml: neither a CustomJob / CustomJobSpec (JSON or YAML with workerPoolSpecs) nor a shell script with a `gcloud ai custom-jobs create` command",
    ),
    (
        "ai-platform",
        "v.json",
        json.dumps(CJ),
        "v.json: (top level): this is a Vertex AI job (workerPoolSpecs): use `provision import vertex`",
    ),
    (
        "ai-platform",
        "t.yaml",
        "scaleTier: STANDARD_1\npythonModule: t.m\n",
        "t.yaml: scaleTier: STANDARD_1 does not say which machines and how many it ran: write the job as CUSTOM with masterType, workerCount, parameterServerCount and their configs",
    ),
    (
        "ai-platform",
        "t.yaml",
        "scaleTier: CUSTOM\nmasterType: n1-standard-4\nworkerCount: many\npythonModule: t.m\n",
        "t.yaml: workerCount: expected an integer, got 'many'",
    ),
    (
        "ai-platform",
        "t.yaml",
        "scaleTier: CUSTOM\nmasterType: n1-standard-4\nmasterConfig: {imageUri: a/b, containerArgs: [x]}\nargs: [y]\n",
        "t.yaml: masterConfig.containerArgs: AI Platform takes containerArgs or trainingInput.args, not both",
    ),
    (
        "ai-platform",
        "t.yaml",
        "scaleTier: CUSTOM\nmasterType: n1-standard-4\nmasterConfig: {acceleratorConfig: {type: NVIDIA_TESLA_T4}}\npythonModule: m\n",
        "t.yaml: masterConfig.acceleratorConfig.count: missing or 0, but type is NVIDIA_TESLA_T4",
    ),
    (
        "ai-platform",
        "t.yaml",
        "scaleTier: CUSTOM\nmasterType: n1-standard-4\n",
        "t.yaml: (top level): neither masterConfig.imageUri (a custom container) nor pythonModule (a training package): what does this job run?",
    ),
    (
        "ai-platform",
        "t.yaml",
        "jobId: x\ntrainingInput: {scaleTier: CUSTOM, masterType: a, pythonModule: m, useChiefInTfConfig: 'yes'}\n",
        "t.yaml: trainingInput.useChiefInTfConfig: expected true or false, got 'yes'",
    ),
    (
        "ai-platform",
        "t.yaml",
        "jobId: x\ntrainingInput: {pythonModule: m, scaleTier: BASIC, args: [--x, .nan]}\n",
        "t.yaml: trainingInput.args[1]: expected a finite number, got nan",
    ),
    (
        "ai-platform",
        "t.yaml",
        "jobId: x\ntrainingInput: {pythonModule: m, scaleTier: BASIC, hyperparameters: {x: !!binary aGk=}}\n",
        "t.yaml: trainingInput.hyperparameters.x: expected a JSON value (string, number, true/false, null, list or mapping), got b'hi'",
    ),
]


@pytest.mark.parametrize("service,name,text,message", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_spec_one_line(service: str, name: str, text: str, message: str, tmp_path: Path) -> None:
    (tmp_path / name).write_text(text)
    code, out, err = run("import", service, name, "-o", "out.yaml", cwd=tmp_path)
    assert code == 1
    assert len(err.splitlines()) == 1, err
    assert err.startswith("Error: " + message), err
    assert out == "" and not (tmp_path / "out.yaml").exists()


def test_unreadable_files_one_line(tmp_path: Path) -> None:
    (tmp_path / "latin1.json").write_bytes(b'{"displayName": "caf\xe9"}')
    (tmp_path / "adir").mkdir()
    (tmp_path / "spec.json").write_text(json.dumps(CJ).replace('"many"', "1"))
    (tmp_path / "hosts-bad.yaml").write_text("hosts: {gpu-1: 192.0.2.1}\n")
    (tmp_path / "out.yaml").write_text("mine\n")
    cases = [
        (["vertex", "missing.json"], "Error: missing.json: no such file"),
        (["vertex", "adir"], "Error: adir: is a directory, expected a file"),
        (["vertex", "latin1.json"], "Error: latin1.json: not UTF-8 text (invalid continuation byte at byte 20)"),
        (["vertex", "spec.json", "--hosts", "nohosts.yaml"], "Error: nohosts.yaml: no such file"),
        (
            ["vertex", "spec.json", "--hosts", "hosts-bad.yaml"],
            "Error: hosts-bad.yaml: hosts: expected a non-empty list of hosts ({name, address, ...} each)",
        ),
        (["vertex", "spec.json", "-o", "out.yaml"], "Error: out.yaml: already exists; give --force to overwrite it"),
        (["vertex", "spec.json", "--job", "Bad_Name"], "Error: --job: expected a DNS-1035 label"),
        (["vertex", "spec.json", "--trial", "one two"], "Error: --trial: expected a trial id such as '1'"),
    ]
    for args, message in cases:
        code, _, err = run("import", *args, cwd=tmp_path)
        assert code == 1, args
        assert len(err.splitlines()) == 1 and err.startswith(message), (args, err)
    assert (tmp_path / "out.yaml").read_text() == "mine\n"
    code, _, err = run(
        "import",
        "vertex",
        "spec.json",
        "-o",
        "out.yaml",
        "--force",
        "--job",
        "given",
        "--hosts",
        "nohosts.yaml",
        cwd=tmp_path,
    )
    assert code == 1
    code, _, err = run("import", "vertex", "spec.json", "-o", "out.yaml", "--force", "--job", "given", cwd=tmp_path)
    assert code == 0, err
    assert load_text(tmp_path / "out.yaml")["job"] == "given"


def load_text(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


# --------------------------------------------------------------------------- gcloud details


def test_gcloud_config_file_under_flags(tmp_path: Path) -> None:
    """--config beside the script, with --args over every pool (gcloud's precedence)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "config.yaml").write_text(
        "workerPoolSpecs:\n"
        "  - {machineSpec: {machineType: n1-standard-4}, replicaCount: 1, containerSpec: {imageUri: r.example/a:1, args: [--old]}}\n"
        "  - {machineSpec: {machineType: n1-standard-4}, replicaCount: 2, containerSpec: {imageUri: r.example/a:1}}\n"
        "serviceAccount: sa@example.iam.gserviceaccount.com\n"
    )
    (tmp_path / "scripts" / "go.sh").write_text(
        "gcloud ai custom-jobs create --display-name=from-config --config=config.yaml \\\n"
        "    --args='^;^--lr=0.1;--names=a,b' --project my-project --labels=a=b\n"
    )
    out, _, _ = do_import(tmp_path, "vertex", "scripts/go.sh")
    inv = load(out)
    assert inv.job == "from-config"
    assert [p.args for p in inv.pools] == [("--lr=0.1", "--names=a,b")] * 2
    text = out.read_text()
    assert "#   - --project: my-project\n#       the Google Cloud project the job ran in\n" in text
    assert "#   - --labels: a=b\n" in text
    assert "#   - serviceAccount: sa@example.iam.gserviceaccount.com\n" in text
    assert inv.job_spec is not None and inv.job_spec["serviceAccount"] == "sa@example.iam.gserviceaccount.com"


def test_gcloud_config_error_names_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("workerPoolSpecs:\n  - {replicaCount: lots, containerSpec: {imageUri: a}}\n")
    (tmp_path / "go.sh").write_text("gcloud ai custom-jobs create --config config.yaml\n")
    code, _, err = run("import", "vertex", "go.sh", cwd=tmp_path)
    assert code == 1
    assert err == "Error: config.yaml: workerPoolSpecs[0].replicaCount: expected an integer, got 'lots'\n"


def test_gcloud_words_like_a_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FROM_ENV_IMAGE", "registry.example/env:7")
    (tmp_path / "go.sh").write_text(
        "# a comment with gcloud ai custom-jobs create in it\n"
        "IMAGE='registry.example/quoted:1' ; export TAG=v2\n"
        "cd /tmp && /usr/lib/google-cloud-sdk/bin/gcloud --project=p beta ai custom-jobs create \\\n"
        '  --display-name "nightly ${TAG}" \\\n'
        "  --worker-pool-spec=replica-count=1,container-image-uri=$IMAGE \\\n"
        "  --worker-pool-spec=replica-count=3,container-image-uri=$FROM_ENV_IMAGE \\\n"
        '  --command=python3,-m,app --args="--x=\\"1\\"" 2>&1 | tee log.txt\n'
    )
    out, _, _ = do_import(tmp_path, "vertex", "go.sh")
    inv = load(out)
    assert inv.job == "nightly-v2"
    assert [(p.role, p.replicas, p.image, p.args) for p in inv.pools] == [
        ("chief", 1, "registry.example/quoted:1", ("python3", "-m", "app", '--x="1"')),
        ("worker", 3, "registry.example/env:7", ("python3", "-m", "app", '--x="1"')),
    ]


# --------------------------------------------------------------------------- examples in inventories/imported/

EXAMPLES = [
    (
        "reduction-server.yaml",
        ["vertex", "tests/fixtures/import/reduction_server.sh", "--hosts", "tests/fixtures/import/hosts-v100.yaml"],
    ),
    (
        "census-hptuning.yaml",
        [
            "ai-platform",
            "tests/fixtures/import/census_hptuning.yaml",
            "--hosts",
            "tests/fixtures/import/hosts-cpu.yaml",
        ],
    ),
    (
        "vertex-hptuning.yaml",
        [
            "vertex",
            "tests/fixtures/import/vertex_hptuning.json",
            "--hosts",
            "tests/fixtures/import/hosts-v100.yaml",
        ],
    ),
]


@pytest.mark.parametrize("name,args", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_examples_are_current_and_valid(name: str, args: list[str]) -> None:
    """inventories/imported/ holds what `provision import` writes today (to stdout, from the repo root)."""
    code, out, err = run("import", *args, cwd=ROOT)
    assert code == 0, err
    path = ROOT / "inventories" / "imported" / name
    assert out == path.read_text(), f"regenerate: provision import {' '.join(args)} > inventories/imported/{name}"
    inv = load(path)
    assert inv.job_spec is not None and task_envs(inv)


# --------------------------------------------------------------------------- the inventory's job_spec:

BASE = """\
job: spec
hosts:
  - {name: a, address: 192.0.2.1}
  - {name: b, address: 192.0.2.2}
pools:
  chief: {replicas: 1, command: [/bin/true]}
  worker: {replicas: 1, command: [/bin/true]}
"""


def test_job_spec_is_the_job_of_tf_config_and_cluster_spec(tmp_path: Path) -> None:
    spec = {
        "workerPoolSpecs": [
            {"replicaCount": "1", "containerSpec": {"imageUri": "a", "env": [{"name": "X", "value": 'ü"$`\\'}]}},
            {},
        ],
        "n": 1.5,
        "flag": True,
        "none": None,
    }
    inv = parse(BASE + "job_spec: " + json.dumps(spec) + "\n", tmp_path / "inv.yaml")
    assert inv.job_spec == spec
    for env in task_envs(inv).values():
        assert json.loads(env["TF_CONFIG"])["job"] == spec
        assert json.loads(env["CLUSTER_SPEC"])["job"] == spec


def test_without_job_spec_tf_config_has_no_job(tmp_path: Path) -> None:
    inv = parse(BASE, tmp_path / "inv.yaml")
    assert inv.job_spec is None
    for env in task_envs(inv).values():
        assert "job" not in json.loads(env["TF_CONFIG"])
        assert json.loads(env["CLUSTER_SPEC"])["job"]["displayName"] == "spec"  # provision's own description


def test_job_spec_change_restarts_nothing(tmp_path: Path) -> None:
    """`job` is informational, as CLUSTER_SPEC's always was: a new spec rewrites the env
    files but leaves every task's inputs (what decides a restart) as they were."""
    one = render(parse(BASE + "job_spec: {a: 1}\n", tmp_path / "inv.yaml"))
    two = render(parse(BASE + "job_spec: {a: 2, b: [x]}\n", tmp_path / "inv.yaml"))
    for host, bundle in one.hosts.items():
        assert [u.inputs for u in bundle.tasks] == [u.inputs for u in two.hosts[host].tasks]
        assert {f.path: f.sha256 for f in bundle.files} != {f.path: f.sha256 for f in two.hosts[host].files}


@pytest.mark.parametrize(
    "value,message",
    [
        ("[1, 2]", "job_spec: expected a mapping (the service's job description, such as a CustomJobSpec), got a list"),
        (
            "{createTime: 2021-01-01}",
            "job_spec.createTime: expected a JSON value (string, number, true/false, null, list or mapping), got datetime.date(2021, 1, 1)",
        ),
        (
            "{a: [1, .nan]}",
            "job_spec.a[1]: expected a JSON value (string, number, true/false, null, list or mapping), got nan",
        ),
        ("{a: !!binary aGk=}", "job_spec.a: expected a JSON value"),
    ],
)
def test_job_spec_must_be_json(value: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "inv.yaml").write_text(BASE + "job_spec: " + value + "\n")
    code, _, err = run("validate", "inv.yaml", cwd=tmp_path)
    assert code == 1
    assert err.startswith("Error: inv.yaml:8: " + message), err


# --------------------------------------------------------------------------- the YAML writer

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from provision.importers.emit import comment, flow  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(),
        st.lists(st.text(), max_size=4),
        st.dictionaries(st.text(min_size=1, max_size=40), st.text(), max_size=3),
    )
)
def test_values_read_back_as_written(value: Any) -> None:
    """Every value in the output is one line of YAML that reads back as it was (by the
    inventory's own loader too), and a comment never spills onto a second line."""
    line = flow(value)
    assert "\n" not in line and "\r" not in line
    assert yaml.safe_load(f"k: {line}\n")["k"] == value
    text = comment(str(value))
    assert text.isprintable() and "\n" not in text


def test_an_alias_bomb_and_a_huge_spec_are_refused_within_a_second(tmp_path):
    """item 17: refused with one line each, before the work grows with the input."""
    import time

    from provision.importers.common import MAX_SPEC_BYTES, SpecError, read_yaml_file

    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 12):
        bomb.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 10) + "]")
    bomb.append("workerPoolSpecs: [*l]")
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    (tmp_path / "huge.yaml").write_text("workerPoolSpecs: []\n" + "# padding\n" * (50 * 1024 * 1024 // 10))
    for name, words in (("bomb.yaml", "alias bomb"), ("huge.yaml", f"at most {MAX_SPEC_BYTES} bytes")):
        t0 = time.monotonic()
        with pytest.raises(SpecError, match=words):
            read_yaml_file(tmp_path / name, name)
        assert time.monotonic() - t0 < 1.0, name
