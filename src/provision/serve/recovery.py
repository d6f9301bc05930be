"""The service's recoveries: a subscriber of the rounds (serve/rounds.py) that watches each
job with `progress:` or `recovery:` (rules/rounds.JobWatch), remembers its progress between
rounds (rules/recovery.Memory: `auto` learns its bound there), and when a round shows
evidence that the job broke (rules/recovery.troubled: a task ended, its progress stopped, a
set-aside host runs it again, a recovery under way) reads the job's state and decides
(rules/recovery.decide), then acts through run/recover.py on a thread of its own, one per
job: a recovery takes its tasks' grace and an apply, and the round goes on meanwhile.

It acts in the job's name: a handed-over job's as its submitter (its state and owner), a
job of `serve --inventory` as the service. Each recovery is `job.recovered` once (its key:
the job and the incident's number). A service killed in the middle leaves the stage in
the job's state and the stop's marker on its hosts: the next leader's first round finds
them and finishes it (a recovery under way is always finished first).

Two of what the rounds learn are kept in the job's state, for a one-off look (`status`,
the owner's apply) to judge as the service does: a recovered job's first sign of progress
in its new run (its incident's `progressing`: the start-up is lost time too), once; and an
`auto` progress bound learnt, when it moved by a fifth.

An elastic job's lost workers (rules/recovery.scale_up) are placed again and started alone
(run/recover.grow), the job's running tasks left as they are: `job.scaled` once (its key:
the job, its run and the hosts lost).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from provision.core.errors import ProvisionError
from provision.core.events import Event, Kind
from provision.core.recovery import Incident, RecoveryRecord, Stage
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore
from provision.rules.progress import bound_moved, learnt_bound
from provision.rules.recovery import Do, Facts, Memory, decide, facts_of_round, remember, troubled
from provision.rules.rounds import JobWatch, Round
from provision.run.context import Context, open_context
from provision.run.jobend import leave_hosts
from provision.run.recover import close, give_up, grow, recover, stacks
from provision.run.survey import KeptContexts

Change = Callable[[RecoveryRecord], RecoveryRecord | None]  # a job's record -> what to keep (None: nothing)


def recovered_key(job: str, n: int) -> str:
    return f"recovered:{job}:{n}"


@dataclass(frozen=True)
class Starting:
    """A job running again since `running` after incident `n`, its first sign of progress
    not seen yet."""

    n: int
    running: float


class Recoverer:
    """The rounds' subscriber (module docstring)."""

    name = "recoveries"

    def __init__(
        self,
        store: ServiceStore,
        say: Callable[[str], None],
        contexts: KeptContexts | None = None,
        wake: Callable[[], None] = lambda: None,
    ):
        self.store, self.say, self.contexts, self.wake = store, say, contexts, wake
        self.memory: dict[str, Memory] = {}
        self.busy: dict[str, threading.Thread] = {}
        self.reported: set[tuple[str, float]] = set()  # hangs said (no recovery:): once each
        self.done: list[Incident] = []  # what it recovered (tests, the bench)
        self.scaled: list[dict[str, str]] = []  # the workers it placed again (task -> host)
        # job -> when its last look closer ended: a round that began before it read some
        # hosts before the recovery and some after (its old placement's failed task beside
        # the new run), evidence of a failure already recovered
        self.acted: dict[str, float] = {}
        self.starting: dict[str, Starting] = {}
        self.bounds: dict[str, float | None] = {}  # job -> the learnt bound last kept

    def on_round(self, r: Round) -> None:
        for job, w in r.watch.items():
            m = self.memory[job] = remember(self.memory.get(job, Memory()), w, r)
            f = facts_of_round(job, w, r, m)
            marked = any(
                (hs.marker_of(job) or {}).get("recovery") for h, hs in r.hosts.items() if h in set(w.tasks.values())
            )
            t = self.busy.get(job)
            if (
                (t is not None and t.is_alive())
                or not troubled(f, marked, w.tasks, r.began)
                or r.began < self.acted.get(job, 0.0)
            ):
                continue
            if f.stall is not None and w.recovery is None:
                if (job, f.stall.since) in self.reported:
                    continue
                self.reported.add((job, f.stall.since))
            t = threading.Thread(target=self._act, args=(job, w, f), name=f"recover:{job}", daemon=True)
            self.busy[job] = t
            t.start()
        self._learnt(r)
        for gone in set(self.memory) - set(r.watch):
            del self.memory[gone]
            self.bounds.pop(gone, None)

    def _learnt(self, r: Round) -> None:
        """What this round learnt that the jobs' states keep (module docstring), each
        written on a thread of its own."""
        for job, st in list(self.starting.items()):
            latest = self.memory[job].latest if job in self.memory else None
            if job not in r.watch:
                del self.starting[job]
            elif latest is not None and latest > st.running:
                del self.starting[job]
                self._keep(job, r.watch[job].file, _progressing(st, latest), f"its progress after incident {st.n}")
        for job, w in r.watch.items():
            b = learnt_bound(w.progress, self.memory[job].intervals) if job in self.memory else None
            if bound_moved(self.bounds.get(job, w.record.learnt), b):
                self.bounds[job] = b
                self._keep(job, w.file, _bound(b), "its progress bound")

    def _keep(self, job: str, file: str, change: Change, what: str) -> None:
        threading.Thread(target=self._keep_now, args=(job, file, change, what), name=f"keep:{job}", daemon=True).start()

    def _keep_now(self, job: str, file: str, change: Change, what: str) -> None:
        try:
            ctx = self._open(job, file)
            try:
                new = change(ctx.state.recovery)
                if new is not None and new != ctx.state.recovery:
                    ctx.state.set_recovery(new)
            finally:
                ctx.close()
        except ProvisionError as e:  # the figure is missing, nothing else
            self.say(f"job {job}: {what} not kept: {e.message}")
        except Exception as e:  # a bug must not end the service
            self.say(f"job {job}: {what} not kept: {type(e).__name__}: {e}")

    def _open(self, job: str, file: str) -> Context:
        """The job's Context as its submitter (a handed-over job's state and owner)."""
        subs = self.store.submissions(unfinished=True, job=job)
        sub = subs[0] if subs else None
        return open_context(
            file, state_path=(sub.state_path or None) if sub else None, operation="recover",
            who=sub.owner if sub else "", files_here=True,
        )  # fmt: skip

    def hurry(self) -> bool:
        """Rounds every SAMPLE_EVERY (10 s: core/recovery.ROUND_S) while a job is watched,
        not QUIET_EVERY: a host lost or a hang is seen within a round."""
        return bool(self.memory)

    def wait(self, timeout: float = 600.0) -> None:
        """Until the recoveries under way have ended (tests)."""
        until = time.monotonic() + timeout
        for t in list(self.busy.values()):
            t.join(max(0.0, until - time.monotonic()))

    def _act(self, job: str, w: JobWatch, f: Facts) -> None:
        try:
            self._act_now(job, w, f)
        except ProvisionError as e:  # said; the next round that shows it broke looks again
            self.say(f"job {job}: recovery: {e.message}")
        except Exception as e:  # a bug must not end the service
            self.say(f"job {job}: recovery failed: {type(e).__name__}: {e}")
        finally:
            self.acted[job] = time.time()

    def _act_now(self, job: str, w: JobWatch, f: Facts) -> None:
        ctx = self._open(job, w.file)
        try:
            v = decide(ctx.inventory.recovery, ctx.state.recovery, f, time.time(), w.tasks)
            if v.do is Do.STOP_THERE:
                self.say(f"job {job}: {v.words}: stopping it there")
                leave_hosts(ctx, set(v.hosts) & set(ctx.state.hosts))
            elif v.do is Do.SCALE_UP:
                self._scaled(job, v.words, v.hosts, f.run, grow(ctx, v, f.run, self.say), ctx.owner.who)
            elif v.do is Do.REPORT and v.incident is not None:
                self.say(f"job {job}: {v.words} (no recovery: set, its stacks are in its logs)")
                stacks(ctx, v.incident, self.say)
            elif v.do is Do.GIVE_UP:
                give_up(ctx, v, self.say)
            elif v.do is Do.CLOSE:
                self._told(job, close(ctx, v, None, f.run), ctx.owner.who)
            elif v.do in (Do.RECOVER, Do.FINISH):
                inc = recover(ctx, v, self.say, set(f.away))
                if inc.stage is Stage.DONE:
                    self._told(job, inc, ctx.owner.who)
                    if inc.running is not None:
                        self.starting[job] = Starting(inc.n, inc.running)
        finally:
            ctx.close()
            if self.contexts is not None:
                self.contexts.forget(w.file)  # its placement and the hosts set aside changed

    def _scaled(
        self, job: str, words: str, lost: tuple[str, ...], run: int | None, moved: dict[str, str], owner: str
    ) -> None:
        """job.scaled, once per hosts lost in a run (its key)."""
        onto = ", ".join(f"{t} on {h}" for t, h in sorted(moved.items()))
        said = f"job {job} scaled up: {words}; started {onto} (the running tasks go on)"
        key = f"scaled:{job}:{run}:{','.join(lost)}"
        hosts = tuple(sorted(set(moved.values())))
        self.store.emit(
            [Event(Kind.JOB_SCALED, key, job, owner, hosts[0] if hosts else "", said, run=run, hosts=hosts)]
        )
        self.scaled.append(moved)
        self.wake()
        self.say(said)

    def _told(self, job: str, inc: Incident, owner: str) -> None:
        """job.recovered, once per incident (its key); the incident a row of the history
        (from when it broke to running again, how long each stage took); and kept for
        whoever asks."""
        self.done.append(inc)
        lost = inc.lost(time.time()).words()
        words = f"job {job} recovered: {inc.words}; {lost}"
        event = Event(Kind.JOB_RECOVERED, recovered_key(job, inc.n), job, owner, inc.host, words, run=inc.new_run)
        self.store.emit([event])
        mark = recovered_key(job, inc.n)
        if inc.at is not None and not self.store.has_rows(mark):
            how = f"recovered: {inc.words}; {lost}"
            self.store.record(
                HistoryRow("incident", job, owner, inc.at, inc.running or time.time(), how, (inc.host,), 0, mark)
            )
        self.wake()
        self.say(words)


def _progressing(st: Starting, at: float) -> Change:
    """The record with incident `st.n`'s first sign of progress, once."""

    def change(rec: RecoveryRecord) -> RecoveryRecord | None:
        inc = next((i for i in rec.incidents if i.n == st.n), None)
        if inc is None or inc.progressing is not None:
            return None
        return rec.with_incident(dataclasses.replace(inc, progressing=at))

    return change


def _bound(b: float | None) -> Change:
    """The record with the `auto` bound learnt."""
    return lambda rec: dataclasses.replace(rec, learnt=b)
