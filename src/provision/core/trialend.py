"""How a trial ended, as its worker saw it: what the study loop tells the search."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Ending(StrEnum):
    SUCCEEDED = "succeeded"
    STOPPED_EARLY = "stopped early"
    FAILED = "failed"
    LOST = "lost"  # adopted, but not on its hosts any more: failed, and run again
    LEFT_RUNNING = "left running"  # tune was interrupted: the trial runs on, for the next tune
    # Its job was preempted: not an end. The trial is not told; it waits in the
    # queue and resumes as the same trial (its worker's word to the loop, never told).
    PAUSED = "paused"


@dataclass(frozen=True)
class Ended:
    ending: Ending
    why: str
    value: float | None = None
    steps: int | None = None
    lines: tuple[str, ...] = ()  # a failed task's last lines (its traceback)
