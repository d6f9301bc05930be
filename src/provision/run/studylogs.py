"""`provision logs STUDY.yaml`: the output of a study's trials, each line prefixed by its
trial and task (`trial-3/chief-0@host-1 | ...`), as `provision tune` keeps them
(`.provision/<job>.tune/trial-N/<task>.log`).

A trial whose logs were kept (it ended and left its hosts) is read from there; one that
runs, or whose logs were kept elsewhere (a service on another machine), from the journals
of the hosts it ran on (the study records where). With `follow`, the study is looked at
again every `poll` seconds: each running trial's new lines (journal cursors), each new
trial's, until the study has ended.
"""

from __future__ import annotations

import datetime as _dt
import heapq
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click

from provision.core.errors import EXIT_OK, ProvisionError
from provision.core.text import printable
from provision.core.tuning import TrialRow, trial_job
from provision.io.journal import Entry
from provision.io.study import Study
from provision.rules.studyview import counts
from provision.run.context import Context
from provision.run.logprinter import Printer
from provision.run.logs import Selection, entries_after
from provision.run.tune import existing_study, study_dir


@dataclass
class _Shown:
    """What was printed of one trial."""

    printer: Printer | None = None
    cursors: dict[str, dict[str, str]] = field(default_factory=dict)  # from its hosts: where to go on
    lines: int = 0
    done: bool = False  # all of it: it ended, and its last lines are out


@dataclass(frozen=True)
class _Ask:
    tasks: tuple[str, ...]
    tail: int | None
    timestamps: bool
    raw: bool
    echo_err: Callable[[str], None]


def study_logs(
    ctx: Context,
    tasks: tuple[str, ...] = (),
    *,
    tail: int | None = None,
    follow: bool = False,
    timestamps: bool = False,
    raw: bool = False,
    poll: float = 2.0,
    echo_err: Callable[[str], None] = lambda s: click.echo(printable(s), err=True),
) -> int:
    """Print the study's trials' lines, trial by trial (with `follow`: then as they come,
    until the study has ended); the exit code (3: a host did not answer). Nothing to show
    is said in one line on stderr, with how to get them."""
    inv = ctx.inventory
    names = [t.name for t in ctx.rendered.placement.tasks]
    unknown = [t for t in tasks if t not in names]
    if unknown:
        raise ProvisionError(f"no task named {', '.join(unknown)} in study {inv.job} (tasks: {', '.join(names)})")
    ask = _Ask(tasks, tail, timestamps, raw, echo_err)
    shown: dict[int, _Shown] = {}
    code = EXIT_OK
    study = existing_study(ctx.where, inv)
    while True:
        rows = study.rows() if study is not None else []
        removed = study.removed() if study is not None else set()
        for r in rows:
            s = shown.setdefault(r.number, _Shown())
            if not s.done and study is not None:
                code = max(code, _show(ctx, study, r, s, r.number in removed, ask))
        gone = any(s.printer is not None and s.printer.pipe_closed for s in shown.values())  # `| head`
        if not follow or gone or (study is not None and _ended(study, rows, shown)):
            break
        time.sleep(poll)
        study = study or existing_study(ctx.where, inv)
    if not any(s.lines for s in shown.values()):
        echo_err(_nothing(inv.job, ctx.where, rows))
    return code


def _ended(study: Study, rows: list[TrialRow], shown: dict[int, _Shown]) -> bool:
    return bool(rows) and all(shown[r.number].done for r in rows) and study.ended(len(rows)) is not None


def _nothing(job: str, where: str, rows: list[TrialRow]) -> str:
    """Why nothing was printed, and how to get the lines."""
    if not rows:
        return (
            f"study {job}: no trial has run yet, so no logs: `provision logs -f {where}` follows its trials' "
            f"output once they run (`provision tune --status {where}` shows the study)"
        )
    each = ", ".join(f"{n} {state}" for state, n in counts(rows).items())
    return f"study {job}: its trials printed nothing yet ({each}); `provision logs -f {where}` follows their output"


def _show(ctx: Context, study: Study, r: TrialRow, s: _Shown, removed: bool, ask: _Ask) -> int:
    """One trial's lines not printed yet: its kept logs, or its hosts' (exit code)."""
    kept = study_dir(ctx.where, ctx.inventory.job) / f"trial-{r.number}"
    if r.state.ended and removed and not s.cursors and kept.is_dir():  # kept whole: its wind-up is done
        entries = list(kept_entries(kept, ask.tasks, ask.tail))
        _print(s, r.number, entries, {e.task: e.host for e in entries}, ask)
        s.done = True
        return EXIT_OK
    got = study.record_of(r.number)
    ran_on = {t: h for t, h in (got[1] if got else {}).items() if h in ctx.targets and t in (ask.tasks or (t,))}
    if not ran_on:  # waiting for room, or ended before it ran
        s.done = r.state.ended
        return EXIT_OK
    sel = Selection.placed(trial_job(ctx.inventory.job, r.number), ran_on)
    label = f"trial-{r.number}/"
    entries, s.cursors, code = entries_after(
        ctx,
        sel,
        tail=None if s.cursors else ask.tail,  # --tail: the last lines before the first new one
        cursors=s.cursors,
        echo_err=lambda line: ask.echo_err(f"{label} {line}"),
    )
    _print(s, r.number, entries, ran_on, ask)
    s.done = r.state.ended  # ended before this look: its last lines are in it
    return code


def _print(s: _Shown, number: int, entries: list[Entry], hosts: dict[str, str], ask: _Ask) -> None:
    if s.printer is None:
        s.printer = Printer(
            sorted(hosts), hosts, out_dir=None, timestamps=ask.timestamps, raw=ask.raw, label=f"trial-{number}/"
        )
    for e in entries:
        s.printer.write(e)
    s.lines += len(entries)


def kept_entries(kept: Path, tasks: tuple[str, ...], tail: int | None) -> Iterator[Entry]:
    """A kept trial's lines (DIR/<task>.log: `TIME HOST TEXT`, as `logs -o` writes them),
    every task's merged in time order."""

    def lines(path: Path) -> Iterable[Entry]:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for line in text if tail is None else text[max(0, len(text) - tail) :]:
            stamp, _, rest = line.partition(" ")
            host, _, said = rest.partition(" ")
            yield Entry(_micros(stamp), host, path.stem, said, "")

    files = [p for p in sorted(kept.glob("*.log")) if not tasks or p.stem in tasks]
    return heapq.merge(*(lines(p) for p in files), key=lambda e: e.ts)


def _micros(stamp: str) -> int:
    """`2024-05-01T12:00:00.000000Z` (journal.iso) as microseconds; 0 when it is not one."""
    try:
        at = _dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=_dt.UTC)
    except ValueError:
        return 0
    return int(at.timestamp() * 1_000_000)
