"""`provision serve`, `provision cancel`, `provision history`, and what `tune --detach` and
`apply --queue --detach` do (called from cli/tunecmd.py and cli/change.py): hand the work to
the service (docs/service.md)."""

from __future__ import annotations

import dataclasses
import json as _json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from provision.cli.serveparts import parts
from provision.cli.tuneview import pause_line
from provision.core.errors import EXIT_INTERRUPTED, ProvisionError
from provision.core.model import Inventory
from provision.core.submission import Kind, Options, Status
from provision.core.text import duration, printable
from provision.inventory.inventory import load
from provision.inventory.statebackend import backend_of
from provision.inventory.statebackend import problem as backend_problem
from provision.io.servicedb import default_db
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceRow, ServiceStore, Submission
from provision.io.state import default_state_path
from provision.rules.priority import level
from provision.rules.tenancy import identity, owner_name_problem
from provision.rules.usage import Use, gpu_hours, since_seconds
from provision.run.context import refuse_bad_keys
from provision.serve import install as unit
from provision.serve.hostsfile import HostsFile
from provision.serve.places import leadership, open_backend, open_place, work_root
from provision.serve.service import Service
from provision.serve.snapshot import snapshot_of, store_files
from provision.serve.source import DEFAULT_LISTEN, Listen, ServiceSource, choose_auth, parse_listen

HISTORY_FORMAT = 1


# --------------------------------------------------------------------------- handing over


def _other_places(store: ServiceStore) -> list[str]:
    """Services running elsewhere than this store (one line each), from the embedded file,
    where every service on this machine also says it runs."""
    try:
        local = ServiceStore.open_local(default_db()) if store.path is None else store
    except ProvisionError:
        return []
    places: dict[str, ServiceRow] = {}
    for s in sorted(local.services(everywhere=True), key=lambda s: not s.leader):  # one per place: its leader
        if s.place != store.place:
            places.setdefault(s.place, s)
    return [f"the service on {s.host} (pid {s.pid}) serves {s.place}" for s in places.values()]


def _secrets_line(inv: Inventory, store: ServiceStore) -> str | None:
    """Refuse (raise) a secret no running leader has; a line when no service runs yet."""
    running = [s for s in store.services() if s.leader] or store.services()
    if not inv.secret_env:
        return None
    if not running:
        names = ", ".join(inv.secret_env)
        return f"its secret_env ({names}) comes from the environment of the service that will run it: start it with them set"
    s = running[0]
    for name in inv.secret_env:
        if name not in s.env_names:
            raise ProvisionError(
                f"secret_env {name}: the service on {s.host} (pid {s.pid}) has no such variable; start it with the variable set"
            )
    return None


