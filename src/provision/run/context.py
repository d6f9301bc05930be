"""A command's view of one job, opened once: the inventory parsed, the state read (and locked
when hosts change), every host's files rendered, one SSH session. Every command below cli/
takes this Context; nothing re-opens the inventory. Also: what a probe asks (Ask).

inventory → render (desired) → probe (one round trip per host) → plan (rules/plan) →
apply (run/apply) / destroy (run/destroy). Only io/ssh.py talks to the network.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from provision.core.devsession import DevTerms
from provision.core.errors import ProvisionError
from provision.core.model import Host, Inventory
from provision.core.records import HostRecord, TaskRecord
from provision.core.target import Target
from provision.host import layout
from provision.host.protocol import (
    CHECK_FACTS,
    FileInfo,
    ProbeReport,
    ProbeRequest,
)
from provision.inventory.inventory import load
from provision.inventory.localcheck import identity_problems, secret_problems
from provision.inventory.statebackend import backend_of
from provision.io.hostkeys import KnownHosts
from provision.io.probe import probe_host
from provision.io.ssh import Session, call_agent
from provision.io.state import State, default_state_path, open_store, writable_dir
from provision.io.statestore import Lock
from provision.io.steps import GroupResult, Step, run_step
from provision.placement.tasks import set_aside
from provision.render.clusterenv import uses_socket_ifname
from provision.render.files import FileKind, HostBundle, Rendered, render
from provision.rules import preflight
from provision.rules.facts import needed as needed_facts
from provision.rules.health import health_fields
from provision.rules.priority import Policy, level
from provision.rules.programs import paths as program_paths
from provision.rules.progress import watched
from provision.rules.tenancy import Owner, Turn

Progress = Callable[[str], None]
Facts = Literal["none", "check", "all"]


@dataclass
class Context:
    inventory: Inventory
    state: State
    session: Session
    targets: dict[str, Target]  # inventory hosts, plus hosts only the state remembers
    rendered: Rendered
    where: str = ""  # the inventory's path as the user gave it (for messages)
    all_targets: dict[str, Target] = field(default_factory=dict)  # before --target
    lock: Lock | None = None
    subset: bool = False  # --target: only some of the hosts
    secrets: dict[str, str] | None = None
    take_over: bool = False  # --take-over: this state becomes the owner of the job
    # host → NCCL's and Gloo's interface that `rendered` was rendered with (checks.py).
    ifnames: dict[str, str] = field(default_factory=dict)
    own_session: bool = True  # False: another Context's (a study's trials share one); not closed here
    # When this work was submitted (the queue's order: the service gives its submission's
    # time), and the team's priority classes (the state backend's policy).
    submitted: float = field(default_factory=time.time)
    policy: Policy = field(default_factory=Policy)
    who: str = ""  # acting in another's name (the service recovering a handed-over job: its submitter)
    dev: DevTerms | None = None  # a dev session's terms (`provision dev`): into its reservation

    # Owner.here asks git for the user's email (a process): once per Context, not per host.
    _owner: tuple[tuple[str, Any], Owner] | None = field(default=None, repr=False, compare=False)
    _hosts: tuple[Inventory, dict[str, Host]] | None = field(default=None, repr=False, compare=False)

    @property
    def owner(self) -> Owner:
        key = (self.state.lineage, self.state.store.owner_ref)
        if self._owner is None or self._owner[0] != key:
            self._owner = (key, Owner.here(*key))
        me = self._owner[1]
        return dataclasses.replace(me, who=self.who) if self.who else me

    def host(self, name: str) -> Host | None:
        """The inventory's host of that name (a map, made once per inventory: per host
        lookups stay linear in the hosts)."""
        if self._hosts is None or self._hosts[0] is not self.inventory:
            self._hosts = (self.inventory, {h.name: h for h in self.inventory.hosts})
        return self._hosts[1].get(name)

    @property
    def turn(self) -> Turn:
        """The job's priority level, preemptibility and submission, as the ledger records
        them (a class the policy does not know: one line naming `priority:`)."""
        sched = self.inventory.scheduling
        return Turn(
            level(sched.priority, self.policy),
            sched.may_be_preempted(self.inventory.tf_config.trial is not None),
            self.submitted,
            self.dev,
        )

    def whole(self) -> Context:
        """The same job on every host, not only the --target ones (the same session: a
        part cannot tell whether the whole job ended)."""
        if not self.subset:
            return self
        return dataclasses.replace(self, targets=self.all_targets, subset=False, lock=None)

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def close(self) -> None:
        if self.own_session:
            self.session.close()
        self.release_lock()
        self.state.close()


def secrets_from_env(inv: Inventory, display: str | None = None) -> dict[str, str]:

    missing = secret_problems(inv, display=display or inv.path.name)
    if missing:
        raise ProvisionError(missing[0], details=missing[1:])
    return {k: os.environ[k] for k in inv.secret_env}


def target_of(name: str, rec: HostRecord) -> Target:
    return Target(
        name,
        rec.address,
        rec.port,
        rec.user,
        rec.identity_file,
        rec.jump_host,
        rec.connect_timeout,
        rec.host_key_policy,
    )


def open_context(
    inventory_path: str,
    *,
    state_path: str | None = None,
    only: tuple[str, ...] = (),
    parallelism: int | None = None,
    verbose: bool = False,
    render_secrets: bool = True,
    operation: str | None = None,
    loaded: Inventory | None = None,
    session: Session | None = None,
    take_over: bool = False,
    submitted: float | None = None,
    keep_session: bool = False,
    files_here: bool = True,
    who: str = "",
) -> Context:
    """Load (`loaded`: the job as given, as a study's trial's), lock (when `operation` changes
    hosts: before the state is read), read the state, render. `session`: connections shared
    (a study's trials'); `keep_session`: the caller keeps those made here; `take_over`: this
    state becomes the job's owner; `submitted`: when the work was handed over (default now);
    `files_here` False: a command that pushes nothing needs no `files:` source."""
    inv = loaded if loaded is not None else load(inventory_path, files_here=files_here)
    backend = backend_of(inv, inventory_path, state_path)
    sp = Path(state_path) if state_path else default_state_path(Path(inventory_path), inv.job)
    writable_dir(sp)  # the local state, or (with a database) the learnt host keys
    store = open_store(backend, sp, inv.job)
    try:
        lock = store.lock(operation).acquire() if operation else None
    except BaseException:
        store.close()
        raise
    try:
        state = State.load(sp if backend.local else store, inv.job)
        policy = Policy() if backend.local else _team_policy(store)
        targets = {h.name: Target.from_host(h) for h in inv.hosts}
        for name, rec in state.hosts.items():
            targets.setdefault(name, target_of(name, rec))
        everyone = dict(targets)
        if only:
            unknown = [h for h in only if h not in targets]
            if unknown:
                raise ProvisionError(f"--target: no host named {', '.join(unknown)} in {inventory_path} or its state")
            targets = {k: v for k, v in targets.items() if k in only}
        if not only:  # a missing key fails every connection: say so once, before any
            refuse_bad_keys(inv, inventory_path)
        inv = set_aside(inv, state.recovery.aside, state.recovery.gpu_map)  # what a recovery set aside for this job
        secrets, ifnames = secrets_from_env(inv, inventory_path) if render_secrets else None, cached_ifnames(inv, state)
        rendered = render(inv, previous=state.previous_placement(), secrets=secrets, socket_ifnames=ifnames)
    except BaseException:
        if lock is not None:
            lock.release()
        store.close()
        raise
    own = session is None and not keep_session
    session = session or Session(KnownHosts(state.known_hosts_path), parallelism=parallelism, verbose=verbose)
    return Context(
        inv, state, session, targets, rendered, inventory_path, everyone, lock, bool(only), secrets, take_over,
        ifnames=ifnames, own_session=own, submitted=submitted if submitted is not None else time.time(), policy=policy, who=who,
    )  # fmt: skip


def refuse_bad_keys(inv: Inventory, inventory_path: str) -> None:
    """One line when an identity file the hosts need is missing or unreadable here: every
    connection would fail (apply, tune and handing work over refuse it alike)."""
    bad_keys = identity_problems(inv, inventory_path)
    if bad_keys:
        raise ProvisionError(bad_keys[0], details=bad_keys[1:])


def _team_policy(store: object) -> Policy:
    """The team's priority classes: only a PostgreSQL state has a policy."""
    # Lazy: psycopg loads only for a PostgreSQL state (open_store's rule, ~40 ms of start-up).
    from provision.io import policystore
    from provision.io.pgstate import PgStore

    return policystore.read(store).policy if isinstance(store, PgStore) else Policy()


