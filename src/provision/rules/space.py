"""A search space's points, when it has finitely many (integer, discrete and categorical
parameters only). Pure.

A point is the parameters a trial gets: a conditional parameter is in it only when its parent
took one of its values, so `{optimizer: adam}` and `{optimizer: sgd, momentum: 0.9}` are two
points, as the trials' command lines differ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from provision.core.tuning import Param, ParamType, Value

Point = tuple[tuple[str, Value], ...]  # (name, value) by name: comparable, hashable


def point(values: Mapping[str, Value]) -> Point:
    return tuple(sorted(values.items()))


def finite_points(params: Sequence[Param], limit: int) -> list[dict[str, Value]] | None:
    """Every point of the space, in `params` order; None when a parameter is a double (no
    end of points) or there are more than `limit` points."""
    if any(p.type is ParamType.DOUBLE for p in params):
        return None
    out: list[dict[str, Value]] = [{}]
    for p in params:
        grown: list[dict[str, Value]] = []
        for pt in out:
            if p.parent is not None and pt.get(p.parent) not in p.parent_values:
                grown.append(pt)
                continue
            grown.extend({**pt, p.name: v} for v in p.grid())
            if len(grown) > limit:
                return None
        out = grown
    return out


def space_size(params: Sequence[Param], limit: int) -> int | None:
    """How many points the space has; None: more than `limit` (or no end)."""
    points = finite_points(params, limit)
    return len(points) if points is not None else None


def grid_size(params: Sequence[Param]) -> int:
    """The points a grid search walks: every combination (a conditional parameter's values
    included whatever its parent's)."""
    return math.prod(len(p.grid()) for p in params)
