#!/usr/bin/env python3
"""TensorFlow MultiWorkerMirroredStrategy example for provision.

One chief and N workers train a small Keras model with a custom training
loop (``strategy.run`` + ``strategy.reduce``) on synthetic data made in this
file.  The only input is the ``TF_CONFIG`` provision writes into the task's
environment (see shared/spec/cluster-env.md); TensorFlow's own
``TFConfigClusterResolver`` reads it, starts this task's gRPC server on the
port of its own cluster address (on all interfaces) and joins the collective
ring.

Every task prints, flushed, one line per step::

    [chief:0] step 3 loss 0.412345

and at the end::

    [chief:0] done steps 20 checksum 12.345678 sha256 0123abcd...

The sha256 is over the float32 bytes of all weights, so a test can check that
every task ends with bit-identical weights.  Exit status 0 on success, 2 when
the environment is unusable (with a one-line message on stderr).

Usage: python3 train.py [--steps N] [--batch-per-replica B]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

PROG = "tf_mwms"


class EnvError(Exception):
    """The task's environment is missing or malformed."""


def read_env(environ=os.environ) -> dict:
    """Parse and check TF_CONFIG for a MultiWorkerMirroredStrategy task.

    Returns the decoded TF_CONFIG.  Raises EnvError with a message naming the
    variable and the problem.
    """
    raw = environ.get("TF_CONFIG")
    if raw is None or not raw.strip():
        raise EnvError(
            "TF_CONFIG is not set: this program is a task of a multi-worker job and "
            "needs the cluster description provision writes (cluster.chief/worker, task.type/index)"
        )
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise EnvError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise EnvError("TF_CONFIG: expected a JSON object")
    cluster = cfg.get("cluster")
    task = cfg.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise EnvError("TF_CONFIG: missing 'cluster' (a map of job name to list of host:port)")
    if not isinstance(task, dict):
        raise EnvError("TF_CONFIG: missing 'task' ({\"type\": ..., \"index\": ...})")
    ttype, index = task.get("type"), task.get("index")
    if ttype not in ("chief", "worker"):
        raise EnvError(
            f"TF_CONFIG: task.type is {ttype!r}; MultiWorkerMirroredStrategy runs only chief and worker tasks"
        )
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise EnvError(f"TF_CONFIG: task.index must be a non-negative integer, got {index!r}")
    if "ps" in cluster:
        raise EnvError("TF_CONFIG: cluster has 'ps' tasks; that is a ParameterServerStrategy job (see examples/tf_ps)")
    members = cluster.get(ttype)
    if not isinstance(members, list) or index >= len(members):
        raise EnvError(f"TF_CONFIG: task {ttype}:{index} has no address in cluster.{ttype}")
    for name, addrs in cluster.items():
        if not isinstance(addrs, list) or not all(isinstance(a, str) and ":" in a for a in addrs):
            raise EnvError(f"TF_CONFIG: cluster.{name} must be a list of 'host:port' strings")
    return cfg


def log(label: str, msg: str) -> None:
    print(f"[{label}] {msg}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--batch-per-replica", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    try:
        cfg = read_env()
    except EnvError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    ttype, index = cfg["task"]["type"], cfg["task"]["index"]
    label = f"{ttype}:{index}"
    n_tasks = sum(len(cfg["cluster"].get(k, [])) for k in ("chief", "worker", "master"))
    log(label, f"TF_CONFIG cluster={json.dumps(cfg['cluster'], sort_keys=True)} tasks={n_tasks}")

    t0 = time.monotonic()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import keras

    tf.config.set_visible_devices([], "GPU")  # CPU only, whatever the host has
    keras.utils.set_random_seed(1234)  # same initial weights on every task

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    log(label, f"strategy ready: replicas={strategy.num_replicas_in_sync} "
               f"task={resolver.task_type}:{resolver.task_id} (tf {tf.__version__}, "
               f"{time.monotonic() - t0:.1f}s)")

    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync
    n_features = 8

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        # Each input pipeline makes its own shard of one synthetic problem:
        # y = tanh(x . w_true / sqrt(d)) with a fixed w_true, x drawn per pipeline.
        rng = np.random.default_rng(1000 + ctx.input_pipeline_id)
        w_true = np.random.default_rng(7).normal(size=(n_features, 1)).astype("float32")
        n = ctx.get_per_replica_batch_size(global_batch) * 16
        x = rng.normal(size=(n, n_features)).astype("float32")
        y = np.tanh(x @ w_true / np.sqrt(n_features)).astype("float32")
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
        return ds.batch(ctx.get_per_replica_batch_size(global_batch), drop_remainder=True)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(n_features,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ])
        optimizer = keras.optimizers.SGD(learning_rate=args.lr)

    dist_ds = strategy.distribute_datasets_from_function(dataset_fn)
    it = iter(dist_ds)

    @tf.function
    def train_step(iterator):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                per_example = tf.reduce_mean(tf.square(pred - y), axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        x, y = next(iterator)
        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    for step in range(1, args.steps + 1):
        loss = float(train_step(it))
        log(label, f"step {step} loss {loss:.6f}")

    flat = np.concatenate([np.asarray(v.numpy(), dtype="float32").ravel() for v in model.weights])
    digest = hashlib.sha256(flat.tobytes()).hexdigest()
    log(label, f"done steps {args.steps} checksum {float(flat.astype('float64').sum()):.6f} "
               f"sha256 {digest} ({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
