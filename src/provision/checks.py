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

import base64
import dataclasses
import os
import posixpath
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .facts import mismatches
from .host.protocol import FileInfo, NetcheckReport, NetcheckRequest, ProbeReport
from .model import Host, Inventory
from .placement import PlacedTask, Placement
from .plan import FileAction, HostPlan, Plan
from .render import FileKind, HostBundle, render

if TYPE_CHECKING:
    from .engine import Context
    from .steps import GroupResult

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
    "gpu health",
    "gpu processes",
    "driver",
    "ports",
    "clock",
    "disk",
    "interface",
    "network",
)


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"

    def __str__(self) -> str:
        return self.value


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
    if host is None or bundle is None:
        return {}
    out: dict[str, Any] = {"cluster_address": host.cluster_address} if interface else {}
    if checks:
        out["checks"] = {
            "gpus": "gpus" in facts_only,
            "gpu_timeout": GPU_TIMEOUT,
            "clock": True,
            "ports": sorted({u.task.port for u in bundle.tasks}),
            "disk": disk_paths(inv),
        }
    return out


# --------------------------------------------------------------------------- NCCL / Gloo interface


def socket_ifnames(reports: Mapping[str, Any]) -> dict[str, str]:
    """host → the interface that holds its cluster address (loopback never: the other hosts
    cannot reach a task there)."""
    out = {}
    for name, r in reports.items():
        it = r.interface if isinstance(r, ProbeReport) else None
        if it and it.get("name") and it["name"] != "lo":
            out[name] = str(it["name"])
    return out


def with_interfaces(ctx: Context, reports: GroupResult[ProbeReport]) -> None:
    """Render again with each host's interface in its tasks' env (ctx.rendered), and keep
    the reports good for the new files' diffs: a file the host has as it was rendered before
    did not come back with its content, which is known here. A host that was not asked
    (engine.settled) keeps the interface the state has for it; nothing is rendered again
    when every host's interface is the one rendered already."""
    asked = {n for n, r in reports.ok.items() if isinstance(r, ProbeReport) and r.interface is not None}
    ifnames = {n: v for n, v in ctx.ifnames.items() if n not in asked} | socket_ifnames(reports.ok)
    if ifnames == ctx.ifnames:
        return
    old = ctx.rendered
    new = render(ctx.inventory, placement=old.placement, secrets=ctx.secrets, socket_ifnames=ifnames)
    ctx.rendered, ctx.ifnames = new, ifnames
    for name, report in list(reports.ok.items()):
        before, after = old.hosts.get(name), new.hosts.get(name)
        if before is None or after is None or not isinstance(report, ProbeReport):
            continue
        was = before.file_map()
        files = dict(report.files)
        for f in after.files:
            prev, got = was.get(f.path), files.get(f.path)
            if (
                prev is not None
                and got is not None
                and got.type == "file"
                and got.content is None
                and got.sha256 == prev.sha256 != f.sha256
                and f.kind is not FileKind.FILE
            ):
                files[f.path] = FileInfo(
                    got.type, got.mode, got.uid, got.size, got.sha256, base64.b64encode(prev.data()).decode()
                )
        if files != report.files:
            reports.ok[name] = dataclasses.replace(report, files=files)


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
    gib = n / 2**30
    return f"{gib:.1f} GiB" if gib >= 1 else f"{n / 2**20:.0f} MiB"


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
    by_uuid = {str(g.get("uuid")): g.get("index") for g in gpus}
    bad = 0
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
            bad += 1
            used = idx in assigned
            tail = " (reset the GPU or drain the host)" if used else " (not one the job uses)"
            status = Status.FAIL if used else Status.WARN
            out.append(Finding(name, "gpu health", status, f"GPU {idx}: {', '.join(issues)}{tail}"))
    if not bad:
        out.append(
            Finding(name, "gpu health", Status.PASS, "no uncorrectable ECC errors, no retirement or remapping pending")
        )
    if c.get("apps_error"):
        out.append(Finding(name, "gpu processes", Status.WARN, f"could not list compute processes: {c['apps_error']}"))
        return out
    own = _own_units(job, bundle, report)
    foreign = 0
    for a in c.get("apps") or []:
        o = a.get("owner")
        if o and (_mine(o, own, job) or _other_job(o, report, job)):
            continue
        foreign += 1
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
    if not foreign:
        out.append(Finding(name, "gpu processes", Status.PASS, "none but provision's"))
    return out


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
    seen: dict[str, int] = {}  # file system (nearest existing directory) → bytes needed
    where: dict[str, list[str]] = {}
    for spec in inv.files:
        dest = posixpath.normpath(spec.dest if spec.is_dir or spec.dest.endswith("/") else posixpath.dirname(spec.dest))
        d = dest
        while d not in free and d != "/":
            d = posixpath.dirname(d)
        if d not in free:
            continue
        need = sum(_file_size(f) for f in writes if f.path == dest or f.path.startswith(dest.rstrip("/") + "/"))
        seen[d] = seen.get(d, 0) + need
        where.setdefault(d, []).append(dest)
    for d, need in seen.items():
        have = int(free[d])
        dests = ", ".join(where[d])
        if have < need:
            out.append(
                Finding(name, "disk", Status.FAIL, f"{_mib(have)} free on {d} (for {dests}): files: need {_mib(need)}")
            )
        elif have < need + DISK_MARGIN:
            out.append(
                Finding(
                    name,
                    "disk",
                    Status.WARN,
                    f"only {_mib(have)} free on {d} (for {dests}); files: need {_mib(need)}, "
                    f"and the job will want room beyond them",
                )
            )
        else:
            out.append(Finding(name, "disk", Status.PASS, f"{_mib(have)} free on {d} (for {dests})"))
    return out


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
        if hp.bundle is None or host is None or report is None:
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
        out += _port_findings(name, hp, report, job)
        out += _disk_findings(name, inv, hp, report)
        f = _interface_finding(name, inv, host, report, len(used))
        if f is not None:
            out.append(f)
    out += _drivers(used)
    out += _clocks(used, timings or {})
    rank = {c: i for i, c in enumerate(ORDER)}
    order = {hp.name: i for i, hp in enumerate(plan.hosts)}
    return sorted(out, key=lambda f: (order.get(f.host, 1 << 30), rank.get(f.check, len(ORDER))))


