"""`provision serve --install` / `--uninstall` for real, inside a sandbox
host (systemd is its PID 1). The host has Python but not provision's dependencies, and
serve/install.py needs none: the test copies it (and the core/ modules it imports) to
/opt/pv on the host, with a stand-in `provision/__main__.py` that records who runs it and
with which arguments, then sleeps. install() runs as root from /opt/pv, so the unit's
WorkingDirectory= is /opt/pv and `python3 -m provision` finds the copy: systemd itself
reads the unit, starts the stand-in as the user and hands it the (hostile) arguments."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from clirun import sh, wait_until

pytestmark = pytest.mark.integration

SRC = Path(__file__).resolve().parents[2] / "src" / "provision"
COPIED = [
    "__init__.py",
    "core/__init__.py",
    "core/encode.py",
    "core/errors.py",
    "serve/__init__.py",
    "serve/install.py",
]
STAND_IN = """\
import json, os, pwd, sys, time
with open("/tmp/serve-ran.json", "w") as f:
    json.dump({"user": pwd.getpwuid(os.getuid()).pw_name, "argv": sys.argv[1:], "cwd": os.getcwd()}, f)
time.sleep(3600)
"""
ARGS = ["--state", "postgresql://db/team", "a b", "$HOME", "%n", 'say "hi"; rm -rf /', "line\nUser=root"]
UNIT = "/etc/systemd/system/provision-serve.service"


@pytest.fixture(scope="module")
def host(sandbox_factory):
    sb = sandbox_factory(hosts=1)
    for rel in COPIED:
        put(sb, f"/opt/pv/provision/{rel}", (SRC / rel).read_bytes())
    put(sb, "/opt/pv/provision/__main__.py", STAND_IN.encode())
    sh(sb, "host-1", "id ana >/dev/null 2>&1 || useradd -m ana", check=True)
    yield sb
    sandbox_factory.down(sb)


def put(sb, path: str, data: bytes) -> None:
    b64 = base64.b64encode(data).decode()
    sh(sb, "host-1", f"mkdir -p $(dirname {path}) && echo {b64} | base64 -d > {path} && chmod 644 {path}", check=True)


def py(sb, call: str, *, env: str = "", user: str = "") -> tuple[int, list[str]]:
    """serve/install's `call` on the host, from /opt/pv: (exit code, the lines it returned or the error)."""
    script = (
        "import sys\nfrom provision.core.errors import ProvisionError\nfrom provision.serve.install import *\n"
        f"try:\n    print('\\n'.join({call}))\nexcept ProvisionError as e:\n    print('Error: ' + e.message); sys.exit(1)\n"
    )
    b64 = base64.b64encode(script.encode()).decode()
    run = f"echo {b64} | base64 -d | {env} python3 -"
    if user:
        run = f"runuser -u {user} -- sh -c '{run}'"
    out = sh(sb, "host-1", f"cd /opt/pv && {run}")
    return out.code, out.splitlines()


def test_install_then_uninstall_on_a_real_systemd(host):
    sh(host, "host-1", "rm -f /tmp/serve-ran.json")
    code, lines = py(host, f"install({ARGS!r}, None)", env="SUDO_USER=ana")
    assert code == 0, lines
    assert any("It runs as ana (who ran sudo" in line for line in lines), lines
    assert sh(host, "host-1", f"stat -c %a {UNIT}").strip() == "644"
    assert sh(host, "host-1", "systemctl is-enabled provision-serve").strip() == "enabled"
    # systemd read the unit back as written: the stand-in runs as ana, from /opt/pv, with
    # every argument intact (none split, expanded or turned into a directive).
    ran = wait_until(lambda: sh(host, "host-1", "cat /tmp/serve-ran.json 2>/dev/null").strip(), what="the service")
    assert json.loads(ran) == {"user": "ana", "argv": ["serve", *ARGS], "cwd": "/opt/pv"}
    props = sh(host, "host-1", "systemctl show -p Restart,User,ActiveState provision-serve")
    assert "Restart=always" in props and "User=ana" in props and "ActiveState=active" in props, props

    # It restarts when it ends.
    pid = sh(host, "host-1", "systemctl show -p MainPID --value provision-serve").strip()
    sh(host, "host-1", f"kill -9 {pid}", check=True)
    wait_until(
        lambda: sh(host, "host-1", "systemctl show -p MainPID --value provision-serve").strip() not in ("0", pid),
        timeout=30,
        what="the restart",
    )

    # Installing again (another user) updates the unit in place.
    code, lines = py(host, "install(['--state', 'x'], 'root')")
    assert code == 0 and lines[0] == f"Updated {UNIT}.", lines
    assert "User=root" in sh(host, "host-1", "systemctl show -p User provision-serve")

    code, lines = py(host, "uninstall()")
    assert code == 0 and lines[0].startswith("Stopped and disabled"), lines
    assert sh(host, "host-1", f"test -e {UNIT}").code != 0
    assert sh(host, "host-1", "systemctl is-active provision-serve").strip() in ("inactive", "unknown")
    assert sh(host, "host-1", "systemctl is-enabled provision-serve").code != 0
    code, lines = py(host, "uninstall()")  # again: nothing to do, and it says so
    assert code == 0 and "not installed" in lines[0], lines


def test_not_root_is_refused_in_one_line_and_nothing_is_written(host):
    code, lines = py(host, "install([], None)", user="ana")
    assert code == 1 and len(lines) == 1 and "run it as root" in lines[0], lines
    assert sh(host, "host-1", f"test -e {UNIT}").code != 0
