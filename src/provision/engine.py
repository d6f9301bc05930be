"""Plan, apply and destroy: the steps that need hosts, in order.

inventory → render (desired) → probe (one agent round trip per host: facts, checksums,
unit states) → plan (pure) → apply: write files everywhere, then start tasks phase by
phase (ps and reduction servers → chief and workers → evaluator), recording state after
every host. Only `ssh.py` talks to the network; this module decides what to ask.
"""

from __future__ import annotations

import base64
import copy
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import ProvisionError
from .facts import needed as needed_facts
from .inventory import load
from .model import Inventory
from .plan import HostPlan, Plan, make_plan, plan_host, task_phase
from .render import Rendered, manifest_bytes, manifest_path, render
from .probe import probe_host
from .ssh import HostError, KnownHosts, Session, Target, call_agent
from .state import State, StateLock, default_state_path

Progress = Callable[[str], None]


@dataclass
class Context:
    inventory: Inventory
    state: State
    session: Session
    targets: dict[str, Target]  # inventory hosts, plus hosts only the state remembers
    rendered: Rendered | None = None
    only: set[str] | None = None

    def close(self) -> None:
        self.session.close()


def secrets_from_env(inv: Inventory) -> dict[str, str]:
    missing = [k for k in inv.secret_env if k not in os.environ]
    if missing:
        raise ProvisionError(
            f"{inv.path.name}: secret_env: {', '.join(missing)} not set in this shell's environment "
            "(secret values are copied from here at apply time)"
        )
    return {k: os.environ[k] for k in inv.secret_env}


def open_context(
    inventory_path: str,
    *,
    state_path: str | None = None,
    only: tuple[str, ...] = (),
    parallelism: int | None = None,
    verbose: bool = False,
    render_secrets: bool = True,
) -> Context:
    inv = load(inventory_path)
    sp = Path(state_path) if state_path else default_state_path(Path(inventory_path), inv.job)
    state = State.load(sp, inv.job)
    known = KnownHosts(state.known_hosts_path)
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    for name, entry in state.hosts().items():
        if name not in targets and "address" in entry:
            targets[name] = Target(
                name, entry["address"], entry.get("port", 22), entry.get("user", "root"),
                entry.get("identity_file"), entry.get("jump_host"), entry.get("connect_timeout", 10.0),
                entry.get("host_key_policy", "accept-new"),
            )
    if only:
        unknown = [h for h in only if h not in targets]
        if unknown:
            raise ProvisionError(f"--target: no host named {', '.join(unknown)} in {inventory_path} or its state")
        targets = {k: v for k, v in targets.items() if k in only}
    secrets = secrets_from_env(inv) if render_secrets else None
    rendered = render(inv, previous=state.previous_placement(), secrets=secrets)
    session = Session(known, parallelism=parallelism, verbose=verbose)
    return Context(inv, state, session, targets, rendered, set(only) if only else None)


# --------------------------------------------------------------------------- probe + plan


def probe(ctx: Context, *, facts: bool | str = True, files: bool = True, only: set[str] | None = None,
          fast: bool = False) -> dict[str, dict | HostError]:
    """One round trip per host. facts: True (all), False, or "check": only those that plan
    checks against the inventory (facts.mismatches), which is much cheaper. fast: through
    the shell probe where it can answer (probe.py); its report lacks the host's clock."""
    rendered = ctx.rendered
    job = ctx.inventory.job
    hosts = {h.name: h for h in ctx.inventory.hosts}
    recorded = ctx.state.hosts()

    def one(t: Target) -> dict:
        bundle = rendered.hosts.get(t.name) if rendered else None
        req = {"op": "probe", "job": job, "facts": bool(facts), "files": files, "content_max": 256 * 1024}
        if facts == "check":
            req["facts_only"] = needed_facts(hosts.get(t.name))
        # What the state says was put there, besides what should be: the host's manifest
        # names it too, but the fast probe must name every path before it reads the manifest.
        entry = recorded.get(t.name, {})
        req["paths"] = sorted(entry.get("files", {}))
        req["units"] = sorted({x["unit"] for x in entry.get("tasks", {}).values() if x.get("unit")})
        if bundle is not None:
            req["want"] = {f.path: f.sha256 for f in bundle.files}
            req["units"] = sorted(set(req["units"]) | {u.unit for u in bundle.tasks})
        if fast:
            return probe_host(ctx.session, t, req)
        return call_agent(ctx.session, t, req, timeout=120)

    return ctx.session.map(one, [t for n, t in ctx.targets.items() if only is None or n in only])


