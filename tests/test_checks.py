"""Pre-flight checks, pure parts, as tables: the host-side parsers (host/hostcheck.py, which
both the agent and the fast probe use), the judging rules (checks.py), who dials whom, what
each host is asked in the network round trip, and the NCCL/Gloo interface in the env.
tests/integration/test_check.py runs them for real on sandbox hosts with injected faults."""

from __future__ import annotations

import pytest

from provision.core.target import HostError, Target
from provision.host import hostcheck, hostfacts, ledger
from provision.host.protocol import NetcheckReport, ProbeReport
from provision.host.taskenv import parse_env
from provision.inventory.inventory import parse
from provision.render.files import render
from provision.rules import network
from provision.rules import preflight as checks
from provision.rules.planner import Checks, make_plan
from provision.rules.preflight import Finding, Status
from provision.run import context

UNIT = "provision-j-chief-0.service"
H100 = "NVIDIA H100 80GB HBM3"

# --------------------------------------------------------------------------- host-side parsers


def test_gpu_health_reads_the_health_columns():
    out = (
        "0, GPU-a, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 0, No, No, 0, 0\n"
        "1, GPU-b, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 3, Yes, [N/A], 87, 500\n"
        "2, GPU-c, Tesla T4, 15360, 535.1, [N/A], [N/A], [Not Supported], [N/A], [N/A]\n"
        "garbage\n"
    )
    assert hostcheck.gpu_health(out) == [
        {
            "index": 0,
            "driver": "550.54.15",
            "ecc_uncorrected": 0,
            "retired_pending": False,
            "remap_pending": False,
            "memory_used_mib": 0,
        },
        {
            "index": 1,
            "driver": "550.54.15",
            "ecc_uncorrected": 3,
            "retired_pending": True,
            "remap_pending": None,
            "memory_used_mib": 500,
        },
        {
            "index": 2,
            "driver": "535.1",
            "ecc_uncorrected": None,
            "retired_pending": None,
            "remap_pending": None,
            "memory_used_mib": None,
        },
    ]
    # The facts from the same run: utilization and memory from their own columns (not ECC's).
    gpus = hostfacts.gpu_report(0, out, "", hostcheck.GPU_FIELDS)["gpus"]
    assert [(g["index"], g["util_pct"], g["memory_used_mib"]) for g in gpus] == [
        (0, 0, 0),
        (1, 87, 500),
        (2, None, None),
    ]


@pytest.mark.parametrize(
    "out, busy",
    [
        ("0, a, H100, 81559, 550, 0, No, No, 0\n1, b, H100, 81559, 550, 0, No, No, 0\n", False),
        ("0, a, H100, 81559, 550, 0, No, No, 0\n1, b, H100, 81559, 550, 0, No, No, 3\n", True),
        ("0, a, H100, 81559, 550, 0, No, No, [N/A]\n", True),  # cannot tell: ask
        ("", False),
        ("\n\n", False),
    ],
)
def test_compute_processes_are_listed_only_when_a_gpu_has_memory_in_use(out, busy):
    assert hostcheck.memory_in_use(out) is busy


def test_compute_apps_keep_names_with_commas():
    out = "GPU-a, 4242, python3, 500\nGPU-b, 77, my, odd, name, [N/A]\n\n"
    assert hostcheck.parse_apps(out) == [
        {"gpu_uuid": "GPU-a", "pid": 4242, "name": "python3", "used_mib": 500},
        {"gpu_uuid": "GPU-b", "pid": 77, "name": "my, odd, name", "used_mib": None},
    ]
    assert hostcheck.app_pids(hostcheck.parse_apps(out)) == [77, 4242]


@pytest.mark.parametrize(
    "cgroup, unit",
    [
        ("0::/system.slice/provision-j-chief-0.service\n", UNIT),
        ("0::/docker/abc/system.slice/provision-j-chief-0.service\n", UNIT),  # cgroupns=host
        ("9:name=systemd:/system.slice/ssh.service\n4:memory:/x\n", "ssh.service"),  # v1 only
        ("9:name=systemd:/a/b.service\n0::/docker/abc/init.scope\n", None),  # the unified line wins
        ("0::/user.slice/user-0.slice/session-3.scope\n", None),
        ("0::/system.slice/docker-abc.scope\n", None),  # a container task's process
        ("", None),
    ],
)
def test_the_unit_a_process_runs_in(cgroup, unit):
    assert hostcheck.unit_of_cgroup(cgroup) == unit


def test_environment_of_a_container_task_names_its_job():
    assert hostcheck.wants_env("0::/system.slice/docker-abc.scope") is True
    assert hostcheck.wants_env("0::/system.slice/provision-j-chief-0.service") is False
    env = ["PATH=/bin", "PROVISION_JOB=j", "PROVISION_TASK=worker-1", "PROVISION_JOB=other", "PROVISION_TASK"]
    assert hostcheck.env_pairs(env) == {"PROVISION_JOB": "j", "PROVISION_TASK": "worker-1"}
    o = hostcheck.owner(7, " python3\n", "0::/system.slice/docker-abc.scope", hostcheck.env_pairs(env))
    assert o == {"pid": 7, "comm": "python3", "unit": None, "job": "j", "task": "worker-1"}


