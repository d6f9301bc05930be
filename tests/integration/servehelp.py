"""A real `provision serve` process for the service's integration tests (test_serve.py,
test_serve_faults.py): started, killed, stopped, its output read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from clirun import wait_until

TRAINER = Path(__file__).resolve().parents[1] / "fixtures" / "tune" / "trainer.py"
STUDY_HOSTS = ["host-1", "host-2"]  # 2 x 2 fake GPUs
APPLY_HOSTS = ["host-3", "host-4"]


def service_env(tmp: Path) -> dict[str, str]:
    """A test's environment for the CLI and its service: its own embedded database."""
    return {
        "PROVISION_SERVICE_DB": str(tmp / "svc" / "service.sqlite"),
        "PROVISION_OWNER": "ann@example.com",
        "PROVISION_QUEUE_POLL": "1",
    }


class Service:
    """A `provision serve` process; its output in tmp/serve-N.log (N: its start)."""

    def __init__(self, tmp: Path, env: dict[str, str], args: tuple[str, ...] = ("--listen", "none")):
        # No pages by default: two services share this machine.
        self.tmp, self.env, self.args = tmp, env, args
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.p: subprocess.Popen | None = None
        self.starts = 0

    def start(self, until: str = "leading", **extra: str) -> None:
        self.starts += 1
        with open(self.log, "wb") as log:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "provision", "serve", "--poll", "0.5", *self.args],
                cwd=self.tmp,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, **extra},
            )
        wait_until(lambda: until in self.output(), timeout=60, what=f"the service to say {until!r}")

    @property
    def log(self) -> Path:
        return self.tmp / f"serve-{self.starts}.log"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self, text: str) -> list[str]:
        return [x for x in self.output().splitlines() if text in x]

    def kill9(self) -> None:
        assert self.p is not None
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()


def show_logs(tmp: Path) -> None:
    """The services' and workers' logs (pytest shows them when a test fails)."""
    for log in sorted(tmp.rglob("serve-*.log")) + sorted(tmp.rglob("work/*.log")):
        print(f"==== {log}\n{log.read_text(errors='replace')}")
