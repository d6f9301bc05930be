"""TPU slices' variables (placement/tpu.py) as tables: 1 host, a 4-host slice, 2 slices of 4,
several processes on one host, and the layouts refused. No hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from provision.core.errors import ProvisionError
from provision.inventory.inventory import load
from provision.render.files import render

KEYS = (
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "TPU_PROCESS_PORT",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES",
    "MEGASCALE_SLICE_ID",
    "TPU_PROCESS_BOUNDS",
    "TPU_VISIBLE_CHIPS",
)


def inventory(tmp_path: Path, hosts: int, *, slices: int = 1, chips: int = 4, per_task: int = 4, replicas=None):
    per_slice = hosts // slices
    doc = {
        "job": "tpu-job",
        "hosts": [
            {
                "name": f"t{i}",
                "address": f"10.0.0.{i}",
                "accelerators": {"type": "tpu-v5e", "count": chips},
                **({"labels": {"tpu_slice": f"s{i // per_slice}"}} if slices > 1 else {}),
            }
            for i in range(hosts)
        ],
        "pools": {
            "worker": {
                "replicas": replicas or hosts,
                "accelerators": per_task,
                "command": ["/usr/bin/python3", "train.py"],
            }
        },
    }
    p = tmp_path / "inv.yaml"
    p.write_text(yaml.safe_dump(doc))
    return load(p)


def table(inv) -> dict[str, dict[str, str | None]]:
    r = render(inv)
    out = {}
    for t in r.placement.tasks:
        env_file = next(f for f in r.hosts[t.host.name].files if f.path.endswith(f"/{t.name}.env"))
        env = dict(
            line.split("=", 1) for line in env_file.data().decode().splitlines() if "=" in line and line[0] != "#"
        )
        out[t.name] = {k: env[k].strip('"') if k in env else None for k in KEYS}
    return out


def test_one_host(tmp_path):
    got = table(inventory(tmp_path, 1))
    assert got == {
        "worker-0": {
            "TPU_WORKER_ID": "0",
            "TPU_WORKER_HOSTNAMES": "10.0.0.0",
            "TPU_PROCESS_ADDRESSES": "10.0.0.0:8476",
            "TPU_PROCESS_PORT": "8476",
            "JAX_COORDINATOR_ADDRESS": "10.0.0.0:8482",
            "JAX_NUM_PROCESSES": "1",
            "JAX_PROCESS_ID": "0",
            "MEGASCALE_COORDINATOR_ADDRESS": None,
            "MEGASCALE_NUM_SLICES": None,
            "MEGASCALE_SLICE_ID": None,
            "TPU_PROCESS_BOUNDS": None,
            "TPU_VISIBLE_CHIPS": "0,1,2,3",
        }
    }


def test_a_slice_of_four_hosts(tmp_path):
    got = table(inventory(tmp_path, 4))
    hosts = ",".join(f"10.0.0.{i}" for i in range(4))
    for i in range(4):
        row = got[f"worker-{i}"]
        host = row["TPU_PROCESS_ADDRESSES"].split(",")[int(row["TPU_WORKER_ID"])].split(":")[0]
        assert row["TPU_WORKER_HOSTNAMES"] == hosts and host == f"10.0.0.{i}", row
        assert row["TPU_WORKER_ID"] == row["JAX_PROCESS_ID"] == str(i)
        assert (row["JAX_COORDINATOR_ADDRESS"], row["JAX_NUM_PROCESSES"]) == ("10.0.0.0:8482", "4")
        assert row["MEGASCALE_NUM_SLICES"] is None


def test_two_slices_of_four(tmp_path):
    got = table(inventory(tmp_path, 8, slices=2))
    for i in range(8):
        row = got[f"worker-{i}"]
        s, k = divmod(i, 4)
        assert (row["MEGASCALE_SLICE_ID"], row["TPU_WORKER_ID"]) == (str(s), str(k)), row
        assert row["TPU_WORKER_HOSTNAMES"] == ",".join(f"10.0.0.{4 * s + j}" for j in range(4))
        assert (row["MEGASCALE_COORDINATOR_ADDRESS"], row["MEGASCALE_NUM_SLICES"]) == ("10.0.0.0", "2")
        # JAX's own numbering: slice id x processes per slice + id in slice.
        assert row["JAX_PROCESS_ID"] == str(4 * s + k) and row["JAX_NUM_PROCESSES"] == "8"


def test_four_processes_on_one_host(tmp_path):
    got = table(inventory(tmp_path, 1, per_task=1, replicas=4))
    for i in range(4):
        row = got[f"worker-{i}"]
        assert row["TPU_VISIBLE_CHIPS"] == str(i) and row["TPU_PROCESS_PORT"] == str(8476 + i), row
        assert row["TPU_PROCESS_BOUNDS"] == "2,2,1" and row["TPU_WORKER_ID"] == str(i)
        assert row["TPU_PROCESS_ADDRESSES"] == ",".join(f"10.0.0.0:{8476 + j}" for j in range(4))
        assert row["JAX_COORDINATOR_ADDRESS"] == "10.0.0.0:8485"  # above every process port there


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"hosts": 3, "slices": 1, "per_task": 2, "replicas": 6}, "supported on a single host only"),
        ({"hosts": 1, "per_task": 2, "replicas": 2}, "one chip each"),
        ({"hosts": 1, "chips": 3, "per_task": 1, "replicas": 3}, "on a host of 1, 2, 4, 8 chips"),
    ],
)
def test_layouts_jax_or_libtpu_cannot_take_are_refused(tmp_path, kw, why):
    with pytest.raises(ProvisionError, match=why):
        table(inventory(tmp_path, **kw))


def test_slices_of_different_sizes_are_refused(tmp_path):
    inv = inventory(tmp_path, 3, slices=1)
    doc = yaml.safe_load((tmp_path / "inv.yaml").read_text())
    for i, h in enumerate(doc["hosts"]):
        h["labels"] = {"tpu_slice": "a" if i < 2 else "b"}
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ProvisionError, match="same number of processes.*a: 2, b: 1"):
        table(load(tmp_path / "inv.yaml"))
    assert inv is not None
