#!/usr/bin/env python3
"""A trial of a hyperparameter study (`provision tune`): PyTorch, CPU, one process.

A small MLP (16 -> 64 tanh -> 1) learns a fixed synthetic regression problem (seeded: the
same data on every host) with plain SGD for ``--steps`` steps. Every ``--report_every``
steps it measures the loss on a held-out set and reports it through cloudml-hypertune, as
code written for Vertex AI / AI Platform tuning does::

    hypertune.HyperTune().report_hyperparameter_tuning_metric(
        hyperparameter_metric_tag=TAG, metric_value=val_loss, global_step=step)

TAG is ``CLOUD_ML_HP_METRIC_TAG`` when set, else ``val_loss``; the library writes to
``CLOUD_ML_HP_METRIC_FILE`` (default /tmp/hypertune/output.metrics). It also prints, flushed,
one line per report for a log-line collector (``tune.metric.regex``)::

    step=20 val_loss=0.095620

The loss depends clearly on the learning rate (measured, 200 steps, batch 64: README.md):
at 1e-4 it barely learns, at 1e-3 slowly, the good region is about 0.03-0.3 (best near
0.1-0.2), and from about 0.4 up SGD diverges. A diverged run (a loss that is NaN, infinite or above 1e6)
reports 1e6, a finite value a study can rank, says why, and ends (exit 0) at that step.

Parameters arrive as ``--name=value`` or ``--name value``; integers also as floats such as
``256.0`` (how DISCRETE values arrive). ``TF_CONFIG``'s ``task.trial`` (set in tuning jobs)
and ``CLOUD_ML_TRIAL_ID`` are printed when present.

Usage: python3 train.py [--learning_rate LR] [--batch_size N] [--momentum M] [--steps N]
                        [--report_every N] [--step_seconds S] [--crash_at_step N]
Exit status 0 on success (diverged included), 1 on a crash (``--crash_at_step``: a traceback
on stderr), 2 for unusable arguments or environment (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

PROG = "tune_torch"
DEFAULT_TAG = "val_loss"
DIVERGED = 1e6  # reported for a diverged run: finite, and worse than any real loss here
N_FEATURES = 16
HIDDEN = 64
N_TRAIN, N_VAL = 4096, 1024
DATA_SEED = 1234  # the problem: the same on every host and in every trial


class EnvError(Exception):
    """The task's environment is malformed."""


def read_env(environ=os.environ) -> dict:
    """What a tuning job tells its trial: the trial number (TF_CONFIG task.trial, or
    CLOUD_ML_TRIAL_ID) and the metric's tag; raises EnvError for a malformed TF_CONFIG."""
    out = {
        "trial": None,
        "trial_id": environ.get("CLOUD_ML_TRIAL_ID"),
        "tag": environ.get("CLOUD_ML_HP_METRIC_TAG") or DEFAULT_TAG,
    }
    raw = environ.get("TF_CONFIG", "").strip()
    if raw:
        try:
            tf_config = json.loads(raw)
        except ValueError as exc:
            raise EnvError(f"TF_CONFIG is not valid JSON ({exc})") from None
        task = tf_config.get("task") if isinstance(tf_config, dict) else None
        if task is not None and not isinstance(task, dict):
            raise EnvError("TF_CONFIG's task must be an object")
        out["trial"] = (task or {}).get("trial")
    return out


