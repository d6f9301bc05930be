"""Runs ON the host: what pre-flight checks read there (host side of checks.py), and the
network check. Stdlib only, like agent.py; sent with every agent call but compiled only
when a request needs it (bundle.LAZY), since compiling costs a host more than most ops.

Two readers must give the same answer: the Python agent (`probe_checks`, `interface`) and
the controller's fast probe, which reads the raw text probe.sh prints and hands it to the
same parsers below (`gpu_health`, `parse_apps`, `owner`, `port_owners`, `interface_of`).
tests/integration/test_probe.py holds the two equal on real hosts.

Probe checks (ProbeRequest.checks, a dict):
    gpus         the GPU query with health columns (GPU_FIELDS, one nvidia-smi run that also
                 gives the facts), then the compute processes (APPS_QUERY)
    gpu_timeout  seconds each nvidia-smi run may take
    ports        the job's ports here: who listens on each (pid, command, systemd unit, or
                 the PROVISION_JOB/PROVISION_TASK of a container task's process)
    disk         paths: free bytes of the file system holding each one that exists
    hypertune    [[python, PYTHONPATH or None], ...]: whether each imports cloudml-hypertune
                 (a study's trials report through it); the agent answers (io/probe.py)
    clock        the host's clock (the report's `now`)
"""

from __future__ import annotations

import os
import time

from . import layout, ledger
from . import protocol as P
from .hostfacts import NVIDIA_SMI_TIMEOUT, gpu_report
from .hostlib import dual_stack_listener, run, timed_out

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Runner = Callable[..., tuple[int, str, str]]

# The facts' query (hostfacts.NVIDIA_SMI's four columns first) with the health columns after.
GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "driver_version",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "utilization.gpu",
    "memory.used",  # last: probe.sh reads it as what follows the last ", "
)
GPU_QUERY = ("nvidia-smi", "--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits")
APPS_QUERY = (
    "nvidia-smi",
    "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
    "--format=csv,noheader,nounits",
)
ENV_KEYS = ("PROVISION_JOB", "PROVISION_TASK")
ENV_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
UNKNOWN_NAME = "does not resolve on this host"


# --------------------------------------------------------------------------- parsers (shared)


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _yes(text: str) -> bool | None:
    """nvidia-smi's Yes/No; None for [N/A], [Not Supported] and the like."""
    t = text.strip().lower()
    return True if t == "yes" else False if t == "no" else None


def gpu_health(out: str) -> list[dict[str, Any]]:
    """The health columns of GPU_QUERY's output, per GPU index."""
    health = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(GPU_FIELDS) or not parts[0].isdigit():
            continue
        health.append(
            {
                "index": int(parts[0]),
                "driver": parts[4],
                "ecc_uncorrected": _int(parts[5]),
                "retired_pending": _yes(parts[6]),
                "remap_pending": _yes(parts[7]),
                "memory_used_mib": _int(parts[9]),
            }
        )
    return health


def memory_in_use(out: str) -> bool:
    """Whether any GPU of GPU_QUERY's output has memory in use (or says nothing readable of
    it): a compute process always holds some (its CUDA context), so without any there is
    none to list and the second nvidia-smi run is saved. As probe.sh decides it."""
    return any(line.rsplit(", ", 1)[-1] != "0" for line in out.splitlines() if line)


def parse_apps(out: str) -> list[dict[str, Any]]:
    """APPS_QUERY's output: one entry per process on a GPU (a name may hold commas)."""
    apps = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0]:
            continue
        apps.append(
            {
                "gpu_uuid": parts[0],
                "pid": _int(parts[1]),
                "name": ", ".join(parts[2:-1]),
                "used_mib": _int(parts[-1]),
            }
        )
    return apps


def app_pids(apps: list[dict[str, Any]]) -> list[int]:
    return sorted({a["pid"] for a in apps if isinstance(a.get("pid"), int)})


def unit_of_cgroup(text: str) -> str | None:
    """The systemd service a process runs in, from /proc/PID/cgroup (the unified line, else
    systemd's own v1 hierarchy): the innermost path part that is a .service."""
    lines = text.splitlines()
    chosen = [ln for ln in lines if ln.startswith("0::")] or [ln for ln in lines if ":name=systemd:" in ln]
    for ln in chosen[:1]:
        for part in reversed(ln.split(":", 2)[-1].split("/")):
            if part.endswith(".service"):
                return part
    return None


