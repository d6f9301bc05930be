"""Human output: a Terraform-like plan, summaries and tables. Colour only on a terminal."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import click

from provision.cli.progress import failed_lines
from provision.core.imagechange import ImageChange
from provision.core.lifecycle import Action, JobPhase, TaskState, stop_rank
from provision.core.recovery import goodput_words, incident_words
from provision.core.text import duration, printable
from provision.host.protocol import Reservation
from provision.rules import provenance
from provision.rules.checkpoints import line as copy_line
from provision.rules.plan import FileAction, FileChange, Plan, TaskChange
from provision.rules.status import JobStatus, TaskStatus
from provision.run.apply import HostOutcome
from provision.run.context import Context

COLOR = {"+": "green", "~": "yellow", "-": "red", "!": "magenta"}
VERB = {Action.START: "start", Action.RESTART: "restart", Action.STOP: "stop and remove"}


def _line(sym: str, text: str) -> str:
    return click.style(f"  {sym} ", fg=COLOR.get(sym), bold=True) + text


def plan_lines(plan: Plan, *, verbose_diff: bool = True, destroying: bool = False) -> list[str]:  # noqa: C901  one branch per kind of change a host's plan lists (task, file, image, reservation, setup)
    out: list[str] = []
    for hp in plan.hosts:
        if hp.error is not None:
            out.append(click.style(f"# {hp.error.target.where}: {printable(hp.error.message)}", fg="red"))
            continue
        for p in hp.problems:
            out.append(click.style(f"# {hp.target.where}: {printable(p)}", fg="red"))
        if not hp.changed:
            continue
        title = f"# {hp.target.where}"
        if hp.bundle is None and not destroying:
            title += " (the job leaves this host)"
        out.append(click.style(title, bold=True))
        for path, other in hp.shared:
            out.append(_line("=", f"file {path} (the same file as job {printable(other)}'s: shared, not written)"))
        if hp.setup_done and hp.bundle is not None and hp.bundle.setup is not None:
            out.append(_line("=", f"setup: {hp.setup_done} (not run again)"))
        for r in hp.resources():  # exactly what the summary counts (HostPlan.resources)
            item = r.item
            if isinstance(item, TaskChange):
                drift = click.style(" [drift]", fg="magenta") if item.drift else ""
                why = "destroy" if destroying else item.why
                out.append(_line(r.symbol, f"task {item.task}: {VERB[item.action]} ({why}){drift}"))
            elif isinstance(item, FileChange):
                drift = click.style(" [drift]", fg="magenta") if item.drift else ""
                why = "destroy" if destroying and item.action is FileAction.DELETE else item.reason
                theirs = click.style(f": {printable(provenance.describe(item))}", fg="magenta") if item.replaces else ""
                out.append(_line(r.symbol, f"{item.kind} {item.path} ({why}){drift}{theirs}"))
                if verbose_diff and item.diff:
                    for dl in item.diff.rstrip("\n").split("\n"):
                        bare = dl.lstrip()
                        color = "green" if bare.startswith("+") else "red" if bare.startswith("-") else None
                        out.append("      " + click.style(printable(dl), fg=color))  # a host file's lines
            elif isinstance(item, ImageChange):
                out.append(_line(r.symbol, item.line()))
            elif isinstance(item, Reservation):
                held = ", ".join(x for x in (f"GPUs {item.gpus}" if item.gpus else "", f"ports {item.ports}") if x)
                out.append(_line(r.symbol, f"ledger: reserve {held.replace('[', '').replace(']', '')}"))
            else:
                out.append(_line(r.symbol, f"setup: run ({item})"))
        out.append("")
    return out


def print_plan(plan: Plan, *, destroying: bool = False) -> None:
    for hp in plan.hosts:  # on stderr, before the plan: they matter before the question
        for w in hp.warnings:
            click.echo(click.style(f"Warning: {printable(w)}", fg="yellow"), err=True)
    lines = plan_lines(plan, destroying=destroying)
    if plan.changed:
        click.echo("provision will perform the following actions:\n")
    for line in lines:
        click.echo(line)
    if plan.changed:
        click.echo(click.style(plan.summary(), bold=True))
        theirs = provenance.summary(plan)
        if theirs is not None and not destroying:
            click.echo(click.style(printable(theirs), fg="magenta"))
        if not plan.errors and plan.finished():
            click.echo(
                f"The job is finished ({plan.finished()}): these changes are written and nothing starts. "
                "`provision apply --rerun` runs it again with them."
            )
    elif not plan.errors and plan.finished():
        click.echo(
            f"No changes: {plan.finished()}, and a finished job is not started again. "
            "`provision apply --rerun` runs it again."
        )
    elif not plan.errors:
        click.echo("No changes. The hosts match the inventory.")
    else:
        click.echo(plan.summary())


def change_json(plan: Plan, outcomes: Mapping[str, HostOutcome]) -> dict[str, object]:
    """`apply --json` and `destroy --json`: the plan and what happened on each host."""
    return {"format_version": 2, "plan": plan.to_json(), "outcome": {n: o.__dict__ for n, o in outcomes.items()}}


def facts_json(hosts: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
    """`facts --json`: per host its facts and what does not match the inventory (or its error)."""
    return {"format_version": 1, "hosts": dict(hosts)}


def print_outcome(ctx: Context, plan: Plan, outcomes: Mapping[str, HostOutcome], operation: str) -> None:
    """Errors per host, then Terraform's closing line."""
    failed = [o for o in outcomes.values() if o.error and not o.unreachable]
    for o in failed:
        click.echo(click.style(f"Error: {ctx.targets[o.name].where}: {printable(o.error or '')}", fg="red"), err=True)
    line = summary_line(plan, outcomes, operation)
    if line is not None:
        click.echo(click.style(f"\n{line}", bold=True))


