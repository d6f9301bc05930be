"""The service's checkpoint copies: a subscriber of the rounds (serve/rounds.py) that keeps
each watched job's newest complete checkpoint off the host that saves it
(rules/checkpoints.py decides, run/checkpoints.py copies), in the background: a thread per
job, one copy at a time, at the job's bandwidth and the lowest priority on the host; the
round goes on meanwhile. It looks when the round saw the checkpoint directory change (its
time, with `progress:`) or a minute went by, and only at a saving host that answered the
round.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from provision.core.errors import ProvisionError
from provision.core.target import HostError
from provision.io.servicestore import ServiceStore
from provision.rules.checkpoints import COPIED, CopyRecord, look_now, saving_task
from provision.rules.rounds import JobWatch, Round
from provision.run.checkpoints import copy_dir, copy_job, read_record
from provision.run.context import open_context


class CheckpointKeeper:
    """The rounds' subscriber (module docstring)."""

    name = "checkpoint copies"

    def __init__(self, store: ServiceStore, say: Callable[[str], None]):
        self.store, self.say = store, say
        self.records: dict[str, CopyRecord] = {}
        self.busy: dict[str, threading.Thread] = {}

    def on_round(self, r: Round) -> None:
        for job, w in r.watch.items():
            if w.checkpoint is None or w.checkpoint.copy not in COPIED:  # a peer's copy goes through here too
                continue
            t = self.busy.get(job)
            if t is not None and t.is_alive():
                continue
            task = saving_task(w.tasks)
            if task is None or w.tasks[task] not in r.answered or w.record.open is not None:
                continue  # its host lost (the copy is what is left of it), or a recovery under way
            rec = self.records.get(job) or read_record(copy_dir(w.file, job))
            if not look_now(rec, w.seen.checkpoint, time.time()):
                continue
            t = threading.Thread(target=self._copy, args=(job, w), name=f"checkpoint:{job}", daemon=True)
            self.busy[job] = t
            t.start()

    def wait(self, timeout: float = 600.0) -> None:
        """Until the copies under way have ended (tests)."""
        until = time.monotonic() + timeout
        for t in list(self.busy.values()):
            t.join(max(0.0, until - time.monotonic()))

    def _copy(self, job: str, w: JobWatch) -> None:
        now = time.time()
        try:
            subs = self.store.submissions(unfinished=True, job=job)
            sub = subs[0] if subs else None
            state = (sub.state_path or None) if sub else None
            ctx = open_context(w.file, state_path=state, render_secrets=False, files_here=False)
            try:
                rec = copy_job(ctx, dict(w.tasks), lambda s: self.say(f"job {job}: {s}"), now)
            finally:
                ctx.close()
            if rec is not None:
                self.records[job] = rec
        except (ProvisionError, HostError) as e:  # said; the next look tries again
            self.say(f"job {job}: checkpoint copy: {e.message}")
            self.records[job] = dataclasses.replace(read_record(copy_dir(w.file, job)), looked_at=now)
        except Exception as e:  # a bug must not end the service
            self.say(f"job {job}: checkpoint copy failed: {type(e).__name__}: {e}")