def detach(inventory: str, kind: Kind, *, state_path: str | None = None, options: Options | None = None) -> None:
    """Hand INVENTORY's study or queued apply to the service of its state backend; print how
    to follow it; return at once. Bad input ends here, before anything is stored."""
    inv = load(inventory)
    if kind is Kind.TUNE and inv.tune is None:
        raise ProvisionError(f"{inventory}: no tune: section, so no study to hand over (see docs/tuning.md)")
    backend = backend_of(inv, inventory, state_path)
    # start-up time: psycopg loads only for a PostgreSQL state (the embedded service needs none)
    from provision.io.policystore import policy_of

    policy = policy_of(backend)  # the store orders the queue by the level (a bad class: one line, here)
    level(inv.scheduling.priority, policy)
    refuse_bad_keys(inv, inventory)  # every connection would fail: `apply` and `tune` refuse it too
    opts = options or Options()
    if kind is Kind.TUNE:
        _refuse_ended_study(inventory, inv)
    elif opts.rerun:
        _refuse_rerun(inventory, state_path, opts)
    snap = snapshot_of(inv)
    store = open_backend(backend)
    try:
        secrets = _secrets_line(inv, store)
        busy = [s for s in store.submissions(unfinished=True, job=inv.job) if s.backend == backend.url]
        if busy:
            raise ProvisionError(
                f"job {inv.job} is already handed over ({busy[0].id}, {busy[0].status.value}, by {busy[0].owner}): "
                f"`provision cancel {inventory}` takes it back"
            )
        state = ""
        if backend.local:
            state = str(Path(state_path).resolve() if state_path else default_state_path(Path(inventory), inv.job))
        sid = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        sub = Submission(
            sid, kind, inv.job, identity(socket.gethostname()), backend.url, state, snap.inventory,
            store_files(store, snap),
            dataclasses.replace(opts, priority=level(inv.scheduling.priority, policy)),
        )  # fmt: skip
        sub = store.submit(sub)
        alive = store.services()
        elsewhere = _other_places(store) if not alive else []
    finally:
        store.close()
    where = str(store.path) if store.path is not None else backend.place
    what = "study" if kind is Kind.TUNE else "queued apply"
    click.echo(f"Handed over {what} of job {inv.job} as {sub.id} (in {where}).")
    if alive:
        lead = next((s for s in alive if s.leader), alive[0])
        click.echo(printable(f"The service on {lead.host} (pid {lead.pid}) runs it."))
    else:
        serve = "provision serve" + ("" if backend.local else f" --state {backend.place}")
        click.echo(f"No service runs on {where} yet: it waits for `{serve}`.")
        for line in elsewhere:
            click.echo(printable(f"Note: {line}, not {where}: the work goes to {where}."))
    if secrets:
        click.echo(f"Note: {secrets}.")
    follow = [f"provision tune {inventory}"] if kind is Kind.TUNE else []
    follow += [f"provision {c} {inventory}" for c in ("status", "logs -f", "cancel")]
    click.echo("Follow it: " + " · ".join(follow))


def _refuse_ended_study(inventory: str, inv: Inventory) -> None:
    """A study that ended has nothing to run: handed over, it would be done at once."""
    # start-up time: Optuna loads only for a study handed over
    from provision.run.tune import existing_study

    study = existing_study(inventory, inv)
    if study is None:
        return
    rows = study.rows()
    why = study.ended(len(rows))
    if why is not None:
        raise ProvisionError(
            f"{inventory}: the study of job {inv.job} has ended ({why}): nothing to hand over. "
            f"`provision tune --status {inventory}` shows its trials; more trials need a larger tune.max_trials"
        )


def _refuse_rerun(inventory: str, state_path: str | None, opts: Options) -> None:
    """`--rerun` of a job that has not finished (or never ran) is refused now, as the
    service's apply would refuse it later, with the same words (one look at its hosts)."""
    # start-up time: planning and SSH load only for a rerun handed over
    from provision.placement.tasks import PlacementError
    from provision.run.context import open_context
    from provision.run.planning import build_plan

    ctx = open_context(inventory, state_path=state_path, take_over=opts.take_over, render_secrets=False)
    try:
        plan = build_plan(ctx, rerun=True, checks=not opts.skip_checks)
    except PlacementError as e:
        if e.held:
            return  # it waits for room: the queue's to wait
        raise
    finally:
        ctx.close()
    rerun = [p for p in plan.problems if p.startswith("--rerun")]
    if rerun:
        raise ProvisionError(rerun[0])


def detach_study(inventory: str, *, seed: int | None, poll: float) -> None:
    detach(inventory, Kind.TUNE, options=Options(seed=seed, poll=poll))


def detach_apply(params: dict[str, Any]) -> None:
    """`apply --queue --detach` (apply's parameters): the flags that go with it are kept
    (--take-over, --rerun, --timeout, --skip-checks); the others are refused."""
    p = params
    if not p["queue"] or p["targets"] or p["wait_after"] or p["replace"] or p["partial"] or p["force_setup"]:
        raise ProvisionError("--detach goes with --queue (and --take-over, --rerun, --timeout, --skip-checks)")
    options = Options(
        take_over=bool(p["take_over"]),
        rerun=bool(p["rerun"]),
        timeout=float(p["timeout"]) if p["timeout"] is not None else None,
        skip_checks=bool(p["skip_checks"]),
    )
    detach(p["inventory"], Kind.APPLY, state_path=p["state_path"], options=options)


