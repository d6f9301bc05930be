"""A first apply's guard on the host: is the host as a plan made without asking it presumed?

A first apply (the controller's state knows none of the job's hosts) plans from a presumed
answer instead of a probe, and sends the probe, the write and the start in one batch with
this guard first: the host answers the probe and refuses, writing nothing, unless nothing
of the job is here (no file it would write, no manifest, end marker, runs or setup mark, no
unit systemd has loaded, no drop-in for its units), nobody's ledger entry or health record
is here (no GPU held or quarantined), every program its tasks run is an executable file,
none of its ports is in use, systemd runs as PID 1, the GPUs presumed are here (as many, of
the model, none busy or failing), `files:` have room (and, when asked, the clock is the
controller's). Any of those would have changed the plan; the apply plans again for a host
that refuses.

The controller's side (run/firstapply.py) builds its presumed answer so that `refusals` of it
is empty: both read this module. Runs on the host (stdlib only; loaded when asked).
"""

from __future__ import annotations

import os

from . import layout
from . import protocol as P
from .agent import op_probe

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def never_loaded(state: Any) -> bool:
    """As core/lifecycle.never_loaded: systemd knows nothing of the unit."""
    return (
        isinstance(state, dict)
        and state.get("LoadState") == "not-found"
        and state.get("ActiveState") == "inactive"
        and state.get("SubState", "dead") == "dead"
    )


def refusals(rep: P.ProbeReport, req: P.ProbeRequest, ports: Any, now: float, skew: float) -> list[str]:  # noqa: C901  one test per thing a presumed plan takes for absent, in the report's order
    """Why the host is not as presumed ([] when it is). `now` 0: the clock is not compared."""
    out = []
    job = req.job
    for what, value in (
        ("the job's manifest", rep.manifest),
        ("the job's end marker", rep.lifecycle),
        ("the job's runs", rep.runs),
        ("a setup's mark", rep.setup_key),
    ):
        if value is not None:
            out.append("%s is here" % what)
    files = rep.files or {}
    for path in sorted(set(req.want) | set(req.paths)):
        if files.get(path) is not None:
            out.append("%s is here" % path)
    for path in req.programs:
        info = files.get(path)
        # As rules/programs: a symlink is taken as runnable (the probe does not follow it).
        if info is None or not (info.type == "symlink" or (info.type == "file" and (info.mode or 0) & 0o111)):
            out.append("%s is not an executable file here" % path)
    for unit, state in sorted((rep.units or {}).items()):
        if not never_loaded(state):
            out.append("systemd knows %s" % unit)
    if any(rep.exits.get(u) for u in rep.exits or {}):
        out.append("the job's tasks have exit records here")
    for path in rep.dropins or []:
        if any(layout.dropin_applies(path, u) for u in req.units):
            out.append("drop-in %s applies to the job's units" % path)
    if rep.ledger or rep.ledger_records or rep.ledger_units:
        out.append("the ledger holds %s" % (", ".join(sorted(rep.ledger or {})) or "entries"))
    if rep.health:
        out.append("the host has a health record")
    # `ports`: the job's ports a bind found in use (op_fresh), or, when the report lists
    # the listening ports, the job's ports, of which those listed are in use.
    taken = sorted(set(ports) & set(rep.listening if rep.listening is not None else ports))
    taken += sorted(int(p) for p in ((rep.checks or {}).get("ports") or {}))
    if taken:
        out.append("port %s in use" % ", ".join(str(p) for p in sorted(set(taken))))
    if not (rep.facts or {}).get("systemd_pid1"):
        out.append("systemd is not PID 1")
    if now and rep.now is not None and abs(rep.now - now) > skew:
        out.append("the clock is %.1f s off the controller's" % (rep.now - now))
    return ["%s: %s" % (job, w) for w in out]


