"""Named per-host steps and the one runner that runs a step on many hosts at once.

Every command that talks to hosts is a sequence of steps (probe, write files, start a phase,
stop a phase, remove the job); each step is one SSH round trip per host, all hosts in
parallel, and its outcome sorted per host into ok / failed / unreachable (like Fabric's
GroupResult), so callers never sort exceptions themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from provision.core.target import HostError, Target
from provision.io.ssh import Session

T = TypeVar("T")


class Step(StrEnum):
    PROBE = "probe"
    SHIP = "ship images"
    WRITE = "write files"
    SETUP = "run setup"
    START = "start tasks"
    STOP = "stop tasks"
    REMOVE = "remove the job"
    END = "end the job"
    NETWORK = "check the network"
    QUEUE = "mark the queued apply"
    HEALTH = "change the health record"
    TEST = "test GPUs"
    FABRIC = "measure the fabric"


@dataclass
class GroupResult(Generic[T]):
    """One step's outcome per host."""

    step: Step
    ok: dict[str, T] = field(default_factory=dict)
    failed: dict[str, HostError] = field(default_factory=dict)
    unreachable: dict[str, HostError] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def errors(self) -> dict[str, HostError]:
        return {**self.failed, **self.unreachable}

    def get(self, name: str) -> T | HostError:
        if name in self.ok:
            return self.ok[name]
        return self.errors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.ok or name in self.failed or name in self.unreachable

    def updated(self, again: GroupResult[T]) -> GroupResult[T]:
        """This outcome, with the hosts `again` ran on taken from `again` (a step retried)."""
        out: GroupResult[T] = GroupResult(self.step, seconds=self.seconds + again.seconds)
        for bucket in ("ok", "failed", "unreachable"):
            mine, theirs = getattr(self, bucket), getattr(again, bucket)
            getattr(out, bucket).update({k: v for k, v in mine.items() if k not in again})
            getattr(out, bucket).update(theirs)
        return out


def run_step(session: Session, step: Step, fn: Callable[[Target], T], targets: Iterable[Target]) -> GroupResult[T]:
    """fn on every target in parallel (session.parallelism at once); a HostError on one host
    never stops the others."""
    _pause_for_tests(step)
    start = time.monotonic()
    res: GroupResult[T] = GroupResult(step)
    for name, r in session.map(fn, targets).items():
        if isinstance(r, HostError):
            (res.unreachable if r.unreachable else res.failed)[name] = r
        else:
            res.ok[name] = r
    res.seconds = time.monotonic() - start
    return res


def _pause_for_tests(step: Step) -> None:
    """PROVISION_TEST_PAUSE=STEP:SECONDS (e.g. START:30) sleeps before that step, so fault
    tests can kill an apply at a known point (between reserving and starting, say)."""
    want = os.environ.get("PROVISION_TEST_PAUSE", "")
    name, _, secs = want.partition(":")
    if name and name == step.name:
        time.sleep(float(secs or 30))
