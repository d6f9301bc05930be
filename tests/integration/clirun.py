"""Running the `provision` CLI from integration tests, as a user would: a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def cli(*args, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m provision ARGS...` in cwd, output captured as text; env adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "provision", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """r, after checking it exited 0 (the output is the failure message otherwise)."""
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def status(tmp: Path, inv: Path) -> dict:
    """`provision status --json`, checked to exit 0."""
    r = cli("status", "--json", inv, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def rows(st: dict) -> dict[str, dict]:
    """A status's tasks by name."""
    return {t["task"]: t for t in st["tasks"]}


def wait_until(pred, timeout: float = 60, every: float = 0.5, what: str = "condition"):
    """pred()'s first true answer, polled every `every` seconds for up to `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
