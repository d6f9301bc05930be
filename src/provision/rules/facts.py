"""What a host reports about itself, checked against what the inventory declares. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from provision.core.model import Host


def mismatches(host: Host, facts: Mapping[str, Any]) -> list[str]:
    """Problems that must stop an apply before anything is written to any host."""
    out = []
    if not facts.get("systemd_pid1"):
        out.append("systemd is not running as PID 1 (provision runs tasks as systemd units)")
    acc = host.accelerators
    if acc and acc.count:
        if acc.kind == "gpu":
            found = len(facts.get("gpus", []))
            if facts.get("nvidia_smi") not in ("ok", None) and not found:
                out.append(
                    f"inventory declares {acc.count} {acc.type}, but nvidia-smi failed: {facts.get('nvidia_smi')}"
                )
            elif found < acc.count:
                out.append(f"inventory declares {acc.count} {acc.type}, but nvidia-smi reports {found}")
        else:
            found = int(facts.get("tpu_chips", 0))
            if found < acc.count:
                out.append(
                    f"inventory declares {acc.count} {acc.type} chip{'' if acc.count == 1 else 's'}, "
                    f"but the host has {found} (/dev/accel*)"
                )
    return out


def needed(host: Host | None) -> list[str]:
    """The fact groups `mismatches` reads besides systemd: the agent's `facts_only`."""
    acc = host.accelerators if host is not None else None
    if not (acc and acc.count):
        return []
    return ["gpus"] if acc.kind == "gpu" else ["tpu"]


def summary_row(name: str, facts: Mapping[str, Any]) -> dict[str, Any]:
    """A host's facts for `facts --json` (absent values as null) and its table row."""
    gpus = facts.get("gpus", [])
    names = sorted({g["name"] for g in gpus})
    return {
        "host": name,
        "os": facts.get("os"),
        "cpus": facts.get("cpus"),
        "memory_gib": round(facts.get("memory_bytes", 0) / 2**30, 1),
        "gpus": len(gpus),
        "gpu_model": ", ".join(names) if names else None,
        "gpu_uuids": [g["uuid"] for g in gpus],
        "tpu_chips": facts.get("tpu_chips", 0),
        "systemd": facts["systemd"].split(" (")[0] if facts.get("systemd") else None,
        "python": facts.get("python"),
    }
