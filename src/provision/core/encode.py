"""Writing values so that systemd reads them back intact (shared/spec/cluster-env.md).

One function per target syntax. Nothing here trusts its input: every inventory value goes
through one of these before it reaches a file, so no value can add a line, a directive or
a shell word.
"""

from __future__ import annotations

import re

from provision.core.errors import ProvisionError

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# An absolute, normalized path (no "." or ".." parts, as systemd requires) or a bare
# name looked up in PATH; never starting with one of ExecStart='s prefixes (- + @ ! :).
EXECUTABLE = re.compile(r"^(?:(?:/(?!\.\.?(?:/|$))[A-Za-z0-9_.+-]+)+|[A-Za-z0-9_][A-Za-z0-9_.+-]*)$")
# Inside double quotes systemd's EnvironmentFile= parser keeps every byte but these four,
# which it unescapes after a backslash; a literal newline stays part of the value.
_ENV_ESCAPE = {"\\": "\\\\", '"': '\\"', "$": "\\$", "`": "\\`"}
_ENV_NEEDS = re.compile(r'[\\"$`]')


def env_assignment(key: str, value: str) -> str:
    """One `KEY="value"` entry of an EnvironmentFile= file."""
    if not ENV_KEY.fullmatch(key):
        raise ProvisionError(f"environment variable name {key!r} is not valid")
    if "\x00" in value:
        raise ProvisionError(f"environment variable {key}: NUL bytes cannot be passed")
    return f'{key}="{env_escape(value)}"'


def env_escape(value: str) -> str:
    """The inside of a double-quoted EnvironmentFile= value."""
    if _ENV_NEEDS.search(value):
        # str.replace runs in C; a per-match callback cost ~2 µs per quote in the cluster
        # JSON (1 s for a 1,000-host job). Backslash first, so added ones stay single.
        for ch in '\\"$`':
            value = value.replace(ch, _ENV_ESCAPE[ch])
    return value


# ExecStart= words: specifiers (%) and variables ($) are expanded by systemd, and inside
# double quotes C escapes are decoded, so each of those is escaped here.
_EXEC_ESCAPE = {
    "\\": "\\\\",
    '"': '\\"',
    "%": "%%",
    "$": "$$",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}
_EXEC_NEEDS = re.compile(r'[\\"%$\x00-\x1f\x7f]')


def _exec_char(ch: str) -> str:
    return _EXEC_ESCAPE.get(ch) or f"\\x{ord(ch):02x}"


def exec_word(arg: str) -> str:
    """One argument of ExecStart=, always double-quoted."""
    if "\x00" in arg:
        raise ProvisionError("command arguments cannot contain NUL bytes")
    if arg == ";":
        return "\\;"  # a lone ';' would separate commands
    return '"' + _EXEC_NEEDS.sub(lambda m: _exec_char(m.group()), arg) + '"'


def exec_line(argv: list[str] | tuple[str, ...]) -> str:
    """A whole ExecStart= value. The program is written bare (systemd reads prefixes
    such as '-' or '@' from it), so it must be a plain path; validation ensures that."""
    if not argv or not EXECUTABLE.fullmatch(argv[0]):
        raise ProvisionError(f"program {argv[0] if argv else ''!r} is not a plain path")
    return " ".join([argv[0], *(exec_word(a) for a in argv[1:])])
