"""Commands that need no network: validate, render, force-unlock (a PostgreSQL state's lock: its database)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from provision.core.errors import ProvisionError, ValidationError
from provision.core.model import Inventory
from provision.core.text import plural, printable
from provision.inventory.inventory import load
from provision.inventory.localcheck import identity_problems, job_file_hint, secret_problems
from provision.inventory.statebackend import backend_of
from provision.io.state import State, default_state_path, open_store
from provision.placement.tasks import Placement, Slot, place
from provision.render.files import render as do_render
from provision.render.files import write_tree


def _summary(inv: Inventory, placement: Placement) -> str:
    counts = ", ".join(f"{p.role} {p.replicas}" for p in inv.pools if p.replicas)
    accs = sum(len(t.accelerators) for t in placement.tasks)
    hosts = len({t.host.name for t in placement.tasks})
    return (
        f"job {inv.job}: {plural(len(placement.tasks), 'task')} ({counts}) on {hosts} of "
        f"{plural(len(inv.hosts), 'host')}, {plural(accs, 'accelerator')} placed"
    )


def _placement_table(placement: Placement) -> list[str]:
    rows = [("TASK", "HOST", "ADDRESS", "ACCELERATORS")]
    for t in placement.tasks:
        rows.append((t.name, t.host.name, t.address, ",".join(map(str, t.accelerators)) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _previous(inventory: str, inv: Inventory, state_path: str | None) -> dict[str, Slot] | None:
    """The placement apply would keep: tasks that exist stay where they are (a local state
    only: these commands reach nothing, a database included)."""

    if not backend_of(inv, inventory, state_path).local:
        return None
    sp = Path(state_path) if state_path else default_state_path(Path(inventory), inv.job)
    return State.load(sp, inv.job).previous_placement() if sp.exists() else None


@click.command()
@click.argument("inventory", type=click.Path())
@click.option("--placement", "show_placement", is_flag=True, help="Also print where every task goes.")
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False),
    help="State whose placement to keep (default: .provision/<job>.state.json beside the inventory, if there is one).",
)
def validate(inventory: str, show_placement: bool, state_path: str | None) -> None:
    """Check INVENTORY without touching the network.

    Reports every problem at once, one line each, as FILE:LINE: key.path: what is wrong.
    Then what this machine lacks to apply it (identity files, secret_env variables), as
    warnings. Exit 0 when the inventory is valid, 1 otherwise.
    """

    try:
        inv = load(inventory)
    except ValidationError as e:
        hint = job_file_hint(inventory)
        if hint is None:
            raise
        for line in [e.message, *e.details]:
            click.echo(f"Error: {line}", err=True)
        click.echo(f"Hint: {hint}", err=True)
        sys.exit(1)
    placement = place(inv, _previous(inventory, inv, state_path))
    click.echo(f"{inventory}: valid; {_summary(inv, placement)}")
    for w in identity_problems(inv, inventory) + secret_problems(inv, display=inventory):
        click.echo(click.style(f"Warning: {w}", fg="yellow"), err=True)
    if show_placement:
        for line in _placement_table(placement):
            click.echo(line)


@click.command()
@click.argument("inventory", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False), help="Directory to write into.")
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False),
    help="State whose placement to keep (default: .provision/<job>.state.json beside the inventory, if there is one).",
)
def render(inventory: str, out: str, state_path: str | None) -> None:
    """Write every file each host would get, as OUT/<host>/<absolute path>.

    No network. Values of secret_env are left out of the rendered env files (apply
    fills them in from the controller's environment).
    """

    inv = load(inventory)
    rendered = do_render(inv, previous=_previous(inventory, inv, state_path))
    try:
        count = write_tree(rendered, Path(out))
    except OSError as e:
        raise ProvisionError(f"{out}: cannot write: {e.strerror} ({e.filename})") from None
    click.echo(f"{inventory}: {_summary(inv, rendered.placement)}")
    for line in _placement_table(rendered.placement):
        click.echo(line)
    click.echo(f"Wrote {plural(count, 'file')} for {plural(len(rendered.hosts), 'host')} under {out}/")


@click.command("force-unlock")
@click.argument("inventory", type=click.Path())
@click.argument("lock_id")
@click.option("--state", "state_path", type=click.Path(), help="State file.")
def force_unlock(inventory: str, lock_id: str, state_path: str | None) -> None:
    """Remove a lock left by an apply that died on another machine (LOCK_ID from the error).

    With a PostgreSQL state, end the database session that holds it."""

    inv = load(inventory)
    backend = backend_of(inv, inventory, state_path)
    sp = Path(state_path) if state_path else default_state_path(Path(inventory), inv.job)
    store = open_store(backend, sp, inv.job)
    try:
        holder = store.force_unlock(lock_id)
    finally:
        store.close()
    click.echo(f"Removed the lock: {printable(holder.describe())}")
