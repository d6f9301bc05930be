"""GPU utilization: the sandbox stand-in's answer parsed as on a host, and the pure rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from provision.host import hostfacts
from provision.rules.gpuuse import GpuUse, from_facts, idle_since, line, task_util

STANDIN = Path(hostfacts.__file__).parent.parent / "hostimage/rootfs/usr/lib/provision-sandbox/nvidia-smi-standin"


def smi(tmp_path: Path, utilization: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "utilization").write_text(utilization)
    env = {**os.environ, "PROVISION_SANDBOX_GPUS": "2", "PROVISION_SANDBOX_FAULTS": str(tmp_path)}
    return subprocess.run(
        [sys.executable, str(STANDIN), *hostfacts.NVIDIA_SMI[1:]], env=env, capture_output=True, text=True, check=True
    )


def test_a_test_sets_what_the_standin_reports_and_the_probe_reads_it(tmp_path: Path) -> None:
    r = smi(tmp_path, "1 87 40000\n0 250 99999999\n")
    use = from_facts(hostfacts.gpu_report(0, r.stdout, r.stderr)["gpus"])
    # GPU 0's numbers are clamped by the stand-in as a real GPU's would be.
    assert [(u.index, u.util_pct, u.memory_used_mib, u.memory_total_mib) for u in use] == [
        (0, 100, 81559, 81559),
        (1, 87, 40000, 81559),
    ]
    assert line(use) == "0: 100% 79.6/79.6 GiB, 1: 87% 39.1/79.6 GiB"


def test_a_gpu_that_does_not_say_is_unknown_not_zero() -> None:
    facts = hostfacts.gpu_report(0, "0, GPU-a, NVIDIA A100, 40960, [N/A], [N/A]\n", "")
    assert from_facts(facts["gpus"]) == (GpuUse(0, "GPU-a", None, None, 40960),)
    # An older answer without the two fields (a host's facts from before) reads the same.
    assert from_facts(hostfacts.gpu_report(0, "0, GPU-a, NVIDIA A100, 40960\n", "")["gpus"])[0].util_pct is None


@pytest.mark.parametrize(
    "bad",
    [
        {"index": -1, "util_pct": 5},
        {"index": "0", "util_pct": 5},
        {"index": True, "util_pct": 5},
    ],
)
def test_untrusted_entries_are_dropped(bad: dict[str, object]) -> None:
    assert from_facts([bad]) == ()


def test_out_of_range_numbers_are_unknown() -> None:
    (u,) = from_facts([{"index": 0, "uuid": "x" * 500, "util_pct": 101, "memory_used_mib": -3, "memory_mib": 1 << 30}])
    assert (len(u.uuid), u.util_pct, u.memory_used_mib, u.memory_total_mib) == (80, None, None, None)


def test_task_util_is_the_mean_of_its_gpus_that_report() -> None:
    use = (GpuUse(0, "a", 90, 1, 2), GpuUse(1, "b", 10, 1, 2), GpuUse(2, "c", None, 1, 2))
    assert task_util(use, [0, 1]) == 50
    assert task_util(use, [1, 2]) == 10
    assert task_util(use, [2]) is None and task_util(use, [7]) is None


@pytest.mark.parametrize(
    ("samples", "now", "want"),
    [
        ([], 1000.0, None),
        ([(0.0, 1), (300.0, 2), (600.0, 0)], 600.0, 0.0),  # below 5 % for 10 minutes
        ([(0.0, 1), (300.0, 2)], 599.0, None),  # not yet 10 minutes
        ([(0.0, 1), (300.0, 50), (310.0, 1)], 900.0, None),  # busy at 300: idle only since 310
        ([(0.0, 1), (300.0, 50), (310.0, 1)], 910.0, 310.0),
        ([(0.0, 1), (300.0, None), (310.0, 1)], 700.0, None),  # a gap: nothing known at 300
        ([(0.0, 5)], 1000.0, None),  # 5 % is not below 5 %
    ],
)
def test_idle_since(samples: list[tuple[float, int | None]], now: float, want: float | None) -> None:
    assert idle_since(samples, now) == want


def test_a_shorter_window_for_tests() -> None:
    assert idle_since([(0.0, 1), (15.0, 2)], 15.0, window=15) == 0.0
    assert idle_since([(0.0, 1), (15.0, 2)], 15.0) is None


def test_host_use_ties_each_compute_process_to_the_job_whose_unit_it_runs_in() -> None:
    from provision.rules.gpuuse import host_use

    facts = {"gpus": [
        {"index": 0, "uuid": "GPU-a", "util_pct": 87, "memory_used_mib": 40000, "memory_mib": 81559},
        {"index": 1, "uuid": "GPU-b", "util_pct": 0, "memory_used_mib": 0, "memory_mib": 81559},
    ]}  # fmt: skip
    apps = [
        {"gpu_uuid": "GPU-a", "pid": 41, "name": "python3", "used_mib": 39000,
         "owner": {"pid": 41, "comm": "python3", "unit": "provision-bert-chief-0.service", "job": None, "task": None}},
        {"gpu_uuid": "GPU-a", "pid": 42, "name": "python3", "used_mib": 500,
         "owner": {"pid": 42, "comm": "python3", "unit": "user@1000.service", "job": None, "task": None}},
        {"gpu_uuid": "GPU-a", "pid": 43, "name": "python3", "used_mib": 1,
         "owner": {"pid": 43, "comm": "python3", "unit": "docker-x.scope", "job": "vit", "task": "chief-0"}},
        {"gpu_uuid": "GPU-zzz", "pid": 44, "name": "ghost", "used_mib": 1, "owner": None},
    ]  # fmt: skip
    ledger = {"bert": {"units": ["provision-bert-chief-0.service"], "gpus": [0]}}
    use = host_use(facts, {"gpus": {"apps": apps}}, ledger)
    assert use["0"]["utilization"] == 87 and use["0"]["memory_mib"] == 40000 and use["1"]["apps"] == []
    assert [(a["pid"], a["job"]) for a in use["0"]["apps"]] == [(41, "bert"), (42, None), (43, "vit")]
    # No GPU check (apps not asked): the numbers alone; a hostile answer is dropped.
    assert host_use(facts, None, None)["0"]["apps"] == []
    assert host_use({"gpus": "x"}, {"gpus": {"apps": "y"}}, {"bert": 3}) == {}
