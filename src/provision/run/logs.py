"""`provision logs`: the journald output of a job's tasks, from every host at once.

Each task's stdout and stderr go to journald under the identifier `provision-<job>-<task>`
(the unit's SyslogIdentifier=). One SSH command per host runs `journalctl -o json` once
per task of the job on that host; the entries are merged in time order and printed with a
`task@host` prefix. `--follow` then keeps one `journalctl --follow` per host streaming
(it follows the identifier, so a task that restarts keeps streaming), `-o DIR` writes
DIR/<task>.log and remembers, per host and task, the journal cursor of the last entry
written, so the next call appends only what is new.

Journald's JSON needs care (see `message_lines`): MESSAGE may be missing or null, a list of
byte values (not UTF-8, or containing control characters), or repeated (a list of values);
progress bars rewrite their line with carriage returns; lines may be very long.
"""

from __future__ import annotations

import datetime as _dt
import heapq
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import click

from provision.core.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, ProvisionError
from provision.core.explain import SYSTEMD_LABEL, strip_unit
from provision.core.target import HostError
from provision.host import layout
from provision.io.steps import Step, run_step
from provision.rules.status import JobStatus
from provision.run.context import Context

CURSOR_FILE = ".provision-logs.json"
FIELDS = "MESSAGE,SYSLOG_IDENTIFIER,UNIT"
# systemd's messages about a task's unit that `logs` shows besides the program's output:
# notices and worse (a failed exec and its reason, an exit status, a kill), and restarts.
SYSTEMD_PRIORITIES = range(6)  # emerg .. notice
RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"  # "Scheduled restart job, restart counter is at N."
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
_DURATION = re.compile(r"^(\d+)(s|m|h|d|w)$")
NO_MESSAGE = "(no message)"


# --------------------------------------------------------------------------- parsing (pure)


def _text(value) -> str:
    """One MESSAGE value as text: a string, or a list of byte values (journald's JSON for
    data that is not valid UTF-8 or holds control characters)."""
    if value is None:
        # journalctl prints null for fields it chose not to show (over 4096 bytes without
        # --all, which provision passes); say so rather than print an empty line.
        return NO_MESSAGE
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, int) for b in value):
        try:
            data = bytes(b & 0xFF for b in value)
        except (TypeError, ValueError):
            return NO_MESSAGE
        return data.decode("utf-8", "replace")
    return str(value)


def terminal_text(line: str) -> str:
    """What a terminal shows for a line that rewrites itself with carriage returns
    (progress bars): the text after the last \\r. A trailing \\r (CRLF line ends) is
    dropped first, so `done\\r` stays `done`."""
    line = line.rstrip("\r")
    if "\r" in line:
        line = line.rsplit("\r", 1)[1]
    return line


def message_lines(entry: dict) -> list[str]:
    """The printable lines of one journal entry ([] when it has no MESSAGE field).

    A field repeated in one entry comes as a list of values, each a string or a list of
    byte values; a single binary value is one list of integers."""
    if "MESSAGE" not in entry:
        return []
    raw = entry["MESSAGE"]
    if isinstance(raw, list) and raw and not all(isinstance(b, int) for b in raw):
        values = raw  # repeated field: several values
    else:
        values = [raw]
    out: list[str] = []
    for v in values:
        # journald splits stdout on \n itself; a value may still hold some (binary data,
        # or a message sent over the native protocol): one output line each.
        for part in _text(v).rstrip("\n").split("\n"):
            out.append(terminal_text(part))
    return out


@dataclass(frozen=True)
class Entry:
    ts: int  # __REALTIME_TIMESTAMP, µs since the epoch (host clock)
    host: str
    task: str
    text: str
    cursor: str


