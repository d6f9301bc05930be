"""`provision tune`: run (or resume) the inventory's `tune:` study, show it (`--status`,
`--json`), or promote a trial to a plain inventory (`--promote best|N -o FILE`)."""

from __future__ import annotations

import json as _json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from provision.cli.tuneview import draw_png, event_line, study_json, table_lines, warm_matplotlib
from provision.core.errors import EXIT_INTERRUPTED, ProvisionError
from provision.core.model import Inventory
from provision.core.text import printable
from provision.core.tuning import Algorithm, EarlyStopping, TrialRow, TrialState, Tune, best, promoted_job
from provision.inventory.inventory import load
from provision.inventory.promote import promoted
from provision.rules.space import grid_size, space_size

if TYPE_CHECKING:  # the study's modules import Optuna: loaded only when a study is opened (below)
    from provision.io.study import Study

PICTURE = "study.png"


class _Screen:
    """One line per trial event; on a terminal also a live line (rewritten in place) with
    the running trials' last steps and what a waiting trial waits for."""

    def __init__(self, tune: Tune):
        self.tune = tune
        self.live = sys.stdout.isatty()
        self.lock = threading.Lock()
        self.shown = False

    def say(self, line: str) -> None:
        """A line of the study's: its trials' words carry what hosts and the storage said."""
        with self.lock:
            self._clear()
            click.echo(printable(line))

    def row(self, r: TrialRow) -> None:
        self.say(event_line(r, self.tune))

    def tick(self, rows: list[TrialRow], waiting: dict[int, str]) -> None:
        if not self.live:
            return
        running = [r for r in rows if r.state is TrialState.RUNNING]
        parts = [
            f"t{r.number}"
            + (f" step {r.steps}" if r.steps is not None else "")
            + (f" ({waiting[r.number]})" if r.number in waiting else "")  # waiting for GPUs, setting up
            for r in running
        ]
        done = sum(r.state.ended for r in rows)
        line = f"{done}/{self.tune.max_trials} ended; running: {', '.join(parts) or 'none'}"
        with self.lock:
            self._clear()
            click.echo(printable(line[:200]), nl=False)
            self.shown = True

    def _clear(self) -> None:
        if self.shown:
            click.echo("\r\033[K", nl=False)
            self.shown = False


def _study_inventory(inventory: str, *, files_here: bool = True) -> Inventory:
    inv = load(inventory, files_here=files_here)
    if inv.tune is None:
        raise ProvisionError(f"{inventory}: no tune: section, so no study to run (see docs/tuning.md)")
    return inv


@click.command("tune")
@click.argument("inventory", type=click.Path())
@click.option("--status", "show", is_flag=True, help="Show the study's trials (from its storage; no host is asked).")
@click.option("--json", "as_json", is_flag=True, help="With --status: the study as JSON.")
@click.option("--promote", metavar="best|N", help="Write an inventory that runs this trial's arguments as a plain job.")
@click.option("-o", "--output", "out", type=click.Path(), help="With --promote: the inventory file to write.")
@click.option("--seed", type=int, default=None, help="Seed the search (the same seed asks the same first trials).")
@click.option(
    "--poll",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between looks at the running trials (at least 0.05).",
)
@click.option("-v", "--verbose", is_flag=True, help="Show the SSH commands.")
@click.option("--detach", is_flag=True, help="Hand the study to the service (`provision serve`) and return at once.")
def tune_cmd(
    inventory: str,
    show: bool,
    as_json: bool,
    promote: str | None,
    out: str | None,
    seed: int | None,
    poll: float,
    verbose: bool,
    detach: bool,
) -> None:
    """Run the inventory's hyperparameter study: each trial a job of its own on free GPUs,
    at most `parallel_trials` at once, until `max_trials`. Run it again to resume: finished
    trials are kept, running ones adopted."""

    # Reading the study (--status, --promote, following a service's) needs none of the files
    # its trials push; running it (or handing it over) does: loaded again below, as a push.
    inv = _study_inventory(inventory, files_here=False)
    assert inv.tune is not None
    # Local: Optuna and SQLAlchemy take about a second to import (start-up of every other
    # command stays as it was: only this one loads them).
    from provision.run.trialrun import trace
    from provision.run.tune import existing_study, study_dir  # (start-up, as above)

    trace(None, "imported")
    if as_json and not show:
        raise ProvisionError("--json goes with --status")
    picture = study_dir(inventory, inv.job) / PICTURE
    if promote is not None or out is not None:
        if promote is None or out is None:
            raise ProvisionError("--promote and -o go together: --promote best -o best.yaml")
        _promote(inventory, inv, existing_study(inventory, inv), promote, Path(out))
        return
    if show:
        _show(inv, existing_study(inventory, inv), picture, as_json)
        return
    if (code := _service(inventory, inv, detach, seed, poll)) is not None:
        sys.exit(code)
    trace(None, "no service holds it")
    sys.exit(_run(inventory, _study_inventory(inventory), picture, seed=seed, poll=poll, verbose=verbose))


