"""What a host is: OS, CPUs, memory, GPUs (nvidia-smi), TPU chips, systemd (the agent's
`facts`; the shell probe reads the same and io/probe.py parses it into the same report)."""

from __future__ import annotations

import os
import sys

from .hostlib import run

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing (and the re, collections, enum it imports) cost every request ~6 ms
    from collections.abc import Collection
    from typing import Any


def facts(only: Collection[str] | None = None) -> dict[str, Any]:
    """What the host reports (`provision facts`). With `only` (plan and apply), just what
    they check: systemd as PID 1 and the groups named, "gpus" and/or "tpu", so hosts that
    declare no accelerators run no nvidia-smi on every plan."""
    if only is not None:
        out: dict[str, Any] = {"systemd_pid1": os.path.isdir("/run/systemd/system")}
        if "gpus" in only:
            out.update(gpu_facts())
        if "tpu" in only:
            out["tpu_chips"] = tpu_chips()
        return out
    out = {
        "hostname": os.uname()[1],
        "kernel": os.uname()[2],
        "cpus": os.cpu_count(),
        "python": "%d.%d.%d" % sys.version_info[:3],
    }
    osr: dict[str, str] = {}
    try:
        with open("/etc/os-release") as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                osr[k] = v.strip('"')
    except OSError:
        pass
    out["os"] = osr.get("PRETTY_NAME", "unknown")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    out["memory_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    out["systemd_pid1"] = os.path.isdir("/run/systemd/system")
    code, so, _ = run(["systemctl", "--version"], timeout=10)
    out["systemd"] = so.splitlines()[0] if code == 0 and so else None
    out.update(gpu_facts())
    out["tpu_chips"] = tpu_chips()
    # Lazy, for its import time: only the full facts read the fabric (plan's and apply's do not).
    from . import topology

    out["fabric"] = topology.topology(len(out["gpus"]))
    out["docker"] = any(os.access(os.path.join(d, "docker"), os.X_OK) for d in ("/usr/bin", "/usr/local/bin"))
    return out


# Utilization and memory in use ride on the same call: no second nvidia-smi.
FIELDS = ("index", "uuid", "name", "memory.total", "utilization.gpu", "memory.used")
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=" + ",".join(FIELDS), "--format=csv,noheader,nounits")
NVIDIA_SMI_TIMEOUT = 20


def gpu_facts() -> dict[str, Any]:
    return gpu_report(*run(list(NVIDIA_SMI), timeout=NVIDIA_SMI_TIMEOUT))


def gpu_report(code: int, so: str, se: str, fields: tuple[str, ...] = FIELDS) -> dict[str, Any]:
    """nvidia-smi's answer as facts (the controller's fast probe reads it with this too).
    `fields`: the query's columns (the pre-flight query has more, in another order), whose
    first four are FIELDS' first four."""
    util, used = fields.index("utilization.gpu"), fields.index("memory.used")
    gpus = []
    out: dict[str, Any] = {}
    if code == 0:
        for line in so.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 4 and parts[0].isdigit():
                gpus.append(
                    {
                        "index": int(parts[0]),
                        "uuid": parts[1],
                        "name": parts[2],
                        "memory_mib": _int(parts[3]),
                        # "[N/A]" where a GPU does not say (MIG, some vGPUs): None.
                        "util_pct": _int(parts[util]) if len(parts) > util else None,
                        "memory_used_mib": _int(parts[used]) if len(parts) > used else None,
                    }
                )
        out["nvidia_smi"] = "ok"
    else:
        out["nvidia_smi"] = "missing" if code == 127 else (se.strip() or so.strip() or "exit %d" % code)
    out["gpus"] = gpus
    return out


def _int(s: str) -> int | None:
    return int(s) if s.isdigit() and len(s) < 10 else None


def tpu_chips() -> int:
    try:
        return len([d for d in os.listdir("/dev") if d.startswith("accel") and d[5:].isdigit()])
    except OSError:
        return 0
