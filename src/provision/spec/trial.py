"""A study's trial as a job of its own: the study's inventory with the trial's parameters.

Vertex runs a tuning job's every worker pool with the trial's parameters as command-line
arguments (`--NAME=VALUE`) and TF_CONFIG's task.trial set to the trial's number; provision
does the same to every pool (a `command:` pool gets them after its command, an `image:`
pool after its args), names the job `<job>-t<N>`, and moves `outputs:` to `<base>/<N>` (as
Vertex's `<baseOutputDirectory>/<trial>/model/`). Everything else (hosts, files, setup,
env) is the study's. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from provision.core.model import Inventory
from provision.core.tuning import Tune, Value, format_value, trial_job


def flags(tune: Tune, params: Mapping[str, Value]) -> tuple[str, ...]:
    """The trial's arguments, in the order `tune.parameters` lists them (a conditional
    parameter that was not suggested is absent)."""
    return tuple(f"--{p.name}={format_value(params[p.name])}" for p in tune.params if p.name in params)


def trial_inventory(inv: Inventory, number: int, params: Mapping[str, Value]) -> Inventory:
    assert inv.tune is not None
    extra = flags(inv.tune, params)
    pools = tuple(
        dataclasses.replace(p, args=p.args + extra) if p.image else dataclasses.replace(p, command=p.command + extra)
        for p in inv.pools
    )
    return dataclasses.replace(
        inv,
        job=trial_job(inv.job, number),
        pools=pools,
        tf_config=dataclasses.replace(inv.tf_config, trial=str(number)),
        outputs=f"{inv.outputs}/{number}" if inv.outputs else None,
    )
