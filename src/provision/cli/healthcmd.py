"""`provision health`: every host's and GPU's health state (healthy, suspect, quarantined,
draining, testing) with its reason and evidence; `--report`, the hosts and GPUs ranked by
their incidents; `quarantine`, `release` and `test` by hand (run/health.py)."""

from __future__ import annotations

import json as _json
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import click

from provision.cli.common import open_ctx
from provision.cli.output import table
from provision.core.errors import ProvisionError
from provision.core.events import iso
from provision.core.text import printable
from provision.rules.health import HostHealth, Mark, State
from provision.rules.healthlog import Known, report_doc
from provision.rules.usage import since_seconds

HEALTH_FORMAT = 1
_STATE_HELP = "The service's database to read (default: PROVISION_STATE, else the embedded file)."


class _HealthGroup(click.Group):
    """`provision health [INVENTORY]` and its subcommands: a first word that names a
    subcommand is one, anything else is the INVENTORY the group reads."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            saved = self.params
            self.params = [p for p in saved if not isinstance(p, click.Argument)]
            ctx.allow_interspersed_args = False  # the subcommand's options are its own
            try:
                rest = super().parse_args(ctx, args)
            finally:
                self.params = saved
            ctx.params.setdefault("inventory", None)
            return rest
        ctx.allow_interspersed_args = True  # `provision health INVENTORY --json`
        return super().parse_args(ctx, args)


def _when(t: float | None) -> str | None:
    return iso(t) if t is not None else None


def _mark_json(m: Mark | None) -> dict[str, Any]:
    if m is None:
        return {"state": State.HEALTHY.value, "reason": "", "evidence": "", "since": None, "by": ""}
    return {"state": m.state.value, "reason": m.reason, "evidence": m.evidence, "since": _when(m.since), "by": m.by}


def health_doc(
    hosts: Iterable[tuple[str, int, HostHealth, str | None, Mapping[int, tuple[str, str]], Iterable[Any]]],
) -> dict[str, Any]:
    """`provision health --json`: each host's state, and each GPU's (host, gpu, state,
    reason, evidence, since, by, and the job that holds it or held it when it was marked)."""
    out: dict[str, Any] = {"format_version": HEALTH_FORMAT, "hosts": [], "gpus": []}
    for name, declared, h, error, held, signals in hosts:
        sigs = [{"gpu": s.gpu, "level": s.level.value, "what": s.what, "evidence": s.evidence} for s in signals]
        out["hosts"].append({"host": name, **_mark_json(h.host), "error": error, "signals": sigs})
        for g in range(declared):
            m = h.gpus.get(g)
            job, owner = (m.job, m.owner) if m is not None and m.job else held.get(g, ("", ""))
            out["gpus"].append({"host": name, "gpu": g, **_mark_json(m), "job": job or None, "owner": owner or None})
    return out


def health_lines(doc: Mapping[str, Any]) -> list[str]:
    rows = [["HOST", "GPU", "STATE", "SINCE", "BY", "REASON"]]
    for h in doc["hosts"]:
        if h["error"]:
            rows.append([h["host"], "-", "unreachable", "-", "-", h["error"]])
            continue
        rows.append([h["host"], "-", h["state"], h["since"] or "-", h["by"] or "-", h["reason"] or "-"])
        for g in doc["gpus"]:
            if g["host"] == h["host"] and (g["state"] != "healthy" or g["job"]):
                held = f" (job {g['job']}, {g['owner']})" if g["job"] else ""
                rows.append(
                    ["", str(g["gpu"]), g["state"], g["since"] or "-", g["by"] or "-", (g["reason"] or "-") + held]
                )
    out = table(rows)
    for h in doc["hosts"]:
        out += [f"  {h['host']}: {'GPU ' + str(s['gpu']) if s['gpu'] is not None else 'host'}: {s['what']} ({s['evidence']})"
                for s in h["signals"] if s["level"] != "program"]  # fmt: skip
        for g in doc["gpus"]:
            if g["host"] == h["host"] and g["evidence"] and g["state"] != "healthy":
                out.append(f"  {h['host']}:{g['gpu']}: evidence: {g['evidence']}")
    return out


@click.group("health", cls=_HealthGroup, invoke_without_command=True)
@click.argument("inventory", required=False, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help=f"As JSON (format_version {HEALTH_FORMAT}).")
@click.option(
    "--report", is_flag=True, help="Rank hosts and GPUs by incidents and GPU-hours lost (the service's history)."
)
@click.option("--since", default=None, metavar="AGE", help="With --report: incidents this recent: 30d, 12h.")
@click.option("--state", "state", metavar="URL", help=_STATE_HELP)
@click.option("--target", "targets", multiple=True, metavar="HOST", help="Only these hosts (repeatable).")
@click.pass_context
def health_group(
    ctx: click.Context,
    inventory: str | None,
    as_json: bool,
    report: bool,
    since: str | None,
    state: str | None,
    targets: tuple[str, ...],
) -> None:
    """Every host's and GPU's health: healthy, suspect, quarantined, draining or testing,
    with its reason, evidence, since when and by whom (INVENTORY: asked now; without it: as
    the service's rounds last saw them)."""
    if ctx.invoked_subcommand is not None:
        return
    if report:
        _report(since, state, as_json)
        return
    if since is not None:
        raise ProvisionError("--since: only with --report")
    if inventory is None:
        doc = _service_doc(state)
    else:
        doc = _asked(inventory, targets)
    if as_json:
        click.echo(_json.dumps(doc, indent=1))
    else:
        for line in health_lines(doc):
            click.echo(printable(line))  # what the hosts sent: shown, never interpreted
    sys.exit(3 if any(h["error"] for h in doc["hosts"]) else 0)


def _asked(inventory: str, targets: tuple[str, ...]) -> dict[str, Any]:
    from provision.run import health  # (start-up: SSH loads only for commands that reach hosts)

    c = open_ctx(inventory, None, targets, None, False, render_secrets=False, files_here=False)
    try:
        looks = health.look(c)
    finally:
        c.close()
    return health_doc((x.name, x.declared, x.health, x.error, x.holders, x.signals) for x in looks)


def _service_doc(state: str | None) -> dict[str, Any]:
    from provision.cli.servecmd import place_of  # (start-up: the service's database only here)
    from provision.serve.health import SEEN
    from provision.serve.places import open_place

    store = open_place(place_of(state))
    try:
        got = store.seen(SEEN)
    finally:
        store.close()
    known = {str(h): Known.from_json(d) for h, d in got.items()} if isinstance(got, dict) else {}
    if not known:
        raise ProvisionError("the service has looked at no host yet: give an INVENTORY to ask its hosts now")
    return health_doc(
        (name, k.declared, k.health(), "did not answer" if k.away is not None else None, {}, ())
        for name, k in sorted(known.items())
    )


def _report(since: str | None, state: str | None, as_json: bool) -> None:
    from provision.cli.servecmd import place_of  # (start-up, as above)
    from provision.serve.places import open_place

    store = open_place(place_of(state))
    try:
        now = store.now()
        try:
            cut = None if since is None else now - since_seconds(since)
        except ValueError:
            raise ProvisionError(f"--since: expected an age such as 30d, 12h or 30m, got {since!r}") from None
        incidents = store.incidents(since=cut)
    finally:
        store.close()
    doc = report_doc(incidents, now, cut)
    if as_json:
        click.echo(_json.dumps(doc, indent=1))
        return
    ranked = doc["ranked"]
    if not ranked:
        click.echo("No health incidents" + (f" in the last {since}" if since else "") + ".")
        return
    rows = [["HOST[:GPU]", "INCIDENTS", "GPU-HOURS LOST", "LAST", "WHEN"]]
    rows += [[r["target"], str(r["incidents"]), f"{r['gpu_hours_lost']:.2f}", r["last"], r["last_at"]] for r in ranked]
    for line in table(rows):
        click.echo(line)


@health_group.command("quarantine")
@click.argument("inventory", type=click.Path())
@click.argument("target", metavar="HOST[:GPU]")
@click.option("--reason", required=True, metavar="TEXT", help="Why (shown to the GPU's users and in its history).")
def quarantine_cmd(inventory: str, target: str, reason: str) -> None:
    """Quarantine a GPU (HOST:GPU) or a whole host (HOST) by hand: no new work goes there;
    what runs there goes on, and its owner is told."""
    from provision.run import health  # (start-up, as above)

    c = open_ctx(inventory, None, (), None, False, render_secrets=False, files_here=False)
    try:
        click.echo(printable(health.quarantine(c, target, reason)))
    finally:
        c.close()


@health_group.command("release")
@click.argument("inventory", type=click.Path())
@click.argument("target", metavar="HOST[:GPU]")
@click.option("--skip-test", is_flag=True, help="Release without the test the team's policy asks for.")
def release_cmd(inventory: str, target: str, skip_test: bool) -> None:
    """Give a quarantined (draining, suspect) GPU or host work again: after a passing test
    (`provision health test`) when the team's policy asks for one (the default)."""
    from provision.run import health  # (start-up, as above)

    c = open_ctx(inventory, None, (), None, False, render_secrets=False, files_here=False)
    try:
        ok, words = health.release(c, target, skip_test=skip_test)
    finally:
        c.close()
    click.echo(printable(words))
    sys.exit(0 if ok else 1)


@health_group.command("test")
@click.argument("inventory", type=click.Path())
@click.argument("target", metavar="HOST[:GPU]")
def test_cmd(inventory: str, target: str) -> None:
    """Test a GPU (every GPU of a host) on its host: DCGM's diagnostics (dcgmi diag -r 2)
    where DCGM is installed, else provision's torch test where torch is; a pass releases
    it, a failure quarantines it with the evidence."""
    from provision.run import health  # (start-up, as above)

    c = open_ctx(inventory, None, (), None, False, render_secrets=False, files_here=False)
    try:
        ok, words = health.test(c, target)
    finally:
        c.close()
    click.echo(printable(words))
    sys.exit(0 if ok else 1)
