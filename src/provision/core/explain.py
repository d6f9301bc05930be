"""Why a task ended, in words. Pure.

systemd reports a task's end as an exit code or a signal; the codes 200-243 are its own
(the program never ran: systemd.exec(5), "Process Exit Codes") and the unit's journal
usually holds the precise reason ("Failed to locate executable /opt/venv/bin/torchrun: No
such file or directory"). This module turns both into one sentence for status, wait,
apply and logs:

    exit_words("exited", "203")  -> "the program could not be started (exit status 203/EXEC)"
    reason(..., journal lines)   -> "the program could not be started: /opt/venv/bin/torchrun:
                                     No such file or directory (exit status 203/EXEC)"
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# systemd's own exit statuses (systemd.exec(5)): name, and what failed before the program ran.
SYSTEMD_EXIT: dict[int, tuple[str, str]] = {
    200: ("CHDIR", "could not change to the working directory"),
    201: ("NICE", "could not set the scheduling priority (Nice=)"),
    202: ("FDS", "could not close the file descriptors it should not inherit"),
    203: ("EXEC", "the program could not be started"),
    204: ("MEMORY", "systemd ran out of memory while starting the program"),
    205: ("LIMITS", "could not set the resource limits (Limit*=)"),
    206: ("OOM_ADJUST", "could not set the OOM score adjustment"),
    207: ("SIGNAL_MASK", "could not set the signal mask"),
    208: ("STDIN", "could not set up standard input"),
    209: ("STDOUT", "could not set up standard output"),
    210: ("CHROOT", "could not change the root directory"),
    211: ("IOPRIO", "could not set the I/O priority"),
    212: ("TIMERSLACK", "could not set the timer slack"),
    213: ("SECUREBITS", "could not set the process security bits"),
    214: ("SETSCHEDULER", "could not set the CPU scheduling policy"),
    215: ("CPUAFFINITY", "could not set the CPU affinity"),
    216: ("GROUP", "could not determine or change to the group"),
    217: ("USER", "could not determine or change to the user"),
    218: ("CAPABILITIES", "could not drop or set capabilities"),
    219: ("CGROUP", "could not set up the control group"),
    220: ("SETSID", "could not create a new session"),
    221: ("CONFIRM", "the start was not confirmed on the console"),
    222: ("STDERR", "could not set up standard error"),
    224: ("PAM", "the PAM session could not be set up"),
    225: ("NETWORK", "could not set up network namespacing"),
    226: ("NAMESPACE", "could not set up the mount namespace"),
    227: ("NO_NEW_PRIVILEGES", "could not disable new privileges"),
    228: ("SECCOMP", "could not apply the system call filters"),
    229: ("SELINUX_CONTEXT", "could not determine or change the SELinux context"),
    230: ("PERSONALITY", "could not set the execution domain"),
    231: ("APPARMOR_PROFILE", "could not prepare the AppArmor profile"),
    232: ("ADDRESS_FAMILIES", "could not restrict the address families"),
    233: ("RUNTIME_DIRECTORY", "could not create the runtime directory"),
    235: ("CHOWN", "could not change the owner of the socket"),
    236: ("SMACK_PROCESS_LABEL", "could not set the SMACK label"),
    237: ("KEYRING", "could not set up the kernel keyring"),
    238: ("STATE_DIRECTORY", "could not create the state directory"),
    239: ("CACHE_DIRECTORY", "could not create the cache directory"),
    240: ("LOGS_DIRECTORY", "could not create the logs directory"),
    241: ("CONFIGURATION_DIRECTORY", "could not create the configuration directory"),
    242: ("NUMA_POLICY", "could not set the NUMA policy"),
    243: ("CREDENTIALS", "could not set up the credentials"),
    245: ("BPF", "could not apply the BPF restrictions"),
}

# Linux signal numbers (the controller may be another OS: not the signal module's).
SIGNALS: dict[int, str] = {
    1: "HUP",
    2: "INT",
    3: "QUIT",
    4: "ILL",
    5: "TRAP",
    6: "ABRT",
    7: "BUS",
    8: "FPE",
    9: "KILL",
    10: "USR1",
    11: "SEGV",
    12: "USR2",
    13: "PIPE",
    14: "ALRM",
    15: "TERM",
    24: "XCPU",
    25: "XFSZ",
}

# What a signal that ended a program usually means.
SIGNAL_HINTS: dict[str, str] = {
    "KILL": "out of memory, or killed by hand: see `dmesg` on the host",
    "SEGV": "segmentation fault: the program crashed",
    "ABRT": "the program aborted: a failed assertion or a fatal error",
    "BUS": "bus error: the program crashed",
    "FPE": "arithmetic error: the program crashed",
    "ILL": "illegal instruction: the program crashed",
    "PIPE": "it wrote to a pipe or socket nobody reads",
    "XCPU": "CPU time limit reached",
    "XFSZ": "file size limit reached",
    "HUP": "hang-up",
}

# Shell conventions for exit codes a program run through `sh -c` often ends with.
SHELL_EXIT: dict[int, str] = {
    126: "a command was found but could not be run (not executable?)",
    127: "a command was not found (the shell's code)",
}


def signal_name(status: str) -> str:
    """'TERM', '15' or 'SIGTERM' -> 'TERM' (a number without a known name stays a number)."""
    s = status.strip().upper().removeprefix("SIG")
    if s.isdigit():
        return SIGNALS.get(int(s), s)
    return s


def systemd_exit(code: int) -> str | None:
    """'the program could not be started (exit status 203/EXEC)' for systemd's own codes."""
    if code not in SYSTEMD_EXIT:
        return None
    name, words = SYSTEMD_EXIT[code]
    return f"{words} (exit status {code}/{name})"


