"""The integration tests' helpers, one per job:

cli("apply", "-y", inv, cwd=tmp)          # the CLI as a user runs it: a fresh process
ok(cli(...))                              # ... checked to exit 0
status(tmp, inv), rows(st)                # `status --json`, its tasks by name
sh(sb, "host-1", "systemctl is-active x") # a shell command on a sandbox host (as root)
sh(sb, "host-1", "test -f /x", check=True)
wait_until(lambda: ..., what="...")       # poll for a condition; never sleep-then-assert
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path


def cli(*args, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m provision ARGS...` in cwd, output captured as text; env adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "provision", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


class Shell(str):
    """What `sh` printed (stdout and stderr, as docker exec gives them), as the string
    itself, with the exit status in `.code`."""

    code: int

    def __new__(cls, code: int, out: str) -> Shell:
        s = super().__new__(cls, out)
        s.code = code
        return s


def sh(sb, host: str, cmd: str, *, check: bool = False) -> Shell:
    """`/bin/sh -c CMD` on a sandbox host, as root (docker exec: no SSH, no provision).
    check: assert it exited 0 (the output is the failure message otherwise)."""
    code, out = sb.docker_exec(host, ["/bin/sh", "-c", cmd])
    if check:
        assert code == 0, (host, cmd, out)
    return Shell(code, out)


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


def first_output(p: subprocess.Popen, timeout: float = 60) -> str:
    """Wait until a CLI started with stdout and stderr as text pipes has printed something
    (it is past its start-up and into its work); that first output. The rest stays in the
    pipes for p.communicate()."""
    streams = [s for s in (p.stdout, p.stderr) if s is not None]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.poll() is not None:
            raise AssertionError(f"exited {p.returncode} before printing anything")
        ready, _, _ = select.select(streams, [], [], 0.2)
        if ready:
            return os.read(ready[0].fileno(), 65536).decode(errors="replace")
    raise AssertionError(f"printed nothing within {timeout}s")
