"""The inventory's `job_spec:` key: the service's own job description, kept as JSON."""

from __future__ import annotations

import math
from typing import Any

from provision.inventory.yamldoc import Checker, KeyPath, show_value


def job_spec_of(c: Checker, value: Any) -> dict[str, object] | None:
    """`job_spec:` the service's job description, any mapping of JSON values.

    It is written as TF_CONFIG's and CLUSTER_SPEC's `job`, so it must be JSON: YAML's
    dates, binary values and NaN are refused with their key path.
    """
    path: KeyPath = ("job_spec",)
    if value is None:
        return None
    if not isinstance(value, dict):
        c.add(
            path,
            f"expected a mapping (the service's job description, such as a CustomJobSpec), got {show_value(value)}",
        )
        return None
    stack: list[tuple[KeyPath, Any]] = [(path, value)]
    while stack:  # not recursive: a deeply nested spec must not hit the recursion limit
        where, v = stack.pop()
        if isinstance(v, dict):
            stack += [(where + (k,), x) for k, x in reversed(list(v.items()))]
        elif isinstance(v, list):
            stack += [(where + (i,), x) for i, x in reversed(list(enumerate(v)))]
        elif not (v is None or isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v))):
            c.add(
                where, f"expected a JSON value (string, number, true/false, null, list or mapping), got {show_value(v)}"
            )
            return None
    return value
