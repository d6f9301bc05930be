r"""Which of provision's directories on a host may be trusted, and reading a task's env file
as data. Runs on hosts (shipped by host/bundle.py, stdlib only, no imports of provision).

OpenSSH refuses a key or config file that someone other than root (or its owner) could
have changed (StrictModes); provision holds its own directories to the same rule before
the agent, running as root, reads, writes, restores or runs anything under them: every
component from `/` is a directory (or a link) owned by root or the agent's own user, and
not writable by group or others (unless sticky, like /tmp: others cannot rename what they
do not own there). A directory that does not exist yet is fine: the agent makes it.

`exec` and `ssh` load a task's environment through `main`: the env file is read as data
(provision writes it: `KEY="value"` with \\ \" \$ \` escaped, as systemd's EnvironmentFile=
reads it), never sourced by a shell, and opened without following a link.
"""

from __future__ import annotations

import os
import sys

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


def open_file(path: str) -> bytes:
    """The file's bytes, opened without following a link, in a directory that passes."""
    why = problem(os.path.dirname(path))
    if why:
        raise PermissionError(why)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


_UNESCAPE = {"\\": "\\", '"': '"', "$": "$", "`": "`"}


def parse_env(text: str) -> list[tuple[str, str]]:
    """KEY="value" entries as provision writes them (core/encode.env_assignment), in order;
    comment and blank lines skipped. Anything else is refused (ValueError): a file that is
    not provision's is not guessed at."""
    out = []
    i, n = 0, len(text)
    while i < n:
        if text[i] in "\n \t":
            i += 1
            continue
        if text[i] == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        eq = text.find('="', i)
        key = text[i:eq] if eq > 0 else ""
        if (
            not key
            or not (key[0].isalpha() or key[0] == "_")
            or not key.replace("_", "a").isalnum()
            or not key.isascii()
        ):
            raise ValueError('line %d is not KEY="value"' % (text.count("\n", 0, i) + 1))
        value: list[str] = []
        j = eq + 2
        while True:
            if j >= n:
                raise ValueError("%s: the value's closing quote is missing" % key)
            ch = text[j]
            if ch == "\\" and j + 1 < n and text[j + 1] in _UNESCAPE:
                value.append(text[j + 1])
                j += 2
                continue
            if ch == '"':
                break
            value.append(ch)
            j += 1
        out.append((key, "".join(value)))
        i = j + 1
    return out


def main(argv: list[str]) -> None:
    """python3 -S -c SOURCE [--if-present] ENV_FILE COMMAND...: run COMMAND with the task's
    environment added (exit 125 when the file is not there, unless --if-present)."""
    present = argv[:1] == ["--if-present"]
    if present:
        argv = argv[1:]
    env_file, command = argv[0], argv[1:]
    env = dict(os.environ)
    try:
        data = open_file(env_file)
    except FileNotFoundError:
        if not present:
            sys.stderr.write("provision: no %s on this host: is the job applied?\n" % env_file)
            sys.exit(125)
        data = b""
    except OSError as e:
        sys.stderr.write("provision: %s: %s\n" % (env_file, e.strerror or e))
        sys.exit(125)
    try:
        env.update(parse_env(data.decode("utf-8", "surrogateescape")))
    except ValueError as e:
        sys.stderr.write("provision: %s: %s\n" % (env_file, e))
        sys.exit(125)
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        sys.stderr.write("provision: %s: %s\n" % (command[0], e.strerror))
        sys.exit(127 if isinstance(e, FileNotFoundError) else 126)