def whole_number(text: str) -> int:
    """An integer argument, also as a float (`256.0`: how DISCRETE values arrive)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not x.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(x)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description="a tuning trial: SGD on a synthetic regression (CPU)")
    ap.add_argument("--learning_rate", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    ap.add_argument("--batch_size", type=whole_number, default=64, help="examples per step (default 64)")
    ap.add_argument("--momentum", type=float, default=0.0, help="SGD momentum in [0, 1) (default 0)")
    ap.add_argument("--steps", type=whole_number, default=200, help="training steps (default 200)")
    ap.add_argument("--report_every", type=whole_number, default=20, help="steps between reports (default 20)")
    ap.add_argument(
        "--step_seconds",
        type=float,
        default=0.0,
        help="sleep this long each step, as if the model were bigger: a study's progress (and "
        "early stopping) can then be watched (default 0)",
    )
    ap.add_argument("--seed", type=whole_number, default=0, help="initial weights and batch order (default 0)")
    ap.add_argument("--crash_at_step", type=whole_number, default=None, help="raise an exception at this step")
    args = ap.parse_args(argv)
    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        ap.error(f"--learning_rate must be a positive number, got {args.learning_rate}")
    if not 0 <= args.momentum < 1:
        ap.error(f"--momentum must be in [0, 1), got {args.momentum}")
    for name in ("batch_size", "steps", "report_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.step_seconds < 0:
        ap.error(f"--step_seconds must be >= 0, got {args.step_seconds}")
    return args


def log(msg: str) -> None:
    print(msg, flush=True)


def make_data(torch):
    """A fixed regression problem: a random tanh teacher plus a linear part and noise, on
    features of spread scales (so too large a step diverges along the widest)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    scales = torch.logspace(math.log10(0.3), math.log10(1.6), N_FEATURES)
    x = torch.randn(N_TRAIN + N_VAL, N_FEATURES, generator=g) * scales
    w1 = torch.randn(N_FEATURES, 32, generator=g) / math.sqrt(N_FEATURES)
    w2 = torch.randn(32, 1, generator=g) / math.sqrt(32)
    linear = torch.randn(N_FEATURES, 1, generator=g) / math.sqrt(N_FEATURES)
    y = 2 * torch.tanh(x @ w1) @ w2 + 0.5 * x @ linear + 0.1 * torch.randn(N_TRAIN + N_VAL, 1, generator=g)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        env = read_env()
    except EnvError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        import hypertune  # cloudml-hypertune: imported here so --help works without it
    except ImportError:
        print(f"{PROG}: error: cloudml-hypertune is not installed (pip install cloudml-hypertune)", file=sys.stderr)
        return 2
    import torch  # here, not at the top: tests load this file for read_env without torch

    torch.set_num_threads(1)  # one core per trial: parallel trials share a host's CPUs
    log(
        f"trial {env['trial'] if env['trial'] is not None else '-'} (TF_CONFIG task.trial), "
        f"CLOUD_ML_TRIAL_ID {env['trial_id'] if env['trial_id'] is not None else '-'}, metric tag {env['tag']}"
    )
    log(
        f"learning_rate={args.learning_rate!r} batch_size={args.batch_size} momentum={args.momentum!r} "
        f"steps={args.steps} (torch {torch.__version__})"
    )
    ht = hypertune.HyperTune()
    log(f"reporting to {ht.metric_path}")

    x_train, y_train, x_val, y_val = make_data(torch)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=args.momentum)
    mse = torch.nn.MSELoss()
    batches = torch.Generator().manual_seed(args.seed)

    def report(step: int, value: float) -> None:
        ht.report_hyperparameter_tuning_metric(
            hyperparameter_metric_tag=env["tag"], metric_value=value, global_step=step
        )
        log(f"step={step} val_loss={value:.6f}")

    t0 = time.monotonic()
    val = float("nan")
    for step in range(1, args.steps + 1):
        if step == args.crash_at_step:
            raise RuntimeError(f"crashing at step {step} as asked (--crash_at_step {args.crash_at_step})")
        idx = torch.randint(0, N_TRAIN, (args.batch_size,), generator=batches)
        opt.zero_grad()
        loss = mse(model(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        train_loss = loss.item()
        if step % args.report_every == 0 or step == args.steps or not math.isfinite(train_loss):
            with torch.no_grad():
                val = mse(model(x_val), y_val).item()
            if not (math.isfinite(val) and val <= DIVERGED and math.isfinite(train_loss)):
                report(step, DIVERGED)
                log(
                    f"diverged at step {step}: training loss {train_loss:.6g}, val_loss {val:.6g} "
                    f"(learning rate {args.learning_rate!r} too large?); reported {DIVERGED:g} and stopped"
                )
                return 0
            report(step, val)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    log(f"done: {args.steps} steps in {time.monotonic() - t0:.1f}s, final val_loss {val:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
