"""Command line: `provision validate|render|facts|plan|apply|status|logs|wait|destroy|sandbox`."""

from __future__ import annotations

import sys

import click

from . import __version__
from .errors import ProvisionError


class _Main(click.Group):
    """Turns ProvisionError into one clear line and its exit code, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ProvisionError as e:
            click.echo(f"Error: {e.message}", err=True)
            for line in e.details:
                click.echo(f"Error: {line}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)


@click.group(cls=_Main)
@click.version_option(__version__, prog_name="provision")
def main() -> None:
    """Provision distributed ML training jobs on hosts you own."""


def _summary(inv, placement) -> str:
    counts = ", ".join(f"{p.role} {p.replicas}" for p in inv.pools if p.replicas)
    accs = sum(len(t.accelerators) for t in placement.tasks)
    hosts = len({t.host.name for t in placement.tasks})
    return (
        f"job {inv.job}: {len(placement.tasks)} tasks ({counts}) on {hosts} of "
        f"{len(inv.hosts)} hosts, {accs} accelerators placed"
    )


def _placement_table(placement) -> list[str]:
    rows = [("TASK", "HOST", "ADDRESS", "ACCELERATORS")]
    for t in placement.tasks:
        rows.append((t.name, t.host.name, t.address, ",".join(map(str, t.accelerators)) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


@main.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--placement", "show_placement", is_flag=True, help="Also print where every task goes.")
def validate(inventory: str, show_placement: bool) -> None:
    """Check INVENTORY without touching the network.

    Reports every problem at once, one line each, as FILE:LINE: key.path: what is wrong.
    Exit 0 when the inventory is valid, 1 otherwise.
    """
    from .inventory import load
    from .placement import place

    inv = load(inventory)
    placement = place(inv)
    click.echo(f"{inventory}: valid; {_summary(inv, placement)}")
    if show_placement:
        for line in _placement_table(placement):
            click.echo(line)


@main.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False), help="Directory to write into.")
def render(inventory: str, out: str) -> None:
    """Write every file each host would get, as OUT/<host>/<absolute path>.

    No network. Values of secret_env are left out of the rendered env files (apply
    fills them in from the controller's environment).
    """
    from pathlib import Path

    from .inventory import load
    from .render import render as do_render
    from .render import write_tree

    inv = load(inventory)
    rendered = do_render(inv)
    try:
        count = write_tree(rendered, Path(out))
    except OSError as e:
        raise ProvisionError(f"{out}: cannot write: {e.strerror} ({e.filename})") from None
    click.echo(f"{inventory}: {_summary(inv, rendered.placement)}")
    for line in _placement_table(rendered.placement):
        click.echo(line)
    click.echo(f"Wrote {count} files for {len(rendered.hosts)} hosts under {out}/")


from .sandbox_cli import sandbox  # noqa: E402

main.add_command(sandbox)
