"""The documentation stays in step with the code and with the repository.

- every relative link in README.md and docs/ resolves to a file or directory inside the
  repository (and to a heading, for `#anchors` into Markdown files); the README links
  nowhere else (issue 16: "the README links only inside the repository");
- every inventory key the parser accepts is documented in docs/inventory.md;
- every variable provision sets for a task is documented in docs/environment.md;
- every command and option of the CLI is documented in docs/commands.md, each option in
  its command's section;
- the example inventories in docs/inventory.md and the README validate, and the env file
  quoted in docs/environment.md is what `provision render` writes.

No network, no hosts: these read files, the click command tree, and render locally.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import click
import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# --------------------------------------------------------------------------- Markdown


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
                fence = None
            continue
        out.append((n, line))
    return out


def _without_code_spans(line: str) -> str:
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def code_spans(text: str) -> set[str]:
    """Contents of every inline code span outside fenced blocks, stripped."""
    spans: set[str] = set()
    for _, line in _prose_lines(text):
        spans |= {m.group(2).strip() for m in CODE_SPAN.finditer(line)}
    return spans


INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]*)>")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.I)


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image in a Markdown file, code excluded."""
    out = []
    for n, line in _prose_lines(path.read_text(encoding="utf-8")):
        prose = _without_code_spans(line)
        for rx in (INLINE_LINK, REF_DEF, AUTOLINK, HTML_LINK):
            out += [(n, m.group(1)) for m in rx.finditer(prose)]
    return out


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: its text, lower-cased, without punctuation but `-` and
    `_`, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", CODE_SPAN.sub(lambda m: m.group(2), text))  # code, then HTML tags
    text = text.strip().lower()
    text = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, text) of every ATX heading outside fenced code."""
    return [(len(m.group(1)), m.group(2)) for _, line in _prose_lines(text) if (m := HEADING.match(line))]


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, text in headings(path.read_text(encoding="utf-8")):
        base = github_anchor(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    # Explicit anchors: <a id="x"></a> / <a name="x">
    out |= set(re.findall(r"""<a\s+(?:id|name)\s*=\s*["']([^"']+)["']""", path.read_text(encoding="utf-8")))
    return out


SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def link_problems(path: Path, *, external_ok: bool, root: Path = REPO) -> list[tuple[int, str, str]]:
    """(line, target, what is wrong) for every bad link in `path`."""
    problems = []
    for line, target in links(path):

        def bad(why: str, line: int = line, target: str = target) -> None:
            problems.append((line, target, why))

        if not target:
            bad("empty link")
            continue
        if SCHEME.match(target) or target.startswith("//"):
            if not external_ok:
                bad("links outside the repository (the README links only inside it)")
            elif not target.lower().startswith(("http://", "https://", "mailto:")):
                bad("neither a repository path nor a web address")
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part.split("?", 1)[0])
        if file_part.startswith("/"):
            bad("absolute path: use a path relative to the file")
            continue
        dest = (path.parent / file_part).resolve() if file_part else path
        try:
            dest.relative_to(root)
        except ValueError:
            bad(f"points outside the repository ({dest})")
            continue
        if not dest.exists():
            bad("no such file or directory in the repository")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            bad(f"no heading #{anchor} in {dest.relative_to(root).as_posix()}")
    return problems


# --------------------------------------------------------------------------- (a) links


def test_docs_exist():
    for name in ("README.md", "inventory.md", "environment.md", "commands.md", "validation-errors.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_links_resolve_inside_the_repository(path):
    problems = link_problems(path, external_ok=path != README)
    assert not problems, "broken or outside links:\n" + "\n".join(
        f"{_rel(path)}:{line}: ({target}): {why}" for line, target, why in problems
    )


def test_link_checker_catches_bad_links(tmp_path):
    """The checker itself: each kind of bad link is reported, good ones and code are not."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("# Title\n\n## The `x_y` key: a, b\n\n## Title\n")
    (tmp_path / "outside.md").write_text("# Outside\n")
    md = repo / "README.md"
    md.write_text(
        "# Top\n"
        "[ok](docs/a.md) [ok](docs/a.md#title) [ok](docs/a.md#the-x_y-key-a-b) [ok](docs/a.md#title-1)\n"
        "[ok](#top) [ok](docs/) ![ok](docs/a.md)\n"
        "`[in code](../nowhere.md)`\n"
        "```\n[in a block](../nowhere.md)\n```\n"
        "[1](docs/missing.md) [2](../outside.md) [3](docs/a.md#nope) [4](https://example.com)\n"
        "[5](/etc/passwd) [6](#bottom)\n"
        "[7]: ../outside.md\n"
    )
    bad = [
        "docs/missing.md",
        "../outside.md",
        "docs/a.md#nope",
        "https://example.com",
        "/etc/passwd",
        "#bottom",
        "../outside.md",
    ]
    assert [t for _, t, _ in link_problems(md, external_ok=False, root=repo)] == bad
    assert [t for _, t, _ in link_problems(md, external_ok=True, root=repo)] == [t for t in bad if "example" not in t]


