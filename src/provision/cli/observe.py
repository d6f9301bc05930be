"""Commands that read hosts: status, logs, wait, jobs, facts."""

from __future__ import annotations

import json as _json
import sys
import time
from typing import Any

import click

from provision.cli.common import (
    complete_tasks,
    host_options,
    open_ctx,
)
from provision.cli.output import facts_json, status_lines, table
from provision.cli.progress import Display, wait_job
from provision.core.errors import ProvisionError
from provision.core.model import Host
from provision.core.target import HostError
from provision.core.text import printable
from provision.host.protocol import ProbeReport
from provision.rules.fabricfacts import fabric_of
from provision.rules.facts import mismatches, summary_row
from provision.rules.health import health_words
from provision.rules.tenancy import HostView, host_view, jobs_json, jobs_lines, queued_lines
from provision.run.context import Ask, probe
from provision.run.jobend import collect
from provision.run.logs import run_logs, run_setup_logs


@click.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the jobs and hosts as JSON.")
def jobs(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    as_json: bool,
) -> None:
    """Every provision job on INVENTORY's hosts: owner, state, since; GPUs and ports held, and free.

    Reads only: works from anyone's machine, whoever applied the jobs.
    """

    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose, render_secrets=False, files_here=False)
    try:
        res = probe(ctx, Ask(files=False, tenancy=True), fast=True)
    finally:
        ctx.close()
    now = time.time()
    gpus = {h.name: h.accelerator_count for h in ctx.inventory.hosts}
    views = []
    for name in ctx.targets:
        r = res.get(name)
        if isinstance(r, HostError):
            views.append(HostView(name, gpus.get(name, 0), error=r.message))
        else:
            views.append(host_view(name, gpus.get(name, 0), r, now))
    if as_json:
        click.echo(_json.dumps(jobs_json(views, now, ctx.policy), indent=1))
    else:
        jobs_rows, host_rows = jobs_lines(views, now, ctx.policy)
        if len(jobs_rows) == 1:
            click.echo("No provision jobs on these hosts.")
        else:
            for line in table(jobs_rows):
                click.echo(line)
            for line in queued_lines(views, now, ctx.policy):
                click.echo(printable(line))  # who waits: the ledgers' owners
        click.echo()
        for line in table(host_rows):
            click.echo(line)
    unreachable = [v for v in views if v.error is not None]
    sys.exit(3 if unreachable else 0)


@click.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def facts(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    as_json: bool,
) -> None:
    """Report per host: OS, CPUs, memory, GPUs (nvidia-smi), TPU chips, systemd, the fabric
    (NVLink, InfiniBand); flag mismatches."""

    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose, render_secrets=False, files_here=False)
    try:
        res = probe(ctx, Ask(facts="all", files=False, tenancy=True, listening=False, health=True))
    finally:
        ctx.close()
    reports = {n: res.get(n) for n in ctx.targets}
    hosts = {h.name: h for h in ctx.inventory.hosts}
    data: dict[str, dict[str, Any]] = {}
    rows: list[tuple[str, ...]] = [
        ("HOST", "OS", "CPUS", "MEMORY", "GPUS", "MODEL", "TPU", "SYSTEMD", "FABRIC", "CHECK")
    ]
    unreachable, bad = [], False
    for name, r in reports.items():
        if isinstance(r, HostError):
            data[name] = {"error": r.message, "problems": []}
            rows.append((name, "-", "-", "-", "-", "-", "-", "-", "-", r.message))
            if r.unreachable:
                unreachable.append(name)
            bad = True
            continue
        data[name], line = _facts_of(name, r, hosts.get(name))
        bad = bad or bool(data[name]["problems"])
        rows.append(line)
    if as_json:
        click.echo(_json.dumps(facts_json(data), indent=1))
    else:
        for text in table(rows):
            click.echo(text)
    if unreachable:
        click.echo(f"Unreachable: {', '.join(unreachable)}", err=True)
        sys.exit(3)
    sys.exit(1 if bad else 0)


