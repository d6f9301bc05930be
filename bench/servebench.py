"""Shared pieces of the service's and dashboard's benchmarks:
bench/serve_takeover.py, bench/serve_idle.py, bench/serve_detach.py, bench/dashboard_load.py.

- a real PostgreSQL on loopback (tests/pgserver.py, as the tests start it);
- `provision serve` as a process, its output read line by line with this machine's clock;
- a process tree's CPU (utime + stime from /proc/PID/stat) and RSS;
- the results file: the exact command, the machine's load, the verdicts.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

sys.path.insert(0, str(ROOT / "tests"))  # tests/pgserver.py: the tests' PostgreSQL


def load() -> str:
    """The machine's load now (1, 5, 15 minutes) and how many processes run."""
    la = Path("/proc/loadavg").read_text().split()
    return f"load average {la[0]} {la[1]} {la[2]} (runnable/all {la[3]}), {os.cpu_count()} cores"


def command() -> str:
    return "PYTHONPATH=$PWD/src python " + shlex.join(sys.argv)


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() + (" (+ uncommitted src changes)" if dirty.stdout.strip() else "")


@dataclass
class Report:
    """What a bench prints and writes: a header (command, commit, load), lines, verdicts."""

    name: str  # bench/results/<name>.txt
    title: str
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for line in (
            f"# {self.title}",
            f"# {stamp}, commit {commit()}",
            f"# command: {command()}",
            f"# at start: {load()}",
        ):
            self.say(line)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def verdict(self, what: str, value: str, holds: bool) -> None:
        self.say(f"{'HOLDS' if holds else 'FAILS'}: {what}: {value}")

    def write(self) -> Path:
        self.say(f"# at end: {load()}")
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"{self.name}.txt"
        out.write_text("\n".join(self.lines) + "\n")
        print(f"written: {out.relative_to(ROOT)}")
        return out


def pg_env(server: object) -> dict[str, str]:
    """What a client process of the tests' PostgreSQL needs (its URL as the team's state)."""
    return {"PROVISION_STATE": server.url(), **server.env()}  # type: ignore[attr-defined]


class Serve:
    """A `provision serve` process; each output line kept with this machine's monotonic clock."""

    def __init__(
        self,
        cwd: Path,
        env: dict[str, str],
        args: tuple[str, ...] = ("--listen", "none"),
        command: tuple[str, ...] = (sys.executable, "-m", "provision", "serve"),
    ):
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        self.lines: list[tuple[float, str]] = []
        self.p = subprocess.Popen(
            [*command, *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, words: str, after: float = 0.0) -> float | None:
        """When a line with `words` came (after `after`), or None."""
        return next((t for t, ln in list(self.lines) if t >= after and words in ln), None)

    def wait_for(self, words: str, timeout: float, after: float = 0.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.first(words, after)
            if t is not None:
                return t
            if self.p.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"no {words!r} from the service within {timeout:g} s:\n" + self.output())

    def output(self) -> str:
        return "\n".join(ln for _, ln in self.lines)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def tree(pid: int) -> list[int]:
    """pid and every descendant (the service's worker processes)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (seconds); 0 when it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / TICK


def rss_mib(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20
    except OSError:
        return 0.0


@dataclass
class Sampler:
    """The CPU and RSS of a process tree, sampled every `every` seconds; CPU of processes that
    ended meanwhile is kept (their last sample), so a short-lived worker is counted."""

    pid: int
    every: float = 1.0
    samples: list[tuple[float, float, float, int]] = field(default_factory=list)  # t, cpu s, rss MiB, processes
    extra: Callable[[], float] | None = None  # one more figure per sample (SSH connections)
    extras: list[float] = field(default_factory=list)
    _last: dict[int, float] = field(default_factory=dict)

    def sample(self) -> None:
        pids = tree(self.pid)
        for p in pids:
            self._last[p] = cpu_seconds(p) or self._last.get(p, 0.0)
        rss = sum(rss_mib(p) for p in pids)
        self.samples.append((time.monotonic(), sum(self._last.values()), rss, len(pids)))
        if self.extra is not None:
            self.extras.append(self.extra())

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(self.every)
        self.sample()

    def cpu_share(self) -> float:
        """CPU seconds per second over the samples (1.0: one core busy)."""
        (t0, c0, _, _), (t1, c1, _, _) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0)

    def rss_max(self) -> float:
        return max(s[2] for s in self.samples)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2) if s else float("nan")


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.95 * len(s)))] if s else float("nan")
