"""The standard library the agent uses, at the cost a host can afford on every call.

Every call starts a fresh interpreter (python3 -S), and importing json, base64, hashlib and
subprocess (re, enum, OpenSSL, threading...) costs more CPU than a probe's own work. Their
C cores do the same job: same bytes in and out, the modules themselves only where these
are missing. tests/test_agent_stdlib_shims.py holds each stand-in to its module.
"""

from __future__ import annotations

import os
import time

# mypy reads the guarded imports (it takes any TYPE_CHECKING as true); hosts never import typing
# (~6 ms of their CPU per request), and annotations stay unevaluated (__future__, Python 3.7+).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from _hashlib import HASH
    from typing import Any

# Every call starts a fresh interpreter, and importing json, base64, hashlib and subprocess
# (re, enum, OpenSSL, threading...) cost more CPU than a probe's own work. Their C cores
# do the same job: same bytes in and out, the modules themselves only where these are missing.
try:
    import _json

    class json:  # noqa: N801 - stands in for the module: loads and dumps as json does them
        _scan = _json.make_scanner(
            type(
                "ctx",
                (),
                {
                    "strict": True,
                    "object_hook": None,
                    "object_pairs_hook": None,
                    "parse_float": float,
                    "parse_int": int,
                    "memo": {},
                    "parse_constant": {
                        "-Infinity": float("-inf"),
                        "Infinity": float("inf"),
                        "NaN": float("nan"),
                    }.__getitem__,
                },
            )()
        )
        _str = _json.encode_basestring_ascii

        @staticmethod
        def loads(s: str) -> Any:
            ws = " \t\n\r"
            try:
                obj, end = json._scan(s, len(s) - len(s.lstrip(ws)))
                if not s[end:].strip(ws):
                    return obj
            except (StopIteration, SystemError):  # SystemError: the C scanner's error path needs json.decoder
                pass
            import json as module  # not JSON: the module raises exactly what it would have

            return module.loads(s)

        @staticmethod
        def dumps(o: Any) -> str:
            if isinstance(o, str):
                return json._str(o)
            if o is None or o is True or o is False:
                return {None: "null", True: "true", False: "false"}[o]
            if isinstance(o, int):
                return int.__repr__(o)
            if isinstance(o, float):
                return (
                    float.__repr__(o)
                    if o == o and abs(o) != float("inf")
                    else ("NaN" if o != o else "Infinity" if o > 0 else "-Infinity")
                )
            if isinstance(o, dict):
                return "{" + ", ".join(json._str(json._key(k)) + ": " + json.dumps(v) for k, v in o.items()) + "}"
            if isinstance(o, (list, tuple)):
                return "[" + ", ".join(json.dumps(v) for v in o) + "]"
            raise TypeError("Object of type %s is not JSON serializable" % type(o).__name__)

        @staticmethod
        def _key(k: object) -> str:
            if isinstance(k, str):
                return k
            if k is None or isinstance(k, (bool, int, float)):
                return json.dumps(k)
            raise TypeError("keys must be str, int, float, bool or None, not %s" % type(k).__name__)
except (ImportError, AttributeError):
    import json  # type: ignore[assignment]  # the module itself, where _json is missing


class base64:  # noqa: N801 - the two calls the agent makes, straight from binascii
    # binascii imported by the calls that use it: where it is a shared library, loading it
    # cost every call ~1 ms, and most calls (a probe, a start) send nothing in base64.
    @staticmethod
    def b64encode(data: bytes) -> bytes:
        import binascii  # here: see above

        return binascii.b2a_base64(data, newline=False)

    @staticmethod
    def b64decode(s: str | bytes) -> bytes:
        import binascii  # here: see above

        return binascii.a2b_base64(s)


