"""`apply --queue`: wait until the job fits on shared hosts, then apply (like a batch queue).

Waiting is re-planning: every POLL seconds the hosts are probed again (one round trip each),
and as soon as placement finds room (another job ended or was destroyed) the plan goes
ahead. Only "does not fit because other jobs hold it" is waited for; any other error ends
the wait at once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from provision.core.errors import EXIT_TIMEOUT, ProvisionError
from provision.core.text import duration
from provision.spec.placement import PlacementError

T = TypeVar("T")
POLL = float(os.environ.get("PROVISION_QUEUE_POLL", 5))  # seconds between looks


class Queue:
    def __init__(self, timeout: float | None, progress: Callable[[str], None]):
        self.start = time.monotonic()
        self.deadline = self.start + timeout if timeout else None
        self.progress = progress

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def plan(self, make: Callable[[], T]) -> T:
        said = None
        while True:
            try:
                return make()
            except PlacementError as e:
                if not e.held:
                    raise
                waited = duration(int(time.monotonic() - self.start))
                if self.expired():
                    raise ProvisionError(
                        f"--queue: gave up after {waited}: {e.message}", details=list(e.details), exit_code=EXIT_TIMEOUT
                    ) from None
                now = (e.message, tuple(e.details))
                if now != said:
                    self.progress(f"queued ({waited} so far): {e.message}")
                    for line in e.details:
                        self.progress(f"  waiting for {line}")
                    said = now
                time.sleep(POLL if self.deadline is None else max(0.0, min(POLL, self.deadline - time.monotonic())))
