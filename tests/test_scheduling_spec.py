"""The inventory's priority, preemptible and preemption keys as parsed (bad values: test_validation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from provision.core.scheduling import PreemptSignal, Scheduling
from provision.inventory.inventory import parse
from provision.inventory.scheduling import duration_s

BASE = """\
job: j
hosts: [{name: h1, address: 192.0.2.11, accelerators: {type: nvidia-h100, count: 2}}]
pools:
  chief: {replicas: 1, accelerators: 1, command: [/usr/bin/python3, /opt/t.py]}
"""


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ("", Scheduling()),
        ("priority: high\n", Scheduling(priority="high")),
        ("priority: -5\n", Scheduling(priority=-5)),
        ("preemptible: false\n", Scheduling(preemptible=False)),
        ("preemption: {grace: 10s, signal: sigusr1}\n", Scheduling(grace_s=10, signal=PreemptSignal.SIGUSR1)),
        ("preemption: {grace: 2m}\n", Scheduling(grace_s=120)),
        ("preemption: {grace: 0}\n", Scheduling(grace_s=0)),
    ],
)
def test_parsed(extra: str, want: Scheduling) -> None:
    assert parse(BASE + extra, Path("inv.yaml")).scheduling == want


def test_defaults_by_kind() -> None:
    assert Scheduling().may_be_preempted(trial=True) and not Scheduling().may_be_preempted(trial=False)
    assert not Scheduling(preemptible=False).may_be_preempted(trial=True)
    assert Scheduling(preemptible=True).may_be_preempted(trial=False)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (90, 90),
        ("90", 90),
        ("90s", 90),
        ("3m", 180),
        ("1h", 3600),
        ("-1", None),
        (True, None),
        ("1d", None),
        (1.5, None),
    ],
)
def test_duration(text: object, want: int | None) -> None:
    assert duration_s(text) == want
