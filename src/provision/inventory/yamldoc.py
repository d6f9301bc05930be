"""The inventory's YAML as plain data, with the line of every key path, and the Checker
that validates it: each problem recorded as `FILE:LINE: key.path: what is wrong`, all of
them at once, instead of stopping at the first. Aliases and size are bounded (MAX_NODES):
a YAML bomb is refused, not expanded."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from typing import Any, cast

import yaml

from provision.core.encode import ENV_KEY
from provision.core.envnames import RESERVED_ENV

KeyPath = tuple[str | int, ...]  # a key path such as ("pools", "worker", "replicas")


class Doc:
    """Plain Python data from YAML plus the line of every key path (1-based)."""

    def __init__(self, data: Any, lines: dict[KeyPath, int]):
        self.data = data
        self.lines = lines


MAX_NODES = 1_000_000  # YAML values after alias expansion; a 1,000-host inventory has ~20,000


def compose(text: str, problems: list[tuple[KeyPath, str, int | None]]) -> Doc:  # noqa: C901  its nested builders: one branch per YAML node kind and per bound
    # The C loader when PyYAML has it: a 1,000-host inventory must load in well under a second.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    lines: dict[KeyPath, int] = {}
    # Aliases make the node graph a DAG (or a cycle, `&a [*a]`): refuse cycles and
    # exponential expansion as YAML errors instead of a RecursionError or a hang.
    active: set[int] = set()
    budget = [MAX_NODES]

    def build(n: yaml.Node, path: KeyPath) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise yaml.MarkedYAMLError(
                problem=f"more than {MAX_NODES:,} values once aliases are expanded", problem_mark=n.start_mark
            )
        if not isinstance(n, yaml.CollectionNode):
            return build_node(n, path)
        if id(n) in active:
            raise yaml.MarkedYAMLError(
                problem="recursive alias (an anchor used inside itself)", problem_mark=n.start_mark
            )
        active.add(id(n))
        try:
            return build_node(n, path)
        finally:
            active.discard(id(n))

    def build_node(n: yaml.Node, path: KeyPath) -> Any:
        lines.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for k_node, v_node in n.value:
                if k_node.tag == "tag:yaml.org,2002:merge":
                    problems.append((path, "YAML merge keys ('<<') are not supported", k_node.start_mark.line + 1))
                    continue
                key = build(k_node, path + ("<key>",))
                if not isinstance(key, (str, int)):
                    problems.append((path, f"keys must be strings, got {show_value(key)}", k_node.start_mark.line + 1))
                    continue
                key = str(key)
                if key in out:
                    problems.append(
                        (path + (key,), "duplicate key (YAML keeps only the last one)", k_node.start_mark.line + 1)
                    )
                lines[path + (key,)] = k_node.start_mark.line + 1
                out[key] = build(v_node, path + (key,))
            return out
        if isinstance(n, yaml.SequenceNode):
            return [build(item, path + (i,)) for i, item in enumerate(n.value)]
        return loader.construct_object(n)  # scalars: typed as YAML says

    try:
        node = loader.get_single_node()
        data = build(node, ()) if node is not None else None
    finally:
        loader.dispose()
    return Doc(data, lines)


def show_value(value: Any) -> str:
    """`got X` rendering: short, quoted for strings, never multi-line (the importers' too)."""
    if isinstance(value, dict):
        s = "a mapping"
    elif isinstance(value, list):
        s = "a list" if value else "an empty list"
    elif value is None:
        s = "nothing (null)"
    else:
        s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def show_values(values: Sequence[Any], few: int = 5) -> str:
    """A list of values in an error line: all of a short one, else the first few and the
    count (a parameter of 10,000 categories made a 69 KB line); each value capped as
    show_value caps it."""
    shown = [s if len(s) <= 60 else s[:57] + "..." for s in map(str, values[:few])]
    if len(values) <= few:
        return ", ".join(shown)
    return f"{', '.join(shown)}, ... ({len(values)} values)"


def dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # A key with a newline or other control character must not break the line.
            s = str(part) if str(part).isprintable() else repr(str(part))
            out += ("." if out else "") + s
    return out or "(top level)"


class Checker:
    """Type checks against the document that record problems instead of raising."""

    def __init__(self, doc: Doc, display: str):
        self.doc = doc
        self.display = display
        self.problems: list[tuple[int, int, str]] = []  # (line, seq, message) for stable order

    def add(self, path: KeyPath, message: str, line: int | None = None) -> None:
        if line is None:
            line = self._line(path)
        where = f"{self.display}:{line}" if line else self.display
        self.problems.append((line or 0, len(self.problems), f"{where}: {dotted(path)}: {message}"))

    def _line(self, path: KeyPath) -> int | None:
        while True:
            if path in self.doc.lines:
                return self.doc.lines[path]
            if not path:
                return None
            path = path[:-1]

    def keys(
        self, value: dict[str, Any], path: KeyPath, allowed: tuple[str, ...], required: tuple[str, ...] = ()
    ) -> None:
        for key in value:
            if key not in allowed:
                hint = difflib.get_close_matches(key, allowed, n=1)
                extra = f" (did you mean '{hint[0]}'?)" if hint else f" (allowed: {', '.join(allowed)})"
                self.add(path + (key,), f"unknown key{extra}")
        for key in required:
            if key not in value:
                self.add(path, f"missing required key '{key}'")

    def mapping(self, value: Any, path: KeyPath) -> dict[str, Any] | None:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.add(path, f"expected a mapping, got {show_value(value)}")
            return None
        return value

    def string(
        self, value: Any, path: KeyPath, *, pattern: re.Pattern[str] | None = None, what: str = ""
    ) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            self.add(path, f"expected a string, got {show_value(value)}")
            return None
        s = str(value)
        if "\x00" in s:
            self.add(path, f"NUL bytes are not allowed, got {show_value(s)}")
            return None
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            self.add(path, f"not valid Unicode text (lone surrogate escape), got {show_value(s)}")
            return None
        if pattern is not None and not pattern.fullmatch(s):
            self.add(path, f"expected {what}, got {show_value(s)}")
            return None
        return s

    def integer(self, value: Any, path: KeyPath, lo: int, hi: int | None = None) -> int | None:
        bound = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            self.add(path, f"expected {bound}, got {show_value(value)}")
            return None
        return value

    def number(self, value: Any, path: KeyPath, lo: float) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= lo:
            self.add(path, f"expected a number > {lo:g}, got {show_value(value)}")
            return None
        return float(value)

    def choice(self, value: Any, path: KeyPath, choices: tuple[str, ...]) -> str | None:
        if value not in choices:
            hint = difflib.get_close_matches(str(value), choices, n=1) if isinstance(value, str) else []
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            self.add(path, f"expected one of {', '.join(choices)}, got {show_value(value)}{extra}")
            return None
        return cast(str, value)  # equal to one of the choices

    def strings(
        self, value: Any, path: KeyPath, *, pattern: re.Pattern[str] | None = None, what: str = ""
    ) -> list[str] | None:
        if not isinstance(value, list):
            self.add(path, f"expected a list of strings, got {show_value(value)}")
            return None
        out = [self.string(v, path + (i,), pattern=pattern, what=what) for i, v in enumerate(value)]
        return None if any(v is None for v in out) else out  # type: ignore[return-value]

    def env(self, value: Any, path: KeyPath) -> tuple[tuple[str, str], ...] | None:
        m = self.mapping(value, path)
        if m is None:
            return None
        out = []
        for key, val in m.items():
            ok = True
            if not ENV_KEY.fullmatch(key):
                self.add(
                    path + (key,),
                    f"not a valid environment variable name (letters, digits, '_', not starting with a digit), got {show_value(key)}",
                )
                ok = False
            elif key in RESERVED_ENV:
                self.add(path + (key,), "is set by provision for every task (see cluster-env) and cannot be overridden")
                ok = False
            s = self.string(val, path + (key,))
            if ok and s is not None:
                out.append((key, s))
        return tuple(out)


def syntax_error(display: str, e: Exception, lang: str = "YAML") -> str:
    """`FILE:LINE: invalid YAML: what` (or JSON): the one wording of a document that does
    not parse, for every reader of YAML or JSON (the inventory, the importers' specs). `e`:
    one of SYNTAX_ERRORS; a RecursionError is a document nested too deeply to read."""
    if isinstance(e, RecursionError):
        return f"{display}: invalid {lang}: nested too deeply"
    if isinstance(e, json.JSONDecodeError):
        return f"{display}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})"
    mark = getattr(e, "problem_mark", None)
    where = f"{display}:{mark.line + 1}" if mark is not None else display
    problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
    return f"{where}: invalid {lang}: {problem}"


SYNTAX_ERRORS = (yaml.YAMLError, json.JSONDecodeError, RecursionError)  # what syntax_error words
