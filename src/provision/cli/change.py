"""Commands that change hosts or judge them first: plan, apply, destroy, stop, check."""

from __future__ import annotations

import functools
import json as _json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from provision.cli.common import (
    confirm,
    exit_code,
    host_options,
    open_ctx,
    progress_line,
    report_unreachable,
)
from provision.cli.output import change_json, print_outcome, print_plan, stop_lines, stoppable, summary_line, table
from provision.cli.progress import phase_line, wait_job
from provision.core.errors import EXIT_CHANGES, EXIT_UNREACHABLE, ProvisionError
from provision.core.lifecycle import TaskState
from provision.core.text import printable
from provision.host import layout
from provision.placement.tasks import PlacementError
from provision.rules import provenance
from provision.rules.fabric import CHOICES as BANDWIDTH_TOOLS
from provision.rules.plan import Plan
from provision.run import firstapply
from provision.run.apply import HostOutcome, adopt_hosts, apply_plan
from provision.run.check import run_check, summary, table_rows
from provision.run.context import Context
from provision.run.destroy import destroy as engine_destroy
from provision.run.destroy import destroy_plan
from provision.run.jobend import end_job, look, stop_marker
from provision.run.planning import build_plan
from provision.run.queue import Queue, ledger_marks
from provision.run.recover import recover_first, started_again

if TYPE_CHECKING:  # types only: the preemption step loads only for an apply that is held
    from provision.run.preempt import Preemptor


def note_change(ctx: Context, operation: str, summary: str) -> None:
    """Keep who changed what in the state's history (`provision state history`); a history
    that cannot be written is a warning: the change itself is saved."""
    try:
        ctx.state.note(ctx.owner.who, operation, summary)
    except ProvisionError as e:
        click.echo(click.style(f"Warning: {printable(e.message)}", fg="yellow"), err=True)
    except OSError as e:
        click.echo(click.style(f"Warning: cannot add to the state's history: {e}", fg="yellow"), err=True)


def _change(
    ctx: Context,
    *,
    operation: str,
    auto_approve: bool,
    as_json: bool,
    make_plan: Callable[[Context], Plan],
    execute: Callable[..., dict[str, HostOutcome]],
    question: str,
    force_conflicts: bool = False,
) -> int:
    """apply and destroy on an opened (and locked) Context: plan, show, confirm, execute,
    report; returns the exit code. The caller closes the Context."""
    if ctx.lock is not None and ctx.lock.notice:
        click.echo(f"Note: {printable(ctx.lock.notice)}", err=True)
    p = make_plan(ctx)
    if not as_json:
        print_plan(p, destroying=operation == "destroy")
    _refuse_problems(p)
    outcomes: dict[str, HostOutcome] = {}
    if p.changed:
        if operation == "apply" and not force_conflicts:
            _theirs_confirmed(p)
        if not auto_approve:
            confirm(operation, question)
        outcomes = execute(ctx, p, progress=progress_line)
        note_change(ctx, operation, summary_line(p, outcomes, operation) or "")
    elif operation == "apply":
        adopt_hosts(ctx, p, pending_only=True)  # an apply whose last save failed left them pending
    if as_json:
        click.echo(_json.dumps(change_json(p, outcomes), indent=1))
    else:
        print_outcome(ctx, p, outcomes, operation)
    report_unreachable(p, outcomes)
    return exit_code(p, outcomes)


def _refuse_problems(p: Plan, cleared: bool = False) -> None:
    """A plan with problems changes nothing (`cleared`: what a first apply wrote was taken
    off again before this plan was made)."""
    if p.problems:
        said = "the hosts this apply wrote were cleared" if cleared else "nothing was changed on any host"
        e = ProvisionError(f"{p.problems[0]} ({said})", details=p.problems[1:])
        if p.unreachable:
            report_unreachable(p)
            e.exit_code = EXIT_UNREACHABLE
        raise e


def _theirs_confirmed(p: Plan) -> None:
    """A plan that replaces content another identity applied (rules/provenance.py) goes ahead
    only when asked and answered here: -y does not answer it, --force-conflicts does."""
    if not provenance.theirs(p):
        return
    if not sys.stdin.isatty():
        raise ProvisionError(provenance.refusal(p))
    if not click.confirm(f"\n{printable(provenance.question(p))}", default=False):
        click.echo("Apply cancelled: nothing was changed.")
        sys.exit(1)


