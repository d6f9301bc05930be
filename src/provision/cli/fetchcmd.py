"""`provision fetch`: the job's outputs directory back from the chief's host."""

from __future__ import annotations

from pathlib import Path

import click

from provision.cli.common import progress_line
from provision.core.errors import ProvisionError
from provision.core.model import Inventory
from provision.core.target import HostError
from provision.inventory.inventory import load
from provision.inventory.trial import trial_inventory
from provision.run.context import open_context
from provision.run.fetch import fetch


@click.command("fetch")
@click.argument("inventory", type=click.Path())
@click.option("-o", "--output", "out_dir", type=click.Path(), required=True, help="Local directory to copy into.")
@click.option("--task", "task", metavar="TASK", help="The task whose host has the files (default: the chief).")
@click.option(
    "--trial", "trial", type=int, metavar="N", help="A trial of the inventory's tune: study (its outputs/N/)."
)
@click.option("--state", "state_path", type=click.Path(), help="State file.")
@click.option("-v", "--verbose", is_flag=True, help="Show the SSH commands.")
def fetch_cmd(
    inventory: str, out_dir: str, task: str | None, trial: int | None, state_path: str | None, verbose: bool
) -> None:
    """Copy the job's `outputs:` directory from the chief's host (AIP_MODEL_DIR and the
    rest) into the -o directory: only the files that changed since the last fetch. With
    --trial N: that trial's directory, from the host it ran on."""

    loaded, ran_on = _trial(inventory, trial) if trial is not None else (None, None)
    ctx = open_context(
        inventory, state_path=state_path, verbose=verbose, render_secrets=False, loaded=loaded, files_here=False
    )
    try:
        fetch(ctx, task, Path(out_dir), progress_line, ran_on=ran_on)
    except HostError as e:
        raise ProvisionError(f"{e.target.where}: {e.message}", exit_code=3 if e.unreachable else 1) from None
    finally:
        ctx.close()


def _trial(inventory: str, number: int) -> tuple[Inventory, dict[str, str]]:
    """The trial's job as the study ran it, and where its tasks ran."""
    inv = load(inventory, files_here=False)  # fetching needs none of the files the job pushes
    if inv.tune is None:
        raise ProvisionError(f"--trial: {inventory} has no tune: section")
    # Local: Optuna takes about a second to import (start-up of a plain fetch stays as it was).
    from provision.run.tune import existing_study

    study = existing_study(inventory, inv)
    got = study.record_of(number) if study is not None else None
    if got is None:
        raise ProvisionError(f"--trial {number}: study {inv.job} has no such trial")
    params, ran_on = got
    return trial_inventory(inv, number, params), ran_on
