"""Pre-flight checks: what to ask the hosts, how to judge their answers, and the network as
the job will use it (`provision check`; the per-host part also runs inside every plan and
apply, in plan's own round trip).

Per host (the probe reads it; host/hostcheck.py is the host side):
- gpus: nvidia-smi answers within GPU_TIMEOUT; count, model and (when the type names one)
  memory match the inventory. TPU hosts: the chips declared are there.
- gpu health: no uncorrectable ECC errors, no page retirement or row remapping pending on
  the GPUs the job's tasks get (fail); on the host's other GPUs, a warning.
- gpu processes: compute processes provision did not start, on the job's GPUs (fail) or the
  host's others (warning). Processes of other provision jobs are tenancy.py's business.
- driver: a driver version that differs between hosts (warning).
- ports: each of the job's ports here is free or held by this job's own task (else fail,
  naming the process).
- clock: a host whose clock is more than CLOCK_SKEW off the others' (warning).
- disk: free space where `files:` go: less than the files need (fail), less than that plus
  DISK_MARGIN (warning).
- interface: the interface that holds the host's cluster address (NCCL_SOCKET_IFNAME and
  GLOO_SOCKET_IFNAME are set to it in the tasks' env: `with_interfaces`).

Network (`provision check` only, one more round trip): every host listens on its tasks'
ports (those nothing listens on yet) for a moment, while from every task's host the
addresses that task will dial are tried (`peers`).

The rules and wording live here; engine.py asks, cli.py prints.
"""

from __future__ import annotations

import os
import posixpath
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from provision.core.model import Host, Inventory
from provision.host.protocol import ProbeReport
from provision.render.files import FileKind, HostBundle
from provision.rules import health as hl
from provision.rules import hypertune
from provision.rules.facts import mismatches
from provision.rules.plan import FileAction, HostPlan, Plan

if TYPE_CHECKING:
    pass

FORMAT_VERSION = 1


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


GPU_TIMEOUT = max(1, int(_env_float("PROVISION_CHECK_GPU_TIMEOUT", 10)))  # seconds per nvidia-smi run
CLOCK_SKEW = 1.0  # seconds between hosts
DISK_MARGIN = int(_env_float("PROVISION_CHECK_DISK_MARGIN", 1 << 30))  # bytes free beyond what files: need
NET_TIMEOUT = _env_float("PROVISION_CHECK_NET_TIMEOUT", 2.0)  # seconds per connection attempt
NET_WINDOW = _env_float("PROVISION_CHECK_NET_WINDOW", 4.0)  # seconds the listeners stay up at most
ALL_TO_ALL_HOSTS = 64  # past this many chief/worker hosts, each dials the master and NEIGHBOURS others
NEIGHBOURS = 8
ORDER = (
    "ssh",
    "plan",
    "systemd",
    "gpus",
    "tpu",
    "tpu processes",
    "gpu health",
    "gpu signals",
    "gpu processes",
    "driver",
    "ports",
    "clock",
    "disk",
    "hypertune",
    "interface",
    "network",
)


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Finding:
    host: str
    check: str
    status: Status
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "status": self.status.value, "detail": self.detail}


# --------------------------------------------------------------------------- what to ask


def disk_paths(inv: Inventory) -> list[str]:
    """Where `files:` go, with every parent up to / (the host reports the ones that exist)."""
    out: set[str] = set()
    for spec in inv.files:
        d = posixpath.normpath(spec.dest if spec.is_dir or spec.dest.endswith("/") else posixpath.dirname(spec.dest))
        while True:
            out.add(d)
            if d == "/":
                break
            d = posixpath.dirname(d)
    return sorted(out)


