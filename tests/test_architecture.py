"""The house's rules, read from the source's AST (no tool installed by hand):

- packages by layer: a module imports only from its own package and the layers below it;
- no import circle between provision's modules, counting the imports inside functions too
  (a function-local import hides a circle from Python, not from the design);
- every import inside a function says why on its line or the line before; one of a
  provision module names the start-up time it saves (else it belongs at the top);
- size: at most 6 modules at the package's top, none over 650 lines, at most 10 functions
  over 60 lines.

docs/architecture.md explains the layers; this file is what keeps them so.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "provision"

# Lower layers first. A module may import its own package and any layer of lower rank.
LAYERS = {
    "host": 0,  # runs on the hosts too: stdlib only, imports nothing of provision outside host/
    "core": 1,
    "placement": 2,  # where every task runs: a pure function of core's model
    "inventory": 3,  # the inventory as written: parsed, validated (asks placement whether it fits)
    "render": 4,  # what each host gets for the placed job: env, files
    "rules": 5,
    "io": 6,
    "run": 7,
    "importers": 7,
    "sandbox": 7,
    "web": 8,  # the dashboard: reads what run/ and io/ return, as cli/ does
    "serve": 9,  # the service: drives handed-over work by calling run/; hosts web/
    "cli": 10,
}
MAX_TOP_MODULES = 6
MAX_MODULE_LINES = 650
LONG_FUNCTION = 60
MAX_LONG_FUNCTIONS = 10
# Words a lazy import's comment uses to say why it is lazy.
LAZY_REASONS = ("start-up", "startup", "import time")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the provision module imported
    line: int
    local: bool  # inside a function
    comment: str  # the comment on the line or the lines right above


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(mod: str, node: ast.ImportFrom, is_package: bool, known: set[str]) -> list[str]:
    if node.level:
        base = mod.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    if not stem.startswith("provision"):
        return []
    out = []
    for alias in node.names:
        sub = f"{stem}.{alias.name}"
        out.append(sub if sub in known else stem)
    return out


def _comment(lines: list[str], lineno: int) -> str:
    """The comment on the line or the line before: that line's own comment, or the block of
    comment lines right above it. Imports written one after the other share one comment."""
    text = []
    i = lineno - 1
    while True:
        if "#" in lines[i]:
            text.append(lines[i].split("#", 1)[1])
        above = lines[i - 1].strip() if i else ""
        if not above.startswith(("import ", "from ")):
            break
        i -= 1
    i -= 1
    while i >= 0 and lines[i].strip().startswith("#"):
        text.append(lines[i].strip()[1:])
        i -= 1
    if i >= 0 and not text and "#" in lines[i]:
        text.append(lines[i].split("#", 1)[1])  # the line before: `if big:  # why`
    return " ".join(t.strip() for t in text if t.strip())


def _local_nodes(tree: ast.AST) -> set[int]:
    """The ids of the import statements inside a function (at any depth)."""
    out: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return out


def local_imports() -> Iterator[tuple[str, int, str]]:
    """Every import statement inside a function, of any module: (module, line, comment)."""
    for mod, path in modules().items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        local = _local_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) in local:
                yield mod, node.lineno, _comment(lines, node.lineno)


def imports() -> Iterator[Import]:
    known = set(modules())
    for mod, path in modules().items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        local_nodes = _local_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("provision")]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(mod, node, path.name == "__init__.py", known)
            else:
                continue
            for t in targets:
                while t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != mod:
                    yield Import(mod, t, node.lineno, id(node) in local_nodes, _comment(lines, node.lineno))


def layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_every_package_is_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), (
        f"a package without a layer: {packages - set(LAYERS)} (add it to LAYERS and docs/architecture.md)"
    )


def test_layers_import_only_downwards():
    wrong = []
    for imp in imports():
        a, b = layer(imp.module), layer(imp.target)
        if a is None or b is None or a == b:
            continue
        if LAYERS[b] >= LAYERS[a]:
            wrong.append(f"{imp.module}:{imp.line} imports {imp.target} ({a} may not import {b})")
    assert not wrong, "\n".join(wrong)


def find_circles(graph: dict[str, set[str]]) -> list[str]:
    """Every back edge of a depth-first walk, as the circle it closes."""
    circles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                circles.append(" -> ".join(stack[stack.index(n) :] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return circles


def test_no_import_circles():
    graph: dict[str, set[str]] = {}
    for imp in imports():  # local ones too: Python does not see their circle, the design does
        graph.setdefault(imp.module, set()).add(imp.target)
    circles = find_circles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_local_import_has_a_comment():
    silent = [f"{mod}:{line}" for mod, line, comment in local_imports() if not comment]
    assert not silent, (
        "an import inside a function says why on its line or the line before "
        "(start-up time, a module the host may lack, ...):\n" + "\n".join(silent)
    )


def test_local_imports_of_provision_say_why():
    unexplained = [
        f"{imp.module}:{imp.line} imports {imp.target} inside a function"
        for imp in imports()
        if imp.local and not any(w in imp.comment.lower() for w in LAZY_REASONS)
    ]
    assert not unexplained, (
        "a function-local import of provision needs a comment naming the start-up time it saves "
        "(else import it at the top; an import circle is fixed by moving code, not hidden):\n" + "\n".join(unexplained)
    )


def test_sizes():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    big = [
        f"{m}: {len(p.read_text().splitlines())} lines"
        for m, p in modules().items()
        if len(p.read_text().splitlines()) > MAX_MODULE_LINES
    ]
    assert not big, big
    long = []
    for m, p in modules().items():
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > LONG_FUNCTION:
                long.append(f"{m}.{n.name}: {n.end_lineno - n.lineno + 1} lines")
    assert len(long) <= MAX_LONG_FUNCTIONS, "\n".join(sorted(long))


def test_the_checker_sees_a_circle():
    """The checks themselves: a circle and a relative import are found."""
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert find_circles({"a": {"b"}, "b": set()}) == []
    node = ast.parse("from ..x import y\n").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("provision.p.m", node, False, {"provision.x", "provision.x.y"}) == ["provision.x.y"]


# --------------------------------------------------------------------------- the round's seams


def _source(mod: str) -> str:
    return modules()[mod].read_text()


def test_nothing_but_the_store_moves_a_submission():
    """A submission's status changes in one place: ServiceStore._move, a compare-and-set
    from the states core/submission.MOVES allows."""
    writers = [m for m, p in modules().items() if "provision_service_submissions SET" in p.read_text()]
    assert writers == ["provision.io.servicestore"], writers
    tree = ast.parse(_source("provision.io.servicestore"))
    setting = sorted(
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        and any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and "SET status" in n.value for n in ast.walk(fn)
        )
    )
    assert setting == ["_move"], setting


def test_web_reads_the_service_only_through_its_source():
    """The pages decide nothing and keep no store of their own: web/ imports no database
    module and nothing of serve/ (the service hands it a Source: the round and its stores)."""
    stores = {
        "provision.io.servicestore",
        "provision.io.servicedb",
        "provision.io.servicehistory",
        "provision.io.serviceevents",
        "provision.io.servicenotify",
        "provision.io.servicelogs",
        "provision.io.servicehealth",
    }
    bad = sorted(
        f"{i.module} imports {i.target}"
        for i in imports()
        if i.module.startswith("provision.web.") and (i.target in stores or i.target.startswith("provision.serve"))
    )
    assert not bad, bad


def test_no_module_reads_the_preemption_mark_as_a_dict():
    """A preemption's mark comes off a host as JSON and is parsed once
    (core/scheduling.PreemptMark); the host's own modules write it."""
    readers = []
    for mod, path in modules().items():
        if mod.startswith("provision.host.") or mod == "provision.core.scheduling":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
                key = n.slice.value
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args:
                key = n.args[0].value if isinstance(n.args[0], ast.Constant) else None
            if key == "preempted":
                readers.append(f"{mod}:{n.lineno}")
    assert not readers, readers
