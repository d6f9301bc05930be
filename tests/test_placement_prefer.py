"""`placement: {prefer_same: [label, ...]}` (placement/tasks.py): a job's replicas on as few
groups of hosts (a label's values: switches, NVLink domains) as fit them, deterministically,
tasks already placed kept; as tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from provision.core.errors import ValidationError
from provision.core.model import ROLES, Accelerators, Host, Inventory, Pool, Preference, SSHSettings
from provision.inventory.inventory import parse
from provision.placement.tasks import place

SSH = SSHSettings()


def host(name: str, gpus: int = 0, **labels: str) -> Host:
    acc = Accelerators("nvidia-h100", gpus) if gpus else None
    return Host(name, name, SSH, name, acc, tuple(sorted(labels.items())))


def inv(hosts, pools, prefer=()) -> Inventory:
    pools = sorted(pools, key=lambda p: ROLES.index(p.role))
    return Inventory(
        path=Path("x"), job="j", ssh=SSH, hosts=tuple(hosts), pools=tuple(pools), placement=Preference(tuple(prefer))
    )


def workers(n: int, gpus: int = 0) -> list[Pool]:
    return [Pool("chief", 1, gpus, ("/bin/true",)), Pool("worker", n - 1, gpus, ("/bin/true",))]


def hosts_of(p) -> list[str]:
    return [t.host.name for t in p.tasks]


# Switch a: four hosts, first in the inventory; switch b: two; one host with no switch label.
CLUSTER = [
    host("a1", switch="a"),
    host("a2", switch="a"),
    host("b1", switch="b"),
    host("a3", switch="a"),
    host("none"),
    host("b2", switch="b"),
    host("a4", switch="a"),
]


@pytest.mark.parametrize(
    "tasks, prefer, expect",
    [
        # Without a preference: one per host, in inventory order.
        (2, (), ["a1", "a2"]),
        (3, (), ["a1", "a2", "b1"]),
        # The smallest switch that holds the job.
        (2, ("switch",), ["b1", "b2"]),
        (3, ("switch",), ["a1", "a2", "a3"]),
        (4, ("switch",), ["a1", "a2", "a3", "a4"]),
        # Larger than any switch: the largest first, then the next, the unlabelled host last.
        (6, ("switch",), ["a1", "a2", "a3", "a4", "b1", "b2"]),
        (7, ("switch",), ["a1", "a2", "a3", "a4", "b1", "b2", "none"]),
    ],
)
def test_replicas_go_to_as_few_groups_as_fit_them(tasks, prefer, expect):
    p = place(inv(CLUSTER, workers(tasks), prefer))
    assert sorted(hosts_of(p)) == sorted(expect)
    assert p == place(inv(CLUSTER, workers(tasks), prefer))  # deterministic


def test_gpu_replicas_count_the_slots_a_group_has():
    # 8 replicas of 2 GPUs: domain x (two hosts of 8 GPUs: 8 slots) holds them; y (one: 4) does not.
    cluster = [host("y1", 8, nvl="y"), host("x1", 8, nvl="x"), host("x2", 8, nvl="x")]
    p = place(inv(cluster, workers(8, gpus=2), ("nvl",)))
    assert sorted(set(hosts_of(p))) == ["x1", "x2"]
    # 4 replicas fit y's single host: the smallest that holds them.
    p = place(inv(cluster, workers(4, gpus=2), ("nvl",)))
    assert set(hosts_of(p)) == {"y1"}


def test_the_first_label_counts_most():
    cluster = [
        host("h1", rack="r1", switch="s1"),
        host("h2", rack="r1", switch="s2"),
        host("h3", rack="r2", switch="s2"),
        host("h4", rack="r2", switch="s2"),
    ]
    assert sorted(hosts_of(place(inv(cluster, workers(2), ("rack", "switch"))))) == ["h1", "h2"]
    assert sorted(hosts_of(place(inv(cluster, workers(2), ("switch", "rack"))))) == ["h3", "h4"]


def test_placed_tasks_stay_when_the_preference_comes():
    before = place(inv(CLUSTER, workers(2)))
    after = place(inv(CLUSTER, workers(3), ("switch",)), previous=before.slots())
    assert hosts_of(after)[:2] == hosts_of(before) and len(after.tasks) == 3


def test_a_drained_host_takes_no_part_in_its_group():
    cluster = [host("b1", switch="b"), host("b2", switch="b"), host("a1", switch="a"), host("a2", switch="a")]
    drained = [
        Host(h.name, h.address, h.ssh, h.cluster_address, h.accelerators, h.labels, h.name == "b1") for h in cluster
    ]
    assert sorted(hosts_of(place(inv(drained, workers(2), ("switch",))))) == ["a1", "a2"]


def test_the_inventory_key():
    text = """job: j
hosts:
  - {name: a, address: 192.0.2.1, labels: {switch: s1, nvlink_domain: d1}}
  - {name: b, address: 192.0.2.2, labels: {switch: s2}}
pools:
  worker: {replicas: 2, command: [/bin/true]}
placement: {prefer_same: [nvlink_domain, switch]}
"""
    assert parse(text, Path("inv.yaml")).placement == Preference(("nvlink_domain", "switch"))
    assert (
        parse(text.replace("placement: {prefer_same: [nvlink_domain, switch]}\n", ""), Path("inv.yaml")).placement
        == Preference()
    )
    with pytest.raises(ValidationError) as e:
        parse(text.replace("[nvlink_domain, switch]", "rack"), Path("inv.yaml"))
    assert "placement.prefer_same: expected a list of strings, got 'rack'" in str(e.value.details or e.value.message)
