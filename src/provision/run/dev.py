"""`provision dev`: a dev session, a job of its own on the team inventory's hosts
(inventory/devsession.py), applied as `apply` applies a job (plan: the ledger's
compare-and-set; apply), then waited for until its sshd answers, and written into the
user's ssh config (io/sshconfig.py). Also its list, its extension and its stop.

Bad input ends before anything is left reserved: a session that does not fit, a NAME of
one of the user's sessions that runs, a policy whose dev priority is no class of it; a
session that started but cannot serve (its sshd did not answer, `--jupyter` on a host
without JupyterLab) is destroyed again before its one line is said.

A session's spec (its GPUs, image, JupyterLab) is kept beside its state
(`.provision/dev/NAME.json`), so `--extend` and `--stop` open the same job again.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provision.core import devsession as dv
from provision.core.errors import ProvisionError
from provision.core.model import Inventory
from provision.core.target import HostError, Target
from provision.host import devsession as hostdev
from provision.host import layout
from provision.host.protocol import DevReport, DevRequest
from provision.inventory.devsession import TASK, SessionSpec, program_dest, program_text, session_inventory
from provision.inventory.inventory import load
from provision.io import images
from provision.io.hostkeys import key_id
from provision.io.ssh import call_agent
from provision.io.sshconfig import SshConfig, SshConfigError
from provision.io.state import default_state_path
from provision.placement.tasks import PlacementError
from provision.rules.priority import Policy, PriorityError, level
from provision.rules.rounds import Round
from provision.rules.tenancy import identity
from provision.run.apply import apply_plan
from provision.run.context import Ask, Context, open_context, probe
from provision.run.destroy import destroy, destroy_plan
from provision.run.jobend import look
from provision.run.planning import build_plan
from provision.run.survey import survey

Progress = Callable[[str], None]
READY_WITHIN = 15  # seconds a new session has to answer (host/devsession.READY_WAIT)
JUPYTER_WITHIN = 75  # ... with JupyterLab starting too


@dataclass(frozen=True)
class Started:
    name: str
    job: str
    host: str
    port: int
    gpus: tuple[int, ...]
    until: float
    jupyter: Mapping[str, Any] | None = None  # {"port", "token"}
    by_hand: str = ""  # the ssh config could not be written: why, and how to connect without it


def owner_here() -> str:
    return identity(socket.gethostname())


def _dev_dir(inventory: str) -> Path:
    return default_state_path(Path(inventory), "x").parent / "dev"


def _spec_path(inventory: str, name: str) -> Path:
    return _dev_dir(inventory) / f"{name}.json"


def _program(inventory: str) -> Path:
    """The session's program, written beside the state (the file `files:` pushes)."""
    text = program_text()
    path = _dev_dir(inventory) / Path(program_dest(text)).name
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def _check_name(name: str) -> None:
    why = dv.name_problem(name)
    if why:
        raise ProvisionError(f"--name: {why}")


def session_context(
    inventory: str, team: Inventory, spec: SessionSpec, *, operation: str | None, state_path: str | None = None
) -> Context:
    """The session's Context: its job on the team's hosts, at the policy's dev priority."""
    inv = session_inventory(team, spec, _program(inventory))
    try:
        ctx = open_context(inventory, loaded=inv, state_path=state_path, operation=operation, render_secrets=False)
    except PlacementError as e:  # no host has that many GPUs at all
        has = e.reason.partition("free on eligible hosts: ")[2] or "none"
        s = "s" if spec.gpus != 1 else ""
        raise ProvisionError(
            f"--gpus {spec.gpus}: no host has {spec.gpus} GPU{s} (they have: {has}); nothing was reserved"
        ) from None
    try:
        prio = spec.priority if spec.priority != "" else ctx.policy.dev.priority
        level(prio, ctx.policy)
    except PriorityError as e:
        ctx.close()
        raise ProvisionError(
            f"the team policy's dev priority: {e.message} (`provision policy set`: dev.priority)"
        ) from None
    ctx.inventory = dataclasses.replace(ctx.inventory, scheduling=dataclasses.replace(inv.scheduling, priority=prio))
    return ctx


def terms(spec: SessionSpec, policy: Policy, hours: float | None, now: float) -> dv.DevTerms:
    h = policy.dev.hours if hours is None else hours
    return dv.DevTerms(
        spec.name, spec.owner, now, now + h * 3600, policy.dev.idle_minutes * 60, policy.dev.idle_below,
        spec.user, spec.image, spec.jupyter,
    )  # fmt: skip


