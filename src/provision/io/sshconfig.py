"""The ssh config entries of dev sessions, so that OpenSSH and every editor built on it (VS
Code's Remote-SSH, JetBrains Gateway) connect by name: `ssh provision-dev-NAME`.

provision writes only files of its own, under ~/.ssh/provision/: `config` (a block per
session, between marker lines, put and taken away whole) and `known_hosts` (the host keys
provision learnt for the session's hosts, beside its state: io/hostkeys.py, so OpenSSH
verifies the key provision did). ~/.ssh/config gets one line, at its top, once:
`Include /HOME/.ssh/provision/config` (an absolute path: OpenSSH reads `~` as the passwd
entry's home, not $HOME); none of the user's own lines is changed. OpenSSH puts back the
Host state after an Include, so the user's lines after it mean what they meant.

A session is two hops: NAME-host is the host's own sshd (its address, port, user, key, the
inventory's jump host); NAME is the session's private sshd on that host's loopback
(host/devsession.py), reached through the first with ProxyJump, its host key (the host's
own) kept under the alias (HostKeyAlias). No RemoteCommand: the session's sshd gives
every login its environment, so `ssh provision-dev-NAME CMD`, scp and editors all work.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from provision.core.errors import ProvisionError
from provision.core.target import Target
from provision.io.connection import jump_target
from provision.io.hostkeys import KnownHosts, key_id

BEGIN, END = "# >>> provision dev ", "# <<< provision dev "


class SshConfigError(ProvisionError):
    pass


@dataclass(frozen=True)
class Hop:
    """One Host block: how OpenSSH reaches one hop."""

    alias: str
    address: str
    port: int | None
    user: str | None
    identity: str | None  # absolute
    jump: str | None  # the alias of the hop before it
    key_alias: str | None  # the name its host keys are kept under, when not `[address]:port`
    checking: str  # StrictHostKeyChecking: yes, accept-new or no


def _value(v: str) -> str:
    """A value as one word of ssh_config (quoted when it has a space)."""
    if any(c in v for c in "\n\r\0"):
        raise SshConfigError(f"ssh config: a value with a line break cannot be written: {v!r}")
    return f'"{v}"' if (" " in v or "\t" in v) and '"' not in v else v


def hops(alias: str, target: Target, session_port: int) -> list[Hop]:
    """The session's hops, the jump host's (if the inventory has one) first."""
    checking = {"strict": "yes", "accept-new": "accept-new", "off": "no"}.get(target.host_key_policy, "yes")
    identity = os.path.expanduser(target.identity_file) if target.identity_file else None
    out: list[Hop] = []
    before = None
    if target.jump_host:
        j = jump_target(target.jump_host, target)
        out.append(Hop(alias + "-jump", j.address, j.port, j.user, identity, None, None, checking))
        before = alias + "-jump"
    out.append(Hop(alias + "-host", target.address, target.port, target.user, identity, before, None, checking))
    session = Hop(alias, "127.0.0.1", session_port, target.user, identity, alias + "-host", alias, checking)
    return [*out, session]


def block(name: str, job: str, hs: Sequence[Hop], known: Path) -> str:
    """The session's block of ~/.ssh/provision/config."""
    lines = [f"{BEGIN}{name} (job {job}): written by `provision dev`, removed by `provision dev --stop {name}`"]
    for h in hs:
        lines.append(f"Host {h.alias}")
        lines.append(f"  HostName {_value(h.address)}")
        if h.port:
            lines.append(f"  Port {h.port}")
        if h.user:
            lines.append(f"  User {_value(h.user)}")
        if h.identity:
            lines += [f"  IdentityFile {_value(h.identity)}", "  IdentitiesOnly yes"]
        if h.jump:
            lines.append(f"  ProxyJump {h.jump}")
        if h.key_alias:
            lines.append(f"  HostKeyAlias {h.key_alias}")
        if h.checking == "no":
            lines += ["  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null"]
        else:
            mine = os.path.expanduser("~/.ssh/known_hosts")
            files = _value(str(known)) + ("" if h.key_alias else " " + _value(mine))
            lines += [f"  StrictHostKeyChecking {h.checking}", f"  UserKnownHostsFile {files}"]
        lines.append("  ServerAliveInterval 30")
    lines.append(f"{END}{name}")
    return "\n".join(lines) + "\n"


