"""The fast probe: the agent's `probe` report, read by a shell script (probe.sh) instead.

plan and destroy probe every host at every run, so a host's cost there is the product's
speed. Starting Python and the agent costs a host about twice what sh plus stat, sha256sum,
head and systemctl do (measured on the sandbox hosts: ~24 ms against ~12 ms of CPU), so the
common case takes this path. The report is the ProbeReport host/agent.py's op_probe returns (a test
holds them equal on real hosts), built here from the script's output with the agent's own
parsers. The clocks come only when asked (`clocks`, for status: `now`, and `now_monotonic_us`
from /proc/uptime, which counts as systemd's monotonic timestamps do unless the host was
suspended; with pre-flight checks the wall clock alone); `boot_id` never.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from provision.core.target import Target
from provision.host import agent, health, hostcheck, hostfacts, hostlib, layout, ledger, logins
from provision.host.protocol import CHECK_FACTS, MAX_PROGRESS_PATHS, NO_FACTS, FileInfo, ProbeReport, ProbeRequest
from provision.io.ssh import ANSWER_LIMIT, Session, call_agent

_SAFE_PATH = re.compile(r"^/[A-Za-z0-9/._@:+=,-]*$")
_SAFE_UNIT = re.compile(r"^[A-Za-z0-9@._:-]+$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._:%-]+$")  # a host name or address
_SCRIPT: str | None = None


def script() -> str:
    global _SCRIPT
    if _SCRIPT is None:
        text = (Path(__file__).parent.parent / "host" / "probe.sh").read_text()
        # One text for both readers of a host's health: the agent runs HEALTH_SH as it is.
        text = text.replace("@HEALTH_SH@\n", health.HEALTH_SH, 1)
        # Comments stay on the controller; what is left travels as one single-quoted word.
        _SCRIPT = "\n".join(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    return _SCRIPT


def _asked(req: ProbeRequest) -> tuple[list[str], list[str], list[str]]:
    """(files the report lists, units, every path the script reads) for a probe request:
    the files are the request's listed paths; the script also reads provision's own records
    (manifest, lifecycle marker, each unit's exits)."""
    job = req.job
    files = req.listed()
    looked = set(req.looked())
    units = sorted(set(req.units))
    records = [
        layout.manifest_path(job),
        layout.lifecycle_path(job),
        layout.setup_key_path(job),
        layout.runs_path(job),
        *(layout.exits_path(job, layout.task_of_unit(job, u)) for u in units),
    ]
    read = [p for p in files if p not in looked]
    return files, units, read + [r for r in records if r not in read]


# The script's answer in one write, with its exit status: written as it comes, a few KB
# arrive in ~20 SSH packets, each decrypted, checked and handed between paramiko's threads
# on the controller (about half of a probe's CPU there; the service probes every host every
# round). Without dd the answer is empty and the agent answers instead (probe_host).
_ONE_WRITE = (
    's=$1; shift; { r=$( { { sh -c "$s" provision-probe "$@"; echo $? >&3; } '
    '| dd bs=16M iflag=fullblock status=none >&4; } 3>&1 ); } 4>&1; exit "${r:-1}"'
)


def command(req: ProbeRequest) -> str | None:
    """The shell command for req, or None when the agent must answer it."""
    if req.facts not in (NO_FACTS, CHECK_FACTS) or not set(req.facts_only) <= {"gpus", "tpu"}:
        return None  # every fact (`provision facts`): the agent's
    facts = set(req.facts_only) if req.facts == CHECK_FACTS else set()
    _, units, paths = _asked(req)
    looked = req.looked()
    progress = req.progress[:MAX_PROGRESS_PATHS]
    if not all(_SAFE_UNIT.fullmatch(u) for u in units) or not all(
        _SAFE_PATH.fullmatch(p) for p in paths + looked + progress
    ):
        return None
    gpus = " ".join((str(hostfacts.NVIDIA_SMI_TIMEOUT), *hostfacts.NVIDIA_SMI)) if "gpus" in facts else ""
    checks = _check_words(req, facts)
    if checks is None:
        return None
    if checks[1]:  # the GPU query with its health columns, in the same nvidia-smi run
        gpus = " ".join((str(_gpu_timeout(req)), *hostcheck.GPU_QUERY))
    words = [
        "sh",
        "-c",
        _ONE_WRITE,
        "provision-probe",
        script(),
        str(int(req.content_max)),
        ",".join(agent.UNIT_PROPS),
        " ".join(units),
        gpus,
        "1" if "tpu" in facts else "",
        f"{layout.LEDGER_DIR} {layout.SYSTEMD_DIR}/{layout.PREFIX} {layout.ledger_path(req.job)} {int(req.listening)} "
        f"{layout.ETC} {layout.VAR}"
        if req.tenancy
        else "",
        *checks,
        " ".join(looked),
        " ".join(layout.unit_known_paths("")),  # the two prefixes: SYSTEMD_DIR/, INVOCATION_PREFIX
        # Drop-ins are drift of the unit files: read with the files (status does not compare them).
        " ".join((layout.DROPIN_DIRS, *(layout.DROPIN_BASES if req.files else ()))),
        _health_words(req),
        " ".join(logins.CGROUP_MOUNTS) if req.logins else "",
        " ".join(progress),
        *paths,
    ]
    return " ".join(shlex.quote(w) for w in words)


def _health_words(req: ProbeRequest) -> str:
    """probe.sh's HEALTH word: the health read when the checks ask it (host/health.py)."""
    asked = (req.checks or {}).get("health")
    return health.words(health._seconds(asked)) if asked else ""


def _gpu_timeout(req: ProbeRequest) -> int:
    c = req.checks or {}
    return int(c.get("gpu_timeout") or hostfacts.NVIDIA_SMI_TIMEOUT) if c.get("gpus") else hostfacts.NVIDIA_SMI_TIMEOUT


def _check_words(req: ProbeRequest, facts: set[str]) -> list[str] | None:
    """The script's CLOCK APPS PORTS DISK RESOLVE words for req (None: the agent's)."""
    c = req.checks or {}
    if c.get("tpu") or c.get("hypertune"):  # who holds the TPU chips (every process's fds); a python's import
        return None
    gpus = bool(c.get("gpus")) and "gpus" in facts
    disk = list(c.get("disk") or [])
    if not all(_SAFE_PATH.fullmatch(p) for p in disk):
        return None
    if req.cluster_address and not _SAFE_NAME.fullmatch(req.cluster_address):
        return None
    ports = [int(p) for p in c.get("ports") or []]
    return [
        "2" if req.clocks else "1" if c.get("clock") or req.progress else "",  # progress: ages on the host's clock
        " ".join((str(_gpu_timeout(req)), *hostcheck.APPS_QUERY)) if gpus else "",
        " " + " ".join(str(p) for p in ports) + " " if ports else "",
        " ".join(disk),
        req.cluster_address,
    ]


class _Mismatch(Exception):
    """The script's output does not add up: ask the agent."""


def _section(line: Callable[[], bytes], end: bytes) -> list[str]:
    out = []
    while (text := line()) != end:
        out.append(text.decode("utf-8", "replace"))
    return out


def _checks(  # noqa: C901  one branch per section of probe.sh's answer, in its order
    line: Callable[[], bytes], text: bytes, req: ProbeRequest, gpu_text: str | None, facts: dict[str, Any]
) -> tuple[bytes, float | None, int | None, dict[str, Any] | None, dict[str, Any] | None]:
    """The clocks', checks' and interface's sections (probe.sh), read as the agent reads the
    host: (the next line, the host's clock, its monotonic clock in µs, checks, interface)."""
    c = req.checks or {}
    now = mono = None
    if c.get("clock") or req.clocks or text.startswith(b"@clock "):  # also unasked: other jobs' entries
        if not text.startswith(b"@clock "):
            raise _Mismatch("no clock")
        now = float(text.split()[1])
        text = line()
    if req.clocks:
        if not text.startswith(b"@uptime "):
            raise _Mismatch("no uptime")
        mono = int(float(text.split()[1]) * 1_000_000)
        text = line()
    out: dict[str, Any] = {}
    pids: list[int] = []
    gpus: dict[str, Any] | None = None
    if c.get("gpus") and gpu_text is not None:
        err = facts.get("nvidia_smi")
        gpus = {"error": None if err == "ok" else err, "health": [], "apps": None, "apps_error": None}
        if err == "ok" and not hostcheck.memory_in_use(gpu_text):
            gpus["health"] = hostcheck.gpu_health(gpu_text)
            gpus["apps"] = []  # no GPU memory in use: no compute process (the script did not ask)
        elif err == "ok":
            gpus["health"] = hostcheck.gpu_health(gpu_text)
            if not text.startswith(b"@apps "):
                raise _Mismatch("no apps section")
            code = int(text.split()[1])
            apps_out = "\n".join(_section(line, b"@apps-end"))
            if code not in (0, 124, 127):
                raise _Mismatch("nvidia-smi failed: the agent reports its own words")
            gpus["apps_error"] = hostcheck.gpu_error(code, apps_out, "", hostcheck.APPS_QUERY[0], _gpu_timeout(req))
            gpus["apps"] = hostcheck.parse_apps(apps_out) if code == 0 else []
            pids += hostcheck.app_pids(gpus["apps"])
            text = line()
        out["gpus"] = gpus
    sockets: list[tuple[int, str]] = []
    fds: dict[str, list[int]] = {}
    if c.get("ports"):
        if text != b"@sockets":
            raise _Mismatch("no sockets section")
        sockets = hostcheck.sockets_of([pr for ln in _section(line, b"@fds") if (pr := ledger.pair(ln))], c["ports"])
        if sockets:
            for ln in _section(line, b"@procs"):
                where, _, link = ln.partition(" ")
                holder = where.removeprefix("/proc/").removesuffix("/fd")
                if holder.isdigit() and link.startswith("socket:["):
                    fds.setdefault(link[8:-1], []).append(int(holder))
            text = b"@procs"
        else:
            text = line()
    procs: dict[int, dict[str, Any]] = {}
    apps_asked = bool(c.get("gpus")) and req.facts == CHECK_FACTS and "gpus" in req.facts_only
    if apps_asked or c.get("ports"):  # as the script decides to print it
        if text != b"@procs":
            raise _Mismatch("no procs section")
        block = _section(line, b"@procs-end")
        i = 0
        while i < len(block):
            if not block[i].startswith("@pid "):
                raise _Mismatch("procs section out of step")
            pid, comm, i = int(block[i][5:]), block[i + 1], i + 2
            cgroup: list[str] = []
            while i < len(block) and block[i] != "@env" and not block[i].startswith("@pid "):
                cgroup.append(block[i])
                i += 1
            env: list[str] = []
            if i < len(block) and block[i] == "@env":
                i += 1
                while i < len(block) and not block[i].startswith("@pid "):
                    env.append(block[i])
                    i += 1
            procs[pid] = hostcheck.owner(pid, comm, "\n".join(cgroup), hostcheck.env_pairs(env))
        text = line()
    if gpus is not None and gpus["apps"]:
        for a in gpus["apps"]:
            a["owner"] = procs.get(a["pid"]) if isinstance(a.get("pid"), int) else None
    if c.get("ports"):
        out["ports"] = hostcheck.port_owners(sockets, fds, procs)
    if c.get("disk"):
        if text != b"@disk":
            raise _Mismatch("no disk section")
        out["disk"] = hostcheck.disk_lines(_section(line, b"@disk-end"))
        text = line()
    interface = None
    if req.cluster_address:
        if text != b"@resolve":
            raise _Mismatch("no resolve section")
        getent = []
        while not (text := line()).startswith(b"@ip "):
            getent.append(text.decode("utf-8", "replace"))
        addresses = hostcheck.getent_addresses("\n".join(getent))
        code = int(text.split()[1])
        ip_out = "\n".join(_section(line, b"@resolve-end"))
        interface = hostcheck.interface_of(addresses, code, ip_out)
        text = line()
    if c.get("health"):
        if text != b"@health":
            raise _Mismatch("no health section")
        block = ["@health", *_section(line, b"@health-end"), "@health-end"]
        out["health"] = health.parse_section(block)
        text = line()
    return text, now, mono, (out if req.checks is not None else None), interface


def parse(out: bytes, req: ProbeRequest) -> ProbeReport:  # noqa: C901  one branch per section of probe.sh's answer, in its order
    """The agent's probe report from the script's output (for `command(req)`); _Mismatch if
    it does not add up."""
    listed, units, paths = _asked(req)
    looked = set(req.looked())
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
    gpu_text: str | None = None
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
        err = hostlib.timed_out(hostfacts.NVIDIA_SMI[0], _gpu_timeout(req)) if code == 124 else ""
        gpu_text = "\n".join(lines)
        asked = hostcheck.GPU_FIELDS if (req.checks or {}).get("gpus") else hostfacts.FIELDS  # as command() chose
        facts.update(hostfacts.gpu_report(code, gpu_text, err, asked))
        text = line()
    if text.startswith(b"@tpu "):
        facts["tpu_chips"] = int(text.split()[1])
        text = line()
    listening = local = None
    if req.tenancy and req.listening:
        if text != b"@listen":
            raise _Mismatch("no listen section")
        pairs, lo = [], []
        while (text := line()) != b"@listen-end":
            pr = ledger.pair(text.decode("utf-8", "replace"))
            if pr is None:
                raise _Mismatch("a listen line out of step")
            pairs.append(pr)
            lo.append((pr[0], text.endswith(b" lo")))
        listening, local = ledger.listening(pairs), ledger.local_only(lo)
        text = line()
    sessions = None
    if req.logins:
        if text != b"@logins":
            raise _Mismatch("no logins section")
        sessions = _logins(_section(line, b"@logins-end"))
        text = line()
    text, now, mono, checks, interface = _checks(line, text, req, gpu_text, facts)
    progress: dict[str, int] | None = None
    if req.progress:
        if text != b"@progress":
            raise _Mismatch("no progress section")
        progress = {}
        for said in _section(line, b"@progress-end"):
            mtime, _, name = said.partition(" ")
            if not mtime.lstrip("-").isdigit() or name not in req.progress:
                raise _Mismatch(f"a progress line out of step: {said!r}")
            progress[name] = int(mtime)
        text = line()
    if text != b"@dropins":
        raise _Mismatch("no dropins section")
    dropins = []
    while (text := line()) != b"@stat":
        name = text.decode("utf-8", "surrogateescape")
        if layout.dropin_unit(name) is None:  # a name with a newline, say: the agent lists them
            raise _Mismatch(f"a drop-in out of step: {name!r}")
        dropins.append(name)
    stats: dict[str, tuple[int, int, int]] = {}
    while True:
        text = line()
        if text.startswith(b"@sha256 "):
            break
        size_s, mode_s, uid_s, name = text.decode().split(" ", 3)
        stats[name] = (int(size_s), int(mode_s, 16), int(uid_s))
    # With tenancy the script adds the ledger's files after the paths asked for.
    held_paths = [
        p
        for p in stats
        if req.tenancy and p.startswith(layout.LEDGER_DIR + "/") and p not in paths and p != layout.HEALTH_PATH
    ]
    # ... and each other job's runs and end marker (ProbeReport.ledger_records).
    held_jobs = {layout.job_of_ledger_path(p) for p in held_paths} - {req.job}
    record_paths = {
        path: (other, key)
        for other in held_jobs
        for key, path in (("runs", layout.runs_path(other)), ("lifecycle", layout.lifecycle_path(other)))
        if path in stats and path not in paths
    }
    for other in held_jobs:  # ... and its tasks' exits (the script lists each one there)
        base = layout.state_dir(other) + "/"
        for path in stats:
            if path.startswith(base) and path.endswith(".exits") and "/" not in path[len(base) :]:
                record_paths.setdefault(path, (other, "exits:" + path[len(base) : -len(".exits")]))
    # In the order the script read them (each ledger entry, then that job's records; the health record).
    paths = paths + [
        p for p in stats if p not in paths and (p in record_paths or p in held_paths or p == layout.HEALTH_PATH)
    ]
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
        if not on_host <= set(listed) - looked or not on_host_units <= set(units):
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
        elif p in looked:
            files[p] = FileInfo("file", mode & 0o7777, uid, size)
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
    held = held_units = records = health_record = None
    if req.tenancy:
        got: dict[str, dict[str, Any]] = {other: {} for other in sorted(held_jobs)}
        for path, (other, key) in sorted(record_paths.items()):
            if key.startswith("exits:"):
                unit = layout.unit_name(other, key[len("exits:") :])
                got[other].setdefault("exits", {})[unit] = layout.parse_exits(
                    (whole(path) or b"").decode("utf-8", "replace")
                )
            else:
                got[other][key] = as_json(path)
        records = got
        held = {}
        for p in held_paths:
            entry = ledger.parse_entry(whole(p) or b"")
            held[layout.job_of_ledger_path(p)] = entry
        held = dict(sorted(held.items()))
        others = ledger.units_of(held, job)
        shown = agent.parse_unit_states(unit_text, others)
        held_units = {u: shown[u] for u in others}
        health_record = ledger.parse_entry(whole(layout.HEALTH_PATH) or b"") if layout.HEALTH_PATH in stats else {}
    shown_units = agent.parse_unit_states(unit_text, units) if units else {}
    return ProbeReport(
        manifest=manifest,
        lifecycle=as_json(layout.lifecycle_path(job)),
        files=files,
        units={u: shown_units[u] for u in units},
        exits=exits,
        facts=facts if req.facts != NO_FACTS else None,
        ledger=held,
        ledger_units=held_units,
        listening=listening,
        listening_local=local,
        now=now,
        now_monotonic_us=mono,
        checks=checks,
        interface=interface,
        setup_key=(whole(layout.setup_key_path(job)) or b"").decode("utf-8", "replace").strip() or None,
        runs=as_json(layout.runs_path(job)),
        ledger_records=records,
        dropins=sorted(dropins) if req.files else None,
        progress=progress,
        health=health_record,
        logins=sessions,
    )


def _logins(lines: list[str]) -> dict[str, list[str]]:
    """The @logins section's "UNIT TITLE" lines as host/logins.logins() reports them."""
    out: dict[str, list[str]] = {}
    for text in lines:
        unit, _, title = text.partition(" ")
        if not _SAFE_UNIT.fullmatch(unit):
            raise _Mismatch(f"a login line out of step: {text[:80]!r}")
        got = logins.login_of(title)
        if got is not None and len(out.setdefault(unit, [])) < logins.MAX_LOGINS:
            out[unit].append(got)
    return {u: v for u, v in out.items() if v}


def probe_host(session: Session, target: Target, req: ProbeRequest, *, timeout: float = 120) -> ProbeReport:
    """The agent's probe report for req, through the script when it can answer. Anything
    else (the script failed, sudo refused, an answer that does not add up) goes to the
    agent, which also words the errors."""
    cmd = command(req)
    if cmd is not None:
        res = session.run(target, cmd, timeout=timeout, limit=ANSWER_LIMIT)
        if res.exit_status == 0:
            try:
                return parse(res.stdout, req)
            except (_Mismatch, ValueError, IndexError, UnicodeDecodeError):
                pass
    report: ProbeReport = call_agent(session, target, req, timeout=timeout)
    return report
