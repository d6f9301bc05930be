"""Command line: `provision validate|render|facts|plan|apply|status|logs|wait|destroy|sandbox`."""

from __future__ import annotations

import sys

import click

from provision import __version__
from provision.core.errors import ProvisionError, no_color
from provision.core.text import plural


class _Main(click.Group):
    """Turns ProvisionError into one clear line and its exit code, never a traceback."""

    def main(self, *args, **kwargs):
        # Usage errors exit 1, not click's 2: exit 2 means "plan found changes".
        kwargs["standalone_mode"] = False
        if no_color():  # https://no-color.org: no ANSI styles, even on a terminal
            kwargs.setdefault("color", False)
        try:
            rv = super().main(*args, **kwargs)
        except click.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `provision`: help, not an error
                help_ctx = getattr(e, "ctx", None)
                click.echo(help_ctx.get_help() if help_ctx else e.format_message())
                sys.exit(0)
            e.show()
            sys.exit(1)
        except click.exceptions.Abort:
            # Ctrl-C in a prompt (click turns it into Abort): the same 130 as anywhere else.
            click.echo("Interrupted.", err=True)
            sys.exit(130)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)

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


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="provision")
def main() -> None:
    """Provision distributed ML training jobs on hosts you own."""


def _complete_tasks(ctx, param, incomplete):
    from provision.run.remote import complete_tasks

    return complete_tasks(ctx, param, incomplete)


def _summary(inv, placement) -> str:
    counts = ", ".join(f"{p.role} {p.replicas}" for p in inv.pools if p.replicas)
    accs = sum(len(t.accelerators) for t in placement.tasks)
    hosts = len({t.host.name for t in placement.tasks})
    return (
        f"job {inv.job}: {plural(len(placement.tasks), 'task')} ({counts}) on {hosts} of "
        f"{plural(len(inv.hosts), 'host')}, {plural(accs, 'accelerator')} placed"
    )


def _placement_table(placement) -> list[str]:
    rows = [("TASK", "HOST", "ADDRESS", "ACCELERATORS")]
    for t in placement.tasks:
        rows.append((t.name, t.host.name, t.address, ",".join(map(str, t.accelerators)) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _previous(inventory: str, inv, state_path: str | None):
    """The placement apply would keep: tasks that exist stay where they are (local read only)."""
    from pathlib import Path

    from provision.io.state import State, default_state_path

    sp = Path(state_path) if state_path else default_state_path(Path(inventory), inv.job)
    return State.load(sp, inv.job).previous_placement() if sp.exists() else None


@main.command()
@click.argument("inventory", type=click.Path())
@click.option("--placement", "show_placement", is_flag=True, help="Also print where every task goes.")
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False),
    help="State whose placement to keep (default: .provision/<job>.state.json beside the inventory, if there is one).",
)
def validate(inventory: str, show_placement: bool, state_path: str | None) -> None:
    """Check INVENTORY without touching the network.

    Reports every problem at once, one line each, as FILE:LINE: key.path: what is wrong.
    Then what this machine lacks to apply it (identity files, secret_env variables), as
    warnings. Exit 0 when the inventory is valid, 1 otherwise.
    """
    from provision.core.errors import ValidationError
    from provision.spec.inventory import load
    from provision.spec.localcheck import identity_problems, job_file_hint, secret_problems
    from provision.spec.placement import place

    try:
        inv = load(inventory)
    except ValidationError as e:
        hint = job_file_hint(inventory)
        if hint is None:
            raise
        for line in [e.message, *e.details]:
            click.echo(f"Error: {line}", err=True)
        click.echo(f"Hint: {hint}", err=True)
        sys.exit(1)
    placement = place(inv, _previous(inventory, inv, state_path))
    click.echo(f"{inventory}: valid; {_summary(inv, placement)}")
    for w in identity_problems(inv, inventory) + secret_problems(inv, display=inventory):
        click.echo(click.style(f"Warning: {w}", fg="yellow"), err=True)
    if show_placement:
        for line in _placement_table(placement):
            click.echo(line)


