"""Reading journald: the commands that fetch or follow a job's tasks' entries
(`journalctl -o json`) and the parser of what they print.

Each task's stdout and stderr go to journald under the identifier `provision-<job>-<task>`
(the unit's SyslogIdentifier=); systemd's own notices about the unit come under its unit
name. Journald's JSON needs care (see `message_lines`): MESSAGE may be missing or null, a
list of byte values (not UTF-8, or containing control characters), or repeated (a list of
values); progress bars rewrite their line with carriage returns; lines may be very long.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.explain import SYSTEMD_LABEL, strip_unit, systemd_words
from provision.core.target import HostError, Target
from provision.host import layout
from provision.io.ssh import Session

FIELDS = "MESSAGE,SYSLOG_IDENTIFIER,UNIT"


# systemd's messages about a task's unit that `logs` shows besides the program's output:
# notices and worse (a failed exec and its reason, an exit status, a kill), and restarts.
SYSTEMD_PRIORITIES = range(6)  # emerg .. notice


RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"  # "Scheduled restart job, restart counter is at N."


_DURATION = re.compile(r"^(\d+)(s|m|h|d|w)$")


NO_MESSAGE = "(no message)"


def _text(value: Any) -> str:
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


def message_lines(entry: dict[str, Any]) -> list[str]:
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


def _task_of(
    entry: dict[str, Any], tasks_by_ident: dict[str, str], tasks_by_unit: dict[str, str] | None
) -> tuple[str | None, bool]:
    """(the task an entry is about or None, whether it is systemd's message about its unit)."""
    ident = entry.get("SYSLOG_IDENTIFIER")
    if isinstance(ident, list):  # repeated or binary: take the first printable one
        ident = _text(ident[0]) if ident and not isinstance(ident[0], int) else _text(ident)
    task = tasks_by_ident.get(ident) if isinstance(ident, str) else None
    if task is None and tasks_by_unit:
        unit = entry.get("UNIT")
        task = tasks_by_unit.get(unit) if isinstance(unit, str) else None
        return task, task is not None
    return task, False


def parse_line(
    line: bytes | str, host: str, tasks_by_ident: dict[str, str], tasks_by_unit: dict[str, str] | None = None
) -> list[Entry] | dict[str, Any] | None:
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
    task, system = _task_of(entry, tasks_by_ident, tasks_by_unit)
    if task is None:
        return None
    try:
        ts = int(entry.get("__REALTIME_TIMESTAMP") or 0)
    except (TypeError, ValueError):
        ts = 0
    raw_cursor = entry.get("__CURSOR")
    cursor = raw_cursor if isinstance(raw_cursor, str) else ""
    if system:
        return [
            Entry(ts, host, task, SYSTEMD_LABEL + systemd_words(strip_unit(text)), cursor)
            for text in message_lines(entry)
        ]
    return [Entry(ts, host, task, text, cursor) for text in message_lines(entry)]


def normalize_since(since: str | None) -> str | None:
    """`--since` for journalctl: `10m`, `2h`, `1d` (ago, as kubectl takes them), or
    anything journalctl reads (`2024-05-01 12:00:00`, `yesterday`, `-5min`, `@EPOCH`)."""
    if since is None:
        return None
    s = since.strip()
    if not s:
        raise ProvisionError("--since: empty; give a duration (10m, 2h, 1d) or a time (2024-05-01 12:00:00)")
    m = _DURATION.fullmatch(s)
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


def runs_line(job: str) -> str:
    """A shell command printing the job's runs on the host (core/runs.py) as one control
    record: `{"__provision_runs": [...]}` (null when there are none)."""
    path = shlex.quote(layout.runs_path(job))
    return 'printf \'{"__provision_runs":%s}\\n\' "$(cat ' + path + ' 2>/dev/null || echo null)"'


def fetch_command(
    job: str,
    tasks: list[str],
    *,
    since: str | None,
    tail: int | None,
    cursors: dict[str, str] | None,
    until: str | None = None,
) -> str:
    """One command for a host (`sh -c`, so a `sudo -n` prefix covers all of it): the host's
    clock and the job's runs, then for each task its entries and journalctl's exit status
    (so a failure is pinned on the task that had it)."""
    parts = ['echo "{\\"__provision_now\\":$(date +%s%N)}"', runs_line(job)]
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
        if until:
            argv += ["--until", until]
        if cursor:
            argv += ["--after-cursor", cursor]
        elif tail is not None:
            # -n counts from the end only without a start point: newest first, reversed here.
            argv += ["--reverse", "-n", str(tail)]
        argv += unit_matches(job, task)
        parts.append(" ".join(shlex.quote(a) for a in argv))
        parts.append('echo "{\\"__provision_rc\\":$?,\\"__provision_task\\":\\"%s\\"}"' % task)
    return "sh -c " + shlex.quote("; ".join(parts))


def stream_command(job: str, tasks: list[str], *, since: str | None, until: str | None = None) -> str:
    """One journalctl for all of a host's tasks (their matches ORed: one time-ordered
    stream), for a fetch read as it arrives (run/logs: no --tail, no cursors); the job's
    runs first, journalctl's complaints on stdout too (they are not JSON), its exit status
    last."""
    argv = ["journalctl", "-o", "json", "--all", "--no-pager", "-q", f"--output-fields={FIELDS}"]
    if since:
        argv += ["--since", since]
    if until:
        argv += ["--until", until]
    argv += matches(job, tasks)
    script = (
        'echo "{\\"__provision_now\\":$(date +%s%N)}"; '
        + runs_line(job)
        + "; "
        + " ".join(shlex.quote(a) for a in argv)
        + ' 2>&1; echo "{\\"__provision_rc\\":$?}"'
    )
    return "sh -c " + shlex.quote(script)


def setup_follow_command(ident: str, since_epoch: int) -> str:
    """The setup unit's output as it runs (`apply --wait --logs`), ended by closing the
    channel as follow_command is. ident: its SyslogIdentifier (SetupUnit.log_identifier)."""
    argv = ["journalctl", "-t", ident, "-o", "cat", "--no-pager", "-q", "--follow"]
    argv += ["--since", f"@{since_epoch}"]
    return "sh -c " + shlex.quote(_until_stdin_closes(argv))


def _until_stdin_closes(argv: list[str]) -> str:
    return (
        "exec 3<&0; " + " ".join(shlex.quote(a) for a in argv) + " </dev/null & j=$!; "
        "(cat <&3 >/dev/null 2>&1; kill $j 2>/dev/null) >/dev/null 2>&1 & "
        "wait $j"
    )


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
    return "sh -c " + shlex.quote(_until_stdin_closes(argv))


@dataclass
class HostLog:
    host: str
    entries: list[Entry] = field(default_factory=list)
    now_us: int | None = None
    errors: list[str] = field(default_factory=list)
    runs: Any = None  # the host's runs.json (core/runs.py parses it)


def _control(out: HostLog, record: dict[str, Any], err_lines: list[str]) -> None:
    """A control record of the fetch's (the host's clock, its runs, a journalctl that failed) into out."""
    if "__provision_now" in record:
        try:
            out.now_us = int(record["__provision_now"]) // 1000
        except (TypeError, ValueError):
            pass
    elif "__provision_runs" in record:
        out.runs = record["__provision_runs"]
    elif record.get("__provision_rc") not in (0, None):
        why = "; ".join(dict.fromkeys(err_lines)) or f"journalctl exited {record['__provision_rc']}"
        out.errors.append(f"{record.get('__provision_task')}: {why}")


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
            _control(out, got, err_lines)
            continue
        for e in got:
            per_task.setdefault(e.task, []).append(e)
    for task, es in per_task.items():
        if task in reversed_tasks:
            es.reverse()
        out.entries.extend(es)
    return out


def host_last_lines(session: Session, target: Target, job: str, tasks: list[str], n: int = 10) -> dict[str, list[str]]:
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


def host_lines_after(
    session: Session, target: Target, job: str, task: str, cursor: str | None, *, first: int = 20000
) -> tuple[list[str], str | None]:
    """One task's journal lines after `cursor` (None: its last `first` lines), oldest first,
    and the cursor to go on from: a follower reads each line once. Raises HostError."""
    cmd = fetch_command(
        job, [task], since=None, tail=None if cursor else first, cursors={task: cursor} if cursor else None
    )
    res = session.run(target, cmd, timeout=60)
    hl = parse_fetch(
        target.name,
        res.stdout,
        res.stderr,
        {identifier(job, task): task},
        set() if cursor else {task},
        units_of(job, [task]),
    )
    entries = [e for e in hl.entries if e.task == task]
    return [e.text for e in entries], (entries[-1].cursor if entries else cursor)


def last_lines(
    session: Session, targets: Mapping[str, Target], job: str, wanted: dict[str, list[str]], n: int = 10
) -> dict[str, list[str]]:
    """host -> tasks  =>  task -> its last `n` journal lines, one round trip per host at
    once; hosts that fail are left out (this only adds to what status says)."""
    asked = [targets[h] for h in wanted if h in targets]
    res = session.map(lambda t: host_last_lines(session, t, job, wanted[t.name], n), asked)
    out: dict[str, list[str]] = {}
    for r in res.values():
        if not isinstance(r, HostError):
            out.update(r)
    return out


def setup_last_lines(
    session: Session, targets: list[Target], idents: Mapping[str, str], n: int = 10
) -> dict[str, tuple[str, ...]]:
    """host -> the setup's last n lines there (hosts that do not answer are left out);
    idents: host -> its setup's SyslogIdentifier (a setup is keyed per host's roles)."""

    def one(t: Target) -> tuple[str, ...]:
        res = session.run(t, setup_command(idents[t.name], n), timeout=60)
        return tuple(terminal_text(x) for x in res.stdout.decode("utf-8", "replace").splitlines()[-n:])

    got = session.map(one, targets)
    return {h: v for h, v in got.items() if isinstance(v, tuple)}


def setup_command(ident: str, tail: int | None) -> str:
    """The setup unit's output on a host, oldest first (ident: SetupUnit.log_identifier)."""
    argv = ["journalctl", "-t", ident, "-o", "cat", "--no-pager", "-q"]
    if tail is not None:
        argv += ["-n", str(tail)]
    return " ".join(shlex.quote(a) for a in argv)