# --------------------------------------------------------------------------- (b) inventory keys


def test_every_inventory_key_is_documented():
    from provision.core import model
    from provision.spec import inventory

    spans = code_spans((DOCS / "inventory.md").read_text(encoding="utf-8"))
    wanted = {
        "top level": inventory.TOP_KEYS,
        "ssh": inventory.SSH_KEYS,
        "hosts[]": inventory.HOST_KEYS,
        "pools.<role>": inventory.POOL_KEYS,
        "pools": model.ROLES,
        # Nested keys and values the parser spells out in place.
        "nested keys": ("type", "count", "policy", "limit", "src", "dest", "chief_name", "trial"),
        "restart policies": model.RESTART_POLICIES,
        "host_key_policy values": model.HOST_KEY_POLICIES,
        "success policies": model.SUCCESS_POLICIES,
    }
    missing = [f"{where}: `{k}`" for where, keys in wanted.items() for k in keys if k not in spans]
    assert not missing, "not documented (as a code span) in docs/inventory.md:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- (c) task environment


def test_every_task_variable_is_documented():
    from provision.spec.clusterenv import RESERVED_ENV

    spans = code_spans((DOCS / "environment.md").read_text(encoding="utf-8"))
    missing = sorted(v for v in RESERVED_ENV if v not in spans)
    assert not missing, f"not documented (as a code span) in docs/environment.md: {', '.join(missing)}"