@click.command()
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
def plan(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    as_json: bool,
    detailed_exitcode: bool,
    replace: tuple[str, ...],
    skip_checks: bool,
) -> None:
    """Show what apply would change on the hosts, drift included. Changes nothing."""

    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose)
    try:
        p = build_plan(ctx, replace=set(replace), checks=not skip_checks)
    finally:
        ctx.close()
    if as_json:
        click.echo(_json.dumps(p.to_json(), indent=1))
    else:
        print_plan(p)
    for problem in p.problems:  # what would refuse the apply, where scripts look for errors
        click.echo(click.style(f"Error: {printable(problem)}", fg="red"), err=True)
    report_unreachable(p)
    code = exit_code(p)
    if code == 0 and detailed_exitcode and p.changed:
        code = EXIT_CHANGES
    sys.exit(code)


@click.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--skip-network", is_flag=True, help="Only the per-host checks: no listeners, no connections.")
@click.option(
    "--bandwidth", is_flag=True, help="Instead: the all-reduce bus bandwidth between the hosts, against the baseline."
)
@click.option(
    "--bandwidth-tool",
    type=click.Choice(BANDWIDTH_TOOLS),
    default="auto",
    show_default=True,
    help="With --bandwidth: what measures it (auto: nccl-tests, else torch, else provision's stream test).",
)
@click.option("--new-baseline", is_flag=True, help="With --bandwidth: a healthy measurement replaces the baseline.")
def check(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    as_json: bool,
    skip_network: bool,
    bandwidth: bool,
    bandwidth_tool: str,
    new_baseline: bool,
) -> None:
    """Pre-flight: GPUs healthy and as declared, the job's ports free, clocks, disk, and every
    task able to reach the addresses it will dial. Changes nothing. With --bandwidth, the
    fabric between the hosts instead (rounds of all-reduce tests; a slow host named).

    Exit 0 when every check passes (warnings allowed), 1 when one fails, 3 when a host is unreachable.
    """

    if not bandwidth and (bandwidth_tool != "auto" or new_baseline):
        raise ProvisionError(f"{'--new-baseline' if new_baseline else '--bandwidth-tool'} goes with --bandwidth")
    if bandwidth:
        # Start-up time: the fabric's modules load only for --bandwidth.
        from provision.cli.fabriccmd import bandwidth_check

        bandwidth_check(inventory, state_path, targets, parallelism, verbose, as_json, bandwidth_tool, new_baseline)
        return
    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose, render_secrets=False)
    try:
        res = run_check(ctx, skip_network=skip_network, progress=progress_line)
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
            click.echo(click.style(f"Failed: {printable(line)}", fg="red"))
        click.echo(summary(res))
    report_unreachable(res.plan)
    sys.exit(res.exit_code)


def _setup_line(host: str, line: str) -> None:
    click.echo(f"setup@{host} | {printable(line)}")  # as `provision logs --setup` prints it


class _Applying:
    """apply's plan and apply steps with its flags; with --queue, planned until the job fits,
    and planned again when another apply took GPUs or ports first."""

    def __init__(
        self,
        queue: Queue | None,
        setup_lines: Callable[[str, str], None] | None = None,
        approved: tuple[bool, bool] = (False, False),
        **plan_flags: Any,
    ):
        self.queue = queue
        self.setup_lines = setup_lines  # --wait --logs: the setup's output as it runs
        self.flags = plan_flags
        self.auto_approve, self.force_conflicts = approved  # -y, --force-conflicts
        self.presumed: firstapply.Presumed | None = None  # a first apply planned without a probe

    def plan(self, ctx: Context) -> Plan:
        if self.queue is None and firstapply.eligible(ctx, auto_approve=self.auto_approve, flags=self.flags):
            self.presumed = firstapply.presumed_plan(ctx, checks=bool(self.flags.get("checks")))
            if self.presumed is not None:
                return self.presumed.plan
        pre: list[Preemptor] = []  # this plan's preemption step, made when first held

        def make() -> Plan:
            recover_first(ctx, progress_line)  # a run that broke: stopped, its failed host set aside (run/recover.py)
            return build_plan(ctx, **self.flags, whole=progress_line)  # preempted whole first (run/victim.py)

        def one() -> Plan:
            if pre:
                return pre[0].planned(make)
            try:
                return make()
            except PlacementError as e:
                if not e.held:
                    raise
                held = e
            # Held by other work: lower-priority work leaves. Loaded only here:
            # run/preempt and rules/preemption cost every apply's start-up ~6 ms of import.
            from provision.run.preempt import Preemptor

            pre.append(Preemptor(ctx, progress_line))
            return pre[0].planned(make, held=held)

        return one() if self.queue is None else self.queue.plan(one)

    def apply(self, ctx: Context, p: Plan, progress: Callable[[str], None]) -> dict[str, HostOutcome]:
        pre, self.presumed = self.presumed, None
        if pre is not None and p is pre.plan:

            def vet(again: Plan, cleared: bool) -> None:  # as _change vets the plan it shows
                _refuse_problems(again, cleared)
                if not self.force_conflicts:
                    _theirs_confirmed(again)

            def again() -> dict[str, HostOutcome]:  # as an apply that probes first, every host
                self.auto_approve = False
                p = self.plan(ctx)
                vet(p, True)
                return self.apply(ctx, p, progress)

            checks = bool(self.flags.get("checks"))
            return firstapply.execute(ctx, pre, progress, checks=checks, again=again, vet=lambda p: vet(p, False))
        outcomes = apply_plan(ctx, p, progress, self.setup_lines)
        while self.queue is not None and any(o.lost_race for o in outcomes.values()) and not self.queue.expired():
            progress("another apply took GPUs or ports first: planning again")
            outcomes = apply_plan(ctx, self.plan(ctx), progress, self.setup_lines)
        placed = [o for n, o in outcomes.items() if n in ctx.rendered.hosts]
        started_again(ctx, any(o.error for o in placed), progress)  # a recovery's start (run/recover.py)
        return outcomes