def request_fields(
    inv: Inventory,
    host: Host | None,
    bundle: HostBundle | None,
    facts_only: Iterable[str],
    *,
    checks: bool,
    interface: bool = True,
) -> dict[str, Any]:
    """The probe request's pre-flight fields for a host (engine.probe_request): with
    `interface` its cluster address to resolve (for a host that runs tasks whose env takes
    NCCL's and Gloo's interface: clusterenv.uses_socket_ifname), and with `checks` what
    they read."""
    if host is None:
        return {}
    if bundle is None:  # no task of the job here: a study's trials may run here all the same
        asked = hypertune.pythons(inv, host) if checks else []
        return {"checks": {"hypertune": asked}} if asked else {}
    out: dict[str, Any] = {"cluster_address": host.cluster_address} if interface else {}
    if checks:
        out["checks"] = {
            "gpus": "gpus" in facts_only,
            "gpu_timeout": GPU_TIMEOUT,
            "clock": True,
            "ports": sorted({u.task.port for u in bundle.tasks}),
            "disk": disk_paths(inv),
        }
        acc = host.accelerators
        if acc is not None and acc.kind == "tpu" and acc.count:
            out["checks"]["tpu"] = True  # who holds the chips (the agent answers: io/probe.py)
        pythons = hypertune.pythons(inv, host)
        if pythons:
            out["checks"]["hypertune"] = pythons  # the agent answers (io/probe.py)
    return out


# --------------------------------------------------------------------------- NCCL / Gloo interface


# --------------------------------------------------------------------------- judging


