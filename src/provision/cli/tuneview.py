"""How a hyperparameter study is shown: its trials table, its --json document, its PNG and
one line per trial event (for a pipe). Pure, but for draw_png, which writes a file.

The engine that runs trials reads them back as `TrialRow`s and calls these.
matplotlib is imported inside draw_png only: the CLI's other commands must not pay for it.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from provision.cli.output import table
from provision.core.errors import no_color
from provision.core.text import duration, plural, printable
from provision.core.tuning import Param, ParamType, Scale, TrialRow, TrialState, Tune, Value, best, format_value

# Re-exported: the --json builder lives in rules/ (the dashboard serves it too).
from provision.rules.studyview import COUNTED as COUNTED
from provision.rules.studyview import counts as counts
from provision.rules.studyview import study_json as study_json

if TYPE_CHECKING:  # types only: the real import is draw_png's (heavy, tune only)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ROW_COLOR = {TrialState.FAILED: "red", TrialState.STOPPED_EARLY: "yellow", TrialState.RUNNING: "cyan"}
# Markers of the picture, per state: what a reader tells apart without colour too.
STYLE: dict[TrialState, dict[str, Any]] = {
    TrialState.SUCCEEDED: {"marker": "o", "color": "tab:blue", "label": "succeeded"},
    TrialState.STOPPED_EARLY: {"marker": "s", "color": "tab:orange", "label": "stopped early"},
    TrialState.RUNNING: {"marker": "o", "facecolors": "none", "edgecolors": "tab:gray", "label": "running"},
    TrialState.FAILED: {"marker": "x", "color": "tab:red", "label": "failed (no value)"},
}


# --------------------------------------------------------------------------- numbers as text


def compact(v: Value) -> str:
    """A parameter's value in a table cell: floats with 4 significant digits (0.0003162, 12.5)."""
    if isinstance(v, float) and not isinstance(v, bool):
        return f"{v:.4g}"
    return format_value(v)


def digits(values: Sequence[float]) -> int:
    """4 significant digits, more (up to 6) when 4 would show two different values alike."""
    distinct = set(values)
    return next((d for d in (4, 5) if len({f"{v:.{d}g}" for v in distinct}) == len(distinct)), 6)


def _flags(row: TrialRow) -> str:
    """The trial's arguments as a shell would need them (a value with a space is one argument)."""
    return " ".join(shlex.quote(f"--{name}={format_value(v)}") for name, v in row.params)


# --------------------------------------------------------------------------- the table


def table_lines(rows: Sequence[TrialRow], tune: Tune) -> list[str]:
    """The trials table, then the best trial and the counts."""
    d = digits([r.value for r in rows if r.value is not None])
    names = [p.name for p in tune.params]
    rungs = tune.early_stopping.has_rungs  # the rung each reached: a column
    cells = [("TRIAL", *names, "STATE", tune.metric.name, "STEP", *(("RUNG",) if rungs else ()), "TIME", "WHY")]
    for r in rows:
        params = dict(r.params)
        trial = str(r.number) + (f" (retry of {r.retry_of})" if r.retry_of is not None else "")
        cells.append(
            (
                trial,
                *(compact(params[n]) if n in params else "" for n in names),
                r.state.value,
                "" if r.value is None else f"{r.value:.{d}g}",
                "" if r.steps is None else str(r.steps),
                *(("" if r.rung is None else str(r.rung),) if rungs else ()),
                "" if r.seconds is None else duration(round(r.seconds)),
                r.why,
            )
        )
    lines = table(cells)
    top = best(tuple(rows), tune.metric)
    colour = not no_color()
    out = [click.style(lines[0], bold=True) if colour else lines[0]]
    for r, line in zip(rows, lines[1:]):
        fg = ROW_COLOR.get(r.state)
        if r is top:
            fg = "green"
        out.append(click.style(line, fg=fg, bold=True if r is top else None) if colour and fg else line)
    return [*out, "", printable(best_line(rows, tune, d)), count_line(rows, tune)]


