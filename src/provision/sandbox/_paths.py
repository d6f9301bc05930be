"""Where the sandbox keeps its caches and per-sandbox state on the controller."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$PROVISION_CACHE_DIR`, else `$XDG_CACHE_HOME/provision`, else `~/.cache/provision`."""
    env = os.environ.get("PROVISION_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "provision"


def sandboxes_dir() -> Path:
    return cache_root() / "sandboxes"


def sandbox_dir(name: str) -> Path:
    return sandboxes_dir() / name


def frameworks_dir() -> Path:
    return cache_root() / "frameworks"


def logs_dir() -> Path:
    return cache_root() / "logs"


def locks_dir() -> Path:
    return cache_root() / "locks"


def build_dir() -> Path:
    return cache_root() / "build"
