"""Small words for people: plurals, durations, and text made safe for a terminal."""

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


# Every control character but tab: C0, DEL and C1. ESC is shown as \e (what the dashboard
# shows too), the others as \xNN; an escape sequence's other characters are plain text
# once its ESC is shown, so nothing of it is interpreted.
_VISIBLE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c != 0x09} | {0x1B: "\\e"}


def printable(text: str) -> str:
    """`text` as a terminal shows it literally: what came from a host, a ledger, a database
    or another user (an owner, a task's output, a host's error) cannot clear the screen,
    retitle the window or hide a line. Every line a command prints for people passes what
    it did not write itself through here; JSON output needs none (json escapes them)."""
    return text.translate(_VISIBLE)
