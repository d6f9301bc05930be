"""The env file read back: host/taskenv.parse_env is provision's one reader of the
`KEY="value"` files it writes (the task's exec on the host, and plan's env diff). Judged
against the port of systemd's own parser (tests/test_encode.py), value by value.

Two readers used to exist. The plan's (rules/plan.py) dropped the backslash before any
character, where systemd keeps it unless the character is one of \\ " $ `: a value
written by hand as `"C:\\new"` read as `C:new`. Both kept a backslash-newline, which
systemd reads as a continued line. The table below holds each such value.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from provision.core.encode import env_assignment
from provision.host.taskenv import parse_env
from provision.rules.plan import env_diff

_spec = importlib.util.spec_from_file_location("_provision_test_encode", Path(__file__).with_name("test_encode.py"))
_ports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ports)  # type: ignore[union-attr]
systemd = _ports.parse_env_file

# Values as provision writes them (env_assignment): each must read back as it was.
WRITTEN = [
    "",
    " ",
    "plain",
    'say "hi"',
    "it's",
    "back\\slash",
    "trailing\\",
    "\\\\",
    "$HOME",
    "${HOME}",
    "$$",
    "`id`",
    "a=b=c",
    "=",
    "two\nlines",
    "\n",
    "carriage\rreturn",
    "tab\there",
    "# not a comment",
    '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}',
    "ünïcödé ✓",
    '\\"',
    "\\$",
]


@pytest.mark.parametrize("value", WRITTEN, ids=repr)
def test_every_written_value_reads_back(value):
    text = env_assignment("K", value) + "\n"
    assert parse_env(text) == [("K", value)] == systemd(text)


# Lines as they may be on a host (written by hand, or by another tool), read as systemd
# reads them: the reader agrees or refuses, it never reads another value.
BY_HAND = [
    ('A="C:\\new"\n', "C:\\new"),  # an unknown escape keeps its backslash
    ('A="\\q"\n', "\\q"),
    ('A="a\\\nb"\n', "ab"),  # a backslash-newline continues the line
    ('A="x\\\\y"\n', "x\\y"),
    ('A="\\`"\n', "`"),
    ('A=""\n', ""),
    ('A="="\n', "="),
    ('A="multi\nline"\n', "multi\nline"),
]


@pytest.mark.parametrize(("text", "value"), BY_HAND, ids=repr)
def test_lines_written_by_hand_read_as_systemd_reads_them(text, value):
    assert systemd(text) == [("A", value)]
    assert parse_env(text) == [("A", value)]


def test_a_whole_file_in_order():
    pairs = [(f"V{i}", v) for i, v in enumerate(WRITTEN)]
    text = "# made by provision\n\n" + "".join(env_assignment(k, v) + "\n" for k, v in pairs)
    assert parse_env(text) == pairs == systemd(text)


def test_the_plan_diff_reads_with_the_same_reader():
    old = b'A="C:\\new"\nB="1"\n'
    new = (env_assignment("A", "C:\\new") + "\n" + env_assignment("B", "2") + "\n").encode()
    # A is the same value in both (the old file's unknown escape kept its backslash): only B changed.
    assert env_diff("/etc/provision/j/w-0.env", old, new) == "- B='1'\n+ B='2'\n"


def test_a_file_that_is_not_provisions_is_diffed_as_text():
    out = env_diff("/etc/provision/j/w-0.env", b"export A=1\n", b'A="1"\n')
    assert out is not None and "-export A=1" in out and '+A="1"' in out
