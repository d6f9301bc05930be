"""`provision notify add|list|remove|test|smtp`: who is told what, by the service
(serve/notify.py), kept in the service's database (io/servicenotify.py): the embedded file
beside the local state, or the team's PostgreSQL. A webhook's URL is never printed in
full: its scheme and host (rules/notify.masked)."""

from __future__ import annotations

import json as _json
import os
import secrets
import socket
import sys
import time
from typing import Any

import click

from provision.cli.servecmd import STATE_OPTION, place_of
from provision.core.errors import ProvisionError
from provision.core.events import Kind, parse_kinds
from provision.core.notify import NOTIFY_FORMAT, Channel, Relay, Rule
from provision.core.text import printable
from provision.io.notifysend import Mailer
from provision.io.servicestore import ServiceStore
from provision.rules import notify
from provision.rules.tenancy import identity, owner_name_problem
from provision.serve.notify import RuleHandler, Sender, sample
from provision.serve.places import open_place

HERE = "this shell's environment: set it to test the rule as the service would send it"


@click.group("notify")
def notify_group() -> None:
    """Tell people what happened: rules that send events (a job ended, a GPU quarantined,
    a study's new best) to a chat webhook, a signed JSON webhook, or mail."""


def _url(flag: str, value: str) -> str:
    """A webhook's URL (`-`: one line from stdin, out of the shell's history), checked;
    the error never repeats it."""
    if value == "-":
        value = sys.stdin.readline().strip()
    why = notify.url_problem(value)
    if why:
        raise ProvisionError(f"{flag}: {why}")
    return value


def _channel(slack: str | None, webhook: str | None, email: str | None, secret_env: str | None) -> tuple[Channel, str]:
    given = [(c, v) for c, v in ((Channel.SLACK, slack), (Channel.WEBHOOK, webhook), (Channel.EMAIL, email)) if v]
    if len(given) != 1:
        raise ProvisionError("notify add: give one of --slack URL, --webhook URL or --email ADDRESS")
    channel, value = given[0]
    if secret_env is not None and channel is not Channel.WEBHOOK:
        raise ProvisionError("--secret-env goes with --webhook (the key its body is signed with)")
    if channel is Channel.EMAIL:
        if (why := notify.address_problem(value.strip())) is not None:
            raise ProvisionError(f"--email: {why}")
        return channel, value.strip()
    return channel, _url(f"--{channel.value}", value)


def _running_lacks(store: ServiceStore, name: str) -> str | None:
    """Words for a variable the running service lacks (None: it has it, or none runs)."""
    running = [s for s in store.services() if s.leader] or store.services()
    if running and name not in running[0].env_names:
        s = running[0]
        return f"the service on {s.host} (pid {s.pid}) has no {name} in its environment; start it with {name} set"
    return None


