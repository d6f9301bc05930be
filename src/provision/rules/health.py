"""A health state per GPU and per host, and what the health read's signals make of it. Pure.

The states (each with its reason, its evidence, since when and who set it: the host keeps
them beside its ledger, host/health.py):
- healthy: nothing said (no mark);
- suspect: a signal that only warns (throttling, a PCIe link below its best, an Xid that
  warns, DCGM's warning, outputs: nearly full); still given work; it clears itself once no
  such signal was seen for SUSPECT_HOLD;
- quarantined: a fatal signal on the GPU (a fatal Xid, uncorrectable ECC errors, row
  remapping failed, DCGM's failure), or by hand; no new work; a test or a release ends it;
- draining (a host): the host itself is bad (a GPU gone, nvidia-smi failing or hanging, a GPU
  fallen off the bus that nvidia-smi no longer lists); no new work, what runs goes on;
- testing: a test runs (`provision health test`); no new work.

The signals come from one read of a host (`signals`); `decide` turns them and the marks
into changes (each expecting the mark as it was: the host refuses one that finds it
otherwise); `transitions` tells what changed as events and incidents. The table of Xids is
rules/xids.py; the team's policy may change it (rules/policyfile.py).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypedDict

from provision.core.model import Inventory
from provision.core.text import printable
from provision.host.protocol import ProbeReport
from provision.rules import xids
from provision.rules.xids import XidClass


class State(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    QUARANTINED = "quarantined"
    DRAINING = "draining"
    TESTING = "testing"

    @property
    def blocks(self) -> bool:
        """No new work is placed there (host/ledger.HEALTH_BLOCKING)."""
        return self in (State.QUARANTINED, State.DRAINING, State.TESTING)


SUSPECT_HOLD = 600.0  # seconds without a warning before a suspect is healthy again
TEST_STALE = 7200.0  # seconds after which a test that never said how it went is taken as failed
DISK_LOW = 1 << 30  # bytes free on the file system of outputs: below which it is full
PCIE_BUSY = 50  # % utilization from which a PCIe generation below the maximum is a slowdown
RETIRED_LIMIT = 60  # pages retired for double-bit errors: NVIDIA's threshold for a replacement
# clocks_event_reasons' bits that slow a GPU down for its health, not by choice.
THROTTLE = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake"}
TEXT = 300  # characters kept of a reason, 1000 of evidence


@dataclass(frozen=True)
class HealthPolicy:
    """The team's: Xids whose class it changes, and whether a quarantined GPU or host must
    pass a test before it gets work again."""

    xids: tuple[tuple[int, XidClass], ...] = ()
    test_before_release: bool = True


@dataclass(frozen=True)
class Mark:
    state: State
    reason: str = ""
    evidence: str = ""
    since: float | None = None  # the host's clock
    by: str = ""
    job: str = ""  # the job that held it when the mark was set, and its owner
    owner: str = ""
    uuid: str = ""

    @classmethod
    def from_json(cls, d: Any) -> Mark | None:
        """A mark as a host keeps it (untrusted: each field checked, bounded, printable)."""
        if not isinstance(d, Mapping):
            return None
        try:
            state = State(str(d.get("state")))
        except ValueError:
            return None
        since = d.get("since")

        def text(k: str, n: int = TEXT) -> str:
            v = d.get(k)
            return printable(v)[:n] if isinstance(v, str) else ""

        ok = isinstance(since, (int, float)) and not isinstance(since, bool) and since == since
        at = float(since) if ok and since is not None else None
        return cls(state, text("reason"), text("evidence", 1000), at, text("by", 200),
                   text("job", 100), text("owner", 200), text("uuid", 100))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "reason": self.reason,
            "evidence": self.evidence,
            "since": self.since,
            "by": self.by,
            "job": self.job,
            "owner": self.owner,
        }


@dataclass(frozen=True)
class HostHealth:
    """A host's record, read: its own mark, each GPU's (a GPU without one is healthy), and
    why the record could not be read when it could not (then it holds nothing)."""

    host: Mark | None = None
    gpus: Mapping[int, Mark] = field(default_factory=dict)
    unreadable: str = ""

    @classmethod
    def from_record(cls, rec: Any) -> HostHealth:
        if not isinstance(rec, Mapping) or not rec:
            return cls()
        if "_unreadable" in rec:
            return cls(unreadable=printable(str(rec.get("_unreadable")))[:200])
        gpus: dict[int, Mark] = {}
        raw = rec.get("gpus")
        for k, v in raw.items() if isinstance(raw, Mapping) else ():
            m = Mark.from_json(v)
            if isinstance(k, str) and k.isdigit() and len(k) < 5 and m is not None and m.state is not State.HEALTHY:
                gpus[int(k)] = m
        host = Mark.from_json(rec.get("host"))
        return cls(host if host is not None and host.state is not State.HEALTHY else None, dict(sorted(gpus.items())))

    def gpu_state(self, gpu: int) -> State:
        m = self.gpus.get(gpu)
        return m.state if m is not None else State.HEALTHY

    @property
    def host_state(self) -> State:
        return self.host.state if self.host is not None else State.HEALTHY

    @property
    def blocked(self) -> frozenset[int]:
        """The GPUs no new work goes to (the host's state aside)."""
        return frozenset(g for g, m in self.gpus.items() if m.state.blocks)


def of_report(report: ProbeReport | None) -> HostHealth:
    return HostHealth.from_record(report.health if report is not None else None)


class Level(StrEnum):
    FATAL = "fatal"
    WARN = "warn"
    PROGRAM = "program"  # the job's own error, on the GPU: no state changes


@dataclass(frozen=True)
class Signal:
    """One thing a health read found: on a GPU (None: the host), how grave, what it is in a
    few words, and the evidence (the line, the counter and its value)."""

    gpu: int | None
    level: Level
    what: str
    evidence: str
    kind: str = ""  # xid, ecc, remap, retired, gone, nvidia-smi, throttle, pcie, dcgm, disk


# --------------------------------------------------------------------------- the signals


def signals(  # noqa: C901  one branch per signal the read gives, in docs/health.md's order
    declared: int, report: ProbeReport, policy: HealthPolicy = HealthPolicy(), outputs: str | None = None
) -> tuple[Signal, ...]:
    """What one read of a host (a probe whose checks asked "health") says of its GPUs and of
    itself; `declared`: the GPUs the inventory declares; `outputs`: its outputs: directory."""
    out: list[Signal] = []
    facts = report.facts or {}
    checks = report.checks or {}
    if declared > 0 and "nvidia_smi" in facts:
        err = facts.get("nvidia_smi")
        if err != "ok":
            what = "nvidia-smi is not installed" if err == "missing" else "nvidia-smi fails"
            if isinstance(err, str) and "timed out" in err:
                what = "nvidia-smi hangs"
            out.append(Signal(None, Level.FATAL, what, printable(str(err))[:1000], "nvidia-smi"))
        else:
            seen = len([g for g in facts.get("gpus") or [] if isinstance(g, dict)])
            if seen < declared:
                words = f"{seen} of the {declared} GPUs declared answer"
                out.append(Signal(None, Level.FATAL, f"a GPU is gone ({words})", f"nvidia-smi lists {seen}", "gone"))
    read = _dict(checks.get("health"))
    rows = [r for r in read.get("gpus") or [] if isinstance(r, dict) and isinstance(r.get("index"), int)]
    # The counters come with the health read's own query; the pre-flight query's where it had none.
    for h in rows or _dict(checks.get("gpus")).get("health") or []:
        out += _counters(h)
    util = {g.get("index"): g.get("util_pct") for g in facts.get("gpus") or [] if isinstance(g, dict)}
    for r in rows:
        out += _fields(r, util.get(r["index"]))
    pci = {p: r["index"] for r in rows if (p := xids.pci_of(str(r.get("pci") or ""))) is not None}
    out += _xid_signals(read.get("xid"), pci, policy, bool(rows))
    out += _dcgm_signals(read.get("dcgm"))
    if outputs:
        free = _dict(checks.get("disk"))
        d = _nearest(outputs, free)
        if d is not None and isinstance(free[d], int) and free[d] < DISK_LOW:
            what = f"the file system of outputs: ({outputs}) is full"
            out.append(Signal(None, Level.WARN, what, f"{_size(free[d])} free on {d}", "disk"))
    return tuple(out)


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _counters(h: Mapping[str, Any]) -> list[Signal]:
    g = h.get("index")
    if not isinstance(g, int):
        return []
    out = []
    n = h.get("ecc_uncorrected")
    if isinstance(n, int) and n > 0:
        what = f"{n} uncorrectable ECC error{'s' if n != 1 else ''}"
        out.append(Signal(g, Level.FATAL, what, f"ecc.errors.uncorrected.volatile.total = {n}", "ecc"))
    if h.get("remap_pending"):
        out.append(
            Signal(g, Level.WARN, "row remapping pending (a reset applies it)", "remapped_rows.pending = Yes", "remap")
        )
    if h.get("retired_pending"):
        out.append(
            Signal(
                g, Level.WARN, "page retirement pending (a reset applies it)", "retired_pages.pending = Yes", "retired"
            )
        )
    return out


def _fields(r: Mapping[str, Any], util: Any) -> list[Signal]:
    g = int(r["index"])
    out = []
    if r.get("remap_failed") is True:
        out.append(Signal(g, Level.FATAL, "row remapping failed", "remapped_rows.failure = Yes", "remap"))
    dbe = r.get("retired_dbe")
    if isinstance(dbe, int) and dbe >= RETIRED_LIMIT:
        what = f"{dbe} pages retired for double-bit ECC errors (NVIDIA replaces a GPU at {RETIRED_LIMIT})"
        out.append(Signal(g, Level.FATAL, what, f"retired_pages.double_bit.count = {dbe}", "retired"))
    mask = r.get("throttle")
    if isinstance(mask, int):
        why = [words for bit, words in THROTTLE.items() if mask & bit]
        if why:
            out.append(
                Signal(
                    g,
                    Level.WARN,
                    "throttled: " + ", ".join(why),
                    f"clocks_event_reasons.active = {mask:#x}",
                    "throttle",
                )
            )
    w, wm, gen, gm = r.get("width"), r.get("width_max"), r.get("gen"), r.get("gen_max")
    if isinstance(w, int) and isinstance(wm, int) and w < wm:
        out.append(
            Signal(g, Level.WARN, f"PCIe link x{w} of x{wm}", f"pcie.link.width.current = {w}, max = {wm}", "pcie")
        )
    elif isinstance(gen, int) and isinstance(gm, int) and gen < gm and isinstance(util, int) and util >= PCIE_BUSY:
        what = f"PCIe gen {gen} of {gm} while {util} % busy"
        out.append(Signal(g, Level.WARN, what, f"pcie.link.gen.current = {gen}, max = {gm}", "pcie"))
    return out


def _xid_signals(
    read: Any, pci: Mapping[tuple[int, int, int], int], policy: HealthPolicy, listed: bool
) -> list[Signal]:
    """One signal per GPU and Xid (however many lines), its first line as the evidence."""
    lines, maybe_more = xids.new_lines(read)
    groups: dict[tuple[int | None, tuple[int, int, int], int], list[xids.XidLine]] = {}
    for x in lines:
        groups.setdefault((pci.get(x.pci), x.pci, x.code), []).append(x)
    out = []
    for (gpu, addr, code), got in groups.items():
        cls = xids.classify(code, policy.xids)
        if cls is XidClass.IGNORE:
            continue
        level = {XidClass.FATAL: Level.FATAL, XidClass.PROGRAM: Level.PROGRAM}.get(cls, Level.WARN)
        times = f", {len(got)} times" if len(got) > 1 else ""
        more = " (at least; the read keeps the newest lines)" if maybe_more and times else ""
        what = f"Xid {code}: {xids.meaning(code)}{times}{more}"
        if gpu is None and level is Level.FATAL:
            # Not among the GPUs listed now (it fell off the bus), or they could not be listed.
            where = "no GPU listed now is" if listed else "the GPUs could not be listed to tell which is"
            what = f"{what} (at PCI {xids.pci_words(addr)}: {where} there)"
        out.append(Signal(gpu, level, what, got[0].line, "xid"))
    return out


def _dcgm_signals(read: Any) -> list[Signal]:
    if not isinstance(read, Mapping) or read.get("code") == 127:
        return []  # DCGM is not installed
    v = xids.parse_dcgm(str(x) for x in read.get("lines") or [])
    out = []
    for g, (level, words) in v.gpus.items():
        if level in ("Failure", "Warning"):
            lv = Level.FATAL if level == "Failure" else Level.WARN
            out.append(Signal(g, lv, f"DCGM's health watch: {level.lower()}", words or level, "dcgm"))
    if not v.gpus and v.overall in ("Failure", "Warning"):
        lv = Level.FATAL if v.overall == "Failure" else Level.WARN
        out.append(
            Signal(None, lv, f"DCGM's health watch: {v.overall.lower()}", f"Overall Health: {v.overall}", "dcgm")
        )
    return out


def _nearest(path: str, free: Mapping[str, Any]) -> str | None:
    d = path.rstrip("/") or "/"
    while True:
        if d in free:
            return d
        if d == "/":
            return None
        d = d.rsplit("/", 1)[0] or "/"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def xid_after(report: ProbeReport) -> float | None:
    """The last look's new time when this read found Xid lines newer than the last look:
    the newest line's (the read's own clock when the read may have missed some)."""
    read = ((report.checks or {}).get("health") or {}).get("xid")
    lines, maybe_more = xids.new_lines(read)
    times = [x.at for x in lines if x.at is not None]
    now = read.get("now") if isinstance(read, Mapping) else None
    if maybe_more and isinstance(now, (int, float)):
        return float(now)
    return max(times) if times else None


# --------------------------------------------------------------------------- deciding


@dataclass(frozen=True)
class Change:
    """A mark to set (to HEALTHY: to take away), where it is one of `expect`."""

    gpu: int | None
    to: State
    expect: tuple[State, ...]
    reason: str = ""
    evidence: str = ""
    by: str = ""
    job: str = ""
    owner: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "to": self.to.value,
            "from": [s.value for s in self.expect],
            "reason": self.reason[:TEXT],
            "evidence": self.evidence[:1000],
            "by": self.by,
            "job": self.job,
            "owner": self.owner,
        }


