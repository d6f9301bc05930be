"""The documentation stays in step with the code and with the repository.

- every relative link in README.md and docs/ resolves to a file or directory inside the
  repository (and to a heading, for `#anchors` into Markdown files); the README links
  nowhere else ("the README links only inside the repository");
- every inventory key the parser accepts is documented in docs/inventory.md;
- every variable provision sets for a task is documented in docs/environment.md;
- every command and option of the CLI is documented in docs/commands.md, each option in
  its command's section;
- the example inventories in docs/inventory.md and the README validate, and the env file
  quoted in docs/environment.md is what `provision render` writes;
- docs/README.md lists every page of docs/; the contents lists of docs/inventory.md and
  docs/import.md name every section; the command table of docs/commands.md names every
  command; the README and docs/commands.md name, where they list the commands that take
  `--json`, exactly those whose `--help` has it;
- every command line of the examples is either run by a test or marked as not run
 , by these rules:

  * A *command line* is a line of a fenced code block (``` or ~~~; indented code blocks may
    not hold one) that, after its indentation and an optional `$ ` prompt, reads
    `provision COMMAND ...`, COMMAND one of those `provision --help` lists (or `-`/`[`
    for the synopsis of `provision` itself). In a block with `$ ` prompts (a transcript)
    only the prompted lines are commands; the rest is output. Any other line starting
    `provision ` is output, and must be words the CLI prints (`provision will perform the
    following actions:`).
  * Every block holding a command line carries a marker, an HTML comment on the line right
    before its opening fence: `<!-- run: sandbox -->`, and
    tests/integration/test_docs_examples.py runs each of its command lines on sandbox hosts
    (how, in its docstring) and expects exit 0; or `<!-- not run: REASON -->`, REASON saying
    why (`synopsis`; GPUs, a real image, many hosts).
  * A run block holds only what the test runs: provision commands (two joined with `&&` at
    most per line, no other shell operators), `export NAME=VALUE` lines (set for the
    block's later lines), `#` comments and blank lines; and no synopsis: no `[optional]`
    parts, `a|b`, `...` or placeholders in capitals (TASK, N, DIR) before a `--`.
  * A marker marks a block with a command line, right before its fence, spelt as above.
  * A file shown in a block whose first line is `# NAME` (`# hosts.yaml`) is the file
    NAME the run lines use; two blocks showing the same NAME show the same text.

No network, no hosts: these read files, the click command tree, and render locally.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import click
import pytest

import doclines

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


def link_problems(path: Path, *, external_ok: bool, root: Path = REPO) -> list[tuple[int, str, str]]:  # noqa: C901  one branch per kind of link
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
    from provision.inventory import inventory

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
    from provision.core.envnames import RESERVED_ENV

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

    from provision.inventory.inventory import parse

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


def test_readme_first_inventory_fits_sandbox_hosts():
    """The README's run lines apply its first inventory, as written, to sandbox hosts
    (tests/integration/test_docs_examples.py): its GPU type must pass apply's pre-flight
    against what their nvidia-smi stand-in reports, or a reader's first apply fails."""
    import yaml

    from provision.rules.preflight import gpu_model_problem

    stand_in = (REPO / "src/provision/hostimage/rootfs/usr/lib/provision-sandbox/nvidia-smi-standin").read_text(
        encoding="utf-8"
    )
    name = re.search(r'^GPU_NAME = "(.+)"$', stand_in, re.M)
    memory = re.search(r"^MEMORY_MIB = (\d+)$", stand_in, re.M)
    assert name and memory, "the nvidia-smi stand-in no longer sets GPU_NAME and MEMORY_MIB: update this test"
    text = next(b for b in _yaml_blocks(README.read_text(encoding="utf-8")) if b.startswith("# inventory.yaml"))
    types = [h["accelerators"]["type"] for h in yaml.safe_load(text)["hosts"] if h.get("accelerators")]
    assert types, "README.md's first inventory declares no GPUs"
    for t in types:
        assert gpu_model_problem(t, [name[1]], [int(memory[1])]) is None, (t, name[1])


def test_environment_example_matches_render(tmp_path):
    """The env file quoted in docs/environment.md is what `provision render` writes for the
    example inventory (lines shortened with '...' in the page are skipped)."""
    from provision.inventory.inventory import load
    from provision.render.files import render, write_tree

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


# --------------------------------------------------------------------------- indexes and lists