def _drivers(used: list[HostPlan]) -> list[Finding]:
    drivers: dict[str, str] = {}
    for hp in used:
        c = ((hp.report.checks or {}) if hp.report else {}).get("gpus") or {}
        found = sorted({str(h.get("driver")) for h in c.get("health") or [] if h.get("driver")})
        if found:
            drivers[hp.name] = ", ".join(found)
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


def add_to_plan(inv: Inventory, plan: Plan, timings: Mapping[str, tuple[float, float]] | None = None) -> None:
    """The per-host checks inside plan and apply: failures refuse the apply (problems),
    warnings are printed. Only hosts that were checked: a settled host (engine.settled),
    where nothing starts, is not."""
    checked = [hp for hp in plan.hosts if hp.report is not None and hp.report.checks is not None]
    for f in judge(inv, Plan(plan.job, checked), timings):
        hp = next(h for h in plan.hosts if h.name == f.host)
        if f.check in ("ssh", "plan"):
            continue
        if f.status is Status.FAIL and f.detail not in hp.problems:
            hp.problems.append(f.detail)
        elif f.status is Status.WARN and f"{f.host}: {f.detail}" not in hp.warnings:
            hp.warnings.append(f"{f.host}: {f.detail}")


# --------------------------------------------------------------------------- the network


def peers(inv: Inventory, placement: Placement) -> dict[str, list[PlacedTask]]:
    """task → the tasks whose address it will dial (shared/spec/cluster-env.md): chief and
    workers dial each other (TF_CONFIG; MASTER_ADDR and the JAX coordinator are among them),
    every ps and every reduction server; parameter servers dial the scheduler (DMLC) when
    there is one; the evaluator, the chief. Past ALL_TO_ALL_HOSTS chief/worker hosts, each
    dials the master and its NEIGHBOURS next ones instead of all."""
    tasks = placement.tasks
    if len(tasks) <= 1:
        return {}
    group = [t for t in tasks if t.role in ("chief", "worker")]
    servers = [t for t in tasks if t.role in ("ps", "reduction_server")]
    master = group[0] if group else None
    big = len({t.host.name for t in group}) > ALL_TO_ALL_HOSTS
    out: dict[str, list[PlacedTask]] = {}
    for t in tasks:
        targets: list[PlacedTask] = []
        if t.role in ("chief", "worker"):
            if big:
                i = group.index(t)
                targets += ([master] if master else []) + [
                    group[(i + k) % len(group)] for k in range(1, NEIGHBOURS + 1)
                ]
            else:
                targets += group
            targets += servers
        elif t.role == "ps" and master is not None:
            targets.append(master)
        elif t.role == "evaluator":
            targets += [x for x in tasks if x.role == "chief"][:1]
        seen: dict[str, PlacedTask] = {}
        for x in targets:
            if x.name != t.name:
                seen.setdefault(x.name, x)
        out[t.name] = list(seen.values())
    return out