def test_listeners_on_the_jobs_ports_and_who_holds_them():
    lines = [
        "0: 00000000:08AE 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 111 1 x",
        "1: 00000000:08AF 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 222 1 x",
        "2: 0100007F:08AE 0100007F:9C40 01 00000000:00000000 00:00000000 00000000 0 0 333 1 x",  # not listening
        "3: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 444 1 x",  # not asked
    ]
    pairs = [pr for ln in lines if (pr := ledger.proc_pair(ln)) is not None]
    assert pairs == [(2222, "111"), (2223, "222"), (22, "444")]
    sockets = hostcheck.sockets_of([*pairs, (2224, "0")], [2222, 2223, 2224])
    assert sockets == [(2222, "111"), (2223, "222")]
    mine = hostcheck.owner(10, "python3", "0::/system.slice/" + UNIT, {})
    got = hostcheck.port_owners(sockets, {"111": [10, 10]}, {10: mine})
    assert got == {"2222": [mine], "2223": [{"pid": None, "comm": "", "unit": None, "job": None, "task": None}]}


@pytest.mark.parametrize(
    "addresses, code, ip_out, want",
    [
        (
            ["10.0.0.5"],
            0,
            "1: lo    inet 127.0.0.1/8 scope host lo\\\n2: eth0    inet 10.0.0.5/24 brd 10.0.0.255 scope global eth0\\",
            {"address": "10.0.0.5", "name": "eth0", "error": None},
        ),
        (
            ["fd00::5", "10.1.0.5"],
            0,
            "3: ib0    inet 10.1.0.5/16 scope global ib0\n2: eth0    inet6 fe80::1/64 scope link",
            {"address": "10.1.0.5", "name": "ib0", "error": None},
        ),
        (
            ["127.0.1.1"],
            0,
            "1: lo    inet 127.0.0.1/8 scope host lo",
            {"address": "127.0.1.1", "name": None, "error": None},
        ),
        ([], 0, "", {"address": None, "name": None, "error": hostcheck.UNKNOWN_NAME}),
        (["10.0.0.5"], 127, "", {"address": "10.0.0.5", "name": None, "error": "ip is not installed (iproute2)"}),
    ],
)
def test_the_interface_that_holds_the_cluster_address(addresses, code, ip_out, want):
    assert hostcheck.interface_of(addresses, code, ip_out) == want


def test_getent_and_stat_output():
    out = "10.0.0.5        STREAM gpu-1\n10.0.0.5        DGRAM  \n10.0.0.5        RAW    \nfd00::5 STREAM\n"
    assert hostcheck.getent_addresses(out) == ["10.0.0.5", "fd00::5"]
    assert hostcheck.disk_lines(["100 4096 /opt", "7 512 /", "bad line"]) == {"/opt": 409600, "/": 3584}


# --------------------------------------------------------------------------- judging

INVENTORY = """
job: j
hosts:
  - {name: h1, address: 10.0.0.1, cluster_address: gpu-1.ib, accelerators: {type: nvidia-h100, count: 2}}
  - {name: h2, address: 10.0.0.2, cluster_address: gpu-2.ib, accelerators: {type: nvidia-h100, count: 2}}
  - {name: h3, address: 10.0.0.3, cluster_address: gpu-3.ib, accelerators: {type: nvidia-h100, count: 2}}
pools:
  chief: {replicas: 1, accelerators: 1, command: [python3, train.py]}
  worker: {replicas: 2, accelerators: 1, command: [python3, train.py]}
"""


def gpus(n=2, name=H100, mib=81559):
    return [{"index": i, "uuid": f"GPU-{i}", "name": name, "memory_mib": mib} for i in range(n)]


def health(n=2, driver="550.54.15", **bad):
    out = [
        {"index": i, "driver": driver, "ecc_uncorrected": 0, "retired_pending": False, "remap_pending": False}
        for i in range(n)
    ]
    for key, (i, value) in bad.items():
        out[i][key] = value
    return out


def report(*, facts=None, health_=None, apps=(), ports=None, now=None, interface=None, error=None, ledger=None):
    c = {
        "gpus": {
            "error": error,
            "health": health() if health_ is None else health_,
            "apps": list(apps),
            "apps_error": None,
        },
        "ports": ports or {},
    }
    return ProbeReport(
        facts={"systemd_pid1": True, "nvidia_smi": "ok", "gpus": gpus(), **(facts or {})},
        checks=c,
        now=now,
        interface=interface or {"address": "10.0.0.1", "name": "eth0", "error": None},
        ledger=ledger,
    )


def judged(tmp_path, **per_host) -> list[Finding]:
    inv = parse(INVENTORY, tmp_path / "inventory.yaml")
    rendered = render(inv)
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    reports = {n: per_host.get(n, report()) for n in targets}
    p = make_plan(rendered, targets, reports)
    return checks.judge(inv, p, per_host.get("timings"))


def has(findings, host, check, status, text=""):
    return any(f.host == host and f.check == check and f.status is status and text in f.detail for f in findings), [
        f for f in findings if f.host == host and f.check == check
    ]


def owner(pid, comm="python3", unit=None, job=None):
    return {"pid": pid, "comm": comm, "unit": unit, "job": job, "task": None}


