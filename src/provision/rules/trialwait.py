"""The command a trial's worker runs on a host to wait for the trial's end there
(run/trialrun.py): one command in flight instead of a look per poll."""

from __future__ import annotations

import shlex

WAIT_SLICE = 0.05  # seconds between the host-side wait's looks at its processes


def end_wait_command(units: list[str], seconds: float) -> str:
    """A shell command that returns as soon as one of `units` ends (its main process is
    gone: a look at /proc, not a round trip per look), or after `seconds`. It prints
    "ended", "timeout", or "none" (no main process to watch: the caller waits its poll).
    One process to watch (a trial's task on its host) is watched by `tail --pid`, which
    forks nothing while it waits; several, by a loop of `sleep`s."""
    turns = max(1, round(seconds / WAIT_SLICE))
    script = (
        'pids=; for u in "$@"; do st=; p=0; '
        # ActiveState and MainPID in one systemctl run (its order of values is systemd's:
        # the number is the PID).
        'for v in $(systemctl show -p ActiveState -p MainPID --value "$u"); do '
        "case $v in *[!0-9]*) st=$v ;; *) p=$v ;; esac; done; "
        'case "$st" in active|activating|reloading|deactivating) ;; *) echo ended; exit 0;; esac; '
        '[ "$p" -gt 0 ] 2>/dev/null && pids="$pids $p"; '
        "done; "
        '[ -n "$pids" ] || { echo none; exit 0; }; '
        "set -- $pids; "
        f'if [ $# -eq 1 ]; then timeout {seconds:g} tail --pid="$1" -s {WAIT_SLICE} -f /dev/null 2>/dev/null; '
        "case $? in 0) echo ended; exit 0;; 124) echo timeout; exit 0;; esac; fi; "  # else no tail: the loop
        f"i=0; while [ $i -lt {turns} ]; do "
        'for p in $pids; do [ -d "/proc/$p" ] || { echo ended; exit 0; }; done; '
        f"sleep {WAIT_SLICE}; i=$((i+1)); done; echo timeout"
    )
    return "sh -c " + shlex.quote(script) + " sh " + " ".join(shlex.quote(u) for u in units)
