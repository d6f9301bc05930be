r"""A task's env file read as data, for `exec` and `ssh` (run/remote.py sends host/trust.py
and this file to the host as one `python3 -S -c` program): provision writes the file as
`KEY="value"` with \ \" \$ \` escaped, as systemd's EnvironmentFile= reads it; it is never
sourced by a shell, and it is opened without following a link, in a directory
host/trust.py passes. Stdlib only.

parse_env is provision's one reader of such files: plan's env diff (rules/plan.py) reads
the host's old file with it too.
"""

from __future__ import annotations

import os
import sys

try:
    from .trust import problem
except ImportError:  # alone on a host (`python3 -S -c`): trust.py's source came first
    pass


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
    comment and blank lines skipped. Inside the quotes as systemd reads them: a backslash
    before \\ " $ ` is dropped, before a newline both go (a continued line), before any
    other character it stays. Anything else is refused (ValueError): a file that is not
    provision's is not guessed at."""
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
            if ch == "\\" and j + 1 < n and text[j + 1] == "\n":
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
