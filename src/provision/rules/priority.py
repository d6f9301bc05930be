"""A job's priority as a number, and the order of waiting work: higher priority
first, then the earlier submission, as Slurm's and Kueue's queues order theirs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from provision.core.errors import ProvisionError
from provision.rules.health import HealthPolicy

# The classes every team has until its policy names others (`provision policy set`).
DEFAULT_CLASSES: Mapping[str, int] = {"low": 100, "normal": 500, "high": 1000}


class PriorityError(ProvisionError):
    pass


@dataclass(frozen=True)
class DevPolicy:
    """What `provision dev` sessions get (the policy's `dev:`): their priority (a class or a
    number: preemptible, like every session), how long one lasts unless --hours says, and
    the idle rule: its GPUs below `idle_below` % for `idle_minutes` with nobody logged in
    end it."""

    priority: int | str = "normal"
    hours: float = 8.0
    idle_minutes: int = 60
    idle_below: int = 5


@dataclass(frozen=True)
class Policy:
    """The team's policy: its priority classes and each owner's guaranteed GPUs. The local
    default state has none: DEFAULT_CLASSES and no guarantee, so nothing changes for one
    person."""

    classes: tuple[tuple[str, int], ...] = tuple(DEFAULT_CLASSES.items())
    guarantees: tuple[tuple[str, int], ...] = ()  # owner (or group) -> GPUs
    groups: tuple[tuple[str, str], ...] = ()  # owner -> the group whose guarantee it shares
    health: HealthPolicy = HealthPolicy()  # which Xids are fatal, whether a release needs a test
    dev: DevPolicy = DevPolicy()

    def quota_of(self, owner: str) -> str:
        """The name an owner's usage and guarantee are counted under."""
        return dict(self.groups).get(owner, owner)

    def guarantee(self, owner: str) -> int:
        return dict(self.guarantees).get(self.quota_of(owner), 0)


def level(priority: int | str, policy: Policy) -> int:
    """The number a priority stands for: itself, or its class's number in the policy."""
    if isinstance(priority, int):
        return priority
    classes = dict(policy.classes)
    if priority not in classes:
        known = ", ".join(f"{k} ({v})" for k, v in sorted(classes.items(), key=lambda kv: kv[1]))
        raise PriorityError(f"priority: {priority!r} is not a class of the team's policy (known: {known})")
    return classes[priority]


def name_of(value: int, policy: Policy) -> str:
    """How a number is shown: its class's name where one has it ("high"), else the number."""
    for k, v in policy.classes:
        if v == value:
            return k
    return str(value)


def queue_key(priority: int, submitted: float, job: str) -> tuple[int, float, str]:
    """Sort key of waiting work: the higher priority first, then first come, then by name
    (so two runs sort alike)."""
    return (-priority, submitted, job)
