"""What `provision fetch` accepts from a host: the listing and the
tar stream are data from a machine provision does not trust.

tarfile's "data" filter is not enough: Python releases before the CVE-2025-4517 fix let a
crafted archive write outside the destination through link chains, and provision runs on
3.11 from its first release. So the stream is read here, header by header, as it arrives
(tarfile.TarInfo.frombuf parses one 512-byte header, nothing more), and every member must
be what fetch asked for: a regular file the listing named, once, with the size the listing
announced. No links, directories, devices or FIFOs; no name that is absolute, holds `..`
or leads anywhere but below the destination. The bytes are bounded by the listing too
(headers and padding included): an endless or oversized stream is cut.

Pure: run/fetch.py feeds the bytes and writes what comes out.
"""

from __future__ import annotations

import tarfile
from collections.abc import Mapping
from dataclasses import dataclass

from provision.core.text import plural

BLOCK = 512
RECORD = 20 * BLOCK  # GNU tar pads the archive to a whole record (blocking factor 20)
RESERVED = ".provision-fetch-"  # fetch's own work directories in -o (run/fetch.py)
REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
KINDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.DIRTYPE: "a directory (fetch asks for files only)",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
    tarfile.XHDTYPE: "a pax header (fetch asks for --format=gnu)",
    tarfile.XGLTYPE: "a pax header (fetch asks for --format=gnu)",
}
LONG = {tarfile.GNUTYPE_LONGNAME: "name", tarfile.GNUTYPE_LONGLINK: "link"}  # GNU's headers for the next one
MAX_SHOWN = 160  # characters of a host's name shown in a message


class Refused(Exception):
    """The stream (or one member of it) is not what fetch asked for."""

    def __init__(self, member: str | None, reason: str):
        super().__init__(f"{shown(member)}: {reason}" if member is not None else reason)
        self.member = member
        self.reason = reason


@dataclass(frozen=True)
class Remote:
    path: str  # relative to the output directory
    size: int
    mtime: int


@dataclass(frozen=True)
class Member:
    name: str
    size: int
    mtime: int
    mode: int  # as tarfile's data filter keeps it: no set-id bits, no write for others


@dataclass(frozen=True)
class End:
    """The member begun by the last Member event is complete."""

    member: Member


Event = Member | memoryview | End


def shown(name: str | None) -> str:
    """A host's name for a message on one line: control characters and undecodable bytes
    escaped, long names cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name or "")
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def name_problem(name: str) -> str | None:
    """Why a name (the listing's or a member's) cannot be written below the destination."""
    if not name:
        return "an empty name"
    if "\0" in name:
        return "a NUL in its name"
    if name.startswith("/"):
        return "an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "`..` in its path"
    if any(p in ("", ".") for p in parts):
        return "not a plain relative path (an empty or `.` part)"
    if parts[0].startswith(RESERVED):
        return f"a name fetch keeps for its own work ({RESERVED}*)"
    return None


def parse_listing(out: bytes) -> list[Remote]:
    """`find -printf '%P\\0%s\\0%T@\\0'` output as Remotes (a file whose name holds a
    newline or anything else survives: NUL separates). A malformed size or time drops the
    entry; a name fetch could not write safely refuses the listing (listing_problem)."""
    words = out.split(b"\0")
    got = []
    for i in range(0, len(words) - 2, 3):
        name, size, mtime = words[i : i + 3]
        try:
            r = Remote(name.decode("utf-8", "surrogateescape"), int(size), int(float(mtime)))
        except (ValueError, OverflowError):
            continue
        if r.size >= 0:
            got.append(r)
    return got


def listing_problem(remote: list[Remote]) -> Refused | None:
    """The first entry of a host's listing that fetch must not write: an unsafe name, a
    name listed twice, or a file where another entry needs a directory."""
    names = {r.path for r in remote}
    seen: set[str] = set()
    for r in remote:
        why = name_problem(r.path)
        if why:
            return Refused(r.path, why)
        if r.path in seen:
            return Refused(r.path, "listed twice")
        seen.add(r.path)
        parts = r.path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in names:
                return Refused(r.path, f"listed inside {shown('/'.join(parts[:i]))}, which is listed as a file")
    return None


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def bound(todo: Mapping[str, int]) -> int:
    """The most bytes GNU tar writes for these files at these sizes: a header each, a long
    name's header and blocks, the data padded to blocks, the end marker, the last record."""
    per = sum(2 * BLOCK + _blocks(len(n.encode("utf-8", "surrogateescape")) + 1) + _blocks(s) for n, s in todo.items())
    return per + 2 * BLOCK + RECORD


def member_problem(info: tarfile.TarInfo, announced: Mapping[str, int], seen: set[str]) -> str | None:
    """Why this member is not one fetch asked for (None: a file of the listing, at its size)."""
    if info.type not in REGULAR:
        kind = KINDS.get(info.type, f"an entry of unknown type {info.type!r}")
        if info.type in (tarfile.SYMTYPE, tarfile.LNKTYPE):
            kind += f" to {shown(info.linkname)}"
        return kind
    why = name_problem(info.name)
    if why:
        return why
    if info.name not in announced:
        return "not a file the listing named"
    if info.name in seen:
        return "sent twice"
    if info.size != announced[info.name]:
        return (
            f"{info.size} bytes where the listing announced {announced[info.name]} "
            "(did it change on the host while fetched? fetch again)"
        )
    if not -(2**40) < info.mtime < 2**40:
        return "a modification time out of range"
    return None