def decide(
    health: HostHealth,
    found: Sequence[Signal],
    now: float,
    by: str,
    holders: Mapping[int, tuple[str, str]] = {},  # noqa: B006  read only
) -> tuple[Change, ...]:
    """The changes this host's signals call for: a fatal signal quarantines its GPU (drains
    the host when it is the host's), a warning makes a healthy one suspect, a suspect with
    no warning for SUSPECT_HOLD is healthy again, a test that never ended is a failed one.
    `holders`: GPU -> (job, owner) holding it now (told, and named in the mark)."""
    out: list[Change] = []
    ok = (State.HEALTHY, State.SUSPECT)
    targets: dict[int | None, list[Signal]] = {}
    for s in found:
        if s.level is not Level.PROGRAM:
            targets.setdefault(s.gpu, []).append(s)
    for gpu, sigs in sorted(targets.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)):
        state = health.host_state if gpu is None else health.gpu_state(gpu)
        fatal = sorted((s for s in sigs if s.level is Level.FATAL), key=lambda s: s.kind != "xid")  # the line first
        job, owner = holders.get(gpu, ("", "")) if gpu is not None else ("", "")
        if fatal and state in ok:
            to = State.DRAINING if gpu is None else State.QUARANTINED
            out.append(Change(gpu, to, ok, fatal[0].what, fatal[0].evidence, by, job, owner))
        elif not fatal and state is State.HEALTHY:
            out.append(Change(gpu, State.SUSPECT, (State.HEALTHY,), sigs[0].what, sigs[0].evidence, by, job, owner))
    marks: list[tuple[int | None, Mark]] = [(g, m) for g, m in health.gpus.items()]
    if health.host is not None:
        marks.append((None, health.host))
    for gpu, m in marks:
        age = now - m.since if m.since is not None else 0.0
        if m.state is State.SUSPECT and gpu not in targets and age >= SUSPECT_HOLD:
            out.append(Change(gpu, State.HEALTHY, (State.SUSPECT,), "no warning since", "", by))
        elif m.state is State.TESTING and age >= TEST_STALE:
            words = f"its test (by {m.by or '?'}) never said how it went"
            out.append(Change(gpu, State.QUARANTINED, (State.TESTING,), "a test that did not end", words, by))
    return tuple(out)


