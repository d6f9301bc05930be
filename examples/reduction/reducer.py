#!/usr/bin/env python3
"""A small, honest reduction server for provision's ``reduction_server`` pool.

Google's reduction-server image (Vertex AI Reduction Server) is not public, so
this stands in for it: one process per replica of ``workerpool2``.  It needs
only the Python standard library (no numpy).

It reads ``CLUSTER_SPEC`` (shared/spec/cluster-env.md): its own address is
``cluster.workerpool2[task.index]`` (``task.type`` is ``workerpool2``); it
binds ``0.0.0.0:<port of that address>``.  The training tasks are
``workerpool0`` (chief) plus ``workerpool1`` (workers); there are
``N = len(workerpool0) + len(workerpool1)`` of them.

Each training task splits its gradient into one contiguous shard per reducer
and sends shard j to reducer j.  A reducer waits for the shard of every one of
the N tasks for the round, adds them up in rank order (so the result does not
depend on arrival order) and sends the same sum back to all N.  The tasks
divide by N: an all-reduce (mean) with no task talking to another task.

Wire protocol (TCP, one connection per training task per reducer, all
integers big-endian, payload float64 little-endian):

  task -> reducer  HELLO  b"RSH1" rank:u32 world:u32 reducer_index:u32
  reducer -> task  b"RSOK" world:u32            or  b"RSER" len:u32 utf-8 message
  task -> reducer  ROUND  b"RSRD" round:u64 count:u32 count*f64
  reducer -> task  SUM    b"RSSM" round:u64 count:u32 count*f64
  task -> reducer  BYE    b"RSBY" rounds_done:u64 0:u32    (then close)

A *session* is one run of the N tasks: it starts when all N ranks have said
HELLO and ends when all of them say BYE (normal end of training) or when one
fails or disconnects without BYE (then the others are disconnected and the reducer waits for a
new session, e.g. after provision restarts the tasks).  The server is
long-lived: it serves sessions until it is stopped (SIGTERM -> exit 0).

Usage: python3 reducer.py [--log-every N] [--round-timeout S] [--steps N]
(``--steps`` is optional: the number of rounds the training tasks run, only
used to warn at the end of a session that served another number.)
Exit status: 0 on SIGTERM, 2 for an unusable environment, 1 if it cannot bind.
"""
from __future__ import annotations

import argparse
import array
import json
import os
import signal
import socket
import struct
import sys
import time

PROG = "reducer"
HELLO = struct.Struct("!4sIII")
OK = struct.Struct("!4sI")
ERR = struct.Struct("!4sI")
ROUND = struct.Struct("!4sQI")


class EnvError(Exception):
    """The task's environment is missing or malformed."""


class ProtocolError(Exception):
    pass


def parse_address(addr: str, where: str) -> tuple[str, int]:
    if not isinstance(addr, str) or ":" not in addr:
        raise EnvError(f"{where}: expected 'host:port', got {addr!r}")
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise EnvError(f"{where}: port of {addr!r} is not a number") from None
    if not host or not 0 < p < 65536:
        raise EnvError(f"{where}: bad address {addr!r}")
    return host, p


