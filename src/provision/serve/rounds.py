"""The service's rounds: every host it watches asked once (run/survey.py) every 10-60 s while
it leads, each round published as one frozen value (rules/rounds.Round) to its subscribers,
in order, on the sampler's thread:

- the GPU samples (GpuRecorder: stored an hour, each GPU's last hour kept for the pages);
- the event stream (EventMaker: rules/events.diff of this round and what the rounds before
  saw, stored with it in one transaction);
- and then `latest`, which the service's loop (which watched jobs to look at again) and the
  dashboard's source read. Nobody else asks the hosts for what a round says.

A subscriber that fails (the database away) says so once, and once when it works again;
the others and the next round go on.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from provision.core.errors import ProvisionError
from provision.io.servicehistory import GPU_KEEP, GpuSample
from provision.io.servicestore import ServiceStore
from provision.rules.events import Seen, diff
from provision.rules.health import holders_of
from provision.rules.jobsdoc import GpuHistoryJson
from provision.rules.rounds import Round
from provision.rules.watch import QUIET
from provision.run.survey import Contexts, Found, KeptContexts, survey
from provision.serve.gpusample import SAMPLE_EVERY, GpuHistory, give_back_memory, history_step, round_every, samples_of

SEEN = "rounds"  # the name the rounds' Seen is kept under


class Subscriber(Protocol):
    name: str

    def on_round(self, r: Round) -> None: ...


class GpuRecorder:
    """Each round's GPU samples stored, and each GPU's last hour kept for the pages (`doc`,
    made again by each round; a page waits for none)."""

    name = "GPU samples"

    def __init__(self, store: ServiceStore):
        self.store = store
        self._kept: GpuHistory | None = None
        self.doc: dict[str, GpuHistoryJson] | None = None  # host -> {"<gpu>": [[t, %], ...]}; None before a round
        self.at = -math.inf  # (monotonic) when `doc` was made

    def on_round(self, r: Round) -> None:
        started = time.monotonic()
        t = self.store.now()
        got = samples_of(r.doc, t)
        self.store.add_gpu_samples(got)
        gpus = gpus_of(r.doc)
        since = t - GPU_KEEP
        kept = self._kept
        if kept is None or history_step(kept.rounds_after(since), gpus) != kept.step:
            kept = self._kept = self.read(since, gpus)
        else:
            kept.add(got, since)
        self.doc, self.at = kept.doc, started

    def read(self, since: float, gpus: int) -> GpuHistory:
        """Each GPU's last hour from the database (a follower's pages, a quiet minute)."""
        rounds = self.store.gpu_round_times(since)
        step = history_step(len(rounds), gpus)
        return GpuHistory(step, self.store.gpu_history(since, step), rounds)


class EventMaker:
    """The events of each round, stored with what the rounds have seen (one transaction: a
    service killed between two rounds, or a new leader, goes on from there)."""

    name = "events"

    def __init__(self, store: ServiceStore, wake: Callable[[], None] = lambda: None):
        self.store = store
        self.wake = wake  # new events: the subscribers deliver now (serve/stream.py)
        self._seen: Seen | None = None  # as stored last (read at the first round)
        self.made = 0

    def on_round(self, r: Round) -> None:
        prev = self._seen if self._seen is not None else Seen.from_json(self.store.seen(SEEN))
        events, seen = diff(prev, r)
        if events or seen != prev:
            new = self.store.emit(events, (SEEN, seen.to_json()))
            self.made += len(new)
            if new:
                self.wake()
        self._seen = seen

    def forget(self) -> None:
        """Read what was seen from the store again (the lead changed hands: another wrote it)."""
        self._seen = None


def gpus_of(doc: Any) -> int:
    return sum(int(h.get("gpus") or 0) for h in (doc.get("hosts") or {}).values())


class Rounds:
    """The sampler: a round every `every()` seconds while `leading()`, published to the
    subscribers and then as `latest`. The period is asked again every second: a page opened
    during a quiet minute gets its rounds at once."""

    def __init__(
        self,
        found: Callable[[], Found],
        contexts: KeptContexts,
        subscribers: Sequence[Subscriber],
        leading: threading.Event,
        say: Callable[[str], None],
        look: Callable[[Found, Contexts, int], Round] = survey,
    ):
        self.found, self.contexts, self.subscribers = found, contexts, list(subscribers)
        self.survey = look  # run/survey.survey (tests give a stand-in)
        self.leading, self.say = leading, say
        self.latest: Round | None = None
        self.number = 0
        self.looked = -math.inf  # (monotonic) when a page last read the samples
        self.wanted = False  # something new is watched that no round has seen yet
        self.held = False  # the last round saw a job holding a GPU
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="rounds", daemon=True)
        self._failing: dict[str, bool] = {}

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)
        self.contexts.close()

    def look(self) -> None:
        """A page read the rounds: they come every SAMPLE_EVERY s for a while."""
        self.looked = time.monotonic()

    def soon(self) -> None:
        """Something new is watched: the next round comes at SAMPLE_EVERY."""
        self.wanted = True

    def every(self) -> float:
        r = self.latest
        changing = r is not None and any(j.get("state") not in QUIET for j in r.doc.get("jobs") or [])
        due = any(
            getattr(s, "hurry", lambda: False)() for s in self.subscribers
        )  # an act due soon (a dev session's end)
        return round_every(time.monotonic() - self.looked, changing or self.wanted or due, self.held)

    def run(self) -> None:
        last = -math.inf
        was_leading = False
        while not self.stopping.is_set():
            if not self.leading.is_set():  # a follower: look again soon (it may lead in a moment)
                last, was_leading = -math.inf, False
                self.stopping.wait(1.0)
                continue
            if not was_leading:  # another service may have written since: read it again
                for s in self.subscribers:
                    getattr(s, "forget", lambda: None)()
                was_leading = True
            due = last + self.every() - time.monotonic()
            if due > 0:
                self.stopping.wait(min(1.0, due))
                continue
            last = time.monotonic()
            self.round()

    def round(self) -> Round | None:
        """One round, published; None when the hosts could not be asked (said once)."""
        self.number += 1
        try:
            r = self.survey(self.found(), self.contexts, self.number)
        except Exception as e:  # an inventory unreadable: said once, asked again next round
            self._said("the hosts", e)
            return None
        self._ok("the hosts")
        self.wanted = False
        self.held = any(holders_of(h.view) for h in r.hosts.values())
        for s in self.subscribers:
            try:
                s.on_round(r)
            except Exception as e:  # the database away: said once, the others go on
                self._said(s.name, e)
            else:
                self._ok(s.name)
        self.latest = r
        give_back_memory()
        return r

    def _said(self, what: str, e: Exception) -> None:
        if not self._failing.get(what):
            why = e.message if isinstance(e, ProvisionError) else f"{type(e).__name__}: {e}"
            self.say(f"{what}: not stored this round: {why}")
        self._failing[what] = True

    def _ok(self, what: str) -> None:
        if self._failing.get(what):
            self.say(f"{what}: stored again")
        self._failing[what] = False


def fresh(r: Round | None, within: float = 2 * SAMPLE_EVERY + 5.0) -> Round | None:
    """`r` when it began less than `within` seconds ago (this machine's clock)."""
    return r if r is not None and time.time() - r.began < within else None


def samples(r: Round, t: float) -> list[GpuSample]:
    return samples_of(r.doc, t)
