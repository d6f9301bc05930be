"""The fabric between hosts, judged (pure): which tool measures it, the rounds of the
bisection that finds a slow host, each measurement's figure from what the hosts sent back
(validated and bounded: a host's numbers are untrusted), and each figure against its
reference: the stored baseline of the hosts' class, or without one the median of its round.

The bisection (`levels`, then `final_pairs`): round 1 is the ring of every host (the
job-wide figure); each next round splits every group of the round before into halves and
measures every half's ring at once, down to pairs (ceil(log2 N) rounds); a slow group's
hosts are suspects, and one last round pairs each suspect with a host whose own group was
fine (a known-good host): a suspect still slow with it is the slow host. At most
ceil(log2 N) + 1 rounds, every round all hosts at once.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from provision.core.model import Host
from provision.core.target import HostError
from provision.host.protocol import FabricReport


class Tool(StrEnum):
    NCCL = "nccl-tests"  # all_reduce_perf under Open MPI's mpirun
    TORCH = "torch"  # torch.distributed all_reduce (gloo on CPU, NCCL on GPUs)
    TCP = "tcp"  # the stream test provision ships (host/fabric.py)


CHOICES = ("auto", *(t.value for t in Tool))
PORT = 47100  # where the members listen (tcp; torch's rendezvous on the group's first host)
SIZES = {Tool.NCCL: 256 << 20, Tool.TORCH: 16 << 20, Tool.TCP: 4 << 20}  # bytes all-reduced
TCP_SECONDS = 1.0  # the stream test iterates at least this long (and at least twice)
TORCH_ITERATIONS = 5  # host/fabric.TORCH_ITERATIONS
TCP_MAX_ITERATIONS = 200  # host/fabric.MAX_ITERATIONS
JOIN_S = 20.0  # the members of a group wait this long for each other
TIMEOUT_S = 60.0  # a transfer's bound once every member joined
SLOW = 0.5  # below this share of its reference, a figure is slow
MAX_GBPS = 100_000.0  # a bus bandwidth above this is not believed (NVLink 5: 1,800 GB/s)
TEXT = 300  # characters kept of a host's words


def call_timeout(tool: Tool) -> float:
    """An SSH round trip's bound for one host's part of a measurement."""
    return JOIN_S + TIMEOUT_S + 30.0


# --------------------------------------------------------------------------- host class, tool


def host_class(host: Host) -> str:
    """What a baseline is kept per: the accelerators (type x count, or cpu) and the labels."""
    acc = host.accelerators
    base = f"{acc.type}x{acc.count}" if acc and acc.count else "cpu"
    labels = ",".join(f"{k}={v}" for k, v in sorted(host.labels))
    return f"{base},{labels}" if labels else base


def class_of(hosts: Iterable[Host]) -> str:
    """The class of hosts measured together: theirs, or each of theirs joined by ' + '."""
    return " + ".join(sorted({host_class(h) for h in hosts}))


def usable(tools: Mapping[str, Any] | None) -> set[Tool]:
    """The tools a host's look says it has (anything but the expected types: none)."""
    t = tools if isinstance(tools, Mapping) else {}
    out = {Tool.TCP}
    if isinstance(t.get("all_reduce_perf"), str) and t.get("mpirun") == "open-mpi":
        out.add(Tool.NCCL)
    if t.get("torch") is True:
        out.add(Tool.TORCH)
    return out


def choose_tool(looks: Mapping[str, Mapping[str, Any] | None], want: str) -> tuple[Tool | None, str]:
    """(the tool every host has, in the order nccl-tests, torch, tcp; or the one asked for),
    or (None, why not) when the one asked for is missing somewhere."""
    have = {name: usable(t) for name, t in looks.items()}
    if want != "auto":
        tool = Tool(want)
        lacking = [n for n, tools in have.items() if tool not in tools]
        if lacking:
            what = {Tool.NCCL: "all_reduce_perf and Open MPI's mpirun", Tool.TORCH: "torch for python3"}.get(tool, "")
            return None, f"--bandwidth-tool {want}: {', '.join(lacking)} lack{'s' if len(lacking) == 1 else ''} {what}"
        return tool, ""
    for tool in (Tool.NCCL, Tool.TORCH):
        if all(tool in tools for tools in have.values()):
            return tool, ""
    return Tool.TCP, ""


# --------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class Figure:
    """One group's measurement: its bus bandwidth in GB/s (None: not measured), or an upper
    bound of it (`at_most`: the transfer ran out of time), and what went wrong."""

    hosts: tuple[str, ...]
    round: int
    gbps: float | None
    seconds: float | None = None
    at_most: bool = False
    error: str | None = None
    blame: tuple[str, ...] = ()  # hosts the error is about (did not answer, did not join)


@dataclass(frozen=True)
class Judged:
    """A figure against its reference (GB/s): its peers' (`against` "peers"), or the
    baseline's where it has too few peers ("baseline"); `slow` below SLOW of it. Apart,
    the baseline's figure of its kind, and whether it is `below` SLOW of that."""

    figure: Figure
    reference: float | None
    slow: bool
    against: str = ""
    baseline: float | None = None
    below: bool = False

    @property
    def share(self) -> float | None:
        f = self.figure.gbps
        return f / self.reference if f is not None and self.reference else None

    @property
    def of_baseline(self) -> float | None:
        f = self.figure.gbps
        return f / self.baseline if f is not None and self.baseline else None