def _run(inventory: str, inv: Inventory, picture: Path, *, seed: int | None, poll: float, verbose: bool) -> int:
    """This terminal runs the study: its trials' lines, the picture, the table; the exit code."""
    # Local: Optuna's modules, as tune_cmd's (the other commands' start-up; no cost here).
    from provision.io.study import Runner, StudyUnavailable
    from provision.run.trialrun import trace  # (start-up, as above)
    from provision.run.tune import StudyLoop, open_work, trial_cap  # (start-up, as above)

    assert inv.tune is not None
    screen = _Screen(inv.tune)
    work, study = open_work(inventory, inv, say=screen.say, poll=poll, verbose=verbose, seed=seed)
    trace(None, "study opened")
    _header(inv, study)
    pic = _Picture(picture, inv.tune)
    loop: StudyLoop | None = None
    cap = trial_cap(inv.tune)

    def tick(rows: list[TrialRow]) -> None:
        screen.tick(rows, loop.waiting if loop is not None else {})
        asked_all = len(rows) >= cap
        if asked_all and loop is not None and not loop.mine.asked:
            pic.warm()  # every trial is on its hosts: matplotlib's import while they run
        pic.maybe(rows, final=asked_all and not any(r.state is TrialState.RUNNING for r in rows))

    loop = StudyLoop(work, study, Runner.here(), on_row=screen.row, on_tick=tick)
    end = loop.run()
    trace(None, "loop ended")
    screen.say("")
    try:
        rows = study.rows()
    except StudyUnavailable:
        pic.wait()
        click.echo(f"{end.why[0].upper()}{end.why[1:]}.")  # the table would read the storage that is gone
        return end.code
    pic.last(rows)
    trace(None, "picture drawn")
    for line in table_lines(rows, inv.tune):
        click.echo(line)
    click.echo(f"\n{end.why[0].upper()}{end.why[1:]}. Picture: {picture}")
    return end.code


def _service(inventory: str, inv: Inventory, detach: bool, seed: int | None, poll: float) -> int | None:
    """--detach: hand the study to the service (0). A study a service holds: followed (its
    exit code). None: this terminal runs it."""
    # Here: the service's modules load only for a `tune` (start-up of the other commands).
    from provision.inventory.statebackend import backend_of
    from provision.io.servicedb import default_db

    if not detach and backend_of(inv, inventory).local and not default_db().exists():
        return None  # no service here to hold it (servecmd's handed_over, without its import time)
    # (start-up, as above)
    from provision.cli.servecmd import detach_study, follow_handed_over
    from provision.run.tune import existing_study, study_dir  # (start-up, as above: Optuna)

    if detach:
        detach_study(inventory, seed=seed, poll=poll)
        return 0
    code = follow_handed_over(inventory, inv, lambda: existing_study(inventory, inv), event_line)
    if code is not None and code != EXIT_INTERRUPTED:
        _followed_end(inv, lambda: existing_study(inventory, inv), study_dir(inventory, inv.job) / PICTURE)
    return code


def _followed_end(inv: Inventory, study: Callable[[], Study | None], picture: Path) -> None:
    """A followed study's end as the terminal that runs one prints it: the picture drawn,
    the table, how it ended (the study's own words)."""
    from provision.io.study import StudyUnavailable  # (start-up: Optuna, loaded by `tune` only)

    assert inv.tune is not None
    try:
        s = study()
        rows = s.rows() if s is not None else []
        ended = s.ended(len(rows)) if s is not None and rows else None
    except StudyUnavailable:
        return  # the submission's end was said: the table would read a storage that is gone
    if not rows:
        return
    _draw(picture, rows, inv.tune)
    for line in table_lines(rows, inv.tune):
        click.echo(line)
    if ended is not None:
        click.echo("\n" + printable(f"{ended[0].upper()}{ended[1:]}.") + f" Picture: {picture}")


