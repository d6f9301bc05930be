#!/usr/bin/env python3
"""PyTorch DistributedDataParallel (gloo, CPU) example for provision.

The chief and every worker run this same program.  It reads only the
PyTorch ``env://`` variables provision writes (shared/spec/cluster-env.md):
``MASTER_ADDR`` (the chief's cluster address), ``MASTER_PORT``,
``WORLD_SIZE`` (chief + workers) and ``RANK`` (chief 0, worker i -> i+1), and
calls ``torch.distributed.init_process_group("gloo", init_method="env://")``.
Rank 0 listens on MASTER_PORT (all interfaces); the others connect to it.
Unless ``GLOO_SOCKET_IFNAME`` is set, gloo is told to use the network
interface that routes to MASTER_ADDR (so a hostname that resolves to
127.0.1.1 does not break multi-host runs).

Each rank trains the same small MLP on its own shard of a synthetic
regression problem; DDP averages the gradients, so every rank ends with the
same weights.  Printed, flushed::

    [chief:0 rank 0] step 3 loss 0.412345          (loss averaged over all ranks)
    [chief:0 rank 0] done steps 20 checksum 1.234567 sha256 ...

Usage: python3 train.py [--steps N]
Exit status 0 on success, 2 for an unusable environment (one line on stderr).
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

PROG = "torch_ddp"
N_FEATURES = 8
REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class EnvError(Exception):
    """The task's environment is missing or malformed."""


def read_env(environ=os.environ) -> dict:
    """Parse and check the env:// variables; raises EnvError naming what is wrong."""
    missing = [k for k in REQUIRED if not environ.get(k, "").strip()]
    if missing:
        raise EnvError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: this program is a task "
            "of a PyTorch DDP job and needs MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK as provision writes them"
        )
    out = {"master_addr": environ["MASTER_ADDR"].strip()}
    for key in ("MASTER_PORT", "WORLD_SIZE", "RANK"):
        try:
            out[key.lower()] = int(environ[key])
        except ValueError:
            raise EnvError(f"{key} must be an integer, got {environ[key]!r}") from None
    if not 0 < out["master_port"] < 65536:
        raise EnvError(f"MASTER_PORT must be a TCP port (1-65535), got {out['master_port']}")
    if out["world_size"] < 1:
        raise EnvError(f"WORLD_SIZE must be >= 1, got {out['world_size']}")
    if not 0 <= out["rank"] < out["world_size"]:
        raise EnvError(f"RANK must be in [0, WORLD_SIZE={out['world_size']}), got {out['rank']}")
    return out


def interface_towards(host: str, port: int) -> tuple[str, str] | None:
    """(interface name, local IPv4) this host uses to reach host:port, or None.

    A UDP connect() only asks the kernel for the route: no packet is sent.
    Gloo otherwise advertises the address the machine's hostname resolves to,
    which on many hosts is 127.0.1.1 (Debian's /etc/hosts) and unreachable
    from the other ranks.
    """
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            local_ip = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    req = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue
            if socket.inet_ntoa(req[20:24]) == local_ip:
                return name, local_ip
    except (OSError, ImportError):
        return None
    return None


def role_label(rank: int, environ=os.environ) -> str:
    """'<role>:<index> rank <rank>' for log lines.

    The role comes from CLUSTER_SPEC's task (workerpool0 = chief, workerpool1 =
    worker) when provision set it; otherwise from the rank (chief 0, worker
    i -> i+1).  Only the label uses it: the process group needs only env://.
    """
    try:
        task = json.loads(environ.get("CLUSTER_SPEC", ""))["task"]
        role = {"workerpool0": "chief", "workerpool1": "worker"}[task["type"]]
        return f"{role}:{int(task['index'])} rank {rank}"
    except (ValueError, KeyError, TypeError):
        return "chief:0 rank 0" if rank == 0 else f"worker:{rank - 1} rank {rank}"


def log(label: str, msg: str) -> None:
    print(f"[{label}] {msg}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PyTorch DDP (gloo, CPU) example")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for all ranks to join")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    try:
        env = read_env()
    except EnvError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    rank, world = env["rank"], env["world_size"]
    label = role_label(rank)
    log(label, f"env:// MASTER_ADDR={env['master_addr']} MASTER_PORT={env['master_port']} "
               f"WORLD_SIZE={world} RANK={rank}")

    if "GLOO_SOCKET_IFNAME" not in os.environ:
        found = interface_towards(env["master_addr"], env["master_port"])
        if found:
            os.environ["GLOO_SOCKET_IFNAME"] = found[0]
            log(label, f"gloo interface {found[0]} ({found[1]}): the route to MASTER_ADDR {env['master_addr']}")
        else:
            log(label, "gloo interface: left to gloo (no IPv4 route to MASTER_ADDR found)")
    else:
        log(label, f"gloo interface {os.environ['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)")

    t0 = time.monotonic()
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=args.timeout))
    log(label, f"process group ready: backend gloo world {dist.get_world_size()} "
               f"(torch {torch.__version__}, {time.monotonic() - t0:.1f}s)")

    torch.manual_seed(1234)  # same init everywhere (DDP also broadcasts rank 0's weights)
    model = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DDP(model)  # CPU module: no device_ids
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    # One synthetic problem y = tanh(x . w_true / sqrt(d)); each rank draws its own x.
    w_true = torch.randn(N_FEATURES, 1, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(1000 + rank)
    x_all = torch.randn(args.batch * 16, N_FEATURES, generator=gen)
    y_all = torch.tanh(x_all @ w_true / N_FEATURES ** 0.5)

    for step in range(1, args.steps + 1):
        i = (step - 1) % 16
        x, y = x_all[i * args.batch:(i + 1) * args.batch], y_all[i * args.batch:(i + 1) * args.batch]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        log(label, f"step {step} loss {float(mean_loss) / world:.6f}")

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float32)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    log(label, f"done steps {args.steps} checksum {float(flat.double().sum()):.6f} sha256 {digest} "
               f"({time.monotonic() - t0:.1f}s)")
    # Every rank waits here, so no collective is in flight anywhere when the group goes.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """Exit without Python's finalization once the job's work is done.

    Constructing DistributedDataParallel leaves references to the gloo process group in
    torch's C++ side (torch 2.13: ten extra references to the group after the DDP object is
    collected and destroy_process_group() has run), so the group and its threads
    (gloo_tcp_loop, pt_gloo_runloop) live on until the process ends. A normal exit then
    tears them down during interpreter finalization, where a thread still running can be
    destroyed unjoined: std::terminate, "terminate called without an active exception",
    SIGABRT (exit -6) after "done" was printed, seen about once in fifteen runs under load.
    os._exit ends the process without running those destructors; the output is flushed
    first, and nothing else is left to clean up.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