def _free_line(e: PlacementError, gpus: int) -> str:
    free = e.reason.partition("free on eligible hosts: ")[2] or "none"
    return (
        f"--gpus {gpus}: no host has {gpus} GPU{'s' if gpus != 1 else ''} free (free now: {free}); nothing was reserved"
    )


def _taken(ctx: Context, name: str) -> bool:
    """Does the user's session NAME run (or is it being started)? An ended one is started again."""
    if not ctx.state.hosts:
        return False
    st, _ = look(ctx, util=False)
    return any(t.state.live for t in st.tasks)


def start(
    inventory: str,
    *,
    gpus: int,
    name: str | None,
    hours: float | None,
    image: str = "",
    jupyter: bool = False,
    state_path: str | None = None,
    home: Path | None = None,
    progress: Progress = lambda s: None,
) -> Started:
    """A new session: planned and applied like a job, waited for, written into ssh config."""
    owner = owner_here()
    name = name or dv.default_name(owner)
    _check_name(name)
    if hours is not None and not 0 < hours <= dv.MAX_HOURS:
        raise ProvisionError(f"--hours: expected more than 0 and at most {dv.MAX_HOURS:g}, got {hours:g}")
    team = load(inventory, files_here=False)  # the team job's files are not the session's
    users = {h.ssh.user for h in team.hosts}
    user = next(iter(users)) or "" if len(users) == 1 else ""  # the session's sshd lets only them in
    spec = SessionSpec(dv.session_job(owner, name), name, owner, gpus, "", user, image, jupyter)
    ctx = session_context(inventory, team, spec, operation="apply", state_path=state_path)
    try:
        if _taken(ctx, name):
            raise ProvisionError(
                f"--name {name}: your session {name} already runs (`provision dev {inventory} --list`; "
                f"`--stop {name}` ends it, or give another --name)"
            )
        ctx.dev = terms(spec, ctx.policy, hours, time.time())
        return _start(ctx, inventory, spec, home, progress)
    finally:
        ctx.close()


def _start(ctx: Context, inventory: str, spec: SessionSpec, home: Path | None, progress: Progress) -> Started:
    try:
        plan = build_plan(ctx, rerun=bool(ctx.state.hosts), checks=True)
    except PlacementError as e:
        raise ProvisionError(_free_line(e, spec.gpus)) from None
    if plan.problems:
        raise ProvisionError(plan.problems[0] + " (nothing was reserved)", details=plan.problems[1:])
    task = next(t for t in ctx.rendered.placement.tasks if t.name == TASK)
    target = ctx.targets[task.host.name]
    if spec.image:
        _image(ctx, spec.image, task.host.name, progress)
    outcomes = apply_plan(ctx, plan, progress)
    failed = next((o for o in outcomes.values() if o.error or o.failed_tasks), None)
    if failed is not None:
        _undo(ctx)
        raise ProvisionError(
            f"{failed.name}: {failed.error or 'the session did not start'} (nothing was left reserved)"
        )
    ready = _wait_ready(ctx, target, JUPYTER_WITHIN if spec.jupyter else READY_WITHIN)
    jup = ready.get("jupyter") if isinstance(ready.get("jupyter"), dict) else None
    if spec.jupyter and (jup is None or "error" in jup):
        _undo(ctx)
        why = jup.get("error") if jup else "JupyterLab did not start"
        raise ProvisionError(f"--jupyter on {task.host.name}: {why}; nothing was left reserved")
    _keep_spec(inventory, spec)
    assert ctx.dev is not None
    started = Started(spec.name, spec.job, task.host.name, task.port, tuple(task.accelerators), ctx.dev.until, jup)
    try:
        SshConfig(home).put(spec.name, spec.job, target, task.port, ctx.session.known)
    except SshConfigError as e:
        hand = by_hand(target, task.port, ctx.state.known_hosts_path)
        return dataclasses.replace(started, by_hand=f"{e.message}; {hand}")
    return started


