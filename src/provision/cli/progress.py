"""Progress while waiting for a job: `apply --wait`, `wait`, `status --watch`.

On a terminal, one line per task is redrawn in place (state, restarts, time in that state,
the task's last log line). Anywhere else (CI logs, pipes) plain lines are printed: one when
a task's state or the job's phase changes, and a summary every `every` seconds, so a long
job still shows it is alive. Everything goes to stderr; stdout is left to the output a
script reads (`--logs` lines, `--json`).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from provision.core.errors import EXIT_INTERRUPTED, EXIT_TIMEOUT, ProvisionError
from provision.core.lifecycle import JobPhase
from provision.core.text import duration, printable
from provision.io.journal import last_lines
from provision.rules.status import JobStatus, TaskStatus
from provision.run.context import Context
from provision.run.jobend import collect
from provision.run.logs import run_logs

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def fit(line: str, width: int) -> str:
    """A line cut to the terminal's width (a wrapped line would break the redraw)."""
    plain = _ANSI.sub("", line)
    if len(plain) <= width:
        return line
    return plain[: max(0, width - 1)] + "…"


def phase_line(st: JobStatus) -> str:
    line = f"job {st.phase}" + (f": {printable(st.reason)}" if st.reason else "")
    if st.unreachable:
        line += f" (unreachable: {printable(', '.join(st.unreachable))})"
    return line


def task_line(t: TaskStatus, last: str | None, width: int) -> str:
    since = duration(t.since) or "-"
    restarts = f"{t.restarts} restart{'s' if t.restarts != 1 else ''}"
    head = f"  {t.task}@{t.host}".ljust(width) + f"  {t.state.value:<10} {restarts:<11} {since:>4}"
    tail = last if last else (t.detail if t.state.ended or t.state.value == "Unknown" else "")
    return head + (f"  | {printable(tail)}" if tail else "")  # the task's own line, or the host's words


def counts(st: JobStatus) -> str:
    by: dict[str, int] = {}
    for t in st.tasks:
        by[t.state.value] = by.get(t.state.value, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in by.items())


