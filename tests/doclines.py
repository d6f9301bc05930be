"""The command lines of the documentation's fenced code blocks, and how each block is marked.

Shared by tests/test_docs.py (every command line is run or marked; the rules are in its
docstring) and tests/integration/test_docs_examples.py (which runs the lines marked
`<!-- run: sandbox -->` on sandbox hosts). Reads files only.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# The marker: an HTML comment on the line right before a block's opening fence.
MARKER = re.compile(r"^<!--\s*(run|not run):\s*(.*?)\s*-->\s*$")
MARKER_LIKE = re.compile(r"^\s*<!--\s*(?:not\s+)?run", re.I)  # what may be meant as one
RUN_WHERE = "sandbox"  # `<!-- run: sandbox -->`: the only place lines are run today
PROMPT = re.compile(r"^\$\s+")
# A block whose first line is `# NAME` (a file name with an extension) shows the file NAME.
FILE_HEADER = re.compile(r"^# ([A-Za-z0-9_-][A-Za-z0-9_.-]*\.[A-Za-z0-9]+)$")
EXPORT = re.compile(r"^export ([A-Za-z_][A-Za-z0-9_]*)=(\S*)$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]+(?:\.\.\.)?$")  # INVENTORY, TASK, N, DIR...
SHELL_OPERATORS = {"|", "||", ";", "&", ">", ">>", "<", "2>", "2>&1"}


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.as_posix()


@dataclass(frozen=True)
class Block:
    """A fenced code block: where its opening fence is, its info string, its lines, and
    the line before the fence (a marker, or anything else)."""

    path: Path
    fence_line: int  # 1-based
    info: str
    lines: tuple[tuple[int, str], ...]  # (line number, text) of the body
    before: str  # the line right before the opening fence ("" at the top of the file)

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.fence_line}"

    @property
    def marker(self) -> tuple[str, str] | None:
        """("run", "sandbox") or ("not run", REASON) from the line before the fence."""
        m = MARKER.match(self.before.strip())
        return (m.group(1), m.group(2)) if m else None

    @property
    def runs(self) -> bool:
        return self.marker == ("run", RUN_WHERE)

    @property
    def transcript(self) -> bool:
        """A block with `$ ` prompts: its other lines are output."""
        return any(PROMPT.match(t.strip()) for _, t in self.lines)

    @property
    def shows_file(self) -> str | None:
        """NAME, when the block's first line is `# NAME`: the block is that file."""
        if not self.lines:
            return None
        m = FILE_HEADER.match(self.lines[0][1].strip())
        return m.group(1) if m else None

    @property
    def text(self) -> str:
        return "".join(t + "\n" for _, t in self.lines)


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    fence: str | None = None
    start, info, body, before, prev = 0, "", [], "", ""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, start, body, before = m.group(1), n, [], prev
                info = line.strip()[len(fence) :].strip()
            prev = line
        elif line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
            out.append(Block(path, start, info, tuple(body), before))
            fence, prev = None, line
        else:
            body.append((n, line))
    return out


def top_commands() -> set[str]:
    """provision's commands, as `provision --help` lists them."""
    import click

    from provision.cli.app import main

    return set(main.list_commands(click.Context(main)))


def is_command(text: str, commands: set[str]) -> bool:
    """`provision COMMAND ...` (or a synopsis, `provision [--version] ...`)."""
    words = text.split()
    return len(words) >= 2 and words[0] == "provision" and (words[1] in commands or words[1][0] in "-[")


@dataclass(frozen=True)
class DocLine:
    block: Block
    line: int
    text: str  # the line without its prompt or indentation

    @property
    def where(self) -> str:
        return f"{rel(self.block.path)}:{self.line}"


def _unprompted(block: Block) -> list[tuple[int, str, bool]]:
    """(line, text without prompt, had a prompt) of the lines a reader would type or read."""
    out = []
    for n, raw in block.lines:
        s = raw.strip()
        m = PROMPT.match(s)
        out.append((n, s[m.end() :] if m else s, m is not None))
    return out


def command_lines(block: Block, commands: set[str]) -> list[DocLine]:
    """The lines of a block that run provision: `provision COMMAND ...`, after an optional
    `$ ` prompt; in a block with prompts, only the prompted lines (the rest is output)."""
    prompts = block.transcript
    return [
        DocLine(block, n, s)
        for n, s, prompted in _unprompted(block)
        if (prompted or not prompts) and is_command(s, commands)
    ]


