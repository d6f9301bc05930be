"""A machine's death as the network sees it, for tests and benchmarks: a process
frozen and its TCP connections to a loopback port dropped both ways with iptables (root
only), so that the server gets no FIN, no RST and no answer to its keepalives, as when the
peer's machine loses power. Always undone by the context manager's exit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


def ports_of(pid: int, port: int) -> list[int]:
    """`pid`'s local ports of its established connections to `port` on loopback (from `ss`)."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established", "dport", "=", f":{port}"],  # noqa: S607 - iproute2's ss
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(int(m[1]) for m in re.finditer(rf"127\.0\.0\.1:(\d+)\s+127\.0\.0\.1:{port}\s.*pid={pid},", out))


def drop_rules(ports: list[int], port: int, tag: str) -> list[list[str]]:
    """iptables rule specs (INPUT on lo) dropping every packet of these connections, both ways."""
    both = [(p, port) for p in ports] + [(port, p) for p in ports]
    comment = ["-m", "comment", "--comment", tag]
    return [
        ["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(a), "--dport", str(b), *comment, "-j", "DROP"]
        for a, b in both
    ]


def _iptables(op: str, rule: list[str]) -> None:
    subprocess.run(["iptables", "-w", op, *rule], check=True, capture_output=True, text=True)  # noqa: S607


@contextmanager
def machine_dead(pid: int, port: int, tag: str) -> Iterator[list[int]]:
    """Inside: `pid` frozen (SIGSTOP) and its connections to `port` cut (the ports, yielded);
    on exit the rules are removed and it is woken (SIGCONT), whatever happened."""
    ports = ports_of(pid, port)
    if not ports:
        raise RuntimeError(f"no connection of pid {pid} to port {port} found by ss")
    cut: list[list[str]] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for rule in drop_rules(ports, port, tag):
            _iptables("-I", rule)
            cut.append(rule)
        yield ports
    finally:
        for rule in cut:
            _iptables("-D", rule)
        os.kill(pid, signal.SIGCONT)
