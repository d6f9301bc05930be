"""Small words for people: plurals and durations."""

from __future__ import annotations


def duration(secs: int | None) -> str:
    """42s, 5m, 3h: for people (JSON keeps the seconds)."""
    if secs is None:
        return ""
    if secs < 120:
        return f"{secs}s"
    if secs < 7200:
        return f"{secs // 60}m"
    return f"{secs // 3600}h"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 file', '2 files', '0 files' (`many` for irregular plurals)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def printable(text: str) -> str:
    """`text` safe for a terminal: control characters (escape sequences among them) shown
    as escapes, never interpreted (names and words from hosts, databases and other users)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\t" else c.encode("unicode_escape").decode() for c in text)