def gpu_refusals(facts: Any, checks: Any, want: Any) -> list[str]:
    """Why the GPUs here are not those presumed (`want`: count, the model's words the names
    must hold, the memory each has within a tenth): as rules/preflight would fail them, and
    any compute process or health issue on any GPU (the plan asked would say so)."""
    if not want:
        return []
    gpus = [g for g in (facts or {}).get("gpus") or [] if isinstance(g, dict)]
    names = " ".join(str(g.get("name")) for g in gpus).lower()
    words = "".join(ch if ch.isalnum() else " " for ch in names).split()
    squashed = "".join(ch for ch in names if ch.isalnum())
    out = []
    if len(gpus) < want.get("count", 0):
        out.append(
            "%d GPUs here (nvidia-smi: %s), not %d" % (len(gpus), (facts or {}).get("nvidia_smi"), want["count"])
        )
    elif any(w not in words and w not in squashed for w in want.get("words") or []):
        out.append("the GPUs here are %s" % ", ".join(sorted({str(g.get("name")) for g in gpus})))
    mib, have = want.get("mib"), [g["memory_mib"] for g in gpus if isinstance(g.get("memory_mib"), int)]
    if mib and any(abs(m - mib) > 0.1 * mib for m in have):
        out.append("the GPUs here have %d MiB of memory" % min(have))
    c = (checks or {}).get("gpus")
    if isinstance(c, dict):
        if c.get("error") or c.get("apps_error"):
            out.append("the GPU check failed: %s" % (c.get("error") or c.get("apps_error")))
        if c.get("apps"):
            out.append("a compute process is on a GPU")
        if any(
            h.get("ecc_uncorrected") or h.get("retired_pending") or h.get("remap_pending")
            for h in c.get("health") or []
        ):
            out.append("a GPU has ECC errors or a retirement or remapping pending")
    return out


def room_refusals(room: Any) -> list[str]:
    """Where `files:` would not have room (their bytes and the margin beyond) on the file
    system holding the nearest existing directory of each destination."""
    need: dict[str, int] = {}
    for dest, n in room.get("need") or []:
        d = dest
        while not os.path.isdir(d) and d != "/":
            d = os.path.dirname(d)
        need[d] = need.get(d, 0) + int(n)
    out = []
    for d, n in sorted(need.items()):
        try:
            st = os.statvfs(d)
        except OSError:
            continue  # as the disk check: a path it cannot read is not judged
        free = st.f_bavail * st.f_frsize
        if free < n + int(room.get("margin") or 0):
            out.append("%d bytes free on %s, files: need %d and room beyond" % (free, d, n))
    return out


def completed(fresh: P.FreshReport, write: Any) -> Any:
    """The write after the guard, its reservation with the UUIDs of the GPUs it takes as
    the guard's probe found them (a plan made without asking knew their indices only)."""
    res = getattr(write, "reserve", None)
    gpus = ((fresh.probe.facts if fresh.probe else None) or {}).get("gpus") or []
    if res is None or not res.gpus or any(res.gpu_uuids):
        return write
    uuids = {g.get("index"): str(g.get("uuid") or "") for g in gpus if isinstance(g, dict)}
    return _replaced(write, reserve=_replaced(res, gpu_uuids=[uuids.get(g, "") for g in res.gpus]))


def _replaced(msg: Any, **changes: Any) -> Any:
    """dataclasses.replace, which the hosts' stand-in (host/standins.py) does not have."""
    names = type(msg).__dict__.get("__annotations__", {})
    return type(msg)(**{**{n: getattr(msg, n) for n in names}, **changes})


def in_use(ports: Any) -> list[int]:
    """The ports something has bound here, as a bind with SO_REUSEADDR tells (a listener's,
    not a closing connection's): microseconds, where reading /proc/net/tcp walks every
    socket of the kernel (~7 ms of a busy machine's CPU). _socket: the socket module's
    import costs more than the binds."""
    import _socket  # the C part only: the socket module's import (enum, selectors) costs more

    out = []
    for port in ports:
        for family, address in ((_socket.AF_INET6, "::"), (_socket.AF_INET, "0.0.0.0")):
            try:
                s = _socket.socket(family, _socket.SOCK_STREAM)
            except OSError:
                continue  # no IPv6 here: the IPv4 bind tells
            try:
                s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
                s.bind((address, int(port)))
            except OSError as e:
                if e.errno == 98:  # EADDRINUSE (EADDRNOTAVAIL, IPv6 off: the IPv4 bind tells)
                    out.append(int(port))
                    break
                continue
            finally:
                s.close()
            break  # bound: free (an IPv6 bind is dual-stack: IPv4 listeners conflict too)
    return out


def op_fresh(req: P.FreshRequest) -> P.FreshReport:
    """The guard: the probe asked (the controller leaves out the listening ports and the
    port check: the binds tell; a GPU host's GPU check stays), then why the host is not as
    presumed."""
    rep = op_probe(req.probe)
    why = refusals(rep, req.probe, in_use(req.ports), req.now, req.skew)
    why += ["%s: %s" % (req.job, w) for w in gpu_refusals(rep.facts, rep.checks, req.gpus)]
    why += ["%s: %s" % (req.job, w) for w in (room_refusals(req.room) if req.room else [])]
    return P.FreshReport(rep, why)