@dataclass
class NetFailure:
    from_host: str
    from_tasks: list[str]
    to_task: str
    address: str
    error: str

    @property
    def line(self) -> str:
        return f"{', '.join(self.from_tasks)} on {self.from_host} cannot reach {self.to_task} at {self.address} ({self.error})"

    def to_json(self) -> dict[str, Any]:
        return {
            "from_host": self.from_host,
            "from_tasks": self.from_tasks,
            "to_task": self.to_task,
            "address": self.address,
            "error": self.error,
            "line": self.line,
        }


@dataclass
class NetworkPlan:
    requests: dict[str, NetcheckRequest] = field(default_factory=dict)
    # host → per dial of its request: (target task, its address as rendered, the host's tasks that dial it)
    dials: dict[str, list[tuple[PlacedTask, list[str]]]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # what was not tried, and why
    taken: set[tuple[str, int]] = field(default_factory=set)  # (host, port) something else holds


def network_plan(inv: Inventory, plan: Plan, placement: Placement) -> NetworkPlan:
    """Per host: the ports to listen on, the addresses to dial, and how many connections to
    wait for. Hosts that did not answer the probe take no part; a port something else holds
    is neither listened on nor dialed (the ports check says who holds it)."""
    job = inv.job
    ready = {hp.name: hp for hp in plan.hosts if hp.error is None and hp.report is not None and hp.bundle is not None}
    taken: set[tuple[str, int]] = set()
    answered: set[tuple[str, int]] = set()  # the job's own task listens: it answers itself
    for name, hp in ready.items():
        assert hp.report is not None and hp.bundle is not None
        owners = (hp.report.checks or {}).get("ports") or {}
        own = _own_units(job, hp.bundle, hp.report)
        for u in hp.bundle.tasks:
            holders = owners.get(str(u.task.port)) or []
            if holders and all(_mine(o, own, job) for o in holders):
                answered.add((name, u.task.port))
            elif holders:
                taken.add((name, u.task.port))
    net = NetworkPlan(taken=taken)
    dials: dict[str, dict[tuple[str, int], tuple[PlacedTask, list[str]]]] = {}
    for t, targets in peers(inv, placement).items():
        src = placement.task(t)
        if src.host.name not in ready:
            continue
        for x in targets:
            key = (x.host.name, x.port)
            if x.host.name not in ready:
                net.skipped.append(
                    f"{t} on {src.host.name} did not try {x.name} at {x.address}: {x.host.name} is not checked "
                    "(unreachable, or left out by --target)"
                )
                continue
            if key in taken:
                net.skipped.append(
                    f"{t} on {src.host.name} did not try {x.name} at {x.address}: the port is taken (see ports)"
                )
                continue
            entry = dials.setdefault(src.host.name, {}).setdefault(key, (x, []))
            entry[1].append(t)
    expect: dict[tuple[str, int], int] = {}
    for by_target in dials.values():
        for key in by_target:
            expect[key] = expect.get(key, 0) + 1
    window = max(NET_WINDOW, NET_TIMEOUT + 1.0)
    for name, hp in ready.items():
        assert hp.bundle is not None
        ports = sorted({u.task.port for u in hp.bundle.tasks} - {p for h, p in taken | answered if h == name})
        mine = dials.get(name, {})
        net.dials[name] = list(mine.values())
        net.requests[name] = NetcheckRequest(
            job=job,
            listen=ports,
            expect={str(p): expect[(name, p)] for p in ports if (name, p) in expect},
            dial=[[x.host.cluster_address, x.port] for x, _ in mine.values()],
            timeout=NET_TIMEOUT,
            window=window,
        )
    return net


def network_findings(
    net: NetworkPlan, results: Mapping[str, NetcheckReport | Exception], placement: Placement
) -> tuple[list[Finding], list[NetFailure]]:
    findings: list[Finding] = []
    failures: list[NetFailure] = []
    for name, req in net.requests.items():
        r = results.get(name)
        if not isinstance(r, NetcheckReport):
            why = getattr(r, "message", None) or str(r)
            findings.append(Finding(name, "network", Status.FAIL, f"the network check did not run here: {why}"))
            continue
        mine = []
        for (x, tasks), result in zip(net.dials[name], r.results):
            if result is not None:
                nf = NetFailure(name, sorted(tasks), x.name, x.address, result)
                mine.append(nf)
                findings.append(Finding(name, "network", Status.FAIL, nf.line))
        for port, err in sorted(r.listen_errors.items()):
            task = next((t.name for t in placement.on_host(name) if str(t.port) == port), "?")
            findings.append(
                Finding(name, "network", Status.FAIL, f"could not listen on port {port} ({task}) to test it: {err}")
            )
        failures += mine
        untested = [f"{t.port} ({t.name})" for t in placement.on_host(name) if (name, t.port) in net.taken]
        if untested:
            findings.append(
                Finding(name, "network", Status.SKIP, f"not tested: {', '.join(untested)}, taken by another process")
            )
        if not mine and not r.listen_errors:
            n = len(req.dial)
            findings.append(
                Finding(
                    name,
                    "network",
                    Status.PASS,
                    f"reached {n} address{'es' if n != 1 else ''}; listened on {len(req.listen)} port"
                    f"{'s' if len(req.listen) != 1 else ''} ({r.seconds:.2f} s)",
                )
            )
    return findings, failures


# --------------------------------------------------------------------------- `provision check`


@dataclass
class CheckResult:
    job: str
    plan: Plan
    findings: list[Finding]
    failures: list[NetFailure] = field(default_factory=list)
    network: bool = False
    network_seconds: float | None = None
    skipped: list[str] = field(default_factory=list)

    @property
    def unreachable(self) -> list[str]:
        return [h.name for h in self.plan.unreachable]

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status is Status.FAIL]

    @property
    def warned(self) -> list[Finding]:
        return [f for f in self.findings if f.status is Status.WARN]

    @property
    def exit_code(self) -> int:
        if self.unreachable:
            return 3
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "job": self.job,
            "ok": not self.failed and not self.unreachable,
            "unreachable": self.unreachable,
            "hosts": {
                hp.name: {
                    "address": hp.target.where,
                    "error": hp.error.message if hp.error else None,
                    "unreachable": bool(hp.error and hp.error.unreachable),
                    "checks": [f.to_json() for f in self.findings if f.host == hp.name],
                }
                for hp in self.plan.hosts
            },
            "network": {
                "checked": self.network,
                "seconds": self.network_seconds,
                "failures": [f.to_json() for f in self.failures],
                "not_tried": self.skipped,
            },
            "failures": [f"{f.host}: {f.detail}" if f.check != "network" else f.detail for f in self.failed],
            "warnings": [f"{f.host}: {f.detail}" for f in self.warned],
        }


