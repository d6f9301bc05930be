"""`provision logs`: the journald output of a job's tasks, from every host at once.

One SSH command per host runs `journalctl -o json` once per task of the job on that host
(io/journal.py builds and reads it); the entries are merged in time order and printed with a
`task@host` prefix. `--follow` then keeps one `journalctl --follow` per host streaming
(it follows the identifier, so a task that restarts keeps streaming), `-o DIR` writes
DIR/<task>.log and remembers, per host and task, the journal cursor of the last entry
written, so the next call appends only what is new.
"""

from __future__ import annotations

import heapq
import queue
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from provision.core.errors import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    ProvisionError,
)
from provision.core.runs import merged, pick
from provision.core.target import HostError, Target
from provision.core.text import printable
from provision.io.journal import (
    Entry,
    HostLog,
    fetch_command,
    follow_command,
    identifier,
    merge,
    normalize_since,
    parse_fetch,
    parse_line,
    runs_line,
    setup_command,
    stream_command,
    terminal_text,
    units_of,
)
from provision.io.steps import Step, run_step
from provision.rules.status import JobStatus
from provision.run.context import Context
from provision.run.jobend import collect
from provision.run.logprinter import Printer, load_cursors, save_cursors

# --------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class Selection:
    """The tasks whose logs are asked for, where they run, and how journald names them."""

    job: str
    by_host: dict[str, list[str]]  # host -> its tasks
    host_of: dict[str, str]  # task -> host
    idents: dict[str, str]  # SyslogIdentifier -> task
    units: dict[str, str]  # unit -> task

    @classmethod
    def of(cls, ctx: Context, tasks: tuple[str, ...]) -> Selection:
        job = ctx.inventory.job
        placed = [t for t in ctx.rendered.placement.tasks if t.host.name in ctx.targets]
        names = [t.name for t in ctx.rendered.placement.tasks]
        if tasks:
            unknown = [t for t in tasks if t not in names]
            if unknown:
                raise ProvisionError(f"no task named {', '.join(unknown)} in job {job} (tasks: {', '.join(names)})")
            placed = [t for t in placed if t.name in tasks]
            if not placed:
                raise ProvisionError(f"{', '.join(tasks)}: not on the --target hosts")
        return cls.placed(job, {t.name: t.host.name for t in placed})

    @classmethod
    def placed(cls, job: str, host_of: Mapping[str, str]) -> Selection:
        """The tasks of `job` where they ran (task -> host): a study's trial, as it recorded them."""
        by_host: dict[str, list[str]] = {}
        for task, host in host_of.items():
            by_host.setdefault(host, []).append(task)
        idents = {identifier(job, t): t for t in host_of}
        return cls(job, by_host, dict(host_of), idents, units_of(job, host_of))


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
    echo_err: Callable[[str], None] = lambda s: click.echo(printable(s), err=True),  # hosts' words in them
    until_end: bool = True,
    on_status: Callable[[JobStatus], None] | None = None,
    timeout: float | None = None,
    run: int | None = None,
    previous: bool = False,
    raw: bool = False,
) -> int:
    """Print (or write; `raw`: the text as written, Printer) the job's logs; returns the
    exit code (0, or 3 when a host was unreachable: the others' logs were still shown). With
    `follow`, until the job ends (`until_end`; then 0 when it succeeded, 1 when it failed)
    or Ctrl-C (130). For `wait --logs`: `on_status` sees every status polled (it then says
    how the job ended) and `timeout` gives up after that many seconds (1)."""
    sel = Selection.of(ctx, tasks)
    since_j, until_j = _span(ctx, sel, since, run, previous, follow)
    if tail is not None and tail < 0:
        raise ProvisionError(f"--tail {tail}: expected a number >= 0")
    out_path, cursors = _output(out_dir, sel.job)
    printer = Printer(list(sel.host_of), sel.host_of, out_dir=out_path, timestamps=timestamps, raw=raw)
    printer.lead_boundary = tail is None and since is None and not cursors
    stop = stop or threading.Event()
    printer.on_pipe_closed = stop.set
    printer.cursors = {h: dict(c) for h, c in cursors.items()}
    if tail is None and not cursors and not follow:
        results = _stream(ctx, sel, since_j, printer, stop, until_j)  # any size, in bounded memory
    else:
        results = _fetch(ctx, sel, since_j, tail, cursors, until_j)
        printer.run_records = {h: hl.runs for h, hl in results.items() if isinstance(hl, HostLog)}
        for entry in merge(hl.entries for hl in results.values() if isinstance(hl, HostLog)):
            printer.write(entry)
    logs = [r for r in results.values() if isinstance(r, HostLog)]
    printer.flush()
    code, bad_hosts = _fetch_errors(results, echo_err)
    if out_path is not None:
        save_cursors(out_path, sel.job, printer.cursors)
    if follow and not printer.pipe_closed:
        follower = Follower(ctx, sel, printer, out_path, stop, echo_err, timeout=timeout)
        live = [hl for hl in logs if not hl.errors]
        code2 = follower.run(live, _job_watcher(ctx, on_status) if until_end else None, announce=on_status is None)
        # The job's outcome (or Ctrl-C's 130) is the exit code; unreachable hosts still say 3.
        code = code if code == EXIT_UNREACHABLE else code2
    printer.close()
    if out_path is not None:
        for task, host in sel.host_of.items():
            n = printer.counts.get(task, 0)
            echo_err(f"{task}@{host}: {n} new line{'s' if n != 1 else ''} -> {out_path / (task + '.log')}")
        save_cursors(out_path, sel.job, printer.cursors)
    if bad_hosts:
        echo_err(f"Unreachable: {', '.join(sorted(bad_hosts))}. The other hosts' logs are above.")
    return code


