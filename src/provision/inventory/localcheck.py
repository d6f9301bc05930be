"""Checks of an inventory that need this machine but no host: identity files and secrets.

`validate` reports them as warnings (the inventory itself is valid: the key may be put in
place later, the secret exported in the shell that applies); the commands that connect
(identity files) or render secrets (`plan`, `apply`) stop on them with the same words,
once, before any host is asked. Each line names the file, line and key, as validation
errors do, and says what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from provision.core.model import Inventory
from provision.inventory.yamldoc import KeyPath, compose, dotted


def _lines(inv: Inventory) -> dict[KeyPath, int]:
    """Key path -> line of the inventory's file (empty when it cannot be read again)."""

    try:
        return compose(inv.path.read_text(encoding="utf-8"), []).lines
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}


def _where(display: str, lines: Mapping[KeyPath, int], path: KeyPath) -> str:

    line = lines.get(path)
    return f"{display}:{line}: {dotted(path)}" if line else f"{display}: {dotted(path)}"


def identity_problems(inv: Inventory, display: str | None = None) -> list[str]:
    """One line per identity file named in the inventory that is not a readable file here."""
    display = display or str(inv.path)
    lines = _lines(inv)
    out: list[str] = []
    candidates: list[tuple[KeyPath, str]] = []
    top = inv.ssh.identity_file
    if top:
        candidates.append((("ssh", "identity_file"), top))
    for i, h in enumerate(inv.hosts):
        own = h.ssh.identity_file
        # A host's own key (inherited ones are reported once, at ssh.identity_file).
        if own and (("hosts", i, "identity_file") in lines or (not lines and own != top)):
            candidates.append((("hosts", i, "identity_file"), own))
    for path, name in candidates:
        full = Path(os.path.expanduser(name))
        why = None
        if not full.exists():
            why = "no such file"
        elif not full.is_file():
            why = "not a file"
        elif not os.access(full, os.R_OK):
            why = "not readable by you"
        if why:
            out.append(
                f"{_where(display, lines, path)}: identity file not found: {name} ({why}); "
                "every connection would fail: fix the path, or leave identity_file out to use "
                "your SSH agent and ~/.ssh/config"
            )
    return out


def secret_problems(inv: Inventory, env: Mapping[str, str] | None = None, display: str | None = None) -> list[str]:
    """One line per secret_env variable that is not set in this shell."""
    env = os.environ if env is None else env
    display = display or str(inv.path)
    lines = _lines(inv)
    return [
        f"{_where(display, lines, ('secret_env', i))}: {key} is not set in this shell; plan and apply copy "
        f"secret values from here (export {key}=... first)"
        for i, key in enumerate(inv.secret_env)
        if key not in env
    ]


def job_file_hint(path: str) -> str | None:
    """For a file with pools but no hosts (a job file, like inventories/sandbox/*.yaml):
    how to use it."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if isinstance(data, dict) and "pools" in data and "hosts" not in data:
        return (
            f"{path} has pools but no hosts: it is a job file. Run it on local sandbox hosts with "
            f"`provision sandbox up --from {path}`, or add `hosts:` (and `ssh:`) to make it an inventory "
            "(docs/inventory.md)"
        )
    return None