def build_plan(ctx: Context, *, replace: set[str] | None = None, facts: bool = True) -> Plan:
    assert ctx.rendered is not None
    if replace:
        names = {t.name for t in ctx.rendered.placement.tasks}
        unknown = sorted(replace - names)
        if unknown:
            raise ProvisionError(f"--replace: no task named {', '.join(unknown)} (tasks: {', '.join(sorted(names))})")
    reports = probe(ctx, facts="check" if facts else False, fast=True)
    return make_plan(ctx.rendered, ctx.targets, reports, replace=replace)


# --------------------------------------------------------------------------- apply


@dataclass
class HostOutcome:
    name: str
    error: str | None = None
    unreachable: bool = False
    started: list[str] = field(default_factory=list)
    failed_tasks: list[str] = field(default_factory=list)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _manifests(hp: HostPlan) -> tuple[bytes, bytes, bytes]:
    """(pending, interim, final) manifests for a host being changed.

    pending: old ∪ new files and tasks, written before anything else, so whatever a kill
    leaves behind is listed. interim: the new manifest, but tasks still to (re)start keep
    'pending' inputs until they run with the new ones. final: the new manifest.
    """
    assert hp.bundle is not None
    final = hp.bundle.manifest
    restart = {t.task for t in hp.tasks if t.action in ("start", "restart")}
    interim = copy.deepcopy(final)
    for name in restart:
        interim["tasks"][name]["inputs"] = "pending"
    pending = copy.deepcopy(interim)
    old = (hp.report or {}).get("manifest")
    if isinstance(old, dict) and "_unreadable" not in old:
        for path, rec in old.get("files", {}).items():
            pending["files"].setdefault(path, rec)
        for name, rec in old.get("tasks", {}).items():
            pending["tasks"].setdefault(name, {**rec, "inputs": "pending"})
    return manifest_bytes(pending), manifest_bytes(interim), manifest_bytes(final)


def _state_entry(t: Target, hp: HostPlan) -> dict:
    assert hp.bundle is not None
    return {
        "address": t.address, "port": t.port, "user": t.user, "identity_file": t.identity_file,
        "jump_host": t.jump_host, "connect_timeout": t.connect_timeout, "host_key_policy": t.host_key_policy,
        "files": {f.path: f.sha256 for f in hp.bundle.files},
        "tasks": {u.task.name: {"unit": u.unit, "inputs": u.inputs, "phase": u.phase} for u in hp.bundle.tasks},
    }


def _never_loaded(state: dict | None) -> bool:
    """systemd knows nothing of the unit: no file was loaded and nothing runs under it."""
    return bool(state) and state.get("LoadState") == "not-found" and state.get("ActiveState") == "inactive" \
        and state.get("SubState", "dead") == "dead"


def _unit_ok(state: dict, exits: list | None) -> bool:
    return task_phase(state, exits) in ("running", "completed")


