"""The kernel's neighbour (ARP) table, which every container on the machine shares.

Its size limits (net.ipv4.neigh.default.gc_thresh1/2/3: 128, 512, 1024 by default) count the
entries of every network namespace together, and a sandbox whose N hosts all talk to each
other (TF_CONFIG's all-to-all, `provision check`'s network round trip) needs about N²: past
about 30 hosts new entries are refused ("neighbour table overflow"), ARP fails, and
connections between some pairs of hosts time out as if a firewall dropped them (measured:
32 hosts, all-to-all, 32 of 992 pairs timed out at 1024; none at 16384).
"""

from __future__ import annotations

from pathlib import Path

from ._util import Progress, raise_sysctls

NEIGH = Path("/proc/sys/net/ipv4/neigh/default")
LIMITS = {"gc_thresh1": 4096, "gc_thresh2": 8192, "gc_thresh3": 16384}
NEEDED_PAST = 16  # hosts on the machine: 16 hosts all-to-all are 240 entries


def raise_neighbour_limits(total_hosts: int, progress: Progress, root: Path = NEIGH) -> None:
    """Raise the limits (never lower them) when the machine will run more than NEEDED_PAST
    sandbox hosts; say so when they cannot be raised (not root)."""
    if total_hosts > NEEDED_PAST:
        raise_sysctls(root, "net.ipv4.neigh.default", LIMITS, f"{total_hosts} hosts that talk to each other", progress)
