"""The tests' helpers, one per job (unit tests and tests/integration/ alike: `from clirun
import cli, wait_until`; tests/ is on the path, as tests/conftest.py's directory):

run("validate", "inv.yaml", cwd=tmp)      # the CLI in-process: (exit code, stdout, stderr)
cli("apply", "-y", inv, cwd=tmp)          # the CLI as a user runs it: a fresh process
ok(cli(...))                              # ... checked to exit 0
status(tmp, inv), rows(st)                # `status --json`, its tasks by name
sh(sb, "host-1", "systemctl is-active x") # a shell command on a sandbox host (as root)
sh(sb, "host-1", "test -f /x", check=True)
unit_props(sb, "host-1", job, "chief-0")  # a task's systemd unit: ActiveState, MainPID, ...
wait_until(lambda: ..., what="...")       # poll for a condition; never sleep-then-assert
first_output(p), output_until(p, "text")  # what a CLI started with Popen printed so far
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path


def run(*args: str, cwd: Path) -> tuple[int, str, str]:
    """The CLI in-process (click's runner), from `cwd`, with stdout and stderr apart; an
    exception the CLI lets out is raised, not turned into an exit code."""
    from click.testing import CliRunner

    from provision.cli.app import main

    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    finally:
        os.chdir(old)
    return r.exit_code, r.stdout, r.stderr


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


def unit_props(sb, host: str, job: str, task: str) -> dict[str, str]:
    """A task's systemd unit on a sandbox host: ActiveState, SubState, MainPID and
    InvocationID (empty when it is not running) as `systemctl show` gives them."""
    from provision.host import layout

    out = sh(sb, host, f"systemctl show -p ActiveState,SubState,MainPID,InvocationID {layout.unit_name(job, task)}")
    return dict(line.partition("=")[::2] for line in out.splitlines() if "=" in line)


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


def output_until(p: subprocess.Popen, text: str, timeout: float = 60) -> str:
    """Wait until a CLI started with its output in pipes (stderr=STDOUT: one stream) has
    printed `text`; all it printed until then. The rest stays in the pipes for
    p.communicate(): the whole output is this plus what that returns."""
    streams = [s for s in (p.stdout, p.stderr) if s is not None]
    got = b""
    end = time.monotonic() + timeout
    while streams and time.monotonic() < end:
        ready, _, _ = select.select(streams, [], [], 0.2)
        for s in ready:
            chunk = os.read(s.fileno(), 65536)
            got += chunk
            if not chunk:  # closed: the process is ending
                streams.remove(s)
        if text in got.decode(errors="replace"):
            return got.decode(errors="replace")
    seen = got.decode(errors="replace")
    why = f"ended (exit {p.wait()})" if not streams else f"went on for {timeout}s"
    raise AssertionError(f"{why} without printing {text!r}; it printed:\n{seen}")