def wants_env(cgroup: str) -> bool:
    """A process outside provision's units (a container task's, say) is asked for its
    PROVISION_JOB and PROVISION_TASK: docker passes them to the container's processes."""
    return "/" + layout.PREFIX not in cgroup


def env_pairs(lines: list[str]) -> dict[str, str]:
    """PROVISION_JOB=... and PROVISION_TASK=... entries (the first of each), as grep -o finds them."""
    out: dict[str, str] = {}
    for ln in lines:
        key, eq, value = ln.partition("=")
        if eq and key in ENV_KEYS and key not in out:
            n = 0
            while n < len(value) and value[n] in ENV_CHARS:
                n += 1
            out[key] = value[:n]
    return out


def owner(pid: int, comm: str, cgroup: str, env: dict[str, str]) -> dict[str, Any]:
    return {
        "pid": pid,
        "comm": comm.strip(),
        "unit": unit_of_cgroup(cgroup),
        "job": env.get("PROVISION_JOB") or None,
        "task": env.get("PROVISION_TASK") or None,
    }


def sockets_of(pairs: list[tuple[int, str]], ports: list[int]) -> list[tuple[int, str]]:
    """(port, socket inode) of the TCP listeners on `ports`, from every listener's (port, inode)."""
    want = set(ports)
    return [(port, inode) for port, inode in pairs if port in want and inode != "0"]