def cached_ifnames(inv: Inventory, state: State) -> dict[str, str]:
    """host → the interface the state last saw holding the host's cluster address (while
    the address is the same)."""
    out = {}
    for h in inv.hosts:
        rec = state.hosts.get(h.name)
        if rec is not None and rec.interface and rec.interface_address == h.cluster_address:
            out[h.name] = rec.interface
    return out


def settled(ctx: Context, name: str) -> bool:
    """The state says the host has exactly what is rendered for it now: the files, the
    tasks and their inputs, the interface. Plan then expects nothing to start there and
    leaves out what only matters before a start (pre-flight checks, listening ports, the
    interface lookup); if the host shows otherwise, it is asked again with them
    (build_plan). The same record host_record would write."""
    rec, bundle = ctx.state.hosts.get(name), ctx.rendered.hosts.get(name)
    if rec is None or bundle is None or rec.pending:
        return False
    if name not in ctx.ifnames and uses_socket_ifname(ctx.inventory):
        return False  # its interface is to be found yet
    return (rec.files, rec.tasks) == kept(ctx, bundle)


def kept(ctx: Context, bundle: HostBundle) -> tuple[dict[str, str], dict[str, TaskRecord]]:
    """What the state keeps of a host's bundle: each file's and task's inputs, keyed."""
    k = ctx.state.keyed
    files = {f.path: k(f.sha256) for f in bundle.files}
    return files, {u.task.name: TaskRecord(u.unit, k(u.inputs), u.phase) for u in bundle.tasks}


