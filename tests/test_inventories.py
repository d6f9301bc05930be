"""Every example in inventories/ validates and renders, and shows what its comments say."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest

from provision.inventory.inventory import load
from provision.render.files import render, write_tree

ROOT = Path(__file__).resolve().parent.parent
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))
REQUIRED = {
    "single-gpu",
    "multi-worker-mirrored",
    "parameter-server",
    "reduction-server",
    "pytorch-ddp",
    "tpu",
}
DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")]


def test_the_examples_exist():
    assert REQUIRED <= {p.stem for p in INVENTORIES}


@pytest.mark.parametrize("path", INVENTORIES, ids=lambda p: p.stem)
def test_validates_and_renders(path, tmp_path):
    inv = load(path)
    rendered = render(inv)
    count = write_tree(rendered, tmp_path)
    assert count == sum(len(b.files) for b in rendered.hosts.values())
    for bundle in rendered.hosts.values():
        for t in bundle.tasks:
            assert (tmp_path / bundle.host.name / t.env_path.lstrip("/")).is_file()
            assert (tmp_path / bundle.host.name / t.unit_path.lstrip("/")).is_file()


@pytest.mark.parametrize("path", INVENTORIES, ids=lambda p: p.stem)
def test_placeholders_only(path):
    """Addresses are documentation placeholders (RFC 5737 / 3849, *.example), and the
    file says what to change."""
    inv = load(path)
    text = path.read_text()
    assert "CHANGE" in text
    for h in inv.hosts:
        for a in (h.address, h.cluster_address):
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                assert a.endswith(".example"), a
            else:
                assert any(ip in n for n in DOC_NETS), a
    for p in inv.pools:
        assert p.command[0].startswith("/opt/venv/bin/"), p.command


def _systemd_env_parser():
    """test_encode.py's port of systemd's EnvironmentFile= parser (loaded by path, so it
    works under any pytest import mode)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_provision_test_encode", Path(__file__).with_name("test_encode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.parse_env_file


def _env(rendered, task: str) -> dict[str, str]:
    """Values as the task sees them: the env file read back by systemd's parser (ported)."""
    parse_env_file = _systemd_env_parser()
    for bundle in rendered.hosts.values():
        for f in bundle.files:
            if f.path.endswith(f"/{task}.env"):
                return dict(parse_env_file(f.data().decode()))
    raise KeyError(task)


def test_single_gpu():
    r = render(load(ROOT / "inventories" / "single-gpu.yaml"))
    env = _env(r, "chief-0")
    assert "TF_CONFIG" not in env
    assert json.loads(env["CLUSTER_SPEC"])["task"] == {"type": "workerpool0", "index": 0}
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_multi_worker_mirrored():
    r = render(load(ROOT / "inventories" / "multi-worker-mirrored.yaml"))
    assert len(r.hosts) == 4  # one replica per host
    tf = json.loads(_env(r, "worker-2")["TF_CONFIG"])
    assert tf["cluster"] == {
        "chief": ["gpu-1.example:2222"],
        "worker": ["gpu-2.example:2222", "gpu-3.example:2222", "gpu-4.example:2222"],
    }
    assert tf["task"] == {"type": "worker", "index": 2}


def test_parameter_server():
    r = render(load(ROOT / "inventories" / "parameter-server.yaml"))
    p = r.placement
    assert {t.host.name for t in p.by_role("ps") + p.by_role("evaluator")} <= {"cpu-1", "cpu-2"}
    chief = json.loads(_env(r, "chief-0")["TF_CONFIG"])
    assert set(chief["cluster"]) == {"chief", "worker", "ps"}
    evaluator = json.loads(_env(r, "evaluator-0")["TF_CONFIG"])
    assert evaluator["task"] == {"type": "evaluator", "index": 0}
    assert evaluator["cluster"]["evaluator"] == [p.task("evaluator-0").address]
    # ps and evaluator are long-lived: provision stops them when the chief is done
    units = {u.task.name: u for b in r.hosts.values() for u in b.tasks}
    assert units["ps-0"].long_lived and units["evaluator-0"].long_lived and not units["chief-0"].long_lived
    assert units["ps-0"].phase < units["chief-0"].phase < units["evaluator-0"].phase


def test_reduction_server():
    r = render(load(ROOT / "inventories" / "reduction-server.yaml"))
    p = r.placement
    assert {t.host.name for t in p.by_role("reduction_server")} == {"reducer-1", "reducer-2"}
    env = _env(r, "reduction_server-3")
    assert "TF_CONFIG" not in env  # not a TF task
    spec = json.loads(env["CLUSTER_SPEC"])
    assert spec["task"] == {"type": "workerpool2", "index": 3}
    assert spec["cluster"]["workerpool2"] == [t.address for t in p.by_role("reduction_server")]
    assert "ps" not in json.loads(_env(r, "chief-0")["TF_CONFIG"])["cluster"]


def test_pytorch_ddp():
    r = render(load(ROOT / "inventories" / "pytorch-ddp.yaml"))
    ranks = {}
    for t in r.placement.tasks:
        env = _env(r, t.name)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == ("192.0.2.11", "29500", "4")
        assert env["PET_NPROC_PER_NODE"] == "4"
        assert "WANDB_API_KEY" not in env  # secret: filled in at apply time only
        ranks[t.name] = env["RANK"]
    assert ranks == {"chief-0": "0", "worker-0": "1", "worker-1": "2", "worker-2": "3"}


def test_tpu():
    r = render(load(ROOT / "inventories" / "tpu.yaml"))
    for t in r.placement.tasks:
        env = _env(r, t.name)
        assert env["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["JAX_COORDINATOR_ADDRESS"] == "192.0.2.41:8482"  # JAX's own default port
        assert env["TPU_PROCESS_ADDRESSES"] == ",".join(f"192.0.2.4{i}:8476" for i in range(1, 5))
    assert sorted(_env(r, t.name)["JAX_PROCESS_ID"] for t in r.placement.tasks) == ["0", "1", "2", "3"]
    unit = next(f for f in r.hosts["tpu-2"].files if f.kind == "unit").data().decode()
    assert re.search(r"^RestartPreventExitStatus=1 2 3 .* 127$", unit, re.MULTILINE)  # ExitCode policy