@dataclass(frozen=True)
class Baseline:
    """The first healthy measurement of a host class with a tool: its pairs' median and
    its job-wide figure (on ring_hosts hosts)."""

    host_class: str
    tool: str
    pair: float | None
    ring: float | None
    ring_hosts: int
    size: int
    at: str
    by: str = ""
    job: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "class": self.host_class,
            "tool": self.tool,
            "pair_gbps": self.pair,
            "ring_gbps": self.ring,
            "ring_hosts": self.ring_hosts,
            "size": self.size,
            "at": self.at,
            "by": self.by,
            "job": self.job,
        }

    @classmethod
    def from_json(cls, d: Any) -> Baseline | None:
        """A stored record, or None when it is not one (every field checked and bounded)."""
        if not isinstance(d, dict):
            return None

        def text(key: str) -> str | None:
            v = d.get(key)
            return v[:TEXT] if isinstance(v, str) else None

        def rate(key: str) -> float | None:
            v = _number(d.get(key), 0, MAX_GBPS)
            return v if v else None

        host_class, tool, at = text("class"), text("tool"), text("at")
        n, size = d.get("ring_hosts"), d.get("size")
        if host_class is None or tool not in {t.value for t in Tool} or at is None:
            return None
        if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 100_000):
            return None
        if not (isinstance(size, int) and not isinstance(size, bool) and 0 < size <= 1 << 40):
            return None
        pair, ring = rate("pair_gbps"), rate("ring_gbps")
        if pair is None and ring is None:
            return None
        return cls(host_class, str(tool), pair, ring, n, size, at, text("by") or "", text("job") or "")


def pick_baseline(stored: Sequence[Baseline], host_class: str, tool: Tool) -> tuple[Baseline | None, str]:
    """The baseline these hosts are compared with, and a line when there is none: a
    baseline of another class, or of another tool, is never compared with."""
    same = [b for b in stored if b.host_class == host_class]
    mine = next((b for b in same if b.tool == tool.value), None)
    if mine is not None:
        return mine, ""
    if same:
        tools = ", ".join(sorted({b.tool for b in same}))
        return None, (
            f"the baseline of host class {host_class} was measured with {tools}, not {tool.value}: not compared; "
            "a healthy measurement now becomes the baseline for this tool"
        )
    others = sorted({b.host_class for b in stored})
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return None, (
            f"no baseline for host class {host_class} (the stored ones are of other host classes: {shown}; "
            "not compared); a healthy measurement now becomes its baseline"
        )
    return None, f"no baseline for host class {host_class} yet: a healthy measurement now becomes it"


# --------------------------------------------------------------------------- figures from the hosts


def _number(v: Any, low: float, high: float) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high
    return float(v) if ok else None


def _count(v: Any, high: int) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= high else None


def _text(s: Any) -> str:
    return (s if isinstance(s, str) else repr(s))[:TEXT]


def _failed(group: tuple[str, ...], rnd: int, answers: Mapping[str, FabricReport | HostError]) -> Figure | None:
    """The group's figure when a member did not answer or said why it could not take part."""
    gone = [h for h in group if isinstance(answers.get(h), HostError) or h not in answers]
    if gone:
        why = "; ".join(f"{h}: {answers[h].message if h in answers else 'not asked'}" for h in gone)  # type: ignore[union-attr]
        return Figure(group, rnd, None, error=f"did not answer ({_text(why)})", blame=tuple(gone))
    reports = [answers[h] for h in group]
    if any(isinstance(r, FabricReport) and _text(r.error).startswith("timed out") for r in reports):
        return None  # too slow: its neighbours' words are about its going away (tcp_figure)
    errors = []
    blame: list[str] = []
    for h in group:
        r = answers[h]
        assert isinstance(r, FabricReport)
        if r.error is not None:
            peer = r.peer if isinstance(r.peer, int) and not isinstance(r.peer, bool) else None
            named = group[peer] if peer is not None and 0 <= peer < len(group) else None
            errors.append(f"{h}: {_text(r.error)}" + (f" ({named})" if named else ""))
            if named and named not in blame:
                blame.append(named)
    if errors:
        return Figure(group, rnd, None, error="; ".join(errors)[: TEXT * 2], blame=tuple(blame or group))
    return None


