"""The fabric between hosts, pure parts, as tables (rules/fabric.py): the bisection's rounds
on a simulated fabric (one slow host named within ceil(log2 N) + 1 rounds, for every N and
every position), a slow link, a fabric slower than its baseline everywhere; the figures
from what hosts send back (untrusted: numbers that do not add up, implausible ones, a
member that did not answer or join); nccl-tests' output; baselines (validated, never
compared across host classes or tools); the tool chosen; the stream test itself between
threads of this process (host/fabric.py). tests/integration/test_fabric.py measures
sandbox hosts for real, one of them throttled with tc."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from clirun import run
from provision.core.model import Accelerators, Host, SSHSettings
from provision.core.target import HostError, Target
from provision.host import fabric as hostfabric
from provision.host.protocol import FabricReport, FabricRequest
from provision.rules import bisection as B
from provision.rules import fabric as F

# --------------------------------------------------------------------------- the rounds


@pytest.mark.parametrize(
    "n, sizes",
    [
        (2, [[2]]),
        (3, [[3], [2]]),
        (4, [[4], [2, 2]]),
        (5, [[5], [3, 2], [2]]),
        (8, [[8], [4, 4], [2, 2, 2, 2]]),
        (9, [[9], [5, 4], [3, 2, 2, 2], [2]]),
    ],
)
def test_levels_halve_down_to_pairs(n, sizes):
    hosts = [f"h{i}" for i in range(n)]
    got = B.levels(hosts)
    assert [[len(g) for g in level] for level in got] == sizes
    assert len(got) == math.ceil(math.log2(n)) == B.max_rounds(n) - 1
    for level in got:  # each host in at most one group of a round
        members = [h for g in level for h in g]
        assert len(members) == len(set(members))


def simulate(hosts, speed, baseline=None, link=None, noise=0.05):
    """The bisection on a fabric where a group goes at its slowest member's speed (and a
    slow `link` slows the pair of it), with a little noise."""
    b = B.Bisection(hosts, baseline)
    rounds = 0
    while (step := b.next()) is not None:
        rounds += 1
        _, groups = step
        figs = []
        for k, g in enumerate(groups):
            v = min(speed.get(h, 1.0) for h in g) * (1 + noise * ((k * 7 + rounds) % 3 - 1))
            if link and set(link) <= set(g):
                v *= 0.1
            figs.append(F.Figure(g, rounds, v, 1.0))
        b.record(figs)
    return b.verdict(), rounds


BASE = F.Baseline("cpu", "tcp", 1.0, 1.0, 8, 4 << 20, "2026-01-01T00:00:00Z")


@pytest.mark.parametrize("n", list(range(3, 18)) + [32, 33])
@pytest.mark.parametrize("baseline", [None, BASE])
def test_one_slow_host_is_named_within_the_bound(n, baseline):
    hosts = [f"host-{i}" for i in range(1, n + 1)]
    for slow in hosts:
        v, rounds = simulate(hosts, {slow: 0.05}, baseline=baseline)
        assert rounds <= B.max_rounds(n), (n, slow, rounds)
        if n == 3 and baseline is None and slow in ("host-1",):
            # Without a baseline, three hosts have too few pairs: the slow one is in both.
            assert v.slow == [] and v.untested == []
            continue
        assert v.slow == [slow], (n, slow, v)
        assert not v.links


def test_a_healthy_fabric_still_pairs_every_host_and_names_none():
    hosts = [f"host-{i}" for i in range(1, 6)]
    b = B.Bisection(hosts, None)
    seen: set[str] = set()
    while (step := b.next()) is not None:
        figs = [F.Figure(g, 1, 1.0, 1.0) for g in step[1]]
        seen |= {h for g in step[1] if len(g) == 2 for h in g}
        b.record(figs)
    assert seen == set(hosts)  # the odd split's leftover was paired in the last round
    assert b.verdict() == B.Verdict([], [], [], [])


def test_two_hosts_without_a_baseline_have_nothing_to_be_slow_against():
    v, rounds = simulate(["a", "b"], {"b": 0.05})
    assert rounds == 1 and v.slow == [] and v.untested == []


def test_two_hosts_below_the_baseline_cannot_be_told_apart():
    base = F.Baseline("cpu", "tcp", 1.0, 1.0, 2, 4 << 20, "2026-01-01T00:00:00Z")
    v, rounds = simulate(["a", "b"], {"b": 0.05}, baseline=base)
    assert rounds == 1 and v.slow == [] and v.untested == ["a", "b"]


def test_a_fabric_slower_than_its_baseline_everywhere_is_not_one_host():
    base = F.Baseline("cpu", "tcp", 10.0, 10.0, 8, 4 << 20, "2026-01-01T00:00:00Z")
    hosts = [f"host-{i}" for i in range(1, 9)]
    b = B.Bisection(hosts, base)
    while (step := b.next()) is not None:
        b.record([F.Figure(g, 1, 1.0, 1.0) for g in step[1]])
    assert b.verdict() == B.Verdict([], [], [], [])
    judged = [j for js in b.judged() for j in js]
    assert all(j.below for j in judged if j.baseline is not None)
    assert not any(j.slow for j in judged if len(j.figure.hosts) == 2)  # none slower than another
    assert {len(j.figure.hosts) for j in judged if j.baseline is not None} == {8, 2}  # not the rings of 4


def test_a_slow_link_between_two_fine_hosts_is_named_as_the_link():
    hosts = [f"host-{i}" for i in range(1, 9)]
    v, rounds = simulate(hosts, {}, link=("host-3", "host-4"))
    assert v.slow == [] and v.links == [("host-3", "host-4")] and rounds == 4


def test_a_host_that_did_not_answer_takes_no_part_after():
    hosts = [f"host-{i}" for i in range(1, 9)]
    b = B.Bisection(hosts, None)
    _, groups = b.next()
    b.record([F.Figure(groups[0], 1, None, error="did not answer", blame=("host-2",))], gone=["host-2"])
    kind, groups = b.next()
    assert kind == "rings" and all("host-2" not in g for g in groups)


def test_judge_compares_with_its_peers_and_the_baseline_apart():
    figs = [F.Figure(("a", "b"), 2, 1.0), F.Figure(("c", "d"), 2, 0.9), F.Figure(("e", "f"), 2, 0.3)]
    j = [B.judge_one(f, None, figs) for f in figs]
    assert [x.slow for x in j] == [False, False, True] and j[0].against == "peers" and j[0].reference == 0.95
    assert not any(x.below for x in j) and j[0].baseline is None
    base = F.Baseline("cpu", "tcp", 2.5, 1.5, 3, 4 << 20, "2026-01-01T00:00:00Z")
    ring = F.Figure(("a", "b", "c"), 1, 1.0)
    j = [B.judge_one(f, base, figs) for f in figs]
    assert [x.slow for x in j] == [False, False, True] and [x.below for x in j] == [True, True, True]
    assert j[0].of_baseline == 0.4
    alone = B.judge_one(ring, base, [ring])
    assert alone.reference == 1.5 and alone.against == "baseline" and not alone.slow and not alone.below
    unjudged = B.judge_one(ring, None, [ring])
    assert unjudged.reference is None and not unjudged.slow and unjudged.against == ""


@pytest.mark.parametrize(
    "values, ref",
    [
        ([], None),
        ([1.0], None),
        ([1.0, 0.1], 1.0),  # the slow one left out
        ([1.0, 0.9, 0.8, 0.1], 0.9),
        ([3, 2, 1], 2),
        ([0.006, 0.140, 0.561, 0.163], 0.163),  # a fast outlier (a loaded machine) moves it little
        ([0.01, 0.01, 1.0, 1.1], 1.05),  # slow ones up to half do not drag it down
    ],
)
def test_the_reference_is_the_median_of_those_not_slow(values, ref):
    assert B.reference_of(values) == pytest.approx(ref) if ref is not None else B.reference_of(values) is None


# --------------------------------------------------------------------------- figures from the hosts

T = Target("host-2", "192.0.2.2")
GROUP = ("host-1", "host-2")
SIZE = 4 << 20
PER = 2 * (2 - 1) * (SIZE // 2)


def report(**kw):
    base = {"seconds": 0.5, "sent": 3 * PER, "received": 3 * PER, "iterations": 3}
    return FabricReport(**{**base, **kw})


def test_tcp_figure_is_the_bytes_sent_over_the_slowest_members_time():
    f = F.tcp_figure(GROUP, 1, {"host-1": report(), "host-2": report(seconds=1.0)}, SIZE)
    assert f.error is None and f.gbps == pytest.approx(3 * PER / 1.0 / 1e9)


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"seconds": -1.0}, "do not add up"),
        ({"seconds": float("nan")}, "do not add up"),
        ({"seconds": True}, "do not add up"),
        ({"seconds": "0.5"}, "do not add up"),
        ({"sent": 1}, "do not add up"),
        ({"iterations": 10**9}, "do not add up"),
        ({"received": 2 * PER, "iterations": 2, "sent": 2 * PER}, "disagree"),
    ],
)
def test_tcp_figure_refuses_numbers_that_do_not_add_up(bad, why):
    f = F.tcp_figure(GROUP, 1, {"host-1": report(), "host-2": report(**bad)}, SIZE)
    assert f.gbps is None and why in (f.error or "")


def test_an_implausible_figure_is_not_believed():
    f = F.tcp_figure(GROUP, 1, {h: report(seconds=1e-6) for h in GROUP}, SIZE)
    assert f.gbps is not None  # 12.6 GB/s in a microsecond: fast, but possible
    f = F.tcp_figure(
        GROUP, 1, {h: report(seconds=1e-6, sent=200 * PER, received=200 * PER, iterations=200) for h in GROUP}, SIZE
    )
    assert f.gbps is None and "implausible" in (f.error or "")


def test_a_member_that_did_not_answer_or_join_is_blamed():
    f = F.tcp_figure(GROUP, 2, {"host-1": report(), "host-2": HostError(T, "timed out", unreachable=True)}, SIZE)
    assert f.gbps is None and f.blame == ("host-2",) and "did not answer" in (f.error or "")
    joined = FabricReport(error="rank 1 did not connect within 20s", peer=1)
    f = F.tcp_figure(GROUP, 2, {"host-1": joined, "host-2": report()}, SIZE)
    assert f.blame == ("host-2",) and "did not connect" in (f.error or "")
    f = F.tcp_figure(GROUP, 2, {"host-1": FabricReport(error="x", peer=99), "host-2": report()}, SIZE)
    assert f.blame == GROUP  # a rank out of range names nobody in particular


def test_a_transfer_that_ran_out_of_time_is_an_upper_bound():
    slow = FabricReport(error="timed out after 60s (1000 of its bytes received)", received=1000)
    gone = FabricReport(error="connection closed", peer=0, received=5000)
    f = F.tcp_figure(GROUP, 1, {"host-1": slow, "host-2": gone}, SIZE)
    assert f.at_most and f.gbps == pytest.approx(1000 / F.TIMEOUT_S / 1e9)


def test_torch_figure_counts_as_nccl_tests_does():
    r = FabricReport(seconds=2.0, sent=1, received=1, iterations=5)
    f = F.torch_figure(("a", "b", "c", "d"), 1, {h: r for h in "abcd"}, 64 << 20)
    assert f.gbps == pytest.approx(5 * (64 << 20) * 2 * 3 / 4 / 2.0 / 1e9)


NCCL_OUT = """# nThread 1 nGpus 2 minBytes 268435456 maxBytes 268435456 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   1887 on   worker-1 device  0 [0x8d] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   1887 on   worker-1 device  1 [0x91] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
   268435456      67108864     float     sum      -1   1412.3  190.07  332.63      0   1410.9  190.26  332.96      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 332.795
