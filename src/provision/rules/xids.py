"""NVIDIA's Xid errors: which mean the GPU is bad, which are the program's own, which only
warn (the default table, docs/health.md), and the kernel's lines read as events. Pure.

The driver logs an Xid in the kernel's messages, e.g.

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

naming the GPU by its PCI address, the error by its number, and (for most) the process.
A team changes the table in its policy (`health: {xids: {31: fatal}}`): rules/policyfile.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum


class XidClass(StrEnum):
    FATAL = "fatal"  # the GPU is quarantined: it needs a reset, a test or a repair
    PROGRAM = "program"  # the job's own bug (a bad address, an exception): not the GPU's
    WARN = "warn"  # worth a look: the GPU is suspect, still given work
    IGNORE = "ignore"  # said nothing of (a team's policy may set it)


# Number -> (class, what NVIDIA's Xid catalogue says it is). An Xid not here warns.
DEFAULT: Mapping[int, tuple[XidClass, str]] = {
    8: (XidClass.WARN, "GPU stopped processing (a timeout)"),
    13: (XidClass.PROGRAM, "graphics engine exception (the program's: an illegal instruction or address)"),
    31: (XidClass.PROGRAM, "GPU memory page fault (the program's: an illegal address)"),
    32: (XidClass.WARN, "invalid or corrupted push buffer stream"),
    38: (XidClass.WARN, "driver firmware error"),
    43: (XidClass.PROGRAM, "GPU stopped processing (the program's: a reset channel)"),
    45: (XidClass.PROGRAM, "preemptive cleanup, after the program's errors"),
    48: (XidClass.FATAL, "double-bit ECC error"),
    56: (XidClass.WARN, "display engine error"),
    57: (XidClass.WARN, "error programming video memory interface"),
    61: (XidClass.FATAL, "internal micro-controller breakpoint"),
    62: (XidClass.FATAL, "internal micro-controller halt"),
    63: (XidClass.FATAL, "ECC page retirement or row remapping recorded"),
    64: (XidClass.FATAL, "ECC page retirement or row remapping failed"),
    69: (XidClass.WARN, "graphics engine class error"),
    74: (XidClass.FATAL, "NVLink error"),
    79: (XidClass.FATAL, "GPU has fallen off the bus"),
    92: (XidClass.FATAL, "high single-bit ECC error rate"),
    94: (XidClass.FATAL, "contained ECC error"),
    95: (XidClass.FATAL, "uncontained ECC error"),
    109: (XidClass.WARN, "context switch timeout"),
    119: (XidClass.FATAL, "GSP RPC timeout"),
    120: (XidClass.FATAL, "GSP error"),
    140: (XidClass.FATAL, "unrecovered ECC error"),
}
MAX_XID = 1023


def classify(code: int, overrides: Mapping[int, XidClass] | Iterable[tuple[int, XidClass]] = ()) -> XidClass:
    """An Xid's class: the team's policy, else the default table, else a warning."""
    got = dict(overrides).get(code)
    if got is not None:
        return got
    return DEFAULT[code][0] if code in DEFAULT else XidClass.WARN


def meaning(code: int) -> str:
    return DEFAULT[code][1] if code in DEFAULT else "an Xid NVIDIA's catalogue explains"


@dataclass(frozen=True)
class XidLine:
    """One Xid the kernel logged: when (host clock, None when the line does not say), the
    GPU's PCI address (domain, bus, device), the Xid, and the line as read (bounded)."""

    at: float | None
    pci: tuple[int, int, int]
    code: int
    line: str


_XID = re.compile(
    r"NVRM: Xid \(PCI:(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-7])?\): (\d{1,4})"
)
_UNIX = re.compile(r"^(\d{9,11}(?:\.\d{1,9})?)\s")  # journalctl -o short-unix, and the sandbox's file
_DMESG = re.compile(r"^\[\s*(\d{1,10}(?:\.\d{1,9})?)\]")  # dmesg: seconds since boot


def parse_line(line: str, source: str, boot: float | None) -> XidLine | None:
    """An Xid from one kernel line (None: not one). `boot`: the host's boot time (its clock),
    for dmesg's seconds since boot."""
    m = _XID.search(line)
    if m is None:
        return None
    code = int(m.group(4))
    if code > MAX_XID:
        return None
    at: float | None = None
    if source == "dmesg":
        d = _DMESG.match(line)
        at = boot + float(d.group(1)) if d is not None and boot is not None else None
    else:
        u = _UNIX.match(line)
        at = float(u.group(1)) if u is not None else None
    pci = (int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16))
    return XidLine(at, pci, code, printable_line(line))


def printable_line(line: str, n: int = 400) -> str:
    """What a host sent, kept as text a terminal and a page may show (no control characters)."""
    return "".join(c if c.isprintable() else "?" for c in line.strip())[:n]


def pci_of(bus_id: str) -> tuple[int, int, int] | None:
    """nvidia-smi's pci.bus_id (00000000:3B:00.0) as (domain, bus, device)."""
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-7])?", bus_id.strip())
    if m is None:
        return None
    return (int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16))


def pci_words(pci: tuple[int, int, int]) -> str:
    return "%04x:%02x:%02x" % pci


def new_lines(read: Mapping[str, object] | None) -> tuple[list[XidLine], bool]:
    """The Xid lines of a health read newer than its last look (`after`), oldest first, and
    whether the read may have missed some (as many lines as it reads at most, all new)."""
    if not isinstance(read, Mapping):
        return [], False
    source = str(read.get("source") or "")
    now, up, after = read.get("now"), read.get("uptime"), read.get("after")
    boot = float(now) - float(up) if isinstance(now, (int, float)) and isinstance(up, (int, float)) else None
    lines = read.get("lines") if isinstance(read.get("lines"), list) else []
    assert isinstance(lines, list)
    got = [x for ln in lines[-400:] if isinstance(ln, str) and (x := parse_line(ln, source, boot)) is not None]
    if isinstance(after, (int, float)):
        got = [x for x in got if x.at is None or x.at > after]
    return got, len(lines) >= 200 and len(got) == len(lines)


# --------------------------------------------------------------------------- DCGM


@dataclass(frozen=True)
class DcgmVerdict:
    overall: str  # Healthy, Warning, Failure (as DCGM says), or "" when unreadable
    gpus: Mapping[int, tuple[str, str]]  # GPU -> (its level, what DCGM says of it)


def parse_dcgm(lines: Iterable[str]) -> DcgmVerdict:
    """`dcgmi health -c`'s report: the overall verdict, and each GPU's with its words."""
    overall = ""
    gpus: dict[int, tuple[str, str]] = {}
    current: int | None = None
    for raw in lines:
        cells = [c.strip() for c in raw.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        left, right = cells[0], cells[1]
        m = re.search(r"Overall Health:\s*(\w+)", right)
        if m:
            overall = m.group(1)
            continue
        g = re.search(r"GPU ID:\s*(\d{1,4})", left)
        if g:
            current = int(g.group(1))
            gpus[current] = (right.split()[0] if right else "", "")
        elif not left and current is not None and right:
            level, words = gpus[current]
            gpus[current] = (level, printable_line(f"{words} {right}".strip(), 300))
    return DcgmVerdict(overall, gpus)
