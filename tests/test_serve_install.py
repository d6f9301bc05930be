"""`provision serve --install` writes a systemd unit. Its text is pure
(serve/install.unit_text): every value is written so that systemd reads it back intact and
none can add a directive. The real install and uninstall run on a sandbox host
(tests/integration/test_serve_install.py)."""

from __future__ import annotations

import os
import pwd
import re

import pytest

from provision.core.errors import ProvisionError
from provision.serve import install as I

KEYS = {
    "Description",
    "Wants",
    "After",
    "StartLimitIntervalSec",
    "Type",
    "ExecStart",
    "Environment",
    "Restart",
    "RestartSec",
    "WantedBy",
}


def directives(text: str) -> list[tuple[str, str]]:
    """(key, value) of each directive line; comments, sections and blank lines left out."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith(("#", "[")):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z]+", key), line
        out.append((key, value))
    return out


def test_the_unit_restarts_always_after_the_network():
    text = I.unit_text(
        "/usr/bin/python3", ["-m", "provision", "serve"], "ana", "/etc/provision/serve.env", workdir="/home/ana"
    )
    d = dict(directives(text))
    assert d["Restart"] == "always" and int(d["RestartSec"]) > 0 and d["StartLimitIntervalSec"] == "0"
    assert d["After"] == d["Wants"] == "network-online.target"
    assert d["User"] == "ana" and d["WorkingDirectory"] == "/home/ana"
    assert d["EnvironmentFile"] == "-/etc/provision/serve.env"  # "-": a missing file is no error
    assert d["ExecStart"] == '/usr/bin/python3 "-m" "provision" "serve"'
    assert d["WantedBy"] == "multi-user.target"
    assert text.endswith("\n") and "[Unit]" in text and "[Service]" in text and "[Install]" in text


def test_without_a_user_or_an_environment_file_neither_is_written():
    keys = {k for k, _ in directives(I.unit_text("/usr/bin/python3", [], None, None))}
    assert keys == KEYS


HOSTILE_ARGS = [
    "a b",
    "x\nUser=root",
    "x\rExecStartPre=/bin/sh",
    "%n%%",
    "$HOME ${PATH}",
    '"quoted"',
    "back\\slash\\",
    ";",
    "tab\there",
    "\x1b[31m",
]


@pytest.mark.parametrize("arg", HOSTILE_ARGS)
def test_no_argument_adds_a_line_or_a_directive(arg):
    text = I.unit_text("/usr/bin/python3", ["serve", arg], "ana", None)
    keys = [k for k, _ in directives(text)]
    assert sorted(keys) == sorted([*KEYS, "User"])  # one each: nothing added, nothing split
    exec_start = dict(directives(text))["ExecStart"]
    assert "\n" not in exec_start and "\r" not in exec_start
    assert "%" not in exec_start.replace("%%", "")  # no specifier left to expand
    assert "$" not in exec_start.replace("$$", "")  # no variable left to expand


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("user", "root\nExecStartPre=/bin/sh"),
        ("user", "a b"),
        ("user", ""),
        ("user", "-x"),
        ("env_file", "relative/serve.env"),
        ("env_file", "/etc/x\nUser=root"),
        ("env_file", "/etc/x\\"),
        ("env_file", "/etc/x "),
        ("workdir", "/home/a\x00b"),
        ("exe", "/opt/my venv/bin/python3"),
        ("exe", "-/usr/bin/python3"),
    ],
)
def test_a_value_systemd_would_read_otherwise_is_refused_in_one_line(field, value):
    kwargs = {"exe": "/usr/bin/python3", "args": [], "user": None, "env_file": None, "workdir": None, field: value}
    with pytest.raises(ProvisionError) as e:
        I.unit_text(**kwargs)
    assert "\n" not in e.value.message.replace(repr(value), "")


def test_a_percent_in_a_path_is_not_a_specifier():
    d = dict(directives(I.unit_text("/usr/bin/python3", [], None, "/etc/p%n.env", workdir="/srv/a%h b")))
    assert d["EnvironmentFile"] == "-/etc/p%%n.env" and d["WorkingDirectory"] == "/srv/a%%h b"


@pytest.mark.parametrize("verb", ["install", "uninstall"])
def test_not_root_is_refused_in_one_line(monkeypatch, verb):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ProvisionError) as e:
        I.install([], None) if verb == "install" else I.uninstall()
    assert "run it as root" in e.value.message and "sudo provision serve" in e.value.message
    assert "\n" not in e.value.message


def test_the_user_is_who_ran_sudo_unless_named(monkeypatch):
    me = pwd.getpwuid(os.getuid()).pw_name
    monkeypatch.setenv("SUDO_USER", me)
    pw, why = I.service_user(None)
    assert pw.pw_name == me and ("sudo" in why if me != "root" else "not run through sudo" in why)
    pw, why = I.service_user("root")
    assert pw.pw_name == "root" and "--user" in why
    monkeypatch.delenv("SUDO_USER")
    assert I.service_user(None)[0].pw_name == "root"
    with pytest.raises(ProvisionError, match="no such user"):
        I.service_user("nobody-here-at-all")
