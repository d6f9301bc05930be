"""Benchmark ("an event reaches a local webhook receiver <= 2 s after the round that saw it;
a burst of 10,000 events is delivered while the service's round takes no more than 10 %
longer; an endpoint that hangs for 60 s delays no other delivery"):

    PYTHONPATH=$PWD/src python bench/notify.py [--hosts 8] [--events 10000] [--rounds 30]
        [--hang 60] [--sandbox NAME (reuse a running sandbox)] [--keep (leave the sandbox up)]

The service's own parts in this process, as cli/servecmd._run wires them: the rounds
(serve/rounds.Rounds: run/survey of --hosts sandbox hosts, each running one task of a job
applied from a terminal, then GpuRecorder and EventMaker on the embedded database) and the
notifications (serve/notify.Notifications on a connection of their own, one signed webhook
rule). The receivers are processes of their own on loopback (this file with --receiver),
so that their work is not this process's.

1. The round's time (each `Rounds.round()`, back to back) with the notifications idle:
   --rounds rounds before the burst and --rounds after it (the baseline: both).
2. A burst: --events events stored at once (in pieces of 1000, on a connection of their
   own, as a worker process stores what it tells); rounds go on back to back until the
   receiver has them all: each round's time while they are delivered, and how long the
   delivery took.
3. Latency: a round whose subscribers make one event (a subscriber after EventMaker
   stores it and wakes the deliveries, as EventMaker does when a round makes events): the
   time from the round's end to the receiver's arrival, --rounds times.
4. A second rule to a receiver that holds every POST for --hang seconds; the same
   latency to the first receiver, measured over --hang + 10 seconds.

Why a rule is paced (serve/notify.RATE): at full speed (577 signed POSTs a second to a
local receiver, before the pace) the round took 2.7 times as long during the burst on this
project's 2 cores; at 100 a second it took as long as without.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from servebench import ROOT, Report, median

from provision import sandbox
from provision.core.events import Event, How, Kind
from provision.core.notify import Channel, Rule
from provision.io.servicestore import ServiceStore
from provision.rules.rounds import Round
from provision.run.survey import KeptContexts
from provision.sandbox.inventory import dump
from provision.serve.notify import Notifications
from provision.serve.rounds import EventMaker, GpuRecorder, Rounds
from provision.serve.source import Known

LATENCY_BOUND = 2.0  # seconds
ROUND_BOUND = 1.10  # of the baseline's median


def receiver(hang: float) -> None:
    """--receiver: POSTs kept as (event id, arrival time); GET / answers them as JSON."""
    got: list[tuple[int, float]] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # connections kept, as a web server keeps them

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            t = time.time()
            if hang:
                time.sleep(hang)
            with lock:
                got.append((int(json.loads(body)["event"]["id"]), t))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # /?since=ID: those of ids from ID on; /count?since=ID: how many
            since = int(self.path.partition("since=")[2] or 0)
            with lock:
                mine = [g for g in got if g[0] >= since]
            data = json.dumps(len(mine) if self.path.startswith("/count") else mine).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


class Receiver:
    def __init__(self, hang: float = 0.0):
        self.p = subprocess.Popen(
            [sys.executable, __file__, "--receiver", "--hang", str(hang)], stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdout is not None
        self.port = int(self.p.stdout.readline())

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook/bench"

    def got(self, since: int = 0) -> list[tuple[int, float]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/?since={since}", timeout=30) as r:
            return [(int(i), float(t)) for i, t in json.loads(r.read())]

    def count(self, since: int) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/count?since={since}", timeout=30) as r:
            return int(json.loads(r.read()))

    def stop(self) -> None:
        self.p.kill()
        self.p.wait()


class Maker:
    """A subscriber after EventMaker: one event per round when `armed` (stored, then the
    deliveries woken: what EventMaker does with the events a round makes)."""

    name = "bench events"

    def __init__(self, store: ServiceStore, wake: Any):
        self.store, self.wake, self.armed, self.n, self.ids = store, wake, False, 0, [0]

    def on_round(self, r: Round) -> None:
        if not self.armed:
            return
        self.n += 1
        self.ids = self.store.emit([_event(f"latency-{self.n}")])
        self.wake()


def _event(key: str) -> Event:
    return Event(Kind.JOB_ENDED, f"bench:{key}", f"bench-{key}", "bench@example.com", "host-1",
                 f"job bench-{key} failed: chief-0 exited 3", How.FAILED, 1, ("host-1",), 1)  # fmt: skip


def _timed(rounds: Rounds) -> float:
    t = time.monotonic()
    if rounds.round() is None:
        raise RuntimeError("a round could not ask the hosts")
    return time.monotonic() - t


def _latencies(
    rep: Report, what: str, rounds: Rounds, maker: Maker, to: Receiver, n: int, seconds: float
) -> list[float]:
    out: list[float] = []
    maker.armed = True
    end = time.monotonic() + seconds
    while len(out) < n or time.monotonic() < end:
        _timed(rounds)
        done, want = time.time(), maker.ids[0]
        limit = time.monotonic() + 30
        while time.monotonic() < limit:
            hit = [t for i, t in to.got(want) if i == want]
            if hit:
                out.append(hit[0] - done)
                break
            time.sleep(0.02)
        else:
            out.append(float("inf"))
    maker.armed = False
    rep.say(
        f"{what}: {len(out)} events, from the round's end to the receiver: median {median(out) * 1000:.0f} ms, "
        f"max {max(out) * 1000:.0f} ms"
    )
    return out


def main() -> int:  # noqa: C901  one bench's steps in order, each with its report lines
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--hang", type=float, default=60.0)
    ap.add_argument("--sandbox", help="a running sandbox's name (else one is started and removed)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--name", default=time.strftime("%Y-%m-%d-notify-delivery"))
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        receiver(args.hang)
        return 0
    rep = Report(args.name, f"notifications: {args.hosts} sandbox hosts, a burst of {args.events} events")
    t = time.monotonic()
    sb = sandbox.load(args.sandbox) if args.sandbox else sandbox.up("notifybench", hosts=args.hosts, gpus_per_host=2)
    hosts = [h.name for h in sb.hosts][: args.hosts]
    rep.say(f"sandbox {sb.name}: {len(hosts)} hosts ({time.monotonic() - t:.0f} s to have them)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-notify-"))
    db = tmp / "svc" / "service.sqlite"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PROVISION_SERVICE_DB": str(db),
           "PROVISION_OWNER": "bench@example.com", "BENCH_HOOK_KEY": "bench-key"}  # fmt: skip
    os.environ.update(BENCH_HOOK_KEY="bench-key")
    pools = {"worker": {"replicas": len(hosts), "accelerators": 1, "command": ["sleep", "infinity"]}}
    inv = tmp / "job.yaml"
    inv.write_text(dump(sandbox.inventory_dict(sb, job="notifybench", pools=pools, hosts=hosts), sb))
    r = subprocess.run([sys.executable, "-m", "provision", "apply", "-y", str(inv)], env=env, cwd=tmp,
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(r.stdout + r.stderr)
    rep.say(f"job notifybench: one task on each of the {len(hosts)} hosts (applied from a terminal)")
    fast, stuck = Receiver(), Receiver(hang=args.hang)
    side = ServiceStore.open_local(db)
    other = ServiceStore.open_local(db)  # a worker's connection: what it tells
    leading = threading.Event()
    leading.set()
    said: list[str] = []
    notes = Notifications(ServiceStore.open_local(db), leading, said.append, "https://ml.example.org")
    side.add_rule(Rule("fast", Channel.WEBHOOK, fast.url(), secret_env="BENCH_HOOK_KEY"))
    known = Known(side, tmp / "work", [str(inv)])
    maker = Maker(side, notes.wake)
    rounds = Rounds(
        known.read, KeptContexts(known), [GpuRecorder(side), EventMaker(side, wake=notes.wake), maker], leading,
        said.append,
    )  # fmt: skip
    notes.start()
    try:
        for _ in range(3):
            _timed(rounds)  # connections opened, the first rounds' events made
        before = [_timed(rounds) for _ in range(args.rounds)]
        rep.say(f"rounds before the burst: median {median(before) * 1000:.0f} ms, max {max(before) * 1000:.0f} ms")

        first = other.last_event_id() + 1
        t0 = time.monotonic()
        for k in range(0, args.events, 1000):
            other.emit([_event(f"burst-{i}") for i in range(k, min(k + 1000, args.events))])
        notes.wake()
        stored = time.monotonic() - t0
        during: list[float] = []
        while True:
            during.append(_timed(rounds))
            n = fast.count(first)
            if n >= args.events:
                break
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"{n} of {args.events} delivered after 900 s")
        took = time.monotonic() - t0
        rep.say(
            f"burst: {args.events} events stored in {stored:.1f} s, delivered (each a signed POST) in {took:.1f} s "
            f"({args.events / took:.0f}/s); {len(during)} rounds meanwhile: median {median(during) * 1000:.0f} ms, "
            f"max {max(during) * 1000:.0f} ms"
        )
        after = [_timed(rounds) for _ in range(args.rounds)]
        rep.say(f"rounds after the burst: median {median(after) * 1000:.0f} ms, max {max(after) * 1000:.0f} ms")
        base = median(before + after)
        ratio = median(during) / base

        lat = _latencies(rep, "latency", rounds, maker, fast, args.rounds, 0.0)

        side.add_rule(Rule("stuck", Channel.WEBHOOK, stuck.url()))
        until = time.monotonic() + 30
        while "stuck" not in notes.deliveries and time.monotonic() < until:
            time.sleep(0.1)
        hung = _latencies(
            rep, f"latency while a second rule's receiver holds each POST {args.hang:g} s", rounds, maker, fast,
            args.rounds, args.hang + 10,
        )  # fmt: skip
        rep.say(
            f"  the holding receiver: {len(stuck.got())} POSTs answered meanwhile (each cut off at 10 s by the "
            "service and tried again later)"
        )
        rep.say("service log: " + (" | ".join(said) if said else "(nothing)"))
        rep.verdict(f"an event at the receiver <= {LATENCY_BOUND:g} s after its round", f"max {max(lat):.2f} s",
                    max(lat) <= LATENCY_BOUND)  # fmt: skip
        rep.verdict(
            f"the round during the burst <= {ROUND_BOUND:.2f} x its baseline",
            f"median {median(during) * 1000:.0f} ms vs {base * 1000:.0f} ms: x{ratio:.3f}",
            ratio <= ROUND_BOUND,
        )
        rep.verdict(
            f"a {args.hang:g} s hang delays no other rule", f"max {max(hung):.2f} s", max(hung) <= LATENCY_BOUND
        )
    finally:
        notes.stop()
        rounds.contexts.close()
        fast.stop()
        stuck.stop()
        subprocess.run([sys.executable, "-m", "provision", "destroy", "-y", str(inv)], env=env, cwd=tmp,
                       capture_output=True)  # fmt: skip
        side.close()
        other.close()
        if not args.sandbox and not args.keep:
            sandbox.down(sb.name)
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
