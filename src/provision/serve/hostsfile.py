"""`provision serve --hosts FILE`: hosts the service watches whether or not any work runs on
them (the Cluster page shows them, idle GPUs too; the rounds survey them). FILE holds an
inventory's `hosts:` list and, optionally, its `ssh:` (docs/dashboard.md):

    ssh: {user: root, identity_file: ~/.ssh/id_ed25519}
    hosts:
      - {name: gpu-1, address: 10.0.0.11, accelerators: {type: nvidia-h100, count: 8}}

It is checked as an inventory is (every problem at once, FILE:LINE), made one of a job
nobody applies (HOSTS_JOB: its one chief asks for no GPU), written into the service's work
directory, and read again when FILE changes (a FILE that no longer checks keeps the hosts it
had, said once).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import yaml

from provision.core.errors import ProvisionError
from provision.inventory.inventory import parse

HOSTS_JOB = "serve-hosts-file"  # the job the hosts are watched under: never applied, never on a page
ALLOWED = ("hosts", "ssh")
# Appended to FILE's text (its lines keep their numbers in what the checker says).
TAIL = f"\njob: {HOSTS_JOB}\npools:\n  chief: {{replicas: 1, accelerators: 0, command: [/bin/true]}}\n"


def hosts_text(path: Path) -> str:
    """FILE as an inventory's text; ProvisionError in one line (or the checker's lines)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProvisionError(f"--hosts {path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ProvisionError(f"--hosts {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        top = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ProvisionError(f"--hosts {path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(top, dict) or "hosts" not in top:
        raise ProvisionError(f"--hosts {path}: expected a mapping with hosts: (and ssh:), as an inventory has them")
    extra = sorted(str(k) for k in top if k not in ALLOWED)
    if extra:
        raise ProvisionError(f"--hosts {path}: {extra[0]}: only hosts: and ssh: go in a hosts file")
    full = text.rstrip("\n") + "\n" + TAIL
    parse(full, path.resolve(), display=str(path), files_here=False)  # raises with every problem
    return full


class HostsFile:
    """FILE and its inventory in `work` (the path Known reads): written when FILE changed."""

    def __init__(self, path: Path, work: Path, say: Callable[[str], None] = lambda s: None):
        self.path, self.say = path, say
        self.inventory = work / "hosts-file" / "hosts.yaml"
        self._stamp: tuple[int, int] | None = None
        self._bad = False
        self.refresh(strict=True)

    def refresh(self, strict: bool = False) -> Path:
        """The inventory, written again if FILE changed since; `strict`: a FILE that does
        not check raises (at start), else the last good one stays (said once)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp and self.inventory.is_file():
            return self.inventory
        try:
            text = hosts_text(self.path)
        except ProvisionError as e:
            if strict or not self.inventory.is_file():
                raise
            if not self._bad:
                self.say(f"{e.message.splitlines()[0]}: the hosts it named before are watched")
            self._bad, self._stamp = True, stamp
            return self.inventory
        self.inventory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.inventory.with_name(".hosts.yaml.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.inventory)
        self._stamp, self._bad = stamp, False
        return self.inventory