def parse_line(
    line: bytes | str, host: str, tasks_by_ident: dict[str, str], tasks_by_unit: dict[str, str] | None = None
) -> list[Entry] | dict | None:
    """One line of `journalctl -o json`: a list of Entry (one per message line), a control
    record of ours (a dict with a "__provision_*" key), or None for anything else (blank
    lines, informational text, a cut-off line).

    An entry of a task's program is found by its SYSLOG_IDENTIFIER; systemd's own messages
    about the task's unit (`tasks_by_unit`: unit name -> task) by their UNIT field, shown
    with a `[systemd] ` label and without the leading unit name."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict):
        return None
    if any(k.startswith("__provision_") for k in entry):
        return entry
    ident = entry.get("SYSLOG_IDENTIFIER")
    if isinstance(ident, list):  # repeated or binary: take the first printable one
        ident = _text(ident[0]) if ident and not isinstance(ident[0], int) else _text(ident)
    task = tasks_by_ident.get(ident) if isinstance(ident, str) else None
    system = False
    if task is None and tasks_by_unit:
        unit = entry.get("UNIT")
        task = tasks_by_unit.get(unit) if isinstance(unit, str) else None
        system = task is not None
    if task is None:
        return None
    try:
        ts = int(entry.get("__REALTIME_TIMESTAMP") or 0)
    except (TypeError, ValueError):
        ts = 0
    raw_cursor = entry.get("__CURSOR")
    cursor = raw_cursor if isinstance(raw_cursor, str) else ""
    if system:
        return [Entry(ts, host, task, SYSTEMD_LABEL + strip_unit(text), cursor) for text in message_lines(entry)]
    return [Entry(ts, host, task, text, cursor) for text in message_lines(entry)]


def normalize_since(since: str | None) -> str | None:
    """`--since` for journalctl: `10m`, `2h`, `1d` (ago, as kubectl takes them), or
    anything journalctl reads (`2024-05-01 12:00:00`, `yesterday`, `-5min`, `@EPOCH`)."""
    if since is None:
        return None
    s = since.strip()
    if not s:
        raise ProvisionError("--since: empty; give a duration (10m, 2h, 1d) or a time (2024-05-01 12:00:00)")
    m = _DURATION.match(s)
    if m:
        unit = {"s": "s", "m": "min", "h": "h", "d": "d", "w": "w"}[m.group(2)]
        return f"-{m.group(1)}{unit}"
    if re.match(r"^\d{4}-\d\d-\d\dT\d", s):
        s = s.replace("T", " ", 1)
    if s.endswith("Z"):
        s = s[:-1] + " UTC"
    return s


def merge(batches: Iterable[list[Entry]]) -> list[Entry]:
    """Entries of many hosts and tasks in time order; ties keep each host's own order."""
    tagged = []
    for b_i, batch in enumerate(batches):
        for i, e in enumerate(batch):
            tagged.append((e.ts, b_i, i, e))
    tagged.sort(key=lambda t: t[:3])
    return [t[3] for t in tagged]


