"""encode.py against faithful Python ports of the systemd parsers it writes for.

- `parse_env_file` is a line-by-line port of systemd's parse_env_file_internal()
  (src/basic/env-file.c, the state machine EnvironmentFile= uses);
- `parse_exec` follows config_parse_exec() (src/core/load-fragment.c): a lone `;`
  separates commands, `\\;` is a literal `;`, words are split by extract_first_word()
  with EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE, `%` specifiers are resolved, and at start-up
  `$$` becomes `$` (replace_env_argv()).

Properties: every value / argument without NUL survives a round trip exactly, whatever
it holds (quotes, backslashes, `$`, `%`, backquotes, `#`, `;`, newlines, CR, unicode),
and no value can add a variable, a line or a directive. The real systemd is the judge in
tests/integration/test_systemd_parsing.py; these ports keep the unit suite honest
without a host.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from provision.core import encode
from provision.core.errors import ProvisionError

EXAMPLES = int(os.environ.get("PROVISION_HYPOTHESIS_EXAMPLES", "300"))

# Values a user (or an attacker who controls one inventory value) might write.
HOSTILE = [
    "",
    " ",
    "  leading and trailing  ",
    "plain",
    'double "quotes"',
    "single 'quotes'",
    "back\\slash",
    "ends with backslash\\",
    "\\",
    "\\\\",
    '\\"',
    "$HOME",
    "${HOME}",
    "$$",
    "%h %n %%",
    "`id`",
    "$(id)",
    "# not a comment",
    "a=b=c",
    "=",
    "semi;colon",
    ";",
    "tab\there",
    "line1\nline2",
    "carriage\rreturn",
    "crlf\r\n",
    "\n",
    '"\nEVIL=1',
    '\\"\nEVIL=1\n#',
    "x\\\nEVIL=2",
    "ünïcödé ✓ 日本語 🚀",
    "\x01\x1b[31mred\x7f",
    '{"cluster":{"chief":["h:2222"]},"task":{"type":"chief","index":0}}',
]

text_no_nul = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=60)
interesting = st.one_of(
    text_no_nul,
    st.lists(st.sampled_from(list("\\\"$`%;#=\n\r\t ' a{}")), max_size=20).map("".join),
    st.sampled_from(HOSTILE),
)


# --------------------------------------------------------------------------- systemd EnvironmentFile=

NEWLINE = "\n\r"
WHITESPACE = " \t\n\r"
COMMENTS = "#;"
SHELL_NEED_ESCAPE = '"\\`$'


def parse_env_file(text: str) -> list[tuple[str, str]]:  # noqa: C901  a port of systemd's parse_env_file_internal, one state per branch as in its C
    """Port of systemd parse_env_file_internal(); returns (key, value) in file order."""
    out: list[tuple[str, str]] = []
    state = "PRE_KEY"
    key: list[str] = []
    value: list[str] | None = None
    last_value_ws = last_key_ws = None

    def push():
        nonlocal key, value
        k = "".join(key[:last_key_ws] if last_key_ws is not None else key)
        out.append((k, "".join(value or [])))
        key, value = [], None

    for c in text:
        if state == "PRE_KEY":
            if c in COMMENTS:
                state = "COMMENT"
            elif c not in WHITESPACE:
                state, last_key_ws = "KEY", None
                key.append(c)
        elif state == "KEY":
            if c in NEWLINE:
                state, key = "PRE_KEY", []
            elif c == "=":
                state, last_value_ws = "PRE_VALUE", None
            else:
                if c not in WHITESPACE:
                    last_key_ws = None
                elif last_key_ws is None:
                    last_key_ws = len(key)
                key.append(c)
        elif state == "PRE_VALUE":
            if c in NEWLINE:
                state = "PRE_KEY"
                push()
            elif c == "'":
                state = "SINGLE_QUOTE_VALUE"
            elif c == '"':
                state = "DOUBLE_QUOTE_VALUE"
            elif c == "\\":
                state = "VALUE_ESCAPE"
            elif c not in WHITESPACE:
                state = "VALUE"
                value = (value or []) + [c]
        elif state == "VALUE":
            if c in NEWLINE:
                state = "PRE_KEY"
                if last_value_ws is not None:
                    value = value[:last_value_ws]  # type: ignore[index]
                push()
            elif c == "\\":
                state, last_value_ws = "VALUE_ESCAPE", None
            else:
                if c not in WHITESPACE:
                    last_value_ws = None
                elif last_value_ws is None:
                    last_value_ws = len(value or [])
                value = (value or []) + [c]
        elif state == "VALUE_ESCAPE":
            state = "VALUE"
            if c not in NEWLINE:
                value = (value or []) + [c]
        elif state == "SINGLE_QUOTE_VALUE":
            if c == "'":
                state = "PRE_VALUE"
            else:
                value = (value or []) + [c]
        elif state == "DOUBLE_QUOTE_VALUE":
            if c == '"':
                state = "PRE_VALUE"
            elif c == "\\":
                state = "DOUBLE_QUOTE_VALUE_ESCAPE"
            else:
                value = (value or []) + [c]
        elif state == "DOUBLE_QUOTE_VALUE_ESCAPE":
            state = "DOUBLE_QUOTE_VALUE"
            if c in SHELL_NEED_ESCAPE:
                value = (value or []) + [c]
            elif c != "\n":
                value = (value or []) + ["\\", c]
        elif state == "COMMENT":
            if c == "\\":
                state = "COMMENT_ESCAPE"
            elif c in NEWLINE:
                state = "PRE_KEY"
        elif state == "COMMENT_ESCAPE":
            state = "PRE_KEY" if c in NEWLINE else "COMMENT"
    if state in (
        "PRE_VALUE",
        "VALUE",
        "VALUE_ESCAPE",
        "SINGLE_QUOTE_VALUE",
        "DOUBLE_QUOTE_VALUE",
        "DOUBLE_QUOTE_VALUE_ESCAPE",
    ):
        if state == "VALUE" and last_value_ws is not None:
            value = value[:last_value_ws]  # type: ignore[index]
        push()
    return out


def test_port_matches_systemd_documented_examples():
    """Sanity of the port itself, on inputs whose systemd reading is documented."""
    assert parse_env_file('A=1\n# c\nB="x y"\nC=\'q "z"\'\nD=  spaced  \n') == [
        ("A", "1"),
        ("B", "x y"),
        ("C", 'q "z"'),
        ("D", "spaced"),
    ]
    assert parse_env_file('E="a\\\nb"\n') == [("E", "ab")]  # escaped newline: continuation
    assert parse_env_file('F="\\q"\n') == [("F", "\\q")]  # unknown escape keeps the backslash
    assert parse_env_file("G='single\nline'\n") == [("G", "single\nline")]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_env_assignment_hostile_values(value):
    line = encode.env_assignment("K", value)
    assert parse_env_file(line + "\n") == [("K", value)]
    assert parse_env_file(line) == [("K", value)]  # no trailing newline either


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(interesting, min_size=1, max_size=6))
def test_env_file_round_trip(values):
    """A whole file of assignments reads back as exactly those pairs: no value can end its
    line, start another key, or swallow the next one."""
    pairs = [(f"V{i}", v) for i, v in enumerate(values)]
    text = "# header\n" + "".join(encode.env_assignment(k, v) + "\n" for k, v in pairs)
    assert parse_env_file(text) == pairs


def test_env_assignment_shape():
    assert encode.env_assignment("A", 'x"$`\\y') == 'A="x\\"\\$\\`\\\\y"'
    assert encode.env_assignment("B", "") == 'B=""'
    assert encode.env_assignment("_x1", "%") == '_x1="%"'  # no specifiers in EnvironmentFile=


@pytest.mark.parametrize("key", ["", "1A", "A-B", "A B", "A=B", "A\nB", "Ä"])
def test_env_assignment_rejects_bad_keys(key):
    with pytest.raises(ProvisionError):
        encode.env_assignment(key, "v")


def test_env_assignment_rejects_nul():
    with pytest.raises(ProvisionError, match="NUL"):
        encode.env_assignment("A", "a\x00b")


# --------------------------------------------------------------------------- systemd ExecStart=

C_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "s": " ",
}


class ExecSyntaxError(ValueError):
    pass


def _cunescape(s: str, i: int) -> tuple[str, int]:
    """One escape after a backslash at s[i-1]; returns (char, next index)."""
    c = s[i]
    if c in C_ESCAPES:
        return C_ESCAPES[c], i + 1
    if c == "x":
        code = int(s[i + 1 : i + 3], 16)
        if code == 0:
            raise ExecSyntaxError("\\x00")
        return chr(code), i + 3
    if c in "uU":
        n = 4 if c == "u" else 8
        return chr(int(s[i + 1 : i + 1 + n], 16)), i + 1 + n
    if c in "01234567":
        code = int(s[i : i + 3], 8)
        if code == 0:
            raise ExecSyntaxError("\\000")
        return chr(code), i + 3
    raise ExecSyntaxError(f"invalid escape \\{c}")


def _words(line: str) -> list[str]:  # noqa: C901  a port of systemd's extract_first_word, branch by branch as in its C
    """extract_first_word(EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE) repeatedly, with
    config_parse_exec()'s checks for `;` and `\\;` before each word."""
    words: list[str] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i] in WHITESPACE:
            i += 1
        if i >= n:
            return words
        if line[i] == ";" and (i + 1 == n or line[i + 1] in WHITESPACE):
            raise ExecSyntaxError("a second command")
        if line.startswith("\\;", i) and (i + 2 == n or line[i + 2] in WHITESPACE):
            words.append(";")
            i += 2
            continue
        word: list[str] = []
        quote = None
        while i < n:
            c = line[i]
            if quote is None:
                if c in WHITESPACE:
                    break
                if c in "\"'":
                    quote = c
                    i += 1
                elif c == "\\":
                    ch, i = _cunescape(line, i + 1)
                    word.append(ch)
                else:
                    word.append(c)
                    i += 1
            else:
                if c == quote:
                    quote = None
                    i += 1
                elif c == "\\":
                    ch, i = _cunescape(line, i + 1)
                    word.append(ch)
                else:
                    word.append(c)
                    i += 1
        if quote is not None:
            raise ExecSyntaxError("unterminated quote")
        words.append("".join(word))


