"""The fabric between hosts, measured from the hosts (the agent's `fabric` request). Runs on
hosts: stdlib only, imported only by the requests that use it (bundle.LAZY).

- look: the tools this host has to measure with (nccl-tests' all_reduce_perf, Open MPI's
  mpirun, torch for python3);
- tcp: this host's part of a ring all-reduce's traffic over plain TCP: 2(n-1) steps per
  iteration, each sending a chunk of size/n to the next member and receiving one from the
  previous, a step's send waiting for the step before's receive (as a ring all-reduce's
  data depends on it), so the slowest link sets the pace of the whole ring;
- torch: one torch.distributed all_reduce per iteration (gloo on CPU, NCCL on GPUs), run by
  the host's python3;
- nccl: all_reduce_perf under mpirun from this host (the group's first; mpirun starts the
  others as MPI does); its output goes back as text, read on the controller.

Every wait is bounded: the members join within req.join seconds, the transfer ends within
req.timeout; a member that does not come is named by its rank.
"""

from __future__ import annotations

import os
import sys
import time

from . import protocol as P
from .hostlib import dual_stack_listener, json, run

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAGIC = b"PVFB"
TOKEN_BYTES = 32  # the controller's token, hex
HEADER = len(MAGIC) + TOKEN_BYTES + 4  # magic, token, the dialer's rank
FLAG = 8  # each chunk's head: 1 in its first byte when this iteration is the last
MAX_ITERATIONS = 200
OUTPUT_KEPT = 16384  # of a tool's output, the tail sent back
# Where nccl-tests is often built, besides PATH.
NCCL_TESTS_DIRS = ("/opt/nccl-tests/build", "/usr/local/nccl-tests/build", "/opt/nccl_tests/build")


def op_fabric(req: Any) -> Any:
    if req.action == "look":
        return P.FabricReport(tools=look())
    if req.action == "tcp":
        return tcp_ring(req)
    if req.action == "torch":
        return torch_ring(req)
    if req.action == "nccl":
        return nccl_tests(req)
    return P.FabricReport(error="unknown fabric action %r" % (req.action,))


# --------------------------------------------------------------------------- look