# --------------------------------------------------------------------------- probe + plan


@dataclass(frozen=True)
class Ask:
    """What a probe asks each host besides its files, units and records (ProbeRequest).
    facts: none, check (only what plan checks against the inventory, much cheaper) or all;
    tenancy: the ledger (and with `listening` the listening ports); checks: the pre-flight
    checks; interface: the cluster address's interface; clocks: the host's clocks (status);
    gpu_apps: with facts "check" on a GPU host, each GPU's compute processes and their
    systemd units too (the dashboard ties them to tasks), without the other checks;
    health: the health read too (rules/health.py: the GPUs' health fields, the kernel's
    Xids since the last look, DCGM's health watch, the file system of outputs:)."""

    facts: Facts = "none"
    files: bool = True
    tenancy: bool = False
    listening: bool = True
    checks: bool = False
    interface: bool = False
    clocks: bool = False
    gpu_apps: bool = False
    progress: bool = False  # what shows the job's progress on the host (rules/progress.watched)
    health: bool = False
    logins: bool = False  # who is logged in to the host's dev sessions

    def settled(self) -> Ask:
        """For a settled host: nothing that only matters before a start (engine.settled)."""
        return dataclasses.replace(self, listening=False, checks=False, interface=False)


def progress_paths(ctx: Context, name: str) -> list[str]:
    """What shows the job's progress on host `name` (its tasks placed there)."""
    tasks = [t.name for t in ctx.rendered.placement.on_host(name)]
    return [w.path for w in watched(ctx.inventory, tasks)]


