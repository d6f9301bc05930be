"""`provision serve --install` / `--uninstall`: the service as a systemd unit on the machine
it runs on.

The unit restarts the service always (RestartSec= apart, and never gives up), starts after
the network is up, and runs as one user: the one whose SSH keys and known hosts reach the
hosts. That is the user who ran `sudo provision serve --install` (SUDO_USER), or the one
`--user` names; root only when root ran it without sudo and named nobody. Secrets (a
PostgreSQL password, the secret_env of handed-over work) go in SERVE_ENV, read by systemd
as root before it drops to that user, so they need not be readable by it.

Every value in the unit is written so that systemd reads it back intact and no value can
add a line or a directive: ExecStart= through core/encode (render's rules for task units),
paths with `%` doubled and no control character or backslash, the user a plain name.

This module imports only the standard library and core/ (no click, no network): the
integration test runs it inside a sandbox host, where provision's other dependencies are
not installed.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from provision.core.encode import exec_line
from provision.core.errors import ProvisionError

UNIT = "provision-serve.service"
UNIT_DIR = Path("/etc/systemd/system")
SERVE_ENV = "/etc/provision/serve.env"  # KEY=value lines; optional ("-"): absent, nothing is read
RESTART_SEC = 5
# What useradd accepts (and systemd's User= checks): no quoting can be needed.
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\\]")


def _path_value(value: str, what: str) -> str:
    """A path as a unit file's value: absolute, one line, nothing systemd would read
    differently (a backslash would join the next line; `%` starts a specifier)."""
    if not value.startswith("/") or value != value.strip() or _CONTROL.search(value):
        raise ProvisionError(
            f"{what} {value!r}: an absolute path without control characters, backslashes or surrounding spaces is needed"
        )
    return value.replace("%", "%%")


def unit_text(
    exe: str, args: Sequence[str], user: str | None, env_file: str | None, *, workdir: str | None = None
) -> str:
    """The unit (pure): ExecStart= is `exe` with `args`; User= when given (else root);
    EnvironmentFile= (optional: a missing file is no error) when given; WorkingDirectory=
    when given, so that relative paths in `args` mean what they meant where it was typed."""
    if user is not None and not _USER.fullmatch(user):
        raise ProvisionError(f"--user {user!r}: not a user name")
    service = [f"ExecStart={exec_line([exe, *args])}"]
    if user is not None:
        service.append(f"User={user}")
    if workdir is not None:
        service.append(f"WorkingDirectory={_path_value(workdir, 'working directory')}")
    if env_file is not None:
        service.append(f"EnvironmentFile=-{_path_value(env_file, 'environment file')}")
    lines = [
        f"# Written by `provision serve --install`; `provision serve --uninstall` removes it. Secrets: {SERVE_ENV}.",
        "[Unit]",
        "Description=provision serve: the team's handed-over studies and queued applies",
        "Wants=network-online.target",
        "After=network-online.target",
        "StartLimitIntervalSec=0",  # Restart=always means always: no start limit to give up at
        "",
        "[Service]",
        "Type=simple",
        *service,
        "Environment=PYTHONUNBUFFERED=1",  # each line reaches the journal as it is printed
        "Restart=always",
        f"RestartSec={RESTART_SEC}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"


def service_user(user: str | None) -> tuple[pwd.struct_passwd, str]:
    """The user the service runs as, and why that one (said to the installer)."""
    sudo = os.environ.get("SUDO_USER", "").strip()
    if user:
        name, why = user, "named by --user"
    elif sudo and sudo != "root":
        name, why = sudo, "who ran sudo; --user names another"
    else:
        name, why = "root", "no --user, and not run through sudo; --user names another"
    try:
        return pwd.getpwnam(name), why
    except KeyError:
        raise ProvisionError(f"--user {name}: no such user on this machine") from None


def _can_enter(pw: pwd.struct_passwd, path: str) -> bool:
    """Whether `pw` may cd into path (every directory on the way searchable by it): the
    unit's WorkingDirectory=, which it cannot start without."""
    if pw.pw_uid == 0:
        return True
    groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
    p = Path(path)
    for d in [*reversed(p.parents), p]:
        try:
            st = d.stat()
        except OSError:
            return False
        bit = 0o100 if st.st_uid == pw.pw_uid else 0o010 if st.st_gid in groups else 0o001
        if not st.st_mode & bit:
            return False
    return True


