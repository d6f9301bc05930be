"""What the controller sends a host so that the agent runs there: one Python program that
installs host/layout.py, protocol.py, ledger.py and agent.py as modules and calls the agent.

The host runs `python3 -S -c BOOT` (boot_command), which reads the bundle's N bytes from
stdin and runs it; the JSON request follows on the same stdin. -S: the agent needs only the
standard library, and skipping site (and the .pth files of whatever the host has installed)
saves start-up time on every call. The stand-ins of host/standins.py take the place of
standard modules whose import would cost the host more than the request's own work.
"""

from __future__ import annotations

import functools
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "provision.host"
# In dependency order: each may import the ones before it.
MODULES = ("layout", "protocol", "ledger", "agent")
# Sent along, compiled on the host only when a request needs one (agent.lazy): compiling
# is most of what a module costs a host, and most requests never use these.
LAZY = ("hostcheck",)
STANDINS = {"dataclasses": "standins"}

_LOADER = """import sys
M = type(sys)
def _install(name, src, pkg):
    m = M(name)
    m.__package__ = pkg
    sys.modules[name] = m
    exec(compile(src, "<provision %s>" % name, "exec"), m.__dict__)
    return m
for _p in ("provision", "provision.host"):
    _m = M(_p)
    _m.__path__ = []
    sys.modules[_p] = _m
"""


def source(module: str) -> str:
    return (HERE / f"{module}.py").read_text()


@functools.lru_cache(maxsize=1)
def payload() -> bytes:
    """The program sent with every agent request (built once per controller process)."""
    parts = [_LOADER]
    for name, module in STANDINS.items():
        parts.append(f"_install({name!r}, {source(module)!r}, '')\n")
    for module in MODULES:
        parts.append(
            f"setattr(sys.modules[{PACKAGE!r}], {module!r}, "
            f"_install({PACKAGE + '.' + module!r}, {source(module)!r}, {PACKAGE!r}))\n"
        )
    lazy = {module: source(module) for module in LAZY}
    parts.append(f"sys.modules[{PACKAGE + '.agent'!r}].LAZY.update({lazy!r})\n")
    parts.append(f"sys.modules[{PACKAGE + '.agent'!r}].main()\n")
    return "".join(parts).encode()


def boot_command() -> str:
    n = len(payload())
    return f'python3 -S -c \'import sys;exec(compile(sys.stdin.buffer.read({n}),"provision-agent","exec"))\''
