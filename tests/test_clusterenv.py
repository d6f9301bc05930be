"""The cluster environment of every task, read back by its real consumers.

For every task of every example job (inventories/*.yaml) and a few variants (legacy
`master`, a trial id, no chief, evaluator), the values `clusterenv.task_env` produces are:
- TF_CONFIG loaded by TensorFlow's own `TFConfigClusterResolver` (cluster_spec, task_type,
  task_id, master()) and checked by TF's own cluster validation (`multi_worker_util`);
- CLUSTER_SPEC, the PyTorch env:// variables, JAX and DMLC variables parsed and compared
  with the placement;
- the torchrun variables (PET_*) read by torchrun's own argument parser.
Encoding into files is tested apart (test_encode.py, integration/test_systemd_parsing.py).

TensorFlow: CI installs tensorflow-cpu (extra `tf`); without it the TF tests skip, saying so.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from provision.inventory.inventory import load, parse
from provision.placement.tasks import place
from provision.placement.tpu import is_tpu
from provision.render.clusterenv import job_cluster, task_env, uses_socket_ifname

ROOT = Path(__file__).resolve().parent.parent
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))

VARIANTS = {
    # TF1 Estimator's legacy name, and a hyperparameter trial id
    "master-trial": """
job: legacy
hosts:
  - {name: a, address: 192.0.2.1}
  - {name: b, address: 192.0.2.2}
pools:
  chief: {replicas: 1, command: [/bin/true]}
  worker: {replicas: 2, command: [/bin/true]}
  ps: {replicas: 1, command: [/bin/true]}
  evaluator: {replicas: 1, command: [/bin/true]}
tf_config: {chief_name: master, trial: "7"}
""",
    # MultiWorkerMirroredStrategy without a chief: worker 0 is the chief, rank 0
    "workers-only": """
job: workers
hosts:
  - {name: a, address: 192.0.2.1, accelerators: {type: nvidia-t4, count: 2}}
  - {name: b, address: 2001:db8::2, accelerators: {type: nvidia-t4, count: 2}}
pools:
  worker: {replicas: 4, accelerators: 1, command: [/bin/true]}
""",
    # a single worker: one task, so no TF_CONFIG
    "one-worker": """
job: one
hosts: [{name: a, address: 192.0.2.1}]
pools:
  worker: {replicas: 1, command: [/bin/true]}