class _Picture:
    """The study's PNG, redrawn while it runs when trials ended since, at most every half
    minute, on a thread of its own: drawing takes half a second of this process's CPU (the
    first one, importing matplotlib, more), and a trial starting meanwhile waits for the
    interpreter between its round trips (every 5 s slowed each hand-off of short trials).
    The last picture is drawn as soon as every trial is told (`final`), beside the last
    trials' logs and removal, and not again at the end unless the rows changed since."""

    EVERY = 30.0

    def __init__(self, path: Path, tune: Tune):
        self.path, self.tune = path, tune
        self.drawn, self.at = -1, time.monotonic()
        self.rows: list[TrialRow] | None = None  # what the last picture started shows
        self.thread: threading.Thread | None = None
        self.warming: threading.Thread | None = None

    def maybe(self, rows: list[TrialRow], *, final: bool = False) -> None:
        ended = sum(r.state.ended for r in rows)
        if self.thread is not None and self.thread.is_alive():
            return
        if final:
            if rows == self.rows:
                return
        elif ended == self.drawn or time.monotonic() - self.at < self.EVERY:
            return
        self.drawn, self.at, self.rows = ended, time.monotonic(), list(rows)
        self.thread = threading.Thread(target=_draw, args=(self.path, rows, self.tune), daemon=True)
        self.thread.start()

    def warm(self) -> None:
        """matplotlib imported on a thread now (about a second), not at the last picture."""
        if self.warming is None:
            self.warming = threading.Thread(target=warm_matplotlib, daemon=True)
            self.warming.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def last(self, rows: list[TrialRow]) -> None:
        """The study's end: its picture, drawn unless the last one drawn shows these rows."""
        self.wait()
        if rows != self.rows:
            _draw(self.path, rows, self.tune)


def _draw(picture: Path, rows: list[TrialRow], tune: Tune) -> None:
    try:
        draw_png(picture, rows, tune)
    except Exception as e:  # the picture never decides the study's exit code: a warning, the study goes on
        click.echo(f"Warning: the study's picture could not be written to {picture}: {type(e).__name__}: {e}", err=True)


def space_line(t: Tune) -> str | None:
    """What a study of more trials than its space has points does (None: it has room)."""
    if t.algorithm is Algorithm.GRID:
        size = grid_size(t.params)
        if size < t.max_trials:
            return f"The grid has {size} points: the study runs {size} trials, not max_trials ({t.max_trials})."
        return None
    n = space_size(t.params, t.max_trials)
    if n is None or n >= t.max_trials:
        return None
    return (
        f"The search space has {n} points, fewer than max_trials ({t.max_trials}): "
        "each point runs once before any runs again."
    )


def _header(inv: Inventory, study: Study) -> None:
    t = inv.tune
    assert t is not None
    names = ", ".join(p.name for p in t.params)
    click.echo(
        f"Study {inv.job}: {t.metric.goal.value} {t.metric.name} over {names}; {t.algorithm.value} search, "
        f"{t.max_trials} trials, {t.parallel_trials} at once"
        + (f", {t.early_stopping} early stopping" if t.early_stopping is not EarlyStopping.NONE else "")
    )
    room = space_line(t)
    if room:
        click.echo(room)
    rows = study.rows()
    if rows:
        ended = sum(r.state.ended for r in rows)
        click.echo(f"Resuming: {ended} trial{'s' if ended != 1 else ''} ended, {len(rows) - ended} running.")


def _show(inv: Inventory, study: Study | None, picture: Path, as_json: bool) -> None:
    assert inv.tune is not None
    rows = study.rows() if study is not None else []
    running = any(r.state is TrialState.RUNNING for r in rows)
    ended = study.ended(len(rows)) if study is not None and rows and not running else None
    if as_json:
        doc = study_json(inv.job, inv.tune, rows, ended=ended, picture=str(picture) if picture.exists() else None)
        click.echo(_json.dumps(doc, indent=1))
        return
    if not rows:
        click.echo(f"Study {inv.job}: no trials yet (`provision tune {inv.path}` starts it).")
        return
    for line in table_lines(rows, inv.tune):
        click.echo(line)
    if ended is not None:
        click.echo("\n" + printable(f"{ended[0].upper()}{ended[1:]}."))  # the storage's words
    if picture.exists():
        click.echo(f"Picture: {picture}")


def _promote(where: str, inv: Inventory, study: Study | None, which: str, out: Path) -> None:
    assert inv.tune is not None
    rows = study.rows() if study is not None else []
    if which == "best":
        row = best(rows, inv.tune.metric)
        if row is None:
            raise ProvisionError(f"study {inv.job}: no trial succeeded yet, so none is best")
    else:
        if not which.isdigit():
            raise ProvisionError(f"--promote: expected best or a trial number, got {which!r}")
        row = next((r for r in rows if r.number == int(which)), None)
        if row is None:
            raise ProvisionError(f"--promote: study {inv.job} has no trial {which} (it has {len(rows)})")
    value = f"{inv.tune.metric.name}={row.value:.6g}" if row.value is not None else "no value"
    text = promoted(
        Path(where).read_text(encoding="utf-8"),
        inv.tune,
        dict(row.params),
        number=row.number,
        why=f"{row.state.value}, {value}",
        src_dir=Path(where).resolve().parent,
        out_dir=out.resolve().parent,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    click.echo(
        f"Wrote {out}: trial {row.number} ({value}) as job {promoted_job(inv.job, row.number)}. Next: provision plan {out}"
    )