def probe_request(ctx: Context, name: str, ask: Ask, more: Iterable[str] = ()) -> ProbeRequest:
    """`more`: paths whose modification time the probe reads besides (other jobs' progress
    on this host, as the service's survey asks)."""
    rec = ctx.state.hosts.get(name)
    bundle = ctx.rendered.hosts.get(name)
    host = ctx.host(name)
    fields: dict[str, Any] = (
        preflight.request_fields(
            ctx.inventory,
            host,
            bundle,
            needed_facts(host) if ask.facts == CHECK_FACTS else [],
            checks=ask.checks,
            interface=ask.interface,
        )
        if ask.checks or ask.interface
        else {}
    )
    if ask.gpu_apps and ask.facts == CHECK_FACTS and not ask.checks:
        fields |= _apps_only(host)
    if ask.health and host is not None:  # beside the other checks (rules/health.health_fields)
        fields["checks"] = health_fields(ctx.inventory, fields.get("checks"), preflight.GPU_TIMEOUT)
    units = set(rec.units()) if rec else set()
    # What the state says was put there, besides what should be: the host's manifest names
    # it too, but the shell probe must name every path before it reads the manifest.
    if bundle is not None:
        units |= {u.unit for u in bundle.tasks}
        if bundle.setup is not None and ask.clocks:  # status: a failed setup is why tasks wait
            units.add(bundle.setup.unit)
    return ProbeRequest(
        job=ctx.inventory.job,
        want={f.path: f.sha256 for f in bundle.files} if bundle else {},
        # ... and a setup's done mark, and a study's holds on its trials' (rules/sharing.py).
        paths=sorted(
            set(rec.files if rec else ())
            | ({bundle.setup.done_path} if bundle and bundle.setup else set())
            | ({layout.setup_hold_path(ctx.inventory.job)} if ctx.inventory.tune else set())
        ),
        # ... and each program a task about to start runs (programs.py: plan's warning).
        programs=program_paths(ctx.inventory, bundle, rec, ctx.state.keyed),
        units=sorted(units),
        files=ask.files,
        facts=ask.facts,
        facts_only=sorted(needed_facts(host)) if ask.facts == CHECK_FACTS and host else [],
        content_max=256 * 1024,
        tenancy=ask.tenancy,
        listening=ask.listening,
        clocks=ask.clocks,
        progress=sorted(set(progress_paths(ctx, name) if ask.progress else ()) | set(more)),
        logins=ask.logins,
        # Pre-flight checks, the cluster address's interface (checks.py), the health read.
        **fields,
    )


def _apps_only(host: Host | None) -> dict[str, Any]:
    """The probe's GPU check alone: one nvidia-smi run for the facts (with utilization) and,
    when a GPU has memory in use, one for its compute processes, each tied to its unit."""
    if host is None or "gpus" not in needed_facts(host):
        return {}
    return {"checks": {"gpus": True, "gpu_timeout": preflight.GPU_TIMEOUT}}


def probe(
    ctx: Context,
    ask: Ask = Ask(),
    *,
    fast: bool = False,
    only: set[str] | None = None,
    quiet: Iterable[str] = (),
    timings: dict[str, tuple[float, float]] | None = None,
    more: Mapping[str, Iterable[str]] | None = None,
) -> GroupResult[ProbeReport]:
    """One round trip per host. fast: through the shell probe where it can answer
    (probe.py); else the agent. quiet: hosts asked `ask.settled()`. `timings` gets when
    each host was asked and answered (checks.py: the clock check). `more`: host -> paths
    whose modification time it reads besides (probe_request)."""
    quiet = set(quiet)

    def one(t: Target) -> ProbeReport:
        req = probe_request(ctx, t.name, ask.settled() if t.name in quiet else ask, (more or {}).get(t.name, ()))
        asked = time.time()
        if fast:
            report = probe_host(ctx.session, t, req)
        else:
            report = call_agent(ctx.session, t, req, timeout=120)
        if timings is not None:
            timings[t.name] = (asked, time.time())
        return report

    targets = [t for n, t in ctx.targets.items() if only is None or n in only]
    return run_step(ctx.session, Step.PROBE, one, targets)


# --------------------------------------------------------------------------- apply


# --------------------------------------------------------------------------- destroy


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