""",
}


def jobs():
    out = [pytest.param(load(p), id=p.stem) for p in INVENTORIES]
    out += [pytest.param(parse(text, Path(f"/nonexistent/{name}.yaml")), id=name) for name, text in VARIANTS.items()]
    return out


def envs(inv):
    placement = place(inv)
    jc = job_cluster(inv, placement)
    return placement, [(t, dict(task_env(inv, t, jc))) for t in placement.tasks]


@contextmanager
def environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def tf():
    try:
        import tensorflow as tf
    except ImportError as e:
        pytest.skip(f"tensorflow is not importable ({e}); `pip install tensorflow-cpu==2.21.0` (CI does)")
    return tf


def expected_tf_cluster(inv, placement) -> dict[str, list[str]]:
    names = {"chief": inv.tf_config.chief_name, "worker": "worker", "ps": "ps"}
    out: dict[str, list[str]] = {}
    for role, key in names.items():
        addrs = [t.address for t in placement.by_role(role)]
        if addrs:
            out[key] = addrs
    return out


# --------------------------------------------------------------------------- TF_CONFIG


@pytest.mark.parametrize("inv", jobs())
def test_tf_config_through_tensorflow(tf, inv):
    from tensorflow.python.distribute import multi_worker_util

    placement, tasks = envs(inv)
    training = expected_tf_cluster(inv, placement)
    checked = 0
    for t, env in tasks:
        if len(placement.tasks) == 1 or t.role == "reduction_server":
            assert "TF_CONFIG" not in env, t.name
            continue
        raw = env["TF_CONFIG"]
        assert "\n" not in raw and ": " not in raw and ", " not in raw  # compact, one line
        doc = json.loads(raw)
        assert doc["environment"] == "cloud"
        if inv.tf_config.trial is None:
            assert "trial" not in doc["task"]
        else:
            assert doc["task"]["trial"] == inv.tf_config.trial
        assert isinstance(doc["task"]["index"], int)

        want_type = inv.tf_config.chief_name if t.role == "chief" else t.role
        want_cluster = dict(training)
        if t.role == "evaluator":
            want_cluster["evaluator"] = [t.address]
        with environ(TF_CONFIG=raw):
            r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            spec = r.cluster_spec()
            assert spec.as_dict() == want_cluster, t.name
            assert (r.task_type, r.task_id) == (want_type, t.index), t.name
            assert r.rpc_layer is None  # provision sets no rpc_layer: grpc by default
            assert r.master() == t.address, t.name
            assert r.master(rpc_layer="grpc") == f"grpc://{t.address}", t.name
            if inv.tf_config.chief_name == "chief":
                # TF's own check of the cluster shape (chief, worker, ps, evaluator only;
                # at most one chief and one evaluator; task id in range).
                multi_worker_util._validate_cluster_spec(spec, r.task_type, r.task_id)
                is_chief = multi_worker_util.is_chief(spec, r.task_type, r.task_id)
                rank0 = t.role == "chief" or (t.role == "worker" and t.index == 0 and not placement.by_role("chief"))
                assert is_chief == (rank0 or t.role == "evaluator"), t.name
        # the cluster part is the same dict for every task (the evaluator adds itself)
        assert {k: v for k, v in doc["cluster"].items() if k != "evaluator"} == training
        checked += 1
    assert checked or len(placement.tasks) == 1 or all(t.role == "reduction_server" for t in placement.tasks)


def test_evaluator_never_in_training_cluster(tf):
    inv = load(ROOT / "inventories" / "parameter-server.yaml")
    _, tasks = envs(inv)
    for t, env in tasks:
        cluster = json.loads(env["TF_CONFIG"])["cluster"]
        assert ("evaluator" in cluster) == (t.role == "evaluator")


# --------------------------------------------------------------------------- CLUSTER_SPEC


@pytest.mark.parametrize("inv", jobs())
def test_cluster_spec(inv):
    placement, tasks = envs(inv)
    pool_of = {"chief": 0, "worker": 1, "ps": 2, "reduction_server": 2, "evaluator": 3}
    want: dict[str, list[str]] = {}
    for role in ("chief", "worker", "ps", "reduction_server", "evaluator"):
        addrs = [t.address for t in placement.by_role(role)]
        if addrs:
            want[f"workerpool{pool_of[role]}"] = addrs
    for t, env in tasks:
        raw = env["CLUSTER_SPEC"]  # every task, single-task jobs too
        doc = json.loads(raw)
        assert "\n" not in raw
        assert doc["cluster"] == want
        assert doc["environment"] == "cloud"
        assert doc["task"]["type"] == f"workerpool{pool_of[t.role]}"
        assert doc["task"]["index"] == t.index
        assert doc["task"].get("trial") == inv.tf_config.trial
        # `job`: the job as submitted, pools at their workerpool position
        job = doc["job"]
        assert job["displayName"] == inv.job
        specs = job["workerPoolSpecs"]
        for p in inv.pools:
            spec = specs[pool_of[p.role]]
            assert spec["replicaCount"] == p.replicas
            assert spec.get("machineSpec", {}).get("acceleratorCount", 0) == p.accelerators
            assert spec["commandSpec"]["command"] == list(p.command)
        # own address is where the spec says it is
        assert doc["cluster"][doc["task"]["type"]][doc["task"]["index"]] == t.address


# --------------------------------------------------------------------------- PyTorch, JAX, DMLC


@pytest.mark.parametrize("inv", jobs())
def test_pytorch_and_jax_variables(inv):
    placement, tasks = envs(inv)
    chief = placement.by_role("chief")
    workers = placement.by_role("worker")
    master = (chief or workers)[0]
    world = len(chief) + len(workers)
    ranks = {}
    for t, env in tasks:
        if t.role not in ("chief", "worker"):
            for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "PET_NODE_RANK", "JAX_PROCESS_ID"):
                assert k not in env, (t.name, k)
            continue
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == master.host.cluster_address
        assert int(env["MASTER_PORT"]) == int(env["PET_MASTER_PORT"]) == master.port
        assert int(env["WORLD_SIZE"]) == int(env["PET_NNODES"]) == int(env["JAX_NUM_PROCESSES"]) == world
        rank = int(env["RANK"])
        assert int(env["PET_NODE_RANK"]) == int(env["JAX_PROCESS_ID"]) == rank
        assert int(env["PET_NPROC_PER_NODE"]) == max(1, inv.pool(t.role).accelerators)
        if is_tpu(master):  # JAX's coordinator beside libtpu's port (placement/tpu.py)
            assert env["JAX_COORDINATOR_ADDRESS"] == f"{master.host.cluster_address}:{master.port + 6}"
        else:
            assert env["JAX_COORDINATOR_ADDRESS"] == master.address
        ranks[t.name] = rank
    if world:
        assert sorted(ranks.values()) == list(range(world))
        assert ranks[master.name] == 0
        # chief 0, worker i -> i+1 (i without a chief)
        for w in workers:
            assert ranks[w.name] == w.index + (1 if chief else 0)


@pytest.mark.parametrize("inv", [load(ROOT / "inventories" / "pytorch-ddp.yaml")], ids=["pytorch-ddp"])
def test_torchrun_reads_pet_variables(inv):
    """torchrun's own parser takes its defaults from PET_*: `torchrun train.py` with the
    task's environment is the multi-node command line, no flags needed."""
    run = pytest.importorskip("torch.distributed.run", reason="torch is not installed")
    _, tasks = envs(inv)
    for _t, env in tasks:
        pet = {k: v for k, v in env.items() if k.startswith("PET_")}
        with environ(**pet):
            args = run.get_args_parser().parse_args(["/opt/job/train.py", "--epochs", "90"])
            config, _, script_args = run.config_from_args(args)
        assert (config.min_nodes, config.max_nodes) == (4, 4)
        assert config.nproc_per_node == 4
        assert config.rdzv_endpoint == "192.0.2.11:29500"
        assert config.rdzv_backend == "static"
        assert config.rdzv_configs["rank"] == int(env["RANK"])
        assert script_args[-3:] == ["/opt/job/train.py", "--epochs", "90"]


