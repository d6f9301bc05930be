"""The fast probe: the agent's `probe` report, read by a shell script (probe.sh) instead.

plan and destroy probe every host at every run, so a host's cost there is the product's
speed. Starting Python and the agent costs a host about twice what sh plus stat, sha256sum,
head and systemctl do (measured on the sandbox hosts: ~24 ms against ~12 ms of CPU), so the
common case takes this path. The report is the ProbeReport host/agent.py's op_probe returns (a test
holds them equal on real hosts), built here from the script's output with the agent's own
parsers; it lacks only the clock readings (`now`, `now_monotonic_us`, `boot_id`) that status
uses.

Whenever the script's answer does not add up, or the request needs what only the agent
reads (accelerator facts, odd path names, a manifest listing files the controller did not
know of), the agent answers instead: same report, one more round trip at worst.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
import stat
from pathlib import Path
from typing import Any

from .host import agent, layout
from .host.protocol import CHECK_FACTS, NO_FACTS, FileInfo, ProbeReport, ProbeRequest
from .ssh import Session, Target, call_agent

_SAFE_PATH = re.compile(r"^/[A-Za-z0-9/._@:+=,-]*$")
_SAFE_UNIT = re.compile(r"^[A-Za-z0-9@._:-]+$")
_SCRIPT: str | None = None


def script() -> str:
    global _SCRIPT
    if _SCRIPT is None:
        text = (Path(__file__).parent / "host" / "probe.sh").read_text()
        # Comments stay on the controller; what is left travels as one single-quoted word.
        _SCRIPT = "\n".join(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    return _SCRIPT


def _asked(req: ProbeRequest) -> tuple[list[str], list[str], list[str]]:
    """(files the report lists, units, every path the script reads) for a probe request:
    the files are the request's listed paths; the script also reads provision's own records
    (manifest, lifecycle marker, each unit's exits)."""
    job = req.job
    files = req.listed()
    units = sorted(set(req.units))
    records = [
        layout.manifest_path(job),
        layout.lifecycle_path(job),
        *(layout.exits_path(job, layout.task_of_unit(job, u)) for u in units),
    ]
    return files, units, files + [r for r in records if r not in files]


def command(req: ProbeRequest) -> str | None:
    """The shell command for req, or None when the agent must answer it."""
    if req.facts not in (NO_FACTS, CHECK_FACTS) or not set(req.facts_only) <= {"gpus", "tpu"}:
        return None  # every fact (`provision facts`): the agent's
    facts = set(req.facts_only) if req.facts == CHECK_FACTS else set()
    _, units, paths = _asked(req)
    if not all(_SAFE_UNIT.match(u) for u in units) or not all(_SAFE_PATH.match(p) for p in paths):
        return None
    gpus = " ".join((str(agent.NVIDIA_SMI_TIMEOUT), *agent.NVIDIA_SMI)) if "gpus" in facts else ""
    words = [
        "sh",
        "-c",
        script(),
        "provision-probe",
        str(int(req.content_max)),
        ",".join(agent.UNIT_PROPS),
        " ".join(units),
        gpus,
        "1" if "tpu" in facts else "",
        *paths,
    ]
    return " ".join(shlex.quote(w) for w in words)


class _Mismatch(Exception):
    """The script's output does not add up: ask the agent."""


def parse(out: bytes, req: ProbeRequest) -> ProbeReport:
    """The agent's probe report from the script's output (for `command(req)`); _Mismatch if
    it does not add up."""
    listed, units, paths = _asked(req)
    pos = 0

    def line() -> bytes:
        nonlocal pos
        end = out.find(b"\n", pos)
        if end < 0:
            raise _Mismatch("truncated")
        text, pos = out[pos:end], end + 1
        return text

    if line() != b"@probe 1":
        raise _Mismatch("not the probe's output")
    facts: dict[str, Any] = {}
    text = line()
    facts["systemd_pid1"] = text == b"@systemd"
    if facts["systemd_pid1"]:
        text = line()
    if text.startswith(b"@gpus "):
        code, lines = int(text.split()[1]), []
        while (text := line()) != b"@gpus-end":
            lines.append(text.decode("utf-8", "replace"))
        if code not in (0, 124, 127):
            raise _Mismatch("nvidia-smi failed: the agent reports its own words")
        err = agent.timed_out(agent.NVIDIA_SMI[0], agent.NVIDIA_SMI_TIMEOUT) if code == 124 else ""
        facts.update(agent.gpu_report(code, "\n".join(lines), err))
        text = line()
    if text.startswith(b"@tpu "):
        facts["tpu_chips"] = int(text.split()[1])
        text = line()
    if text != b"@stat":
        raise _Mismatch("no stat section")
    stats: dict[str, tuple[int, int, int]] = {}
    while True:
        text = line()
        if text.startswith(b"@sha256 "):
            break
        size_s, mode_s, uid_s, name = text.decode().split(" ", 3)
        stats[name] = (int(size_s), int(mode_s, 16), int(uid_s))
    regular = [p for p in paths if p in stats and stat.S_ISREG(stats[p][1])]
    if int(text.split()[1]) != len(regular):
        raise _Mismatch("a file changed type while probed")
    sums = {}
    for p in regular:
        digest = line().lstrip(b"\\")[:64].decode()
        if len(digest) != 64:
            raise _Mismatch(f"no checksum for {p}")
        sums[p] = digest
    if line() != b"@content":
        raise _Mismatch("no content section")
    cap = req.content_max + 1
    content_of = {}
    for p in regular:
        n = min(stats[p][0], cap)
        content_of[p], pos = out[pos : pos + n], pos + n
    if line() != b"@units" or not out.endswith(b"@end\n"):
        raise _Mismatch("a file changed size while probed")
    unit_text = out[pos : -len(b"@end\n")].decode("utf-8", "replace")

    def whole(p: str) -> bytes | None:
        """A small file of provision's own, as the agent's read_json would read it."""
        if p not in stats:
            return None
        if p not in content_of or len(content_of[p]) != stats[p][0] or len(content_of[p]) >= cap:
            raise _Mismatch(f"{p} is not a small regular file")
        return content_of[p]

    def as_json(p: str) -> Any:
        data = whole(p)
        if data is None:
            return None
        try:
            return json.loads(data.decode("utf-8"))
        except ValueError as e:
            return {"_unreadable": str(e)}

    job = req.job
    manifest = as_json(layout.manifest_path(job))
    if isinstance(manifest, dict) and "_unreadable" not in manifest:
        on_host = set(manifest.get("files", {})) if req.files else set()
        on_host_units = {t.get("unit") for t in manifest.get("tasks", {}).values() if t.get("unit")}
        if not on_host <= set(listed) or not on_host_units <= set(units):
            raise _Mismatch("the manifest lists files or tasks the controller did not know of")
    files: dict[str, FileInfo | None] = {}
    for p in listed:
        if p not in stats:
            files[p] = None
            continue
        size, mode, uid = stats[p]
        if stat.S_ISLNK(mode):
            files[p] = FileInfo("symlink")
        elif not stat.S_ISREG(mode):
            files[p] = FileInfo("dir" if stat.S_ISDIR(mode) else "other")
        else:
            content = None
            if req.want.get(p) is not None and sums[p] != req.want[p] and size <= req.content_max:
                data = content_of[p]
                if len(data) != size or hashlib.sha256(data).hexdigest() != sums[p]:
                    raise _Mismatch(f"{p} changed while probed")
                content = base64.b64encode(data).decode()
            files[p] = FileInfo("file", mode & 0o7777, uid, size, sums[p], content)
    exits = {}
    for u in units:
        record = whole(layout.exits_path(job, layout.task_of_unit(job, u)))
        exits[u] = layout.parse_exits(record.decode("utf-8", "replace")) if record is not None else []
    return ProbeReport(
        manifest=manifest,
        lifecycle=as_json(layout.lifecycle_path(job)),
        files=files,
        units=agent.parse_unit_states(unit_text, units) if units else {},
        exits=exits,
        facts=facts if req.facts != NO_FACTS else None,
    )


def probe_host(session: Session, target: Target, req: ProbeRequest, *, timeout: float = 120) -> ProbeReport:
    """The agent's probe report for req, through the script when it can answer. Anything
    else (the script failed, sudo refused, an answer that does not add up) goes to the
    agent, which also words the errors."""
    cmd = command(req)
    if cmd is not None:
        res = session.run(target, cmd, timeout=timeout)
        if res.exit_status == 0:
            try:
                return parse(res.stdout, req)
            except (_Mismatch, ValueError, IndexError, UnicodeDecodeError):
                pass
    report: ProbeReport = call_agent(session, target, req, timeout=timeout)
    return report
