"""The inventory's `placement:` key, checked as the rest of the inventory is: every problem
one line naming its place.

    placement:
      prefer_same: [nvlink_domain, switch]   # host labels; the first counts most
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from provision.core.model import Host, Preference
from provision.inventory.yamldoc import Checker, show_value

KEYS = ("placement",)
LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})?$")  # inventory.LABEL_VALUE: a label's name
MAX_LABELS = 8


def placement(c: Checker, value: Any, hosts: Sequence[Host]) -> Preference:
    path = ("placement",)
    m = c.mapping(value, path)
    if not m:
        return Preference()
    c.keys(m, path, ("prefer_same",))
    raw = m.get("prefer_same")
    if raw is None:
        return Preference()
    names = c.strings(raw, path + ("prefer_same",), pattern=LABEL, what="a host label's name") or []
    if len(names) > MAX_LABELS:
        c.add(path + ("prefer_same",), f"at most {MAX_LABELS} labels, got {len(names)}")
        return Preference()
    out: list[str] = []
    known = {k for h in hosts for k, _ in h.labels}
    for i, name in enumerate(names):
        if name in out:
            c.add(path + ("prefer_same", i), f"{show_value(name)} is listed twice")
        elif hosts and name not in known:
            c.add(path + ("prefer_same", i), f"no host has the label {show_value(name)}")
        else:
            out.append(name)
    return Preference(tuple(out))
