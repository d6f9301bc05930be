"""The trials of a study report through cloudml-hypertune: does each host's python import it?
(`provision check` of a study: preflight.py asks and judges with these; host/hostcheck.py
answers.) A bare host has no cloudml-hypertune, and hosts often reach no package index: a
trial would fail at once with "No module named hypertune". Pure.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from provision.core.model import Host, Inventory

PYTHON = re.compile(r"^python[0-9.]*$")
HYPERTUNE_FIX = (
    "the trials report {metric} through cloudml-hypertune (`import hypertune`): install it in setup: "
    "(`pip install cloudml-hypertune`); a host with no package index: push its wheel with files: and "
    "install that in setup:, or put the package on PYTHONPATH (docs/tuning.md#hypertune-on-the-hosts); "
    "or give tune.metric.regex to read {metric} from the chief's log"
)


def brings_hypertune(inv: Inventory) -> str | None:
    """What in the inventory brings cloudml-hypertune to the hosts itself (a setup: line, a
    pushed wheel or package), in words; None: the hosts must have it."""
    setups = [inv.setup, *(p.setup for p in inv.pools)]
    for st in setups:
        for line in st.commands if st is not None else ():
            if "hypertune" in line:
                return f"setup: installs it ({line.strip()[:80]})"
    for f in inv.files:
        if "hypertune" in f.src.name.lower():
            return f"files: pushes {f.src.name} to {f.dest}"
        # A directory holding the package (pip install --target DIR), for PYTHONPATH: read
        # here, as plan reads the files it pushes.
        if f.is_dir and (f.src / "hypertune" / "__init__.py").is_file():
            return f"files: pushes {f.src.name}/hypertune/ to {f.dest}"
    return None


def pythons(inv: Inventory, host: Host) -> list[list[str | None]]:
    """For a study (`tune:` without metric.regex; the study's own inventory, not a trial's
    of `provision tune`, whose start this would slow): [python, PYTHONPATH] of each pool a
    trial's task could run in here (eligible, with the accelerators it needs: a trial goes
    wherever there is room, not where the plain job's placement puts the pool) whose command
    starts with a python, whose trials must import hypertune. Empty when the inventory
    brings the library itself (brings_hypertune)."""
    tune = inv.tune
    if tune is None or tune.metric.regex is not None or inv.tf_config.trial is not None:
        return []
    if brings_hypertune(inv) is not None:
        return []
    env = dict(inv.env)
    out: list[list[str | None]] = []
    for pool in sorted(inv.pools, key=lambda p: p.role):
        if not pool.eligible(host) or host.accelerator_count < pool.accelerators:
            continue
        if pool.image or not pool.command or not PYTHON.match(posixpath.basename(pool.command[0])):
            continue
        item: list[str | None] = [pool.command[0], {**env, **dict(pool.env)}.get("PYTHONPATH")]
        if item not in out:
            out.append(item)
    return out


def judge(answers: Any, inv: Inventory) -> list[tuple[bool, str]]:
    """(ok, in words) per python the host was asked about; when none was asked because the
    inventory brings the library itself, that."""
    if inv.tune is None:
        return []
    if answers is None and inv.tune.metric.regex is None and inv.tf_config.trial is None:
        brought = brings_hypertune(inv)
        return [(True, f"cloudml-hypertune: {brought}")] if brought else []
    if not isinstance(answers, list):
        return []
    out = []
    for a in answers:
        if not isinstance(a, dict):
            continue
        python, path = str(a.get("python")), a.get("pythonpath")
        on = f" (PYTHONPATH={path})" if path else ""
        if a.get("ok"):
            where = f": {a['file']}" if a.get("file") else ""
            out.append((True, f"{python}{on} imports hypertune{where}"))
        else:
            why = str(a.get("error") or "it failed")
            fix = HYPERTUNE_FIX.format(metric=inv.tune.metric.name)
            out.append((False, f"{python}{on} cannot import hypertune ({why}): {fix}"))
    return out
