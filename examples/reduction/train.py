#!/usr/bin/env python3
"""Training task of a job with reduction servers (examples/reduction).

Runs as every task of ``workerpool0`` (chief) and ``workerpool1`` (workers).
It reads only ``CLUSTER_SPEC`` as provision writes it
(shared/spec/cluster-env.md): its rank is its index in workerpool0, or
``len(workerpool0) + index`` in workerpool1; the world size is
``len(workerpool0) + len(workerpool1)``; the reduction servers are the
addresses in ``workerpool2``.  Training tasks never talk to each other, only
to the reducers (see reducer.py for the protocol).

It trains a linear regression (numpy, float64) on its own shard of a
synthetic data set.  Every step it appends its loss to its gradient, splits
the vector into one contiguous shard per reducer, sends each shard to its
reducer, gets back the sum over all tasks and divides by the world size: an
all-reduce (mean) of gradient and loss.  Every task therefore applies the same
update and ends with bit-identical weights.  Printed, flushed::

    [workerpool1:0 rank 1] step 3 loss 0.412345     (mean loss over all tasks)
    [workerpool1:0 rank 1] done steps 20 checksum 1.234567 sha256 ...

It retries connecting while the reducers start (``--connect-timeout``).
Usage: python3 train.py [--steps N] [--connect-timeout S]
Needs numpy.  Exit status 0 on success, 1 if the reducers fail or cannot be
reached in time, 2 for an unusable environment (one line on stderr).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import struct
import sys
import time

PROG = "reduction-train"
HELLO = struct.Struct("!4sIII")
OK = struct.Struct("!4sI")
ROUND = struct.Struct("!4sQI")
N_FEATURES = 16


class EnvError(Exception):
    """The task's environment is missing or malformed."""


class ReduceError(Exception):
    pass


def parse_address(addr, where: str) -> tuple[str, int]:
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


def read_env(environ=os.environ) -> dict:
    """Parse CLUSTER_SPEC for a training task; raises EnvError naming what is wrong."""
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
    cluster = spec["cluster"]
    ttype, index = task.get("type"), task.get("index")
    if ttype not in ("workerpool0", "workerpool1"):
        raise EnvError(f"CLUSTER_SPEC: task.type is {ttype!r}; training tasks are workerpool0 (chief) "
                       "or workerpool1 (workers)")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise EnvError(f"CLUSTER_SPEC: task.index must be a non-negative integer, got {index!r}")
    pool0, pool1 = cluster.get("workerpool0") or [], cluster.get("workerpool1") or []
    if index >= len(cluster.get(ttype) or []):
        raise EnvError(f"CLUSTER_SPEC: task {ttype}:{index} has no address in cluster.{ttype}")
    reducers = cluster.get("workerpool2") or []
    if not reducers:
        raise EnvError("CLUSTER_SPEC: cluster.workerpool2 is empty: this job has no reduction servers to reduce with")
    addrs = [parse_address(a, f"CLUSTER_SPEC cluster.workerpool2[{i}]") for i, a in enumerate(reducers)]
    rank = index if ttype == "workerpool0" else len(pool0) + index
    return {"type": ttype, "index": index, "rank": rank, "world": len(pool0) + len(pool1),
            "reducers": addrs}


def log(label: str, msg: str) -> None:
    print(f"[{label}] {msg}", flush=True)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ReduceError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def connect_reducer(j: int, host: str, port: int, env: dict, label: str, deadline: float) -> socket.socket:
    """Connect and say HELLO to reducer j, retrying while it is not up yet."""
    attempt, last_note = 0, 0.0
    while True:
        attempt += 1
        try:
            sock = socket.create_connection((host, port), timeout=10)
        except OSError as exc:
            now = time.monotonic()
            if now >= deadline:
                raise ReduceError(f"reducer {j} at {host}:{port} not reachable after {attempt} attempts: "
                                  f"{exc}") from exc
            if now - last_note >= 5:
                log(label, f"waiting for reducer {j} at {host}:{port}: {exc}")
                last_note = now
            time.sleep(min(0.2 * attempt, 2.0))
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(HELLO.pack(b"RSH1", env["rank"], env["world"], j))
        reply = recv_exact(sock, 8)
        if reply[:4] == b"RSER":
            (n,) = struct.unpack("!I", reply[4:])
            why = recv_exact(sock, n).decode(errors="replace")
            raise ReduceError(f"reducer {j} at {host}:{port} refused us: {why}")
        magic, world = OK.unpack(reply)
        if magic != b"RSOK" or world != env["world"]:
            raise ReduceError(f"reducer {j} at {host}:{port}: unexpected reply {reply!r}")
        sock.settimeout(None)
        return sock


