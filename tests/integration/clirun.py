"""Running the `provision` CLI from integration tests, as a user would: a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
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
