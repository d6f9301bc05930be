"""Which of provision's directories on a host may be trusted. Runs on hosts (shipped by
host/bundle.py first, and compiled at every request without the cache it judges: keep it
small), stdlib only, no imports of provision.

OpenSSH refuses a key or config file that someone other than root (or its owner) could
have changed (StrictModes); provision holds its own directories to the same rule before
the agent, running as root, reads, writes, restores or runs anything under them: every
component from `/` is a directory (or a link) owned by root or the agent's own user, and
not writable by group or others (unless sticky, like /tmp: others cannot rename what they
do not own there). A directory that does not exist yet is fine: the agent makes it.
"""

from __future__ import annotations

import os

GROUP_OTHER_WRITE = 0o022
STICKY = 0o1000
S_IFMT, S_IFDIR, S_IFLNK = 0o170000, 0o040000, 0o120000


def problem(path: str, _depth: int = 0) -> str | None:
    """Why `path` (a directory provision uses) cannot be trusted, in one line; None if it
    can. Components that do not exist end the check (the agent creates them)."""
    me = os.geteuid()
    cur = "/"
    for part in [p for p in path.split("/") if p]:
        cur = cur.rstrip("/") + "/" + part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return None
        fmt = st.st_mode & S_IFMT
        if st.st_uid not in (0, me):
            return "%s is owned by uid %d (mode %04o): provision uses only directories owned by root" % (
                cur,
                st.st_uid,
                st.st_mode & 0o7777,
            )
        if fmt == S_IFLNK:  # owned by root, in a directory checked so far: where it leads must pass too
            if _depth > 8:
                return "%s: too many levels of symbolic links" % cur
            why = problem(os.path.realpath(cur), _depth + 1)
            if why:
                return why
            continue
        if fmt != S_IFDIR:
            return "%s is not a directory" % cur
        if st.st_mode & GROUP_OTHER_WRITE and not st.st_mode & STICKY:
            return (
                "%s is writable by group or others (mode %04o): provision uses only directories only root may write"
                % (
                    cur,
                    st.st_mode & 0o7777,
                )
            )
    return None