def holders_of(view: Any) -> dict[int, tuple[str, str]]:
    """GPU -> (job, owner) of what holds it in a round's view of the host (rules/tenancy.HostView)."""
    out: dict[int, tuple[str, str]] = {}
    for h in getattr(view, "holders", ()):
        if h.hold.holds:
            for g in h.gpus:
                out.setdefault(g, (h.job, h.who))
    return out


def parse_target(text: str) -> tuple[str, int | None]:
    """HOST or HOST:GPU (ValueError: neither)."""
    host, colon, gpu = text.strip().partition(":")
    if not host or (colon and not (gpu.isdigit() and len(gpu) < 5)):
        raise ValueError(text)
    return host, int(gpu) if colon else None


def target_words(host: str, gpu: int | None) -> str:
    return f"GPU {gpu} of {host}" if gpu is not None else host


def blocked_words(health: HostHealth) -> list[str]:
    """What keeps new work off a host, for placement's messages (`held by` lines)."""
    out = []
    if health.host is not None and health.host.state.blocks:
        out.append(f"this host is {health.host.state.value}: {health.host.reason}")
    for g, m in health.gpus.items():
        if m.state.blocks:
            out.append(f"GPU {g} is {m.state.value}: {m.reason}")
    return out


class HealthSummary(TypedDict):
    """A host's health as `jobs --json` and the pages show it: its mark and each GPU's."""

    host: dict[str, Any]
    gpus: dict[str, dict[str, Any]]


