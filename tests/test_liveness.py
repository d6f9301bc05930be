"""rules/liveness.py: the one rule for "is this process alive" (a table), and a process
that ended but was not reaped (a zombie) counting as gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clirun import wait_until
from provision.rules.liveness import _zombie, pid_exists, process_alive


@pytest.mark.parametrize(
    ("machine", "pid", "beat_at", "now", "stale_after", "want"),
    [
        ("here", "self", None, 0.0, 60.0, True),  # this machine: the pid (this process's) decides
        ("here", 0, None, 0.0, 60.0, True),  # no pid, no heartbeat: taken as alive
        ("there", 123, 100.0, 130.0, 60.0, True),  # elsewhere: a recent heartbeat
        ("there", 123, 100.0, 170.0, 60.0, False),  # ... a stale one
        ("there", 123, None, 170.0, None, True),  # no heartbeat rule: alive
    ],
)
def test_process_alive(machine, pid, beat_at, now, stale_after, want):
    pid = os.getpid() if pid == "self" else pid  # not in the test's id: xdist's workers collect alike
    assert process_alive(machine, pid, beat_at, now, stale_after, here="here") is want


def test_an_ended_process_not_yet_reaped_is_gone():
    # Its parent (this test) does not reap it yet, as an init that reaps late would not.
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603 - our own interpreter
    wait_until(lambda: _zombie(child.pid), timeout=30, what="the child to end")
    assert not pid_exists(child.pid)
    child.wait()
    assert not pid_exists(child.pid)
    assert pid_exists(os.getpid())
