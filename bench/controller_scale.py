#!/usr/bin/env python3
"""The controller's CPU per host for plan and a first apply, without SSH, at N hosts.

    python bench/controller_scale.py --hosts 250 1000 2000 [--profile 1000]

For each N: an inventory of N hosts (a chief and N-1 workers, one task per host, no
accelerators, NCCL's and Gloo's interface set: the one-round-trip first apply's kind), a
fresh state in a temporary directory, then, in this process, timed (CPU of this thread):

- open: load + validate + place + render (run/context.open_context);
- presumed plan: every host's probe request and presumed answer, make_plan (what a plan
  costs here besides SSH, from canned answers);
- apply requests: what the apply builds per host before sending (the manifests, the write
  and start requests with the guard, as the wire's JSON, the state's pending records);
- plan from answers: make_plan from the same answers again (a no-op apply's and plan's own
  part, the hosts answering as the first apply left them aside).

Per host = each part's time / N: a part whose per-host time grows with N is quadratic.
SSH's own cost per host is measured on real hosts by bench/roundtrips.py.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def inventory(n: int, key: Path) -> str:
    lines = [
        "job: scale",
        f"ssh: {{user: root, identity_file: {key}, host_key_policy: accept-new}}",
        "env: {NCCL_SOCKET_IFNAME: eth0, GLOO_SOCKET_IFNAME: eth0}",
        "hosts:",
    ]
    for i in range(n):
        a, b = divmod(i + 1, 250)
        lines.append(f"  - {{name: h{i + 1:04d}, address: 10.1.{a}.{b + 1}}}")
    lines += [
        "pools:",
        "  chief: {replicas: 1, command: [/bin/sleep, infinity]}",
        f"  worker: {{replicas: {n - 1}, command: [/bin/sleep, infinity]}}",
    ]
    return "\n".join(lines) + "\n"


def measure(n: int, profile: bool) -> dict[str, float]:
    from provision.core.target import Target
    from provision.host.protocol import BatchRequest, to_wire
    from provision.rules.planner import make_plan
    from provision.run import apply as apply_mod
    from provision.run import firstapply
    from provision.run.context import open_context

    d = Path(tempfile.mkdtemp(prefix="ctlscale"))
    key = d / "id"
    key.write_text("not a key\n")
    key.chmod(0o600)
    inv = d / "inv.yaml"
    inv.write_text(inventory(n, key))
    out: dict[str, float] = {}
    prof = cProfile.Profile() if profile else None

    def part(name, fn):
        if prof:
            prof.enable()
        t0 = time.thread_time()
        r = fn()
        out[name] = time.thread_time() - t0
        if prof:
            prof.disable()
        return r

    ctx = part("open (load, place, render)", lambda: open_context(str(inv), operation="apply"))
    try:
        pre = part("presumed plan", lambda: firstapply.presumed_plan(ctx, checks=True))
        assert pre is not None

        def requests() -> int:
            a = apply_mod._Apply(ctx, pre.plan, lambda s: None)
            guard = firstapply.guard(pre)
            size = 0
            for name in a.work:
                t: Target = ctx.targets[name]
                batch = BatchRequest([guard(t), a._write_request(t), a._start_request(t, a.first or 0)])
                size += len(json.dumps(to_wire(batch)))
                apply_mod.host_record(ctx, t, a.work[name], pending=True)
            return size

        part("apply requests (manifests, wire, records)", requests)
        reports = {n_: firstapply.presumed(r, time.time()) for n_, r in pre.requests.items()}
        part("plan from answers (make_plan)", lambda: make_plan(ctx.rendered, ctx.targets, reports))
    finally:
        ctx.close()
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--profile", type=int, default=0, help="cProfile the run of this many hosts")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {n: measure(n, n == args.profile) for n in args.hosts}
    parts = list(next(iter(rows.values())))
    lines = [
        f"# The controller's CPU per host without SSH ({time.strftime('%Y-%m-%d %H:%M')} UTC)",
        "",
        f"`python bench/controller_scale.py {' '.join(sys.argv[1:])}` (ms per host; CPU of the thread)",
        "",
        f"  {'part':44s} " + " ".join(f"{n:>9d}" for n in rows),
    ]
    for p in parts:
        lines.append(f"  {p:44s} " + " ".join(f"{rows[n][p] / n * 1000:9.3f}" for n in rows))
    lines.append(f"  {'all':44s} " + " ".join(f"{sum(rows[n].values()) / n * 1000:9.3f}" for n in rows))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
