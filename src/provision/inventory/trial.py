"""A study's trial as a job of its own: the study's inventory with the trial's parameters.

Vertex runs a tuning job's every worker pool with the trial's parameters as command-line
arguments (`--NAME=VALUE`) and TF_CONFIG's task.trial set to the trial's number; provision
does the same to every pool (a `command:` pool gets them after its command, an `image:`
pool after its args; a flag the command has already, `--NAME=OLD` or `--NAME OLD`, is
replaced where it is, so the program sees the trial's value once), names the job `<job>-t<N>`, and moves `outputs:` to `<base>/<N>` (as
Vertex's `<baseOutputDirectory>/<trial>/model/`). Everything else (hosts, files, setup,
env) is the study's. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from provision.core.model import Inventory
from provision.core.tuning import Tune, Value, format_value, trial_job


def flags(tune: Tune, params: Mapping[str, Value]) -> tuple[str, ...]:
    """The trial's arguments, in the order `tune.parameters` lists them (a conditional
    parameter that was not suggested is absent)."""
    return tuple(f"--{p.name}={format_value(params[p.name])}" for p in tune.params if p.name in params)


def with_flags(argv: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """`argv` with each `--NAME=VALUE` of `extra` in place of the same flag already there
    (`--NAME=OLD`, or `--NAME OLD` when OLD is no `--flag`: both words become the one), the
    others appended in their order. Every occurrence is replaced: a program reading the
    last one (argparse) and one reading the first see the same value. Each value stays
    one argument whatever it holds (spaces, quotes, `$`): argv is never a shell's."""
    new = {f.split("=", 1)[0]: f for f in extra}
    out: list[str] = []
    used: set[str] = set()
    i = 0
    while i < len(argv):
        word = argv[i]
        name, eq, _ = word.partition("=")
        if name in new:
            out.append(new[name])
            used.add(name)
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1  # `--NAME OLD`: OLD goes with it
        else:
            out.append(word)
        i += 1
    return (*out, *(f for f in extra if f.split("=", 1)[0] not in used))


def trial_inventory(inv: Inventory, number: int, params: Mapping[str, Value]) -> Inventory:
    assert inv.tune is not None
    extra = flags(inv.tune, params)
    pools = tuple(
        dataclasses.replace(p, args=with_flags(p.args, extra))
        if p.image
        else dataclasses.replace(p, command=(*p.command[:1], *with_flags(p.command[1:], extra)))
        for p in inv.pools
    )
    return dataclasses.replace(
        inv,
        job=trial_job(inv.job, number),
        pools=pools,
        tf_config=dataclasses.replace(inv.tf_config, trial=str(number)),
        outputs=f"{inv.outputs}/{number}" if inv.outputs else None,
    )