def test_docs_index_lists_every_page():
    linked = {(DOCS / target.partition("#")[0]).resolve() for _, target in links(DOCS / "README.md")}
    missing = [_rel(p) for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link: {', '.join(missing)}"


@pytest.mark.parametrize("name", ["inventory.md", "import.md"])
def test_contents_list_names_every_section(name):
    """The list at the top of the page (before its first section) links every section."""
    path = DOCS / name
    text = path.read_text(encoding="utf-8")
    top = next(n for n, line in _prose_lines(text) if (m := HEADING.match(line)) and len(m.group(1)) == 2)
    linked = {target[1:] for n, target in links(path) if n < top and target.startswith("#")}
    sections = [h for level, h in headings(text) if level == 2]
    missing = [h for h in sections if github_anchor(h) not in linked]
    assert not missing, f"docs/{name}'s contents list does not link: " + ", ".join(missing)


def _leaf_commands() -> list[tuple[tuple[str, ...], click.Command]]:
    from provision.cli.app import main

    return [(p, c) for p, c in _commands(main) if not isinstance(c, click.Group)]


def test_command_table_names_every_command():
    """The table at the top of docs/commands.md: a row per command, `provision NAME ...`;
    a group's row names each of its commands (`provision sandbox up`, `down`, ...)."""
    text = (DOCS / "commands.md").read_text(encoding="utf-8")
    table = text[: text.index("\n## ")]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| [")]
    spans = [[m.group(2).split() for m in CODE_SPAN.finditer(cell)] for cell in cells]
    missing = []
    for path, _ in _leaf_commands():
        row = next((s for s in spans if s and s[0][:2] == ["provision", path[0]]), None)
        if row is None or (len(path) > 1 and not any(path[-1] in words for words in row)):
            missing.append("provision " + " ".join(path))
    assert not missing, "not in the command table of docs/commands.md: " + ", ".join(missing)


JSON_LIST = re.compile(r"`--json` \((?:for )?([^)]*)\)")


@pytest.mark.parametrize("path", [README, DOCS / "commands.md"], ids=_rel)
def test_json_list_is_the_commands_with_json(path):
    """Where a page lists the commands that take `--json` ("`--json` (facts, plan, ...)"),
    it lists exactly those whose options have it."""
    from provision.cli.app import main

    # A group that runs as a command of its own (`provision health INVENTORY --json`) counts.
    truth = {" ".join(p) for p, c in _commands(main) if "--json" in _flags(c)}
    m = JSON_LIST.search(path.read_text(encoding="utf-8"))
    assert m, f"{_rel(path)} no longer lists the commands that take --json: update this test"
    # "facts, plan, ..., state show": commands, a group's by its path
    listed = {" ".join(x.strip(" `").split()) for x in re.split(r",|\band\b", m.group(1))} - {""}
    assert listed == truth, (
        f"{_rel(path)}: missing {sorted(truth - listed)}, not taking --json {sorted(listed - truth)}"
    )


# --------------------------------------------------------------------------- command lines in examples


@pytest.fixture(scope="module")
def top_commands() -> set[str]:
    return doclines.top_commands()


def test_every_command_line_is_run_or_marked(top_commands):
    problems = doclines.marking_problems(doclines.doc_files(), top_commands)
    assert not problems, "command lines in the docs (rules: tests/test_docs.py's docstring):\n" + "\n".join(problems)


def test_the_docs_run_some_lines_and_mark_others(top_commands):
    """The rules hold something: lines to run, and lines marked with a reason."""
    run = [
        c
        for p in doclines.doc_files()
        for b in doclines.blocks(p)
        if b.runs
        for c in doclines.command_lines(b, top_commands)
    ]
    kept = [b for p in doclines.doc_files() for b in doclines.blocks(p) if b.marker and b.marker[0] == "not run"]
    assert len(run) >= 20 and kept


def test_marking_check_catches_each_mistake(tmp_path, top_commands):
    md = tmp_path / "page.md"
    md.write_text(
        "```\nprovision status inv.yaml\n```\n"  # 1: no marker
        "<!-- run: sandbox -->\n```\n$ provision status inv.yaml\nprovision will perform\n```\n"  # fine
        "<!-- not run: synopsis -->\n```\nprovision logs [-f] INVENTORY\n```\n"  # fine
        "<!-- run: sandbox -->\n```\nprovision logs INVENTORY TASK\n```\n"  # 15: a synopsis
        "<!-- run: sandbox -->\n```\ncd /tmp\nprovision plan inv.yaml | less\n```\n"  # 19: cd, 20: a pipe
        "<!-- run: sandbox -->\n```\nnothing here\n```\n"  # 22: marks nothing
        "<!-- not run: -->\n```\nprovision plan inv.yaml\n```\n"  # 26: no reason
        "<!-- run: laptop -->\n```\nprovision plan inv.yaml\n```\n"  # 30: unknown place
        "<!-- run: sandbox -->\n\n```\nprovision plan inv.yaml\n```\n"  # 34: not right before; 37 unmarked
        "<!-- runs here -->\n"  # 39: misspelt
        "```\nprovision aply inv.yaml\n```\n"  # an unknown command: output, not a command line
    )
    problems = doclines.marking_problems([md], top_commands)
    where = [int(p.split(":")[1]) for p in problems]
    assert where == [22, 26, 30, 34, 39, 2, 15, 19, 20, 37], "\n".join(problems)


def test_output_lines_are_what_provision_prints(top_commands):
    """A `provision WORD ...` line that is not a command is output: its first words are
    words the CLI prints (so a misspelt command is not taken for output)."""
    source = "".join(p.read_text(encoding="utf-8") for p in (REPO / "src" / "provision" / "cli").glob("*.py"))
    bad = [
        f"{line.where}: {line.text}"
        for p in doclines.doc_files()
        for b in doclines.blocks(p)
        for line in doclines.output_lines(b, top_commands)
        if " ".join(line.text.split()[:2]) not in source
    ]
    assert not bad, "neither a provision command nor what provision prints:\n" + "\n".join(bad)


INDENTED_COMMAND = re.compile(r"^(?: {4,}|\t)(?:\$ )?provision \S")


def test_commands_are_shown_in_fenced_blocks():
    bad = []
    for path in doc_files():
        prev = ""
        for n, line in _prose_lines(path.read_text(encoding="utf-8")):
            if INDENTED_COMMAND.match(line) and not prev.strip():
                bad.append(f"{_rel(path)}:{n}: {line.strip()}")
            prev = line
    assert not bad, "an indented code block with a provision command (use a fenced one, marked):\n" + "\n".join(bad)


def test_files_shown_twice_are_the_same():
    shown: dict[str, tuple[str, str]] = {}
    bad = []
    for p in doclines.doc_files():
        for b in doclines.blocks(p):
            if (name := b.shows_file) is None:
                continue
            if name in shown and shown[name][1] != b.text:
                bad.append(f"{b.where}: {name} differs from the one at {shown[name][0]}")
            shown.setdefault(name, (b.where, b.text))
    assert not bad, "\n".join(bad)