@pytest.mark.parametrize("inv", jobs())
def test_dmlc_variables(inv):
    placement, tasks = envs(inv)
    ps = placement.by_role("ps")
    for t, env in tasks:
        if not ps or t.role not in ("chief", "worker", "ps"):
            assert "DMLC_ROLE" not in env
            continue
        root = (placement.by_role("chief") or placement.by_role("worker"))[0]
        assert env["DMLC_ROLE"] == {"chief": "scheduler", "worker": "worker", "ps": "server"}[t.role]
        assert env["DMLC_PS_ROOT_URI"] == root.host.cluster_address
        assert int(env["DMLC_PS_ROOT_PORT"]) == root.port
        assert int(env["DMLC_NUM_WORKER"]) == len(placement.by_role("worker"))
        assert int(env["DMLC_NUM_SERVER"]) == len(ps)


# --------------------------------------------------------------------------- accelerators and the rest


@pytest.mark.parametrize("inv", jobs())
def test_accelerators_visible(inv):
    _, tasks = envs(inv)
    for t, env in tasks:
        placed = ",".join(map(str, t.accelerators))
        if t.host.accelerators is not None and t.host.accelerators.kind == "tpu":
            assert env["TPU_VISIBLE_CHIPS"] == placed
            assert env["CUDA_VISIBLE_DEVICES"] == ""
        else:
            assert "TPU_VISIBLE_CHIPS" not in env
            assert env["CUDA_VISIBLE_DEVICES"] == placed  # "" for a task without any
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_single_task_job_has_cluster_spec_but_no_tf_config():
    inv = load(ROOT / "inventories" / "single-gpu.yaml")
    ((_, env),) = envs(inv)[1]
    assert "TF_CONFIG" not in env
    assert json.loads(env["CLUSTER_SPEC"])["cluster"] == {"workerpool0": ["192.0.2.11:2222"]}
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert (env["RANK"], env["WORLD_SIZE"]) == ("0", "1")


