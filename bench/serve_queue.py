"""Benchmark ("waiting work costs a row, not a process"): N queued applies handed to one
`provision serve`, none of which fits (a blocker holds every GPU), and the service's
processes and memory while they wait.

    PYTHONPATH=$PWD/src python bench/serve_queue.py [--queued 1000] [--seconds 120]
        [--sandbox NAME (reuse a running sandbox)] [--keep (leave the sandbox up)]

A sandbox of 2 hosts (2 fake GPUs each); a blocker applied from a terminal holds the 4
GPUs (`sleep infinity`); --queued submissions of a 1-GPU job are put in the service's
embedded database as `apply --queue --detach` puts them (the same store calls, without a
CLI start-up each: 1,000 of those take a quarter of an hour here), then `provision serve`
starts. Sampled every second over --seconds: the service's processes (itself, its spare
worker, the workers it admitted) and their RSS summed; at the end, how many submissions are
queued (a row each) and how many it looked at. Before the rows, 30 queued applies started 31
workers (2.3 GiB, load 15 on 2 cores): one process per waiting submission.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path

from servebench import Report, Sampler, Serve, rss_mib

from provision import sandbox
from provision.core.submission import Kind, Options
from provision.inventory.inventory import load
from provision.io.servicestore import ServiceStore, Submission
from provision.rules.tenancy import identity
from provision.sandbox.inventory import dump
from provision.serve.snapshot import snapshot_of, store_files

PROCESS_BOUND = 6  # the service, its spare, at most 4 admitted workers
SERVICE_MIB = 200.0  # the service process alone (its workers are counted apart)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queued", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--sandbox", default="")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    rep = Report(f"{time.strftime('%Y-%m-%d')}-serve-queue-{args.queued}", f"{args.queued} queued applies, one service")
    name = args.sandbox or f"bq{os.getpid()}"
    sb = sandbox.up(name, hosts=2, gpus_per_host=2) if not args.sandbox else sandbox.load(name)
    tmp = Path(tempfile.mkdtemp(prefix="serve-queue-"))
    env = {"PROVISION_SERVICE_DB": str(tmp / "svc" / "service.sqlite"), "PROVISION_OWNER": "bench@example.com"}
    os.environ.update(env)
    serve: Serve | None = None
    try:
        blocker = tmp / "blocker.yaml"
        pools = {"worker": {"replicas": 2, "accelerators": 2, "command": ["sleep", "infinity"]}}
        blocker.write_text(dump(sandbox.inventory_dict(sb, job="blocker", pools=pools), sb))
        os.system(f"cd {tmp} && python -m provision apply -y {blocker} >/dev/null")  # noqa: S605 - the bench's own file
        store = ServiceStore.open_local(Path(env["PROVISION_SERVICE_DB"]))
        began = time.monotonic()
        for n in range(args.queued):
            d = tmp / f"q{n}"
            d.mkdir()
            inv = d / "inv.yaml"
            pools = {"chief": {"replicas": 1, "accelerators": 1, "command": ["true"]}}
            inv.write_text(dump(sandbox.inventory_dict(sb, job=f"q{n}", pools=pools), sb))
            snap = snapshot_of(load(inv))
            sid = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
            state = str(d / ".provision" / f"q{n}.state.json")
            store.submit(
                Submission(sid, Kind.APPLY, f"q{n}", identity(socket.gethostname()), "local", state, snap.inventory,
                           store_files(store, snap), Options())
            )  # fmt: skip
        store.close()
        rep.say(f"{args.queued} submissions stored in {time.monotonic() - began:.1f} s")
        serve = Serve(tmp / "svc", env)
        serve.wait_for("leading", 120)
        s = Sampler(serve.p.pid, every=1.0)
        own: list[float] = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            s.sample()
            own.append(rss_mib(serve.p.pid))
            time.sleep(1.0)
        s.sample()
        procs = max(x[3] for x in s.samples)
        rep.say(f"over {args.seconds:g} s: processes at most {procs}, RSS at most {s.rss_max():.0f} MiB in all "
                f"(the service alone {max(own):.0f} MiB), CPU {100 * s.cpu_share():.1f} % of a core")  # fmt: skip
        with sqlite3.connect(env["PROVISION_SERVICE_DB"]) as c:
            states = dict(
                c.execute("SELECT status, count(*) FROM provision_service_submissions GROUP BY status").fetchall()
            )
        rep.say(f"submissions by status at the end: {states}")
        rep.verdict("processes while they wait", f"{procs} (bound {PROCESS_BOUND})", procs <= PROCESS_BOUND)
        rep.verdict("the service's memory (its own process)", f"{max(own):.0f} MiB", max(own) <= SERVICE_MIB)
    finally:
        if serve is not None:
            serve.stop()
        with contextlib.suppress(Exception):
            os.system(f"cd {tmp} && python -m provision destroy -y {tmp / 'blocker.yaml'} >/dev/null")  # noqa: S605
        if not args.keep and not args.sandbox:
            sandbox.down(name)
        rep.write()


if __name__ == "__main__":
    main()