def run_check(
    ctx: Context, *, skip_network: bool = False, progress: Callable[[str], None] = lambda s: None
) -> CheckResult:
    """plan's round trip with the checks (failures of the plan itself shown too), then the
    network's, unless skipped or no host answered."""
    from .engine import build_plan
    from .ssh import call_agent
    from .steps import Step, run_step

    timings: dict[str, tuple[float, float]] = {}
    p = build_plan(ctx, checks=True, thorough=True, timings=timings)
    findings = judge(ctx.inventory, p, timings)
    covered = {(f.host, f.detail) for f in findings}
    for hp in p.hosts:
        for problem in hp.problems:
            if (hp.name, problem) not in covered:
                findings.append(Finding(hp.name, "plan", Status.FAIL, problem))
    res = CheckResult(ctx.inventory.job, p, findings)
    if skip_network:
        res.findings = _ordered(res.findings, p)
        return res
    net = network_plan(ctx.inventory, p, ctx.rendered.placement)
    res.skipped = net.skipped
    if net.requests:
        timeout = max(r.window for r in net.requests.values()) + 60

        def one(t: Any) -> NetcheckReport:
            report: NetcheckReport = call_agent(ctx.session, t, net.requests[t.name], timeout=timeout)
            return report

        started = time.monotonic()
        got = run_step(ctx.session, Step.NETWORK, one, [ctx.targets[n] for n in net.requests])
        res.network, res.network_seconds = True, round(time.monotonic() - started, 3)
        results: dict[str, NetcheckReport | Exception] = {**got.ok, **got.errors}
        more, res.failures = network_findings(net, results, ctx.rendered.placement)
        res.findings += more
    res.findings = _ordered(res.findings, p)
    return res


def _ordered(findings: list[Finding], p: Plan) -> list[Finding]:
    rank = {c: i for i, c in enumerate(ORDER)}
    order = {hp.name: i for i, hp in enumerate(p.hosts)}
    return sorted(findings, key=lambda f: (order.get(f.host, 1 << 30), rank.get(f.check, len(ORDER))))


def table_rows(res: CheckResult) -> list[list[str]]:
    rows = [["HOST", "CHECK", "STATUS", "DETAIL"]]
    for f in res.findings:
        detail = f.detail
        if f.check == "network" and f.status is Status.FAIL and len(detail) > 100:
            detail = detail[:97] + "..."
        rows.append([f.host, f.check, f.status.value, detail])
    return rows


def summary(res: CheckResult) -> str:
    hosts = len(res.plan.hosts)
    fails, warns = len(res.failed), len(res.warned)
    parts = [f"{fails} failed" if fails else "all passed", f"{warns} warning{'s' if warns != 1 else ''}"]
    if res.unreachable:
        parts.append(f"{len(res.unreachable)} unreachable")
    net = "" if res.network else " (network not checked)"
    return f"check: {', '.join(parts)} on {hosts} host{'s' if hosts != 1 else ''}{net}."