def _mode(mode: int) -> int:
    """tarfile's data filter's: no set-id or sticky bits, no write for group or others,
    readable and writable by the owner, executable only if the owner may execute it."""
    mode = (mode & 0o755) | 0o600
    return mode if mode & 0o100 else mode & ~0o111


class TarStream:
    """A GNU tar stream checked as it arrives: feed() the bytes, take the events (a Member
    begins, its data, its End), close() at the end of the stream. Raises Refused at the
    first member or byte that is not what fetch asked for."""

    def __init__(self, announced: Mapping[str, int]):
        self.announced = dict(announced)
        self.limit = bound(self.announced)
        self.got = 0  # bytes fed
        self._at = 0  # bytes read by the parser (to say where a bad header is)
        self._seen: set[str] = set()
        self._longest = max((len(n.encode("utf-8", "surrogateescape")) for n in self.announced), default=0) + 1
        self._buf = bytearray()  # a header (or a long name) being gathered
        self._want = BLOCK  # bytes the gathered part needs
        self._state = "header"  # header | name | link (GNU long ones) | data | pad | end
        self._long: dict[str, str] = {}  # GNU long name and link target, for the next header
        self._member: Member | None = None
        self._left = 0  # data or padding bytes to come

    def feed(self, data: bytes) -> list[Event]:
        over = self.got + len(data) > self.limit
        view = memoryview(data)[: max(0, self.limit - self.got)] if over else memoryview(data)
        self.got += len(view)
        events = self._parse(view)  # a bad member within the bound is named before the bound
        if over:
            raise Refused(
                None,
                f"the host sent more than the {self.limit} bytes its listing leaves room for "
                f"({plural(len(self.announced), 'file')} of {sum(self.announced.values())} bytes)",
            )
        return events

    def _parse(self, view: memoryview) -> list[Event]:
        events: list[Event] = []
        i = 0
        while i < len(view) and self._state != "end":
            if self._state in ("data", "pad"):
                n = min(self._left, len(view) - i)
                if self._state == "data" and n:
                    events.append(view[i : i + n])
                i += n
                self._at += n
                self._left -= n
                if self._left == 0:
                    self._next(events)
                continue
            n = min(self._want - len(self._buf), len(view) - i)
            self._buf += view[i : i + n]
            i += n
            self._at += n
            if len(self._buf) == self._want:
                block, self._buf = bytes(self._buf), bytearray()
                self._gathered(block, events)
        return events

    def close(self) -> None:
        """The stream ended: refuse it if it stopped short."""
        if self._state == "end":
            missing = sorted(set(self.announced) - self._seen)
            if missing:
                raise Refused(
                    missing[0],
                    f"not in the stream (it held {len(self._seen)} of the {len(self.announced)} files announced)",
                )
            return
        if self._member is not None and self._state == "data":
            raise Refused(self._member.name, f"the stream ended {self._left} bytes before the end of this file")
        raise Refused(None, f"the stream ended after {self.got} bytes, before the end of the archive")

    def _next(self, events: list[Event]) -> None:
        """Data done (then its padding), or padding done (then the next header)."""
        if self._state == "data":
            assert self._member is not None
            events.append(End(self._member))
            self._left = _blocks(self._member.size) - self._member.size
            self._state = "pad"
            self._member = None
            if self._left:
                return
        self._state, self._want = "header", BLOCK

    def _gathered(self, block: bytes, events: list[Event]) -> None:  # noqa: C901  one branch per tar header kind a host may send
        if self._state in LONG.values():  # a GNU long name or link target: for the next header
            self._long[self._state] = block.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            self._state, self._want = "header", BLOCK
            return
        if block == bytes(BLOCK):
            if self._long:
                raise Refused(self._long.get("name"), "a long name followed by the end of the archive")
            self._state = "end"  # what follows (a second zero block, the record's padding) is counted, not read
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except (tarfile.HeaderError, ValueError) as e:
            raise Refused(None, f"not a tar stream: the header at byte {self._at - BLOCK} is invalid ({e})") from None
        if info.type in LONG:
            what = LONG[info.type]
            if what in self._long:
                raise Refused(self._long.get("name"), f"two long {what}s for one member")
            # Bounded before it is read: a name no longer than the listing's, a target PATH_MAX.
            most = self._longest if what == "name" else 4096
            if not 0 < info.size <= most:
                raise Refused(None, f"a long {what} of {info.size} bytes, longer than any the listing announced")
            self._state, self._want = what, _blocks(info.size)
            return
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):
            raise Refused(self._long.get("name"), KINDS[info.type])  # its name is tar's own (././@PaxHeader)
        if "name" in self._long:
            info.name = self._long["name"].rstrip("/") if info.type == tarfile.DIRTYPE else self._long["name"]
        if "link" in self._long:
            info.linkname = self._long["link"]
        self._long = {}
        why = member_problem(info, self.announced, self._seen)
        if why:
            raise Refused(info.name, why)
        self._seen.add(info.name)
        member = Member(info.name, info.size, int(info.mtime), _mode(info.mode))
        events.append(member)
        self._member, self._left, self._state = member, member.size, "data"
        if member.size == 0:
            self._next(events)