def exit_words(kind: str, status: str, result: str = "") -> str:
    """One exit of a task (an .exits record's EXIT_CODE and EXIT_STATUS, or systemd's
    ExecMainCode as a word) as words, for a task that failed.

    Plain exit codes stay "exit code N", the program's own verdict; systemd's codes, the
    shell's 126 and 127, 128+N (a child killed by signal N) and signals are explained."""
    if kind == "none":
        return "between tries"
    if result == "oom-kill":
        return "killed by the kernel's out-of-memory killer"
    if kind == "exited":
        try:
            code = int(status)
        except ValueError:
            return f"exit code {status}"
        sd = systemd_exit(code)
        if sd is not None:
            return sd
        if code in SHELL_EXIT:
            return f"exit code {code}: {SHELL_EXIT[code]}"
        if 128 < code < 160 and (code - 128) in SIGNALS:
            sig = SIGNALS[code - 128]
            return f"exit code {code}: a process it ran was killed by SIG{sig}"
        return f"exit code {code}"
    sig = signal_name(status)
    named = f"SIG{sig}" if not sig.isdigit() else f"signal {sig}"
    what = "core dumped, " if kind == "dumped" else ""
    hint = SIGNAL_HINTS.get(sig)
    return f"{what}killed by {named}" + (f" ({hint})" if hint else "")


# --------------------------------------------------------------------------- the journal

_UNIT_PREFIX = re.compile(r"^[A-Za-z0-9@._:\\-]+\.service: ")
# systemd's words for why it could not start a program (systemd 239-256), most precise first.
_JOURNAL_REASONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Failed to locate executable (?P<path>\S+): (?P<err>.+?)\.?$"), "{path}: {err}"),
    (re.compile(r"Failed at step \w+ spawning (?P<path>\S+): (?P<err>.+?)\.?$"), "{path}: {err}"),
    (re.compile(r"Failed to execute (?:command |program )?(?P<path>/\S+): (?P<err>.+?)\.?$"), "{path}: {err}"),
    (re.compile(r"Failed to load environment files?: (?P<err>.+?)\.?$"), "environment file: {err}"),
    (re.compile(r"Changing to the requested working directory failed: (?P<err>.+?)\.?$"), "{err}"),
    (re.compile(r"Failed to determine (?:user|group) credentials: (?P<err>.+?)\.?$"), "{err}"),
    (re.compile(r"A process of this unit has been killed by the OOM killer"), "killed by the out-of-memory killer"),
    (re.compile(r"Start request repeated too quickly"), "started too often (systemd's start limit)"),
)


