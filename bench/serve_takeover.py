"""Benchmark ("Take-over after the leader dies: <= 15 s"): two `provision serve`
on one real PostgreSQL (tests/pgserver.py, over TCP on 127.0.0.1); the leader dies and the
time from its death to the follower's first action as leader (its "leading" line, printed
when it holds the advisory lock, right before it drives the submissions) is taken, `--reps`
times (a new follower is started after each take-over), median and max.

    PYTHONPATH=$PWD/src python bench/serve_takeover.py [--reps 10] [--poll 1.0]
    PYTHONPATH=$PWD/src python bench/serve_takeover.py --dead-machine [--reps 5]   # as root

The services run with the default --poll (1 s) and no pages.

- Default: the leader's process is killed (SIGKILL). Its kernel closes its TCP connections:
  the server ends the session and frees the lock at once, so the take-over is the
  follower's poll plus a connect.
- --dead-machine: the leader's MACHINE dies (power off, network gone): its process is
  frozen (SIGSTOP) and every packet of its connections to PostgreSQL is dropped both ways
  (iptables on loopback, by the leader's local ports as `ss -tnp` lists them): no FIN or RST
  reaches the server, which must see the session gone by itself (io/pgstate.py's
  LOCK_BOUND: the server's keepalives and TCP_USER_TIMEOUT set on the lock's session).
  Then the rules are removed and the old leader woken (SIGCONT): it must say it lost the
  lead and never act as leader again (serve/service.py's _leading). Needs root (iptables);
  the rules carry the comment "provision-bench" and are removed in any case.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from servebench import Report, Serve, median, pg_env

from provision.sandbox.netcut import machine_dead

BOUND = 15.0
WAKE = 30.0  # seconds a woken old leader has to say it lost the lead


def die_as_a_machine(leader: Serve, follower: Serve, pg_port: int, wait: float) -> tuple[float | None, str]:
    """Freeze the leader and cut its connections: the take-over's time (None: none within
    `wait` s). Then the network back and the old leader woken: what it did (it must give the
    lead up and not lead again)."""
    took: float | None = None
    with machine_dead(leader.p.pid, pg_port, "provision-bench") as ports:
        died = time.monotonic()
        try:
            took = follower.wait_for("leading", wait, after=died) - died
        except RuntimeError:
            pass
    woke = time.monotonic()
    try:
        lost = f"said it lost the lead after {leader.wait_for('the lead was lost', WAKE, after=woke) - woke:.3f} s"
    except RuntimeError:
        lost = f"did NOT say it lost the lead within {WAKE:g} s"
    again = leader.first("leading", after=woke)
    led = f"LED AGAIN at +{again - woke:.3f} s" if again is not None else "did not lead again"
    return (
        took,
        f"  its connections (local ports {ports}) cut; woken with the network back, the old leader {lost}, {led}",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--name", default="")
    ap.add_argument("--dead-machine", action="store_true", help="the leader's machine dies (SIGSTOP + iptables)")
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a take-over")
    args = ap.parse_args()
    from pgserver import start_server

    if args.dead_machine:
        name = args.name or "2026-11-27-issue40-takeover-dead-machine"
        title = "take-over after the leader's machine dies (SIGSTOP + its packets dropped)"
    else:
        name = args.name or "2026-11-27-issue40-takeover"
        title = "take-over after the leader's kill -9 (two services, one PostgreSQL)"
    rep = Report(name, title)
    server = start_server()
    tmp = Path(tempfile.mkdtemp(prefix="bench-takeover-"))
    env = {**pg_env(server), "PROVISION_OWNER": "bench@example.com"}
    opts = ("--poll", f"{args.poll:g}", "--listen", "none")
    running: list[Serve] = []
    took: list[float] = []
    failed = 0
    try:

        def start(n: int) -> Serve:
            s = Serve(tmp / f"s{n}", {**env, "PROVISION_SERVICE_DB": str(tmp / f"s{n}" / "svc.sqlite")}, opts)
            running.append(s)
            s.wait_for("following until it can lead", 60)
            return s

        leader = start(0)
        leader.wait_for("leading", 30)
        for n in range(1, args.reps + 1):
            follower = start(n)
            # It has tried the lock (and failed) at least once; the kill at a random phase of its
            # poll (a fixed sleep kills right before its next try: 0.05 s every time).
            time.sleep(2 * args.poll + random.uniform(0, args.poll))
            if follower.first("leading") is not None:
                raise RuntimeError("the follower leads while the leader lives:\n" + follower.output())
            if args.dead_machine:
                t, after = die_as_a_machine(leader, follower, server.port, args.wait)
                what = f"the machine of pid {leader.p.pid} dies"
                leader.stop()
            else:
                leader.p.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                leader.p.wait()
                t = follower.wait_for("leading", args.wait, after=killed) - killed
                what, after = f"kill -9 of pid {leader.p.pid}", ""
            if t is None:
                failed += 1
                rep.say(f"rep {n}: {what} -> the follower (pid {follower.p.pid}) does NOT lead within {args.wait:g} s")
                rep.say(after)
                break
            took.append(t)
            rep.say(f"rep {n}: {what} -> the follower (pid {follower.p.pid}) leads after {t:.3f} s")
            if after:
                rep.say(after)
            leader = follower
    finally:
        for s in running:
            s.stop()
        server.cleanup()
    if took:
        rep.say(
            f"{len(took)} take-overs, poll {args.poll:g} s: median {median(took):.3f} s, max {max(took):.3f} s, min {min(took):.3f} s"
        )
    worst = f"> {args.wait:g} s (no take-over)" if failed else f"{max(took):.3f} s"
    rep.verdict(f"take-over <= {BOUND:g} s (max of {len(took) + failed})", worst, not failed and max(took) <= BOUND)
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