# Each case: what host h1 reports, then (check, status, words in the line). The chief is on
# h1 with GPU 0 and port 2222 (placement: one task per host, lowest GPUs first).
CASES = [
    ("healthy", {}, [("gpus", Status.PASS, "2 × NVIDIA H100"), ("ports", Status.PASS, "2222 (chief-0) free")]),
    (
        "a GPU missing",
        {"facts": {"gpus": gpus(1)}},
        [("gpus", Status.FAIL, "inventory declares 2 nvidia-h100, but nvidia-smi reports 1")],
    ),
    (
        "another GPU model",
        {"facts": {"gpus": gpus(2, "NVIDIA A100-SXM4-40GB", 40960)}},
        [("gpus", Status.FAIL, "but nvidia-smi reports NVIDIA A100-SXM4-40GB")],
    ),
    (
        "nvidia-smi hangs",
        {
            "facts": {"nvidia_smi": "nvidia-smi: timed out after 10s", "gpus": []},
            "error": "nvidia-smi: timed out after 10s",
        },
        [("gpus", Status.FAIL, "nvidia-smi failed: nvidia-smi: timed out after 10s")],
    ),
    (
        "ECC errors on the job's GPU",
        {"health_": health(ecc_uncorrected=(0, 2))},
        [("gpu health", Status.FAIL, "GPU 0: 2 uncorrectable ECC errors")],
    ),
    (
        "row remapping pending on a GPU the job does not use",
        {"health_": health(remap_pending=(1, True))},
        [("gpu health", Status.WARN, "GPU 1: row remapping pending (not one the job uses)")],
    ),
    (
        "page retirement pending on the job's GPU",
        {"health_": health(retired_pending=(0, True))},
        [("gpu health", Status.FAIL, "GPU 0: page retirement pending")],
    ),
    (
        "a foreign process on the job's GPU",
        {"apps": [{"gpu_uuid": "GPU-0", "pid": 4242, "name": "trainer", "used_mib": 500, "owner": None}]},
        [("gpu processes", Status.FAIL, "GPU 0 is busy: trainer (pid 4242, not among this host's processes")],
    ),
    (
        "a foreign process on a GPU the job does not use",
        {"apps": [{"gpu_uuid": "GPU-1", "pid": 9, "name": "x", "used_mib": 5, "owner": owner(9, "x", "foo.service")}]},
        [("gpu processes", Status.WARN, "GPU 1 is busy: x (pid 9, foo.service), 5 MiB, not started by provision")],
    ),
    (
        "the job's own process on its GPU",
        {"apps": [{"gpu_uuid": "GPU-0", "pid": 9, "name": "python3", "used_mib": 5, "owner": owner(9, unit=UNIT)}]},
        [("gpu processes", Status.PASS, "none but provision's")],
    ),
    (
        "another provision job's process (tenancy's business)",
        {
            "apps": [
                {
                    "gpu_uuid": "GPU-1",
                    "pid": 9,
                    "name": "p",
                    "used_mib": 5,
                    "owner": owner(9, unit="provision-o-w.service"),
                }
            ],
            "ledger": {"o": {"units": ["provision-o-w.service"]}},
        },
        [("gpu processes", Status.PASS, "none but provision's")],
    ),
    (
        "a foreign listener on the chief's port",
        {"ports": {"2222": [owner(133, "python3", "foreign.service")]}},
        [("ports", Status.FAIL, "port 2222 (chief-0) is taken by python3 (pid 133, foreign.service), not by this job")],
    ),
    (
        "the chief itself listens on its port",
        {"ports": {"2222": [owner(50, unit=UNIT)]}},
        [("ports", Status.PASS, "2222 (chief-0) held by the job's own task")],
    ),
    (
        "the chief's container listens on its port",
        {"ports": {"2222": [owner(50, unit=None, job="j")]}},
        [("ports", Status.PASS, "held by the job's own task")],
    ),
    (
        "another job's task listens on the port",
        {
            "ports": {"2222": [owner(50, unit="provision-o-w.service")]},
            "ledger": {"o": {"units": ["provision-o-w.service"]}},
        },
        [("ports", Status.FAIL, "taken by job o's python3 (pid 50, provision-o-w.service)")],
    ),
    (
        "a listener in another PID namespace",
        {"ports": {"2222": [owner(None)]}},
        [("ports", Status.FAIL, "not visible here")],
    ),
    (
        "the cluster address is on loopback",
        {"interface": {"address": "127.0.1.1", "name": "lo", "error": None}},
        [("interface", Status.WARN, "on loopback")],
    ),
    (
        "the cluster address is on no interface",
        {"interface": {"address": "203.0.113.9", "name": None, "error": None}},
        [("interface", Status.WARN, "which no interface of this host holds")],
    ),
    (
        "the interface",
        {"interface": {"address": "10.0.0.1", "name": "ib0", "error": None}},
        [("interface", Status.PASS, "ib0 holds 10.0.0.1 (gpu-1.ib)")],
    ),
    ("systemd missing", {"facts": {"systemd_pid1": False}}, [("systemd", Status.FAIL, "systemd is not running")]),
]


@pytest.mark.parametrize("doc, h1, want", CASES, ids=[c[0] for c in CASES])
def test_per_host_judgement(tmp_path, doc, h1, want):
    found = judged(tmp_path, h1=report(**h1))
    for check, status, text in want:
        ok, seen = has(found, "h1", check, status, text)
        assert ok, f"{doc}: want {check} {status} {text!r}; got {seen}"
    # The other hosts are healthy whatever h1 has.
    assert not [f for f in found if f.host != "h1" and f.status is Status.FAIL]


