"""`provision import vertex|ai-platform SPEC [--hosts FILE] [-o OUT]`: a managed service's
job as a commented inventory (docs/import.md)."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from provision.core.errors import ProvisionError, ValidationError
from provision.importers import import_job, load_hosts
from provision.inventory.inventory import parse
from provision.io.outfile import check_output, write_output


@click.group("import")
def import_group() -> None:
    """A Vertex AI or AI Platform Training job as an inventory.

    The output is commented YAML: the pools as the service ran them, every field that
    has no meaning on your hosts listed with the reason, and the spec itself as the
    `job` of every task's TF_CONFIG and CLUSTER_SPEC. See docs/import.md."""


def _options(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.argument("spec", type=click.Path(dir_okay=True)),
            click.option(
                "--hosts",
                "hosts_file",
                type=click.Path(),
                metavar="FILE",
                help="YAML with hosts: (and ssh:) in the inventory's format [default: a placeholder list to fill in].",
            ),
            click.option(
                "--output",
                "-o",
                type=click.Path(),
                metavar="OUT",
                help="Inventory file to write [default: standard output].",
            ),
            click.option("--job", help="Job name [default: the spec's displayName / jobId, else the file's name]."),
            click.option(
                "--trial",
                help="Trial id for TF_CONFIG's task.trial: one trial of a tuning job imported as a plain job "
                "[default: none]. Refused for a tuning job: its study becomes tune:, and `provision tune` numbers the trials.",
            ),
            click.option("--force", is_flag=True, help="Overwrite OUT if it exists."),
        ]
    ):
        f = option(f)
    return f


@import_group.command("vertex")
@_options
def vertex_cmd(
    spec: str, hosts_file: str | None, output: str | None, job: str | None, trial: str | None, force: bool
) -> None:
    """A Vertex AI custom job as an inventory.

    SPEC: a CustomJob, CustomJobSpec or HyperparameterTuningJob (JSON or YAML), gcloud's
    --config YAML, or a shell script with a `gcloud [beta] ai custom-jobs create` or
    `hp-tuning-jobs create` command. A tuning job's study becomes the inventory's tune:."""
    _run("vertex", spec, hosts_file, output, job, trial, force)


@import_group.command("ai-platform")
@_options
def ai_platform_cmd(
    spec: str, hosts_file: str | None, output: str | None, job: str | None, trial: str | None, force: bool
) -> None:
    """An AI Platform Training job as an inventory.

    SPEC: a TrainingInput, or a job with trainingInput (gcloud's config.yaml), JSON or YAML,
    or a shell script with a `gcloud [beta] ai-platform jobs submit training` (or `ml-engine`)
    command, its --config beside it. Its hyperparameters, if any, become the inventory's tune:."""
    _run("ai-platform", spec, hosts_file, output, job, trial, force)


def _run(
    service: str, spec: str, hosts_file: str | None, output: str | None, job: str | None, trial: str | None, force: bool
) -> None:

    to_stdout = output in (None, "-")
    out_path = None if to_stdout else Path(str(output))
    if out_path is not None:
        check_output(out_path, str(output), force=force)
    out_dir = (out_path.parent if out_path is not None else Path.cwd()).resolve()
    argv = ["provision", "import", service, spec]
    for flag, value in (("--hosts", hosts_file), ("--job", job), ("--trial", trial)):
        argv += [flag, value] if value is not None else []
    argv += ["-o", str(output)] if not to_stdout else []

    hosts = load_hosts(Path(hosts_file), hosts_file) if hosts_file else None
    result = import_job(
        service, Path(spec), spec, hosts=hosts, job=job, trial=trial, out_dir=out_dir, command=shlex.join(argv)
    )

    # Validated as `provision validate` will read it (relative files: beside OUT); without
    # --hosts, with the example hosts the file shows, commented.
    shown = str(output) if not to_stdout else "(output)"
    problems: list[str] = []
    try:
        parse(result.check_text, out_dir / (out_path.name if out_path is not None else "imported.yaml"), display=shown)
    except ValidationError as e:
        problems = e.problems

    if out_path is None:
        click.echo(result.text, nl=False)
    else:
        write_output(out_path, result.text, str(output), force=force)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    if problems:
        where = "written" if out_path is not None else "printed"
        raise ProvisionError(
            f"{shown}: {where}, but it does not validate yet: fix these, then `provision validate`", details=problems
        )
    plan = result.plan
    counts = ", ".join(f"{p.role} {p.replicas}" for p in plan.pools)
    study = ""
    if plan.study is not None:
        t = plan.study.tune
        n = len(t.params)
        study = f"tune: {n} parameter{'s' * (n != 1)}, up to {t.max_trials} trial{'s' * (t.max_trials != 1)}; "
    click.echo(
        f"{'Wrote ' + str(output) if out_path is not None else 'Imported'}: job {plan.job} ({counts}); {study}"
        f"{len(plan.not_applied)} field{'' if len(plan.not_applied) == 1 else 's'} not applied, "
        f"{len(plan.partly)} applied in part: see the notes in the file.",
        err=True,
    )
    if hosts is None:
        click.echo("Next: replace the example hosts with yours, then `provision validate`.", err=True)