def follow_handed_over(
    inventory: str, inv: Inventory, study: Callable[[], Any], line: Callable[[Any, Any], str]
) -> int | None:
    """`provision tune INV` of a study a service holds: follow it (its exit code); None: no
    service holds it (the terminal runs it)."""
    found = handed_over(inventory, inv)
    if found is None:
        return None

    def rows() -> list[Any]:
        try:
            s = study()
        except ProvisionError:  # its storage is not made yet (the service's worker is starting): look again
            return []
        return list(s.rows()) if s is not None else []

    return follow_study(found[0], found[1], rows, lambda r: line(r, inv.tune))


def handed_over(inventory: str, inv: Inventory) -> tuple[ServiceStore, Submission] | None:
    """The unfinished submission of this job for this state, if a service holds one."""
    backend = backend_of(inv, inventory)
    if backend.local and not default_db().exists():
        return None
    store = open_backend(backend)
    state = str(default_state_path(Path(inventory), inv.job)) if backend.local else ""
    for s in store.submissions(unfinished=True, job=inv.job):
        if s.backend == backend.url and (not backend.local or s.state_path == state):
            return store, s
    store.close()
    return None


def follow_study(
    store: ServiceStore, sub: Submission, rows: Callable[[], list[Any]], line: Callable[[Any], str]
) -> int:
    """`provision tune INV` of a handed-over study: its trials as they go (read from the
    study's storage: no second runner) until it ends. Ctrl-C changes nothing."""
    click.echo(
        printable(f"The study is handed over ({sub.id}, by {sub.owner}): following it; Ctrl-C stops following only.")
    )
    seen: dict[int, str] = {}
    paused: set[int] = set()
    try:
        while True:
            for r in rows():
                key = r.state.value
                if seen.get(r.number) != key:
                    seen[r.number] = key
                    click.echo(line(r))
                if (said := pause_line(r, paused)) is not None:  # as a terminal that runs it says
                    click.echo(said)
            got = store.get(sub.id)
            if got is None or got.status.finished:
                why = f": {got.why}" if got and got.why else ""
                click.echo(printable(f"Submission {sub.id} {got.status.value if got else 'gone'}{why}."))
                return 0 if got is not None and got.status is Status.DONE else 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        click.echo("\nStopped following; the service goes on (`provision cancel INVENTORY` ends it).", err=True)
        return EXIT_INTERRUPTED
    finally:
        store.close()


# --------------------------------------------------------------------------- serve


def place_of(state: str | None) -> str:
    value = state or os.environ.get("PROVISION_STATE", "").strip() or "local"
    why = backend_problem(value)
    if why:
        raise ProvisionError(f"--state: {why}")
    return value


