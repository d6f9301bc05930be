"""The directories provision makes and reads as root on a user's behalf (`outputs:`: the
base, a trial's BASE/N and the model/, checkpoints/ and logs/ under it), held to the rule
of provision's own directories (host/trust.py), and stricter about links: every component
from / is a directory, not a symbolic link, owned by root, and not writable by group or
others unless sticky (as /tmp, where others cannot rename or remove what root made).
A user who owned /data could otherwise make /data/runs a link to /root/x: the task's unit
made model/ there as root, and `fetch` sent root's files back.

Two forms of one rule: `problem` (Python, the agent's check before a write) and
`GUARD_SH` (sh, what a task's unit runs before every start, and what `fetch` runs before it
lists or reads: no Python there). The sh form makes a missing component with mkdir and
checks it after (mkdir never follows a link; a user who made it first is found out), so
nothing is ever made through a link. Stdlib only; shipped to hosts (bundle.LAZY).
"""

from __future__ import annotations

import os

# The refusals, the same words in both forms (printf's and Python's % formats).
LINK = "%s is a symbolic link: provision follows none on the way to outputs: (write the path it leads to)"
OWNER = "%s is owned by uid %s (mode %04o): outputs: must be in directories owned by root"
WRITABLE = (
    "%s is writable by group or others (mode %04o): outputs: must be in directories only root may write"
    " (or sticky, as /tmp)"
)
NOT_DIR = "%s is not a directory"
S_IFMT, S_IFDIR, S_IFLNK = 0o170000, 0o040000, 0o120000


def judged(path: str, mode: int, uid: int, me: int = 0) -> str | None:
    """Why one component (lstat's mode and owner) may not be on the way to outputs:."""
    fmt = mode & S_IFMT
    if fmt == S_IFLNK:
        return LINK % path
    if uid not in (0, me):
        return OWNER % (path, uid, mode & 0o7777)
    if fmt != S_IFDIR:
        return NOT_DIR % path
    if mode & 0o022 and not mode & 0o1000:
        return WRITABLE % (path, mode & 0o7777)
    return None


def problem(path: str) -> str | None:
    """Why `path` may not be made or read as root for outputs:, in one line; None if it
    may. A component that does not exist ends the check (the unit's guard makes it)."""
    cur = ""
    for part in [p for p in path.split("/") if p]:
        cur += "/" + part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return None
        why = judged(cur, st.st_mode, st.st_uid, os.geteuid())
        if why:
            return why
    return None


def refusals(paths: list[str]) -> list[str]:
    """The write request's refusal for its outputs: directories, one line (the first path
    refused; they share the way there): nothing is written then."""
    for p in paths:
        why = problem(p)
        if why:
            return ["outputs: %s: %s; refused (nothing was done on this host)" % (p, why)]
    return []


# sh -c GUARD_SH NAME MAKE PATH...: checks every component of each PATH as `judged` does,
# made first (mkdir, mode 0755) when MAKE is 1; without MAKE a missing component ends that
# path's check (nothing there to read). Exit 1 with the refusal on stderr. stat -c: GNU
# coreutils and busybox. No quotes of one kind and no backslashes: it travels
# single-quoted (in a unit's command line, in an SSH command).
_SAY = 'printf "%s" %s >&2; echo >&2; exit 1'
GUARD_SH = (
    'set -f; m=$1; shift; for p do c=; r=${p#/}/; while [ -n "$r" ]; do '
    'w=${r%%/*}; r=${r#*/}; [ -n "$w" ] || continue; c=$c/$w; '
    'if [ ! -e "$c" ] && [ ! -h "$c" ]; then [ "$m" = 1 ] || break; mkdir -m 0755 -- "$c" || [ -e "$c" ] || exit 1; fi; '
    's=$(stat -c "%u %f" -- "$c") || exit 1; u=${s% *}; f=$((0x${s#* })); t=$((f & '
    + str(S_IFMT)
    + ")); x=$((f & 4095)); "
    "if [ $t = " + str(S_IFLNK) + " ]; then " + _SAY % (LINK, '"$c"') + "; fi; "
    'if [ "$u" != 0 ]; then ' + _SAY % (OWNER, '"$c" "$u" $x') + "; fi; "
    "if [ $t != " + str(S_IFDIR) + " ]; then " + _SAY % (NOT_DIR, '"$c"') + "; fi; "
    "if [ $((x & 18)) != 0 ] && [ $((x & 512)) = 0 ]; then " + _SAY % (WRITABLE, '"$c" $x') + "; fi; "
    "done; done"
)


def unit_command(paths: list[str]) -> str:
    """GUARD_SH making `paths`, as a unit's ExecStartPre= (systemd's % and $ escaped)."""
    sh = GUARD_SH.replace("%", "%%").replace("$", "$$")
    return "/bin/sh -c '" + sh + "' provision-outputs 1 " + " ".join(paths)


def read_prefix(path: str) -> str:
    """sh commands that refuse `path` as GUARD_SH does, then make it the working directory
    (exit 0 when it is not there: nothing to read) and check it again from there: no link
    was followed on the way, and the directory entered is root's (a user who made it in a
    sticky parent between the checks is found out). `path`: plain characters (validate)."""
    guard = "sh -c '" + GUARD_SH + "' provision-outputs 0 " + path + " || exit 1; "
    return (
        guard
        + "cd -P -- %s 2>/dev/null || exit 0; " % path
        + '[ "$(pwd -P)" = %s ] || { echo "%s changed while it was read" >&2; exit 1; }; ' % (path, path)
        + guard
    )
