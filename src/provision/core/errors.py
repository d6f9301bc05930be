"""User-facing errors and the exit codes the interface promises."""

from __future__ import annotations

import os

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CHANGES = 2  # plan --detailed-exitcode found changes
EXIT_UNREACHABLE = 3  # one or more hosts unreachable; the others were handled
# wait / apply --wait / logs -f / apply --queue gave up at --timeout: the job is neither
# succeeded nor failed (a queued one was not applied). 124, as timeout(1) exits.
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130  # Ctrl-C, in every command (128 + SIGINT, as shells report it)


class ProvisionError(Exception):
    """An error a user caused or can fix; printed as one line, never as a traceback."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, details: list[str] | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.details = details or []
        if exit_code is not None:
            self.exit_code = exit_code


class ValidationError(ProvisionError):
    """Inventory problems, all reported at once (one line each)."""

    def __init__(self, problems: list[str]):
        super().__init__(problems[0] if problems else "invalid inventory", details=problems[1:])
        self.problems = problems


def no_color() -> bool:
    """NO_COLOR set to anything but an empty string: no ANSI colours (https://no-color.org).
    Here, not in progress.py, so that the CLI's start does not load the status code."""
    return bool(os.environ.get("NO_COLOR"))