def log_entries(
    ctx: Context, *, tail: int | None, cursors: dict[str, dict[str, str]], limit: int | None = None
) -> tuple[list[Entry], dict[str, dict[str, str]], list[str]]:
    """The job's entries after `cursors` (host -> task -> journal cursor; a task without
    one: its last `tail`), merged in time order; the cursors after them; one line per host
    that failed (a host that sent more than `limit` bytes is one). `logs -o DIR`'s fetch,
    for a reader that keeps the cursors (the dashboard)."""
    sel = Selection.of(ctx, ())
    results = _fetch(ctx, sel, None, tail, cursors, limit=limit)
    entries = list(merge(hl.entries for hl in results.values() if isinstance(hl, HostLog)))
    after = {h: dict(c) for h, c in cursors.items()}
    for e in entries:
        if e.cursor:
            after.setdefault(e.host, {})[e.task] = e.cursor
    errors = [f"{h}: {r.message}" for h, r in results.items() if isinstance(r, HostError)]
    errors += [f"{h}: {x}" for h, r in results.items() if isinstance(r, HostLog) for x in r.errors]
    return entries, after, errors


def entries_after(
    ctx: Context,
    sel: Selection,
    *,
    tail: int | None,
    cursors: dict[str, dict[str, str]],
    echo_err: Callable[[str], None],
) -> tuple[list[Entry], dict[str, dict[str, str]], int]:
    """`sel`'s entries after `cursors` (a task without one: its last `tail`; None: all),
    merged in time order; the cursors after them; the exit code of the hosts' answers
    (each error said through echo_err, as run_logs says them)."""
    results = _fetch(ctx, sel, None, tail, cursors)
    entries = list(merge(hl.entries for hl in results.values() if isinstance(hl, HostLog)))
    after = {h: dict(c) for h, c in cursors.items()}
    for e in entries:
        if e.cursor:
            after.setdefault(e.host, {})[e.task] = e.cursor
    return entries, after, _fetch_errors(results, echo_err)[0]


def _output(out_dir: str | None, job: str) -> tuple[Path | None, dict[str, dict[str, str]]]:
    """-o DIR: the directory (made) and the cursors the last call left there."""
    if out_dir is None:
        return None, {}
    out_path = Path(out_dir)
    try:
        out_path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ProvisionError(f"{out_dir}: cannot create: {e.strerror}") from None
    return out_path, load_cursors(out_path, job)


def _span(
    ctx: Context, sel: Selection, since: str | None, number: int | None, previous: bool, follow: bool
) -> tuple[str | None, str | None]:
    """journalctl's --since and --until: --since as given, or one run's (`--run N`,
    `--previous`) from the hosts' runs (one round trip each)."""
    if number is None and not previous:
        return normalize_since(since), None
    if since is not None or follow:
        raise ProvisionError("--run and --previous show one whole run: not with --since or --follow")

    def read(tg: Target) -> Any:
        res = ctx.session.run(tg, "sh -c " + shlex.quote(runs_line(sel.job)), timeout=60)
        got = parse_line(res.stdout, tg.name, {})
        return got.get("__provision_runs") if isinstance(got, dict) else None

    res = ctx.session.map(read, [ctx.targets[h] for h in sel.by_host])
    picked = pick(merged(r for r in res.values() if not isinstance(r, HostError)), number, previous)
    if isinstance(picked, str):
        raise ProvisionError(picked)
    first, after = picked
    return f"@{first.started_at:.6f}", f"@{after.started_at:.6f}" if after is not None else None