# A healthy GPU's and host's mark, shared by every document that shows one (they are read,
# never changed): a round of 1,000 hosts x 8 GPUs made 9,000 dicts of it each time.
_HEALTHY: dict[str, Any] = {"state": State.HEALTHY.value}


def summary(health: HostHealth, gpus: Iterable[int]) -> HealthSummary:
    """Each GPU's and the host's state as the pages and `jobs --json` show it."""
    return {
        "host": health.host.to_json() if health.host is not None else _HEALTHY,
        "gpus": {str(g): (health.gpus[g].to_json() if g in health.gpus else _HEALTHY) for g in gpus},
    }


def task_notes(task: str, host: str, gpus: Iterable[int], report: ProbeReport, declared: int = 0) -> list[str]:
    """What its host's health says of a task's GPUs (`provision status`): its owner is told
    that the GPU it runs on is quarantined, or its host drained, and why; and what the
    health read finds on them now (when the probe asked it), before the service acts."""
    gpus = list(gpus)
    health = of_report(report)
    out = []
    if "health" in (report.checks or {}):
        for s in signals(declared, report):
            if (
                s.level is not Level.PROGRAM
                and (s.gpu is None or s.gpu in gpus)
                and s.kind not in ("nvidia-smi", "gone")
            ):
                where = f"GPU {s.gpu} of {host}" if s.gpu is not None else host
                out.append(f"{task}: {where} now: {s.what} ({s.evidence})")
    h = health.host
    if h is not None and h.state is not State.HEALTHY:
        out.append(f"{task}: {host} is {h.state.value} since {_iso(h.since)} by {h.by or '?'}: {h.reason}")
    for g in gpus:
        m = health.gpus.get(g)
        if m is not None and m.state.blocks:
            tail = f" ({m.evidence})" if m.evidence and m.evidence != "by hand" else ""
            out.append(
                f"{task}: GPU {g} of {host} is {m.state.value} since {_iso(m.since)} by {m.by or '?'}: {m.reason}{tail}"
            )
    return out


