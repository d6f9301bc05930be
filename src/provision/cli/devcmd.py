"""`provision dev`: a GPU shell, VS Code or JupyterLab on the team's hosts in seconds, given
back when it goes idle (docs/dev.md). The work is run/dev.py's; these are its words."""

from __future__ import annotations

import json as _json
import time
from typing import Any

import click

from provision.cli.common import progress_line
from provision.core import devsession as dv
from provision.core.errors import ProvisionError
from provision.core.text import duration, printable
from provision.rules.usage import since_seconds
from provision.run import dev

DEV_FORMAT = 1


def _clock(t: float) -> str:
    """18:30, or with its day when it is not today."""
    fmt = "%H:%M" if time.strftime("%Y-%m-%d", time.localtime(t)) == time.strftime("%Y-%m-%d") else "%a %H:%M"
    return time.strftime(fmt, time.localtime(t))


def started_line(s: dev.Started) -> str:
    """The one line `provision dev` prints: how to reach the session."""
    gpus = ", ".join(map(str, s.gpus)) or "none"
    what = f"GPU{'s' if len(s.gpus) != 1 else ''} {gpus} on {s.host} until {_clock(s.until)}"
    if s.by_hand:
        return printable(f"Dev session {s.name} is up ({what}), but {s.by_hand}")
    return printable(f"ssh {dv.alias(s.name)}    # dev session {s.name}: {what}")


def jupyter_line(s: dev.Started) -> str | None:
    j = s.jupyter
    if not j or not isinstance(j.get("port"), int):
        return None
    port, token = j["port"], str(j.get("token", ""))
    return printable(
        f"JupyterLab: ssh -N -L {port}:127.0.0.1:{port} {dv.alias(s.name)}, then "
        f"http://127.0.0.1:{port}/lab?token={token}"
    )


def list_rows(rows: list[dev.Listed], now: float) -> list[list[str]]:
    out = [["NAME", "OWNER", "HOST", "GPUS", "STATE", "UP", "ENDS", "GPU%", "LOGGED IN"]]
    for r in rows:
        up = duration(int(now - r.since)) if r.since is not None else "-"
        util = "-" if r.util is None else f"{r.util}%"
        who = ", ".join(r.logins) or "nobody"
        gpus = ",".join(map(str, r.gpus)) or "-"
        out.append([r.name, r.owner, r.host, gpus, r.state, up, _clock(r.until), util, who])
    return out


def _json_row(r: dev.Listed) -> dict[str, Any]:
    return {
        "name": r.name, "job": r.job, "owner": r.owner, "host": r.host, "gpus": list(r.gpus), "state": r.state,
        "since": r.since, "until": r.until, "gpu_util": r.util, "logins": list(r.logins), "yours": r.mine,
        "ssh": dv.alias(r.name) if r.mine else None,
    }  # fmt: skip


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _list(inventory: str, as_json: bool) -> None:
    rows = dev.sessions(inventory)
    if as_json:
        doc = {"format_version": DEV_FORMAT, "sessions": [_json_row(r) for r in rows]}
        click.echo(_json.dumps(doc, indent=1))
        return
    if not rows:
        click.echo(f"No dev sessions on the hosts of {inventory}.")
        return
    for line in _table(list_rows(rows, time.time())):
        click.echo(printable(line))


@click.command("dev")
@click.argument("inventory", type=click.Path())
@click.option("--gpus", type=click.IntRange(0, 1024), default=1, show_default=True, help="GPUs the session holds.")
@click.option("--name", metavar="NAME", help="The session's name (default: your name): `ssh provision-dev-NAME`.")
@click.option("--hours", type=float, default=None, help="End it after this many hours (default: the team policy's, 8).")
@click.option("--image", metavar="IMAGE", default="", help="Hold the GPUs in a container of IMAGE; logins enter it.")
@click.option("--jupyter", is_flag=True, help="Start JupyterLab too, on the host's loopback; print its URL.")
@click.option("--list", "listing", is_flag=True, help="List the dev sessions on the inventory's hosts.")
@click.option("--extend", nargs=2, metavar="DURATION NAME", default=None, help="End session NAME DURATION later (2h).")
@click.option(
    "--stop", "stop_name", metavar="NAME", help="End session NAME now and remove it (GPUs, files, ssh entry)."
)
@click.option("--json", "as_json", is_flag=True, help="With --list: as JSON (format_version 1).")
@click.option("--state", "state_path", type=click.Path(), help="State file (default: beside the inventory).")
def dev_cmd(
    inventory: str,
    gpus: int,
    name: str | None,
    hours: float | None,
    image: str,
    jupyter: bool,
    listing: bool,
    extend: tuple[str, str] | None,
    stop_name: str | None,
    as_json: bool,
    state_path: str | None,
) -> None:
    """Start a dev session: GPUs held like any job's, a shell on their host in the job's
    environment (CUDA_VISIBLE_DEVICES, ...), reached by `ssh provision-dev-NAME` (also from
    VS Code and JetBrains Gateway). It ends at --hours, or when its GPUs stay idle with
    nobody logged in (the service watches it), warned ten minutes before."""
    asked = [x for x in (listing, extend is not None, stop_name is not None) if x]
    if len(asked) > 1:
        raise ProvisionError("dev: give one of --list, --extend or --stop")
    if as_json and not listing:
        raise ProvisionError("dev: --json goes with --list")
    if listing:
        return _list(inventory, as_json)
    if extend is not None:
        try:
            seconds = since_seconds(extend[0])
        except ValueError:
            raise ProvisionError(f"--extend: expected a duration such as 2h or 30m, got {extend[0]!r}") from None
        until = dev.extend(inventory, extend[1], seconds)
        click.echo(f"Dev session {extend[1]} now ends at {_clock(until)}.")
        return
    if stop_name is not None:
        left = dev.stop(inventory, stop_name, progress=progress_line)
        click.echo(f"Dev session {stop_name} ended and removed ({', '.join(left) or 'no host held it'}).")
        return
    s = dev.start(
        inventory, gpus=gpus, name=name, hours=hours, image=image, jupyter=jupyter, state_path=state_path,
        progress=progress_line,
    )  # fmt: skip
    click.echo(started_line(s))
    line = jupyter_line(s)
    if line:
        click.echo(line)