def _fetch(
    ctx: Context,
    sel: Selection,
    since: str | None,
    tail: int | None,
    cursors: dict[str, dict[str, str]],
    until: str | None = None,
    limit: int | None = None,
) -> dict[str, HostLog | HostError]:
    """Every host's entries at once (one round trip each), --tail applied per task; a host's
    answer over `limit` bytes is a HostError."""
    # With a cursor, journalctl is asked from the cursor on and --tail is applied here.
    reversed_tasks = {
        h: {t for t in ts if tail is not None and not cursors.get(h, {}).get(t)} for h, ts in sel.by_host.items()
    }

    def fetch(tg: Target) -> HostLog:
        cmd = fetch_command(
            sel.job, sel.by_host[tg.name], since=since, tail=tail, cursors=cursors.get(tg.name), until=until
        )
        res = ctx.session.run(tg, cmd, timeout=300, limit=limit)
        hl = parse_fetch(tg.name, res.stdout, res.stderr, sel.idents, reversed_tasks[tg.name], sel.units)
        if tail is not None:
            per: dict[str, list[Entry]] = {}
            for item in hl.entries:
                per.setdefault(item.task, []).append(item)
            hl.entries = [x for es in per.values() for x in (es[-tail:] if tail else [])]
        return hl

    return ctx.session.map(fetch, [ctx.targets[h] for h in sel.by_host])


_DONE = object()


def _control_record(got: dict[str, Any], hl: HostLog, printer: Printer, said: list[str], tasks: list[str]) -> None:
    """A control record of stream_command's output: the host's clock, its runs (before
    any line of the host), journalctl's exit status."""
    if "__provision_now" in got:
        hl.now_us = int(got["__provision_now"]) // 1000
    elif "__provision_runs" in got:
        printer.run_records[hl.host] = got["__provision_runs"]
    elif got.get("__provision_rc") not in (0, None):
        why = "; ".join(dict.fromkeys(said)) or f"journalctl exited {got['__provision_rc']}"
        hl.errors.append(f"{','.join(tasks)}: {why}")


def _stream(  # noqa: C901  its reader threads and the merge that prints in time order belong together
    ctx: Context, sel: Selection, since: str | None, printer: Printer, stop: threading.Event, until: str | None = None
) -> dict[str, HostLog | HostError]:
    """Every host's entries read as they arrive (one time-ordered journalctl per host) and
    printed in time order across hosts as they come: memory is bounded by the hosts'
    queues and SSH windows, not by the log's size (a task with 600k lines)."""
    queues: dict[str, queue.Queue[Any]] = {h: queue.Queue(maxsize=4096) for h in sel.by_host}
    results: dict[str, HostLog | HostError] = {}

    def pump(host: str) -> None:
        hl, said = HostLog(host), list[str]()

        def on_line(raw: bytes) -> None:
            got = parse_line(raw, host, sel.idents, sel.units)
            if isinstance(got, list):
                for e in got:
                    queues[host].put(e)
            elif isinstance(got, dict):
                _control_record(got, hl, printer, said, sel.by_host[host])
            elif got is None and raw.strip() and not raw.lstrip().startswith(b"{") and len(said) < 20:
                said.append(raw.decode("utf-8", "replace").strip())  # journalctl's complaint

        try:
            ctx.session.stream(
                ctx.targets[host],
                stream_command(sel.job, sel.by_host[host], since=since, until=until),
                on_line,
                stop=stop,
            )
            results[host] = hl
        except HostError as e:
            results[host] = e
        except Exception as e:  # noqa: BLE001 - the connection broke mid-stream: that host's error
            results[host] = HostError(ctx.targets[host], f"connection lost: {e or type(e).__name__}", unreachable=True)
        finally:
            queues[host].put(_DONE)

    def entries(host: str) -> Iterable[Entry]:
        while (e := queues[host].get()) is not _DONE:
            yield e

    threads = [threading.Thread(target=pump, args=(h,), daemon=True, name=f"logs-{h}") for h in sel.by_host]
    for t in threads:
        t.start()
    # Ties keep the hosts' order, as merge() does.
    for e in heapq.merge(*(entries(h) for h in sel.by_host), key=lambda e: e.ts):
        printer.write(e)
    for t in threads:
        t.join()
    return results


