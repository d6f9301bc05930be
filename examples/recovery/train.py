#!/usr/bin/env python3
"""A training script that survives its hardware (docs/recovery.md): PyTorch DDP over gloo on
CPU that does what provision asks of a job it recovers.

- every step it touches PROVISION_HEARTBEAT (its progress, as provision watches it) and
  prints `step N` (its own step log: the benchmark reads what was redone from it);
- every CKPT_EVERY seconds rank 0 saves a checkpoint to AIP_CHECKPOINT_DIR, complete or not
  at all (written to a temporary name, then renamed: `ckpt-STEP.pt`, the newest kept);
- on SIGTERM (provision's stop, a preemption's or a recovery's) rank 0 saves one more and
  every rank exits 0; when a collective fails (a peer's process or host lost, or its
  collectives timed out) rank 0 saves what it has, complete at that step, and exits 1; under torchrun, when only some ranks got it (torchrun restarting its
  nodes: one joined), each rank waits for its own and exits 0 then, 1 if it never comes (a
  node whose workers all end well would close torchrun's rendezvous);
- with PROVISION_RESUME=1 (provision ran it again) or TORCHELASTIC_RESTART_COUNT above 0
  (torchrun restarted it at a new size: `elastic:`) each rank loads the newest checkpoint
  it has, and every rank goes on from the newest of them (its weights broadcast from the
  rank that has it: after torchrun's rendezvous rank 0 may be on another host).

Env: STEPS (default 1000000), STEP_S (seconds a step takes, default 1), CKPT_EVERY
(default 20), GLOO_TIMEOUT (seconds a collective may wait for a peer, default 30).
Exit 0 when done or stopped; any failure of a peer is an exception (exit 1).
"""

from __future__ import annotations

import datetime
import glob
import os
import signal
import sys
import time

STOP = []


def log(*words: object) -> None:
    print(f"[{os.environ.get('PROVISION_TASK', '?')}]", *words, flush=True)


def newest(ckdir: str) -> str | None:
    found = sorted(glob.glob(os.path.join(ckdir, "ckpt-*.pt")), key=lambda p: int(p.rsplit("-", 1)[1][:-3]))
    return found[-1] if found else None


def save(torch, model, opt, step: int, ckdir: str) -> None:
    os.makedirs(ckdir, exist_ok=True)
    tmp = os.path.join(ckdir, f".ckpt-{step}.tmp")
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, os.path.join(ckdir, f"ckpt-{step}.pt"))
    for old in glob.glob(os.path.join(ckdir, "ckpt-*.pt")):
        if old != os.path.join(ckdir, f"ckpt-{step}.pt"):
            os.unlink(old)
    log(f"checkpoint step {step}")


def touch(path: str | None) -> None:
    if path:
        with open(path, "a"):
            os.utime(path)


def restarted(step: int) -> int:
    """Some ranks asked to stop, not all, under torchrun: its agents restart their nodes (a
    node joins or left), each its own in turn. Every rank waits for its own agent's signal;
    one that never comes is a failure its agent restarts, never a success (a node that ends
    well closes the rendezvous for all)."""
    until = time.monotonic() + 15
    while not STOP and time.monotonic() < until:
        time.sleep(0.1)
    if not STOP:
        log(f"at step {step} other ranks were restarted, not this one: failing, for torchrun to restart it")
        return 1
    log(f"restarted by torchrun at step {step}")
    return 0


def lost_peer(torch, model, opt, step: int, ckdir: str, rank: int) -> int:
    """A collective failed: a peer was lost (its process or its host) or timed out. The
    weights are those of `step` on every rank (the optimiser never ran on a failed
    all-reduce), so rank 0 saves them before failing: the run provision starts again
    resumes here, not from the last periodic checkpoint."""
    log(f"a peer was lost at step {step}")
    if rank == 0:
        save(torch, model, opt, step, ckdir)
    return 1


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    signal.signal(signal.SIGTERM, lambda *_: STOP.append(1))
    torch.set_num_threads(1)
    steps = int(os.environ.get("STEPS", "1000000"))
    step_s = float(os.environ.get("STEP_S", "1"))
    every = float(os.environ.get("CKPT_EVERY", "20"))
    ckdir = os.environ.get("AIP_CHECKPOINT_DIR", "/tmp/ckpt").rstrip("/")
    beat = os.environ.get("PROVISION_HEARTBEAT")
    timeout = datetime.timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT", "30")))
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    world = dist.get_world_size()
    mine = torch.zeros(1, dtype=torch.long)
    resume = os.environ.get("PROVISION_RESUME") == "1" or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0
    found = newest(ckdir) if resume else None
    if found:
        state = torch.load(found)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        mine[0] = state["step"]
    start = mine.clone()
    dist.all_reduce(start, op=dist.ReduceOp.MAX)  # the newest checkpoint any rank has ...
    src = torch.tensor([rank if found and int(mine[0]) == int(start[0]) else world])
    dist.all_reduce(src, op=dist.ReduceOp.MIN)  # ... and the first rank that has it
    source = int(src[0]) if int(src[0]) < world else 0
    if resume:
        log(f"resumed from step {int(start[0])} ({found or 'no checkpoint here'}; world {world})")
    for p in model.parameters():  # its weights on every rank
        dist.broadcast(p.data, source)
    step, last = int(start[0]), time.monotonic()
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    while step < steps:
        t0 = time.monotonic()
        try:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # its gradients' all-reduce: a peer lost fails here ...
        except RuntimeError:
            return lost_peer(torch, model.module, opt, step, ckdir, rank)
        opt.step()
        step += 1
        flag = torch.tensor([1 if STOP else 0])
        try:
            dist.all_reduce(flag)  # how many ranks were asked to stop: every rank stops at this step
        except RuntimeError:  # ... or here
            return lost_peer(torch, model.module, opt, step, ckdir, rank)
        log(f"step {step} loss {loss.item():.4f} world {world}")
        touch(beat)
        if rank == 0 and (flag.item() or time.monotonic() - last >= every):
            save(torch, model.module, opt, step, ckdir)
            last = time.monotonic()
        if flag.item():
            if int(flag.item()) < world and os.environ.get("TORCHELASTIC_RUN_ID"):
                return restarted(step)
            log(f"stopped at step {step}")
            return 0
        time.sleep(max(0.0, step_s - (time.monotonic() - t0)))
    log(f"done steps {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