def _detach(params: dict[str, Any]) -> None:
    """`apply --queue --detach`: handed to the service (cli/servecmd.py)."""
    # Here: the service's modules load only for work handed to it (start-up of every apply).
    from provision.cli.servecmd import detach_apply

    detach_apply(params)


@click.command()
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
@click.option("--detach", is_flag=True, help="With --queue: hand the queued apply to the service (`provision serve`).")
@click.option("--take-over", is_flag=True, help="Apply a job that another state (operator) applied, and own it.")
@click.option(
    "--force-conflicts",
    is_flag=True,
    help="Replace content a teammate applied to the hosts since (plan names it) without asking; -y alone does not.",
)
@click.option("--rerun", is_flag=True, help="Start a finished (Succeeded or Failed) job again, whole.")
@click.option("--force-setup", is_flag=True, help="Run the job's setup on its hosts even if it did not change.")
@click.option(
    "--partial", is_flag=True, help="Restart the reachable part of a synchronous job even when a host of it is down."
)
@click.option(
    "--skip-checks", is_flag=True, help="Leave out the pre-flight checks (GPUs, ports, clock, disk: `provision check`)."
)
def apply(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    auto_approve: bool,
    as_json: bool,
    replace: tuple[str, ...],
    wait_after: bool,
    timeout: float | None,
    queue: bool,
    detach: bool,
    take_over: bool,
    force_conflicts: bool,
    rerun: bool,
    partial: bool,
    stream_logs: bool,
    force_setup: bool,
    skip_checks: bool,
) -> None:
    """Make the hosts match INVENTORY: plan, ask, then write files and start tasks; a second
    apply with nothing changed does nothing."""
    if detach:
        return _detach(click.get_current_context().params)
    began = time.time()
    ctx = open_ctx(inventory, state_path, targets, parallelism, verbose, operation="apply", take_over=take_over)
    q = Queue(timeout=timeout if queue else 0, progress=progress_line, mark=ledger_marks(ctx)) if queue else None
    lines = _setup_line if wait_after and stream_logs else None
    flags = {"replace": set(replace), "rerun": rerun, "partial": partial, "force_setup": force_setup}
    how = _Applying(q, lines, (auto_approve, force_conflicts), **flags, checks=not skip_checks)
    try:
        code = _change(
            ctx,
            operation="apply",
            auto_approve=auto_approve,
            as_json=as_json,
            make_plan=how.plan,
            execute=how.apply,
            question="Do you want to perform these actions?",
            force_conflicts=force_conflicts,
        )
        if wait_after and code == 0:
            ctx.release_lock()  # a wait may take hours: other operators may plan meanwhile
            code = wait_job(
                ctx,
                timeout=timeout,
                logs=stream_logs,
                since=f"@{began:.3f}",  # this run's lines (the hosts' clocks are taken to agree)
            )
    finally:
        if q is not None:
            q.done()  # its queue marks, where the apply's reservation did not replace them
        ctx.close()
    sys.exit(code)


