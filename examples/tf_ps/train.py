#!/usr/bin/env python3
"""TensorFlow ParameterServerStrategy example for provision.

One program for every task of the job; ``TF_CONFIG`` (written by provision,
see shared/spec/cluster-env.md) says which one this process is:

* ``chief``  -- the coordinator.  Builds a ``ParameterServerStrategy`` and a
  ``ClusterCoordinator``, schedules training steps onto the workers (the
  variables live on the ps tasks), prints the loss of every step, saves a
  checkpoint every ``--checkpoint-every`` steps when ``CHECKPOINT_DIR`` is set,
  prints a checksum of the final weights and exits 0.  The job succeeds when
  the chief exits 0.
* ``worker`` / ``ps`` -- run ``tf.distribute.Server`` on the port of their own
  cluster address (TensorFlow binds it on all interfaces) and serve until
  stopped (long-lived: provision stops them when the chief is done).  They print
  one line when the server is up and one when they get SIGTERM.
* ``evaluator`` -- a side-car that is never part of the training cluster.  When
  ``CHECKPOINT_DIR`` is set it watches that directory, restores every new
  checkpoint into the same model and prints its loss on a held-out synthetic
  set (and the checksum of the weights it restored, which for the final
  checkpoint equals the chief's).  Without ``CHECKPOINT_DIR`` it says so and
  waits.  Long-lived: provision stops it at job end.

Progress lines look like ``[chief:0] step 3 loss 0.412345``.

Usage: python3 train.py [--steps N] [--checkpoint-every K] [--poll-seconds S]
Env: TF_CONFIG (required), CHECKPOINT_DIR (optional, chief and evaluator).
Exit status: 0 on success or on SIGTERM for long-lived tasks, 2 for an
unusable environment (one line on stderr).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time

PROG = "tf_ps"
N_FEATURES = 8
HIDDEN = 16
ROLES = ("chief", "worker", "ps", "evaluator")


class EnvError(Exception):
    """The task's environment is missing or malformed."""


def read_env(environ=os.environ) -> dict:
    """Parse and check TF_CONFIG for a ParameterServerStrategy job task.

    Returns {"cluster", "task_type", "task_index", "checkpoint_dir"}; raises
    EnvError naming the variable and what is wrong.
    """
    raw = environ.get("TF_CONFIG")
    if raw is None or not raw.strip():
        raise EnvError(
            "TF_CONFIG is not set: this program is a task of a parameter-server job and "
            "needs the cluster description provision writes (cluster.chief/worker/ps, task.type/index)"
        )
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise EnvError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise EnvError("TF_CONFIG: expected a JSON object")
    cluster, task = cfg.get("cluster"), cfg.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise EnvError("TF_CONFIG: missing 'cluster' (a map of job name to list of host:port)")
    if not isinstance(task, dict):
        raise EnvError("TF_CONFIG: missing 'task' ({\"type\": ..., \"index\": ...})")
    ttype, index = task.get("type"), task.get("index")
    if ttype not in ROLES:
        raise EnvError(f"TF_CONFIG: task.type is {ttype!r}; expected one of {', '.join(ROLES)}")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise EnvError(f"TF_CONFIG: task.index must be a non-negative integer, got {index!r}")
    for name, addrs in cluster.items():
        if not isinstance(addrs, list) or not all(isinstance(a, str) and ":" in a for a in addrs):
            raise EnvError(f"TF_CONFIG: cluster.{name} must be a list of 'host:port' strings")
    for needed in ("chief", "worker", "ps"):
        if not cluster.get(needed):
            raise EnvError(f"TF_CONFIG: cluster.{needed} is missing; "
                           "ParameterServerStrategy needs chief, worker and ps tasks")
    if ttype != "evaluator" and index >= len(cluster[ttype]):
        raise EnvError(f"TF_CONFIG: task {ttype}:{index} has no address in cluster.{ttype}")
    ckpt = environ.get("CHECKPOINT_DIR") or None
    return {"cluster": cluster, "task_type": ttype, "task_index": index, "checkpoint_dir": ckpt}


def log(label: str, msg: str) -> None:
    print(f"[{label}] {msg}", flush=True)