def port_owners(
    sockets: list[tuple[int, str]], fds: dict[str, list[int]], procs: dict[int, dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """port (as a string: a JSON key) → the processes that hold a listener on it. A listener
    whose process could not be found (gone meanwhile, another PID namespace) is {"pid": None}."""
    out: dict[str, list[dict[str, Any]]] = {}
    for port, inode in sockets:
        holders = out.setdefault(str(port), [])
        pids = sorted(set(fds.get(inode, [])))
        if not pids:
            unknown = {"pid": None, "comm": "", "unit": None, "job": None, "task": None}
            if unknown not in holders:
                holders.append(unknown)
        for pid in pids:
            o = procs.get(pid) or {"pid": pid, "comm": "", "unit": None, "job": None, "task": None}
            if o not in holders:
                holders.append(o)
    for k in out:
        out[k].sort(key=lambda o: (o["pid"] is None, o["pid"] or 0))
    return out


def interface_of(addresses: list[str], ip_code: int, ip_out: str) -> dict[str, Any]:
    """The interface that holds the first of `addresses` (the host's cluster address as
    resolved here) that one holds, from `ip -o addr show`."""
    if not addresses:
        return {"address": None, "name": None, "error": UNKNOWN_NAME}
    if ip_code != 0:
        why = "ip is not installed (iproute2)" if ip_code == 127 else "ip -o addr show: exit %d" % ip_code
        return {"address": addresses[0], "name": None, "error": why}
    held: dict[str, str] = {}
    for ln in ip_out.splitlines():
        w = ln.split()
        if len(w) > 3 and w[2] in ("inet", "inet6"):
            held.setdefault(w[3].split("/", 1)[0], w[1].split("@", 1)[0])
    for a in addresses:
        if a.split("%", 1)[0] in held:
            return {"address": a, "name": held[a.split("%", 1)[0]], "error": None}
    return {"address": addresses[0], "name": None, "error": None}


def getent_addresses(out: str) -> list[str]:
    """The addresses `getent ahosts NAME` prints, in its order, each once."""
    seen: list[str] = []
    for ln in out.splitlines():
        w = ln.split()
        if w and w[0] not in seen:
            seen.append(w[0])
    return seen


def disk_lines(lines: list[str]) -> dict[str, int]:
    """`stat -f -c "%a %S %n"` lines: path → bytes free to unprivileged users."""
    out = {}
    for ln in lines:
        w = ln.split(" ", 2)
        if len(w) == 3 and w[0].isdigit() and w[1].isdigit():
            out[w[2]] = int(w[0]) * int(w[1])
    return out


def gpu_error(code: int, out: str, err: str, program: str, timeout: float) -> str | None:
    """None when nvidia-smi answered, else why not (the facts' words)."""
    if code == 0:
        return None
    if code == 127:
        return "missing"
    if code == 124:
        return program + ": timed out after %ss" % timeout
    return err.strip() or out.strip() or "exit %d" % code


# --------------------------------------------------------------------------- the agent's readers


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def read_owner(pid: int) -> dict[str, Any] | None:
    comm = _read("/proc/%d/comm" % pid)
    cgroup = _read("/proc/%d/cgroup" % pid)
    if comm is None and cgroup is None:
        return None
    env: dict[str, str] = {}
    if wants_env(cgroup or ""):
        raw = _read("/proc/%d/environ" % pid)
        if raw:
            env = env_pairs(raw.split("\0"))
    return owner(pid, (comm or "").split("\n", 1)[0], cgroup or "", env)


def _fds(inodes: set[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    if not inodes:
        return out
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        d = "/proc/%s/fd" % name
        try:
            fds = os.listdir(d)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(d + "/" + fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                out.setdefault(link[8:-1], []).append(int(name))
    return out


def tpu_devices() -> list[str]:
    """The host's TPU chip devices: /dev/accel* (TPU v4 and later) or /dev/vfio/N (v5e and
    later through VFIO)."""
    out: list[str] = []
    where: list[tuple[str, Callable[[str], bool]]] = [
        ("/dev", lambda n: n.startswith("accel")),
        ("/dev/vfio", lambda n: n.isdigit()),
    ]
    for d, keep in where:
        try:
            out += [d + "/" + n for n in sorted(os.listdir(d)) if keep(n)]
        except OSError:
            pass
    return out


def device_users(devices: list[str]) -> dict[str, list[int]]:
    """device -> the pids that hold it open (every process's fds, as fuser reads them)."""
    wanted = set(devices)
    out: dict[str, list[int]] = {}
    if not wanted:
        return out
    for pid in (n for n in os.listdir("/proc") if n.isdigit()):
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            if target in wanted and int(pid) not in out.setdefault(target, []):
                out[target].append(int(pid))
    return out


def probe_checks(checks: dict[str, Any], facts: dict[str, Any] | None) -> dict[str, Any]:  # noqa: C901  one branch per check the probe may be asked for (gpus, tpu, ports, ...)
    """The checks part of the agent's probe report. With "gpus", runs GPU_QUERY and fills
    `facts` with what hostfacts.gpu_facts would (the shell probe reads both from one run)."""
    out: dict[str, Any] = {}
    pids: list[int] = []
    if checks.get("gpus"):
        timeout = checks.get("gpu_timeout") or NVIDIA_SMI_TIMEOUT
        code, so, se = run(list(GPU_QUERY), timeout=timeout)
        if facts is not None:
            facts.update(gpu_report(code, so, timed_out(GPU_QUERY[0], timeout) if code == 124 else se, GPU_FIELDS))
        gpus: dict[str, Any] = {"error": gpu_error(code, so, se, GPU_QUERY[0], timeout)}
        gpus["health"] = gpu_health(so) if code == 0 else []
        gpus["apps"] = None
        gpus["apps_error"] = None
        if code == 0 and not memory_in_use(so):
            gpus["apps"] = []
        elif code == 0:
            acode, aout, aerr = run(list(APPS_QUERY), timeout=timeout)
            gpus["apps_error"] = gpu_error(acode, aout, aerr, APPS_QUERY[0], timeout)
            gpus["apps"] = parse_apps(aout) if acode == 0 else []
            pids += app_pids(gpus["apps"])
        out["gpus"] = gpus
    users: dict[str, list[int]] = {}
    if checks.get("tpu"):
        users = device_users(tpu_devices())
        pids += [p for ps in users.values() for p in ps]
    sockets: list[tuple[int, str]] = []
    if checks.get("ports"):
        sockets = sockets_of(ledger.listen_pairs(), checks["ports"])
    fds = _fds({inode for _, inode in sockets})
    pids += [p for ps in fds.values() for p in ps]
    procs = {}
    for pid in sorted(set(pids)):
        o = read_owner(pid)
        if o is not None:
            procs[pid] = o
    if "gpus" in out and out["gpus"]["apps"]:
        for a in out["gpus"]["apps"]:
            a["owner"] = procs.get(a["pid"]) if isinstance(a.get("pid"), int) else None
    if checks.get("ports"):
        out["ports"] = port_owners(sockets, fds, procs)
    if checks.get("tpu"):  # device -> who holds it open
        out["tpu"] = {d: [procs.get(p) or {"pid": p} for p in ps] for d, ps in users.items()}
    if checks.get("disk"):
        free = {}
        for p in checks["disk"]:
            try:
                st = os.statvfs(p)
            except OSError:
                continue
            free[p] = st.f_bavail * st.f_frsize
        out["disk"] = free
    if checks.get("hypertune"):
        out["hypertune"] = [python_imports(str(py), pp, "hypertune") for py, pp in checks["hypertune"]]
    return out


IMPORT_TIMEOUT = 20  # seconds: a python's start and one import, on a loaded host


def python_imports(python: str, pythonpath: str | None, module: str) -> dict[str, Any]:
    """Whether `python` imports `module` (ok, the file it came from, or the error's last
    line), with the task's PYTHONPATH (none: unset, as a task's unit has it)."""
    env = ["env", f"PYTHONPATH={pythonpath}"] if pythonpath else ["env", "-u", "PYTHONPATH"]
    code, so, se = run([*env, python, "-c", f"import {module}; print({module}.__file__)"], timeout=IMPORT_TIMEOUT)
    out: dict[str, Any] = {"python": python, "pythonpath": pythonpath, "ok": code == 0}
    if code == 0:
        out["file"] = so.strip()
    elif code == 124:
        out["error"] = timed_out(python, IMPORT_TIMEOUT)
    elif code == 127:  # env's "No such file or directory"
        out["error"] = f"{python}: not found"
    else:
        lines = [ln for ln in se.strip().splitlines() if ln.strip()]
        out["error"] = lines[-1].strip() if lines else f"exit {code}"
    return out


def interface(address: str) -> dict[str, Any]:
    """The interface holding this host's cluster address, resolved here as getent would."""
    socket = _socket_module()

    try:
        infos = socket.getaddrinfo(
            address, None, socket.AF_UNSPEC, 0, 0, socket.AI_V4MAPPED | socket.AI_ADDRCONFIG | socket.AI_CANONNAME
        )
    except (OSError, UnicodeError):
        infos = []
    addresses: list[str] = []
    for info in infos:
        a = str(info[4][0])
        if a not in addresses:
            addresses.append(a)
    code, out, _ = run(["ip", "-o", "addr", "show"], timeout=10)
    return interface_of(addresses, code, out)


# --------------------------------------------------------------------------- the network check

_WORDS = {
    "ECONNREFUSED": "connection refused: nothing listens there",
    "EHOSTUNREACH": "no route to host",
    "ENETUNREACH": "network unreachable",
    "ECONNRESET": "connection reset",
    "ETIMEDOUT": "timed out: a firewall?",
}


def _why(err: int) -> str:
    import errno  # lazy: only a failure is explained (import time)

    return _WORDS.get(errno.errorcode.get(err, ""), os.strerror(err))


def _socket_module() -> Any:
    """The C module under `socket`: the same calls, without the ~8 ms of a host's CPU that
    importing socket.py costs (its enums), more than a network check's own work. Its sockets
    have _accept() (a file descriptor) where socket.py's have accept()."""
    import _socket  # not socket.py: its import time (see above)

    return _socket


def _accept(listener: Any) -> Any:
    fd, _ = listener._accept()
    return _socket_module().socket(fileno=fd)


def _listener(port: int) -> Any:
    """A listener on every address of the host (IPv6 and IPv4 where the host has both)."""
    s = dual_stack_listener(_socket_module(), port, 128)
    s.setblocking(False)
    return s


class _Dial:
    """One address to reach: resolved once, tried until it answers, is refused past the
    window, or an attempt times out."""

    def __init__(self, address: str, port: int):
        self.address, self.port = address, port
        self.addrs: list[Any] = []  # (family, sockaddr), in getaddrinfo's order
        self.sock: Any = None
        self.started = 0.0
        self.retry_at = 0.0
        self.last = 0  # errno of the last attempt
        self.result: str | None = None
        self.done = False


TIMED_OUT = "timed out: a firewall?"
# Connection attempts in flight at once from one host: every host of a big job dials all the
# others at the same moment, and a burst of hundreds of ARP and SYN packets at once loses
# some on a busy host (measured on 32 sandbox hosts sharing 2 cores).
IN_FLIGHT = 8


def op_netcheck(req: Any) -> Any:  # noqa: C901  one select loop serving listeners and dialers, on the host, stdlib only
    """Listen on req.listen, reach every address of req.dial, until every dial is settled and
    every expected connection came in and closed, or req.window seconds passed.

    A refused connection is tried again (the peer's listener may not be up yet: every host
    starts this at about the same time); an attempt with no answer within req.timeout is a
    failure (packets dropped: a firewall). Connections this check accepts are closed once
    the dialer closed its end, so the job's port is left without a TIME_WAIT of ours."""
    import errno  # lazy: only this check pays their import time
    import select

    socket = _socket_module()

    start = time.monotonic()
    deadline = start + req.window
    poller = select.poll()
    listeners: dict[int, Any] = {}  # fd → (port, socket)
    errors: dict[str, str] = {}
    for port in req.listen:
        try:
            s = _listener(port)
        except OSError as e:
            errors[str(port)] = e.strerror or str(e)
            continue
        listeners[s.fileno()] = (port, s)
        poller.register(s.fileno(), select.POLLIN)
    accepted: dict[str, int] = {str(p): 0 for p, _ in listeners.values()}
    expect = {str(p): n for p, n in req.expect.items() if str(p) in accepted}
    conns: dict[int, Any] = {}  # accepted connections still open
    dials = [_Dial(a, int(p)) for a, p in req.dial]
    by_fd: dict[int, _Dial] = {}
    for d in dials:
        try:
            infos = socket.getaddrinfo(d.address, d.port, socket.AF_UNSPEC, socket.SOCK_STREAM)
            d.addrs = [(i[0], i[4]) for i in infos]
        except (OSError, UnicodeError):
            pass
        if not d.addrs:
            d.result, d.done = "%s %s" % (d.address, UNKNOWN_NAME), True

    def close(d: _Dial) -> None:
        if d.sock is not None:
            by_fd.pop(d.sock.fileno(), None)
            try:
                poller.unregister(d.sock.fileno())
            except (KeyError, ValueError):
                pass
            d.sock.close()
            d.sock = None

    def attempt(d: _Dial) -> None:
        family, sockaddr = d.addrs[0]
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setblocking(False)
        d.sock, d.started = s, time.monotonic()
        rc = s.connect_ex(sockaddr)
        if rc in (0, errno.EINPROGRESS):
            by_fd[s.fileno()] = d
            poller.register(s.fileno(), select.POLLOUT)
        else:
            settle(d, rc)

    def settle(d: _Dial, err: int) -> None:
        close(d)
        d.last = err
        now = time.monotonic()
        if err == errno.ECONNREFUSED and now + 0.05 < deadline:
            d.retry_at = now + 0.05  # the peer's listener may not be up yet
            return
        if err != 0 and len(d.addrs) > 1:
            d.addrs = d.addrs[1:]  # the name's next address (IPv6 first, then IPv4, say)
            d.retry_at = now
            return
        d.result = None if err == 0 else _why(err)
        d.done = True

    def time_out(d: _Dial) -> None:
        close(d)
        d.last = errno.ETIMEDOUT
        if time.monotonic() + req.timeout <= deadline:
            d.retry_at = time.monotonic()  # once more while the window lasts: a loaded host is slow
            return
        d.result, d.done = TIMED_OUT, True

    while True:
        now = time.monotonic()
        flying = sum(1 for d in dials if d.sock is not None)
        for d in dials:
            if flying >= IN_FLIGHT:
                break
            if not d.done and d.sock is None and d.retry_at <= now:
                attempt(d)
                flying += d.sock is not None
        if all(d.done for d in dials) and not conns and all(accepted[p] >= n for p, n in expect.items()):
            break
        if now >= deadline:
            for d in dials:
                if not d.done:
                    close(d)
                    d.result, d.done = (_why(d.last) if d.last else TIMED_OUT), True
            break
        waits = [deadline - now]
        for d in dials:
            if not d.done and (d.sock is not None or flying < IN_FLIGHT):
                waits.append(d.retry_at - now if d.sock is None else d.started + req.timeout - now)
        for fd, _ev in poller.poll(max(0.0, min(waits)) * 1000 + 1):
            if fd in listeners:
                port, ls = listeners[fd]
                while True:
                    try:
                        c = _accept(ls)
                    except OSError:
                        break
                    accepted[str(port)] += 1
                    c.setblocking(False)
                    conns[c.fileno()] = c
                    poller.register(c.fileno(), select.POLLIN)
            elif fd in conns:
                c = conns[fd]
                try:
                    data = c.recv(4096)
                except OSError:
                    data = b""
                if not data:  # the dialer closed: close ours after it (no TIME_WAIT here)
                    poller.unregister(fd)
                    del conns[fd]
                    c.close()
            elif fd in by_fd:
                d = by_fd[fd]
                settle(d, d.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        # Only after the poll: a host too busy to run this loop for a while has its answers
        # waiting there, and an attempt is not timed out for that.
        now = time.monotonic()
        for d in dials:
            if not d.done and d.sock is not None and now - d.started >= req.timeout:
                time_out(d)
    for c in conns.values():
        c.close()
    for _, s in listeners.values():
        s.close()
    return P.NetcheckReport(
        results=[d.result for d in dials],
        listen_errors=errors,
        accepted=accepted,
        seconds=round(time.monotonic() - start, 3),
    )