def best_line(rows: Sequence[TrialRow], tune: Tune, d: int = 4) -> str:
    top = best(tuple(rows), tune.metric)
    if top is None or top.value is None:
        return "Best: none yet"
    params = f" ({_flags(top)})" if top.params else ""
    return f"Best: trial {top.number}, {tune.metric.name}={top.value:.{d}g}{params}"


def count_line(rows: Sequence[TrialRow], tune: Tune) -> str:
    """`12 trials: 9 succeeded, 2 stopped early, 1 failed, 0 running (max_trials 12, parallel 4)`."""
    each = ", ".join(f"{n} {state}" for state, n in counts(rows).items())
    return f"{plural(len(rows), 'trial')}: {each} (max_trials {tune.max_trials}, parallel {tune.parallel_trials})"


# --------------------------------------------------------------------------- progress lines


def event_line(row: TrialRow, tune: Tune) -> str:
    """One line per trial event, for a pipe: a running row has started, any other has ended.
    Printable: its why and its arguments are the study storage's."""
    return printable(_event_words(row, tune))


def pause_line(row: TrialRow, paused: set[int]) -> str | None:
    """A followed study's pause or resume of `row` since the last look (`paused`: the trials
    paused then; updated), in the words the terminal that runs the study says them
    (run/tune.py): a running row's why says where it is (`paused: ...`, `running on ...`)."""
    running = row.state is TrialState.RUNNING
    if running and row.why.startswith("paused: "):
        if row.number in paused:
            return None
        paused.add(row.number)
        return printable(f"trial {row.number} {row.why}")
    if row.number not in paused or (running and not row.why.startswith("running")):
        return None  # not paused, or still on its way back (resuming, waiting for room)
    paused.discard(row.number)
    on = row.why.removeprefix("running").removeprefix(" on ")
    return printable(f"trial {row.number} resumed on {on or 'its hosts'} (from its checkpoint)") if running else None


def _event_words(row: TrialRow, tune: Tune) -> str:
    head = f"trial {row.number}"
    why = f": {row.why}" if row.why else ""
    if row.state is TrialState.RUNNING:
        retry = f" (retry of trial {row.retry_of})" if row.retry_of is not None else ""
        return f"{head} started{retry}" + (f": {_flags(row)}" if row.params else "")
    if row.state is TrialState.FAILED:
        return f"{head} failed{why}"
    if row.state is TrialState.STOPPED_EARLY:
        step = f" at step {row.steps}" if row.steps is not None else ""
        return f"{head} stopped early{step}{why}"
    parts = [
        f"{tune.metric.name}={row.value:.6g}" if row.value is not None else f"no {tune.metric.name} reported",
        f"at step {row.steps}" if row.steps is not None else "",
        f"after {duration(round(row.seconds))}" if row.seconds is not None else "",
    ]
    return f"{head} succeeded: " + " ".join(p for p in parts if p)


# --------------------------------------------------------------------------- the picture


