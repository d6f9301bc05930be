"""The host's ledger: what each provision job holds here (GPUs, ports), and who applied it.

Runs on the host (shipped by host/bundle.py, stdlib only) and is read by the controller's
fast probe too. One JSON file per job under layout.LEDGER_DIR:

    {"job": J, "owner": {"lineage", "who", "host", "pid"}, "since": T0, "updated": T,
     "token": random, "gpus": [...], "gpu_uuids": [...], "ports": [...], "units": [...],
     "started": bool, "held": bool (stopped with --hold),
     "queued": {"since", "waiting_for", "gpus"} (an `apply --queue` waits; gpus: its
     largest task's need here),
     "priority": int, "preemptible": bool, "submitted": T (the queue's order and
     preemption; `submitted` is on the controller's clock)}

Also here: which jobs' manifests list a pushed path (other_owners): two jobs may push the
same file, and it stays until the last of them leaves.

Every change happens under one flock (layout.LEDGER_LOCK), so two applies racing for a GPU
see each other: `reserve` is a compare-and-set against what the controller saw at plan time.
Judging entries (running, finished, stale) is the controller's (tenancy.py): it needs the
units' states, and the rule belongs in one place.
"""

from __future__ import annotations

import os
import time

from . import layout

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .protocol import Reservation


JSON: Any = None  # the agent sets its cheap json stand-in here; else the real module


def _json() -> Any:
    global JSON
    if JSON is None:
        import json  # no stand-in set: the module, at first use (import time)

        JSON = json
    return JSON


def read_entry(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return parse_entry(f.read())
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"_unreadable": str(e)}


def parse_entry(data: bytes) -> Any:
    try:
        entry = _json().loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        return {"_unreadable": str(e) or type(e).__name__}
    return entry if isinstance(entry, dict) else {"_unreadable": "not an object"}


def read_all() -> dict[str, Any]:
    """job → entry ({"_unreadable": why} for a file that is not one)."""
    try:
        names = sorted(os.listdir(layout.LEDGER_DIR))
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.endswith(layout.LEDGER_SUFFIX) and not name.startswith("."):
            path = layout.LEDGER_DIR + "/" + name
            entry = read_entry(path)
            if entry is not None:
                out[layout.job_of_ledger_path(path)] = entry
    return out


def records(entries: dict[str, Any], but: str) -> dict[str, dict[str, Any]]:
    """Each other job's runs, end marker and tasks' exits here (ProbeReport.ledger_records):
    how a job the service's rounds watch ended, and which run it was (the shell probe reads
    the same files). systemd forgets an ended unit's outcome; the .exits records do not."""
    out: dict[str, dict[str, Any]] = {}
    for job in entries:
        if job == but:
            continue
        got: dict[str, Any] = {}
        for key, path in (("runs", layout.runs_path(job)), ("lifecycle", layout.lifecycle_path(job))):
            if os.path.isfile(path):
                got[key] = _read_json(path)
        try:
            names = sorted(n for n in os.listdir(layout.state_dir(job)) if n.endswith(".exits"))
        except OSError:
            names = []
        exits = {}
        for name in names:
            path = layout.state_dir(job) + "/" + name
            if os.path.isfile(path):
                try:
                    with open(path) as f:
                        exits[layout.unit_name(job, name[: -len(".exits")])] = layout.parse_exits(f.read())
                except OSError:
                    pass
        if exits:
            got["exits"] = exits
        out[job] = got
    return out


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return _json().loads(f.read().decode("utf-8"))
    except (ValueError, OSError) as e:
        return {"_unreadable": str(e)}


def units_of(entries: dict[str, Any], but: str) -> list[str]:
    """The units other jobs' entries name (their states tell the controller which still run)."""
    units: set[str] = set()
    for job, e in entries.items():
        if job != but and isinstance(e.get("units"), list):
            units |= {u for u in e["units"] if isinstance(u, str)}
    return sorted(units)


def proc_pair(line: str) -> tuple[int, str] | None:
    """(port, socket inode) of a /proc/net/tcp{,6} line in state 0A (listening), else None."""
    w = line.split()
    if len(w) < 10 or w[3] != "0A":
        return None
    try:
        return int(w[1].rsplit(":", 1)[1], 16), w[9]
    except (IndexError, ValueError):
        return None


def pair(line: str) -> tuple[int, str] | None:
    """(port, inode) of a "PORT INODE [lo]" line, as the shell probe writes them (probe.sh)."""
    w = line.split()
    if len(w) not in (2, 3) or not w[0].isdigit() or (len(w) == 3 and w[2] != "lo"):
        return None
    return int(w[0]), w[1]