def _sha256() -> HASH:
    """The interpreter's own SHA-256 (no OpenSSL to load), else hashlib's."""
    for name in ("_sha256", "_sha2"):
        try:
            h: HASH = __import__(name).sha256()  # the same methods as hashlib's
            return h
        except (ImportError, AttributeError):
            pass
    import hashlib  # only where the C cores are missing (OpenSSL's import time)

    return hashlib.sha256()


try:  # what subprocess resets in its children; _signal, not signal (its enums cost time)
    import _signal

    _SIGDEF: tuple[int, ...] = (_signal.SIGPIPE, _signal.SIGXFSZ)
except (ImportError, AttributeError):
    _SIGDEF = ()


def sha256_file(path: str) -> str:
    if os.path.getsize(path) > 1 << 20:  # big files: OpenSSL's SHA-256 is worth loading
        import hashlib

        h = hashlib.sha256()
    else:
        h = _sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as e:
        return {"_unreadable": str(e)}


def run(argv: list[str], timeout: float = 60) -> tuple[int, str, str]:  # noqa: C901  posix_spawn's pipes, timeout and clean-up in one place (subprocess costs a probe more)
    """(exit code, stdout, stderr) of argv: subprocess.run with pipes and a timeout, done
    with posix_spawn (Python 3.8+), because importing subprocess costs more CPU than a
    probe's own work."""
    if not hasattr(os, "posix_spawnp"):
        return _run_subprocess(argv, timeout)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            os.environ,
            setsigdef=_SIGDEF,
            file_actions=[(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)],
        )
    except FileNotFoundError:
        os.close(out_r)
        os.close(err_r)
        return 127, "", argv[0] + ": not found"
    finally:
        os.close(out_w)
        os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    import select  # only a call that runs a program needs it (a shared library on some hosts)

    poller = select.poll()
    for fd in chunks:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    left, status = len(chunks), None
    try:
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            for fd, _ in poller.poll(wait * 1000):
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    poller.unregister(fd)
                    left -= 1
        while not left:  # both pipes closed: reap it, still within the timeout
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
    finally:
        os.close(out_r)
        os.close(err_r)
    if status is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return 124, "", timed_out(argv[0], timeout)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, b"".join(chunks[out_r]).decode("utf-8", "replace"), b"".join(chunks[err_r]).decode("utf-8", "replace")


def timed_out(program: str, timeout: float) -> str:
    return program + ": timed out after %ss" % timeout


def _run_subprocess(argv: list[str], timeout: float) -> tuple[int, str, str]:
    import subprocess  # only without posix_spawnp (Python < 3.8): its import time

    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
        return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    except FileNotFoundError:
        return 127, "", argv[0] + ": not found"
    except subprocess.TimeoutExpired:
        return 124, "", timed_out(argv[0], timeout)


def dropins(bases: Any, prefix: str, suffix: str) -> list[str]:
    """Every BASE/PREFIX*.d/*SUFFIX file of the bases (layout.DROPIN_BASES), sorted, as
    probe.sh's glob finds them: hidden names left out, a base whose top is a link skipped."""
    out = []
    for b in bases:
        if os.path.islink("/" + b.split("/")[1]):
            continue
        try:
            names = os.listdir(b)
        except OSError:
            continue
        for d in names:
            if not (d.startswith(prefix) and d.endswith(".d")):
                continue
            try:
                confs = os.listdir(b + "/" + d)
            except OSError:
                continue
            out += [b + "/" + d + "/" + c for c in confs if c.endswith(suffix) and not c.startswith(".")]
    return sorted(out)


def dual_stack_listener(socket: Any, port: int, backlog: int) -> Any:
    """A TCP listener on every address of the host (IPv6 and IPv4 where it has both, else
    IPv4), from the socket module given (socket.py or _socket: the callers' import costs
    differ). EADDRINUSE is the same on either family: raised at once."""
    last = None
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        s = None
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((addr, port))
            s.listen(backlog)
            return s
        except OSError as e:
            if s is not None:
                s.close()
            last = e
            if e.errno == 98:
                break
    assert last is not None
    raise last