@notify_group.command("add")
@click.option("--owner", metavar="NAME", help="Only this owner's work (default: everyone's).")
@click.option("--job", "job", metavar="GLOB", help="Only jobs whose name matches (bert-*; default: every job).")
@click.option(
    "--events", "kinds", metavar="KINDS", help="Only these kinds, comma-separated (job.*; default: every kind)."
)
@click.option(
    "--slack", metavar="URL", help="A chat service's incoming webhook (Slack's {\"text\"}; `-`: read from stdin)."
)
@click.option("--webhook", metavar="URL", help="A JSON webhook: the event, signed with --secret-env (`-`: from stdin).")
@click.option("--secret-env", metavar="VAR", help="With --webhook: the service's variable holding the signing key.")
@click.option("--email", metavar="ADDRESS", help="Mail to this address through the relay (`notify smtp`).")
@STATE_OPTION
def add(
    owner: str | None,
    job: str | None,
    kinds: str | None,
    slack: str | None,
    webhook: str | None,
    secret_env: str | None,
    email: str | None,
    state: str | None,
) -> None:
    """Add a rule: these events go there, from now on."""
    channel, target = _channel(slack, webhook, email, secret_env)
    try:
        want = parse_kinds(kinds) if kinds is not None else ()
    except ValueError as e:
        known = ", ".join(k.value for k in Kind)
        raise ProvisionError(f"--events: {e.args[0]!r} is not an event kind (known: {known})") from None
    if kinds is not None and not want:
        raise ProvisionError("--events: no kind given (leave it out for every kind)")
    if owner is not None and (why := owner_name_problem(owner.strip())) is not None:
        raise ProvisionError(f"--owner: {why}")
    if job is not None and (why := notify.glob_problem(job)) is not None:
        raise ProvisionError(f"--job: {why}")
    if secret_env is not None and (why := notify.env_name_problem(secret_env)) is not None:
        raise ProvisionError(f"--secret-env: {why}")
    rule = Rule(
        secrets.token_hex(3), channel, target, (owner or "").strip(), job or "", want, secret_env or "",
        created_by=identity(socket.gethostname()),
    )  # fmt: skip
    store = open_place(place_of(state))
    try:
        if channel is Channel.EMAIL and store.relay() is None:
            raise ProvisionError(
                "--email: no SMTP relay is set: `provision notify smtp --host HOST --from ADDRESS` first"
            )
        lacks = _running_lacks(store, rule.secret_env) if rule.secret_env else None
        if lacks:
            raise ProvisionError(f"--secret-env {rule.secret_env}: {lacks}")
        rule = store.add_rule(rule)
        alive = bool(store.services())
    finally:
        store.close()
    click.echo(printable(f"Added rule {rule.id}: {_what(rule)} to {_to(rule)}, from now on."))
    if channel is Channel.WEBHOOK and not rule.secret_env:
        click.echo("Note: unsigned (a receiver cannot tell it from a forgery): --secret-env VAR signs it.")
    if not alive:
        also = f"; start it with {rule.secret_env} set" if rule.secret_env else " (the events from now on wait for it)"
        click.echo(f"No service runs yet: `provision serve` delivers it{also}.")


def _what(r: Rule) -> str:
    kinds = ", ".join(k.value for k in r.kinds) if r.kinds else "every event"
    whose = f" of {r.owner}'s work" if r.owner else ""
    jobs = f" of jobs {r.job}" if r.job else ""
    return kinds + whose + jobs


def _to(r: Rule) -> str:
    if r.channel is Channel.EMAIL:
        return f"email {r.target}"
    signed = f", signed with ${r.secret_env}" if r.secret_env else ""
    return f"{r.channel.value} {notify.masked(r.target)}{signed}"


@notify_group.command("list")
@click.option("--json", "as_json", is_flag=True, help=f"As JSON (format_version {NOTIFY_FORMAT}).")
@STATE_OPTION
def list_cmd(as_json: bool, state: str | None) -> None:
    """Every rule (its URL as scheme and host only) and the SMTP relay."""
    store = open_place(place_of(state))
    try:
        rules, relay = store.rules(), store.relay()
        cursors = {r.id: store.cursor(r.cursor) for r in rules}
    finally:
        store.close()
    if as_json:
        doc: dict[str, Any] = {
            "format_version": NOTIFY_FORMAT,
            "rules": [_rule_json(r, cursors[r.id]) for r in rules],
            "smtp": _relay_json(relay),
        }
        click.echo(_json.dumps(doc, indent=1))
        return
    if not rules:
        click.echo("No rules yet: `provision notify add --slack URL` (or --webhook, --email) adds one.")
    else:
        click.echo(f"{'ID':<7} {'TO':<40} {'OWNER':<20} {'JOB':<16} {'BY':<20} EVENTS")
        for r in rules:
            kinds = ",".join(k.value for k in r.kinds) or "every kind"
            click.echo(
                printable(f"{r.id:<7} {_to(r):<40} {r.owner or '*':<20} {r.job or '*':<16} {r.created_by:<20} {kinds}")
            )
    if relay is not None:
        click.echo(printable(f"SMTP relay: {_relay_words(relay)}."))


def _rule_json(r: Rule, after: int | None) -> dict[str, Any]:
    return {
        "id": r.id, "channel": r.channel.value,
        "to": r.target if r.channel is Channel.EMAIL else notify.masked(r.target),
        "owner": r.owner or None, "job": r.job or None, "events": [k.value for k in r.kinds],
        "secret_env": r.secret_env or None, "created": r.created, "created_by": r.created_by, "delivered_after": after,
    }  # fmt: skip


