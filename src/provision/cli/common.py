"""What the commands that talk to hosts share: their flags, opening the Context, the
confirmation prompt, the exit code, the unreachable hosts' lines."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

import click

from provision.core.errors import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, ProvisionError, no_color
from provision.core.text import printable
from provision.run.context import Context, open_context
from provision.run.remote import complete_tasks as complete_tasks  # re-exported: TASK completion

if TYPE_CHECKING:  # types only: `status` and `logs` need not load apply's code
    from provision.rules.plan import Plan
    from provision.run.apply import HostOutcome

F = TypeVar("F", bound=Callable[..., object])


def host_options(fn: F) -> F:
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


def progress_line(line: str) -> None:
    # From the hosts' threads: click's context (and its colour setting) is the main thread's.
    click.echo(click.style("  ... ", dim=True) + printable(line), err=True, color=False if no_color() else None)


def open_ctx(
    inventory: str,
    state_path: str | None,
    targets: Iterable[str],
    parallelism: int | None,
    verbose: bool,
    *,
    render_secrets: bool = True,
    operation: str | None = None,
    take_over: bool = False,
    files_here: bool = True,
) -> Context:
    """The command's Context (run/context.open_context); `files_here` False for the
    commands that only read the job: they need none of the `files:` it pushes."""
    return open_context(
        inventory,
        state_path=state_path,
        only=tuple(targets),
        parallelism=parallelism,
        verbose=verbose,
        render_secrets=render_secrets,
        operation=operation,
        take_over=take_over,
        files_here=files_here,
    )


def exit_code(plan: Plan, outcomes: Mapping[str, HostOutcome] | None = None) -> int:
    unreachable = bool(plan.unreachable) or any(o.unreachable for o in (outcomes or {}).values())
    if unreachable:
        return EXIT_UNREACHABLE
    if any(h.error or h.problems for h in plan.hosts) or any(o.error for o in (outcomes or {}).values()):
        return EXIT_ERROR
    return EXIT_OK


def confirm(verb: str, question: str) -> None:
    """Terraform's rule: only 'yes' goes ahead; without a terminal, -y is required."""
    if not sys.stdin.isatty():
        raise ProvisionError(f"{verb} needs confirmation; run with -y/--auto-approve when there is no terminal")
    if click.prompt(f"\n{question} Only 'yes' will be accepted", default="", show_default=False) != "yes":
        click.echo(f"{verb.capitalize()} cancelled.")
        sys.exit(1)


def report_unreachable(plan: Plan, outcomes: Mapping[str, HostOutcome] | None = None) -> None:
    """One line per unreachable host with its reason; past 10 hosts, a count per reason."""
    why = {h.name: h.error.message for h in plan.unreachable if h.error is not None}
    for o in (outcomes or {}).values():
        if o.unreachable:
            why.setdefault(o.name, o.error or "unreachable")  # an unreachable host always has its error
    if not why:
        return
    if len(why) <= 10:
        for name in sorted(why):
            click.echo(click.style(f"Unreachable: {name}: {printable(why[name])}", fg="red"), err=True)
    else:
        by_reason: dict[str, list[str]] = {}
        for name, reason in why.items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            names.sort()
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            click.echo(
                click.style(
                    f"Unreachable: {len(names)} host{'s' if len(names) != 1 else ''} ({shown}): {printable(reason)}",
                    fg="red",
                ),
                err=True,
            )
    click.echo(click.style("The other hosts were handled; run again when these are back.", fg="red"), err=True)
