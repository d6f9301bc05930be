"""The command a trial's worker runs on a host to wait for the trial's end there
(run/trialrun.py): one command in flight instead of a look per poll."""

from __future__ import annotations

import shlex

WAIT_SLICE = 0.05  # seconds between the host-side wait's looks at its processes (a `sleep` forked)
TAIL_SLICE = 0.02  # seconds between `tail --pid`'s looks at its process (no fork: a kill(PID, 0))


SETTLE_TURNS = 50  # 10 ms looks at most, after the process is gone, for its unit to be inactive


def end_wait_command(units: list[str], seconds: float, preempted: str = "") -> str:
    """A shell command that returns as soon as one of `units` ends (its main process is
    gone: a look at /proc, not a round trip per look), or after `seconds`. It prints
    "ended STATE" (the unit's ActiveState once it settled: "inactive" or "failed" say it
    holds nothing any more, its ExecStopPost done; an empty STATE: not known), "timeout",
    or "none" (no main process to watch: the caller waits its poll); "ended STATE
    preempted" when the file `preempted` is there (a preemption's mark, written before it
    stops the units: the GPUs are the preemptor's, not free). One process to watch
    (a trial's task on its host) is watched by `tail --pid`, which forks nothing while it
    waits; several, by a loop of `sleep`s."""
    turns = max(1, round(seconds / WAIT_SLICE))
    script = (
        'pre=$1; shift; pids=; for u in "$@"; do st=; p=0; '
        # ActiveState and MainPID in one systemctl run (its order of values is systemd's:
        # the number is the PID).
        'for v in $(systemctl show -p ActiveState -p MainPID --value "$u"); do '
        "case $v in *[!0-9]*) st=$v ;; *) p=$v ;; esac; done; "
        'case "$st" in active|activating|reloading|deactivating) ;; *) echo "ended $st"; exit 0;; esac; '
        '[ "$p" -gt 0 ] 2>/dev/null && { pids="$pids $p"; unit=$u; }; '
        "done; "
        '[ -n "$pids" ] || { echo none; exit 0; }; '
        "set -- $pids; "
        f'if [ $# -eq 1 ]; then timeout {seconds:g} tail --pid="$1" -s {TAIL_SLICE} -f /dev/null 2>/dev/null; '
        "case $? in "
        # The process is gone: its unit settles (ExecStopPost) within milliseconds.
        f'0) n=0; while st=$(systemctl is-active "$unit"); [ $n -lt {SETTLE_TURNS} ]; do '
        'case "$st" in active|activating|reloading|deactivating) ;; *) break;; esac; '
        "sleep 0.01; n=$((n+1)); done; "
        'if [ -n "$pre" ] && [ -e "$pre" ]; then echo "ended $st preempted"; else echo "ended $st"; fi; '
        "exit 0;; "
        "124) echo timeout; exit 0;; esac; fi; "  # else no tail: the loop
        f"i=0; while [ $i -lt {turns} ]; do "
        'for p in $pids; do [ -d "/proc/$p" ] || { echo ended; exit 0; }; done; '
        f"sleep {WAIT_SLICE}; i=$((i+1)); done; echo timeout"
    )
    return "sh -c " + " ".join(shlex.quote(a) for a in (script, "sh", preempted, *units))


def settled_free(said: str) -> bool:
    """The wait's answer says its unit ended and holds nothing (inactive, or failed: no
    restart pending): the GPUs it had are free for the next trial's plan (rules/tenancy's
    judge counts such an entry as ended)."""
    words = said.split()
    return len(words) == 2 and words[0] == "ended" and words[1] in ("inactive", "failed")