@click.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("-y", "--auto-approve", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and outcome as JSON.")
@click.option("--take-over", is_flag=True, help="Destroy a job that another state (operator) applied.")
@click.option("--remove-images", is_flag=True, help="Also remove the container pools' images from the hosts.")
def destroy(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    auto_approve: bool,
    as_json: bool,
    take_over: bool,
    remove_images: bool,
) -> None:
    """Stop the job's tasks (reverse start order) and remove everything provision put on the hosts."""

    do_destroy = functools.partial(engine_destroy, remove_images=remove_images)

    ctx = open_ctx(
        inventory,
        state_path,
        targets,
        parallelism,
        verbose,
        render_secrets=False,
        operation="destroy",
        take_over=take_over,
    )
    try:
        code = _change(
            ctx,
            operation="destroy",
            auto_approve=auto_approve,
            as_json=as_json,
            make_plan=destroy_plan,
            execute=do_destroy,
            question="Destroy the job on these hosts?",
        )
    finally:
        ctx.close()
    sys.exit(code)


@click.command()
@click.argument("inventory", type=click.Path())
@host_options
@click.option("-y", "--auto-approve", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Print what was stopped as JSON.")
@click.option(
    "--hold", is_flag=True, help="Keep the job's GPUs and ports reserved for its rerun (default: free them for others)."
)
@click.option("--take-over", is_flag=True, help="Stop a job that another state (operator) applied.")
def stop(
    inventory: str,
    state_path: str | None,
    targets: tuple[str, ...],
    parallelism: int | None,
    verbose: bool,
    auto_approve: bool,
    as_json: bool,
    hold: bool,
    take_over: bool,
) -> None:
    """End the job's tasks (evaluator first, ps last; SIGTERM, then SIGKILL after the pool's
    grace_period) and keep its files, logs and state. `apply --rerun` starts it again."""

    if targets:
        raise ProvisionError("stop ends the whole job: --target is not supported (destroy or drain a host instead)")
    ctx = open_ctx(
        inventory,
        state_path,
        targets,
        parallelism,
        verbose,
        render_secrets=False,
        operation="stop",
        take_over=take_over,
    )
    try:
        code = _stop(ctx, auto_approve=auto_approve, as_json=as_json, hold=hold)
    finally:
        ctx.close()
    sys.exit(code)


def _stop(ctx: Context, *, auto_approve: bool, as_json: bool, hold: bool) -> int:  # noqa: C901  stop's dialogue as the user reads it: what to stop, ask, end, report, the unreachable hosts
    if ctx.lock is not None and ctx.lock.notice:
        click.echo(f"Note: {printable(ctx.lock.notice)}", err=True)
    st, foreign = look(ctx)
    if foreign is not None:
        raise ProvisionError(foreign)
    if st.tasks and all(t.detail == "not applied" for t in st.tasks):
        raise ProvisionError(f"job {st.job} is not on its hosts: nothing to stop")
    live = stoppable(st)
    stopped: list[str] = []
    if st.phase.ended and not live:
        if not as_json:
            click.echo(f"Nothing to stop: job {st.phase}" + (f" ({printable(st.reason)})." if st.reason else "."))
    elif not live:
        if not as_json:
            click.echo(f"Nothing to stop: no task of job {st.job} runs on the hosts that answered.")
    else:
        if not as_json:
            for line in stop_lines(st, ctx.where, hold=hold):
                click.echo(line)
        if not auto_approve:
            confirm("stop", "Stop these tasks?")
        marker = None if st.phase.ended else stop_marker(ctx)  # an ended job keeps its outcome
        stopped = [layout.task_of_unit(st.job, u) for u in end_job(ctx, st, marker=marker, hold=hold)]
        st, _ = look(ctx)
        note_change(ctx, "stop", f"Stopped {len(stopped)} task{'s' if len(stopped) != 1 else ''}. {phase_line(st)}")
    if as_json:
        out = {"format_version": 1, "job": st.job, "stopped": stopped, "held": hold and bool(stopped)}
        click.echo(_json.dumps({**out, "status": st.to_json()}, indent=1))
    elif stopped:
        click.echo(f"\nStopped {len(stopped)} task{'s' if len(stopped) != 1 else ''}. {phase_line(st)}")
        click.echo(f"Files, logs and state are kept: `provision apply --rerun {ctx.where}` starts the job again.")
    for h in st.unreachable:
        why = next((t.detail for t in st.tasks if t.host == h and t.state is TaskState.UNKNOWN), "unreachable")
        click.echo(click.style(f"Unreachable: {h}: {printable(why)}", fg="red"), err=True)
    if st.unreachable:
        click.echo(click.style("Its tasks there were not stopped; run stop again when it is back.", fg="red"), err=True)
        return EXIT_UNREACHABLE
    return 0