def without(text: str, name: str) -> str:
    """`text` without the block of session `name` (the user's lines, and other sessions', as they were)."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if line.startswith(f"{BEGIN}{name} (") or line.rstrip("\n") == f"{BEGIN}{name}":
            skipping = True
            continue
        if skipping and line.rstrip("\n") == f"{END}{name}":
            skipping = False
            continue
        if not skipping:
            out.append(line)
    return "".join(out)


def names_in(text: str) -> list[str]:
    return [line[len(BEGIN) :].split(" ", 1)[0] for line in text.splitlines() if line.startswith(BEGIN)]


def include_line(config: Path) -> str:
    return f"Include {_value(str(config))}\n"


def with_include(text: str, config: Path) -> str | None:
    """~/.ssh/config's text with the Include line at its top, or None when it has it."""
    line = include_line(config)
    if any(x.strip() == line.strip() for x in text.splitlines()):
        return None
    return line + text


def known_lines(name_keys: Iterable[tuple[str, str, str]]) -> str:
    """OpenSSH's known_hosts lines: (the name it is looked up by, key type, base64)."""
    return "".join(f"{name} {typ} {b64}\n" for name, typ, b64 in name_keys)


def _write(path: Path, text: str) -> None:
    """Atomically, mode 0600 (OpenSSH refuses a config others may write)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""


class SshConfig:
    """~/.ssh/provision/config and known_hosts, and the Include line in ~/.ssh/config, of
    the home `home` (default: $HOME, as the user's shell has it)."""

    def __init__(self, home: Path | None = None):
        self.home = home or Path.home()
        self.dir = self.home / ".ssh" / "provision"
        self.config = self.dir / "config"
        self.known = self.dir / "known_hosts"
        self.main = self.home / ".ssh" / "config"

    def names(self) -> list[str]:
        return names_in(_read(self.config))

    def put(self, name: str, job: str, target: Target, port: int, keys: KnownHosts) -> None:
        """Write the session's block and its hosts' keys, then the Include line. SshConfigError
        (one line naming the file) when a file cannot be written; the block is kept then if
        it was written (`ssh -F` reaches it)."""
        hs = hops(f"provision-dev-{name}", target, port)
        try:
            _write(self.config, without(_read(self.config), name) + block(name, job, hs, self.known))
            self._put_keys(hs, keys)
        except OSError as e:
            raise SshConfigError(f"{e.filename or self.config}: cannot write: {e.strerror or e}") from None
        try:
            text = _read(self.main)
            new = with_include(text, self.config)
            if new is not None:
                _write(self.main, new)
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise SshConfigError(f"{self.main}: cannot add the Include line: {why}") from None

    def _put_keys(self, hs: Sequence[Hop], keys: KnownHosts) -> None:
        names = {h.alias for h in hs if h.key_alias} | {key_id(h.address, h.port or 22) for h in hs}
        kept = [line for line in _read(self.known).splitlines(keepends=True) if line.split(" ", 1)[0] not in names]
        new: list[tuple[str, str, str]] = []
        host = next(h for h in hs if h.alias.endswith("-host"))
        for h in hs:
            looked = key_id(host.address, host.port or 22) if h.key_alias else key_id(h.address, h.port or 22)
            for typ, key in (keys.lookup(looked) or {}).items():
                new.append((h.key_alias or looked, typ, base64.b64encode(key.asbytes()).decode()))
        _write(self.known, "".join(kept) + known_lines(new))

    def remove(self, name: str) -> bool:
        """Take the session's block away (its keys stay: a host's keys are a host's). Whether
        there was one."""
        text = _read(self.config)
        if name not in names_in(text):
            return False
        try:
            _write(self.config, without(text, name))
        except OSError as e:
            raise SshConfigError(f"{self.config}: cannot write: {e.strerror or e}") from None
        return True