def _relay_json(r: Relay | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "host": r.host,
        "port": r.port,
        "from": r.sender,
        "user": r.user or None,
        "password_env": r.password_env or None,
    }


def _relay_words(r: Relay) -> str:
    login = f" as {r.user} (password from ${r.password_env})" if r.user else " (no login)"
    return f"{r.host}:{r.port}{login}, from {r.sender}"


@notify_group.command("remove")
@click.argument("rule_id", metavar="ID")
@STATE_OPTION
def remove(rule_id: str, state: str | None) -> None:
    """Remove a rule: nothing more is sent for it."""
    store = open_place(place_of(state))
    try:
        gone = store.remove_rule(rule_id)
    finally:
        store.close()
    if not gone:
        raise ProvisionError(f"no rule {printable(rule_id)} (`provision notify list` shows them)")
    click.echo(f"Removed rule {rule_id}.")


@notify_group.command("test")
@click.argument("rule_id", metavar="ID")
@STATE_OPTION
def test(rule_id: str, state: str | None) -> None:
    """Send the rule one sample event now, from here (its key and the relay's password from
    this shell's environment); the answer in one line."""
    store = open_place(place_of(state))
    try:
        rule = store.rule(rule_id)
        if rule is None:
            raise ProvisionError(f"no rule {printable(rule_id)} (`provision notify list` shows them)")
        handler = RuleHandler(store, rule, None, _env(), Sender(), env_is=HERE)
        said = handler.test(sample(rule, identity(socket.gethostname()), time.time()))
    finally:
        store.close()
    click.echo(printable(f"Rule {rule.id}: a test event went to {_to(rule)}: {said}."))


def _env() -> dict[str, str]:
    """The rule's key and the relay's password, as this shell has them."""
    return dict(os.environ)


@notify_group.command("smtp")
@click.option("--host", required=True, metavar="HOST", help="The relay's host name.")
@click.option("--port", type=click.IntRange(1, 65535), default=587, show_default=True, help="465: TLS from the start.")
@click.option("--user", metavar="NAME", help="Log in as NAME (default: no login).")
@click.option("--password-env", metavar="VAR", help="With --user: the variable holding the password (never stored).")
@click.option("--from", "sender", required=True, metavar="ADDRESS", help="The From: address of the mail sent.")
@STATE_OPTION
def smtp(host: str, port: int, user: str | None, password_env: str | None, sender: str, state: str | None) -> None:
    """Set the SMTP relay mail goes through, after a login with the password from this
    shell's environment (STARTTLS where offered); the password is not stored."""
    host = host.strip()
    if not host or any(c.isspace() or not c.isprintable() for c in host) or len(host) > 253:
        raise ProvisionError("--host: a host name or address")
    if (why := notify.address_problem(sender.strip())) is not None:
        raise ProvisionError(f"--from: {why}")
    if bool(user) != bool(password_env):
        raise ProvisionError("--user and --password-env go together (the password is read from that variable)")
    if password_env is not None and (why := notify.env_name_problem(password_env)) is not None:
        raise ProvisionError(f"--password-env: {why}")
    if user is not None and (not user.strip() or not user.isprintable()):
        raise ProvisionError("--user: a login name")
    relay = Relay(host, port, sender.strip(), (user or "").strip(), password_env or "")
    password = _env().get(relay.password_env) if relay.user else None
    if relay.user and not password:
        raise ProvisionError(f"--password-env {relay.password_env}: not set here: set it to check the login")
    try:
        with Mailer(relay, password):
            pass
    except ProvisionError as e:
        raise ProvisionError(f"SMTP relay {host}:{port}: {e.message}; nothing stored") from None
    store = open_place(place_of(state))
    try:
        store.set_relay(relay)
        lacks = _running_lacks(store, relay.password_env) if relay.user else None
    finally:
        store.close()
    click.echo(printable(f"SMTP relay set: {_relay_words(relay)} (login checked)." if relay.user else
                         f"SMTP relay set: {_relay_words(relay)} (connection checked)."))  # fmt: skip
    if lacks:
        click.echo(printable(f"Note: {lacks}: until then no mail goes."))
