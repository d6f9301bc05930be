"""Benchmark: how fast `provision.sandbox.up` gives usable hosts, with a warm image cache.

    python bench/sandbox_startup.py [--repeat 3] [--sizes 1,3,16] [--check]

For each size it starts a sandbox, times `up()` from the call until every host is usable
(systemd finished booting and root logged in over SSH with the sandbox key), checks each
host with one more SSH command, then times `down()`. Size 1 is the time to the first usable
host. The host image is built first if missing (reported apart: that is the cold cost).
Targets (warm): 3 hosts < 15 s, 16 hosts < 40 s; --check exits 1 when one is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from provision import sandbox

TARGETS = {3: 15.0, 16: 40.0}


def check_hosts(sb: sandbox.Sandbox) -> None:
    def one(h):
        with sb.connection(h) as c:
            out = c.run("hostname", hide=True).stdout.strip()
        assert out == h.container, (out, h.container)

    with ThreadPoolExecutor(max_workers=len(sb.hosts)) as ex:
        list(ex.map(one, sb.hosts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per size (default 3)")
    ap.add_argument("--sizes", default="1,3,16", help="host counts (default 1,3,16)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    client = sandbox.check_engine()
    t0 = time.monotonic()
    tag = sandbox.ensure_image(client, progress=lambda m: print(f"  {m}", file=sys.stderr))
    print(
        f"host image {tag}: ready in {time.monotonic() - t0:.1f} s "
        "(near 0 = warm cache; otherwise this was the one-off build)"
    )
    print(f"machine: {os.cpu_count()} cores; {args.repeat} run(s) per size\n")

    results: dict[int, list[float]] = {}
    downs: dict[int, list[float]] = {}
    missed = []
    n = 0
    for size in sizes:
        for _ in range(args.repeat):
            n += 1
            name = f"bench{os.getpid()}-{n}"
            try:
                t = time.monotonic()
                sb = sandbox.up(name, hosts=size, client=client)
                up_s = time.monotonic() - t
                check_hosts(sb)
            finally:
                t = time.monotonic()
                sandbox.down(name, client=client)
                down_s = time.monotonic() - t
            results.setdefault(size, []).append(up_s)
            downs.setdefault(size, []).append(down_s)
            print(f"  {size:>2} host(s): up {up_s:5.2f} s, down {down_s:5.2f} s")
    print()
    print(f"{'hosts':>5}  {'up median':>9}  {'min':>6}  {'max':>6}  {'down median':>11}  target")
    for size in sizes:
        ups = results[size]
        target = TARGETS.get(size)
        verdict = ""
        if target is not None:
            ok = statistics.median(ups) < target
            verdict = f"< {target:.0f} s {'ok' if ok else 'MISSED'}"
            if not ok:
                missed.append(size)
        if size == 1:
            verdict = "(time to first usable host)"
        print(
            f"{size:>5}  {statistics.median(ups):8.2f}s  {min(ups):5.2f}s  {max(ups):5.2f}s  "
            f"{statistics.median(downs[size]):10.2f}s  {verdict}"
        )
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
