"""The dashboard's answers that no command prints: a job's log lines as a page follows them,
and what an action (stop, rerun, cancel, promote) says. Typed so that mypy checks every
place that makes or reads one (docs/dashboard.md documents them)."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class LogLine(TypedDict):
    time: str  # ISO 8601, UTC
    task: str
    host: str
    text: str  # as the host sent it, ANSI escapes shown as \e


class LogsDoc(TypedDict):
    """`GET /api/v1/jobs/NAME/logs`: the lines after the opaque cursor `after`."""

    lines: list[LogLine]
    after: str
    errors: list[str]
    kept: NotRequired[bool]  # the lines are the service's kept copy (the hosts no longer have them)


class ActionAnswer(TypedDict):
    """What an action says: ok false is a refusal, with its reason."""

    ok: bool
    message: str
    stopped: NotRequired[list[str]]  # stop: the tasks it stopped
    inventory: NotRequired[str]  # promote: the inventory that runs the trial as a plain job