def _tokens(text: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", text.lower()) if t]


def gpu_model_problem(declared: str, names: list[str], memory_mib: list[int | None]) -> str | None:
    """The inventory's accelerator type against what nvidia-smi names: every word of the type
    with a digit in it (the model, 'h100'; a size, '80gb') must be in the GPU's name, and a
    size must match the memory. Vendor and family words (nvidia, tesla) are not compared."""
    if not names:
        return None
    name_tokens = set(_tokens(" ".join(names)))
    squashed = re.sub(r"[^a-z0-9]", "", " ".join(names).lower())
    for tok in _tokens(declared):
        if not any(ch.isdigit() for ch in tok):
            continue
        size = re.fullmatch(r"(\d+)gb?", tok)
        if size:
            want = int(size.group(1)) * 1024
            have = [m for m in memory_mib if m is not None]
            if have and any(abs(m - want) > 0.1 * want for m in have):
                return f"inventory declares {declared}, but the GPUs have {min(have)} MiB of memory"
            continue
        if tok not in name_tokens and tok not in squashed:
            return f"inventory declares {declared}, but nvidia-smi reports {', '.join(sorted(set(names)))}"
    return None


def _mib(n: int) -> str:
    """A size in words, never rounded down to nothing ("0 MiB free ... need 0 MiB")."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.0f} KiB"
    return f"{n} byte{'s' if n != 1 else ''}"


def _own_units(job: str, bundle: HostBundle, report: ProbeReport) -> set[str]:
    units = {u.unit for u in bundle.tasks}
    manifest = report.readable_manifest() or {}
    units |= {str(t.get("unit")) for t in manifest.get("tasks", {}).values() if t.get("unit")}
    return units


def _other_job(owner: Mapping[str, Any], report: ProbeReport, job: str) -> str | None:
    """The other provision job a process belongs to, if it is one's."""
    if owner.get("job") and owner["job"] != job:
        return str(owner["job"])
    for other, entry in (report.ledger or {}).items():
        if other != job and isinstance(entry, dict) and owner.get("unit") in (entry.get("units") or []):
            return str(other)
    return None


def _mine(owner: Mapping[str, Any], own_units: set[str], job: str) -> bool:
    return owner.get("unit") in own_units or owner.get("job") == job


def describe_process(owner: Mapping[str, Any] | None, name: str = "") -> str:
    if not owner or owner.get("pid") is None:
        return f"{name or 'a process'} (not visible here: another PID namespace?)"
    what = owner.get("comm") or name or "a process"
    unit = owner.get("unit")
    return f"{what} (pid {owner['pid']}{', ' + unit if unit else ''})"


def _gpu_findings(name: str, host: Host, hp: HostPlan, report: ProbeReport, job: str) -> list[Finding]:
    out: list[Finding] = []
    acc = host.accelerators
    facts = report.facts or {}
    bundle = hp.bundle
    assert acc is not None and bundle is not None
    gpus = [g for g in facts.get("gpus") or [] if isinstance(g, dict)]
    mine = [p for p in mismatches(host, facts) if p.startswith("inventory declares")]
    for p in mine:
        out.append(Finding(name, "gpus", Status.FAIL, p))
    model = gpu_model_problem(acc.type, [str(g.get("name")) for g in gpus], [g.get("memory_mib") for g in gpus])
    if model and gpus:
        out.append(Finding(name, "gpus", Status.FAIL, model))
    if not mine and not model:
        if gpus:
            kinds = ", ".join(sorted({str(g.get("name")) for g in gpus}))
            sizes = sorted({int(g["memory_mib"]) for g in gpus if g.get("memory_mib")})
            size = f", {sizes[0]} MiB" if len(sizes) == 1 else ""
            out.append(Finding(name, "gpus", Status.PASS, f"{len(gpus)} × {kinds}{size}"))
        else:
            out.append(Finding(name, "gpus", Status.PASS, "none declared in use"))
    c = (report.checks or {}).get("gpus")
    if not isinstance(c, dict) or c.get("error"):
        return out  # nvidia-smi did not answer: the line above says so
    assigned = {a for u in bundle.tasks for a in u.task.accelerators}
    out += _gpu_health(name, c, assigned)
    if "health" in (report.checks or {}):  # the health read's signals (rules/health.py)
        out += [Finding(name, k, Status(st), d) for k, st, d in hl.findings(acc.count, report, assigned)]
    if c.get("apps_error"):
        out.append(Finding(name, "gpu processes", Status.WARN, f"could not list compute processes: {c['apps_error']}"))
        return out
    by_uuid = {str(g.get("uuid")): g.get("index") for g in gpus}
    return out + _gpu_processes(name, c, assigned, by_uuid, _own_units(job, bundle, report), report, job)


def _gpu_health(name: str, c: Mapping[str, Any], assigned: set[int]) -> list[Finding]:
    """ECC errors, retirement and remapping pending: a failure on a GPU the job uses."""
    out: list[Finding] = []
    for h in c.get("health") or []:
        idx = h.get("index")
        issues = []
        if h.get("ecc_uncorrected"):
            issues.append(f"{h['ecc_uncorrected']} uncorrectable ECC error{'s' if h['ecc_uncorrected'] != 1 else ''}")
        if h.get("retired_pending"):
            issues.append("page retirement pending")
        if h.get("remap_pending"):
            issues.append("row remapping pending")
        if issues:
            used = idx in assigned
            tail = " (reset the GPU or drain the host)" if used else " (not one the job uses)"
            status = Status.FAIL if used else Status.WARN
            out.append(Finding(name, "gpu health", status, f"GPU {idx}: {', '.join(issues)}{tail}"))
    if not out:
        out.append(
            Finding(name, "gpu health", Status.PASS, "no uncorrectable ECC errors, no retirement or remapping pending")
        )
    return out


def _gpu_processes(
    name: str,
    c: Mapping[str, Any],
    assigned: set[int],
    by_uuid: Mapping[str, Any],
    own: set[str],
    report: ProbeReport,
    job: str,
) -> list[Finding]:
    """Compute processes on the GPUs that neither this job nor another provision job started."""
    out: list[Finding] = []
    for a in c.get("apps") or []:
        o = a.get("owner")
        if o and (_mine(o, own, job) or _other_job(o, report, job)):
            continue
        idx = by_uuid.get(str(a.get("gpu_uuid")))
        used = idx in assigned
        what = (
            describe_process(o, str(a.get("name") or ""))
            if o
            else f"{a.get('name') or 'a process'} (pid {a.get('pid')}, not among this host's processes: "
            "another container's?)"
        )
        taking = f", {a['used_mib']} MiB" if a.get("used_mib") is not None else ""
        tail = "" if used else " (not one the job uses)"
        out.append(
            Finding(
                name,
                "gpu processes",
                Status.FAIL if used else Status.WARN,
                f"GPU {idx if idx is not None else a.get('gpu_uuid')} is busy: {what}{taking}, not started by provision{tail}",
            )
        )
    if not out:
        out.append(Finding(name, "gpu processes", Status.PASS, "none but provision's"))
    return out


def _tpu_users(name: str, hp: HostPlan, report: ProbeReport, job: str) -> list[Finding]:
    """TPU chips held open by a process that neither this job nor another provision job
    started (libtpu takes a host's chips whole: a second user fails to start)."""
    users = (report.checks or {}).get("tpu")
    if users is None or hp.bundle is None:
        return []
    own = _own_units(job, hp.bundle, report)
    out = [
        Finding(
            name,
            "tpu processes",
            Status.FAIL,
            f"TPU chip {dev} is busy: {describe_process(o)}, not started by provision",
        )
        for dev, owners in sorted(users.items())
        for o in owners
        if not (_mine(o, own, job) or _other_job(o, report, job))
    ]
    return out or [Finding(name, "tpu processes", Status.PASS, "none but provision's")]


def _port_findings(name: str, hp: HostPlan, report: ProbeReport, job: str) -> list[Finding]:
    bundle = hp.bundle
    assert bundle is not None
    owners = (report.checks or {}).get("ports")
    if owners is None:
        return []
    own = _own_units(job, bundle, report)
    out, ok = [], []
    for u in sorted(bundle.tasks, key=lambda u: u.task.port):
        holders = owners.get(str(u.task.port)) or []
        if not holders:
            ok.append(f"{u.task.port} ({u.task.name}) free")
            continue
        theirs = [o for o in holders if not _mine(o, own, job)]
        if not theirs:
            ok.append(f"{u.task.port} ({u.task.name}) held by the job's own task")
            continue
        who = []
        for o in theirs:
            other = _other_job(o, report, job)
            who.append(f"job {other}'s {describe_process(o)}" if other else describe_process(o))
        out.append(
            Finding(
                name,
                "ports",
                Status.FAIL,
                f"port {u.task.port} ({u.task.name}) is taken by {', '.join(who)}, not by this job",
            )
        )
    if not out:
        out.append(Finding(name, "ports", Status.PASS, "; ".join(ok)))
    return out


def _file_size(f: Any) -> int:
    if f.content is not None:
        return len(f.content)
    try:
        return int(os.stat(f.source).st_size)
    except (OSError, TypeError):
        return 0


def _disk_findings(name: str, inv: Inventory, hp: HostPlan, report: ProbeReport) -> list[Finding]:
    free = (report.checks or {}).get("disk")
    if free is None or not inv.files or hp.bundle is None:
        return []
    desired = hp.bundle.file_map()
    writes = [
        desired[f.path]
        for f in hp.files
        if f.kind is FileKind.FILE and f.action is not FileAction.DELETE and f.path in desired
    ]
    out = []
    # Each file counted once, under the nearest existing directory of the longest `files:`
    # destination holding it (a destination nested in another is not counted twice).
    paths: dict[str, set[str]] = {}  # nearest existing directory -> files written under it
    where: dict[str, list[str]] = {}
    counted: set[str] = set()
    dests = sorted(
        {
            posixpath.normpath(s.dest if s.is_dir or s.dest.endswith("/") else posixpath.dirname(s.dest))
            for s in inv.files
        },
        key=len,
        reverse=True,
    )
    for dest in dests:
        d = dest
        while d not in free and d != "/":
            d = posixpath.dirname(d)
        if d not in free:
            continue
        where.setdefault(d, []).append(dest)
        mine = {f.path for f in writes if f.path == dest or f.path.startswith(dest.rstrip("/") + "/")} - counted
        paths.setdefault(d, set()).update(mine)
        counted |= mine
    by_path = {f.path: f for f in writes}
    seen = {d: sum(_file_size(by_path[p]) for p in ps) for d, ps in paths.items()}
    for d, need in seen.items():
        have = int(free[d])
        dests_of = ", ".join(sorted(where[d]))
        if have < need:
            out.append(
                Finding(
                    name, "disk", Status.FAIL, f"{_mib(have)} free on {d} (for {dests_of}): files: need {_mib(need)}"
                )
            )
        elif have < need + DISK_MARGIN:
            out.append(
                Finding(
                    name,
                    "disk",
                    Status.WARN,
                    f"only {_mib(have)} free on {d} (for {dests_of}); files: need {_mib(need)}, "
                    f"and the job will want room beyond them",
                )
            )
        else:
            out.append(Finding(name, "disk", Status.PASS, f"{_mib(have)} free on {d} (for {dests_of})"))
    return out


def _hypertune_findings(name: str, inv: Inventory, report: ProbeReport) -> list[Finding]:
    """Whether each trial python imports hypertune here (request_fields asked it)."""
    return [
        Finding(name, "hypertune", Status.PASS if ok else Status.FAIL, detail)
        for ok, detail in hypertune.judge((report.checks or {}).get("hypertune"), inv)
    ]


def _interface_finding(name: str, inv: Inventory, host: Host, report: ProbeReport, hosts_used: int) -> Finding | None:
    it = report.interface
    if it is None:
        return None
    addr = host.cluster_address
    if it.get("error"):
        return Finding(
            name,
            "interface",
            Status.WARN,
            f"{addr}: {it['error']}; NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are not set",
        )
    if not it.get("name"):
        return Finding(
            name,
            "interface",
            Status.WARN,
            f"{addr} resolves here to {it.get('address')}, which no interface of this host holds; "
            "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are not set",
        )
    if it["name"] == "lo":
        status = Status.WARN if hosts_used > 1 else Status.PASS
        return Finding(
            name,
            "interface",
            status,
            f"{addr} resolves here to {it.get('address')} on loopback: the other hosts cannot reach a task "
            "that listens there; NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are not set",
        )
    env = dict(inv.env)
    kept = [k for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if k in env and env[k] != it["name"]]
    note = f" (the inventory sets {', '.join(f'{k}={env[k]}' for k in kept)})" if kept else ""
    return Finding(
        name,
        "interface",
        Status.PASS,
        f"{it['name']} holds {it.get('address')} ({addr}): NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME={it['name']}{note}",
    )


def judge(
    inv: Inventory,
    plan: Plan,
    timings: Mapping[str, tuple[float, float]] | None = None,
) -> list[Finding]:
    """Every host's findings, then the ones across hosts (driver, clock), in ORDER per host."""
    hosts = {h.name: h for h in inv.hosts}
    job = inv.job
    out: list[Finding] = []
    used = [hp for hp in plan.hosts if hp.bundle is not None and hp.error is None and hp.report is not None]
    for hp in plan.hosts:
        name = hp.name
        if hp.error is not None:
            out.append(Finding(name, "ssh", Status.FAIL, hp.error.message))
            continue
        host, report = hosts.get(name), hp.report
        if host is None or report is None:
            continue
        if hp.bundle is None:  # no task of the job here: a study's trials may run here all the same
            out += _hypertune_findings(name, inv, report)
            continue
        facts = report.facts or {}
        problems = mismatches(host, facts) if report.facts is not None else []
        systemd = [p for p in problems if p.startswith("systemd")]
        out.append(
            Finding(name, "systemd", Status.FAIL, systemd[0])
            if systemd
            else Finding(name, "systemd", Status.PASS, "running as PID 1")
        )
        acc = host.accelerators
        if acc and acc.count and acc.kind == "gpu":
            out += _gpu_findings(name, host, hp, report, job)
        elif acc and acc.count:
            mine = [p for p in problems if p.startswith("inventory declares")]
            chips = facts.get("tpu_chips", "?")
            out += [Finding(name, "tpu", Status.FAIL, p) for p in mine] or [
                Finding(name, "tpu", Status.PASS, f"{chips} chip{'' if str(chips) == '1' else 's'}")
            ]
            out += _tpu_users(name, hp, report, job)
        out += _port_findings(name, hp, report, job)
        out += _disk_findings(name, inv, hp, report)
        out += _hypertune_findings(name, inv, report)
        f = _interface_finding(name, inv, host, report, len(used))
        if f is not None:
            out.append(f)
    out += _drivers(used)
    out += _clocks(used, timings or {})
    rank = {c: i for i, c in enumerate(ORDER)}
    order = {hp.name: i for i, hp in enumerate(plan.hosts)}
    return sorted(out, key=lambda f: (order.get(f.host, 1 << 30), rank.get(f.check, len(ORDER))))


def _drivers(used: list[HostPlan]) -> list[Finding]:
    return driver_findings({hp.name: (hp.report.checks or {}) if hp.report else {} for hp in used})


def driver_findings(checks: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    """The GPU driver of each host (its checks' answer) against the other hosts'."""
    drivers: dict[str, str] = {}
    for name, answer in checks.items():
        c = answer.get("gpus") or {}
        found = sorted({str(h.get("driver")) for h in c.get("health") or [] if h.get("driver")})
        if found:
            drivers[name] = ", ".join(found)
    if not drivers:
        return []
    counts: dict[str, int] = {}
    for d in drivers.values():
        counts[d] = counts.get(d, 0) + 1
    common = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    tie = list(counts.values()).count(counts[common]) > 1
    out = []
    for name, d in drivers.items():
        if len(counts) == 1:
            out.append(Finding(name, "driver", Status.PASS, f"{d}, as on every GPU host"))
        elif d != common or tie:
            others = sorted({x for x in drivers.values() if x != d})
            where = "; ".join(f"{x} on {', '.join(n for n, y in drivers.items() if y == x)}" for x in others)
            out.append(
                Finding(
                    name,
                    "driver",
                    Status.WARN,
                    f"driver {d} here, {where}: NCCL and CUDA may not agree across hosts",
                )
            )
        else:
            out.append(Finding(name, "driver", Status.PASS, d))
    return out


def clock_offsets(
    nows: Mapping[str, float], timings: Mapping[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    """host → (least, most) its clock can be ahead of the controller's: the host read it
    somewhere between sending the request and getting the answer."""
    return {n: (now - timings[n][1], now - timings[n][0]) for n, now in nows.items() if n in timings}


def clock_skews(offsets: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """host → how far (at least) its clock is from the hosts' median: + ahead, - behind."""
    if len(offsets) < 2:
        return {}
    mid = statistics.median((lo + hi) / 2 for lo, hi in offsets.values())
    out = {}
    for n, (lo, hi) in offsets.items():
        out[n] = lo - mid if lo > mid else hi - mid if hi < mid else 0.0
    return out


def _clocks(used: list[HostPlan], timings: Mapping[str, tuple[float, float]]) -> list[Finding]:
    nows = {hp.name: hp.report.now for hp in used if hp.report is not None and hp.report.now is not None}
    skews = clock_skews(clock_offsets(nows, timings))
    out = []
    for name, s in skews.items():
        if abs(s) > CLOCK_SKEW:
            way = "ahead of" if s > 0 else "behind"
            out.append(
                Finding(
                    name,
                    "clock",
                    Status.WARN,
                    f"clock {abs(s):.1f} s {way} the other hosts' (over {CLOCK_SKEW:g} s): timeouts and "
                    "log times will not agree; is NTP running?",
                )
            )
        else:
            out.append(Finding(name, "clock", Status.PASS, f"within {CLOCK_SKEW:g} s of the other hosts"))
    return out


# --------------------------------------------------------------------------- the network


# --------------------------------------------------------------------------- `provision check`