def test_drivers_that_differ_warn_on_the_odd_host(tmp_path):
    found = judged(tmp_path, h3=report(health_=health(driver="535.104")))
    assert has(found, "h3", "driver", Status.WARN, "driver 535.104 here, 550.54.15 on h1, h2")[0]
    assert has(found, "h1", "driver", Status.PASS, "550.54.15")[0]


@pytest.mark.parametrize(
    "nows, timings, want",
    [
        # host → its clock; asked at 100.0, answered at 100.2 (controller's clock)
        ({"h1": 100.1, "h2": 100.1, "h3": 103.6}, None, {"h3": Status.WARN, "h1": Status.PASS}),
        ({"h1": 100.1, "h2": 98.5, "h3": 100.1}, None, {"h2": Status.WARN}),
        ({"h1": 100.1, "h2": 100.6, "h3": 100.1}, None, {"h2": Status.PASS}),  # within a second
        # a slow answer: the clock could have been read any time in 2 s
        ({"h1": 100.1, "h2": 100.1, "h3": 102.0}, {"h3": (100.0, 102.0)}, {"h3": Status.PASS}),
    ],
)
def test_clock_skew_between_hosts(tmp_path, nows, timings, want):
    times = {n: (100.0, 100.2) for n in nows}
    times.update(timings or {})
    found = judged(tmp_path, timings=times, **{n: report(now=t) for n, t in nows.items()})
    for host, status in want.items():
        assert has(found, host, "clock", status)[0], [f for f in found if f.check == "clock"]


def test_clock_skew_is_a_lower_bound():
    offsets = checks.clock_offsets({"a": 10.0, "b": 10.0, "c": 15.0}, {n: (9.5, 10.5) for n in "abc"})
    skews = checks.clock_skews(offsets)
    assert skews["a"] == skews["b"] == 0.0 and skews["c"] == pytest.approx(4.5)


@pytest.mark.parametrize(
    "declared, names, mib, problem",
    [
        ("nvidia-h100", [H100], [81559], None),
        ("nvidia-tesla-a100", ["NVIDIA A100-SXM4-40GB"], [40960], None),  # 'tesla' is not compared
        ("nvidia-a100-80gb", ["NVIDIA A100-SXM4-80GB"], [81920], None),
        ("nvidia-a100-80gb", ["NVIDIA A100-SXM4-40GB"], [40960], "GPUs have 40960 MiB"),
        ("nvidia-l4", ["NVIDIA L4"], [23034], None),
        ("nvidia-h100", ["Tesla V100-SXM2-16GB"], [16384], "but nvidia-smi reports Tesla V100"),
        ("gpu", ["anything"], [1], None),  # no model named: nothing to compare
    ],
)
def test_gpu_model_and_memory_against_the_declared_type(declared, names, mib, problem):
    got = checks.gpu_model_problem(declared, names, mib)
    assert (got is None) if problem is None else (problem in (got or "")), got


def test_failures_refuse_the_apply_and_warnings_are_shown(tmp_path):
    inv = parse(INVENTORY, tmp_path / "inventory.yaml")
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    reports = {
        "h1": report(ports={"2222": [owner(133, "nc")]}),
        "h2": report(health_=health(remap_pending=(1, True))),
        "h3": report(),
    }
    p = make_plan(render(inv), targets, reports, checks=Checks())
    h1, h2, h3 = p.hosts
    assert any("port 2222 (chief-0) is taken by nc (pid 133)" in x for x in h1.problems)
    assert len(h1.problems) == 1  # the port is said once, though two checks see it
    assert h2.problems == () and any(w.startswith("h2: GPU 1: row remapping pending") for w in h2.warnings)
    assert h3.problems == ()
    assert make_plan(render(inv), targets, reports).hosts[0].problems == ()  # checks only when asked


def test_an_unreachable_host_is_one_line(tmp_path):
    inv = parse(INVENTORY, tmp_path / "inventory.yaml")
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    err = HostError(targets["h2"], "connection refused", unreachable=True)
    p = make_plan(render(inv), targets, {"h1": report(), "h2": err, "h3": report()})
    found = checks.judge(inv, p)
    assert [f for f in found if f.host == "h2"] == [Finding("h2", "ssh", Status.FAIL, err.message)]


# --------------------------------------------------------------------------- the network

JOBS = {
    "tf": "chief: {replicas: 1, command: [x]}\n  worker: {replicas: 2, command: [x]}\n  ps: {replicas: 1, command: [x]}\n"
    "  evaluator: {replicas: 1, command: [x]}",
    "reduction": "worker: {replicas: 3, command: [x]}\n  reduction_server: {replicas: 2, command: [x]}",
    "single": "chief: {replicas: 1, command: [x]}",
}


def inventory(tmp_path, pools: str, hosts: int = 3):
    hs = "\n".join(f"  - {{name: h{i}, address: 10.0.0.{i}, cluster_address: n{i}}}" for i in range(1, hosts + 1))
    return parse(f"job: j\nhosts:\n{hs}\npools:\n  {pools}\n", tmp_path / "inventory.yaml")