# A /proc/net/tcp{,6} local address on loopback: 127.0.0.0/8 (little-endian hex: its last
# byte is 7F), ::1, and ::ffff:127.x.x.x.
_LO6 = "00000000000000000000000001000000"


def proc_loopback(line: str) -> bool:
    a = line.split()[1].rsplit(":", 1)[0] if len(line.split()) > 1 else ""
    return (
        (len(a) == 8 and a.endswith("7F"))
        or a == _LO6
        or (a.startswith("0000000000000000FFFF0000") and a.endswith("7F"))
    )


def local_only(lines: list[tuple[int, bool]]) -> list[int]:
    """Ports whose every listener is on a loopback address, from (port, on loopback): the
    host's own services (Docker's DNS on 127.0.0.11): placement avoids them, messages do
    not name them as holders."""
    public = {p for p, lo in lines if not lo}
    return sorted({p for p, lo in lines if lo} - public)


def listening(pairs: list[tuple[int, str]]) -> list[int]:
    """The ports of (port, inode) listeners, sorted, each once."""
    return sorted({p for p, _ in pairs})


_LISTEN: list[tuple[int, str]] | None = None
_LOOPBACK: list[tuple[int, bool]] = []


def listen_pairs() -> list[tuple[int, str]]:
    """(port, inode) of every listening TCP socket, from /proc/net/tcp and tcp6, read once per
    agent run (the ledger's listening ports and the port check both use them)."""
    global _LISTEN
    if _LISTEN is None:
        _LISTEN = []
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(name) as f:
                    for line in f:
                        pr = proc_pair(line)
                        if pr is not None:
                            _LISTEN.append(pr)
                            _LOOPBACK.append((pr[0], proc_loopback(line)))
            except OSError:
                pass
    return _LISTEN


def proc_listening() -> list[int]:
    return listening(listen_pairs())


def proc_local_only() -> list[int]:
    listen_pairs()
    return local_only(_LOOPBACK)


