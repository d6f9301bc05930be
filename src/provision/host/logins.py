"""Who is logged in to each dev session on this host, and a message to its terminals.

A dev session (host/devsession.py) is a private sshd in a provision unit: each of its
connections is an sshd process in the unit's cgroup whose title names the user and the
terminal (`sshd: ana@pts/3`, `sshd: ana@notty` for an editor's or a command's connection;
OpenSSH 9.8 calls the process `sshd-session`). The probe reports them (ProbeReport.logins:
the shell probe reads the same files, probe.sh), so "nobody is logged in" is a fact of the
round, bounded like every other. Runs on the host (a lazy module of the agent's bundle,
and the first part of the session's own program), stdlib only, no imports of its package.
"""

from __future__ import annotations

import os

PREFIX = "provision-"  # host/layout.PREFIX: provision's units
# Where the cgroup hierarchies systemd uses are mounted: the unified one (cgroup v2, or
# v2's half of a hybrid), then v1's named one. systemd's own root in them is PID 1's
# (a host in a container, a nested systemd: not the mount's root).
CGROUP_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")
SSHD_NAMES = ("sshd", "sshd-session")
MAX_LOGINS = 32  # per session (core/devsession.MAX_LOGINS)


def login_of(title: str) -> str | None:
    """`user@pts/3` or `user@notty` from a connection's process title as sshd sets it
    (`sshd: user@pts/3`, OpenSSH 9.8's `sshd-session: user@notty`); None for any other
    process (the listener, a connection's privileged half `sshd: user [priv]`)."""
    head, sep, rest = title.partition(": ")
    if not sep or head not in SSHD_NAMES:
        return None
    word = rest.split(" ", 1)[0].strip()
    user, at, tty = word.partition("@")
    if not at or not user or len(user) > 32 or not all(c.isalnum() or c in "._-" for c in user):
        return None
    if tty == "notty" or (tty.startswith("pts/") and tty[4:].isdigit() and len(tty) <= 10):
        return word
    return None


def _read(path: str, limit: int = 4096) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return b""
    try:
        return os.read(fd, limit)
    except OSError:
        return b""
    finally:
        os.close(fd)


def title_of(pid: int) -> str | None:
    """A process's title if it is sshd's (its comm says so), else None."""
    comm = _read("/proc/%d/comm" % pid, 64).decode("utf-8", "replace").strip()
    if comm not in SSHD_NAMES:
        return None
    return _read("/proc/%d/cmdline" % pid, 512).split(b"\0", 1)[0].decode("utf-8", "replace")


def _pids(unit_dir: str) -> list[int]:
    text = _read(unit_dir + "/cgroup.procs", 1 << 16).decode("ascii", "replace")
    return [int(w) for w in text.split() if w.isdigit()]


def cgroup_bases() -> list[str]:
    """The directories systemd's system units' cgroups are in (system.slice under PID 1's
    own cgroup, in each hierarchy mounted)."""
    out: list[str] = []
    for line in _read("/proc/1/cgroup", 1 << 14).decode("utf-8", "replace").splitlines():
        n, _, rest = line.partition(":")
        ctrl, _, path = rest.partition(":")
        mounts: tuple[str, ...]
        if (n, ctrl) == ("0", ""):
            mounts = CGROUP_MOUNTS[:2]
        elif ctrl == "name=systemd":
            mounts = CGROUP_MOUNTS[2:]
        else:
            continue
        root = path[: -len("/init.scope")] if path.endswith("/init.scope") else path.rstrip("/")
        for m in mounts:
            d = m + root + "/system.slice"
            if d not in out and os.path.isdir(d):
                out.append(d)
    return out


def unit_pids(unit: str, bases: list[str] | None = None) -> list[int]:
    """The processes of a provision unit, each once (a hybrid host lists them twice)."""
    if not unit.startswith(PREFIX) or not unit.endswith(".service") or "/" in unit or unit.startswith("."):
        return []  # only a provision unit's cgroup is read
    got: dict[int, None] = {}
    for base in cgroup_bases() if bases is None else bases:
        got.update(dict.fromkeys(_pids(base + "/" + unit)))
    return list(got)


def unit_logins(unit: str, bases: list[str] | None = None) -> list[str]:
    """The session's connections now, each once per connection (its unprivileged half)."""
    out: list[str] = []
    for pid in unit_pids(unit, bases):
        title = title_of(pid)
        got = login_of(title) if title is not None else None
        if got is not None and len(out) < MAX_LOGINS:
            out.append(got)
    return out


def logins() -> dict[str, list[str]]:
    """unit -> its connections, for every provision unit that has some (ProbeReport.logins)."""
    bases = cgroup_bases()
    names: set[str] = set()
    for base in bases:
        try:
            names |= {n for n in os.listdir(base) if n.startswith(PREFIX) and n.endswith(".service")}
        except OSError:
            continue
    out = {}
    for name in sorted(names):
        got = unit_logins(name, bases)
        if got:
            out[name] = got
    return out


def warn(unit: str, text: str) -> int:
    """Write `text` to the session's terminals (its logins' ptys, only those): how many.
    A pty is written only when it is a character device that is not our terminal, opened
    without blocking: a full terminal never holds this up."""
    import stat  # only a warning needs it (the agent's probe does not)

    sent = 0
    msg = ("\r\n\a*** provision: " + text.replace("\n", " ") + " ***\r\n").encode("utf-8", "replace")
    for login in dict.fromkeys(unit_logins(unit)):
        tty = login.partition("@")[2]
        if not tty.startswith("pts/"):
            continue
        path = "/dev/" + tty
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if stat.S_ISCHR(os.fstat(fd).st_mode):
                os.write(fd, msg)
                sent += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return sent


def hang_up(unit: str, but: int) -> None:
    """Every login's processes (they are the session's): hung up, then asked to end; what
    is left systemd kills when the unit stops (KillMode=mixed)."""
    import signal  # only an ending session needs it

    for pid in unit_pids(unit):
        if pid != but:
            for sig in (signal.SIGHUP, signal.SIGTERM):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
