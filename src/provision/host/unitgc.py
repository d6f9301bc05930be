"""Whether destroy must make systemd read its unit files again (a daemon-reload).

A reload takes PID 1 0.1-0.5 s of a host's CPU, and every systemctl there waits meanwhile:
a study's next trial starting on the host, another trial's wait on its task. Most of the
time it is not needed: systemd lets go of a unit that stopped and nothing refers to, and
systemd 246+ looks on disk again for a unit it does not hold when the unit is named, so a
unit whose files destroy removed is "not-found" from then on, and a later apply of it loads
it anew. Only a unit systemd still holds (its old definition in memory) needs the reload.

Stdlib only; shipped to hosts (bundle.LAZY): imported by destroy alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import layout
from .hostlib import run


def needs_reload(manifest: dict[str, Any], units: Sequence[str]) -> bool:
    """After destroy removed the job's files and reset its units: True unless every unit
    whose file or drop-in went (a stopped one's file too) is unknown to systemd now."""
    names = _units_changed(manifest, units)
    return names is None or not _forgotten(names)


# Where systemd reads unit files, drop-ins and its own configuration: a file there that is
# not one of provision's unit files (a `replace: true` push, its original put back by
# destroy) may change what systemd would load: reload.
SYSTEMD_ROOTS = ("/etc/systemd", "/run/systemd", "/usr/lib/systemd", "/lib/systemd", "/usr/local/lib/systemd")


def _units_changed(manifest: dict[str, Any], units: Sequence[str]) -> list[str] | None:
    """The units whose files (or drop-ins) destroy took away, and the stopped units whose
    file is gone; None when that cannot be told (no manifest lists the files, or a file
    systemd reads that is not provision's own unit file)."""
    files = manifest.get("files") or {}
    if not isinstance(files, dict) or not files:
        return None
    # A stopped unit whose file is still there (a setup another job or the study holds)
    # did not change: systemd may keep it.
    names = {u for u in units if not os.path.lexists(layout.SYSTEMD_DIR + "/" + u)}
    for path in files:
        d, base = os.path.split(path)
        owner = layout.dropin_unit(path)
        if d == layout.SYSTEMD_DIR and base.startswith(layout.PREFIX):
            if not os.path.lexists(path):  # else kept for another job (the directory is provision's own)
                names.add(base)
        elif d.startswith(layout.SYSTEMD_DIR + "/") and d.endswith(".wants") and base.startswith(layout.PREFIX):
            continue  # a boot's link: read at boot only (agent.start_at_boot)
        elif owner is not None and not owner.endswith("-." + owner.rsplit(".", 1)[-1]) and not os.path.lexists(path):
            names.add(owner)
        elif owner is not None or any(path.startswith(r + "/") for r in SYSTEMD_ROOTS):
            return None  # a drop-in kept or put back, one for a prefix, another file systemd reads
    return sorted(names)


def _forgotten(units: Sequence[str]) -> bool:
    """Whether systemd holds none of `units`: each is "not-found" (naming it made systemd
    look on disk, where its files are gone)."""
    if not units:
        return True
    code, out, _ = run(["systemctl", "show", "--property=LoadState", "--value", "--"] + list(units), timeout=60)
    states = [line.strip() for line in out.splitlines() if line.strip()]
    return code == 0 and len(states) == len(units) and all(s == "not-found" for s in states)
