"""What the controller sends a host so that the agent runs there: one Python program that
makes host/layout.py, protocol.py, ledger.py, hostlib.py, hostfacts.py, agent.py and
hostcheck.py importable (a finder on sys.meta_path) and calls the agent.

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
import threading
from pathlib import Path

from . import layout

HERE = Path(__file__).resolve().parent
PACKAGE = "provision.host"
# What every request imports (the agent and what it imports at its top).
MODULES = ("trust", "layout", "protocol", "ledger", "hostlib", "agent")
# Sent along too, but imported only by the requests that use it (agent.lazy): compiling
# hostcheck cost every network check ~6 ms of a host's CPU; a write or a start reads no facts.
LAZY = (
    "hostfacts",
    "hostcheck",
    "outdirs",
    "setups",
    "preempt",
    "unitgc",
    "health",
    "fabric",
    "topology",
    "logins",
    "devop",
    "stacks",
    "fresh",
)
STANDINS = {"dataclasses": "standins"}

# Compiling the modules is most of what starting the agent costs a host (~10 ms of its
# CPU at every request), so each host keeps them compiled, per source (KEY: the sha256
# the controller computed) and per python3 (cache_tag), in a directory host/trust.py
# passes from / down (anything else: compile, as without a cache), files opened without
# following links.
_LOADER = """import sys, os, marshal
C = %(cache)r
T = False  # the cache is used once host/trust.py (compiled without it) says it may be
def _trusted():
    from provision.host import trust
    if trust.problem(C):
        return False
    try:
        os.makedirs(C, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    return trust.problem(C) is None
# A file in the cache is loaded only when it is a regular file of one link, owned by this
# user, that only it may write: the directory's owner and mode may have been fixed after
# someone else replaced its files (a file that fails is compiled again and replaced).
def _mine(fd):
    st = os.fstat(fd)
    return st.st_mode & 0o170022 == 0o100000 and st.st_uid == os.geteuid() and st.st_nlink == 1
def _code(name, src, key):
    p = "%%s/%%s-%%s.%%s" %% (C, name, key, sys.implementation.cache_tag)
    if T:
        try:
            with os.fdopen(os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
                if _mine(f.fileno()):
                    return marshal.load(f)
        except (OSError, ValueError, EOFError, TypeError):
            pass
    code = compile(src, "<provision %%s>" %% name, "exec")
    if T:
        try:
            tmp = "%%s.%%d" %% (p, os.getpid())
            try:
                os.unlink(tmp)  # whatever is there (a link someone left): never written through
            except FileNotFoundError:
                pass
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
                marshal.dump(code, f)
            os.replace(tmp, p)
            for e in os.listdir(C):
                if e.startswith(name + "-") and e.endswith("." + sys.implementation.cache_tag) and C + "/" + e != p:
                    os.unlink(C + "/" + e)
        except OSError:
            pass
    return code
# The import system's finder and loader for the modules this program carries: each is
# compiled (or loaded from the cache) only when something imports it.
class _Bundle:
    def __init__(self):
        self.src = {}
    def find_spec(self, name, path=None, target=None):
        if name in PKGS:
            return SPEC(name, self, is_package=True)
        return SPEC(name, self) if name in self.src else None
    def create_module(self, spec):
        return None
    def exec_module(self, m):
        if m.__name__ in self.src:
            exec(_code(m.__name__, *self.src[m.__name__]), m.__dict__)
# importlib.machinery.ModuleSpec, taken from a module already loaded: importing importlib
# would cost every request ~0.4 ms.
SPEC = type(sys.__spec__)
PKGS = ("provision", "provision.host")
B = _Bundle()
sys.meta_path.insert(0, B)
"""


def source(module: str) -> str:
    return (HERE / f"{module}.py").read_text()


def _key(module: str) -> str:
    return _digest(source(module).encode())


def _digest(src: bytes) -> str:
    return hashlib.sha256(src).hexdigest()[:20]


# After the loader, each module's source travels as raw bytes (the loader reads their
# lengths from the table _parts writes into it): a host with the modules cached never parses them, where
# source inside the program as string literals cost every request ~2.5 ms of compiling.
_READ = """for _name, _key, _n in %(table)r:
    B.src[_name] = (sys.stdin.buffer.read(_n), _key)
T = _trusted()
from provision.host import agent
agent.main()
sys.stdout.flush()
os._exit(0)  # the answer is out and every file closed: no interpreter teardown (~1.5 ms)
"""

# Built once per controller process under this lock: a step's worker threads all ask at
# once, and lru_cache alone let each of them read and hash every module (up to
# one build per host, ~2 ms of CPU each).
_building = threading.Lock()


def _parts(cache: str) -> tuple[bytes, bytes]:
    """(the loader program, the sources it reads after itself)."""
    with _building:
        return _built_parts(cache)


@functools.lru_cache(maxsize=2)
def _built_parts(cache: str) -> tuple[bytes, bytes]:
    named = [*STANDINS.items(), *((PACKAGE + "." + m, m) for m in (*MODULES, *LAZY))]
    sources = [source(module).encode() for _, module in named]
    rows = [(name, _digest(src), len(src)) for (name, _), src in zip(named, sources)]
    program = _LOADER % {"cache": cache} + _READ % {"table": rows}
    return program.encode(), b"".join(sources)


def payload(cache: str = layout.AGENT_CACHE) -> bytes:
    """What precedes the request on the agent's stdin (built once per controller process)."""
    with _building:
        return _built_payload(cache)


@functools.lru_cache(maxsize=2)
def _built_payload(cache: str) -> bytes:
    program, sources = _built_parts(cache)
    return program + sources


def boot_command(cache: str = layout.AGENT_CACHE) -> str:
    """What the host runs: python3 reads the loader program from stdin and runs it."""
    n = len(_parts(cache)[0])
    return f'python3 -S -c \'import sys;exec(compile(sys.stdin.buffer.read({n}),"provision-agent","exec"))\''