@main.command()
@click.argument("inventory", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False), help="Directory to write into.")
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False),
    help="State whose placement to keep (default: .provision/<job>.state.json beside the inventory, if there is one).",
)
def render(inventory: str, out: str, state_path: str | None) -> None:
    """Write every file each host would get, as OUT/<host>/<absolute path>.

    No network. Values of secret_env are left out of the rendered env files (apply
    fills them in from the controller's environment).
    """
    from pathlib import Path

    from provision.spec.inventory import load
    from provision.spec.render import render as do_render
    from provision.spec.render import write_tree

    inv = load(inventory)
    rendered = do_render(inv, previous=_previous(inventory, inv, state_path))
    try:
        count = write_tree(rendered, Path(out))
    except OSError as e:
        raise ProvisionError(f"{out}: cannot write: {e.strerror} ({e.filename})") from None
    click.echo(f"{inventory}: {_summary(inv, rendered.placement)}")
    for line in _placement_table(rendered.placement):
        click.echo(line)
    click.echo(f"Wrote {plural(count, 'file')} for {plural(len(rendered.hosts), 'host')} under {out}/")


# --------------------------------------------------------------------------- host commands

import json as _json  # noqa: E402


def host_options(fn):
    """Flags every command that talks to hosts shares (interface.md, Common flags)."""
    opts = [
        click.option(
            "--state",
            "state_path",
            type=click.Path(),
            help="State file (default: .provision/<job>.state.json beside the inventory).",
        ),
        click.option("--target", "targets", multiple=True, metavar="HOST", help="Limit to these hosts (repeatable)."),
        click.option(
            "--parallelism",
            type=click.IntRange(1, 4096),
            help="Hosts at once (default: all, up to a file-descriptor-safe bound).",
        ),
        click.option("-v", "--verbose", is_flag=True, help="Show the SSH commands."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _progress(line: str) -> None:
    # From the hosts' threads: click's context (and its colour setting) is the main thread's.
    click.echo(click.style("  ... ", dim=True) + line, err=True, color=False if no_color() else None)


def _context(inventory, state_path, targets, parallelism, verbose, *, render_secrets=True, operation=None):
    from provision.run.context import open_context

    return open_context(
        inventory,
        state_path=state_path,
        only=tuple(targets),
        parallelism=parallelism,
        verbose=verbose,
        render_secrets=render_secrets,
        operation=operation,
    )


def _exit_for(plan, outcomes=None) -> int:
    from provision.core.errors import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE

    unreachable = bool(plan.unreachable) or any(o.unreachable for o in (outcomes or {}).values())
    if unreachable:
        return EXIT_UNREACHABLE
    if any(h.error or h.problems for h in plan.hosts) or any(o.error for o in (outcomes or {}).values()):
        return EXIT_ERROR
    return EXIT_OK


def _confirm(verb: str, question: str) -> None:
    """Terraform's rule: only 'yes' goes ahead; without a terminal, -y is required."""
    if not sys.stdin.isatty():
        raise ProvisionError(f"{verb} needs confirmation; run with -y/--auto-approve when there is no terminal")
    if click.prompt(f"\n{question} Only 'yes' will be accepted", default="", show_default=False) != "yes":
        click.echo(f"{verb.capitalize()} cancelled.")
        sys.exit(1)


def _report_unreachable(plan, outcomes=None) -> None:
    """One line per unreachable host with its reason; past 10 hosts, a count per reason."""
    why = {h.name: h.error.message for h in plan.unreachable}
    for o in (outcomes or {}).values():
        if o.unreachable:
            why.setdefault(o.name, o.error)
    if not why:
        return
    if len(why) <= 10:
        for name in sorted(why):
            click.echo(click.style(f"Unreachable: {name}: {why[name]}", fg="red"), err=True)
    else:
        by_reason: dict[str, list[str]] = {}
        for name, reason in why.items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            names.sort()
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            click.echo(
                click.style(
                    f"Unreachable: {len(names)} host{'s' if len(names) != 1 else ''} ({shown}): {reason}", fg="red"
                ),
                err=True,
            )
    click.echo(click.style("The other hosts were handled; run again when these are back.", fg="red"), err=True)


def _change(
    inventory,
    state_path,
    targets,
    parallelism,
    verbose,
    *,
    operation,
    auto_approve,
    as_json,
    make_plan,
    execute,
    question,
    take_over=False,
):
    """apply and destroy: lock, plan, show, confirm, execute, report; returns the exit code."""
    from provision.cli.output import print_outcome, print_plan

    ctx = _context(
        inventory, state_path, targets, parallelism, verbose, render_secrets=operation == "apply", operation=operation
    )
    ctx.take_over = take_over
    try:
        if ctx.lock is not None and ctx.lock.notice:
            click.echo(f"Note: {ctx.lock.notice}", err=True)
        p = make_plan(ctx)
        if not as_json:
            print_plan(p, destroying=operation == "destroy")
        if p.problems:
            from provision.core.errors import EXIT_UNREACHABLE

            e = ProvisionError(p.problems[0] + " (nothing was changed on any host)", details=p.problems[1:])
            if p.unreachable:
                _report_unreachable(p)
                e.exit_code = EXIT_UNREACHABLE
            raise e
        outcomes = {}
        if p.changed:
            if not auto_approve:
                _confirm(operation, question)
            outcomes = execute(ctx, p, progress=_progress)
        if as_json:
            click.echo(
                _json.dumps(
                    {"format_version": 2, "plan": p.to_json(), "outcome": {n: o.__dict__ for n, o in outcomes.items()}},
                    indent=1,
                )
            )
        else:
            print_outcome(ctx, p, outcomes, operation)
        _report_unreachable(p, outcomes)
        return _exit_for(p, outcomes)
    finally:
        ctx.close()


@main.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--detailed-exitcode", is_flag=True, help="Exit 2 when there are changes (0 none, 1 error, 3 unreachable)."
)
@click.option(
    "--replace", multiple=True, metavar="TASK", help="Plan to restart TASK even if nothing changed (repeatable)."
)
@click.option(
    "--skip-checks", is_flag=True, help="Leave out the pre-flight checks (GPUs, ports, clock, disk: `provision check`)."
)
def plan(inventory, state_path, targets, parallelism, verbose, as_json, detailed_exitcode, replace, skip_checks):
    """Show what apply would change on the hosts, drift included. Changes nothing."""
    from provision.cli.output import print_plan
    from provision.core.errors import EXIT_CHANGES
    from provision.run.planning import build_plan

    ctx = _context(inventory, state_path, targets, parallelism, verbose)
    try:
        p = build_plan(ctx, replace=set(replace), checks=not skip_checks)
    finally:
        ctx.close()
    if as_json:
        click.echo(_json.dumps(p.to_json(), indent=1))
    else:
        print_plan(p)
    for problem in p.problems:  # what would refuse the apply, where scripts look for errors
        click.echo(click.style(f"Error: {problem}", fg="red"), err=True)
    _report_unreachable(p)
    code = _exit_for(p)
    if code == 0 and detailed_exitcode and p.changed:
        code = EXIT_CHANGES
    sys.exit(code)


@main.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--skip-network", is_flag=True, help="Only the per-host checks: no listeners, no connections.")
def check(inventory, state_path, targets, parallelism, verbose, as_json, skip_network):
    """Pre-flight: GPUs healthy and as declared, the job's ports free, clocks, disk, and every
    task able to reach the addresses it will dial. Changes nothing.

    Exit 0 when every check passes (warnings allowed), 1 when one fails, 3 when a host is unreachable.
    """
    from provision.cli.output import table
    from provision.run.check import run_check, summary, table_rows

    ctx = _context(inventory, state_path, targets, parallelism, verbose, render_secrets=False)
    try:
        res = run_check(ctx, skip_network=skip_network, progress=_progress)
    finally:
        ctx.close()
    if as_json:
        click.echo(_json.dumps(res.to_json(), indent=1))
    else:
        color = {"fail": "red", "warn": "yellow"}
        lines = table(table_rows(res))
        click.echo(lines[0])
        for f, line in zip(res.findings, lines[1:]):
            click.echo(click.style(line, fg=color.get(f.status.value)))
        for f in res.failed:
            line = f.detail if f.check == "network" else f"{f.host}: {f.detail}"
            click.echo(click.style(f"Failed: {line}", fg="red"))
        click.echo(summary(res))
    _report_unreachable(res.plan)
    sys.exit(res.exit_code)


@main.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("-y", "--auto-approve", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and the outcome as JSON.")
@click.option("--replace", multiple=True, metavar="TASK", help="Restart TASK even if nothing changed (repeatable).")
@click.option("--wait", "wait_after", is_flag=True, help="After applying, wait until the job succeeds or fails.")
@click.option("--logs", "stream_logs", is_flag=True, help="With --wait: stream the tasks' output while waiting.")
@click.option("--timeout", type=float, default=None, help="With --wait or --queue: give up after this many seconds.")
@click.option(
    "--queue",
    is_flag=True,
    help="When other jobs hold the GPUs or ports this job needs, wait until it fits, then apply.",
)
@click.option("--take-over", is_flag=True, help="Apply a job that another state (operator) applied, and own it.")
@click.option("--rerun", is_flag=True, help="Start a finished (Succeeded or Failed) job again, whole.")
@click.option("--force-setup", is_flag=True, help="Run the job's setup on its hosts even if it did not change.")
@click.option(
    "--partial", is_flag=True, help="Restart the reachable part of a synchronous job even when a host of it is down."
)
@click.option(
    "--skip-checks", is_flag=True, help="Leave out the pre-flight checks (GPUs, ports, clock, disk: `provision check`)."
)
def apply(
    inventory,
    state_path,
    targets,
    parallelism,
    verbose,
    auto_approve,
    as_json,
    replace,
    wait_after,
    timeout,
    queue,
    take_over,
    rerun,
    partial,
    stream_logs,
    force_setup,
    skip_checks,
):
    """Make the hosts match INVENTORY: plan, ask, then write files and start tasks.

    A second apply with nothing changed does nothing.
    """
    import time

    from provision.run.apply import apply_plan
    from provision.run.planning import build_plan

    began = time.time()
    from provision.run.queue import Queue

    q = Queue(timeout=timeout if queue else 0, progress=_progress) if queue else None

    def make(ctx):
        def one():
            return build_plan(
                ctx,
                replace=set(replace),
                rerun=rerun,
                partial=partial,
                force_setup=force_setup,
                checks=not skip_checks,
            )

        return one() if q is None else q.plan(one)

    def execute(ctx, p, progress):
        outcomes = apply_plan(ctx, p, progress)
        # Lost a race for a GPU or port to another apply: with --queue, plan again and retry.
        while q is not None and any(o.lost_race for o in outcomes.values()) and not q.expired():
            progress("another apply took GPUs or ports first: planning again")
            p = make(ctx)
            outcomes = apply_plan(ctx, p, progress)
        return outcomes

    code = _change(
        inventory,
        state_path,
        targets,
        parallelism,
        verbose,
        operation="apply",
        auto_approve=auto_approve,
        as_json=as_json,
        make_plan=make,
        execute=execute,
        question="Do you want to perform these actions?",
        take_over=take_over,
    )
    if wait_after and code == 0:
        from provision.cli.progress import wait_job

        code = wait_job(
            inventory,
            state_path=state_path,
            timeout=timeout,
            verbose=verbose,
            logs=stream_logs,
            since=f"@{began:.3f}",  # this run's lines (the hosts' clocks are taken to agree)
        )
    sys.exit(code)


@main.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("-y", "--auto-approve", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and outcome as JSON.")
@click.option("--take-over", is_flag=True, help="Destroy a job that another state (operator) applied.")
@click.option("--remove-images", is_flag=True, help="Also remove the container pools' images from the hosts.")
def destroy(inventory, state_path, targets, parallelism, verbose, auto_approve, as_json, take_over, remove_images):
    """Stop the job's tasks (reverse start order) and remove everything provision put on the hosts."""
    import functools

    from provision.run.destroy import destroy as engine_destroy
    from provision.run.destroy import destroy_plan

    do_destroy = functools.partial(engine_destroy, remove_images=remove_images)

    sys.exit(
        _change(
            inventory,
            state_path,
            targets,
            parallelism,
            verbose,
            operation="destroy",
            auto_approve=auto_approve,
            as_json=as_json,
            make_plan=destroy_plan,
            execute=do_destroy,
            question="Destroy the job on these hosts?",
            take_over=take_over,
        )
    )


@main.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the jobs and hosts as JSON.")
def jobs(inventory, state_path, targets, parallelism, verbose, as_json):
    """Every provision job on INVENTORY's hosts: owner, state, since; GPUs and ports held, and free.

    Reads only: works from anyone's machine, whoever applied the jobs.
    """
    import time

    from provision.cli.output import table
    from provision.core.target import HostError
    from provision.rules.tenancy import HostView, host_view, jobs_json, jobs_lines
    from provision.run.context import Ask, probe

    ctx = _context(inventory, state_path, targets, parallelism, verbose, render_secrets=False)
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
        click.echo(_json.dumps(jobs_json(views, now), indent=1))
    else:
        jobs_rows, host_rows = jobs_lines(views, now)
        if len(jobs_rows) == 1:
            click.echo("No provision jobs on these hosts.")
        else:
            for line in table(jobs_rows):
                click.echo(line)
        click.echo()
        for line in table(host_rows):
            click.echo(line)
    unreachable = [v for v in views if v.error is not None]
    sys.exit(3 if unreachable else 0)


@main.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
def facts(inventory, state_path, targets, parallelism, verbose, as_json):
    """Report per host: OS, CPUs, memory, GPUs (nvidia-smi), TPU chips, systemd; flag mismatches."""
    from provision.cli.output import table
    from provision.core.target import HostError
    from provision.rules.facts import mismatches, summary_row
    from provision.run.context import Ask, probe

    ctx = _context(inventory, state_path, targets, parallelism, verbose, render_secrets=False)
    try:
        res = probe(ctx, Ask(facts="all", files=False))
    finally:
        ctx.close()
    reports = {n: res.get(n) for n in ctx.targets}
    hosts = {h.name: h for h in ctx.inventory.hosts}
    rows, data, unreachable, bad = (
        [("HOST", "OS", "CPUS", "MEMORY", "GPUS", "MODEL", "TPU", "SYSTEMD", "CHECK")],
        {},
        [],
        False,
    )
    for name, r in reports.items():
        if isinstance(r, HostError):
            data[name] = {"error": r.message, "problems": []}
            rows.append((name, "-", "-", "-", "-", "-", "-", "-", r.message))
            if r.unreachable:
                unreachable.append(name)
            bad = True
            continue
        f = r.facts or {}
        problems = mismatches(hosts[name], f) if name in hosts else []
        bad = bad or bool(problems)
        row = summary_row(name, f)
        data[name] = {**row, "problems": problems}
        rows.append(
            (
                name,
                row["os"] or "-",
                str(row["cpus"]),
                f"{row['memory_gib']} GiB",
                str(row["gpus"]),
                row["gpu_model"] or "-",
                str(row["tpu_chips"]),
                row["systemd"] or "none",
                "; ".join(problems) or "ok",
            )
        )
    if as_json:
        click.echo(_json.dumps({"format_version": 1, "hosts": data}, indent=1))
    else:
        for line in table(rows):
            click.echo(line)
    if unreachable:
        click.echo(f"Unreachable: {', '.join(unreachable)}", err=True)
        sys.exit(3)
    sys.exit(1 if bad else 0)


@main.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option(
    "--watch", is_flag=True, help="Refresh every 2 seconds until the job ends or Ctrl-C (in place on a terminal)."
)
def status(inventory, state_path, targets, parallelism, verbose, as_json, watch):
    """Job phase (Pending, Running, Succeeded, Failed) and every task's state. One round trip per host."""
    import time

    from provision.cli.output import status_lines
    from provision.cli.progress import Display
    from provision.run.jobend import collect

    disp = Display(sys.stdout)
    ctx = _context(inventory, state_path, targets, parallelism, verbose, render_secrets=False)
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
            click.echo(f"Unreachable: {h}: {why.get(h, 'host unreachable')}", err=True)
        sys.exit(3)


@main.command()
@click.argument("inventory", type=click.Path())
@click.argument("tasks", nargs=-1, metavar="[TASK]...", shell_complete=_complete_tasks)
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
def logs(
    inventory, tasks, state_path, targets, parallelism, verbose, follow, since, tail, out_dir, timestamps, setup_logs
):
    """The job's task output (journald) from all hosts, merged in time order.

    Each line starts with TASK@HOST. TASK... limits to those tasks. Exit 3 when a host was
    unreachable (the other hosts' lines are still shown).
    """
    from provision.run.logs import run_logs, run_setup_logs

    if setup_logs:
        sys.exit(
            run_setup_logs(
                inventory,
                state_path=state_path,
                targets=tuple(targets),
                parallelism=parallelism,
                verbose=verbose,
                tail=tail,
            )
        )

    sys.exit(
        run_logs(
            inventory,
            tuple(tasks),
            state_path=state_path,
            targets=tuple(targets),
            parallelism=parallelism,
            verbose=verbose,
            since=since,
            tail=tail,
            follow=follow,
            out_dir=out_dir,
            timestamps=timestamps,
        )
    )


@main.command()
@click.argument("inventory", type=click.Path())
@click.option("--state", "state_path", type=click.Path(), help="State file.")
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds (exit 1).")
@click.option("-v", "--verbose", is_flag=True, help="Show the SSH commands.")
@click.option("--logs", "stream_logs", is_flag=True, help="Stream the tasks' output while waiting.")
def wait(inventory, state_path, timeout, verbose, stream_logs):
    """Block until the job succeeds (exit 0) or fails (exit 1), showing each task's progress."""
    from provision.cli.progress import wait_job

    sys.exit(wait_job(inventory, state_path=state_path, timeout=timeout, verbose=verbose, logs=stream_logs))


@main.command("force-unlock")
@click.argument("inventory", type=click.Path())
@click.argument("lock_id")
@click.option("--state", "state_path", type=click.Path(), help="State file.")
def force_unlock(inventory, lock_id, state_path):
    """Remove a lock left by an apply that died on another machine (LOCK_ID from the error)."""
    from pathlib import Path

    from provision.io.state import default_state_path
    from provision.io.state import force_unlock as unlock
    from provision.spec.inventory import load

    inv = load(inventory)
    sp = Path(state_path) if state_path else default_state_path(Path(inventory), inv.job)
    holder = unlock(sp, lock_id)
    click.echo(f"Removed the lock: {holder.describe()}")


from provision.cli.sandboxcmd import sandbox  # noqa: E402

main.add_command(sandbox)

from provision.cli.importcmd import import_group  # noqa: E402

main.add_command(import_group, name="import")

from provision.cli.everyday import exec_cmd, init_cmd, ssh_cmd  # noqa: E402

main.add_command(exec_cmd)
main.add_command(ssh_cmd)
main.add_command(init_cmd)
