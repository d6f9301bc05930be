"""The inventory's keys for a run that survives its hardware: `progress:`, `recovery:`,
`spares:` and a pool's `elastic:` (core/recovery.py), checked as the rest
of the inventory is: every problem one line naming its place (docs/recovery.md)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from provision.core.model import Host, Pool
from provision.core.recovery import (
    DEFAULT_COPY_MAX,
    DEFAULT_COPY_RATE,
    DEFAULT_MAX,
    DEFAULT_WINDOW_S,
    ROUND_S,
    CheckpointSpec,
    CopyTo,
    Elastic,
    ProgressSpec,
    RecoverySpec,
)
from provision.inventory.scheduling import duration_s
from provision.inventory.yamldoc import Checker, KeyPath, show_value

KEYS = ("progress", "recovery", "spares", "checkpoint")
MAX_RECOVERIES = 1000
MAX_TIMEOUT_S = 7 * 24 * 3600
SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kKMGT]i?B|B)?$")
UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
}
MAX_COPY_BYTES = 1 << 40
# The programs that are torchrun: its own name, or Python running its module.
TORCHRUN = re.compile(r"(^|/)torchrun$")


def progress(c: Checker, value: Any) -> ProgressSpec | None:
    path = ("progress",)
    if value is None:
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, ("timeout",), required=("timeout",))
    raw = m.get("timeout")
    if raw is None or raw == "auto":
        return ProgressSpec(None)
    t = duration_s(raw)
    if t is None or t > MAX_TIMEOUT_S:
        c.add(path + ("timeout",), f"expected a duration up to 168h (600, 10m, 1h) or auto, got {show_value(raw)}")
        return None
    if t < ROUND_S:
        c.add(
            path + ("timeout",),
            f"{show_value(raw)} is shorter than the service's round ({ROUND_S:g} s): a job would be judged "
            f"hung between two looks; give at least {ROUND_S:g}s, or auto",
        )
        return None
    return ProgressSpec(t)


def recovery(c: Checker, value: Any) -> RecoverySpec | None:
    path = ("recovery",)
    if value is None:
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, ("max", "window"))
    most = c.integer(m.get("max", DEFAULT_MAX), path + ("max",), 0, MAX_RECOVERIES)
    window = DEFAULT_WINDOW_S
    if "window" in m:
        w = duration_s(m["window"])
        if w is None or w <= 0:
            c.add(path + ("window",), f"expected a duration such as 24h, 90m or 3600, got {show_value(m['window'])}")
        else:
            window = w
    return RecoverySpec(DEFAULT_MAX if most is None else most, window)


def spares(c: Checker, value: Any, hosts: Sequence[Host], pools: Sequence[Pool]) -> tuple[str, ...]:
    """`spares: [gpu-9]`: hosts of `hosts:` no pool names (placement keeps them for a
    replica that needs one)."""
    path = ("spares",)
    if value is None:
        return ()
    listed = c.strings(value, path)
    if listed is None:
        return ()
    names = {h.name for h in hosts}
    out: list[str] = []
    for i, n in enumerate(listed):
        used = [p.role for p in pools if p.host_names is not None and n in p.host_names]
        if n not in names:
            c.add(path + (i,), f"no host named {n!r} in hosts: a spare is one of the inventory's hosts")
        elif used:
            c.add(
                path + (i,),
                f"{n} is named by pools.{used[0]}.hosts: a spare waits for a replica that needs one, "
                "no pool is placed on it by name",
            )
        elif n in out:
            c.add(path + (i,), f"{n} is listed twice")
        else:
            out.append(n)
    return tuple(out)


def elastic(
    c: Checker, value: Any, path: KeyPath, command: Sequence[str] | None, replicas: int | None
) -> Elastic | None:
    """`elastic: {min: 2, max: 4}` on a pool whose command is torchrun (provision gives it
    the rendezvous: --nnodes=MIN:MAX, its endpoint and id)."""
    if value is None:
        return None
    p = path + ("elastic",)
    m = c.mapping(value, p)
    if m is None:
        return None
    c.keys(m, p, ("min", "max"), required=("min", "max"))
    lo = c.integer(m.get("min"), p + ("min",), 1, 10000) if "min" in m else None
    hi = c.integer(m.get("max"), p + ("max",), 1, 10000) if "max" in m else None
    if not command or not torchrun(command):
        got = show_value(command[0]) if command else "an image"
        c.add(
            p,
            f"runs under PyTorch's elastic engine (torchrun's c10d rendezvous), so the pool's command must be "
            f"torchrun (or python -m torch.distributed.run), got {got}",
        )
        return None
    if lo is None or hi is None:
        return None
    if path[-1] != "worker":
        c.add(p, "only the worker pool can be elastic: the chief hosts the rendezvous, and its size is fixed")
        return None
    if lo > hi:
        c.add(p, f"min {lo} is more than max {hi}")
        return None
    if replicas is not None and not lo <= replicas <= hi:
        c.add(p, f"replicas ({replicas}) must be from min {lo} to max {hi}: provision places that many nodes")
        return None
    return Elastic(lo, hi)


def torchrun(command: Sequence[str]) -> bool:
    """Is the command torchrun: `torchrun ...`, `/opt/venv/bin/torchrun ...`, or
    `python -m torch.distributed.run ...`?"""
    if TORCHRUN.search(command[0]):
        return True
    return (
        len(command) >= 3
        and "python" in command[0].rsplit("/", 1)[-1]
        and list(command[1:3])
        == [
            "-m",
            "torch.distributed.run",
        ]
    )


def size_bytes(value: Any) -> int | None:
    """`2GiB`, `500MB`, `1048576`: bytes (None: not a size)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    m = SIZE.match(str(value).strip())
    if m is None:
        return None
    n = int(float(m.group(1)) * UNITS[(m.group(2) or "B").replace("k", "K")])
    return n if n > 0 else None