class Display:
    """Draws the job's progress: in place on a terminal, as plain lines elsewhere."""

    def __init__(
        self,
        out: TextIO | None = None,
        *,
        tty: bool | None = None,
        every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.out = out or sys.stderr
        self.tty = is_terminal(self.out) if tty is None else tty
        self.every = every
        self.clock = clock
        self.start = clock()
        self.drawn = 0  # lines drawn in place (tty), to redraw over
        self.last_phase: str | None = None
        self.states: dict[str, str] = {}
        self.last_plain = self.start

    def stamp(self) -> str:
        return f"[{int(self.clock() - self.start)}s]"

    def _write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except (BrokenPipeError, ValueError):
            pass

    # -- terminal

    def draw(self, lines: Sequence[str]) -> None:
        """Replace what was drawn last with `lines` (terminal only)."""
        width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
        buf = f"\x1b[{self.drawn}F" if self.drawn else ""
        for line in lines:
            buf += "\x1b[2K" + fit(line, width) + "\n"
        extra = self.drawn - len(lines)
        if extra > 0:
            buf += "\x1b[2K\n" * extra + f"\x1b[{extra}F"
        self.drawn = len(lines)
        self._write(buf)

    def keep(self) -> None:
        """Leave what is drawn on the screen; later output goes below it."""
        self.drawn = 0

    # -- both

    def update(self, st: JobStatus, last: Mapping[str, str] | None = None) -> None:
        """Show the job's status now; `last`: task -> its last log line."""
        last = last or {}
        if self.tty:
            width = max((len(f"{t.task}@{t.host}") for t in st.tasks), default=0) + 2
            head = f"{self.stamp()} {phase_line(st)}"
            self.draw([head, *(task_line(t, last.get(t.task), width) for t in st.tasks)])
            return
        lines = []
        phase = phase_line(st)
        if phase != self.last_phase:
            lines.append(f"{self.stamp()} {phase}")
            self.last_phase = phase
        for t in st.tasks:
            key = f"{t.state.value}/{t.restarts}"
            if self.states.get(t.task) != key:
                self.states[t.task] = key
                more = f", {t.restarts} restart{'s' if t.restarts != 1 else ''}" if t.restarts else ""
                detail = (
                    f": {printable(t.detail)}" if t.detail and (t.state.ended or t.state.value != "Running") else ""
                )
                lines.append(f"{self.stamp()} {t.task}@{t.host} {t.state.value}{more}{detail}")
        now = self.clock()
        if lines:
            self.last_plain = now
        elif now - self.last_plain >= self.every:
            lines.append(f"{self.stamp()} job {st.phase}: {counts(st)}")
            self.last_plain = now
        for line in lines:
            self._write(line + "\n")

    def note(self, st: JobStatus) -> None:
        """Take `st` as shown already (plain lines then name only what changes after it)."""
        self.last_phase = phase_line(st)
        self.states = {t.task: f"{t.state.value}/{t.restarts}" for t in st.tasks}
        self.last_plain = self.clock()

    def finish(self, st: JobStatus, inventory: str | None = None) -> None:
        """The outcome: the phase line, and the last lines of each task that failed."""
        if self.tty:
            self.update(st)
            self.keep()
        elif phase_line(st) != self.last_phase:
            self.update(st)
        for line in failed_lines(st, inventory):
            self._write(line + "\n")

    def say(self, line: str) -> None:
        """A line of its own (an error, a note) below the progress."""
        if self.tty:
            self.keep()
        self._write(line + "\n")


def failed_lines(st: JobStatus, inventory: str | None = None) -> list[str]:
    """For each task with journal lines (it failed): a heading and its last lines; the
    same for each host whose setup failed."""
    out: list[str] = []
    for host, lines in sorted(st.setup_lines.items()):
        more = f" (all of them: provision logs --setup {inventory})" if inventory else ""
        out.append(f"setup@{host} failed, last lines{more}:")
        out += [f"  | {printable(line)}" for line in lines] or ["  (it printed nothing)"]
    for t in st.tasks:
        if not t.last_lines:
            continue
        more = f" (all of them: provision logs {inventory} {t.task})" if inventory else ""
        out.append(f"{t.task}@{t.host}, last lines{more}:")
        out += [f"  | {printable(line)}" for line in t.last_lines]
    return out


def _wait_with_logs(
    ctx: Context, st: JobStatus, disp: Display, *, quiet: bool, since: str | None, timeout: float | None
) -> int:
    """wait --logs: the tasks' output streams (from `since`, else each task's last 10
    lines) while the status is shown as plain lines; the job's end ends it."""

    def on_status(s: JobStatus) -> None:
        if not quiet:
            disp.update(s)

    on_status(st)
    code = run_logs(ctx, since=since, tail=None if since else 10, follow=True, on_status=on_status, timeout=timeout)
    if code in (EXIT_TIMEOUT, EXIT_INTERRUPTED):
        for line in still_running(ctx.where):
            disp.say(line)
    return code


def still_running(inventory: str) -> list[str]:
    """What to do about a job a wait left (a timeout, Ctrl-C): it runs on without us."""
    return [
        "The job is still running on its hosts. "
        f"`provision wait {inventory}` waits again, `provision logs -f {inventory}` follows its output, "
        f"`provision stop {inventory}` ends it, `provision destroy {inventory}` removes it."
    ]


def _last_line_of_each(ctx: Context, st: JobStatus) -> dict[str, str]:
    """task -> its newest journal line, for the tasks still running (one round trip per host)."""
    live: dict[str, list[str]] = {}
    for t in st.tasks:
        if t.state.live:
            live.setdefault(t.host, []).append(t.task)
    if not live:
        return {}
    lines = last_lines(ctx.session, ctx.targets, ctx.inventory.job, live, 1)
    return {k: v[-1] for k, v in lines.items() if v}


def wait_job(  # noqa: C901  the wait loop with each of its exits (ended, timed out, Ctrl-C) in one place
    ctx: Context,
    *,
    timeout: float | None = None,
    interval: float = 2.0,
    quiet: bool = False,
    logs: bool = False,
    since: str | None = None,
    display: Display | None = None,
) -> int:
    """Block until the job succeeds (0) or fails or is stopped (1, its failed tasks' last
    lines shown); EXIT_TIMEOUT at the timeout, saying so and what to do about the job. With `logs`, the tasks' output streams on stdout meanwhile
    (from `since`, else each task's last 10 lines) and progress is printed as plain lines."""
    ctx = ctx.whole()  # with --target too, the job ends when the whole job does
    disp = display or Display(tty=False if logs else None)
    try:
        st = collect(ctx)
        if st.tasks and all(t.detail == "not applied" for t in st.tasks):
            raise ProvisionError(f"job {st.job} is not on its hosts: run `provision apply {ctx.where}` first")
        if logs:
            return _wait_with_logs(ctx, st, disp, quiet=quiet, since=since, timeout=timeout)
        while True:
            if st.phase.ended or st.setup_failed:  # a failed setup: nothing starts until an apply
                if not quiet:
                    disp.finish(st, ctx.where)
                return 0 if st.phase is JobPhase.SUCCEEDED else 1
            if not quiet:
                disp.update(st, _last_line_of_each(ctx, st) if disp.tty else {})
            if timeout is not None and disp.clock() - disp.start > timeout:
                disp.say(f"Error: timed out after {timeout:g}s; the job is still {st.phase}")
                for line in still_running(ctx.where):
                    disp.say(line)
                return EXIT_TIMEOUT
            time.sleep(interval)
            st = collect(ctx)
    except KeyboardInterrupt:
        disp.keep()
        if not quiet:
            for line in still_running(ctx.where):
                disp.say(line)
        raise