class FileLock:
    """flock on a lock file for the duration of a with block. Whoever removes what the lock
    guards may unlink the lock file (release() removes an empty ledger): one unlinked while
    we waited for it locks nothing, so take the one that is there now."""

    def __init__(self, directory: str, path: str) -> None:
        self.directory, self.path = directory, path

    def __enter__(self) -> FileLock:
        import fcntl  # lazy: only requests that lock pay its import time

        while True:
            os.makedirs(self.directory, 0o755, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return self
            os.close(fd)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the flock


def _Locked() -> FileLock:  # noqa: N802 - reads as the context manager it returns
    """The ledger's lock."""
    return FileLock(layout.LEDGER_DIR, layout.LEDGER_LOCK)


class _Unlocked:
    def __enter__(self) -> _Unlocked:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _write(job: str, entry: dict[str, Any]) -> None:
    path = layout.ledger_path(job)
    tmp = path + layout.TMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, _json().dumps(entry).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def write_entry(job: str, entry: dict[str, Any]) -> None:
    """Replace the job's entry (the caller holds the ledger's lock: host/preempt.py)."""
    _write(job, entry)


def _token() -> str:
    return os.urandom(8).hex()


def _span(xs: list[int]) -> str:
    return ", ".join(str(x) for x in xs)


def runs_now(unit: str) -> bool:
    """Whether the unit has a live run: its invocation link is there (systemd removes it
    when the run ends or fails). A stat, no systemctl (the agent's probes use it too)."""
    return os.path.islink(layout.INVOCATION_PREFIX + unit)


def _runs(entry: dict[str, Any]) -> bool:
    return any(isinstance(u, str) and runs_now(u) for u in entry.get("units") or [])


def conflicts(entries: dict[str, Any], res: Reservation) -> list[str]:
    """Why res cannot be taken now, given the ledger's entries (empty: it can)."""
    out = []
    own = entries.get(res.job)
    own_lineage = (own.get("owner") or {}).get("lineage") if isinstance(own, dict) else None
    if own_lineage != res.expect_lineage and own_lineage != res.owner.get("lineage"):
        who = (own or {}).get("owner", {}).get("who", "?")
        out.append("job %s here was taken over by %s since plan" % (res.job, who))
    gpus, ports = set(res.gpus), set(res.ports)
    mark = own.get("preempted") if isinstance(own, dict) else None
    # Preempted: its GPUs wait for the preemptor, unless the controller saw that
    # reservation lapse (the preemptor gone) and nothing changed since.
    follows = isinstance(mark, dict) and bool(mark.get("follows"))  # the job's own stop: reserved for nobody
    mine = isinstance(mark, dict) and mark.get("by") == res.job  # a recovery's stop: held for its own next run
    if (
        isinstance(mark, dict)
        and not follows
        and not mine
        and own is not None
        and res.free.get(res.job) != own.get("token")
    ):
        g = sorted(gpus & set(own.get("gpus") or []))
        if g:
            out.append("GPU %s reserved for job %s, which preempted this job" % (_span(g), mark.get("by", "?")))
    for job, e in sorted(entries.items()):
        if job == res.job:
            continue
        if "_unreadable" in e:  # what it holds is unknown: it may hold what res asks for
            out.append("ledger entry %s cannot be read (%s)" % (layout.ledger_path(job), e["_unreadable"]))
            continue
        # Finished or stale when the controller looked, and unchanged since: free, unless its
        # units run now (the host is the arbiter: a look between two steps of a start erred).
        if res.free.get(job) is not None and res.free.get(job) == e.get("token") and not _runs(e):
            continue
        who = (e.get("owner") or {}).get("who", "?")
        g = sorted(gpus & set(e.get("gpus") or []))
        p = sorted(ports & set(e.get("ports") or []))
        if g:
            out.append("GPU %s taken by job %s (%s) since plan" % (_span(g), job, who))
        if p:
            out.append("port %s taken by job %s (%s) since plan" % (_span(p), job, who))
    return out


# The health states in which a GPU, or the host, is given no new work (host/health.py keeps
# them in layout.HEALTH_PATH, under this file's lock).
HEALTH_BLOCKING = ("quarantined", "draining", "testing")


def health_refusals(job: str, gpus: Any, units: Any, own: Any) -> list[str]:
    """Why job may not take `gpus` or start `units` here by the host's health record: a GPU
    quarantined or under test takes no new work; a host draining (or quarantined, or under
    test) none either. What a job runs now (its units live, on GPUs its entry holds) is not
    new work: it goes on, and its owner is told."""
    rec = read_entry(layout.HEALTH_PATH)
    if not isinstance(rec, dict) or "_unreadable" in rec:
        return []
    running = isinstance(own, dict) and "_unreadable" not in own and _runs(own)
    kept = set(own.get("gpus") or []) if running else set()
    out = []
    host = rec.get("host")
    if isinstance(host, dict) and host.get("state") in HEALTH_BLOCKING:
        new_units = set(units) - set(own.get("units") or []) if running else set(units)
        if set(gpus) - kept or new_units:
            out.append("this host is %s (%s): no new work is placed here" % (host["state"], host.get("reason") or "?"))
    marks = rec.get("gpus")
    for g in sorted(set(gpus) - kept):
        m = marks.get(str(g)) if isinstance(marks, dict) else None
        if isinstance(m, dict) and m.get("state") in HEALTH_BLOCKING:
            out.append("GPU %d is %s here (%s): no new work is placed on it" % (g, m["state"], m.get("reason") or "?"))
    return out


def start_refusals(job: str, units: Any, locked: bool = False, running: bool | None = None) -> list[str]:
    """Why the job's units may not start here now by the health record (health_refusals):
    a job none of whose units run (a rerun, a resume) starting on a GPU its entry holds that
    is quarantined since, or on a host draining. `locked`: the caller holds the ledger's
    lock (start_locked); `running`: whether they ran when the caller first asked (a restart
    has stopped them since)."""
    entry = read_entry(layout.ledger_path(job))
    ran = all(runs_now(u) for u in units) if running is None else running
    if not isinstance(entry, dict) or "_unreadable" in entry or ran:
        return []
    with _Unlocked() if locked else _Locked():
        return health_refusals(job, entry.get("gpus") or [], units, entry)


def start_locked(job: str, units: Any, running: bool, start: Any, errors: list[str]) -> list[str]:
    """A start (`start(units, errors)` starts the units) under the ledger's lock from its last look at
    the health record until its entry is marked started: a quarantine racing with it waits
    and then finds the GPU held by a running task (told as any held GPU's), and no task
    starts on a GPU quarantined before its start. Only once they run is the entry marked:
    "started" with units not running reads as ended (tenancy.judge), and a probe between
    the mark and the start gave its GPUs away. Why it may not start, if so."""
    with _Locked():
        refused = start_refusals(job, units, locked=True, running=running)
        if not refused:
            start(units, errors)
            mark_started(job, time.time(), locked=True)
        return refused


def reserve(res: Reservation, now: float) -> list[str]:
    """Compare-and-set: take what res asks for, or nothing (returning why not); what the
    host's health record keeps from new work is refused too (health_refusals)."""
    with _Locked():
        entries = read_all()
        why = conflicts(entries, res) + health_refusals(res.job, res.gpus, res.units, entries.get(res.job))
        if why:
            return why
        old = entries.get(res.job)
        old = old if isinstance(old, dict) and "_unreadable" not in old else {}
        entry = {
            "job": res.job,
            "owner": res.owner,
            "since": old.get("since", now),
            "updated": now,
            "token": _token(),
            "gpus": sorted(res.gpus),
            "gpu_uuids": list(res.gpu_uuids),
            "ports": sorted(res.ports),
            "units": sorted(res.units),
            "started": bool(old.get("started")) and old.get("units") == sorted(res.units),
            "priority": res.priority,
            "preemptible": res.preemptible,
            "submitted": res.submitted if res.submitted is not None else old.get("submitted", now),
        }
        dev = res.dev if res.dev is not None else old.get("dev")  # a dev session's terms
        if dev is not None:
            entry["dev"] = dev
        _write(res.job, entry)
        _take_from_preempted(res.job, entries, now)
    return []


def _take_from_preempted(job: str, entries: dict[str, Any], now: float) -> None:
    """The preemptor took the GPUs: the entries it preempted hold nothing any more (their
    mark stays, for status), so no job is both Preempted and holding GPUs."""
    for other, e in entries.items():
        mark = e.get("preempted")
        if other != job and isinstance(mark, dict) and mark.get("by") == job and (e.get("gpus") or e.get("ports")):
            e.update(gpus=[], gpu_uuids=[], ports=[], updated=now, token=_token())
            _write(other, e)


def renew(job: str, now: float) -> None:
    """The job's entry is still wanted (its apply lives): `updated` is now."""
    with _Locked():
        entry = read_entry(layout.ledger_path(job))
        if isinstance(entry, dict) and "_unreadable" not in entry:
            entry["updated"] = now
            _write(job, entry)


def renewing(job: str, every: float) -> Any:
    """Renew the job's entry every `every` seconds until the returned event is set (a
    thread: a long setup goes on meanwhile)."""
    import threading  # only setup needs it (start-up time of every other request)
    import time

    done = threading.Event()

    def loop() -> None:
        while not done.wait(every):
            try:
                renew(job, time.time())
            except OSError:
                pass  # the next tick tries again; the setup goes on

    threading.Thread(target=loop, daemon=True).start()
    return done


def mark_started(job: str, now: float, locked: bool = False) -> None:
    """The job's units were started here: its entry is no longer a bare reservation, nor
    held by a stop (its units hold what it needs while they run, as any job's), nor
    preempted. A start is a new run (a resume too), and the plan reserves nothing where the
    entry is unchanged (a host its own side stopped, `follows`; a preemptor that lapsed):
    an earlier run's mark left there would refuse the next preemptor and hide the job from
    every look (run/preempt.py), so it could never be preempted again."""
    path = layout.ledger_path(job)
    if not os.path.exists(path):
        return
    with _Unlocked() if locked else _Locked():
        entry = read_entry(path)
        if (
            isinstance(entry, dict)
            and "_unreadable" not in entry
            and (not entry.get("started") or entry.get("held") or "preempted" in entry)
        ):
            entry.pop("held", None)
            entry.pop("preempted", None)
            entry.update(started=True, updated=now, token=_token())
            _write(job, entry)


def hold(job: str, now: float) -> None:
    """`provision stop --hold`: the job's entry keeps its GPUs and ports though its units
    ended (tenancy.judge), until the next reserve() of the job replaces it."""
    path = layout.ledger_path(job)
    if not os.path.exists(path):
        return
    with _Locked():
        entry = read_entry(path)
        if isinstance(entry, dict) and "_unreadable" not in entry:
            entry.update(held=True, updated=now, token=_token())
            _write(job, entry)


def queue(
    job: str,
    owner: dict[str, Any],
    waiting: str | None,
    now: float,
    priority: int = 500,
    submitted: Any = None,
    gpus: int = 1,
) -> list[str]:
    """`apply --queue`: mark the job's entry as waiting, and for what (an entry that holds
    nothing when the job has none here), so `provision jobs` shows the queue; waiting None
    takes the mark away (and an entry that only held it). The mark carries the waiting
    work's priority and submission time: other applies order themselves by them."""
    path = layout.ledger_path(job)
    if waiting is None and not os.path.exists(path):
        return []
    with _Locked():
        entry = read_entry(path)
        if not isinstance(entry, dict) or "_unreadable" in entry:
            if waiting is None or entry is not None:  # an unreadable entry is left as it is
                return []
            entry = {"job": job, "owner": owner, "since": now, "gpus": [], "ports": [], "units": [], "started": False}
        if waiting is not None:
            since = (entry.get("queued") or {}).get("since", now)
            entry["queued"] = {"since": since, "waiting_for": waiting, "gpus": gpus}
            entry["priority"] = priority
            entry["submitted"] = submitted if submitted is not None else entry.get("submitted", now)
        elif entry.pop("queued", None) is not None and not (entry.get("units") or entry.get("gpus")):
            os.unlink(path)
            return []
        # The token says what the entry holds changed (conflicts: "taken since plan"); a
        # queue mark holds nothing: a preempted job waiting to resume must not make its
        # preemptor's reservation of the GPUs it left fail as a lost race.
        entry.update(updated=now, token=entry.get("token") or _token())
        _write(job, entry)
    return []  # nothing to report: a failed write is the agent's fatal error


def set_dev(job: str, dev: dict[str, Any], lineage: str, now: float) -> list[str]:
    """A dev session's terms replaced (`--extend`), when its entry is there and is its
    owner's (the lineage of the state that applied it)."""
    path = layout.ledger_path(job)
    with _Locked():
        entry = read_entry(path)
        if not isinstance(entry, dict) or "_unreadable" in entry or "dev" not in entry:
            return ["no dev session %s here" % job]
        if (entry.get("owner") or {}).get("lineage") != lineage:
            return ["dev session %s here is another state's" % job]
        entry.update(dev=dev, updated=now)
        _write(job, entry)
    return []


def release(job: str) -> None:
    path = layout.ledger_path(job)
    if not os.path.exists(path):
        return
    with _Locked():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if not read_all():  # the last job here: leave nothing behind
            for p in (layout.LEDGER_LOCK, layout.LEDGER_DIR):
                try:
                    os.unlink(p) if p == layout.LEDGER_LOCK else os.rmdir(p)
                except OSError:
                    pass


# --------------------------------------------------------------------------- shared files


def other_owners(job: str, paths: Any) -> dict[str, dict[str, str]]:
    """path -> {other job: sha256 its manifest records} for the paths other jobs' manifests
    list: two jobs may push the same bytes to one path, and the host keeps who uses it this
    way (the last job to leave removes it)."""
    wanted = set(paths)
    out: dict[str, dict[str, str]] = {}
    if not wanted:
        return out
    try:
        jobs = sorted(os.listdir(layout.ETC))
    except OSError:
        return out
    for other in jobs:
        if other == job or not os.path.isfile(layout.manifest_path(other)):
            continue
        m = read_entry(layout.manifest_path(other))
        files = m.get("files") if isinstance(m, dict) else None
        if isinstance(files, dict):
            for path in wanted.intersection(files):
                rec = files[path]
                out.setdefault(path, {})[other] = rec.get("sha256", "") if isinstance(rec, dict) else ""
    return out


def remove_unowned(job: str, paths: Any, errors: list[str] | None = None) -> int:
    """Unlink paths no other job's manifest lists (the last job leaving a shared file removes
    it). Under the ledger's lock: an apply counting on a file another job pushed checks it is
    still there under the same lock (missing), so one of the two sees the other."""
    removed = 0
    if not paths:
        return removed
    # No ledger yet: no apply here has reached its write (reserve makes it), so none counts on
    # these files yet; its own check (missing) comes later and sees them gone.
    with _Locked() if os.path.isdir(layout.LEDGER_DIR) else _Unlocked():
        shared = other_owners(job, paths)
        for path in paths:
            if path in shared:
                continue
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                if errors is not None:
                    errors.append(path + ": is a directory, left in place")
    return removed


def missing(paths: Any) -> list[str]:
    """Of the shared files an apply did not write (its manifest, written first, lists them),
    those gone: the job that pushed them left meanwhile (remove_unowned)."""
    if not paths:
        return []
    with _Locked():
        return [p for p in paths if not os.path.lexists(p)]