def read_cluster_spec(environ) -> dict:
    raw = environ.get("CLUSTER_SPEC")
    if raw is None or not raw.strip():
        raise EnvError(
            "CLUSTER_SPEC is not set: this program is a task of a job with reduction servers and needs "
            "the cluster description provision writes (cluster.workerpool0..2, task.type/index)"
        )
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise EnvError(f"CLUSTER_SPEC is not valid JSON: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict):
        raise EnvError("CLUSTER_SPEC: missing 'cluster' (a map of workerpoolN to list of host:port)")
    task = spec.get("task")
    if not isinstance(task, dict):
        raise EnvError("CLUSTER_SPEC: missing 'task' ({\"type\": \"workerpoolN\", \"index\": ...})")
    index = task.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise EnvError(f"CLUSTER_SPEC: task.index must be a non-negative integer, got {index!r}")
    for name, addrs in spec["cluster"].items():
        if not isinstance(addrs, list):
            raise EnvError(f"CLUSTER_SPEC: cluster.{name} must be a list of 'host:port' strings")
    return spec


def read_env(environ=os.environ) -> dict:
    """Parse CLUSTER_SPEC for a reduction-server task; raises EnvError naming what is wrong."""
    spec = read_cluster_spec(environ)
    cluster, task = spec["cluster"], spec["task"]
    if task.get("type") != "workerpool2":
        raise EnvError(f"CLUSTER_SPEC: task.type is {task.get('type')!r}; a reduction server is a workerpool2 task")
    reducers = cluster.get("workerpool2") or []
    if task["index"] >= len(reducers):
        raise EnvError(f"CLUSTER_SPEC: task workerpool2:{task['index']} has no address in cluster.workerpool2")
    host, port = parse_address(reducers[task["index"]], f"CLUSTER_SPEC cluster.workerpool2[{task['index']}]")
    world = len(cluster.get("workerpool0") or []) + len(cluster.get("workerpool1") or [])
    if world < 1:
        raise EnvError("CLUSTER_SPEC: no training tasks (cluster.workerpool0 and workerpool1 are empty)")
    return {"index": task["index"], "address": reducers[task["index"]], "port": port,
            "world": world, "n_reducers": len(reducers)}


def log(label: str, msg: str) -> None:
    print(f"[{label}] {msg}", flush=True)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def to_wire(values: array.array) -> bytes:
    if sys.byteorder == "big":
        values = array.array("d", values)
        values.byteswap()
    return values.tobytes()


def from_wire(data: bytes) -> array.array:
    values = array.array("d")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def send_error(conn: socket.socket, msg: str) -> None:
    data = msg.encode()
    try:
        conn.sendall(ERR.pack(b"RSER", len(data)) + data)
    except OSError:
        pass
    conn.close()


class Stop(Exception):
    pass


def _on_sigterm(signum, frame):
    raise Stop()


def accept_session(server: socket.socket, env: dict, label: str, hello_timeout: float) -> dict[int, socket.socket]:
    """Accept connections until every rank 0..world-1 has said a valid HELLO."""
    world = env["world"]
    conns: dict[int, socket.socket] = {}
    while len(conns) < world:
        conn, peer = server.accept()
        conn.settimeout(hello_timeout)
        try:
            magic, rank, their_world, reducer_index = HELLO.unpack(recv_exact(conn, HELLO.size))
        except (OSError, EOFError, struct.error) as exc:
            log(label, f"dropped connection from {peer[0]}:{peer[1]}: no HELLO ({exc})")
            conn.close()
            continue
        if magic != b"RSH1":
            send_error(conn, f"not a reduction-server client (magic {magic!r})")
            log(label, f"rejected {peer[0]}:{peer[1]}: bad magic {magic!r}")
            continue
        problem = None
        if their_world != world:
            problem = (f"world size mismatch: task says {their_world}, this reducer's CLUSTER_SPEC has "
                       f"{world} training tasks (workerpool0+workerpool1)")
        elif reducer_index != env["index"]:
            problem = f"task addressed reducer {reducer_index} but this is reducer {env['index']}"
        elif not 0 <= rank < world:
            problem = f"rank {rank} out of range for world {world}"
        if problem:
            send_error(conn, problem)
            log(label, f"rejected rank {rank} from {peer[0]}:{peer[1]}: {problem}")
            continue
        if rank in conns:  # a restarted task: its old connection is stale
            log(label, f"rank {rank} reconnected from {peer[0]}:{peer[1]}; dropping its old connection")
            conns.pop(rank).close()
        conn.sendall(OK.pack(b"RSOK", world))
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns[rank] = conn
        log(label, f"rank {rank} joined from {peer[0]}:{peer[1]} ({len(conns)}/{world})")
    return conns


def serve_session(conns: dict[int, socket.socket], env: dict, label: str, args) -> int:
    """Reduce rounds until the tasks disconnect. Returns the number of rounds served."""
    world = env["world"]
    rounds = 0
    t0 = time.monotonic()
    for c in conns.values():
        c.settimeout(args.round_timeout)

    def read(rank: int, n: int) -> bytes:
        try:
            return recv_exact(conns[rank], n)
        except EOFError:
            raise ProtocolError(f"rank {rank} disconnected in round {rounds + 1} without saying goodbye") from None
        except socket.timeout:
            raise ProtocolError(f"rank {rank} sent nothing for {args.round_timeout:g}s in round {rounds + 1}") from None
        except OSError as exc:
            raise ProtocolError(f"rank {rank} connection lost in round {rounds + 1}: {exc}") from None

    try:
        while True:
            total = None
            expect = None
            byes = 0
            for rank in range(world):  # fixed order: deterministic sum
                header = read(rank, ROUND.size)
                if header[:4] == b"RSBY":
                    byes += 1
                    continue
                if byes:
                    raise ProtocolError(f"rank {rank} sent round data while a lower rank ended the session")
                magic, rnd, count = ROUND.unpack(header)
                if magic != b"RSRD":
                    raise ProtocolError(f"rank {rank}: bad round magic {magic!r}")
                if expect is None:
                    expect = (rnd, count)
                elif (rnd, count) != expect:
                    raise ProtocolError(f"rank {rank} sent round {rnd} with {count} values, "
                                        f"rank 0 sent round {expect[0]} with {expect[1]}")
                values = from_wire(read(rank, 8 * count))
                if total is None:
                    total = values
                else:
                    for i in range(count):
                        total[i] += values[i]
            if byes == world:
                note = ""
                if args.steps is not None and rounds != args.steps:
                    note = f" (warning: expected {args.steps} rounds from --steps)"
                log(label, f"session complete: {rounds} rounds from {world} tasks "
                           f"in {time.monotonic() - t0:.1f}s{note}")
                return rounds
            if byes:
                raise ProtocolError(f"{byes} of {world} tasks ended the session, the others sent round {expect[0]}")
            reply = ROUND.pack(b"RSSM", expect[0], expect[1]) + to_wire(total)
            for rank in range(world):
                try:
                    conns[rank].sendall(reply)
                except OSError as exc:
                    raise ProtocolError(f"rank {rank} connection lost sending round {expect[0]}: {exc}") from None
            rounds += 1
            if rounds == 1 or rounds % args.log_every == 0:
                log(label, f"round {expect[0]} reduced {expect[1]} values from {world} tasks "
                           f"(round {rounds} of this session)")
    except ProtocolError as exc:
        log(label, f"session aborted after {rounds} rounds: {exc}; disconnecting all tasks")
        return rounds
    finally:
        for c in conns.values():
            c.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="reduction server (sum of gradient shards)")
    ap.add_argument("--log-every", type=int, default=10, help="print a line every N rounds (and the first)")
    ap.add_argument("--round-timeout", type=float, default=600.0,
                    help="seconds to wait for a task's shard before giving the session up")
    ap.add_argument("--hello-timeout", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=None,
                    help="rounds the training tasks run (optional; only checked in the end-of-session line)")
    args = ap.parse_args(argv)
    if args.log_every < 1:
        ap.error("--log-every must be >= 1")
    try:
        env = read_env()
    except EnvError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    label = f"workerpool2:{env['index']}"
    signal.signal(signal.SIGTERM, _on_sigterm)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("0.0.0.0", env["port"]))
    except OSError as exc:
        print(f"{PROG}: error: cannot bind 0.0.0.0:{env['port']} (own address {env['address']}): {exc}",
              file=sys.stderr, flush=True)
        return 1
    server.listen(max(16, env["world"] * 2))
    log(label, f"reduction server {env['index'] + 1}/{env['n_reducers']} for {env['address']} listening on "
               f"0.0.0.0:{env['port']}; {env['world']} training tasks per round")
    sessions = 0
    try:
        while True:
            conns = accept_session(server, env, label, args.hello_timeout)
            sessions += 1
            log(label, f"session {sessions} started: all {env['world']} training tasks connected")
            serve_session(conns, env, label, args)
    except (Stop, KeyboardInterrupt):
        log(label, f"stopping: signal received after {sessions} sessions")
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