def apply_plan(ctx: Context, plan: Plan, progress: Progress = lambda s: None) -> dict[str, HostOutcome]:
    """Make it so. Hosts with errors in the plan are left alone; the rest converge."""
    assert ctx.rendered is not None
    job = ctx.inventory.job
    outcomes: dict[str, HostOutcome] = {}
    work: dict[str, HostPlan] = {}
    for hp in plan.hosts:
        if hp.error is not None:
            outcomes[hp.name] = HostOutcome(hp.name, hp.error.message, hp.error.unreachable)
        elif hp.changed:
            work[hp.name] = hp
            outcomes[hp.name] = HostOutcome(hp.name)
    if not work:
        return outcomes
    # Growing pools must not move tasks: the placement is recorded before anything moves.
    placement = {n: {"host": s.host, "port": s.port, "accelerators": list(s.accelerators)} for n, s in ctx.rendered.placement.slots().items()}
    ctx.state.update(placement=placement)
    manifests = {n: _manifests(hp) for n, hp in work.items() if hp.bundle is not None}
    starts = {n: [t for t in hp.tasks if t.action in ("start", "restart")] for n, hp in work.items() if hp.bundle is not None}
    last_phase = {n: max((t.phase for t in ts), default=-1) for n, ts in starts.items()}
    lock = threading.Lock()

    def fail(name: str, message: str, unreachable: bool = False) -> None:
        with lock:
            o = outcomes[name]
            o.error = o.error or message
            o.unreachable = o.unreachable or unreachable

    def start_request(t: Target, phase: int) -> dict:
        units = [x.unit for x in starts[t.name] if x.phase == phase]
        # Units systemd had never loaded when probed (a first apply) have no failed state,
        # start counters or process to reset or stop: a plain start saves the host two
        # systemctl runs each (~7 ms apiece, mostly loading the binary).
        seen = (work[t.name].report or {}).get("units", {})
        unseen = [u for u in units if _never_loaded(seen.get(u))]
        rest = [u for u in units if u not in unseen]
        req = {"op": "units", "job": job, "actions": [["reset-failed", rest], ["restart", rest], ["start", unseen]],
               "report": units}
        if last_phase[t.name] == phase:
            req["manifest"] = _b64(manifests[t.name][2])
        return req

    def started(t: Target, phase: int, res: dict) -> None:
        movers = [x for x in starts[t.name] if x.phase == phase]
        bad = []
        for x in movers:
            st = res["units"].get(x.unit, {})
            if _unit_ok(st, res.get("exits", {}).get(x.unit)):
                outcomes[t.name].started.append(x.task)
            else:
                bad.append(f"{x.task} did not start ({st.get('Result', '?')}, exit {st.get('ExecMainStatus', '?')})")
                outcomes[t.name].failed_tasks.append(x.task)
        if res["errors"] or bad:
            raise HostError(t, "; ".join(res["errors"] + bad) + f"; see `provision logs {ctx.inventory.path.name} TASK`")
        progress(f"{t.name}: started {', '.join(x.task for x in movers)}")
        if last_phase[t.name] == phase:
            ctx.state.update(host=t.name, entry=_state_entry(t, work[t.name]))

    # The first phase to start needs nothing started before it: when nothing stops anywhere
    # (stops must finish on every host first), a host's tasks of that phase start in the
    # same round trip as its files are written, one agent call instead of two.
    first = min((x.phase for ts in starts.values() for x in ts), default=None)
    if any(hp.bundle is None or any(x.action == "stop" for x in hp.tasks) for hp in work.values()):
        first = None
    early: set[str] = set()

    # 1. Files, everywhere at once; tasks leaving the job are stopped first.
    def write(t: Target) -> None:
        hp = work[t.name]
        if hp.bundle is None:
            order = sorted((x for x in hp.tasks if x.action == "stop"), key=lambda x: -x.phase)
            res = call_agent(ctx.session, t, {"op": "destroy", "job": job, "stop": [x.unit for x in order]})
            if res["errors"]:
                raise HostError(t, "; ".join(res["errors"]))
            ctx.state.update(remove_host=t.name)
            progress(f"{t.name}: removed the job ({res['removed']} files)")
            return
        desired = hp.bundle.file_map()
        writes = [desired[f.path] for f in hp.files if f.action in ("create", "update") and f.kind != "manifest"]
        stops = [x.unit for x in sorted((x for x in hp.tasks if x.action == "stop"), key=lambda x: -x.phase)]
        pending, interim, final = manifests[t.name]
        # Unit files new to the host need no daemon-reload (a tenth of a second of the host's
        # CPU) where systemd loads them by itself (246+): the agent asks systemd and reloads
        # only if one is not loaded or is stale. Changed or removed unit files, and stops,
        # always reload.
        unit_changes = [f for f in hp.files if f.kind in ("unit", "target")]
        fresh = bool(unit_changes) and not stops and all(f.action == "create" and not f.drift for f in unit_changes)
        req = {
            "op": "write",
            "job": job,
            "manifest_pending": _b64(pending),
            "stop": stops,
            "files": [{"path": f.path, "mode": f.mode, "content": _b64(f.data())} for f in writes],
            "remove": [f.path for f in hp.files if f.action == "delete"],
            "daemon_reload": (hp.units_changed and not fresh) or bool(stops),
            "load_units": sorted(os.path.basename(f.path) for f in unit_changes) if fresh else [],
            "reset_failed": stops,
            "clear_lifecycle": bool(starts[t.name]),
            "manifest": _b64(final if last_phase[t.name] < 0 else interim),
        }
        go = first is not None and any(x.phase == first for x in starts[t.name])
        if go:
            both = call_agent(ctx.session, t, {"op": "batch", "requests": [req, start_request(t, first)]})["results"]
            res = both[0]
        else:
            res = call_agent(ctx.session, t, req)
        if res["errors"]:
            raise HostError(t, "; ".join(res["errors"]))
        progress(f"{t.name}: wrote {res['written']} files, removed {res['removed']}")
        if last_phase[t.name] < 0:
            ctx.state.update(host=t.name, entry=_state_entry(t, hp))
        if go:
            early.add(t.name)
            started(t, first, both[1])

    _run_step(ctx, work, write, fail)

    # 2. Tasks, phase by phase across all hosts.
    for phase in (0, 1, 2):
        movers = {n: [x for x in ts if x.phase == phase] for n, ts in starts.items()}
        movers = {n: ts for n, ts in movers.items() if ts and outcomes[n].error is None and not (phase == first and n in early)}
        if not movers:
            continue

        def start(t: Target, phase=phase) -> None:
            started(t, phase, call_agent(ctx.session, t, start_request(t, phase)))

        _run_step(ctx, {n: work[n] for n in movers}, start, fail)
    return outcomes


