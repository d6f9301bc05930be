"""`provision events`: what happened, one event a line, as `kubectl get events` shows it;
read from the service's database (the embedded file, or a team's PostgreSQL)."""

from __future__ import annotations

import json
import time

import click

from provision.cli.servecmd import STATE_OPTION, place_of
from provision.core.errors import ProvisionError
from provision.core.events import EVENTS_FORMAT, Kind, Stored, parse_kinds
from provision.core.text import printable
from provision.io.servicestore import ServiceStore
from provision.rules.usage import since_seconds
from provision.serve.places import open_place

FOLLOW_EVERY = 1.0  # seconds between two looks with --follow
PAGE = 1000


@click.command("events")
@click.option("--since", default=None, metavar="AGE", help="Only what happened this recently: 1h, 30m, 7d.")
@click.option("--job", "job", metavar="NAME", help="Only this job's (or trial's, or study's) events.")
@click.option("--kind", "kinds", metavar="KINDS", help="Only these kinds, comma-separated (job.ended, gpu.*).")
@click.option("--follow", "-f", is_flag=True, help="Go on printing events as they happen (Ctrl-C stops).")
@click.option("--json", "as_json", is_flag=True, help="As JSON (format_version 1); with --follow, one event a line.")
@STATE_OPTION
def events(
    since: str | None, job: str | None, kinds: str | None, follow: bool, as_json: bool, state: str | None
) -> None:
    """What happened to jobs, trials, studies, submissions and hosts, oldest first."""
    try:
        want = parse_kinds(kinds) if kinds else ()
    except ValueError as e:
        known = ", ".join(k.value for k in Kind)
        raise ProvisionError(f"--kind: {e.args[0]!r} is not an event kind (known: {known})") from None
    store = open_place(place_of(state))
    try:
        try:
            cut = None if since is None else store.now() - since_seconds(since)
        except ValueError:
            raise ProvisionError(f"--since: expected an age such as 1h, 30m or 7d, got {since!r}") from None
        got = _all(store, 0, cut, job, want)
        if as_json and not follow:
            click.echo(json.dumps({"format_version": EVENTS_FORMAT, "events": [s.to_json() for s in got]}, indent=1))
            return
        for s in got:
            click.echo(_line(s, as_json))
        if not follow:
            if not got:
                click.echo("No events" + (f" of job {job}" if job else "") + (" in that time" if since else "") + ".")
            return
        after = got[-1].id if got else store.last_event_id()
        try:
            while True:
                time.sleep(FOLLOW_EVERY)
                for s in _all(store, after, None, job, want):
                    click.echo(_line(s, as_json))
                    after = s.id
        except KeyboardInterrupt:
            return
    finally:
        store.close()


def _all(
    store: ServiceStore, after: int, since: float | None, job: str | None, kinds: tuple[Kind, ...]
) -> list[Stored]:
    out: list[Stored] = []
    while True:
        got = store.events(after=after, since=since, job=job, kinds=kinds, limit=PAGE)
        out += got
        if len(got) < PAGE:
            return out
        after = got[-1].id


def _line(s: Stored, as_json: bool) -> str:
    if as_json:
        return json.dumps(s.to_json(), sort_keys=True)
    e = s.event
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.time))
    who = f" ({e.owner})" if e.owner else ""
    where = f" on {e.host}" if e.host and e.host not in e.words else ""
    return printable(f"{when}  {e.kind.value:<17} {e.words}{who}{where}")
