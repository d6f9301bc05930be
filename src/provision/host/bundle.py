"""What the controller sends a host so that the agent runs there: one Python program that
installs host/layout.py, protocol.py, ledger.py, hostlib.py, hostfacts.py and agent.py as
modules and calls the agent.

The host runs `python3 -S -c BOOT` (boot_command), which reads the loader's N bytes from
stdin and runs it; the loader reads the modules' sources that follow, and the JSON request
follows them on the same stdin. -S: the agent needs only the
standard library, and skipping site (and the .pth files of whatever the host has installed)
saves start-up time on every call. The stand-ins of host/standins.py take the place of
standard modules whose import would cost the host more than the request's own work.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from . import layout

HERE = Path(__file__).resolve().parent
PACKAGE = "provision.host"
# In dependency order: each may import the ones before it.
MODULES = ("layout", "protocol", "ledger", "hostlib", "hostfacts", "agent")
# Sent along, loaded on the host only when a request needs one (agent.lazy), from the same
# cache as the others: compiling hostcheck cost every network check ~6 ms of a host's CPU.
LAZY = ("hostcheck",)
STANDINS = {"dataclasses": "standins"}

# Compiling the modules is most of what starting the agent costs a host (~10 ms of its
# CPU at every request), so each host keeps them compiled, per source (KEY: the sha256
# the controller computed) and per python3 (cache_tag), in a directory that only the
# agent's own user may write (anything else: compile, as without a cache).
_LOADER = """import sys, os, marshal
M = type(sys)
C = %(cache)r
def _trusted():
    try:
        st = os.stat(C)
    except OSError:
        try:
            os.makedirs(C, 0o700)
            st = os.stat(C)
        except OSError:
            return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022
T = _trusted()
def _code(name, src, key):
    p = "%%s/%%s-%%s.%%s" %% (C, name, key, sys.implementation.cache_tag)
    if T:
        try:
            with open(p, "rb") as f:
                return marshal.load(f)
        except (OSError, ValueError, EOFError, TypeError):
            pass
    code = compile(src, "<provision %%s>" %% name, "exec")
    if T:
        try:
            tmp = "%%s.%%d" %% (p, os.getpid())
            with open(tmp, "wb") as f:
                marshal.dump(code, f)
            os.replace(tmp, p)
            for e in os.listdir(C):
                if e.startswith(name + "-") and e.endswith("." + sys.implementation.cache_tag) and C + "/" + e != p:
                    os.unlink(C + "/" + e)
        except OSError:
            pass
    return code
def _install(name, src, pkg, key):
    m = M(name)
    m.__package__ = pkg
    sys.modules[name] = m
    exec(_code(name, src, key), m.__dict__)
    return m
for _p in ("provision", "provision.host"):
    _m = M(_p)
    _m.__path__ = []
    sys.modules[_p] = _m
"""


def source(module: str) -> str:
    return (HERE / f"{module}.py").read_text()


def _key(module: str) -> str:
    return hashlib.sha256(source(module).encode()).hexdigest()[:20]


# After the loader, each module's source travels as raw bytes (the loader reads their
# lengths from the table _parts writes into it): a host with the modules cached never parses them, where
# source inside the program as string literals cost every request ~2.5 ms of compiling.
_READ = """for _name, _pkg, _key, _n, _how in %(table)r:
    _src = sys.stdin.buffer.read(_n)
    if _how == "lazy":  # compiled (or loaded from the cache) when first used
        sys.modules[%(agent)r].LAZY[_name] = lambda n=_name, s=_src, k=_key: _code(n, s, k)
    elif _how == "module":
        setattr(sys.modules[%(package)r], _name.rsplit(".", 1)[1], _install(_name, _src, _pkg, _key))
    else:
        _install(_name, _src, _pkg, _key)
sys.modules[%(agent)r].main()
sys.stdout.flush()
os._exit(0)  # the answer is out and every file closed: no interpreter teardown (~1.5 ms)
"""


@functools.lru_cache(maxsize=2)
def _parts(cache: str) -> tuple[bytes, bytes]:
    """(the loader program, the sources it reads after itself)."""
    table, sources = [], []
    for name, module in STANDINS.items():
        table.append((name, "", _key(module), "standin"))
        sources.append(source(module).encode())
    for module in MODULES:
        table.append((PACKAGE + "." + module, PACKAGE, _key(module), "module"))
        sources.append(source(module).encode())
    for module in LAZY:
        table.append((module, "", _key(module), "lazy"))
        sources.append(source(module).encode())
    rows = [(n, pkg, key, len(src), how) for (n, pkg, key, how), src in zip(table, sources)]
    program = _LOADER % {"cache": cache} + _READ % {"table": rows, "agent": PACKAGE + ".agent", "package": PACKAGE}
    return program.encode(), b"".join(sources)


@functools.lru_cache(maxsize=2)
def payload(cache: str = layout.AGENT_CACHE) -> bytes:
    """What precedes the request on the agent's stdin (built once per controller process)."""
    program, sources = _parts(cache)
    return program + sources


def boot_command(cache: str = layout.AGENT_CACHE) -> str:
    """What the host runs: python3 reads the loader program from stdin and runs it."""
    n = len(_parts(cache)[0])
    return f'python3 -S -c \'import sys;exec(compile(sys.stdin.buffer.read({n}),"provision-agent","exec"))\''
