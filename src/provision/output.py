"""Human output: a Terraform-like plan, summaries and tables. Colour only on a terminal."""

from __future__ import annotations

import click

from .plan import Plan

SYMBOL = {"create": "+", "update": "~", "delete": "-", "start": "+", "restart": "~", "stop": "-"}
COLOR = {"+": "green", "~": "yellow", "-": "red", "!": "magenta"}


def _line(sym: str, text: str) -> str:
    return click.style(f"  {sym} ", fg=COLOR.get(sym), bold=True) + text


def plan_lines(plan: Plan, *, verbose_diff: bool = True) -> list[str]:
    out: list[str] = []
    for hp in plan.hosts:
        if hp.error is not None:
            out.append(click.style(f"# {hp.error.target.where}: {hp.error.message}", fg="red"))
            continue
        if hp.problems:
            for p in hp.problems:
                out.append(click.style(f"# {hp.target.where}: {p}", fg="red"))
        if not hp.changed:
            continue
        title = f"# {hp.target.where}" + (" (the job leaves this host)" if hp.bundle is None else "")
        out.append(click.style(title, bold=True))
        for t in hp.tasks:
            if t.action == "none":
                continue
            sym = "+" if t.new else "~" if t.action == "start" else SYMBOL[t.action]
            verb = {"start": "start", "restart": "restart", "stop": "stop and remove"}[t.action]
            drift = click.style(" [drift]", fg="magenta") if t.drift else ""
            out.append(_line(sym, f"task {t.task}: {verb} ({t.reason}){drift}"))
        shown = [f for f in hp.files if f.kind != "manifest"] or hp.files  # bookkeeping only when alone
        for f in shown:
            drift = click.style(" [drift]", fg="magenta") if f.drift else ""
            out.append(_line(SYMBOL[f.action], f"{f.kind} {f.path} ({f.reason}){drift}"))
            if verbose_diff and f.diff:
                for dl in f.diff.rstrip("\n").split("\n"):
                    bare = dl.lstrip()
                    color = "green" if bare.startswith("+") else "red" if bare.startswith("-") else None
                    out.append("      " + click.style(dl, fg=color))
        out.append("")
    return out


def print_plan(plan: Plan) -> None:
    lines = plan_lines(plan)
    if plan.changed:
        click.echo("provision will perform the following actions:\n")
    for line in lines:
        click.echo(line)
    if plan.changed:
        click.echo(click.style(plan.summary(), bold=True))
    elif not plan.errors:
        click.echo("No changes. The hosts match the inventory.")
    else:
        click.echo(plan.summary())


def table(rows: list[tuple[str, ...]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


PHASE_COLOR = {"Succeeded": "green", "Failed": "red", "Running": "cyan", "Restarting": "yellow", "Stopped": None, "Pending": None, "Unknown": "red"}


def status_lines(st) -> list[str]:
    head = click.style(f"Job {st.job}: {st.phase}", bold=True, fg=PHASE_COLOR.get(st.phase))
    if st.reason:
        head += f" ({st.reason})"
    rows = [("TASK", "HOST", "ADDRESS", "GPUS", "STATE", "EXIT", "RESTARTS", "SINCE", "DETAIL")]
    for t in st.tasks:
        rows.append((t.task, t.host, t.address, t.gpus, t.state, "-" if t.exit_code is None else str(t.exit_code), str(t.restarts), t.since or "-", t.detail))
    lines = table(rows)
    out = [head, lines[0]]
    for t, line in zip(st.tasks, lines[1:]):
        color = PHASE_COLOR.get(t.state)
        out.append(click.style(line, fg=color) if color else line)
    return out
