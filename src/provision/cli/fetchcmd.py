"""`provision fetch`: the job's outputs directory back from the chief's host."""

from __future__ import annotations

from pathlib import Path

import click

from provision.cli.common import progress_line
from provision.core.errors import ProvisionError
from provision.core.target import HostError
from provision.run.context import open_context
from provision.run.fetch import fetch


@click.command("fetch")
@click.argument("inventory", type=click.Path())
@click.option("-o", "--output", "out_dir", type=click.Path(), required=True, help="Local directory to copy into.")
@click.option("--task", "task", metavar="TASK", help="The task whose host has the files (default: the chief).")
@click.option("--state", "state_path", type=click.Path(), help="State file.")
@click.option("-v", "--verbose", is_flag=True, help="Show the SSH commands.")
def fetch_cmd(inventory: str, out_dir: str, task: str | None, state_path: str | None, verbose: bool) -> None:
    """Copy the job's `outputs:` directory from the chief's host (AIP_MODEL_DIR and the
    rest) into the -o directory: only the files that changed since the last fetch."""

    ctx = open_context(inventory, state_path=state_path, verbose=verbose, render_secrets=False)
    try:
        fetch(ctx, task, Path(out_dir), progress_line)
    except HostError as e:
        raise ProvisionError(f"{e.target.where}: {e.message}", exit_code=3 if e.unreachable else 1) from None
    finally:
        ctx.close()