def iso(ts_us: int) -> str:
    return _dt.datetime.fromtimestamp(ts_us / 1e6, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- host commands


def identifier(job: str, task: str) -> str:
    return layout.log_identifier(job, task)


def unit_matches(job: str, task: str) -> list[str]:
    """journalctl matches for one task: its program's output (the unit's SyslogIdentifier=)
    or systemd's notices about its unit and its restarts (terms joined by `+`: OR)."""
    unit = layout.unit_name(job, task)
    return [
        f"SYSLOG_IDENTIFIER={identifier(job, task)}",
        "+",
        f"UNIT={unit}",
        *(f"PRIORITY={p}" for p in SYSTEMD_PRIORITIES),
        "+",
        f"UNIT={unit}",
        f"MESSAGE_ID={RESTART_SCHEDULED}",
    ]


def matches(job: str, tasks: Iterable[str]) -> list[str]:
    out: list[str] = []
    for task in tasks:
        out += (["+"] if out else []) + unit_matches(job, task)
    return out


def units_of(job: str, tasks: Iterable[str]) -> dict[str, str]:
    """unit name -> task, for parse_line."""
    return {layout.unit_name(job, t): t for t in tasks}


def fetch_command(
    job: str, tasks: list[str], *, since: str | None, tail: int | None, cursors: dict[str, str] | None
) -> str:
    """One command for a host (`sh -c`, so a `sudo -n` prefix covers all of it): the host's
    clock, then for each task its entries and journalctl's exit status (so a failure is
    pinned on the task that had it)."""
    parts = ['echo "{\\"__provision_now\\":$(date +%s%N)}"']
    for task in tasks:
        argv = [
            "journalctl",
            "-o",
            "json",
            "--all",
            "--no-pager",
            "-q",
            f"--output-fields={FIELDS}",
        ]
        cursor = (cursors or {}).get(task)
        if since:
            argv += ["--since", since]
        if cursor:
            argv += ["--after-cursor", cursor]
        elif tail is not None:
            # -n counts from the end only without a start point: newest first, reversed here.
            argv += ["--reverse", "-n", str(tail)]
        argv += unit_matches(job, task)
        parts.append(" ".join(shlex.quote(a) for a in argv))
        parts.append('echo "{\\"__provision_rc\\":$?,\\"__provision_task\\":\\"%s\\"}"' % task)
    return "sh -c " + shlex.quote("; ".join(parts))


def follow_command(job: str, tasks: list[str], since_epoch: int) -> str:
    """`journalctl --follow` that ends when the SSH channel closes.

    Without a terminal nothing tells journalctl that its reader left until it next writes,
    which for a quiet task may be never: a watcher holding the channel's stdin kills it on
    EOF. (Asynchronous lists get /dev/null as stdin, hence the copy of fd 0 on fd 3.)"""
    argv = [
        "journalctl",
        "-o",
        "json",
        "--all",
        "--no-pager",
        "-q",
        f"--output-fields={FIELDS}",
        "--follow",
        "--since",
        f"@{since_epoch}",
        *matches(job, tasks),
    ]
    script = (
        "exec 3<&0; " + " ".join(shlex.quote(a) for a in argv) + " </dev/null & j=$!; "
        "(cat <&3 >/dev/null 2>&1; kill $j 2>/dev/null) >/dev/null 2>&1 & "
        "wait $j"
    )
    return "sh -c " + shlex.quote(script)


@dataclass
class HostLog:
    host: str
    entries: list[Entry] = field(default_factory=list)
    now_us: int | None = None
    errors: list[str] = field(default_factory=list)


def parse_fetch(
    host: str,
    stdout: bytes,
    stderr: bytes,
    tasks_by_ident: dict[str, str],
    reversed_tasks: set[str],
    tasks_by_unit: dict[str, str] | None = None,
) -> HostLog:
    """The output of `fetch_command` → a HostLog (entries in journal order per task)."""
    out = HostLog(host)
    per_task: dict[str, list[Entry]] = {}
    err_lines = [l for l in stderr.decode("utf-8", "replace").splitlines() if l.strip()]
    for raw in stdout.split(b"\n"):
        got = parse_line(raw, host, tasks_by_ident, tasks_by_unit)
        if got is None:
            continue
        if isinstance(got, dict):
            if "__provision_now" in got:
                try:
                    out.now_us = int(got["__provision_now"]) // 1000
                except (TypeError, ValueError):
                    pass
            elif got.get("__provision_rc") not in (0, None):
                why = "; ".join(dict.fromkeys(err_lines)) or f"journalctl exited {got['__provision_rc']}"
                out.errors.append(f"{got.get('__provision_task')}: {why}")
            continue
        for e in got:
            per_task.setdefault(e.task, []).append(e)
    for task, es in per_task.items():
        if task in reversed_tasks:
            es.reverse()
        out.entries.extend(es)
    return out


def host_last_lines(session, target, job: str, tasks: list[str], n: int = 10) -> dict[str, list[str]]:
    """The last `n` lines of each task's journal on one host (its output and systemd's
    notices about it), oldest first: one round trip. Raises HostError."""
    cmd = fetch_command(job, tasks, since=None, tail=n, cursors=None)
    res = session.run(target, cmd, timeout=60)
    idents = {identifier(job, t): t for t in tasks}
    hl = parse_fetch(target.name, res.stdout, res.stderr, idents, set(tasks), units_of(job, tasks))
    out: dict[str, list[str]] = {t: [] for t in tasks}
    for e in hl.entries:
        out[e.task].append(e.text)
    return out


def last_lines(ctx, wanted: dict[str, list[str]], n: int = 10) -> dict[str, list[str]]:
    """host -> tasks  =>  task -> its last `n` journal lines, one round trip per host at
    once; hosts that fail are left out (this only adds to what status says)."""

    job = ctx.inventory.job
    targets = [ctx.targets[h] for h in wanted if h in ctx.targets]
    res = ctx.session.map(lambda t: host_last_lines(ctx.session, t, job, wanted[t.name], n), targets)
    out: dict[str, list[str]] = {}
    for r in res.values():
        if not isinstance(r, HostError):
            out.update(r)
    return out


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
    terminal only), or to DIR/<task>.log. Thread-safe (follow mode prints from threads)."""

    def __init__(
        self,
        task_order: list[str],
        hosts: dict[str, str],
        *,
        out_dir: Path | None,
        timestamps: bool,
        color: bool | None = None,
    ):
        self.lock = threading.Lock()
        self.out_dir = out_dir
        self.timestamps = timestamps
        # It prints from the hosts' threads, which do not see click's context: NO_COLOR here.
        self.color = False if color is None and os.environ.get("NO_COLOR") else color
        self.colors = {t: COLORS[i % len(COLORS)] for i, t in enumerate(task_order)}
        self.width = max((len(f"{t}@{hosts[t]}") for t in task_order), default=0)
        self.files: dict[str, TextIO] = {}
        self.counts: dict[str, int] = {}
        self.cursors: dict[str, dict[str, str]] = {}
        self.pipe_closed = False  # the reader went away (`provision logs … | head`)
        self.on_pipe_closed: Callable[[], None] = lambda: None

    def write(self, e: Entry) -> None:
        with self.lock:
            if self.pipe_closed:
                return
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
            prefix = f"{e.task}@{e.host}".ljust(self.width)
            prefix = click.style(prefix, fg=self.colors.get(e.task))
            stamp = f"{iso(e.ts)} " if self.timestamps else ""
            try:
                click.echo(f"{stamp}{prefix} | {e.text}", color=self.color)
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


# --------------------------------------------------------------------------- the command


def run_logs(
    ctx: Context,
    tasks: tuple[str, ...] = (),
    *,
    since: str | None = None,
    tail: int | None = None,
    follow: bool = False,
    out_dir: str | None = None,
    timestamps: bool = False,
    stop: threading.Event | None = None,
    echo_err: Callable[[str], None] = lambda s: click.echo(s, err=True),
    until_end: bool = True,
    on_status: Callable[[JobStatus], None] | None = None,
    timeout: float | None = None,
) -> int:
    """Print (or write) the job's logs; returns the exit code (0, or 3 when a host was
    unreachable: the others' logs were still shown). With `follow`, until the job ends
    (`until_end`; then 0 when it succeeded, 1 when it failed) or Ctrl-C (130).

    For `wait --logs`: `on_status` sees every status polled (it then says how the job
    ended) and `timeout` gives up after that many seconds (1)."""

    closers: list[Callable[[], None]] = []
    try:
        job = ctx.inventory.job
        assert ctx.rendered is not None
        placed = [t for t in ctx.rendered.placement.tasks if t.host.name in ctx.targets]
        names = [t.name for t in ctx.rendered.placement.tasks]
        if tasks:
            unknown = [t for t in tasks if t not in names]
            if unknown:
                raise ProvisionError(f"no task named {', '.join(unknown)} in job {job} (tasks: {', '.join(names)})")
            placed = [t for t in placed if t.name in tasks]
            if not placed:
                raise ProvisionError(f"{', '.join(tasks)}: not on the --target hosts")
        since_j = normalize_since(since)
        if tail is not None and tail < 0:
            raise ProvisionError(f"--tail {tail}: expected a number >= 0")
        by_host: dict[str, list[str]] = {}
        for t in placed:
            by_host.setdefault(t.host.name, []).append(t.name)
        host_of = {t.name: t.host.name for t in placed}
        idents = {identifier(job, t.name): t.name for t in placed}
        units = units_of(job, (t.name for t in placed))
        out_path = None
        cursors: dict[str, dict[str, str]] = {}
        if out_dir is not None:
            out_path = Path(out_dir)
            try:
                out_path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ProvisionError(f"{out_dir}: cannot create: {e.strerror}") from None
            cursors = load_cursors(out_path, job)
        printer = Printer([t.name for t in placed], host_of, out_dir=out_path, timestamps=timestamps)
        stop = stop or threading.Event()
        printer.on_pipe_closed = stop.set
        printer.cursors = {h: dict(c) for h, c in cursors.items()}
        reversed_tasks_by_host = {
            h: {t for t in ts if tail is not None and not cursors.get(h, {}).get(t)} for h, ts in by_host.items()
        }

        def fetch(tg) -> HostLog:
            cmd = fetch_command(job, by_host[tg.name], since=since_j, tail=tail, cursors=cursors.get(tg.name))
            res = ctx.session.run(tg, cmd, timeout=300)
            return parse_fetch(tg.name, res.stdout, res.stderr, idents, reversed_tasks_by_host[tg.name], units)

        results = ctx.session.map(fetch, [ctx.targets[h] for h in by_host])
        logs = [r for r in results.values() if isinstance(r, HostLog)]
        for hl in logs:
            if tail is not None:  # with a cursor, --tail is applied here
                per: dict[str, list[Entry]] = {}
                for item in hl.entries:
                    per.setdefault(item.task, []).append(item)
                hl.entries = [x for es in per.values() for x in (es[-tail:] if tail else [])]
        for entry in merge(hl.entries for hl in logs):
            printer.write(entry)
        printer.flush()
        code = EXIT_OK
        bad_hosts = []
        failed: dict[str, list[str]] = {}  # journalctl's complaint -> "task@host"
        for name, r in results.items():
            if isinstance(r, HostError):
                echo_err(f"Error: {r.target.where}: {r.message}")
                bad_hosts.append(name)
                code = EXIT_UNREACHABLE if r.unreachable else max(code, EXIT_ERROR)
            else:
                for msg in r.errors:
                    task, _, why = msg.partition(": ")
                    failed.setdefault(why, []).append(f"{task}@{name}")
                    code = code if code == EXIT_UNREACHABLE else EXIT_ERROR
        for why, where in failed.items():  # a bad --since fails the same way everywhere: one line
            echo_err(f"Error: journalctl ({', '.join(where)}): {why}")
        if out_path is not None:
            save_cursors(out_path, job, printer.cursors)
        if follow and not printer.pipe_closed:
            live = [hl for hl in logs if not hl.errors]
            code2 = _follow(
                ctx,
                job,
                by_host,
                idents,
                units,
                live,
                printer,
                out_path,
                stop,
                echo_err,
                job_status=_job_watcher(ctx, on_status) if until_end else None,
                announce=on_status is None,
                timeout=timeout,
            )
            # The job's outcome (or Ctrl-C's 130) is the exit code; unreachable hosts still say 3.
            code = code if code == EXIT_UNREACHABLE else code2
        printer.close()
        if out_path is not None:
            for t in placed:
                n = printer.counts.get(t.name, 0)
                echo_err(
                    f"{t.name}@{t.host.name}: {n} new line{'s' if n != 1 else ''} -> {out_path / (t.name + '.log')}"
                )
            save_cursors(out_path, job, printer.cursors)
        if bad_hosts:
            echo_err(f"Unreachable: {', '.join(sorted(bad_hosts))}. The other hosts' logs are above.")
        return code
    finally:
        for close in closers:
            close()


def _job_watcher(ctx: Context, on_status: Callable[[JobStatus], None] | None = None) -> Callable[[], JobStatus | None]:
    """The job's status for `--follow` to end with, from every host of the job (with
    --target too: a part cannot tell the whole ended)."""
    from provision.run.jobend import collect  # FIXME(merge): top-level once last_lines is in io/journal

    whole = ctx.whole()

    def status() -> JobStatus:
        st = collect(whole)
        if on_status is not None:
            on_status(st)
        return st

    return status


class Reorder:
    """A small reorder window: entries from many hosts, printed in time order.

    Each entry waits `window` seconds after it arrived; the oldest (by the host's clock)
    goes first, so lines from hosts whose streams lag a little behind still come out in
    time order. A line later than the window is printed when it arrives."""

    def __init__(self, emit: Callable[[Entry], None], window: float = 1.0):
        self.emit, self.window = emit, window
        self.heap: list[tuple[int, int, float, Entry]] = []
        self.lock = threading.Lock()
        self.seq = 0

    def push(self, e: Entry, now: float | None = None) -> None:
        with self.lock:
            self.seq += 1
            heapq.heappush(self.heap, (e.ts, self.seq, time.monotonic() if now is None else now, e))

    def due(self, now: float | None = None) -> None:
        """Print what has waited long enough (everything older than it first)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            out = []
            while self.heap and self.heap[0][2] <= now - self.window:
                out.append(heapq.heappop(self.heap)[3])
        for e in out:
            self.emit(e)

    def drain(self) -> None:
        with self.lock:
            out = [heapq.heappop(self.heap)[3] for _ in range(len(self.heap))]
        for e in out:
            self.emit(e)


class Boundary:
    """Where a task's follow stream takes over from what was already printed.

    Per task, the last entry printed (time and cursor), or the moment the fetch began for a
    task that printed nothing: a stream that starts earlier (it starts on a whole second, or
    again after a broken connection) skips what is not newer, so every line is printed once
    and `--tail N` shows exactly N lines before the new ones."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], tuple[int, str]] = {}
        self.skipping: set[tuple[str, str]] = set()

    def printed(self, e: Entry) -> None:
        self.last[(e.host, e.task)] = (e.ts, e.cursor)

    def start(self, host: str, tasks: Iterable[str], now_us: int) -> None:
        """A stream (re)starts for `tasks` of `host`."""
        for t in tasks:
            self.last.setdefault((host, t), (now_us, ""))
            self.skipping.add((host, t))

    def accept(self, e: Entry) -> bool:
        key = (e.host, e.task)
        if key in self.skipping:
            ts, cursor = self.last.get(key, (0, ""))
            if cursor and e.cursor == cursor:
                self.skipping.discard(key)
                return False
            if e.ts <= ts:
                return False
            self.skipping.discard(key)
        self.last[key] = (e.ts, e.cursor)
        return True


def _follow(
    ctx,
    job: str,
    by_host: dict[str, list[str]],
    idents: dict[str, str],
    units: dict[str, str],
    logs: list[HostLog],
    printer: Printer,
    out_path: Path | None,
    stop: threading.Event,
    echo_err: Callable[[str], None],
    *,
    job_status: Callable[[], JobStatus | None] | None = None,
    poll: float = 2.0,
    grace: float = 2.0,
    window: float = 1.0,
    announce: bool = True,
    timeout: float | None = None,
) -> int:
    """Stream from every host at once until the job has ended (`job_status` returns a
    JobStatus; exit 0 when it succeeded, 1 when it failed) or `stop` is set (130: Ctrl-C).

    Each host's stream starts at the second its fetch began (`--since @T`, T from the
    host's clock) and skips per task what was printed already (Boundary); lines go out in
    time order across hosts through a reorder window. A stream that breaks (the host
    rebooted, the connection dropped) is started again from its last entry. Once the job
    has ended, the streams run `grace` seconds more for the last lines."""

    boundary = Boundary()
    starts: dict[str, int] = {}
    for hl in logs:
        now_us = hl.now_us or int(time.time() * 1e6)
        for e in hl.entries:
            boundary.printed(e)
        boundary.start(hl.host, by_host[hl.host], now_us)
        starts[hl.host] = now_us // 1_000_000
    reorder = Reorder(printer.write, window)
    failures: dict[str, str] = {}
    newest: dict[str, int] = {}

    def on_entry(host: str, e: Entry) -> None:
        if not boundary.accept(e):
            return
        newest[host] = max(newest.get(host, 0), e.ts)
        reorder.push(e)

    def run_host(host: str) -> None:
        tg = ctx.targets[host]
        warned = False
        while not stop.is_set():
            cmd = follow_command(job, by_host[host], starts[host])

            def on_line(raw: bytes, host=host) -> None:
                got = parse_line(raw, host, idents, units)
                if isinstance(got, list):
                    for e in got:
                        on_entry(host, e)

            try:
                ctx.session.stream(tg, cmd, on_line, stop=stop)
                why = "the log stream ended"
            except HostError as e:
                why = e.message
            except Exception as e:  # noqa: BLE001 - connection lost mid-stream: report, retry
                # (the session reconnects on the next call: it checks the connection first)
                why = f"connection lost: {e or type(e).__name__}"
            if stop.is_set():
                return
            failures[host] = why
            if not warned:
                echo_err(f"Warning: {tg.where}: {why}; retrying every 2 s")
                warned = True
            # Resume from the newest entry seen; Boundary skips what was printed.
            if host in newest:
                starts[host] = newest[host] // 1_000_000
            boundary.start(host, by_host[host], 0)
            stop.wait(2.0)

    ended: list[JobStatus] = []  # the status that saw the job end

    def watch() -> None:
        while not stop.is_set():
            try:
                st = job_status() if job_status is not None else None
            except (HostError, ProvisionError) as e:
                echo_err(f"Warning: job status: {getattr(e, 'message', e)}")
                st = None
            if st is not None and st.phase.ended:
                ended.append(st)
                return
            stop.wait(poll)

    threads = [threading.Thread(target=run_host, args=(h,), daemon=True, name=f"logs-{h}") for h in starts]
    if job_status is not None:
        threads.append(threading.Thread(target=watch, daemon=True, name="logs-status"))
    for t in threads:
        t.start()
    last_save = began = time.monotonic()
    end_at: float | None = None
    code = EXIT_OK
    timed_out = False
    try:
        while any(t.is_alive() for t in threads) and not stop.is_set():
            stop.wait(0.1)
            reorder.due()
            if ended and end_at is None:
                end_at = time.monotonic() + grace
            if end_at is not None and time.monotonic() >= end_at:
                code = EXIT_OK if ended[0].phase.value == "Succeeded" else EXIT_ERROR
                break
            if timeout is not None and not ended and time.monotonic() - began > timeout:
                timed_out, code = True, EXIT_ERROR
                break
            if out_path is not None and time.monotonic() - last_save > 2:
                printer.flush()
                save_cursors(out_path, job, printer.cursors)
                last_save = time.monotonic()
        if not ended and not printer.pipe_closed and not timed_out:
            code = EXIT_INTERRUPTED  # stopped from outside: Ctrl-C, or the caller's stop
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    finally:
        stop.set()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: we are leaving
        for t in threads:
            t.join(timeout=5)
        reorder.drain()
    if timed_out:
        echo_err(f"Error: timed out after {timeout:g}s; the job has not ended")
    elif ended and announce:
        st = ended[0]
        echo_err(f"job {st.phase}" + (f": {st.reason}" if st.reason else ""))
    elif code == EXIT_INTERRUPTED and not printer.pipe_closed:
        echo_err("Interrupted.")
    return code


# --------------------------------------------------------------------------- setup


def setup_command(job: str, tail: int | None) -> str:
    """The setup unit's output on a host, oldest first."""
    argv = ["journalctl", "-t", layout.setup_log_identifier(job), "-o", "cat", "--no-pager", "-q"]
    if tail is not None:
        argv += ["-n", str(tail)]
    return " ".join(shlex.quote(a) for a in argv)


def run_setup_logs(ctx: Context, *, tail: int | None = None) -> int:
    """`provision logs --setup`: each host's setup output, host by host, as `setup@HOST | line`."""

    job = ctx.inventory.job
    hosts = [n for n, b in ctx.rendered.hosts.items() if b.setup is not None and n in ctx.targets]
    if not hosts:
        raise ProvisionError(f"job {job} has no setup: on these hosts (inventory key `setup:`)")
    cmd = setup_command(job, tail)

    def fetch(tg) -> list[str]:
        res = ctx.session.run(tg, cmd, timeout=120)
        if res.exit_status != 0:
            raise HostError(tg, f"journalctl exited {res.exit_status}: {res.stderr.decode(errors='replace').strip()}")
        return res.stdout.decode("utf-8", "replace").splitlines()

    res = run_step(ctx.session, Step.PROBE, fetch, [ctx.targets[h] for h in hosts])
    for h in hosts:
        if h in res.ok:
            for line in res.ok[h]:
                click.echo(f"setup@{h} | {terminal_text(line)}")
    for e in res.errors.values():
        click.echo(f"Error: {e.target.where}: {e.message}", err=True)
    return 3 if res.unreachable else (1 if res.failed else 0)