@pytest.mark.parametrize(
    "job, want",
    [
        (
            "tf",
            {
                "chief-0": ["worker-0", "worker-1", "ps-0"],
                "worker-0": ["chief-0", "worker-1", "ps-0"],
                "worker-1": ["chief-0", "worker-0", "ps-0"],
                "ps-0": ["chief-0"],  # DMLC's scheduler
                "evaluator-0": ["chief-0"],
            },
        ),
        (
            "reduction",
            {
                "worker-0": ["worker-1", "worker-2", "reduction_server-0", "reduction_server-1"],
                "worker-1": ["worker-0", "worker-2", "reduction_server-0", "reduction_server-1"],
                "worker-2": ["worker-0", "worker-1", "reduction_server-0", "reduction_server-1"],
                "reduction_server-0": [],
                "reduction_server-1": [],
            },
        ),
        ("single", {}),
    ],
)
def test_who_dials_whom(tmp_path, job, want):
    inv = inventory(tmp_path, JOBS[job])
    got = network.peers(inv, render(inv).placement)
    assert {t: [x.name for x in xs] for t, xs in got.items()} == want


def test_big_jobs_dial_the_master_and_their_neighbours(tmp_path):
    inv = inventory(tmp_path, "worker: {replicas: 80, command: [x]}", hosts=80)
    got = network.peers(inv, render(inv).placement)
    assert [x.name for x in got["worker-5"]] == ["worker-0"] + [f"worker-{i}" for i in range(6, 14)]
    assert [x.name for x in got["worker-79"]] == [f"worker-{i}" for i in range(8)]  # the master once


def net_plan(tmp_path, ports_h1=None):
    inv = inventory(tmp_path, "chief: {replicas: 1, command: [x]}\n  worker: {replicas: 2, command: [x]}")
    rendered = render(inv)
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    reports = {n: ProbeReport(checks={"ports": {}}) for n in targets}
    if ports_h1 is not None:
        reports["h1"] = ProbeReport(checks={"ports": ports_h1})
    p = make_plan(rendered, targets, reports)
    return network.network_plan(inv, p, rendered.placement), rendered.placement


def test_each_host_listens_on_its_free_ports_and_dials_its_peers(tmp_path):
    net, _ = net_plan(tmp_path)
    h1 = net.requests["h1"]
    assert h1.listen == [2222] and h1.expect == {"2222": 2}
    assert sorted(h1.dial) == [["n2", 2222], ["n3", 2222]]
    assert net.requests["h2"].dial == [["n1", 2222], ["n3", 2222]]


def test_a_port_the_task_holds_is_dialed_not_listened_on_and_a_taken_one_neither(tmp_path):
    net, _ = net_plan(tmp_path, {"2222": [owner(5, unit="provision-j-chief-0.service")]})
    assert net.requests["h1"].listen == [] and ["n1", 2222] in net.requests["h2"].dial
    net, _ = net_plan(tmp_path, {"2222": [owner(5, "nc")]})
    assert net.requests["h1"].listen == [] and ["n1", 2222] not in net.requests["h2"].dial
    assert any("did not try chief-0 at n1:2222: the port is taken" in s for s in net.skipped)


def test_a_failure_is_one_line_naming_both_ends(tmp_path):
    net, placement = net_plan(tmp_path)
    results = {n: NetcheckReport(results=[None] * len(r.dial)) for n, r in net.requests.items()}
    i = net.requests["h3"].dial.index(["n1", 2222])
    results["h3"].results[i] = "timed out: a firewall?"
    results["h2"] = NetcheckReport(results=[None, None], listen_errors={"2222": "Address already in use"})
    found, failures = network.network_findings(net, results, placement)
    assert [f.line for f in failures] == ["worker-1 on h3 cannot reach chief-0 at n1:2222 (timed out: a firewall?)"]
    assert has(found, "h2", "network", Status.FAIL, "could not listen on port 2222 (worker-0) to test it")[0]
    assert has(found, "h1", "network", Status.PASS, "reached 2 addresses")[0]


# --------------------------------------------------------------------------- NCCL / Gloo interface


def env_of(rendered, host, task):
    return dict(parse_env(rendered.hosts[host].file_map()[f"/etc/provision/j/{task}.env"].data().decode()))


