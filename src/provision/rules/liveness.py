"""Is a process alive? One rule for every record that names the process behind it (a
ledger reservation, a state lock, a study's runner):

- on this machine its pid decides, whatever the record's age (a setup or a study may run
  for hours without a word);
- elsewhere only a heartbeat can tell: alive until `stale_after` seconds pass without one,
  judged on the clock that wrote the heartbeats (the host's for a ledger, the storage's for
  a study), never on this machine's;
- with no heartbeat rule (a lock file names its holder but never beats), a process
  elsewhere is taken as alive: only its owner, or force-unlock, ends it.
"""

from __future__ import annotations

import os
import socket


def pid_exists(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (one we may not signal does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A process that ended and nobody reaped yet (a service's worker killed with it, its
    parent gone, and an init that reaps late): it holds no lock and does no work."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False  # no /proc (not Linux): kill's answer stands
    end = stat.rfind(b")")  # the name may hold spaces and parentheses: the state follows the last
    return stat[end + 2 : end + 3] in (b"Z", b"X")


def this_machine() -> str:
    return socket.gethostname()


def process_alive(
    machine: str,
    pid: int | None,
    beat_at: float | None,
    now: float,
    stale_after: float | None,
    *,
    here: str | None = None,
) -> bool:
    """The rule above. `beat_at` and `now` are on the same clock; `here`: this machine's
    name (tests give it)."""
    if pid and machine == (this_machine() if here is None else here):
        return pid_exists(pid)
    if stale_after is None or beat_at is None:
        return True
    return now - beat_at < stale_after