def _specifiers(word: str) -> str:
    out, i = [], 0
    while i < len(word):
        if word[i] == "%":
            if word[i + 1 : i + 2] != "%":
                raise ExecSyntaxError(f"specifier %{word[i + 1 : i + 2]} would be expanded")
            out.append("%")
            i += 2
        else:
            out.append(word[i])
            i += 1
    return "".join(out)


def _variables(word: str) -> str:
    out, i = [], 0
    while i < len(word):
        if word[i] == "$":
            if word[i + 1 : i + 2] != "$":
                raise ExecSyntaxError(f"${word[i + 1 : i + 2]} would be expanded")
            out.append("$")
            i += 2
        else:
            out.append(word[i])
            i += 1
    return "".join(out)


def parse_exec(line: str) -> list[str]:
    """The argv systemd runs for `ExecStart=<line>`."""
    if "\n" in line:
        raise ExecSyntaxError("a newline ends the directive")
    return [_variables(_specifiers(w)) for w in _words(line)]


def test_exec_port_sanity():
    assert parse_exec('/bin/echo "a b" c\\sd "%%h" "$$HOME" \\;') == ["/bin/echo", "a b", "c d", "%h", "$HOME", ";"]
    with pytest.raises(ExecSyntaxError):
        parse_exec("/bin/echo ; /bin/true")
    with pytest.raises(ExecSyntaxError):
        parse_exec('/bin/echo "%h"')
    with pytest.raises(ExecSyntaxError):
        parse_exec('/bin/echo "$HOME"')