def checkpoint(c: Checker, value: Any, outputs: str | None, rec: RecoverySpec | None) -> CheckpointSpec | None:
    """`checkpoint: {copy: controller | peer | shared | none, max_size: 2GiB, bandwidth: 20MB/s}`:
    where the newest complete checkpoint is kept off its host (docs/recovery.md). A job with
    `recovery:` and `outputs:` has it copied to the controller unless it says otherwise."""
    path = ("checkpoint",)
    if value is None:
        return CheckpointSpec() if rec is not None and outputs is not None else None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, ("copy", "max_size", "bandwidth"))
    copy = c.choice(m.get("copy", CopyTo.CONTROLLER.value), path + ("copy",), tuple(k.value for k in CopyTo))
    most = DEFAULT_COPY_MAX
    if "max_size" in m:
        n = size_bytes(m["max_size"])
        if n is None or n > MAX_COPY_BYTES:
            c.add(
                path + ("max_size",),
                f"expected a size up to 1TiB (2GiB, 500MB, bytes), got {show_value(m['max_size'])}",
            )
        else:
            most = n
    rate = DEFAULT_COPY_RATE
    if "bandwidth" in m:
        raw = m["bandwidth"]
        n = size_bytes(raw[:-2] if isinstance(raw, str) and raw.endswith("/s") else raw)
        if n is None or n < 1000:
            c.add(
                path + ("bandwidth",),
                f"expected bytes a second of at least 1kB/s (20MB/s, 1MiB/s), got {show_value(raw)}",
            )
        else:
            rate = n
    if copy is None:
        return None
    if outputs is None and copy in (CopyTo.CONTROLLER.value, CopyTo.PEER.value):
        c.add(path + ("copy",), "copies AIP_CHECKPOINT_DIR, which is below `outputs:`: the job has none")
        return None
    return CheckpointSpec(CopyTo(copy), most, rate)