def _image(ctx: Context, image: str, host: str, progress: Progress) -> None:
    """The image on the session's host before it starts: shipped from here or pulled, as a
    container pool's (io/images.py)."""
    pool = dataclasses.replace(ctx.inventory.pools[0], image=image)
    inv = dataclasses.replace(ctx.inventory, pools=(pool,))
    changes, errors = images.plan_images(ctx.session, inv, {host: [pool.role]}, ctx.targets)
    if errors:
        raise ProvisionError(f"--image {image}: {next(iter(errors.values())).message} (nothing was reserved)")
    if changes:
        res = images.ship(ctx.session, changes, ctx.targets, progress)
        if res.errors:
            raise ProvisionError(f"--image: {next(iter(res.errors.values())).message} (nothing was reserved)")


def _wait_ready(ctx: Context, target: Target, within: int) -> dict[str, Any]:
    """What the session says once its sshd answers (host/devsession.ready_path), waited for
    on the host in one round trip; a session that fails instead is destroyed, in one line."""
    job = ctx.inventory.job
    unit = layout.unit_name(job, TASK)
    path = hostdev.ready_path(job)
    script = (
        f"i=0; while [ $i -lt {within * 10} ]; do if [ -s {path} ]; then cat {path}; exit 0; fi; "
        f"if ! systemctl is-active -q {unit}; then journalctl -u {unit} -n 3 -o cat --no-pager; exit 3; fi; "
        "sleep 0.1; i=$((i+1)); done; exit 4"
    )
    r = ctx.session.run(target, f"sh -c {shlex.quote(script)}", timeout=within + 30)
    out = r.stdout.decode("utf-8", "replace").strip()
    if r.exit_status == 0:
        try:
            got = json.loads(out)
            if isinstance(got, dict):
                return got
        except ValueError:
            pass
    _undo(ctx)
    last = out.splitlines()[-1] if out else f"it did not answer within {within} s"
    raise ProvisionError(f"{target.name}: the session did not start: {last[:300]} (nothing was left reserved)")


def _undo(ctx: Context) -> None:
    """The session destroyed again (a refusal leaves nothing reserved)."""
    try:
        destroy(ctx, destroy_plan(ctx))
    except (ProvisionError, HostError):
        pass


def _keep_spec(inventory: str, spec: SessionSpec) -> None:
    path = _spec_path(inventory, spec.name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(spec)))


def _spec_of(inventory: str, name: str, owner: str) -> SessionSpec:
    """The session's spec as `provision dev` kept it (a session started elsewhere: its job
    with one GPU; destroy and the ledger do not need more)."""
    try:
        d = json.loads(_spec_path(inventory, name).read_text())
        return SessionSpec(**{k: d[k] for k in (f.name for f in dataclasses.fields(SessionSpec))})
    except (OSError, ValueError, KeyError, TypeError):
        return SessionSpec(dv.session_job(owner, name), name, owner, 1, "")


def by_hand(target: Target, port: int, known: Path) -> str:
    """How to reach the session without the ssh config: one OpenSSH command line, checking
    the host's key against the one provision learnt (`known`, beside the state)."""
    keys = ["-o", f"UserKnownHostsFile={known}", "-o", f"HostKeyAlias={key_id(target.address, target.port or 22)}"]
    hop = ["ssh", "-W", "%h:%p", *keys]
    if target.port:
        hop += ["-p", str(target.port)]
    if target.identity_file:
        hop += ["-i", str(Path(target.identity_file).expanduser())]
    if target.jump_host:
        hop += ["-J", target.jump_host]
    hop.append(f"{target.user}@{target.address}" if target.user else target.address)
    words = ["ssh", "-o", "ProxyCommand=" + " ".join(hop), "-p", str(port), *keys]
    if target.identity_file:
        words += ["-i", str(Path(target.identity_file).expanduser())]
    words.append(f"{target.user}@127.0.0.1" if target.user else "127.0.0.1")
    return "connect with: " + " ".join(shlex.quote(w) for w in words)


# --------------------------------------------------------------------------- list, extend, stop


@dataclass(frozen=True)
class Listed:
    job: str
    name: str
    owner: str
    host: str
    gpus: tuple[int, ...]
    state: str  # the ledger's hold: running, ended, preempted, ...
    since: float | None
    until: float
    logins: tuple[str, ...]
    util: int | None  # the mean of its GPUs' utilization now
    mine: bool


@contextmanager
def _opened(ctx: Context) -> Iterator[Context]:
    yield ctx


