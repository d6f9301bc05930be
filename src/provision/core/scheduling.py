"""What a job says about its turn on a shared cluster: its priority, whether it may be
preempted, and how (issue 42). The values as the inventory gives them; rules/priority.py
turns a class name into a number with the team's policy."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

DEFAULT_PRIORITY = "normal"
DEFAULT_GRACE_S = 120


class PreemptSignal(StrEnum):
    """The signals a task may be asked to stop with: a fixed list, so no inventory value
    reaches a unit file or a kill command as text of its own."""

    SIGTERM = "SIGTERM"
    SIGINT = "SIGINT"
    SIGHUP = "SIGHUP"
    SIGQUIT = "SIGQUIT"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"


@dataclass(frozen=True)
class Scheduling:
    # An integer, or a class name of the team's policy (`low`, `normal`, `high` by default).
    priority: int | str = DEFAULT_PRIORITY
    # None: the default for the kind of work (a study's trials yes, a plain job no).
    preemptible: bool | None = None
    grace_s: int = DEFAULT_GRACE_S
    signal: PreemptSignal = PreemptSignal.SIGTERM

    def may_be_preempted(self, trial: bool) -> bool:
        return trial if self.preemptible is None else self.preemptible