@click.group("serve", invoke_without_command=True)
@click.option(
    "--state", "state", metavar="URL", help="The team's PostgreSQL (default: PROVISION_STATE, else the embedded file)."
)
@click.option(
    "--poll", type=click.FloatRange(min=0.1, max=2.0), default=1.0, show_default=True, help="Seconds between looks."
)
@click.option(
    "--listen",
    default=DEFAULT_LISTEN,
    show_default=True,
    metavar="ADDR:PORT",
    help="Where the dashboard answers; none: no pages. Off loopback, tokens are needed.",
)
@click.option(
    "--inventory",
    "inventories",
    multiple=True,
    type=click.Path(),
    metavar="PATH",
    help="Also show this inventory's job on the dashboard (a job run from a terminal); repeatable.",
)
@click.option(
    "--hosts",
    "hosts_file",
    type=click.Path(),
    metavar="FILE",
    help="Also watch these hosts (an inventory's hosts: and ssh:), work on them or not: the Cluster page shows them.",
)
@click.option(
    "--trust-header", metavar="HEADER", help="Take the user from this proxy header (X-Forwarded-User); loopback only."
)
@click.option(
    "--public-url", metavar="URL", help="Where people reach the dashboard (behind a proxy): its host is answered too."
)
@click.option("--install", is_flag=True, help="Write, enable and start a systemd unit running this service (root).")
@click.option("--uninstall", is_flag=True, help="Stop, disable and remove the unit --install wrote (root).")
@click.option("--user", metavar="NAME", help="With --install: the user the service runs as (default: who ran sudo).")
@click.pass_context
def serve(
    ctx: click.Context,
    state: str | None,
    poll: float,
    listen: str,
    inventories: tuple[str, ...],
    hosts_file: str | None,
    trust_header: str | None,
    public_url: str | None,
    install: bool,
    uninstall: bool,
    user: str | None,
) -> None:
    """Run the service: drive the studies and queued applies handed to it (`--detach`),
    resume them after a restart, record history, and serve the dashboard. Two services on
    one PostgreSQL: one leads, the other takes over when it dies."""
    if ctx.invoked_subcommand is not None:
        return
    public = _public_url(public_url)
    if install or uninstall or user:
        # The unit runs the service with the same pages (an --inventory path made absolute).
        pages = ["--listen", listen, *(a for p in inventories for a in ("--inventory", str(Path(p).resolve())))]
        pages += ["--hosts", str(Path(hosts_file).resolve())] if hosts_file else []
        pages += ["--trust-header", trust_header] if trust_header else []
        _unit(state, poll, install, uninstall, user, pages + (["--public-url", public] if public else []))
        return
    _run(place_of(state), parse_listen(listen), inventories, trust_header, poll, public, hosts_file)


def _run(
    url: str,
    where: Listen | None,
    inventories: tuple[str, ...],
    trust_header: str | None,
    poll: float,
    public: str | None,
    hosts_file: str | None = None,
) -> None:
    """The service, its rounds, the event stream's subscribers and the pages, until stopped."""
    store = open_place(url)
    hosts = HostsFile(Path(hosts_file), work_root(store), _stamped) if hosts_file else None
    mirror = ServiceStore.open_local(default_db()) if store.path is None else None
    leading = threading.Event()
    side, keeping, rounds, deliveries, source = parts(url, store, inventories, hosts, public, leading, _stamped)
    try:
        stop_pages = _web(side, source, where, trust_header, public) if where is not None else None
    except BaseException:
        side.close()
        keeping.close()
        raise
    svc = Service(
        store, leadership(store, url), work_root(store), say=_stamped, url=url, poll=poll, mirror=mirror,
        rounds=rounds, leading=leading, public_url=public,
    )  # fmt: skip
    rounds.start()
    for d in deliveries:
        d.start()

    def stop(signum: int, frame: object) -> None:
        svc.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        svc.run()
    finally:
        rounds.stop()
        for d in deliveries:
            d.stop()
        if stop_pages is not None:
            stop_pages()
        source.close()
        side.close()
        keeping.close()
    click.echo("Stopped; handed-over work goes on with the next `provision serve`.")


def _public_url(text: str | None) -> str | None:
    """--public-url checked (http(s)://HOST[:PORT][/PATH]); ProvisionError in one line."""
    if text is None:
        return None
    from provision.web.guard import BadURL, public_origin  # (start-up: the web app loads only for pages)

    try:
        public_origin(text)
    except BadURL as e:
        raise ProvisionError(f"--public-url: {e}") from None
    return text.strip()