def output_lines(block: Block, commands: set[str]) -> list[DocLine]:
    """Lines starting `provision ` that are not commands: what provision prints."""
    prompts = block.transcript
    return [
        DocLine(block, n, s)
        for n, s, prompted in _unprompted(block)
        if s.startswith("provision ") and not ((prompted or not prompts) and is_command(s, commands))
    ]


def exports(block: Block) -> list[tuple[int, str, str]]:
    """(line, NAME, VALUE) of the block's `export NAME=VALUE` lines."""
    return [(n, m.group(1), m.group(2)) for n, s, _ in _unprompted(block) if (m := EXPORT.match(s))]


def strays(block: Block, commands: set[str]) -> list[DocLine]:
    """Lines a reader would type (all of a block without prompts, the prompted ones of a
    transcript) that are neither a provision command nor an `export NAME=VALUE`, a `#`
    comment or blank: a run block may hold nothing the test would not run."""
    prompts = block.transcript
    return [
        DocLine(block, n, s)
        for n, s, prompted in _unprompted(block)
        if (prompted or not prompts)
        and s
        and not s.startswith("#")
        and not EXPORT.match(s)
        and not is_command(s, commands)
    ]


def chains(text: str) -> list[list[str]]:
    """The words of each command of a line (`A && B` is two), `# comments` left out.
    ValueError for what a test cannot run as argv: other shell operators, a command that is
    not provision."""
    words = shlex.split(text, comments=True)
    out: list[list[str]] = [[]]
    for w in words:
        if w == "&&":
            out.append([])
        elif w in SHELL_OPERATORS:
            raise ValueError(f"shell operator {w!r}: write one provision command per line (or join them with &&)")
        else:
            out[-1].append(w)
    for argv in out:
        if not argv or argv[0] != "provision":
            raise ValueError(f"not a provision command: {' '.join(argv) or '(empty)'}")
    return out


def synopsis_words(argv: list[str]) -> list[str]:
    """Words that make a line a synopsis rather than a command: `[optional]` parts,
    alternatives (`a|b`), `...` and placeholders in capitals (before `--`, after which the
    words are the remote command's own)."""
    words = argv[: argv.index("--")] if "--" in argv else argv
    return [w for w in words[1:] if any(c in w for c in "[]|") or "..." in w or PLACEHOLDER.match(w)]


def marking_problems(paths: list[Path], commands: set[str]) -> list[str]:  # noqa: C901  one branch per marking rule of the docs
    """Every way the pages break the marking rules (tests/test_docs.py's docstring), one
    line each: a command line in a block without a marker, a marker that marks nothing or
    is misspelt, a run block holding a synopsis or a line the test would not run."""
    out: list[str] = []
    for path in paths:
        bs = blocks(path)
        by_fence = {b.fence_line: b for b in bs}
        code = {n for b in bs for n in (b.fence_line, *(m for m, _ in b.lines))}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if n in code or not MARKER_LIKE.match(line):
                continue
            where, m, b = f"{rel(path)}:{n}", MARKER.match(line.strip()), by_fence.get(n + 1)
            if m is None:
                out.append(f"{where}: not a marker: write <!-- run: {RUN_WHERE} --> or <!-- not run: REASON -->")
            elif b is None:
                out.append(f"{where}: a marker must be the line right before a code block's opening fence")
            elif not command_lines(b, commands):
                out.append(f"{where}: marks a block without a provision command line")
            elif m.group(1) == "run" and m.group(2) != RUN_WHERE:
                out.append(f"{where}: unknown place to run {m.group(2)!r}: write <!-- run: {RUN_WHERE} -->")
            elif m.group(1) == "not run" and not m.group(2):
                out.append(f"{where}: say why: <!-- not run: REASON -->")
        for b in bs:
            lines = command_lines(b, commands)
            if lines and b.marker is None:
                out += [
                    f"{c.where}: {c.text}: neither run by a test nor marked: put <!-- run: {RUN_WHERE} --> "
                    "or <!-- not run: REASON --> on the line before the block"
                    for c in lines
                ]
            if not b.runs or not lines:
                continue
            out += [f"{s.where}: {s.text}: a run block holds only provision commands" for s in strays(b, commands)]
            for c in lines:
                try:
                    argvs = chains(c.text)
                except ValueError as e:
                    out.append(f"{c.where}: {c.text}: {e}")
                    continue
                for argv in argvs:
                    if words := synopsis_words(argv):
                        out.append(
                            f"{c.where}: {c.text}: a synopsis ({' '.join(words)}) in a run block: "
                            "mark it <!-- not run: synopsis -->"
                        )
    return out
