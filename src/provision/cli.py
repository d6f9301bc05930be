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


from .sandbox_cli import sandbox  # noqa: E402

main.add_command(sandbox)