def _fetch_errors(results: dict[str, HostLog | HostError], echo_err: Callable[[str], None]) -> tuple[int, list[str]]:
    """Each host's error in a line (journalctl's, once for every place it failed the same
    way: a bad --since fails everywhere); the exit code and the unreachable hosts."""
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
    for why, where in failed.items():
        echo_err(f"Error: journalctl ({', '.join(where)}): {why}")
    return code, bad_hosts


def _job_watcher(ctx: Context, on_status: Callable[[JobStatus], None] | None = None) -> Callable[[], JobStatus | None]:
    """The job's status for `--follow` to end with, from every host of the job (with
    --target too: a part cannot tell the whole ended)."""
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


class Follower:
    """`--follow`: stream from every host at once until the job has ended (the job_status
    given to run returns an ended JobStatus: exit 0 when it succeeded, 1 when it failed) or
    `stop` is set (130: Ctrl-C).

    Each host's stream starts at the second its fetch began (`--since @T`, T from the
    host's clock) and skips per task what was printed already (Boundary); lines go out in
    time order across hosts through a reorder window. A stream that breaks (the host
    rebooted, the connection dropped) is started again from its last entry. Once the job
    has ended, the streams run `grace` seconds more for the last lines."""

    def __init__(
        self,
        ctx: Context,
        sel: Selection,
        printer: Printer,
        out_path: Path | None,
        stop: threading.Event,
        echo_err: Callable[[str], None],
        *,
        poll: float = 2.0,
        grace: float = 2.0,
        window: float = 1.0,
        timeout: float | None = None,
    ):
        self.ctx, self.sel, self.printer, self.out_path = ctx, sel, printer, out_path
        self.stop, self.echo_err = stop, echo_err
        self.poll, self.grace, self.timeout = poll, grace, timeout
        self.boundary = Boundary()
        self.reorder = Reorder(printer.write, window)
        self.starts: dict[str, int] = {}  # host -> the second its stream starts at
        self.newest: dict[str, int] = {}  # host -> its newest entry's time (us)
        self.ended: list[JobStatus] = []  # the status that saw the job end

    def run(
        self, logs: list[HostLog], job_status: Callable[[], JobStatus | None] | None, *, announce: bool = True
    ) -> int:
        for hl in logs:
            now_us = hl.now_us or int(time.time() * 1e6)
            for e in hl.entries:
                self.boundary.printed(e)
            self.boundary.start(hl.host, self.sel.by_host[hl.host], now_us)
            self.starts[hl.host] = now_us // 1_000_000
        threads = [
            threading.Thread(target=self.stream_host, args=(h,), daemon=True, name=f"logs-{h}") for h in self.starts
        ]
        if job_status is not None:
            threads.append(threading.Thread(target=self.watch, args=(job_status,), daemon=True, name="logs-status"))
        for t in threads:
            t.start()
        code, timed_out = EXIT_INTERRUPTED, False
        try:
            code, timed_out = self._print_until_the_end(threads)
        except KeyboardInterrupt:
            code = EXIT_INTERRUPTED
        finally:
            self.stop.set()
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: we are leaving
            for t in threads:
                t.join(timeout=5)
            self.reorder.drain()
        self._say_how_it_ended(code, timed_out, announce)
        return code

    def _on_entry(self, host: str, e: Entry) -> None:
        if not self.boundary.accept(e):
            return
        self.newest[host] = max(self.newest.get(host, 0), e.ts)
        self.reorder.push(e)

    def stream_host(self, host: str) -> None:
        """One host's `journalctl --follow`, started again (from its newest entry) whenever
        it breaks, until stop."""
        tg = self.ctx.targets[host]
        warned = False

        def on_line(raw: bytes) -> None:
            got = parse_line(raw, host, self.sel.idents, self.sel.units)
            if isinstance(got, list):
                for e in got:
                    self._on_entry(host, e)

        while not self.stop.is_set():
            cmd = follow_command(self.sel.job, self.sel.by_host[host], self.starts[host])
            try:
                self.ctx.session.stream(tg, cmd, on_line, stop=self.stop)
                why = "the log stream ended"
            except HostError as e:
                why = e.message
            except Exception as e:  # noqa: BLE001 - connection lost mid-stream: report, retry
                # (the session reconnects on the next call: it checks the connection first)
                why = f"connection lost: {e or type(e).__name__}"
            if self.stop.is_set():
                return
            if not warned:
                self.echo_err(f"Warning: {tg.where}: {why}; retrying every 2 s")
                warned = True
            # Resume from the newest entry seen; Boundary skips what was printed.
            if host in self.newest:
                self.starts[host] = self.newest[host] // 1_000_000
            self.boundary.start(host, self.sel.by_host[host], 0)
            self.stop.wait(2.0)

    def watch(self, job_status: Callable[[], JobStatus | None]) -> None:
        """Poll the job's status until it has ended."""
        while not self.stop.is_set():
            try:
                st = job_status()
            except (HostError, ProvisionError) as e:
                self.echo_err(f"Warning: job status: {getattr(e, 'message', e)}")
                st = None
            if st is not None and st.phase.ended:
                self.ended.append(st)
                return
            self.stop.wait(self.poll)

    def _print_until_the_end(self, threads: list[threading.Thread]) -> tuple[int, bool]:
        """Print what is due until the job ended (plus grace), the timeout, or stop: the exit
        code, and whether the timeout ended it."""
        last_save = began = time.monotonic()
        end_at: float | None = None
        while any(t.is_alive() for t in threads) and not self.stop.is_set():
            self.stop.wait(0.1)
            self.reorder.due()
            now = time.monotonic()
            if self.ended and end_at is None:
                end_at = now + self.grace
            if end_at is not None and now >= end_at:
                return (EXIT_OK if self.ended[0].phase.value == "Succeeded" else EXIT_ERROR), False
            if self.timeout is not None and not self.ended and now - began > self.timeout:
                return EXIT_TIMEOUT, True
            if self.out_path is not None and now - last_save > 2:
                self.printer.flush()
                save_cursors(self.out_path, self.sel.job, self.printer.cursors)
                last_save = now
        if not self.ended and not self.printer.pipe_closed:
            return EXIT_INTERRUPTED, False  # stopped from outside: Ctrl-C, or the caller's stop
        return EXIT_OK, False

    def _say_how_it_ended(self, code: int, timed_out: bool, announce: bool) -> None:
        if timed_out:
            assert self.timeout is not None
            self.echo_err(f"Error: timed out after {self.timeout:g}s; the job has not ended")
        elif self.ended and announce:
            st = self.ended[0]
            self.echo_err(f"job {st.phase}" + (f": {st.reason}" if st.reason else ""))
        elif code == EXIT_INTERRUPTED and not self.printer.pipe_closed:
            self.echo_err("Interrupted.")