def _run_step(ctx: Context, hosts: dict[str, HostPlan], fn, fail) -> None:
    results = ctx.session.map(lambda t: fn(t), [ctx.targets[n] for n in hosts])
    for name, r in results.items():
        if isinstance(r, HostError):
            fail(name, r.message, r.unreachable)


# --------------------------------------------------------------------------- destroy


def destroy_plan(ctx: Context) -> Plan:
    reports = probe(ctx, facts=False, fast=True)
    hosts = []
    for name, t in ctx.targets.items():
        hosts.append(plan_host(name, t, None, None, reports[name]))
    return Plan(ctx.inventory.job, hosts)


def destroy(ctx: Context, plan: Plan, progress: Progress = lambda s: None) -> dict[str, HostOutcome]:
    """Stop tasks in reverse start order across hosts, then remove every file."""
    job = ctx.inventory.job
    outcomes = {h.name: HostOutcome(h.name, h.error.message if h.error else None, bool(h.error and h.error.unreachable)) for h in plan.hosts}
    work = {h.name: h for h in plan.hosts if h.error is None and h.changed}
    for phase in (2, 1, 0):
        stoppers = {n: [x.unit for x in hp.tasks if x.action == "stop" and x.phase == phase] for n, hp in work.items()}
        stoppers = {n: u for n, u in stoppers.items() if u}
        if not stoppers:
            continue
        results = ctx.session.map(
            lambda t: call_agent(ctx.session, t, {"op": "units", "job": job, "actions": [["stop", stoppers[t.name]]]}),
            [ctx.targets[n] for n in stoppers],
        )
        for n, r in results.items():
            if isinstance(r, HostError):
                outcomes[n].error, outcomes[n].unreachable = r.message, r.unreachable

    def remove(t: Target) -> dict:
        res = call_agent(ctx.session, t, {"op": "destroy", "job": job})
        if res["errors"]:
            raise HostError(t, "; ".join(res["errors"]))
        ctx.state.update(remove_host=t.name)
        progress(f"{t.name}: removed {res['removed']} files")
        return res

    results = ctx.session.map(remove, [ctx.targets[n] for n in work if outcomes[n].error is None])
    for n, r in results.items():
        if isinstance(r, HostError):
            outcomes[n].error, outcomes[n].unreachable = r.message, r.unreachable
    # Hosts with nothing left are forgotten, so a second destroy is a clean no-op.
    for h in plan.hosts:
        if h.error is None and not h.changed:
            ctx.state.update(remove_host=h.name)
    return outcomes


def lock(ctx: Context, operation: str) -> StateLock:
    return StateLock(ctx.state.path, operation)