def test_the_interface_goes_into_every_task_env_unless_the_inventory_sets_it(tmp_path):
    inv = parse(INVENTORY, tmp_path / "inventory.yaml")
    r = render(inv, socket_ifnames={"h1": "ib0", "h2": "eth1"})
    assert env_of(r, "h1", "chief-0")["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env_of(r, "h1", "chief-0")["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env_of(r, "h2", "worker-0")["NCCL_SOCKET_IFNAME"] == "eth1"
    assert "NCCL_SOCKET_IFNAME" not in env_of(r, "h3", "worker-1")  # nothing reported
    assert "NCCL_SOCKET_IFNAME" not in env_of(render(inv), "h1", "chief-0")  # offline: unknown
    inv = parse(INVENTORY + "env: {NCCL_SOCKET_IFNAME: '=ib1'}\n", tmp_path / "inventory.yaml")
    r = render(inv, socket_ifnames={"h1": "ib0"})
    assert env_of(r, "h1", "chief-0")["NCCL_SOCKET_IFNAME"] == "=ib1"
    assert env_of(r, "h1", "chief-0")["GLOO_SOCKET_IFNAME"] == "ib0"


def test_socket_ifnames_leave_out_loopback_and_unknowns():
    reports = {
        "a": ProbeReport(interface={"address": "10.0.0.1", "name": "eth0", "error": None}),
        "b": ProbeReport(interface={"address": "127.0.1.1", "name": "lo", "error": None}),
        "c": ProbeReport(interface={"address": None, "name": None, "error": "x"}),
        "d": ProbeReport(),
    }
    assert context.socket_ifnames(reports) == {"a": "eth0"}


def test_what_a_host_is_asked(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a").write_text("x")
    inv = parse(INVENTORY + "files: [{src: data/, dest: /opt/job/}]\n", tmp_path / "inventory.yaml")
    bundle = render(inv).hosts["h1"]
    host = inv.hosts[0]
    assert checks.request_fields(inv, host, bundle, ["gpus"], checks=False) == {"cluster_address": "gpu-1.ib"}
    got = checks.request_fields(inv, host, bundle, ["gpus"], checks=True)["checks"]
    assert got == {
        "gpus": True,
        "gpu_timeout": checks.GPU_TIMEOUT,
        "clock": True,
        "ports": [2222],
        "disk": ["/", "/opt", "/opt/job"],
    }
    assert checks.request_fields(inv, host, None, [], checks=True) == {}


# --------------------------------------------------------------------------- script and agent agree


def test_the_script_and_the_agent_read_the_checks_alike(tmp_path, monkeypatch):
    """probe.sh's check sections, read by probe.py, against the agent's own reading, on this
    machine: a fake nvidia-smi (the sandbox's stand-in) with a busy GPU, a listener on a
    port of the job, free disk, the clock, the interface of an address.
    tests/integration/test_probe.py does the same on real hosts."""
    import os
    import shutil
    import socket
    import subprocess
    from pathlib import Path

    from provision.host import agent
    from provision.host.protocol import ProbeRequest, to_wire
    from provision.io import probe

    standin = Path(checks.__file__).parent.parent / "hostimage/rootfs/usr/lib/provision-sandbox/nvidia-smi-standin"
    if not Path("/usr/bin/python3").exists():
        pytest.skip("the stand-in runs under /usr/bin/python3")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(standin, bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "busy-gpus").write_text(f"1 {os.getpid()} python3 10\n")
    (faults / "ecc-errors").write_text("0 2\n")
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PROVISION_SANDBOX_GPUS": "2",
        "PROVISION_SANDBOX_FAULTS": str(faults),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        req = ProbeRequest(
            "j",
            facts="check",
            facts_only=["gpus"],
            checks={"gpus": True, "gpu_timeout": 10, "clock": True, "ports": [port], "disk": ["/", str(tmp_path)]},
            cluster_address="localhost",
        )
        cmd = probe.command(req)
        assert cmd is not None
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, check=True, env={**os.environ, **env}).stdout
        fast = probe.parse(out, req)
        slow = agent.op_probe(req)
    a, b = to_wire(fast), to_wire(slow)
    for x in (a, b):
        x["checks"]["disk"] = sorted(x["checks"]["disk"])  # free space moves between two reads
    assert a["checks"] == b["checks"] and a["facts"] == b["facts"] and a["interface"] == b["interface"]
    assert abs(fast.now - slow.now) < 5
    owners = a["checks"]["ports"][str(port)]
    assert [o["pid"] for o in owners] == [os.getpid()]
    assert [x["owner"]["pid"] for x in a["checks"]["gpus"]["apps"]] == [os.getpid()]
    assert a["checks"]["gpus"]["health"][0]["ecc_uncorrected"] == 2
    assert a["interface"]["name"] == "lo"

    # No GPU memory in use: neither asks for compute processes, both say there are none.
    (faults / "busy-gpus").unlink()
    req = ProbeRequest("j", facts="check", facts_only=["gpus"], checks={"gpus": True, "gpu_timeout": 10})
    out = subprocess.run(["sh", "-c", probe.command(req) or ""], capture_output=True, check=True).stdout
    a, b = to_wire(probe.parse(out, req)), to_wire(agent.op_probe(req))
    assert a["checks"] == b["checks"] and a["checks"]["gpus"]["apps"] == [] and b"@apps" not in out

    # A hung nvidia-smi, and no ports asked: both give up after the timeout, alike.
    (faults / "nvidia-smi-hang").write_text("30\n")
    req = ProbeRequest("j", facts="check", facts_only=["gpus"], checks={"gpus": True, "gpu_timeout": 1})
    out = subprocess.run(["sh", "-c", probe.command(req) or ""], capture_output=True, check=True).stdout
    a, b = to_wire(probe.parse(out, req)), to_wire(agent.op_probe(req))
    assert a["checks"] == b["checks"] and a["facts"] == b["facts"]
    assert a["checks"]["gpus"]["error"] == "nvidia-smi: timed out after 1s"


def test_the_network_op_listens_dials_and_ends_when_all_came_in():
    """op_netcheck on this machine's loopback: the listener gets its one expected connection
    and the op ends at once; a closed port is refused (tried until the window ends); a port
    something already holds cannot be listened on."""
    import socket
    import time

    from provision.host.protocol import NetcheckRequest

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    mine, closed = free_port(), free_port()
    req = NetcheckRequest("j", listen=[mine], expect={str(mine): 1}, dial=[["127.0.0.1", mine]], timeout=1, window=3)
    t0 = time.monotonic()
    rep = hostcheck.op_netcheck(req)
    assert rep.results == [None] and rep.accepted == {str(mine): 1} and rep.listen_errors == {}
    assert time.monotonic() - t0 < 1, "ended as soon as the expected connection came in and closed"

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        req = NetcheckRequest("j", listen=[taken], dial=[["127.0.0.1", closed]], timeout=1, window=1)
        rep = hostcheck.op_netcheck(req)
    assert rep.results == ["connection refused: nothing listens there"]
    assert list(rep.listen_errors) == [str(taken)] and "in use" in rep.listen_errors[str(taken)]


@pytest.mark.parametrize(
    "hosts, before, after",
    [
        (8, {"gc_thresh1": 128, "gc_thresh2": 512, "gc_thresh3": 1024}, {"gc_thresh3": 1024}),  # small: left alone
        (32, {"gc_thresh1": 128, "gc_thresh2": 512, "gc_thresh3": 1024}, {"gc_thresh1": 4096, "gc_thresh3": 16384}),
        (32, {"gc_thresh1": 8000, "gc_thresh2": 8192, "gc_thresh3": 99999}, {"gc_thresh1": 8000, "gc_thresh3": 99999}),
    ],
)
def test_sandbox_hosts_that_dial_each_other_get_room_in_the_neighbour_table(tmp_path, hosts, before, after):
    """32 hosts all-to-all need ~1000 ARP entries, the kernel's default limit for all
    containers together (the network check timed out between some pairs without this)."""
    from provision.sandbox.neighbours import raise_neighbour_limits

    for k, v in before.items():
        (tmp_path / k).write_text(f"{v}\n")
    said: list[str] = []
    raise_neighbour_limits(hosts, said.append, root=tmp_path)
    for k, v in after.items():
        assert int((tmp_path / k).read_text()) == v
    assert bool(said) == (after != {k: before[k] for k in after})


def test_sizes_are_never_rounded_down_to_nothing():
    assert [checks._mib(n) for n in (0, 1, 300, 4096, 5 << 20, 3 << 30)] == [
        "0 bytes",
        "1 byte",
        "300 bytes",
        "4 KiB",
        "5 MiB",
        "3.0 GiB",
    ]


# --------------------------------------------------------------------------- hypertune (a study's trials)

STUDY = (
    INVENTORY
    + """tune:
  metric: {name: val_loss, goal: minimize}
  parameters: {lr: {type: double, min: 0.001, max: 0.1}}
  max_trials: 4
"""
)


@pytest.mark.parametrize(
    "extra, want",
    [
        ("", [["python3", None]]),
        ("env: {PYTHONPATH: /opt/libs}\n", [["python3", "/opt/libs"]]),
        # Read from the log: no hypertune needed.
        ("", None),
        ("setup: {commands: ['pip install cloudml-hypertune']}\n", None),
    ],
    ids=["bare", "pythonpath", "regex", "setup-installs-it"],
)
def test_a_study_asks_whether_its_python_imports_hypertune(tmp_path, extra, want, request):
    text = STUDY + extra
    if request.node.callspec.id == "regex":
        text = text.replace("goal: minimize}", "goal: minimize, regex: 'val_loss=(?P<value>[0-9.]+)'}")
    inv = parse(text, tmp_path / "inventory.yaml")
    bundle = render(inv).hosts["h1"]
    got = checks.request_fields(inv, inv.hosts[0], bundle, ["gpus"], checks=True)["checks"]
    assert got.get("hypertune") == want
    # Not for a plain job, nor for a trial of `provision tune` (its start would pay for it).
    plain = parse(INVENTORY, tmp_path / "inventory.yaml")
    assert (
        "hypertune"
        not in checks.request_fields(plain, plain.hosts[0], render(plain).hosts["h1"], [], checks=True)["checks"]
    )


ONE_CHIEF_STUDY = """
job: s
hosts:
  - {name: h1, address: 10.0.0.1, accelerators: {type: nvidia-h100, count: 2}}
  - {name: h2, address: 10.0.0.2, accelerators: {type: nvidia-h100, count: 2}}
  - {name: cpu, address: 10.0.0.3}
pools:
  chief: {replicas: 1, accelerators: 1, command: [python3, train.py]}
tune:
  metric: {name: val_loss, goal: minimize}
  parameters: {lr: {type: double, min: 0.001, max: 0.1}}
  max_trials: 4
"""


def test_every_host_a_trial_could_run_on_is_asked_and_judged_not_only_the_plain_jobs(tmp_path):
    # The plain job's one chief goes on h1; a trial may go on h2 too (not on cpu: no GPU).
    inv = parse(ONE_CHIEF_STUDY, tmp_path / "inventory.yaml")
    rendered = render(inv)
    assert set(rendered.hosts) == {"h1"}
    by = {h.name: h for h in inv.hosts}
    for name in ("h1", "h2"):
        got = checks.request_fields(inv, by[name], rendered.hosts.get(name), [], checks=True)
        assert got["checks"]["hypertune"] == [["python3", None]], name
    assert checks.request_fields(inv, by["cpu"], None, [], checks=True) == {}
    plain = parse(ONE_CHIEF_STUDY.split("tune:")[0], tmp_path / "inventory.yaml")
    assert checks.request_fields(plain, plain.hosts[1], None, [], checks=True) == {}
    # h2's answer is judged like h1's.
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    missing = report()
    missing.checks["hypertune"] = [
        {
            "python": "python3",
            "pythonpath": None,
            "ok": False,
            "error": "ModuleNotFoundError: No module named 'hypertune'",
        }
    ]
    p = make_plan(rendered, targets, {n: missing if n == "h2" else report() for n in targets})
    ok, seen = has(checks.judge(inv, p), "h2", "hypertune", Status.FAIL, "python3 cannot import hypertune")
    assert ok, seen


def test_an_image_pool_and_a_non_python_command_are_not_asked(tmp_path):
    text = STUDY.replace("command: [python3, train.py]}", "command: [torchrun, train.py]}", 1).replace(
        "worker: {replicas: 2, accelerators: 1, command: [python3, train.py]}",
        "worker: {replicas: 2, accelerators: 1, image: 'reg/t:1'}",
    )
    inv = parse(text, tmp_path / "inventory.yaml")
    for h in ("h1", "h2"):
        assert (
            "hypertune" not in checks.request_fields(inv, inv.hosts[0], render(inv).hosts[h], [], checks=True)["checks"]
        )


def test_a_trial_is_not_asked(tmp_path):
    from provision.inventory.trial import trial_inventory

    inv = trial_inventory(parse(STUDY, tmp_path / "inventory.yaml"), 2, {"lr": 0.01})
    assert (
        "hypertune" not in checks.request_fields(inv, inv.hosts[0], render(inv).hosts["h1"], [], checks=True)["checks"]
    )


@pytest.mark.parametrize(
    "answer, status, text",
    [
        (
            {"python": "python3", "pythonpath": None, "ok": True, "file": "/usr/lib/python3/hypertune/__init__.py"},
            Status.PASS,
            "python3 imports hypertune: /usr/lib/python3/hypertune/__init__.py",
        ),
        (
            {
                "python": "python3",
                "pythonpath": None,
                "ok": False,
                "error": "ModuleNotFoundError: No module named 'hypertune'",
            },
            Status.FAIL,
            "python3 cannot import hypertune (ModuleNotFoundError: No module named 'hypertune'): the trials report "
            "val_loss through cloudml-hypertune (`import hypertune`): install it in setup: (`pip install "
            "cloudml-hypertune`); a host with no package index: push its wheel with files: and install that in setup:",
        ),
        (
            {
                "python": "/opt/venv/bin/python",
                "pythonpath": "/opt/libs",
                "ok": False,
                "error": "/opt/venv/bin/python: not found",
            },
            Status.FAIL,
            "/opt/venv/bin/python (PYTHONPATH=/opt/libs) cannot import hypertune (/opt/venv/bin/python: not found)",
        ),
    ],
    ids=["imports", "missing", "no-python"],
)
def test_hypertune_is_judged_with_the_fix(tmp_path, answer, status, text):
    inv = parse(STUDY, tmp_path / "inventory.yaml")
    rendered = render(inv)
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    r = report()
    r.checks["hypertune"] = [answer]
    p = make_plan(rendered, targets, {n: r if n == "h1" else report() for n in targets})
    found = checks.judge(inv, p)
    ok, seen = has(found, "h1", "hypertune", status, text)
    assert ok, seen


def test_the_host_answers_whether_a_python_imports_a_module(tmp_path):
    (tmp_path / "hypertune").mkdir()
    (tmp_path / "hypertune" / "__init__.py").write_text("")
    got = hostcheck.probe_checks({"hypertune": [["python3", str(tmp_path)], ["no-such-python3", None]]}, None)
    assert got["hypertune"][0] == {
        "python": "python3",
        "pythonpath": str(tmp_path),
        "ok": True,
        "file": str(tmp_path / "hypertune" / "__init__.py"),
    }
    assert got["hypertune"][1] == {
        "python": "no-such-python3",
        "pythonpath": None,
        "ok": False,
        "error": "no-such-python3: not found",
    }
    missing = hostcheck.python_imports("python3", None, "no_such_module_here")
    assert missing["ok"] is False and missing["error"] == "ModuleNotFoundError: No module named 'no_such_module_here'"


def test_an_inventory_that_brings_hypertune_says_so(tmp_path):
    inv = parse(
        STUDY + "setup: {commands: ['pip install /opt/wheels/cloudml_hypertune-0.1.0.dev6-py3-none-any.whl']}\n",
        tmp_path / "i.yaml",
    )
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    found = checks.judge(inv, make_plan(render(inv), targets, {n: report() for n in targets}))
    ok, seen = has(
        found, "h1", "hypertune", Status.PASS, "cloudml-hypertune: setup: installs it (pip install /opt/wheels/"
    )
    assert ok, seen


def test_a_pushed_directory_holding_the_package_brings_it(tmp_path):
    """The air-gapped way of docs/tuning.md: pip install --target pylibs/, pushed, on PYTHONPATH."""
    (tmp_path / "pylibs" / "hypertune").mkdir(parents=True)
    (tmp_path / "pylibs" / "hypertune" / "__init__.py").write_text("")
    text = STUDY + "files: [{src: pylibs/, dest: /opt/study/pylibs/}]\nenv: {PYTHONPATH: /opt/study/pylibs}\n"
    inv = parse(text, tmp_path / "i.yaml")
    assert (
        "hypertune" not in checks.request_fields(inv, inv.hosts[0], render(inv).hosts["h1"], [], checks=True)["checks"]
    )
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    found = checks.judge(inv, make_plan(render(inv), targets, {n: report() for n in targets}))
    ok, seen = has(
        found, "h1", "hypertune", Status.PASS, "cloudml-hypertune: files: pushes pylibs/hypertune/ to /opt/study/pylibs"
    )
    assert ok, seen