class _Stop(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Stop()


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")  # CPU only, whatever the host has
    return tf


def make_model(tf):
    """A two-layer MLP as a tf.Module of plain variables (placed on ps by the strategy)."""

    class MLP(tf.Module):
        def __init__(self):
            super().__init__(name="mlp")
            init = tf.random.stateless_normal
            self.w1 = tf.Variable(init((N_FEATURES, HIDDEN), seed=(1, 2)) * 0.3, name="w1")
            self.b1 = tf.Variable(tf.zeros((HIDDEN,)), name="b1")
            self.w2 = tf.Variable(init((HIDDEN, 1), seed=(3, 4)) * 0.3, name="w2")
            self.b2 = tf.Variable(tf.zeros((1,)), name="b2")

        def __call__(self, x):
            return tf.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2

    return MLP()


def synthetic(tf, n, seed):
    """y = tanh(x . w_true / sqrt(d)) with a fixed w_true; x depends on seed."""
    w_true = tf.random.stateless_normal((N_FEATURES, 1), seed=(7, 7))
    x = tf.random.stateless_normal((n, N_FEATURES), seed=(seed, 11))
    return x, tf.tanh(x @ w_true / N_FEATURES ** 0.5)


def checksum(tf, module) -> str:
    import numpy as np

    flat = np.concatenate([np.asarray(v.numpy(), dtype="float32").ravel()
                           for v in sorted(module.trainable_variables, key=lambda v: v.name)])
    return f"checksum {float(flat.astype('float64').sum()):.6f} sha256 {hashlib.sha256(flat.tobytes()).hexdigest()}"


def run_chief(env, args, label) -> int:
    t0 = time.monotonic()
    tf = _tf()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    log(label, f"coordinator ready: workers={len(env['cluster']['worker'])} ps={len(env['cluster']['ps'])} "
               f"(tf {tf.__version__}, {time.monotonic() - t0:.1f}s)")
    batch = args.batch

    def dataset_fn(ctx):
        x, y = synthetic(tf, 1024, seed=1)
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024).repeat().batch(batch, drop_remainder=True)

    with strategy.scope():
        model = make_model(tf)
        step_var = tf.Variable(0, dtype=tf.int64, name="step")

    per_worker_ds = coordinator.create_per_worker_dataset(strategy.distribute_datasets_from_function(dataset_fn))
    per_worker_it = iter(per_worker_ds)
    lr = args.lr

    @tf.function
    def train_step(iterator):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(lr * g)
            step_var.assign_add(1)
            return loss

        x, y = next(iterator)
        return strategy.run(replica_fn, args=(x, y))

    manager = None
    if env["checkpoint_dir"]:
        ckpt = tf.train.Checkpoint(model=model, step=step_var)
        manager = tf.train.CheckpointManager(ckpt, env["checkpoint_dir"], max_to_keep=3)
        log(label, f"checkpoints to {env['checkpoint_dir']} every {args.checkpoint_every} steps")

    step = 0
    while step < args.steps:
        window = min(args.checkpoint_every, args.steps - step)
        remotes = [coordinator.schedule(train_step, args=(per_worker_it,)) for _ in range(window)]
        coordinator.join()
        for r in remotes:
            step += 1
            log(label, f"step {step} loss {float(r.fetch()):.6f}")
        if manager is not None:
            path = manager.save(checkpoint_number=step)
            log(label, f"saved checkpoint {path} step {step}")
    log(label, f"done steps {args.steps} {checksum(tf, model)} ({time.monotonic() - t0:.1f}s)")
    return 0


def run_server(env, args, label) -> int:
    tf = _tf()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(), job_name=env["task_type"], task_index=env["task_index"],
        protocol=resolver.rpc_layer or "grpc", start=True)
    own = env["cluster"][env["task_type"]][env["task_index"]]
    log(label, f"server started for {own} (listening on all interfaces, port {own.rsplit(':', 1)[1]}); "
               f"target {server.target}; serving until stopped")
    # server.join() blocks in C++ where Python signal handlers cannot run, so it
    # runs in a daemon thread and the main thread waits for SIGTERM.
    threading.Thread(target=server.join, daemon=True).start()
    try:
        while True:
            time.sleep(3600)
    except (_Stop, KeyboardInterrupt):
        log(label, "stopping: signal received")
        sys.stdout.flush()
        os._exit(0)


def run_evaluator(env, args, label) -> int:
    ckpt_dir = env["checkpoint_dir"]
    if not ckpt_dir:
        log(label, "CHECKPOINT_DIR is not set: nothing to evaluate; waiting until stopped")
        try:
            while True:
                time.sleep(args.heartbeat_seconds)
                log(label, "waiting: CHECKPOINT_DIR is not set")
        except (_Stop, KeyboardInterrupt):
            log(label, "stopping: signal received")
            return 0
    tf = _tf()
    model = make_model(tf)
    step_var = tf.Variable(0, dtype=tf.int64, name="step")
    ckpt = tf.train.Checkpoint(model=model, step=step_var)
    x_eval, y_eval = synthetic(tf, 512, seed=99)  # held out: the training data uses seed 1
    log(label, f"watching {ckpt_dir} for checkpoints every {args.poll_seconds}s")
    seen, last_beat = None, time.monotonic()
    try:
        while True:
            latest = tf.train.latest_checkpoint(ckpt_dir)
            if latest and latest != seen:
                try:
                    ckpt.restore(latest).expect_partial()
                except Exception as exc:  # half-written or pruned under us: retry next poll
                    log(label, f"cannot read {latest} yet: {type(exc).__name__}")
                else:
                    seen = latest
                    loss = float(tf.reduce_mean(tf.square(model(x_eval) - y_eval)))
                    log(label, f"evaluated {os.path.basename(latest)} step {int(step_var.numpy())} "
                               f"eval_loss {loss:.6f} {checksum(tf, model)}")
                    last_beat = time.monotonic()
            elif time.monotonic() - last_beat >= args.heartbeat_seconds:
                log(label, f"waiting for a new checkpoint in {ckpt_dir} (last: {seen or 'none'})")
                last_beat = time.monotonic()
            time.sleep(args.poll_seconds)
    except (_Stop, KeyboardInterrupt):
        log(label, "stopping: signal received")
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="TensorFlow ParameterServerStrategy example (chief, worker, ps, evaluator)")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--poll-seconds", type=float, default=1.0, help="evaluator: checkpoint poll interval")
    ap.add_argument("--heartbeat-seconds", type=float, default=30.0, help="evaluator: idle status line interval")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1:
        ap.error("--steps and --checkpoint-every must be >= 1")
    try:
        env = read_env()
    except EnvError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    label = f"{env['task_type']}:{env['task_index']}"
    signal.signal(signal.SIGTERM, _on_sigterm)
    # As in TensorFlow's ParameterServerStrategy guide: let RPCs to tasks that
    # are not up yet wait instead of failing at once.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    log(label, f"TF_CONFIG cluster={json.dumps(env['cluster'], sort_keys=True)}")
    if env["task_type"] == "chief":
        return run_chief(env, args, label)
    if env["task_type"] in ("worker", "ps"):
        return run_server(env, args, label)
    return run_evaluator(env, args, label)


if __name__ == "__main__":
    sys.exit(main())