def _facts_of(name: str, r: ProbeReport, host: Host | None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A host's facts as `--json` and the table show them: its problems are the inventory's
    mismatches and the health read's fatal signals (rules/health.py)."""
    f = r.facts or {}
    problems = mismatches(host, f) if host is not None else []
    sick = health_words(host.accelerator_count, r) if host is not None else {}
    problems += list(sick.get("fatal") or [])
    row = summary_row(name, f)
    fabric = fabric_of(f)  # the topology the hardware tells, and the labels it suggests
    doc = {**row, "fabric": fabric.to_json(), "labels": fabric.labels(), "problems": problems, "health": sick}
    line = (
        name, row["os"] or "-", str(row["cpus"]), f"{row['memory_gib']} GiB", str(row["gpus"]),
        row["gpu_model"] or "-", str(row["tpu_chips"]), row["systemd"] or "none", fabric.summary(),
        "; ".join(problems) or "ok",
    )  # fmt: skip
    return doc, line


@click.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option(
    "--watch", is_flag=True, help="Refresh every 2 seconds until the job ends or Ctrl-C (in place on a terminal)."
)
def status(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    as_json: bool,
    watch: bool,
) -> None:
    """Job phase (Pending, Running, Succeeded, Failed) and every task's state. One round trip per host."""

    disp = Display(sys.stdout)
    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose, render_secrets=False, files_here=False)
    try:
        while True:
            st = collect(ctx)
            if as_json:
                click.echo(_json.dumps(st.to_json(), indent=1))
            elif watch and disp.tty:
                disp.draw(status_lines(st, inventory))  # the table, redrawn in place
            elif watch and disp.last_phase is not None and not st.phase.ended:
                disp.update(st)  # not a terminal: a line per change, and every 10 s
            else:
                for line in status_lines(st, inventory):
                    click.echo(line)
                disp.note(st)
            if not watch or st.phase.ended:
                break
            time.sleep(2)
    except KeyboardInterrupt:
        disp.keep()
        raise
    finally:
        ctx.close()
    if st.unreachable:
        why = {t.host: t.detail for t in st.tasks if t.state.value == "Unknown"}
        for h in st.unreachable:
            click.echo(f"Unreachable: {h}: {printable(why.get(h, 'host unreachable'))}", err=True)
        sys.exit(3)


@click.command()
@click.argument("inventory", type=click.Path())
@click.argument("tasks", nargs=-1, metavar="[TASK]...", shell_complete=complete_tasks)
@host_options
@click.option("-f", "--follow", is_flag=True, help="Keep streaming new lines from every host until Ctrl-C.")
@click.option(
    "--since",
    metavar="WHEN",
    help="Only lines since WHEN: a duration ago (10m, 2h, 1d) or a time journalctl reads ('2024-05-01 12:00:00').",
)
@click.option("--tail", type=click.IntRange(0), metavar="N", help="Only the last N lines of each task.")
@click.option(
    "-o",
    "--output",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Write DIR/<task>.log instead of printing; the next call appends only new lines.",
)
@click.option("--timestamps", is_flag=True, help="Start every line with its time (UTC).")
@click.option("--setup", "setup_logs", is_flag=True, help="The output of the job's setup on each host instead.")
@click.option(
    "--run", "run_number", type=click.IntRange(1), metavar="N", help="Only run N of the job (status shows runs)."
)
@click.option("--previous", is_flag=True, help="Only the run before the latest (after a rerun: the one that ended).")
@click.option(
    "--raw",
    is_flag=True,
    help="The tasks' output as they wrote it, escape sequences too (colours); else shown as text.",
)
def logs(
    inventory: str,
    tasks: tuple[str, ...],
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    follow: bool,
    since: str | None,
    tail: int | None,
    out_dir: str | None,
    timestamps: bool,
    setup_logs: bool,
    run_number: int | None,
    previous: bool,
    raw: bool,
) -> None:
    """The job's task output (journald) from all hosts, merged in time order.

    Each line starts with TASK@HOST. TASK... limits to those tasks. Exit 3 when a host was
    unreachable (the other hosts' lines are still shown). A study's inventory: its trials'
    output, each line as trial-N/TASK@HOST.
    """

    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose, render_secrets=False, files_here=False)
    try:
        if ctx.inventory.tune is not None and not ctx.state.hosts:  # a study's: its trials' jobs
            job_only = [f for f, given in (("--since", since), ("-o", out_dir), ("--setup", setup_logs),
                        ("--run", run_number), ("--previous", previous)) if given]  # fmt: skip
            if job_only:
                raise ProvisionError(
                    f"{', '.join(job_only)}: not for a study's logs (its trials' output, trial by trial); "
                    f"`provision fetch --trial N` or `provision tune --status {inventory}` for the rest"
                )
            # start-up time: the study's modules import Optuna (only a study's logs load them)
            from provision.run.studylogs import study_logs

            code = study_logs(ctx, tuple(tasks), tail=tail, follow=follow, timestamps=timestamps, raw=raw)
        elif setup_logs:
            code = run_setup_logs(ctx, tail=tail, raw=raw)
        else:
            code = run_logs(
                ctx,
                tuple(tasks),
                since=since,
                tail=tail,
                follow=follow,
                out_dir=out_dir,
                timestamps=timestamps,
                run=run_number,
                previous=previous,
                raw=raw,
            )
    finally:
        ctx.close()
    sys.exit(code)


@click.command()
@click.argument("inventory", type=click.Path())
@click.option("--state", "state_path", type=click.Path(), help="State file.")
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds (exit 124).")
@click.option("-v", "--verbose", is_flag=True, help="Show the SSH commands.")
@click.option("--logs", "stream_logs", is_flag=True, help="Stream the tasks' output while waiting.")
def wait(inventory: str, state_path: str | None, timeout: float | None, verbose: bool, stream_logs: bool) -> None:
    """Block until the job succeeds (exit 0) or fails or is stopped (exit 1), showing each task's progress."""

    ctx = open_ctx(inventory, state_path, (), None, verbose, render_secrets=False, files_here=False)
    try:
        code = wait_job(ctx, timeout=timeout, logs=stream_logs)
    finally:
        ctx.close()
    sys.exit(code)