def _systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        why = (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}").splitlines()[-1]
        raise ProvisionError(f"systemctl {' '.join(args)} failed: {why}")
    return r


def _as_root(verb: str) -> None:
    if os.geteuid() != 0:
        raise ProvisionError(
            f"serve {verb} changes {UNIT_DIR / UNIT} and systemd's services: run it as root "
            f"(sudo provision serve {verb} ...)"
        )
    if not Path("/run/systemd/system").is_dir():
        raise ProvisionError(
            "this machine does not run systemd: run `provision serve` under another supervisor "
            "(supervisord, a container, tmux) instead"
        )


def _write(path: Path, text: str) -> None:
    """0644, whole or not at all (a temp file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def install(args: Sequence[str], user: str | None) -> list[str]:
    """Write the unit (0644), reload systemd, enable and start it; the lines to print.
    args: serve's own arguments (`--install` and `--user` left out); the unit runs
    `python -m provision serve ARGS` with this Python, from the current directory."""
    _as_root("--install")
    pw, why = service_user(user)
    here = os.getcwd()
    if not _can_enter(pw, here):
        raise ProvisionError(
            f"{pw.pw_name} cannot enter {here}, where the service would start (relative paths in its arguments "
            f"mean what they mean here): run --install from a directory {pw.pw_name} can enter"
        )
    text = unit_text(sys.executable, ["-m", "provision", "serve", *args], pw.pw_name, SERVE_ENV, workdir=here)
    path = UNIT_DIR / UNIT
    try:
        before = path.read_text()
    except FileNotFoundError:
        before = None
    except OSError as e:
        raise ProvisionError(f"{path}: cannot read it: {e.strerror}") from None
    try:
        _write(path, text)
    except OSError as e:
        raise ProvisionError(f"{path}: cannot write it: {e.strerror}") from None
    _systemctl("daemon-reload")
    _systemctl("enable", "--now", UNIT)
    if before is not None and before != text:
        _systemctl("restart", UNIT)  # running with the old unit: enable --now left it so
    lines = [
        f"{'Updated' if before is not None and before != text else 'Wrote'} {path}.",
        f"Enabled and started {UNIT}: it restarts whenever it ends, and starts at boot.",
        f"It runs as {pw.pw_name} ({why}): it reaches the hosts with the SSH keys and known hosts in {pw.pw_dir}/.ssh.",
    ]
    ssh = Path(pw.pw_dir) / ".ssh"
    try:
        keys = [p for p in ssh.glob("id_*") if not p.name.endswith(".pub")]
    except OSError:
        keys = []
    if not keys:
        lines.append(
            f"Note: {ssh} has no id_* key: the inventories' identity_file must be readable by {pw.pw_name}, "
            "or an ssh-agent socket given to the service."
        )
    lines += [
        f"Secrets it needs (a database password, the secret_env of handed-over work): KEY=value lines in {SERVE_ENV} "
        f"(root's, mode 0600; read by systemd before it becomes {pw.pw_name}), then `systemctl restart {UNIT}`.",
        f"Follow it: `systemctl status {UNIT}`, `journalctl -u {UNIT} -f`. Remove it: `provision serve --uninstall`.",
    ]
    return lines


def uninstall() -> list[str]:
    """Stop and disable the unit, remove it, reload systemd; the lines to print. Once it is
    gone, again says so and changes nothing."""
    _as_root("--uninstall")
    path = UNIT_DIR / UNIT
    if not path.exists():
        return [f"{UNIT} is not installed ({path} does not exist): nothing to remove."]
    _systemctl("disable", "--now", UNIT)
    path.unlink(missing_ok=True)
    _systemctl("daemon-reload")
    _systemctl("reset-failed", UNIT, check=False)  # forget its failures: nothing to show any more
    return [
        f"Stopped and disabled {UNIT}, removed {path}.",
        f"{SERVE_ENV} is kept if it exists (remove it yourself: it may hold secrets). The handed-over work "
        "stays in the state backend: the next `provision serve` takes it up.",
    ]