def sessions(inventory: str) -> list[Listed]:
    """Every dev session on the inventory's hosts (one look at each), the user's marked."""
    team = load(inventory, files_here=False)
    ctx = open_context(inventory, loaded=team, render_secrets=False)
    try:
        r = survey({team.job: (inventory, team)}, lambda job, path: _opened(ctx))
    finally:
        ctx.close()
    return sessions_of(r, owner_here())


def sessions_of(r: Round, me: str) -> list[Listed]:
    out = []
    for name, hs in sorted(r.hosts.items()):
        seen = r.doc["hosts"].get(name)
        use = (seen.get("gpu_use") if seen is not None else None) or {}
        for h in hs.view.holders:
            if h.dev is None:
                continue
            utils = [x for g in h.gpus if (u := use.get(str(g))) and isinstance(x := u["utilization"], int)]
            logins = tuple(x for u in h.units for x in hs.logins.get(u, ()))
            util = round(sum(utils) / len(utils)) if utils else None
            state = f"preempted by {h.preempted_by}" if h.preempted_by else h.hold.value
            out.append(
                Listed(h.job, h.dev.name, h.who, name, h.gpus, state, h.since, h.dev.until, logins, util, h.who == me)
            )
    return out


def _session_ctx(inventory: str, name: str, operation: str) -> tuple[Context, SessionSpec]:
    _check_name(name)
    owner = owner_here()
    spec = _spec_of(inventory, name, owner)
    team = load(inventory, files_here=False)
    ctx = session_context(inventory, team, spec, operation=operation)
    if not ctx.state.hosts:
        ctx.close()
        raise ProvisionError(f"no session {name} of yours here (`provision dev {inventory} --list` lists them)")
    return ctx, spec


def extend(inventory: str, name: str, seconds: float) -> float:
    """The session's end moved `seconds` later (from its end, or from now if it is past):
    its new end."""
    ctx, _ = _session_ctx(inventory, name, "apply")
    try:
        seen = list(_terms_on_hosts(ctx).items())
        if not seen:
            raise ProvisionError(
                f"session {name} holds nothing on its hosts: it has ended (`--stop {name}` removes it)"
            )
        host, t = seen[0]
        until = max(t.until, time.time()) + seconds
        if until - t.started > dv.MAX_HOURS * 3600:
            raise ProvisionError(f"--extend: a session lasts at most {dv.MAX_HOURS:g} h")
        new = dataclasses.replace(t, until=until)
        for n, _ in seen:
            report: DevReport = call_agent(
                ctx.session, ctx.targets[n], DevRequest(ctx.inventory.job, new.to_json(), ctx.state.lineage)
            )
            if report.errors:
                raise ProvisionError(f"{n}: {report.errors[0]}")
        return until
    finally:
        ctx.close()


def _terms_on_hosts(ctx: Context) -> dict[str, dv.DevTerms]:
    """The session's terms as its hosts' ledgers hold them (those the state names)."""
    res = probe(ctx, Ask(tenancy=True, listening=False, files=False), fast=True, only=set(ctx.state.hosts))
    out = {}
    for n, rep in res.ok.items():
        entry = (rep.ledger or {}).get(ctx.inventory.job)
        got = dv.DevTerms.parse(entry.get("dev")) if isinstance(entry, dict) else None
        if got is not None:
            out[n] = got
    return out


def stop(inventory: str, name: str, home: Path | None = None, progress: Progress = lambda s: None) -> list[str]:
    """The session destroyed (its tasks, files, ledger entry, state) and its ssh config
    block taken away; the hosts it left."""
    ctx, _ = _session_ctx(inventory, name, "destroy")
    try:
        plan = destroy_plan(ctx)
        if plan.problems:
            raise ProvisionError(plan.problems[0])
        outcomes = destroy(ctx, plan, progress)
        held = [h.name for h in plan.hosts if h.changed]
    finally:
        ctx.close()
    bad = next((o for o in outcomes.values() if o.error), None)
    if bad is not None:
        raise ProvisionError(f"{bad.name}: {bad.error}", exit_code=3 if bad.unreachable else 1)
    try:
        SshConfig(home).remove(name)
    except SshConfigError:
        pass  # the session is gone; a stale block only fails to connect
    try:
        _spec_path(inventory, name).unlink()
    except FileNotFoundError:
        pass
    return sorted(held)