def draw_png(path: Path, rows: Sequence[TrialRow], tune: Tune, *, job: str | None = None) -> None:
    """The study as a PNG: the metric per trial with the best so far, then the metric against
    each parameter. Written whole or not at all (a temp file renamed over `path`). `job`
    (the title's) defaults to the study's job the trials' job names start with."""
    _quiet_matplotlib()
    fig = figure(rows, tune, job=job if job is not None else _job_of(rows, path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def warm_matplotlib() -> None:
    """figure's imports done ahead (on a thread, while trials run): the picture drawn at
    the study's end does not wait for them."""
    # Lazy: as in figure (matplotlib's import is `tune`'s alone).
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401
    from matplotlib.ticker import MaxNLocator  # noqa: F401


def _quiet_matplotlib() -> None:
    """matplotlib's warnings are about the drawing, not the study: none reaches the terminal
    (a line like "No artists with labels found" among the trials' lines). Its warn_external
    names the first caller outside matplotlib, this module; the rest log. Process-wide
    filters, not catch_warnings: the picture is drawn on a thread of its own."""
    warnings.filterwarnings("ignore", module=r"provision\.cli\.tuneview")
    warnings.filterwarnings("ignore", module=r"matplotlib(\.|$)")
    logging.getLogger("matplotlib").setLevel(logging.ERROR)


def log_scale(values: Sequence[float]) -> bool:
    """The metric axis is logarithmic when every value is positive and the largest is
    LOG_RATIO times the smallest or more: on a linear axis up to 3.1, 0.0093 and 0.0099 both
    sit on 0."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) >= LOG_RATIO * min(finite)


LOG_RATIO = 30.0


def figure(rows: Sequence[TrialRow], tune: Tune, *, job: str) -> Figure:
    """The picture as a matplotlib Figure (draw_png writes it)."""
    # Lazy: matplotlib costs ~0.5 s of import time and only `provision tune` draws; the
    # object-oriented Figure with the Agg canvas needs no pyplot, so no global backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(tune.params)
    cols = min(max(n, 1), 3)
    prows = (n + cols - 1) // cols if rows else 0
    fig = Figure(figsize=(max(6.4, 4.2 * cols), 3.6 + 3.0 * prows), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 + prows, cols, height_ratios=[1.3] + [1.0] * prows)
    off = _off_the_chart(rows)
    clipped = f"; {off} value{'s' if off != 1 else ''} beyond ±{DRAWN_LIMIT:g} drawn at it" if off else ""
    fig.suptitle(f"{job}: {tune.metric.name} ({tune.metric.goal.value}){clipped}")
    top = fig.add_subplot(grid[0, :])
    _metric_panel(top, rows, tune)
    if rows:
        top.xaxis.set_major_locator(MaxNLocator(integer=True))  # trial numbers
    log = log_scale([y for _, y in _valued(rows)])
    for i, p in enumerate(tune.params if rows else ()):
        _param_panel(fig.add_subplot(grid[1 + i // cols, i % cols]), p, rows, tune, log=log)
    return fig


def _job_of(rows: Sequence[TrialRow], path: Path) -> str:
    """The study's job: a trial's job name without its `-tN` (core.tuning.trial_job)."""
    for r in rows:
        if r.job.endswith(f"-t{r.number}"):
            return r.job[: -len(f"-t{r.number}")]
    return path.name.split(".")[0]


def _metric_panel(ax: Axes, rows: Sequence[TrialRow], tune: Tune) -> None:
    ax.set_xlabel("trial")
    ax.set_ylabel(tune.metric.name)
    if not rows:
        ax.text(0.5, 0.5, "no trials yet", ha="center", va="center", transform=ax.transAxes, fontsize=14)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    valued = _valued(rows)
    if log_scale([y for _, y in valued]):
        ax.set_yscale("log")
        ax.set_ylabel(f"{tune.metric.name} (log)")
    _scatter(ax, [(float(r.number), y, r.state) for r, y in valued])
    for r, y in valued:  # a stopped trial says at which step: its value is the one it had there
        if r.state is TrialState.STOPPED_EARLY and r.steps is not None:
            ax.annotate(
                f"step {r.steps}",
                (r.number, y),
                xytext=(4, -10),
                textcoords="offset points",
                fontsize="x-small",
                color=STYLE[TrialState.STOPPED_EARLY]["color"],
            )
    failed = [r.number for r in rows if r.state is TrialState.FAILED]
    if failed:  # no value: at the bottom of the panel (x in data, y in axes coordinates)
        ax.scatter(
            failed, [0.03] * len(failed), transform=ax.get_xaxis_transform(), zorder=3, **STYLE[TrialState.FAILED]
        )
    xs, ys = best_so_far(rows, tune)
    ys = [max(-DRAWN_LIMIT, min(DRAWN_LIMIT, y)) for y in ys]
    if xs:
        ax.step(
            [*xs, max(r.number for r in rows)],
            [*ys, ys[-1]],
            where="post",
            color="tab:green",
            label="best so far",
            zorder=2,
        )
    top = best(tuple(rows), tune.metric)
    if top is not None and top.value is not None and math.isfinite(top.value):
        y = max(-DRAWN_LIMIT, min(DRAWN_LIMIT, top.value))
        name = f"best: trial {top.number}, {tune.metric.name} {top.value:.{digits([y for _, y in valued])}g}"
        ax.scatter([top.number], [y], marker="*", s=220, color="tab:green", edgecolors="black", zorder=4, label="best")
        ax.annotate(
            name, (top.number, y), xytext=(6, 8), textcoords="offset points", fontsize="small", color="darkgreen"
        )
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # only failed trials: nothing to name (matplotlib warns on stderr)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside: no point hidden


def best_so_far(rows: Sequence[TrialRow], tune: Tune) -> tuple[list[int], list[float]]:
    """Where the best succeeded value changes, in trial-number order: (numbers, values)."""
    xs: list[int] = []
    ys: list[float] = []
    for r in sorted(rows, key=lambda r: r.number):
        if r.state is TrialState.SUCCEEDED and r.value is not None and (not ys or tune.metric.better(r.value, ys[-1])):
            xs.append(r.number)
            ys.append(r.value)
    return xs, ys


def _param_panel(ax: Axes, p: Param, rows: Sequence[TrialRow], tune: Tune, *, log: bool = False) -> None:
    """The metric against one parameter: a log axis for scale log, categories at positions;
    the metric's axis as the top panel's (`log`)."""
    pts = [(dict(r.params)[p.name], y, r.state) for r, y in _valued(rows) if p.name in dict(r.params)]
    ax.set_xlabel(p.name + (" (log)" if p.scale is Scale.LOG else ""))
    ax.set_ylabel(tune.metric.name + (" (log)" if log else ""))
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if p.type is ParamType.CATEGORICAL:
        known = [str(v) for v in p.values]
        seen = known + sorted({str(v) for v, _, _ in pts} - set(known))
        ax.set_xticks(range(len(seen)), seen, rotation=30 if len(seen) > 3 else 0)
        ax.set_xlim(-0.5, max(len(seen) - 0.5, 0.5))
        where = {c: float(i) for i, c in enumerate(seen)}
        _scatter(ax, [(where[str(v)], y, s) for v, y, s in pts])
        return
    xs = [(float(v), y, s) for v, y, s in pts]
    if p.scale is Scale.LOG and xs and min(x for x, _, _ in xs) > 0:
        ax.set_xscale("log")
    _scatter(ax, xs)


DRAWN_LIMIT = 1e100  # values past ± this are drawn at it (matplotlib's axis arithmetic overflows near 1e308)


def _valued(rows: Sequence[TrialRow]) -> list[tuple[TrialRow, float]]:
    """The rows with a finite value (a failed trial has none), and it, clipped to what an
    axis can hold."""
    return [
        (r, max(-DRAWN_LIMIT, min(DRAWN_LIMIT, r.value)))
        for r in rows
        if r.value is not None and math.isfinite(r.value)
    ]


def _off_the_chart(rows: Sequence[TrialRow]) -> int:
    return sum(1 for r in rows if r.value is not None and math.isfinite(r.value) and abs(r.value) > DRAWN_LIMIT)


def _scatter(ax: Axes, points: Sequence[tuple[float, float, TrialState]]) -> None:
    """(x, y, state) points, marked per state (STYLE)."""
    for state in (TrialState.SUCCEEDED, TrialState.STOPPED_EARLY, TrialState.RUNNING):
        mine = [(x, y) for x, y, s in points if s is state]
        if mine:
            ax.scatter([x for x, _ in mine], [y for _, y in mine], zorder=3, **STYLE[state])