def which(name: str, extra: tuple[str, ...] = ()) -> str | None:
    for d in os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":") + list(extra):
        p = os.path.join(d or ".", name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def look() -> dict[str, Any]:
    out: dict[str, Any] = {"all_reduce_perf": which("all_reduce_perf", NCCL_TESTS_DIRS), "mpirun": None}
    mpirun = which("mpirun")
    if mpirun:
        code, so, se = run([mpirun, "--version"], timeout=10)
        text = so + se
        out["mpirun"] = "open-mpi" if ("Open MPI" in text or "OpenRTE" in text) else "other"
    # find_spec, not import: torch's import costs seconds; run by the host's python3 with its
    # site (the agent runs under -S, without the paths where torch is installed).
    code, so, _ = run(
        [sys.executable or "python3", "-c", "import importlib.util as u; print(u.find_spec('torch') is not None)"],
        timeout=20,
    )
    out["torch"] = code == 0 and so.strip() == "True"
    return out


# --------------------------------------------------------------------------- tcp


class Failed(Exception):
    def __init__(self, message: str, peer: int | None = None):
        Exception.__init__(self, message)
        self.message, self.peer = message, peer


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        import errno  # lazy: only a failure is explained

        words = {
            errno.ECONNREFUSED: "connection refused",
            errno.EHOSTUNREACH: "no route to host",
            errno.ENETUNREACH: "network unreachable",
            errno.ECONNRESET: "connection reset",
            errno.EPIPE: "connection closed",
            errno.ETIMEDOUT: "timed out",
        }
        return words.get(e.errno, e.strerror or str(e))
    return str(e) or type(e).__name__


def _recv_exact(sock: Any, view: Any, deadline: float) -> None:
    got, n = 0, len(view)
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Failed("timed out")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except OSError as e:
            raise Failed("timed out" if "timed out" in str(e) else _why(e)) from None
        if k == 0:
            raise Failed("connection closed")
        got += k


def _dial(socket: Any, req: Any, rank: int, deadline: float) -> Any:
    """The next member's listener, tried until it answers or the join deadline passes (its
    listener may not be up yet: every member starts at about the same time)."""
    address, port = req.peers[rank][0], int(req.peers[rank][1])
    last = "not tried"
    while time.monotonic() < deadline:
        try:
            infos = socket.getaddrinfo(address, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise Failed("%s: unknown name" % address, rank) from None
        for family, kind, proto, _, sockaddr in infos:
            s = socket.socket(family, kind, proto)
            s.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
            try:
                s.connect(sockaddr)
                s.sendall(
                    MAGIC + req.token.encode()[:TOKEN_BYTES].ljust(TOKEN_BYTES, b"-") + req.rank.to_bytes(4, "big")
                )
                return s
            except OSError as e:
                s.close()
                last = _why(e)
        time.sleep(0.1)
    raise Failed("could not reach %s:%d within %gs (%s)" % (address, port, req.join, last), rank)


def _accept(socket: Any, listener: Any, req: Any, rank: int, deadline: float, into: list[Any]) -> None:
    """The previous member's connection: whoever else connects (without the token, or as
    another rank) is closed and waited past."""
    want = MAGIC + req.token.encode()[:TOKEN_BYTES].ljust(TOKEN_BYTES, b"-") + rank.to_bytes(4, "big")
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            into.append(Failed("rank %d did not connect within %gs" % (rank, req.join), rank))
            return
        listener.settimeout(left)
        try:
            c, _ = listener.accept()
        except OSError:
            continue  # the timeout: the loop's deadline says
        head = bytearray(HEADER)
        try:
            _recv_exact(c, memoryview(head), min(deadline, time.monotonic() + 5))
        except (OSError, Failed):
            c.close()
            continue
        if bytes(head) != want:
            c.close()
            continue
        into.append(c)
        return


def tcp_ring(req: Any) -> Any:  # noqa: C901  the ring's forming, its timed steps and their bounds in one place, on the host
    import socket  # lazy, as this module: only a measurement pays their import time
    import threading  # (as socket)

    n, rank = len(req.peers), req.rank
    if n < 2 or not 0 <= rank < n:
        return P.FabricReport(error="a ring needs two members or more, and this host among them")
    start = time.monotonic()
    joined_by = start + req.join
    try:
        listener = dual_stack_listener(socket, int(req.peers[rank][1]), 16)
    except OSError as e:
        return P.FabricReport(error="cannot listen on port %s: %s" % (req.peers[rank][1], _why(e)))
    got: list[Any] = []
    acceptor = threading.Thread(target=_accept, args=(socket, listener, req, (rank - 1) % n, joined_by, got))
    acceptor.daemon = True
    acceptor.start()
    out = inp = None
    try:
        try:
            out = _dial(socket, req, (rank + 1) % n, joined_by)
        finally:
            acceptor.join(max(0.0, joined_by - time.monotonic()) + 1)
        if not got:
            raise Failed("rank %d did not connect within %gs" % ((rank - 1) % n, req.join), (rank - 1) % n)
        if isinstance(got[0], Failed):
            raise got[0]
        inp = got[0]
        return _steps(req, n, rank, out, inp, threading)
    except Failed as e:
        return P.FabricReport(error=e.message, peer=e.peer)
    finally:
        for s in (out, inp, listener):
            if s is not None:
                s.close()


class _Sender:
    """The ring's sends, on a thread of their own: a member receives while it sends (every
    member sends at once; with chunks past the sockets' buffers, none would receive)."""

    def __init__(self, out: Any, size: int, threading: Any):
        import queue  # lazy: only a measurement pays its import time

        self.out, self.payload = out, bytearray(FLAG + size)
        self.todo: Any = queue.SimpleQueue()
        self.problems: list[BaseException] = []
        self.sent = 0
        self.thread = threading.Thread(target=self._run)
        self.thread.daemon = True
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                item = self.todo.get()
                if item is None:
                    return
                flag, size, deadline, counted = item
                self.payload[0] = flag
                self.out.settimeout(max(0.001, deadline - time.monotonic()))
                self.out.sendall(memoryview(self.payload)[: FLAG + size])
                self.sent += size if counted else 0
        except (OSError, ValueError) as e:
            self.problems.append(e)

    def send(self, flag: int, size: int, deadline: float, counted: bool = True) -> None:
        self.check()
        self.todo.put((flag, size, deadline, counted))

    def check(self) -> None:
        if self.problems:
            why = _why(self.problems[0])
            raise Failed("timed out" if "timed out" in why else "sending: %s" % why, 1)

    def finish(self, deadline: float) -> None:
        self.todo.put(None)
        self.thread.join(max(0.0, deadline - time.monotonic()))
        self.check()
        if self.thread.is_alive():
            raise Failed("timed out", 1)


def _steps(req: Any, n: int, rank: int, out: Any, inp: Any, threading: Any) -> Any:
    """Two laps of a small chunk around the ring (everyone is there; go), then iterations
    of 2(n-1) steps until rank 0 says the last one (its flag travels with the chunks: every
    member has it within the iteration): at least twice, until req.seconds passed or
    MAX_ITERATIONS. A Failed's peer here: 1 the next member (sending), else the previous."""
    chunk = max(1, int(req.size) // n)
    inbox = bytearray(FLAG + chunk)
    sender = _Sender(out, chunk, threading)
    deadline = time.monotonic() + req.timeout
    received = iterations = 0
    try:
        warm = min(chunk, 65536)
        for _ in range(2):  # two laps of a small chunk: every member joined, then go
            if rank == 0:
                sender.send(0, warm, deadline, False)
            _recv_exact(inp, memoryview(inbox)[: FLAG + warm], deadline)
            if rank != 0:
                sender.send(0, warm, deadline, False)
        t0 = time.monotonic()
        while True:
            elapsed = time.monotonic() - t0
            last = rank == 0 and (
                iterations + 1 >= MAX_ITERATIONS
                or (iterations >= 1 and elapsed >= req.seconds)
                or elapsed * (iterations + 1) / max(1, iterations) >= req.timeout / 2
            )
            for _ in range(2 * (n - 1)):
                sender.send(1 if last else 0, chunk, deadline)
                _recv_exact(inp, memoryview(inbox), deadline)
                received += chunk
                last = last or inbox[0] == 1
            iterations += 1
            if last:
                break
        sender.finish(deadline)
        seconds = time.monotonic() - t0
    except Failed as e:
        sender.todo.put(None)
        peer = None if e.message == "timed out" else (rank + (-1 if e.peer is None else e.peer)) % n
        if e.message == "timed out":
            e.message = "timed out after %gs (%d of its bytes received)" % (req.timeout, received)
        return P.FabricReport(error=e.message, peer=peer, sent=sender.sent, received=received, iterations=iterations)
    return P.FabricReport(seconds=round(seconds, 6), sent=sender.sent, received=received, iterations=iterations)


# --------------------------------------------------------------------------- torch


TORCH_PROGRAM = r"""
import datetime, json, os, sys, time
a = json.loads(sys.argv[1])
import torch
import torch.distributed as dist
backend = "nccl" if a["gpus"] > 0 and torch.cuda.is_available() else "gloo"
dist.init_process_group(backend, init_method="tcp://%s:%d" % (a["master"], a["port"]), rank=a["rank"],
                        world_size=a["world"], timeout=datetime.timedelta(seconds=a["join"]))
dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
x = torch.ones(max(1, a["size"] // 4), dtype=torch.float32, device=dev)
def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()
dist.all_reduce(x); sync(); dist.barrier()
t0 = time.perf_counter()
for _ in range(a["iterations"]):
    dist.all_reduce(x)
sync()
t = time.perf_counter() - t0
print("PROVISION-FABRIC " + json.dumps({"seconds": t, "bytes": x.numel() * 4, "backend": backend}))
dist.destroy_process_group()
"""
TORCH_ITERATIONS = 5


def torch_ring(req: Any) -> Any:
    n = len(req.peers)
    if n < 2 or not 0 <= req.rank < n:
        return P.FabricReport(error="a group needs two members or more, and this host among them")
    master, port = req.peers[0][0], int(req.peers[0][1])
    args = {
        "master": master,
        "port": port,
        "rank": req.rank,
        "world": n,
        "join": req.join,
        "size": int(req.size),
        "iterations": TORCH_ITERATIONS,
        "gpus": req.gpus,
    }
    # Gloo and NCCL talk on the interface that holds this host's address as the others dial it.
    mine = req.peers[req.rank][0]
    iface = __import__(__name__.rsplit(".", 1)[0] + ".hostcheck", fromlist=["_"]).interface(mine).get("name")
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = iface
    code, so, se = run(
        [sys.executable or "python3", "-c", TORCH_PROGRAM, json.dumps(args)], timeout=req.join + req.timeout
    )
    for line in so.splitlines():
        if line.startswith("PROVISION-FABRIC "):
            try:
                got = json.loads(line.split(" ", 1)[1])
                seconds, size = float(got["seconds"]), int(got["bytes"])
            except (ValueError, KeyError, TypeError):
                break
            moved = TORCH_ITERATIONS * size * 2 * (n - 1) // n
            return P.FabricReport(
                seconds=round(seconds, 6),
                sent=moved,
                received=moved,
                iterations=TORCH_ITERATIONS,
                backend=str(got.get("backend", ""))[:16],
            )
    lines = [ln.strip() for ln in (se + so).splitlines() if ln.strip()]
    why = lines[-1] if lines else "exit %d" % code
    return P.FabricReport(error="torch.distributed: %s" % why[-500:], output=(se + so)[-OUTPUT_KEPT:])


# --------------------------------------------------------------------------- nccl-tests


def nccl_command(req: Any, mpirun: str, program: str) -> list[str]:
    """mpirun (Open MPI) with one process per host, each driving its req.gpus GPUs (-g)."""
    hosts = ",".join("%s:1" % p[0] for p in req.peers)
    mb = max(1, int(req.size) // (1 << 20))
    return [
        mpirun, "--allow-run-as-root", "-np", str(len(req.peers)), "-H", hosts,
        "-x", "NCCL_DEBUG=WARN", "-x", "PATH",
        program, "-b", "%dM" % mb, "-e", "%dM" % mb, "-f", "2", "-g", str(max(1, req.gpus)),
        "-n", "20", "-w", "5", "-c", "1",
    ]  # fmt: skip


def run_group(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """hostlib.run for a launcher: in a session of its own, and on timeout every process of
    it killed (mpirun's children too, not mpirun alone)."""
    import signal  # lazy: only nccl-tests pays their import time
    import subprocess

    try:
        p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
        )
    except OSError as e:
        return 127, "", "%s: %s" % (argv[0], e.strerror or e)
    try:
        so, se = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        so, se = p.communicate()
        return 124, so.decode("utf-8", "replace"), "%s: timed out after %gs" % (argv[0], timeout)
    return p.returncode, so.decode("utf-8", "replace"), se.decode("utf-8", "replace")


def nccl_tests(req: Any) -> Any:
    program = which("all_reduce_perf", NCCL_TESTS_DIRS)
    mpirun = which("mpirun")
    if not program or not mpirun:
        return P.FabricReport(error="all_reduce_perf or mpirun is not installed here")
    code, so, se = run_group(nccl_command(req, mpirun, program), timeout=req.join + req.timeout)
    if code != 0:
        lines = [ln.strip() for ln in (se + so).splitlines() if ln.strip()]
        why = lines[-1] if lines else "exit %d" % code
        return P.FabricReport(error="mpirun all_reduce_perf: %s" % why[-500:], output=(so + se)[-OUTPUT_KEPT:])
    return P.FabricReport(output=so[-OUTPUT_KEPT:])