#
"""


def test_nccl_tests_output_is_read_as_it_prints_it():
    gbps, seconds, problem = F.parse_nccl(NCCL_OUT)
    assert problem == "" and gbps == pytest.approx(332.795) and seconds == pytest.approx(1412.3e-6)
    no_avg = "\n".join(x for x in NCCL_OUT.splitlines() if "Avg" not in x)
    assert F.parse_nccl(no_avg)[0] == pytest.approx(332.63)
    wrong = NCCL_OUT.replace("332.63      0", "332.63      7")
    assert "7 wrong values" in F.parse_nccl(wrong)[2]
    failed = NCCL_OUT.replace("0 OK", "3 FAILED")
    assert "FAILED" in F.parse_nccl(failed)[2]
    assert F.parse_nccl("garbage\n")[2] == "all_reduce_perf printed no bus bandwidth"
    huge = NCCL_OUT.replace("332.795", "1e12")
    assert F.parse_nccl(huge)[0] == pytest.approx(sum([332.63]) / 1)  # the line not believed: the rows'
    f = F.nccl_figure(GROUP, 1, {"host-1": FabricReport(output=NCCL_OUT)})
    assert f.gbps == pytest.approx(332.795)


# --------------------------------------------------------------------------- baselines, classes, tools


def test_a_stored_baseline_is_checked_field_by_field():
    good = F.Baseline("cpu", "tcp", 1.0, 0.9, 3, 4 << 20, "2026-01-01T00:00:00Z", "me", "j")
    assert F.Baseline.from_json(good.to_json()) == good
    for key, value in [
        ("class", 3),
        ("tool", "carrier-pigeon"),
        ("ring_hosts", -1),
        ("ring_hosts", True),
        ("size", 0),
        ("at", None),
    ]:
        assert F.Baseline.from_json({**good.to_json(), key: value}) is None, key
    both_bad = {**good.to_json(), "pair_gbps": float("inf"), "ring_gbps": -1}
    assert F.Baseline.from_json(both_bad) is None
    assert F.Baseline.from_json({**good.to_json(), "pair_gbps": 1e9}).pair is None  # past MAX_GBPS
    assert F.Baseline.from_json([1, 2]) is None


def test_a_baseline_of_another_class_or_tool_is_never_compared():
    h100 = F.Baseline("nvidia-h100x8", "tcp", 1.0, 1.0, 8, 4 << 20, "2026-01-01T00:00:00Z")
    torch = F.Baseline("cpu", "torch", 1.0, 1.0, 3, 64 << 20, "2026-01-01T00:00:00Z")
    b, note = F.pick_baseline([h100], "cpu", F.Tool.TCP)
    assert b is None and "other host classes: nvidia-h100x8; not compared" in note
    b, note = F.pick_baseline([h100, torch], "cpu", F.Tool.TCP)
    assert b is None and "measured with torch, not tcp: not compared" in note
    b, note = F.pick_baseline([h100, torch], "cpu", F.Tool.TORCH)
    assert b is torch and note == ""
    assert "yet" in F.pick_baseline([], "cpu", F.Tool.TCP)[1]


def host(name, acc=None, labels=()):
    return Host(name, name, SSHSettings(), name, acc, labels)


def test_host_class_is_the_accelerators_and_the_labels():
    assert F.host_class(host("a")) == "cpu"
    assert F.host_class(host("a", Accelerators("nvidia-h100", 8), (("rack", "r2"), ("pod", "p1")))) == (
        "nvidia-h100x8,pod=p1,rack=r2"
    )
    assert F.class_of([host("a"), host("b", Accelerators("nvidia-h100", 8))]) == "cpu + nvidia-h100x8"


def test_the_tool_every_host_has():
    nccl = {"all_reduce_perf": "/opt/nccl-tests/build/all_reduce_perf", "mpirun": "open-mpi", "torch": True}
    torch = {"all_reduce_perf": None, "mpirun": None, "torch": True}
    assert F.choose_tool({"a": nccl, "b": nccl}, "auto") == (F.Tool.NCCL, "")
    assert F.choose_tool({"a": nccl, "b": torch}, "auto") == (F.Tool.TORCH, "")
    assert F.choose_tool({"a": nccl, "b": {"torch": "yes"}}, "auto") == (F.Tool.TCP, "")  # not a bool: no
    assert F.choose_tool({"a": {**nccl, "mpirun": "other"}, "b": nccl}, "auto")[0] is F.Tool.TORCH
    tool, why = F.choose_tool({"a": nccl, "b": torch}, "nccl-tests")
    assert tool is None and why == "--bandwidth-tool nccl-tests: b lacks all_reduce_perf and Open MPI's mpirun"
    assert F.choose_tool({"a": None, "b": torch}, "tcp") == (F.Tool.TCP, "")


# --------------------------------------------------------------------------- the stream test, here


def free_ports(n: int) -> list[int]:
    """Ports free on this machine now (other work shares it)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ring(n, **kw):
    peers = [["127.0.0.1", p] for p in free_ports(n)]
    out: list[FabricReport | None] = [None] * n

    def one(r):
        req = FabricRequest("j", "tcp", rank=r, peers=peers, token="t" * 32, size=1 << 20, seconds=0.05, join=5, **kw)
        out[r] = hostfabric.tcp_ring(req)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_the_stream_test_between_threads_adds_up():
    reports = ring(3)
    f = F.tcp_figure(("a", "b", "c"), 1, dict(zip("abc", reports)), 1 << 20)
    assert f.error is None and f.gbps and f.gbps > 0, reports
    assert len({r.iterations for r in reports}) == 1 and reports[0].iterations >= 2