def tcp_figure(group: tuple[str, ...], rnd: int, answers: Mapping[str, FabricReport | HostError], size: int) -> Figure:
    """The stream test's figure: the bytes each member sent over the slowest member's time
    (a ring goes at its slowest link's pace); every member's numbers must agree."""
    failed = _failed(group, rnd, answers)
    if failed is not None:
        return failed
    n = len(group)
    chunk = max(1, size // n)
    per = 2 * (n - 1) * chunk
    reports = [answers[h] for h in group]
    timed_out = [r for r in reports if isinstance(r, FabricReport) and r.error is not None]
    if timed_out:
        got = [_count(r.received, TCP_MAX_ITERATIONS * per) for r in reports if isinstance(r, FabricReport)]
        least = min((g for g in got if g is not None), default=0)
        return Figure(group, rnd, least / TIMEOUT_S / 1e9, TIMEOUT_S, at_most=True, error="timed out")
    seconds, moved = [], []
    for h, r in zip(group, reports):
        assert isinstance(r, FabricReport)
        s = _number(r.seconds, 1e-6, TIMEOUT_S + 5)
        it = _count(r.iterations, TCP_MAX_ITERATIONS)
        if s is None or not it or r.sent != it * per or r.received != it * per:
            return Figure(group, rnd, None, error=f"{h} sent back numbers that do not add up", blame=(h,))
        seconds.append(s)
        moved.append(it * per)
    if len(set(moved)) != 1:
        return Figure(group, rnd, None, error="the members disagree on what was sent", blame=group)
    return _bounded(group, rnd, moved[0] / max(seconds) / 1e9, max(seconds))


def torch_figure(
    group: tuple[str, ...], rnd: int, answers: Mapping[str, FabricReport | HostError], size: int
) -> Figure:
    """nccl-tests' bus bandwidth of torch's all_reduce: size·2(n-1)/n per iteration over the
    slowest member's time."""
    failed = _failed(group, rnd, answers)
    if failed is not None:
        return failed
    n = len(group)
    moved = TORCH_ITERATIONS * (max(4, size - size % 4)) * 2 * (n - 1) / n
    seconds = []
    for h in group:
        r = answers[h]
        assert isinstance(r, FabricReport)
        s = _number(r.seconds, 1e-6, TIMEOUT_S + JOIN_S + 5)
        if s is None:
            return Figure(group, rnd, None, error=f"{h} sent back no time it could have taken", blame=(h,))
        seconds.append(s)
    return _bounded(group, rnd, moved / max(seconds) / 1e9, max(seconds))


def nccl_figure(group: tuple[str, ...], rnd: int, answers: Mapping[str, FabricReport | HostError]) -> Figure:
    """all_reduce_perf's own figure (its `# Avg bus bandwidth`), run from the group's first."""
    lead = group[0]
    r = answers.get(lead)
    if not isinstance(r, FabricReport):
        why = r.message if isinstance(r, HostError) else "not asked"
        return Figure(group, rnd, None, error=f"did not answer ({lead}: {_text(why)})", blame=(lead,))
    if r.error is not None:
        return Figure(group, rnd, None, error=f"{lead}: {_text(r.error)}", blame=group)
    gbps, seconds, problem = parse_nccl(_text_all(r.output))
    if problem:
        return Figure(group, rnd, None, error=f"{lead}: {problem}", blame=group)
    assert gbps is not None
    return _bounded(group, rnd, gbps, seconds)


def _text_all(s: Any) -> str:
    return s[-65536:] if isinstance(s, str) else ""


def _bounded(group: tuple[str, ...], rnd: int, gbps: float, seconds: float | None) -> Figure:
    if not math.isfinite(gbps) or gbps > MAX_GBPS or gbps < 0:
        return Figure(group, rnd, None, error=f"an implausible figure ({gbps:g} GB/s): not believed", blame=group)
    return Figure(group, rnd, gbps, seconds)


def parse_nccl(text: str) -> tuple[float | None, float | None, str]:
    """nccl-tests' output: (bus bandwidth GB/s, seconds of one operation, problem). The
    figure is its `# Avg bus bandwidth` line, else the mean of its rows' out-of-place busbw;
    a row with wrong values, or `Out of bounds values : N FAILED`, is a problem."""
    avg: float | None = None
    rows: list[tuple[float, float]] = []
    for line in text.splitlines()[-2000:]:
        words = line.split()
        if line.startswith("#"):
            if "Avg bus bandwidth" in line:
                avg = _number(_float(line.rsplit(":", 1)[-1]), 0, MAX_GBPS)
            elif "Out of bounds values" in line and "FAILED" in line:
                return None, None, "all_reduce_perf: " + line.strip("# ").strip()[:TEXT]
            continue
        if len(words) < 9 or not words[0].isdigit():
            continue
        usec, busbw, wrong = _float(words[5]), _float(words[7]), words[8]
        if wrong.isdigit() and int(wrong) > 0:
            return None, None, f"all_reduce_perf found {int(wrong)} wrong values at {words[0]} bytes: data corrupted"
        if usec is not None and busbw is not None and math.isfinite(busbw):
            rows.append((usec, busbw))
    seconds = statistics.mean(u for u, _ in rows) / 1e6 if rows else None
    if avg is None and rows:
        avg = _number(statistics.mean(b for _, b in rows), 0, MAX_GBPS)
    if avg is None:
        return None, None, "all_reduce_perf printed no bus bandwidth"
    return avg, seconds, ""


def _float(s: str) -> float | None:
    try:
        v = float(s.strip())
    except ValueError:
        return None
    return v if math.isfinite(v) else None