def _iso(t: float | None) -> str:
    import time  # only a note's words need it

    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t is not None else "?"


# --------------------------------------------------------------------------- what to ask, and `check`


def health_fields(inv: Inventory, checks: Mapping[str, Any] | None, timeout: int) -> dict[str, Any]:
    """A probe's checks with the health read added: the GPUs' health fields, the kernel's
    Xids, DCGM's health watch, and the file system of outputs: (its path and parents)."""
    out = dict(checks or {})
    out["health"] = {"timeout": timeout}
    if inv.outputs:
        d, parents = posixpath.normpath(inv.outputs), []
        while True:
            parents.append(d)
            if d == "/":
                break
            d = posixpath.dirname(d)
        out["disk"] = sorted(set(out.get("disk") or []) | set(parents))
    return out


def findings(declared: int, report: ProbeReport, assigned: Iterable[int]) -> list[tuple[str, str, str]]:
    """`provision check`'s "gpu signals" lines (check, pass|warn|fail, detail): a fatal
    signal on a GPU the job gets fails it, any other signal warns, a quarantined GPU the job
    would get fails it. The host's own (nvidia-smi failing, a GPU gone) are the "gpus"
    check's already, and uncorrectable ECC errors the "gpu health" check's (said once)."""
    used = set(assigned)
    out = []
    for s in signals(declared, report):
        if s.kind in ("nvidia-smi", "gone", "ecc"):
            continue
        bad = s.level is Level.FATAL and (s.gpu is None or s.gpu in used)
        where = f"GPU {s.gpu}" if s.gpu is not None else "the host"
        tail = "" if s.gpu is None or s.gpu in used else " (not one the job uses)"
        if s.level is Level.PROGRAM:
            tail = " (the program's own error, not the GPU's)"
        out.append(("gpu signals", "fail" if bad else "warn", f"{where}: {s.what}{tail}: {s.evidence}"))
    h = of_report(report)
    for g, m in h.gpus.items():
        if m.state.blocks and g in used:
            out.append(("gpu signals", "fail", f"GPU {g} is {m.state.value} by {m.by or '?'}: {m.reason}"))
    if not out:
        out.append(("gpu signals", "pass", "no Xid since the last look, no throttling, PCIe links at their best"))
    return out


def health_words(declared: int, report: ProbeReport) -> dict[str, Any]:
    """`provision facts`' health of a host: its state and each GPU's, and the signals the
    read gives now ("fatal" ones are problems, as a mismatch is)."""
    h = of_report(report)
    found = signals(declared, report) if "health" in (report.checks or {}) else ()

    def words(s: Signal) -> str:
        return f"{'GPU ' + str(s.gpu) if s.gpu is not None else 'host'}: {s.what}"

    return {
        **summary(h, range(declared)),
        "fatal": [words(s) for s in found if s.level is Level.FATAL],
        "warn": [words(s) for s in found if s.level is not Level.FATAL],
    }