def test_gpu_uuids_when_facts_have_them():
    inv = load(ROOT / "inventories" / "multi-worker-mirrored.yaml")
    placement = place(inv)
    jc = job_cluster(inv, placement)
    uuids = {"gpu-2": [f"GPU-{i:08x}" for i in range(8)]}
    w0 = placement.task("worker-0")
    assert w0.host.name == "gpu-2"
    env = dict(task_env(inv, w0, jc, gpu_uuids=uuids))
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(f"GPU-{i:08x}" for i in range(8))
    chief = dict(task_env(inv, placement.task("chief-0"), jc, gpu_uuids=uuids))
    assert chief["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # no facts for gpu-1: indices


def test_env_precedence_and_secrets():
    inv = parse(
        """
job: envs
hosts: [{name: a, address: 192.0.2.1}]
pools:
  chief: {replicas: 1, command: [/bin/true], env: {LEVEL: pool, ONLY_POOL: "1"}}
  worker: {replicas: 1, command: [/bin/true]}
env: {LEVEL: job, PYTHONUNBUFFERED: "0"}
secret_env: [TOKEN]
""",
        Path("/nonexistent/envs.yaml"),
    )
    placement = place(inv)
    jc = job_cluster(inv, placement)
    chief = task_env(inv, placement.task("chief-0"), jc, secrets={"TOKEN": "s3cr=t\n"})
    worker = dict(task_env(inv, placement.task("worker-0"), jc))
    d = dict(chief)
    assert d["LEVEL"] == "pool" and d["ONLY_POOL"] == "1"
    assert d["PYTHONUNBUFFERED"] == "0"  # the job may override provision's default
    assert d["TOKEN"] == "s3cr=t\n"
    assert [k for k, _ in chief].count("LEVEL") == 1  # one entry per name
    assert worker["LEVEL"] == "job" and "ONLY_POOL" not in worker
    assert "TOKEN" not in worker  # no secrets given: left out, never empty
    assert d["PROVISION_TASK"] == "chief-0" and d["PROVISION_TASK_TYPE"] == "chief"


@pytest.mark.parametrize(
    "job_env,chief_env,used",
    [
        ("{}", "{}", True),
        ("{NCCL_SOCKET_IFNAME: eth0, GLOO_SOCKET_IFNAME: eth0}", "{}", False),
        ("{NCCL_SOCKET_IFNAME: eth0}", "{}", True),  # Gloo's still comes from the host
        ("{NCCL_SOCKET_IFNAME: eth0}", "{GLOO_SOCKET_IFNAME: eth1}", True),  # the worker's does
        ("{}", "{NCCL_SOCKET_IFNAME: eth0, GLOO_SOCKET_IFNAME: eth0}", True),
    ],
)
def test_the_hosts_interface_is_asked_for_only_where_an_env_takes_it(job_env, chief_env, used):
    inv = parse(
        f"""
job: ifs
hosts: [{{name: a, address: 192.0.2.1}}]
pools:
  chief: {{replicas: 1, command: [/bin/true], env: {chief_env}}}
  worker: {{replicas: 1, command: [/bin/true]}}
env: {job_env}
""",
        Path("/nonexistent/ifs.yaml"),
    )
    assert uses_socket_ifname(inv) is used
    # ... the same rule as task_env's: with the interface known, some task's env takes it.
    placement = place(inv)
    jc = job_cluster(inv, placement)
    took = [
        k
        for t in placement.tasks
        for k, v in task_env(inv, t, jc, socket_ifname="ib7")
        if k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") and v == "ib7"
    ]
    assert bool(took) is used


def test_outputs_give_vertex_output_directories(tmp_path):
    text = (ROOT / "inventories" / "single-gpu.yaml").read_text() + "\noutputs: /data/runs/\n"
    (tmp_path / "inv.yaml").write_text(text)
    inv = load(tmp_path / "inv.yaml")
    assert inv.outputs == "/data/runs"
    ((_, env),) = envs(inv)[1]
    assert (env["AIP_MODEL_DIR"], env["AIP_CHECKPOINT_DIR"], env["AIP_TENSORBOARD_LOG_DIR"]) == (
        "/data/runs/model/",
        "/data/runs/checkpoints/",
        "/data/runs/logs/",
    )
    from provision.render.files import render

    unit = next(f for b in render(inv).hosts.values() for f in b.files if f.kind == "unit").data().decode()
    # Made by host/outdirs.py's guard, each directory on the way checked (tests/test_trust.py).
    assert "' provision-outputs 1 /data/runs/model /data/runs/checkpoints /data/runs/logs\n" in unit
    assert "/bin/mkdir -p --" not in unit


@pytest.mark.parametrize(
    "value, why",
    [
        ("data/runs", "an absolute directory"),
        ("/data/run s", "an absolute directory"),
        ("/etc/provision/x", "inside /etc/provision"),
        ("/var/lib/provision", "inside /var/lib/provision"),
        ("/", "an absolute directory"),
    ],
)
def test_outputs_refused(tmp_path, value, why):
    import yaml as _yaml

    from provision.core.errors import ProvisionError

    doc = _yaml.safe_load((ROOT / "inventories" / "single-gpu.yaml").read_text())
    doc["outputs"] = value
    (tmp_path / "inv.yaml").write_text(_yaml.safe_dump(doc))
    with pytest.raises(ProvisionError, match=why):
        load(tmp_path / "inv.yaml")


ELASTIC = """
job: el
hosts:
  - {name: a, address: 192.0.2.1}
  - {name: b, address: 192.0.2.2}
  - {name: c, address: 192.0.2.3}
pools:
  chief: {replicas: 1, command: [/usr/bin/python3, -m, torch.distributed.run, /opt/job/train.py]}
  worker: {replicas: 2, elastic: {min: 1, max: 3}, command: [/opt/venv/bin/torchrun, /opt/job/train.py]}
"""


def test_an_elastic_pool_runs_under_torchruns_c10d_rendezvous():
    """`elastic: {min, max}` on the workers: torchrun's own parser reads --nnodes=MIN:MAX
    (with the chief), the c10d rendezvous at the chief's address and port, the job's name
    its id; no fixed rank (the rendezvous gives them)."""
    from torch.distributed import run

    inv = parse(ELASTIC, Path("/nonexistent/el.yaml"))
    placement, tasks = envs(inv)
    chief = placement.by_role("chief")[0]
    for _t, env in tasks:
        assert "PET_NODE_RANK" not in env and "PET_MASTER_ADDR" not in env
        pet = {k: v for k, v in env.items() if k.startswith("PET_")}
        with environ(**pet):
            config, _, _ = run.config_from_args(run.get_args_parser().parse_args(["/opt/job/train.py"]))
        assert (config.min_nodes, config.max_nodes) == (2, 4)
        assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == f"192.0.2.1:{chief.port}"
        assert config.run_id == "el" and config.max_restarts == 3


@pytest.mark.parametrize(
    "pools, why",
    [
        ("  chief: {replicas: 1, elastic: {min: 1, max: 1}, command: [torchrun, t.py]}\n",
         "pools.chief.elastic: only the worker pool can be elastic"),
        ("  worker: {replicas: 4, elastic: {min: 1, max: 3}, command: [torchrun, t.py]}\n",
         "pools.worker.elastic: replicas (4) must be from min 1 to max 3"),
    ],
)  # fmt: skip
def test_an_elastic_pool_is_the_workers_within_its_bounds(pools, why):
    from provision.core.errors import ProvisionError

    text = "job: el\nhosts: [{name: a, address: 192.0.2.1}]\npools:\n" + pools
    with pytest.raises(ProvisionError) as e:
        parse(text, Path("/nonexistent/el.yaml"))
    assert why in str(e.value), str(e.value)