def allreduce_mean(np, socks, names, vec, rnd: int, world: int):
    """Sum vec over all tasks via the reducers (one shard each) and divide by world."""
    shards = np.array_split(vec.astype("<f8"), len(socks))
    out = []
    j = 0
    try:
        for j, (sock, shard) in enumerate(zip(socks, shards)):
            sock.sendall(ROUND.pack(b"RSRD", rnd, shard.size) + shard.tobytes())
        for j, (sock, shard) in enumerate(zip(socks, shards)):
            magic, r, count = ROUND.unpack(recv_exact(sock, ROUND.size))
            if magic != b"RSSM" or r != rnd or count != shard.size:
                raise ReduceError(f"bad reply (magic {magic!r}, round {r}, {count} values)")
            out.append(np.frombuffer(recv_exact(sock, 8 * count), dtype="<f8"))
    except (OSError, ReduceError) as exc:
        raise ReduceError(f"reducer {j} at {names[j]}: lost in round {rnd}: {exc} "
                          "(a reducer stopped, or it dropped the session because another task failed)") from None
    return np.concatenate(out) / world


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="training task that all-reduces through reduction servers")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--batch", type=int, default=64, help="per-task batch size")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--connect-timeout", type=float, default=120.0,
                    help="seconds to keep retrying while the reducers start")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    try:
        env = read_env()
    except EnvError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    import numpy as np

    label = f"{env['type']}:{env['index']} rank {env['rank']}"
    names = [f"{h}:{p}" for h, p in env["reducers"]]
    log(label, f"world {env['world']} training tasks; {len(names)} reducers: {', '.join(names)}")
    t0 = time.monotonic()
    deadline = t0 + args.connect_timeout
    socks = []
    try:
        for j, (host, port) in enumerate(env["reducers"]):
            socks.append(connect_reducer(j, host, port, env, label, deadline))
        log(label, f"connected to {len(socks)} reducers ({time.monotonic() - t0:.1f}s)")

        # One synthetic problem y = x . w_true + b_true + noise; each task has its own x.
        truth = np.random.default_rng(7)
        w_true, b_true = truth.normal(size=N_FEATURES), 0.5
        rng = np.random.default_rng(1000 + env["rank"])
        x_all = rng.normal(size=(args.batch * 16, N_FEATURES))
        y_all = x_all @ w_true + b_true + 0.01 * rng.normal(size=len(x_all))
        w, b = np.zeros(N_FEATURES), 0.0  # identical start on every task

        for step in range(1, args.steps + 1):
            i = (step - 1) % 16
            x, y = x_all[i * args.batch:(i + 1) * args.batch], y_all[i * args.batch:(i + 1) * args.batch]
            err = x @ w + b - y
            loss = float(np.mean(err ** 2))
            grad = np.concatenate([2 * x.T @ err / len(x), [2 * err.mean()], [loss]])
            mean = allreduce_mean(np, socks, names, grad, step, env["world"])
            w = w - args.lr * mean[:N_FEATURES]
            b = b - args.lr * mean[N_FEATURES]
            log(label, f"step {step} loss {mean[-1]:.6f}")
        for s in socks:  # tell the reducers this is a clean end, not a crash
            s.sendall(ROUND.pack(b"RSBY", args.steps, 0))
    except (ReduceError, OSError) as exc:
        print(f"{PROG}: error: [{label}] {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for s in socks:
            s.close()
    flat = np.concatenate([w, [b]]).astype("<f8")
    log(label, f"done steps {args.steps} checksum {float(flat.sum()):.6f} "
               f"sha256 {hashlib.sha256(flat.tobytes()).hexdigest()} ({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
