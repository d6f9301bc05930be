"""Where `provision logs` puts lines: the terminal, with a `task@host` prefix and a line
where each run begins, or DIR/<task>.log files with the journal cursors that let the next
`logs -o DIR` append only what is new."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import click

from provision.core.errors import ProvisionError
from provision.core.runs import Run, merged
from provision.core.text import printable
from provision.io.journal import Entry, iso

CURSOR_FILE = ".provision-logs.json"
COLORS = (
    "cyan",
    "green",
    "yellow",
    "magenta",
    "blue",
    "bright_cyan",
    "bright_green",
    "bright_yellow",
    "bright_magenta",
    "bright_blue",
    "red",
    "bright_red",
)


# --------------------------------------------------------------------------- cursors (-o DIR)


def load_cursors(out_dir: Path, job: str) -> dict[str, dict[str, str]]:
    path = out_dir / CURSOR_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ProvisionError(f"{path}: unreadable ({e}); delete it to fetch every line again") from None
    if not isinstance(data, dict) or data.get("job") != job or not isinstance(data.get("cursors"), dict):
        if isinstance(data, dict) and data.get("job") not in (None, job):
            raise ProvisionError(
                f"{out_dir}: holds the logs of job {data.get('job')!r}, not {job!r}; use another -o directory"
            )
        return {}
    return {h: dict(c) for h, c in data["cursors"].items() if isinstance(c, dict)}


def save_cursors(out_dir: Path, job: str, cursors: dict[str, dict[str, str]]) -> None:
    path = out_dir / CURSOR_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"job": job, "cursors": cursors}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- output


class Printer:
    """Writes entries: to the terminal with a `task@host` prefix (a colour per task on a
    terminal only), or to DIR/<task>.log. Thread-safe (follow mode prints from threads).

    On the terminal a task's text is printable (core/text.py: its escape sequences shown,
    not run) unless `raw`; DIR/<task>.log keeps it as the task wrote it. `label` goes
    before each prefix (a study's `trial-3/`)."""

    def __init__(
        self,
        task_order: list[str],
        hosts: dict[str, str],
        *,
        out_dir: Path | None,
        timestamps: bool,
        color: bool | None = None,
        raw: bool = False,
        label: str = "",
    ):
        self.lock = threading.Lock()
        self.raw, self.label = raw, label
        self.out_dir = out_dir
        self.timestamps = timestamps
        # It prints from the hosts' threads, which do not see click's context: NO_COLOR here.
        self.color = False if color is None and os.environ.get("NO_COLOR") else color
        self.colors = {t: COLORS[i % len(COLORS)] for i, t in enumerate(task_order)}
        self.width = max((len(f"{label}{t}@{hosts[t]}") for t in task_order), default=0)
        self.files: dict[str, TextIO] = {}
        self.counts: dict[str, int] = {}
        self.cursors: dict[str, dict[str, str]] = {}
        self.pipe_closed = False  # the reader went away (`provision logs … | head`)
        self.on_pipe_closed: Callable[[], None] = lambda: None
        # host -> its runs.json, as the hosts' answers bring them: a line marks where each
        # run begins (core/runs.py), before the first line of it that is shown.
        self.run_records: dict[str, Any] = {}
        self._runs: list[Run] | None = None
        self._run_shown: int | None = None
        # The first run's line too, when the output starts where a run does (not after
        # --tail or --since, where it would interrupt the lines asked for).
        self.lead_boundary = True

    def _boundary(self, e: Entry) -> str | None:
        """The line that opens e's run, when e is the first line shown of it."""
        if self._runs is None:
            self._runs = merged(self.run_records.values())
        ts = e.ts / 1e6
        current = next((r for r in reversed(self._runs) if r.started_at <= ts), None)
        if current is None or current.number == self._run_shown:
            return None
        first, self._run_shown = self._run_shown is None, current.number
        return None if first and not self.lead_boundary else f"── {printable(current.words())} ──"

    def write(self, e: Entry) -> None:
        with self.lock:
            if self.pipe_closed:
                return
            boundary = self._boundary(e) if self.out_dir is None else None
            if boundary is not None:
                self._echo(click.style(boundary, bold=True))
            self.counts[e.task] = self.counts.get(e.task, 0) + 1
            if e.cursor:
                self.cursors.setdefault(e.host, {})[e.task] = e.cursor
            if self.out_dir is not None:
                f = self.files.get(e.task)
                if f is None:
                    f = open(self.out_dir / f"{e.task}.log", "a", encoding="utf-8", errors="replace")
                    self.files[e.task] = f
                f.write(f"{iso(e.ts)} {e.host} {e.text}\n")
                return
            prefix = f"{self.label}{e.task}@{e.host}".ljust(self.width)
            stamp = f"{iso(e.ts)} " if self.timestamps else ""
            if self.raw:  # the task's text as written: click would take its colours out on a pipe
                coloured = self.color if self.color is not None else sys.stdout.isatty()
                prefix = click.style(prefix, fg=self.colors.get(e.task)) if coloured else prefix
                self._echo(f"{stamp}{prefix} | {e.text}", color=True)
                return
            prefix = click.style(prefix, fg=self.colors.get(e.task))
            self._echo(f"{stamp}{prefix} | {printable(e.text)}")

    def _echo(self, line: str, color: bool | None = None) -> None:
        if not self.pipe_closed:
            try:
                click.echo(line, color=self.color if color is None else color)
            except BrokenPipeError:
                self.pipe_closed = True
                # Python would complain again when it flushes stdout at exit.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
                self.on_pipe_closed()

    def flush(self) -> None:
        with self.lock:
            for f in self.files.values():
                f.flush()

    def close(self) -> None:
        with self.lock:
            for f in self.files.values():
                f.close()
            self.files.clear()