def _web(
    store: ServiceStore, source: ServiceSource, where: Listen, trust_header: str | None, public_url: str | None
) -> Callable[[], None]:
    """The dashboard in a thread of this process, answering as its address and `public_url`
    (serve/dashboard.py bounds its connections); returns what stops it."""
    # Lazy (start-up): uvicorn and the web app load only when pages are served.
    from provision.serve import dashboard
    from provision.web.app import make_app  # (start-up, as above)
    from provision.web.guard import Site  # (start-up, as above)

    auth = choose_auth(where, trust_header, store, bool(store.tokens()))
    try:
        family = socket.AF_INET6 if ":" in where.host else socket.AF_INET
        sock = socket.create_server((where.host, where.port), family=family)
    except OSError as e:
        raise ProvisionError(f"--listen {where.host}:{where.port}: {e.strerror}") from None
    port = sock.getsockname()[1]  # the one bound (--listen HOST:0 asks for any free one)
    site = Site.listening(where.host, port, public_url, names=[socket.gethostname()])
    stop = dashboard.start(
        make_app(source, auth=auth, site=site), sock, dashboard.Limits.for_descriptors(dashboard.soft_limit())
    )
    host = f"[{where.host}]" if ":" in where.host else where.host
    _stamped(f"Dashboard on http://{host}:{port}/ ({auth.mode.value})")
    return stop


def _unit(state: str | None, poll: float, install: bool, uninstall: bool, user: str | None, web: list[str]) -> None:
    """--install / --uninstall: the service as a systemd unit (serve/install.py)."""
    if install == uninstall:
        raise ProvisionError(
            "serve: give one of --install or --uninstall" + (" (--user goes with --install)" if user else "")
        )
    if uninstall and user:
        raise ProvisionError("serve: --user goes with --install, not --uninstall")
    args = [*(["--state", state] if state else []), "--poll", f"{poll:g}", *web]
    for line in unit.install(args, user) if install else unit.uninstall():
        click.echo(line)


def _stamped(line: str) -> None:
    click.echo(f"{time.strftime('%H:%M:%S')} {printable(line)}")  # it names submitters, hosts, their errors


@serve.group("token")
def token() -> None:
    """The dashboard's tokens (for pages served off loopback): stored hashed in the
    service's database."""


STATE_OPTION = click.option(
    "--state", "state", metavar="URL", help="The team's PostgreSQL (default: PROVISION_STATE, else the embedded file)."
)


@token.command("create")
@click.option("--owner", required=True, metavar="NAME", help="Whose token: the jobs they may act on are theirs.")
@click.option("--admin", is_flag=True, help="May act on every job.")
@STATE_OPTION
def token_create(owner: str, admin: bool, state: str | None) -> None:
    """Make a token and print it once (only its hash is kept)."""
    owner = owner.strip()
    if (why := owner_name_problem(owner)) is not None:
        raise ProvisionError(f"--owner: {why}")
    store = open_place(place_of(state))
    try:
        row, secret = store.create_token(owner, admin)
    finally:
        store.close()
    click.echo(secret)
    click.echo(
        f"Token {row.id} for {printable(row.owner)}{' (admin)' if row.admin else ''}: shown this once.", err=True
    )


@token.command("list")
@STATE_OPTION
def token_list(state: str | None) -> None:
    """Every token's id, owner, admin and when it was made (never the token)."""
    store = open_place(place_of(state))
    try:
        rows = store.tokens()
    finally:
        store.close()
    if not rows:
        click.echo("No tokens yet: `provision serve token create --owner NAME` makes one.")
        return
    click.echo(f"{'ID':<10} {'OWNER':<24} {'ADMIN':<5}  CREATED")
    for r in rows:
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
        click.echo(f"{printable(r.id):<10} {printable(r.owner):<24} {'yes' if r.admin else 'no':<5}  {made}")


@token.command("revoke")
@click.argument("token_id", metavar="ID")
@STATE_OPTION
def token_revoke(token_id: str, state: str | None) -> None:
    """Revoke a token: the next request with it is refused."""
    store = open_place(place_of(state))
    try:
        gone = store.revoke_token(token_id)
    finally:
        store.close()
    if not gone:
        raise ProvisionError(f"no token {token_id} (`provision serve token list` shows them)")
    click.echo(f"Revoked token {token_id}.")