def test_the_stream_test_names_a_member_that_never_came():
    peers = [["127.0.0.1", p] for p in free_ports(2)]
    r = hostfabric.tcp_ring(FabricRequest("j", "tcp", rank=0, peers=peers, token="t" * 32, size=1 << 20, join=1))
    assert r.peer == 1 and f"could not reach 127.0.0.1:{peers[1][1]}" in r.error


def test_the_stream_test_closes_on_whoever_else_connects():
    import socket

    peers = [["127.0.0.1", p] for p in free_ports(2)]
    got = []
    t = threading.Thread(
        target=lambda: got.append(
            hostfabric.tcp_ring(FabricRequest("j", "tcp", rank=1, peers=peers, token="t" * 32, size=1 << 16, join=1.5))
        )
    )
    t.start()
    for _ in range(50):
        try:
            s = socket.create_connection(("127.0.0.1", peers[1][1]), timeout=1)
            s.sendall(b"PVFB" + b"x" * 36)  # a wrong token
            s.close()
            break
        except OSError:
            threading.Event().wait(0.05)
    t.join()
    assert got and got[0].error and ("did not connect" in got[0].error or "could not reach" in got[0].error)


# --------------------------------------------------------------------------- the command, offline


def test_one_host_has_nothing_to_measure_between(tmp_path: Path):
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "job: j\nhosts:\n  - {name: only, address: 192.0.2.1}\npools:\n  chief: {replicas: 1, command: [/bin/true]}\n"
    )
    code, out, err = run("check", "--bandwidth", str(inv), cwd=tmp_path)
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        f"Error: {inv}: --bandwidth measures between hosts, and it has 1 (only): nothing to measure"
    ]


def test_the_bandwidth_options_go_with_bandwidth(tmp_path: Path):
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "job: j\nhosts:\n  - {name: a, address: 192.0.2.1}\n  - {name: b, address: 192.0.2.2}\n"
        "pools:\n  chief: {replicas: 1, command: [/bin/true]}\n"
    )
    for flags, word in ((["--new-baseline"], "--new-baseline"), (["--bandwidth-tool", "tcp"], "--bandwidth-tool")):
        code, out, err = run("check", *flags, str(inv), cwd=tmp_path)
        assert code == 1 and out == "" and err.strip().splitlines() == [f"Error: {word} goes with --bandwidth"]