HOSTILE_ARGS = HOSTILE + [";", "\\;", '";"', "-", "@", "+", "!", ":", "--flag=$x", "%", "%%", "\\x41"]


@pytest.mark.parametrize("arg", HOSTILE_ARGS, ids=repr)
def test_exec_word_hostile(arg):
    line = encode.exec_line(["/opt/venv/bin/python", arg, "last"])
    assert "\n" not in line and "\r" not in line
    assert parse_exec(line) == ["/opt/venv/bin/python", arg, "last"]


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(interesting, max_size=6))
def test_exec_line_round_trip(args):
    argv = ["/usr/bin/env", *args]
    line = encode.exec_line(argv)
    assert "\n" not in line
    assert parse_exec(line) == argv


def test_exec_line_shape():
    assert encode.exec_line(["/bin/echo", "a b", "", ";", "$x", "%h"]) == '/bin/echo "a b" "" \\; "$$x" "%%h"'
    assert encode.exec_line(["/bin/echo", "l1\nl2\r\t\x01"]) == '/bin/echo "l1\\nl2\\r\\t\\x01"'


@pytest.mark.parametrize(
    "program",
    [
        "",
        "python3 train.py",
        "-/bin/true",
        "+/bin/sh",
        "@/bin/true",
        "!/bin/x",
        ":/bin/x",
        "/bin/$x",
        "/bin/%h",
        "/bin/a b",
        '"/bin/x"',
        "./train",
        "venv/bin/python",
        "/opt/../bin/x",
        "/opt/./x",
        "//x",
        "/x/",
        "/",
        "-x",
    ],
)
def test_exec_line_rejects_fancy_programs(program):
    with pytest.raises(ProvisionError):
        encode.exec_line([program, "x"])


@pytest.mark.parametrize(
    "program",
    ["/opt/venv/bin/python", "/opt/.venv/bin/python3.11", "python3", "torchrun", "/usr/bin/docker", "/a/b-c_d+e.f"],
)
def test_exec_line_accepts_plain_programs(program):
    assert encode.exec_line([program]) == program


def test_exec_line_rejects_nul_and_empty():
    with pytest.raises(ProvisionError):
        encode.exec_line([])
    with pytest.raises(ProvisionError, match="NUL"):
        encode.exec_line(["/bin/echo", "a\x00"])
