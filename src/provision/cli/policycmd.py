"""`provision policy show|set`: the team's priority classes and GPU guarantees,
kept in its PostgreSQL state (io/policystore.py). The local default state has none."""

from __future__ import annotations

import json as _json
import os
from typing import Any

import click

from provision.core.errors import ProvisionError
from provision.core.text import printable
from provision.inventory.statebackend import ENV, LOCAL, Backend, problem
from provision.rules import policyfile
from provision.rules.priority import Policy

POLICY_FORMAT = 1
_STATE_HELP = "The team's PostgreSQL URL (default: PROVISION_STATE, else the local state, which has no policy)."


def _backend(state: str | None) -> Backend:
    value = (state or os.environ.get(ENV, "").strip()) or LOCAL
    why = problem(value)
    if why:
        raise ProvisionError(f"{'--state' if state else ENV}: {why}")
    return Backend(value, "--state" if state else (ENV if value != LOCAL else "default"))


@click.group("policy")
def policy_group() -> None:
    """The team's priority classes and GPU guarantees per owner (or group), in its state backend."""


def _words(p: Policy) -> list[str]:
    groups: dict[str, list[str]] = {}
    for owner, group in p.groups:
        groups.setdefault(group, []).append(owner)
    guarantees = [f"{who} {n} GPU{'s' if n != 1 else ''}" + (f" ({', '.join(groups[who])})" if who in groups else "")
                  for who, n in p.guarantees]  # fmt: skip
    xids = ", ".join(f"{code} {cls.value}" for code, cls in p.health.xids)
    return [
        "Priority classes: " + ", ".join(f"{k} {v}" for k, v in p.classes),
        "Guarantees: " + (", ".join(guarantees) or "none (every GPU is shared first come, by priority)"),
        "Health: Xids "
        + (f"changed: {xids}" if xids else "as the default table (docs/health.md)")
        + (
            "; a quarantined GPU passes a test before it gets work"
            if p.health.test_before_release
            else "; a release needs no test"
        ),
        f"Dev sessions: priority {p.dev.priority}, {p.dev.hours:g} h, ended after {p.dev.idle_minutes} min "
        f"below {p.dev.idle_below} % GPU with nobody logged in",
    ]


@policy_group.command("show")
@click.option("--state", "state", metavar="URL", help=_STATE_HELP)
@click.option("--json", "as_json", is_flag=True, help=f"As JSON (format_version {POLICY_FORMAT}).")
def show(state: str | None, as_json: bool) -> None:
    """The policy in effect: its classes, guarantees and groups, who set it and when."""
    backend = _backend(state)
    if backend.local:
        p, is_set, at, by = Policy(), False, None, None
    else:
        # start-up time: psycopg loads only for a PostgreSQL state
        from provision.io import policystore

        store = policystore.open_team(backend)
        try:
            got = policystore.read(store)
        finally:
            store.close()
        p, is_set, at, by = got.policy, got.set, got.updated_at, got.updated_by
    if as_json:
        doc: dict[str, Any] = {"format_version": POLICY_FORMAT, "backend": backend.place, "set": is_set}
        doc |= policyfile.to_json(p) | {"updated_at": at, "updated_by": by}
        click.echo(_json.dumps(doc, indent=1))
        return
    if backend.local:
        click.echo(
            "The local state has no team policy: the defaults apply (a team keeps one in its PostgreSQL "
            "state: `state:` in the inventory, or PROVISION_STATE)."
        )
    elif not is_set:
        click.echo(f"No policy set in {backend.place} yet: the defaults apply (`provision policy set FILE`).")
    else:
        click.echo(printable(f"Policy of {backend.place}, set by {by} at {at}."))
    for line in _words(p):
        click.echo(printable(line))  # owners and groups: the team's database's


@policy_group.command("set")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--state", "state", metavar="URL", help=_STATE_HELP)
def set_cmd(file: str, state: str | None) -> None:
    """Replace the team's policy with FILE's (YAML: classes: {name: int}, guarantees:
    {owner-or-group: GPUs}, groups: {owner: group}, health: {xids: {N: fatal|program|warn|ignore},
    test_before_release: BOOL})."""
    backend = _backend(state)
    if backend.local:
        raise ProvisionError(
            "policy set: the local state has no team policy; point `state:` (or PROVISION_STATE, or --state) "
            "at the team's PostgreSQL"
        )
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ProvisionError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProvisionError(f"{file}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    # start-up time: psycopg loads only for a PostgreSQL state
    from provision.io import policystore

    store = policystore.open_team(backend)
    try:
        known = policystore.known_owners(store)
        p = policyfile.parse(text, file, known, policystore.KNOWN_FROM)
        policystore.write(store, p)
    finally:
        store.close()
    click.echo(f"Policy of {backend.place} set.")
    for line in _words(p):
        click.echo(line)