# --------------------------------------------------------------------------- (d) commands and flags


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    """(path, command) of every command under `group`, subgroups included, recursively."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # the top group loads its commands lazily
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        path = prefix + (name,)
        yield path, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path)


def _flags(cmd: click.Command) -> list[str]:
    return [o for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)]


def _section(text: str, path: tuple[str, ...]) -> str | None:
    """The part of commands.md under the heading that names `provision PATH` (in a code
    span), up to the next heading of the same or a higher level."""
    name = re.compile(r"provision\s+" + r"\s+".join(map(re.escape, path)) + r"(?![\w-])")
    lines = text.splitlines()
    heads = [(i, m) for i, line in enumerate(lines) if (m := HEADING.match(line))]
    in_code = {i for i, _ in enumerate(lines)} - {n - 1 for n, _ in _prose_lines(text)}
    heads = [(i, m) for i, m in heads if i not in in_code]
    for k, (i, m) in enumerate(heads):
        level = len(m.group(1))
        if any(name.fullmatch(s.strip()) for s in (c.group(2) for c in CODE_SPAN.finditer(m.group(2)))):
            end = next((j for j, mm in heads[k + 1 :] if len(mm.group(1)) <= level), len(lines))
            return "\n".join(lines[i:end])
    return None


def _mentions(section: str, flag: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", section) is not None


def test_every_command_and_flag_is_documented():
    from provision.cli.app import main

    text = (DOCS / "commands.md").read_text(encoding="utf-8")
    missing = []
    for flag in _flags(main):  # the group's own (--version)
        if not _mentions(text, flag):
            missing.append(f"provision {flag}")
    for path, cmd in _commands(main):
        section = _section(text, path)
        shown = "provision " + " ".join(path)
        if section is None:
            missing.append(f"{shown}: no heading `{shown}`")
            continue
        for flag in _flags(cmd):
            if not _mentions(section, flag):
                missing.append(f"{shown} {flag}: not in its section")
    assert not missing, "docs/commands.md is missing:\n" + "\n".join(missing)


def test_command_walk_sees_subcommands():
    """The walk above reaches nested groups (sandbox up, ...), so they are checked too."""
    from provision.cli.app import main

    paths = {p for p, _ in _commands(main)}
    assert ("apply",) in paths and ("sandbox",) in paths and ("sandbox", "up") in paths
    flags = {f for p, c in _commands(main) if p == ("sandbox", "up") for f in _flags(c)}
    assert "--from" in flags and "-n" in flags


# --------------------------------------------------------------------------- examples


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    out, fence, info, body = [], None, "", []
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, info, body = m.group(1), line.strip()[len(m.group(1)) :].strip(), []
        elif line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
            out.append((info, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    return out


def _yaml_blocks(text: str) -> list[str]:
    return [body for info, body in fenced_blocks(text) if info == "yaml"]


def _validate_example(text: str, tmp_path: Path) -> None:
    """Validate an example inventory, with empty stand-ins for the `files:` it pushes."""
    import yaml

    from provision.spec.inventory import parse

    for entry in (yaml.safe_load(text) or {}).get("files") or []:
        src = tmp_path / entry["src"]
        if entry["src"].endswith("/"):
            src.mkdir(parents=True, exist_ok=True)
            (src / "main.py").write_text("print('hello')\n")
        else:
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_text("print('hello')\n")
    parse(text, tmp_path / "inventory.yaml")  # raises ValidationError, listing every problem


def test_inventory_reference_example_is_valid(tmp_path):
    """The complete example at the top of docs/inventory.md validates as written."""
    blocks = _yaml_blocks((DOCS / "inventory.md").read_text(encoding="utf-8"))
    assert blocks, "docs/inventory.md has no yaml example"
    _validate_example(blocks[0], tmp_path)


def test_readme_first_inventory_is_valid(tmp_path):
    blocks = [b for b in _yaml_blocks(README.read_text(encoding="utf-8")) if b.startswith("# inventory.yaml")]
    assert blocks, "README.md has no first inventory (a yaml block starting with '# inventory.yaml')"
    _validate_example(blocks[0], tmp_path)


def test_environment_example_matches_render(tmp_path):
    """The env file quoted in docs/environment.md is what `provision render` writes for the
    example inventory (lines shortened with '...' in the page are skipped)."""
    from provision.spec.inventory import load
    from provision.spec.render import render, write_tree

    text = (DOCS / "environment.md").read_text(encoding="utf-8")
    m = re.search(r"`(out/([a-z0-9][a-z0-9._-]*)/(etc/provision/[a-z0-9-]+/[a-z0-9_-]+\.env))`", text)
    assert m, "docs/environment.md names no rendered env file (out/HOST/etc/provision/JOB/TASK.env)"
    inv = load(REPO / "inventories" / "parameter-server.yaml")
    write_tree(render(inv), tmp_path)
    rendered = (tmp_path / m.group(2) / m.group(3)).read_text().splitlines()
    block = next(body for _, body in fenced_blocks(text) if "PROVISION_JOB=" in body)
    quoted = [line for line in block.splitlines() if re.match(r'^[A-Z_]+="', line) and "..." not in line]
    assert len(quoted) > 10
    missing = [line for line in quoted if line not in rendered]
    assert not missing, f"not in the rendered {m.group(1)}:\n" + "\n".join(missing)