def summary_line(plan: Plan, outcomes: Mapping[str, HostOutcome], operation: str) -> str | None:
    """Terraform's closing line (None when nothing changed): printed, and kept in the
    state's history (`provision state history`)."""
    if not plan.changed:
        return None
    a, c, d = plan.counts()
    whole = not any((o.error and not o.unreachable) or o.unreachable for o in outcomes.values())
    if operation == "destroy":
        word = "Destroy complete!" if whole else "Destroy finished with errors."
        return f"{word} Resources: {d} destroyed."
    word = "Apply complete!" if whole else "Apply finished with errors."
    return f"{word} Resources: {a} added, {c} changed, {d} destroyed."


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as aligned columns; every cell printable (a cell may be a host's or a ledger's)."""
    if not rows:
        return []
    rows = [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


PHASE_COLOR = {
    "Succeeded": "green",
    "Failed": "red",
    "Running": "cyan",
    "Restarting": "yellow",
    "Stopped": None,
    "Preempted": "yellow",
    "Recovering": "yellow",
    "Pending": None,
    "Unknown": "red",
}


def status_lines(st: JobStatus, inventory: str | None = None) -> list[str]:
    """The status table; below it, the last journal lines of each task that failed."""
    head = click.style(f"Job {st.job}: {st.phase}", bold=True, fg=PHASE_COLOR.get(st.phase.value))
    reason = printable(st.reason or "")  # the reason and the owner come from the hosts' ledgers
    if reason:  # "Preempted at 14:02 by ...": its reason reads on from the phase
        head += f" {reason}" if st.phase is JobPhase.PREEMPTED else f" ({reason})"
    if st.owner:
        head += f"  owner: {printable(st.owner)}"
    rows = [("TASK", "HOST", "ADDRESS", "GPUS", "GPU%", "STATE", "EXIT", "RESTARTS", "SINCE", "DETAIL")]
    for t in st.tasks:
        rows.append(
            (
                t.task,
                t.host,
                t.address,
                ",".join(map(str, t.gpus)) or "-",
                "-" if t.gpu_util is None else f"{t.gpu_util}%",
                t.state.value,
                "-" if t.exit_code is None else str(t.exit_code),
                str(t.restarts),
                duration(t.since) or "-",
                t.detail,
            )
        )
    lines = table(rows)
    out = [head, *([printable(st.run.words()).capitalize()] if st.run is not None else []), *recovery_lines(st)]
    out.append(lines[0])
    for t, line in zip(st.tasks, lines[1:]):
        color = PHASE_COLOR.get(t.state.value)
        out.append(click.style(line, fg=color) if color else line)
    failed = failed_lines(st, inventory)
    behind = [click.style(f"Warning: {printable(line)}", fg="yellow") for line in st.left_behind]
    sick = [click.style(f"Health: {printable(line)}", fg="red") for line in st.health]  # the hosts' words
    return out + ([""] + failed if failed else []) + ([""] + behind if behind else []) + ([""] + sick if sick else [])


def recovery_lines(st: JobStatus) -> list[str]:
    """A watched job's progress, where its run broke, and its recoveries (rules/recovery.py)."""
    out = []
    p = st.progress
    if p is not None:
        now = time.time()
        last = f"last sign {duration(int(max(0, now - p.last)))} ago" if p.last is not None else "no sign yet"
        ck = f", newest checkpoint {duration(int(max(0, now - p.checkpoint)))} ago" if p.checkpoint is not None else ""
        how = " (auto, learnt by the service)" if p.learnt else " (auto, until the service learns it)"
        bound = f"bound {duration(int(p.bound))}" + (how if p.auto else "")
        out.append(f"Progress: {last}{ck} ({bound})" + ("; hung" if p.stalled else ""))
    if st.broke:
        out.append(click.style(f"Broke: {printable(st.broke)}", fg="yellow"))
    words = goodput_words(st.goodput) if st.goodput is not None else None
    if words is not None:
        out.append(words)
    if st.checkpoint_copy is not None:
        out.append(copy_line(st.checkpoint_copy, lambda s: duration(int(s))))
    for inc in st.recovery.incidents[-3:] if st.recovery is not None else ():
        out.append("  " + printable(incident_words(inc, time.time())))
    return out


def stoppable(st: JobStatus) -> list[TaskStatus]:
    """The tasks `provision stop` ends (running, waiting to restart, or not started yet), in
    the order it stops them."""
    live = [t for t in st.tasks if t.state.live or t.state is TaskState.PENDING]
    return sorted(live, key=lambda t: (stop_rank(t.role), t.task))


def stop_lines(st: JobStatus, inventory: str, *, hold: bool) -> list[str]:
    """What `provision stop` is about to do, before it asks."""
    out = [f"provision will stop job {st.job}'s tasks, in this order:", ""]
    out += [f"  - {t.task}@{t.host} ({t.state.value})" for t in stoppable(st)]
    kept = "its GPUs and ports stay held for it" if hold else "its GPUs and ports are freed for other jobs"
    out += ["", f"Files, logs and state stay; {kept}. `provision apply --rerun {inventory}` starts it again."]
    return out
