"""Inventories (shared/spec/interface.md format) for a sandbox's hosts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from provision.core.errors import ProvisionError

from .hosts import ACCELERATOR_TYPE, Sandbox

# First line of every inventory the sandbox writes: `sandbox up` overwrites only such files.
HEADER = "# provision sandbox inventory"


def host_entries(sandbox: Sandbox) -> list[dict[str, Any]]:
    out = []
    for h in sandbox.hosts:
        entry: dict[str, Any] = {
            "name": h.name,
            "address": h.ssh_host,
            "port": h.ssh_port,
            "cluster_address": h.cluster_address,
        }
        if h.gpus:
            entry["accelerators"] = {"type": ACCELERATOR_TYPE, "count": h.gpus}
        out.append(entry)
    return out


def example_pools(sandbox: Sandbox, command: list[str] | None = None) -> dict[str, Any]:
    """A small job that runs anywhere: a chief and one worker per remaining host, each
    printing its TF_CONFIG and sleeping a little."""
    command = command or ["/bin/sh", "-c", "echo $TF_CONFIG; sleep 5"]
    gpus = sandbox.gpus_per_host
    pools: dict[str, dict[str, Any]] = {"chief": {"replicas": 1, "command": list(command)}}
    if len(sandbox.hosts) > 1:
        pools["worker"] = {"replicas": len(sandbox.hosts) - 1, "command": list(command)}
    if gpus:
        for spec in pools.values():
            spec["accelerators"] = gpus
    return pools


def inventory_dict(
    sandbox: Sandbox,
    job: str = "demo",
    pools: dict[str, Any] | None = None,
    *,
    hosts: list[str] | None = None,
    ssh: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """An inventory for the sandbox's hosts (all, or those named in `hosts`).

    `pools` goes in as given (deep-copied); `extra` adds other top-level keys (env, files,
    tf_config, success, secret_env, ...); `ssh` overrides ssh defaults."""
    entries = host_entries(sandbox)
    if hosts is not None:
        unknown = set(hosts) - {e["name"] for e in entries}
        if unknown:
            raise ProvisionError(f"sandbox {sandbox.name!r} has no host {sorted(unknown)[0]!r}")
        entries = [e for e in entries if e["name"] in hosts]
    inv: dict[str, Any] = {
        "job": job,
        "ssh": {
            "user": sandbox.user,
            "identity_file": str(sandbox.key_path),
            "host_key_policy": "accept-new",
            "connect_timeout": 10,
            **(ssh or {}),
        },
        "hosts": entries,
    }
    if pools is not None:
        inv["pools"] = copy.deepcopy(pools)
    inv.update(copy.deepcopy(extra))
    return inv


def dump(inv: dict[str, Any], sandbox: Sandbox | None = None) -> str:
    lines = [HEADER]
    if sandbox is not None:
        lines += [
            f"# Hosts of sandbox {sandbox.name!r}: Docker containers with systemd and sshd,",
            "# SSH published on 127.0.0.1; cluster_address is each host's name on the",
            "# sandbox's Docker network. Edit the pools, then:",
            "#   provision validate THIS_FILE && provision apply THIS_FILE",
            f"# Remove the hosts with: provision sandbox down --name {sandbox.name}",
        ]
    return "\n".join(lines) + "\n" + yaml.safe_dump(inv, sort_keys=False, default_flow_style=False, width=100)


def write_inventory(
    sandbox: Sandbox,
    path: str | Path,
    job: str = "demo",
    pools: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Path:
    """Write `inventory_dict(...)` as YAML to `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(inventory_dict(sandbox, job, pools, **kwargs), sandbox))
    return path