# --------------------------------------------------------------------------- setup


def run_setup_logs(ctx: Context, *, tail: int | None = None, raw: bool = False) -> int:
    """`provision logs --setup`: each host's setup output, host by host, as `setup@HOST | line`."""

    job = ctx.inventory.job
    hosts = [n for n, b in ctx.rendered.hosts.items() if b.setup is not None and n in ctx.targets]
    if not hosts:
        raise ProvisionError(f"job {job} has no setup: on these hosts (inventory key `setup:`)")

    def fetch(tg: Target) -> list[str]:
        setup = ctx.rendered.hosts[tg.name].setup
        assert setup is not None
        res = ctx.session.run(tg, setup_command(setup.log_identifier, tail), timeout=120)
        if res.exit_status != 0:
            raise HostError(tg, f"journalctl exited {res.exit_status}: {res.stderr.decode(errors='replace').strip()}")
        return res.stdout.decode("utf-8", "replace").splitlines()

    res = run_step(ctx.session, Step.PROBE, fetch, [ctx.targets[h] for h in hosts])
    for h in hosts:
        if h in res.ok:
            for line in res.ok[h]:
                text = terminal_text(line)
                click.echo(f"setup@{h} | {text if raw else printable(text)}")
    for e in res.errors.values():
        click.echo(f"Error: {e.target.where}: {printable(e.message)}", err=True)
    return 3 if res.unreachable else (1 if res.failed else 0)
