"""`provision state show|history|migrate`: the job's state in its backend (the local file,
or a PostgreSQL database the team shares), who changed it when, and moving it between
backends. None of them reaches a host."""

from __future__ import annotations

import json as _json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from provision.core.errors import ProvisionError
from provision.core.model import Inventory
from provision.core.text import printable
from provision.inventory.inventory import load
from provision.inventory.statebackend import ENV, LOCAL, Backend, backend_of, chosen, problem
from provision.io.state import State, default_state_path, open_store
from provision.io.stateops import change_line, history_json, migrate, show_json, show_lines
from provision.io.statestore import Store
from provision.rules.tenancy import identity

F = TypeVar("F", bound=Callable[..., object])


def _state_option(fn: F) -> F:
    return click.option(
        "--state",
        "state_path",
        type=click.Path(dir_okay=False),
        help="The local state file (default: .provision/<job>.state.json beside the inventory).",
    )(fn)


@click.group("state")
def state_group() -> None:
    """The job's state in its backend: show it, its history, move it to another backend."""


def _open(inventory: str, state_path: str | None) -> tuple[Inventory, Store]:
    inv = load(inventory, files_here=False)  # the state, not the files the job pushes
    backend = backend_of(inv, inventory, state_path)
    sp = Path(state_path) if state_path else default_state_path(Path(inventory), inv.job)
    return inv, open_store(backend, sp, inv.job)


@state_group.command("show")
@click.argument("inventory", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the state as JSON.")
@_state_option
def show(inventory: str, as_json: bool, state_path: str | None) -> None:
    """Where the job's state is, its lineage and serial, its hosts, its lock and last change."""
    inv, store = _open(inventory, state_path)
    try:
        doc = show_json(store, State.load(store, inv.job))
    finally:
        store.close()
    if as_json:
        click.echo(_json.dumps(doc, indent=1))
    else:
        for line in show_lines(doc):
            click.echo(printable(line))  # its lock holder and last change: who ran them


@state_group.command("history")
@click.argument("inventory", type=click.Path())
@click.option("-n", "number", type=click.IntRange(1, 100000), default=10, show_default=True, help="How many changes.")
@click.option("--json", "as_json", is_flag=True, help="Print the changes as JSON.")
@_state_option
def history(inventory: str, number: int, as_json: bool, state_path: str | None) -> None:
    """The last changes made to the job through its state: who, when, which command, its summary line."""
    inv, store = _open(inventory, state_path)
    try:
        changes = store.history(number)
    finally:
        store.close()
    if as_json:
        click.echo(_json.dumps(history_json(store, inv.job, changes), indent=1))
        return
    if not changes:
        click.echo(f"No changes recorded for job {inv.job} in {store.where}.")
    for c in changes:
        click.echo(printable(change_line(c)))


@state_group.command("migrate")
@click.argument("inventory", type=click.Path())
@click.option("--to", "to", required=True, metavar="URL|local", help="Where to move the state.")
@_state_option
def migrate_cmd(inventory: str, to: str, state_path: str | None) -> None:
    """Move the job's state to another backend, keeping its lineage and serial."""
    inv = load(inventory)
    why = problem(to)
    if why:
        raise ProvisionError(f"--to: {why}")
    source_backend = chosen(inv.state, inventory)
    target_backend = Backend(to, "--to")
    if source_backend.place == target_backend.place:
        raise ProvisionError(
            f"job {inv.job}'s state is in {source_backend.place} already (from {source_backend.source})"
        )
    sp = Path(state_path) if state_path else default_state_path(Path(inventory), inv.job)
    source = open_store(source_backend, sp, inv.job)
    try:
        target = open_store(target_backend, sp, inv.job)
        try:
            lineage, serial = migrate(source, target, identity(socket.gethostname()))
        finally:
            target.close()
    finally:
        source.close()
    click.echo(
        f"Moved job {inv.job}'s state (lineage {lineage}, serial {serial}) from {source.where} to {target.where}."
    )
    click.echo(
        f"The old one is retired: a command that uses it says where the state went. {_switch(inventory, inv.state, source_backend, to)}"
    )


def _switch(inventory: str, in_file: str, source: Backend, to: str) -> str:
    """How the user points the job at its new backend."""
    if to == LOCAL:
        steps = []
        if in_file != LOCAL:
            steps.append(f"remove `state:` from {inventory} (or set it to local)")
        if source.source == ENV:
            steps.append(f"unset {ENV}")
        return "Now " + " and ".join(steps or ["nothing more is needed"]) + "."
    how = f"set `state: {to}` in {inventory} (the team's checkouts then all use it)"
    if source.source == ENV:
        return f"Now export {ENV}={to}, or {how} and unset {ENV}."
    return f"Now {how}, or export {ENV}={to}."