# --------------------------------------------------------------------------- cancel


@click.command("cancel")
@click.argument("inventory", type=click.Path())
@click.option("--take-over", is_flag=True, help="Cancel work another owner handed over.")
def cancel(inventory: str, take_over: bool) -> None:
    """Take back handed-over work not started yet, or stop it (a study asks no more trials
    and its running trials are stopped)."""
    inv = load(inventory, files_here=False)  # the service holds its own copy of the files
    found = handed_over(inventory, inv)
    if found is None:
        raise ProvisionError(f"job {inv.job}: nothing handed over to a service is unfinished")
    store, sub = found
    try:
        me = identity(socket.gethostname())
        if sub.owner != me and not take_over:
            raise ProvisionError(f"{sub.id} is {sub.owner}'s: only they cancel it, or --take-over")
        got = store.cancel(sub.id, me)
        if got is Status.CANCELLED:
            click.echo(f"Took back {sub.id}: nothing of it ran.")
        elif got is Status.RUNNING:
            click.echo(f"Asked the service to stop {sub.id}; `provision status {inventory}` shows it end.")
        else:
            click.echo(f"{sub.id} had ended already.")
    finally:
        store.close()


# --------------------------------------------------------------------------- history


@click.command("history")
@click.option("--owner", help="Only this owner's runs, trials and waits.")
@click.option("--since", default=None, metavar="AGE", help="Only what ended this recently: 7d, 12h, 30m.")
@click.option("--json", "as_json", is_flag=True, help="As JSON (format_version 1).")
@click.option(
    "--state", "state", metavar="URL", help="The team's PostgreSQL (default: PROVISION_STATE, else the embedded file)."
)
def history(owner: str | None, since: str | None, as_json: bool, state: str | None) -> None:
    """Every run, trial and queue wait the service recorded (kept after destroy), and
    GPU-hours per owner."""
    store = open_place(place_of(state))
    try:
        now = store.now()
        try:
            cut = None if since is None else now - since_seconds(since)
        except ValueError:
            raise ProvisionError(f"--since: expected an age such as 7d, 12h or 30m, got {since!r}") from None
        events = store.history(owner=owner, since=cut)
    finally:
        store.close()
    hours = gpu_hours((Use(e.owner, e.kind, e.gpus, e.started, e.ended) for e in events), now, cut)
    if as_json:
        doc = {
            "format_version": HISTORY_FORMAT,
            "now": now,
            "events": [_event_json(e) for e in events],
            "gpu_hours": hours,
        }
        click.echo(_json.dumps(doc, indent=1))
        return
    if not events:
        click.echo("No history yet" + (f" for {owner}" if owner else "") + ".")
        return
    for e in events:
        click.echo(printable(_event_line(e, now)))
    click.echo("\nGPU-hours: " + printable(", ".join(f"{o} {h:.2f}" for o, h in hours.items()) or "none"))


def _event_json(e: HistoryRow) -> dict[str, Any]:
    return {
        "kind": e.kind, "job": e.job, "owner": e.owner, "started": e.started, "ended": e.ended, "how": e.how,
        "hosts": list(e.hosts), "gpus": e.gpus, "submission": e.submission,
    }  # fmt: skip


def _event_line(e: HistoryRow, now: float) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.started))
    took = duration(round((e.ended if e.ended is not None else now) - e.started))
    how = e.how or "still running"
    gpus = f" {e.gpus} GPU{'s' if e.gpus != 1 else ''}" if e.gpus else ""
    hosts = f" on {','.join(e.hosts)}" if e.hosts else ""
    return f"{when}  {e.kind:<6} {e.job}  {e.owner}{hosts}{gpus}  {took}  {how}"