# systemd's own words in a unit's journal, and what they mean for a task. systemd names
# exit statuses after the LSB init-script conventions (3 is "NOTIMPLEMENTED"), which say
# nothing about a training program: its code is its own.
_STATUS = re.compile(r"status=(?P<code>\d+)/(?P<name>[A-Z_]+)")
_SYSTEMD_WORDS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"Start request repeated too quickly"),
        "systemd refused to start it again: it was started too often in a row (the pool's restart limit)",
    ),
    (re.compile(r"Failed with result 'start-limit-hit'"), "the pool's restart limit was reached"),
    (re.compile(r"Failed with result 'timeout'"), "it did not stop within its grace period, and was killed"),
    (re.compile(r"Failed with result 'oom-kill'"), "killed by the kernel's out-of-memory killer"),
    (re.compile(r"Scheduled restart job, restart counter is at (?P<n>\d+)"), "restart {n} of the pool's policy"),
    (re.compile(r"State 'stop-sigterm' timed out\. Killing"), "SIGTERM's grace period is over: SIGKILL"),
)


def systemd_words(message: str) -> str:
    """A systemd journal line with what it means appended in brackets, when systemd's
    words say it poorly: `status=3/NOTIMPLEMENTED` is the program's exit code 3, "Start
    request repeated too quickly" is the restart limit. Other lines are returned as is."""
    notes = []
    m = _STATUS.search(message)
    if m and "code=exited" in message and m.group("code") != "0":
        code = int(m.group("code"))
        notes.append(systemd_exit(code) or f"the program's exit code {code}; systemd's name for it does not apply")
    elif m and ("code=killed" in message or "code=dumped" in message):
        notes.append(exit_words("dumped" if "code=dumped" in message else "killed", m.group("name")))
    for rx, words in _SYSTEMD_WORDS:
        hit = rx.search(message)
        if hit:
            notes.append(words.format(**hit.groupdict()))
            break
    return f"{message} [{'; '.join(notes)}]" if notes else message


def strip_unit(message: str) -> str:
    """systemd's message about a unit without the leading 'provision-j-t.service: '."""
    return _UNIT_PREFIX.sub("", message, count=1)


def journal_reason(lines: Iterable[str]) -> str | None:
    """The most precise reason systemd logged for a failed start, from the unit's journal
    lines (newest last; the newest match wins), or None."""
    best: tuple[int, str] | None = None
    for line in lines:
        text = strip_unit(line.removeprefix(SYSTEMD_LABEL))
        for rank, (rx, fmt) in enumerate(_JOURNAL_REASONS):
            m = rx.search(text)
            if m and (best is None or rank <= best[0]):
                best = (rank, fmt.format(**m.groupdict()))
                break
    return best[1] if best else None


SYSTEMD_LABEL = "[systemd] "


def reason(detail: str, exit_code: int | None, lines: Sequence[str]) -> str:
    """A failed task's detail (lifecycle's words) made precise with its journal: systemd's
    exec failures get the path and the error, "the program could not be started:
    /opt/venv/bin/torchrun: No such file or directory (exit status 203/EXEC)"."""
    why = journal_reason(lines)
    if why is None:
        return detail
    if exit_code is not None and exit_code in SYSTEMD_EXIT:
        name, words = SYSTEMD_EXIT[exit_code]
        head = f"{words}: {why} (exit status {exit_code}/{name})"
        sd = systemd_exit(exit_code)
        assert sd is not None
        # Keep what lifecycle added after the words (", restart limit (2) reached").
        return detail.replace(sd, head, 1) if sd in detail else head
    if "out-of-memory" in why and "out-of-memory" not in detail:
        return f"{detail} ({why})" if detail else why
    return detail
