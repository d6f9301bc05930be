"""`provision serve`: one long-running process that does for the team what a terminal does
for one person. It leads or follows (io/servicelead.py: the database decides), and the
leader drives every unfinished submission: each in a worker process of its own
(serve/worker.py), started again when a previous leader died with it (kill -9, a reboot):
its study re-opens and adopts the trials left running, its queued apply waits and applies
again (apply is idempotent).

The database going away (a restart, a network cut) is said once when it stops answering and
once when it answers again; the service looks again every poll meanwhile and never dies of
it. A leader whose lock's session ended stops its workers (their trials run on) and takes
the lead again, or follows whoever took it. It asks again right before it takes or ends a
submission (_leading): one frozen past a take-over (SIGSTOP, a suspended VM) wakes to nothing.

Nothing is kept in memory that the database does not have: a submission's status and claim
(which service drives it) are rows; a restart reads them and goes on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import IO

from provision.core.errors import ProvisionError
from provision.core.submission import Kind, Status
from provision.core.text import duration
from provision.io.servicelead import POLL, Leadership
from provision.io.servicestore import ALIVE_AFTER, ServiceRow, ServiceStore, Submission
from provision.rules.admission import Queued, admit
from provision.rules.watch import Watched, to_look_at
from provision.serve.ends import LEFT, SERVICE_ENV, record_end
from provision.serve.rounds import Rounds
from provision.serve.snapshot import prepare

PR_SET_PDEATHSIG = 1
LEAVE_GRACE = 15.0  # seconds a worker has to leave when the service stops


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """The worker dies with the service (Linux): the next leader starts another, never two.
    A cancel's SIGUSR1 is ignored until the worker's handler is in place (its imports take a
    second or more; the default action would kill it): one sent before is for a cancel
    already in the database, which the worker reads after setting its handler."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the worker's own check of its parent ends it
        pass


@dataclass
class _Worker:
    sub: Submission
    proc: subprocess.Popen[bytes]
    log: Path
    cancelling: bool = False


def _waits(sub: Submission) -> bool:
    """A queued apply: it costs a row, not a process, until the rounds admit it (a new one
    too: its first worker waits at most ROOM_WAIT s, then it is QUEUED)."""
    return sub.kind is Kind.APPLY and sub.status in (Status.WAITING, Status.QUEUED)


class Mode(StrEnum):
    """What the service is doing: one value, its changes in `next_mode` (and said there)."""

    FOLLOWING = "following"  # another leads (or nobody yet): it tries to take the lead every poll
    LEADING = "leading"  # it holds the lead: it drives every unfinished submission
    CUT_OFF = "cut off"  # the database does not answer: it drives nothing, looks again every poll
    LEAVING = "leaving"  # asked to stop: its workers leave, the lead goes


def next_mode(mode: Mode, *, answered: bool, holds: bool, took: bool, stopping: bool) -> Mode:
    """The mode after one look: `answered` the database answered, `holds` the lead is still
    this service's (asked first, even while cut off), `took` it took the lead in this look."""
    if stopping:
        return Mode.LEAVING
    if not answered:
        return Mode.CUT_OFF
    return Mode.LEADING if holds or took else Mode.FOLLOWING


@dataclass
class Service:
    store: ServiceStore
    lead: Leadership
    work_root: Path
    say: Callable[[str], None]
    url: str = "local"  # the store's place as the worker opens it
    public_url: str | None = None  # --public-url: where people reach the dashboard (for links to it)
    poll: float = POLL
    stopping: threading.Event = field(default_factory=threading.Event)
    workers: dict[str, _Worker] = field(default_factory=dict)
    # A team's service also says in this machine's embedded file that it runs (a `--detach`
    # of a local state here names it: "the work goes to ...").
    mirror: ServiceStore | None = None
    # The rounds (serve/rounds.py): which watched jobs to look at again, which queued applies
    # may fit; None: no rounds (tests of the loop alone): nothing watched is looked at again.
    rounds: Rounds | None = None
    mode: Mode = Mode.FOLLOWING
    # Set while it leads (the mode's): the rounds' thread samples only then.
    leading: threading.Event = field(default_factory=threading.Event)
    away_since: float | None = None  # (monotonic) since when the database does not answer
    followed: str = ""  # the leader this follower last named (said once per leader)
    holds: bool = False  # the lead's lock is this service's (as last asked)
    lost: bool = False  # the lead was lost and that is not said yet
    since: dict[str, float] = field(default_factory=dict)  # submission -> watched since (time.time())
    looked: dict[str, float] = field(default_factory=dict)  # submission -> a round last sent a worker to look
    admitted: dict[str, float] = field(default_factory=dict)  # queued submission -> last admitted
    prepared: set[str] = field(default_factory=set)  # submissions whose snapshot is in the work directory
    set_aside: set[str] = field(default_factory=set)  # rows this version cannot read, said once
    # A worker started ahead, its imports done (a second of CPU: Optuna, the run layer), waiting
    # on its stdin for a submission: handed work starts at once. Kept only while leading.
    spare: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        host = socket.gethostname()
        self.id = f"{host}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.row = ServiceRow(self.id, host, os.getpid(), self.store.place, tuple(sorted(os.environ)), False, 0.0)

    @property
    def leads(self) -> bool:
        return self.mode is Mode.LEADING

    def run(self) -> None:
        """Until `stopping` is set (SIGTERM, Ctrl-C): follow, lead, drive."""
        self.work_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.store.beat(self.row)
        self.say(f"service {self.id} on {self.store.place}: following until it can lead")
        try:
            while not self.stopping.is_set():
                why = ""
                try:
                    self._tick()
                except ProvisionError as e:  # the database is away: said once, looked at again
                    why = e.message
                if why:
                    self._lead_kept()  # a leader cut off says at once whether it lost the lead too
                    self._become(Mode.CUT_OFF, why)
                self.stopping.wait(self.poll)
        finally:
            self._become(Mode.LEAVING)
            self._leave()

    def _become(self, mode: Mode, why: str = "") -> None:
        """The one place the mode changes, and what each change says. Cut off, a leader
        keeps its workers while it holds the lead (the lock is looked at every poll)."""
        was = self.mode
        if mode is was:
            return
        self.mode = mode
        if mode is not Mode.LEADING:
            self.leading.clear()
        if mode in (Mode.FOLLOWING, Mode.LEAVING):
            self._stop_workers()  # their trials run on: the next leader adopts them
        if mode is Mode.CUT_OFF:
            self.away_since = time.monotonic()
            more = "; the lead was lost: its workers left, their trials run on" if self.lost else ""
            self.lost = False
            self.say(f"the database does not answer ({why}){more}; looking again every {self.poll:g} s")
            return
        if was is Mode.CUT_OFF and self.away_since is not None:
            self.say(f"the database answers again after {time.monotonic() - self.away_since:.0f} s: going on")
            self.away_since = None
        if self.lost:
            self.lost = False
            self.say("the lead was lost (the database ended its session): its workers left, their trials run on")
        if mode is Mode.LEADING:
            self.leading.set()
            self.followed = ""
            self.say("leading: driving every unfinished submission")
            self._warm()  # a spare worker from the moment it leads

    def _tick(self) -> None:
        # The lead first, even while the database is away: a leader cut off from it (the
        # others still reach it) stops its workers before the server frees the lead.
        self._lead_kept()
        if self.mode is Mode.CUT_OFF:
            # Raises while it is still away. A write, not a read: a database on a full disk
            # answers reads, and said "answers again" and "does not answer" twice a second.
            self.store.beat(self.row)
        took = not self.holds and self._take()
        self.holds = self.holds or took
        self._become(next_mode(self.mode, answered=True, holds=self.holds, took=took, stopping=self.stopping.is_set()))
        self.row = dataclasses.replace(self.row, leader=self.leads)
        self.store.beat(self.row)
        if self.mirror is not None:
            self.mirror.beat(self.row)
        if self.leads:
            self.store.lead_is(self.id, self.lead.backend())
            self._drive()
        else:
            self._say_whom()

    def _lead_kept(self) -> None:
        """Whether the lead is still this service's; a lost one's workers stop at once."""
        if self.holds and not self.lead.still_held():
            self.holds, self.lost = False, True
            self._stop_workers()

    def _take(self) -> bool:
        """Take the lead when it is free; a leader that stopped beating (frozen: SIGSTOP, a
        suspended VM, whose kernel still answers for its session) is made to let go first."""
        if self.lead.try_take():
            return True
        frozen = self.store.frozen_leader(self.id)
        if frozen is not None:
            self.say(f"the leader {frozen} has not beaten for {ALIVE_AFTER:g} s: ending its session to take over")
            self.store.end_lead(frozen)
            return self.lead.try_take()
        return False

    def _say_whom(self) -> None:
        """A follower names the leader it follows (once per leader): a second service
        started by mistake says it does nothing while that one runs."""
        lead = next((s for s in self.store.services() if s.leader and s.id != self.id), None)
        if lead is not None and lead.id != self.followed:
            self.followed = lead.id
            self.say(
                f"following the service on {lead.host} (pid {lead.pid}, {lead.id}), which leads: doing nothing meanwhile"
            )

    def _drive(self) -> None:
        subs, bad = self.store.unfinished()
        self._set_aside(bad)
        self._prepare(subs)
        look, gone = self._watch(subs)
        admitted = set(self._admit(subs))
        for sub in subs:
            w = self.workers.get(sub.id)
            if w is not None:
                if sub.cancel and not w.cancelling:
                    w.cancelling = True
                    self.say(f"{sub.id}: cancel asked by {sub.cancel}")
                    w.proc.send_signal(signal.SIGUSR1)
            elif sub.status is Status.WATCHING and not sub.cancel:
                if sub.id in gone:
                    self._gone(sub)
                elif sub.id in look:
                    self.looked[sub.id] = time.time()
                    self._start(sub)  # its hosts say it ended (or changed): a worker looks once
            elif _waits(sub):
                if sub.id in admitted:
                    self.admitted[sub.id] = time.time()
                    self._start(sub)  # a round says it may fit now
            else:
                self._start(sub)  # new, or a dead leader's (or ours, before we lost the lead)
        self._reap()
        if self.spare is not None and self.spare.poll() is not None:
            self._warm()  # it died (killed by hand, out of memory): another

    def _prepare(self, subs: list[Submission]) -> None:
        """Each new submission's snapshot in its work directory, once: the rounds read its
        inventory (what it needs: rules/admission) before any worker is started for it."""
        for sub in subs:
            if sub.id in self.prepared:
                continue
            try:
                prepare(self.store, sub, self.work_root / sub.id)
            except (ProvisionError, OSError) as e:
                why = e.message if isinstance(e, ProvisionError) else str(e)
                if self._leading() and self.store.finish(sub.id, Status.FAILED, f"its snapshot: {why}"):
                    self.say(f"{sub.id}: failed: its snapshot: {why}")
            self.prepared.add(sub.id)

    def _set_aside(self, bad: list[tuple[str, str]]) -> None:
        """Rows this version cannot read (a kind it does not know, an id that is no id):
        failed with why, once, never run; the service goes on with the others."""
        for sid, why in bad:
            if sid in self.set_aside:
                continue
            self.set_aside.add(sid)
            if self._leading():
                self.store.set_aside(sid, why)
            self.say(f"submission {sid[:80]!r} set aside: {why}")

    def _admit(self, subs: list[Submission]) -> list[str]:
        """The queued applies a worker looks at now (rules/admission.py)."""
        now = self.store.now() if any(_waits(s) and s.options.timeout is not None for s in subs) else 0.0
        queued = [
            Queued(s.id, s.job, s.options.priority, s.created, self.admitted.get(s.id, 0.0))
            for s in subs
            if _waits(s) and s.id not in self.workers and not s.cancel and not self._gave_up(s, now)
        ]
        if not queued:
            return []
        running = sum(1 for w in self.workers.values() if _waits(w.sub))
        return admit(queued, self.rounds.latest if self.rounds is not None else None, time.time(), running)

    def _gave_up(self, sub: Submission, now: float) -> bool:
        """A queued apply past its --timeout with no worker to say so: it fails here, in the
        words its worker's queue would have used (`now`: the database's clock)."""
        timeout = sub.options.timeout
        if timeout is None:
            return False
        waited = now - sub.created
        if waited < timeout:
            return False
        if self._leading():
            wait = self.store.open_event(sub.id, "wait")
            if wait is not None:
                self.store.closed(wait, now, "gave up")
            record_end(self.store, sub, Status.FAILED, f"--queue: gave up after {duration(int(waited))}: no room came")
            self.say(f"{sub.id}: failed (gave up after {timeout:g} s in the queue)")
        return True

    def _reap(self) -> None:
        """Workers that ended: their submission finished, left (started again), or failed."""
        for sid, w in list(self.workers.items()):
            code = w.proc.poll()
            if code is None:
                continue
            del self.workers[sid]
            got = self.store.get(sid)
            if code == LEFT:
                self.say(f"{sid}: its worker left; started again")
                continue
            live = got is not None and got.status is Status.RUNNING
            if live and self._leading():
                self.store.finish(sid, Status.FAILED, f"its worker ended with exit code {code} (its log: {w.log})")
            self.say(f"{sid}: {(got.status.value if got else '?')} ({w.log})")

    def _watch(self, subs: list[Submission]) -> tuple[set[str], set[str]]:
        """Applied jobs are watched from the rounds (rules/watch.py), not by workers."""
        r = self.rounds.latest if self.rounds is not None else None
        now = time.time()
        watched = [
            Watched(s.id, s.job, r.jobs.get(s.job, frozenset()) if r is not None else frozenset(),
                    self.since.setdefault(s.id, now), self.looked.get(s.id, 0.0))
            for s in subs
            if s.status is Status.WATCHING and s.id not in self.workers and not s.cancel
        ]  # fmt: skip
        if r is None or not watched:
            return set(), set()
        if any(w.since > r.began for w in watched) and self.rounds is not None:
            self.rounds.soon()  # newly watched: the next round comes soon
        return to_look_at(r.doc, r.began, watched)

    def _gone(self, sub: Submission) -> None:
        """Destroyed by its owner (no host has it): its run ends in the history."""
        if not self._leading():
            return
        row = self.store.open_event(sub.id, "run")
        if row is not None:
            self.store.closed(row, self.store.now(), "gone from its hosts (destroyed)")
        record_end(self.store, sub, Status.DONE, "applied; the job was destroyed")
        self.say(f"{sub.id}: done (the job {sub.job} is gone from its hosts)")

    def _leading(self) -> bool:
        """The lead asked again right before an act that needs it (taking a submission, ending
        one): a leader frozen since its loop's look (SIGSTOP, a suspended VM) may wake here after
        a follower took over. Its lock's session is gone then (the follower could not lead
        otherwise), so the look fails: at once, or within CUT_OFF s while still cut off."""
        return self.lead.still_held()

    def _start(self, sub: Submission) -> None:
        if not self._leading() or not self.store.claim(sub.id, self.id):
            return
        workdir = self.work_root / sub.id
        workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        log = workdir.parent / f"{sub.id}.log"
        env = {"PROVISION_OWNER": sub.owner, "PROVISION_STATE": sub.backend, SERVICE_ENV: self.id}
        proc = self._hand(sub, workdir, log, env)
        if proc is None:  # no spare ready: a worker of its own, its imports paid now
            with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
                proc = self._spawn(["--id", sub.id, "--workdir", str(workdir)], out, subprocess.DEVNULL, env)
        self.workers[sub.id] = _Worker(sub, proc, log)
        self.say(f"{sub.id}: {sub.kind.value} of job {sub.job} for {sub.owner} (pid {proc.pid})")
        self._warm()  # the next one, ahead (the lead was just asked: this service leads)

    def _warm(self) -> None:
        """A spare worker, started ahead while this service leads (after taking the lead, and
        after each start): never by a service that may have lost it."""
        if self.spare is None or self.spare.poll() is not None:
            self.spare = self._spawn(["--warm"], subprocess.DEVNULL, subprocess.PIPE)

    def _hand(self, sub: Submission, workdir: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The spare worker takes the submission (one line on its stdin), or None."""
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        line = json.dumps({"id": sub.id, "workdir": str(workdir), "log": str(log), "env": env}) + "\n"
        try:
            spare.stdin.write(line.encode())
            spare.stdin.close()
        except OSError:  # it died meanwhile
            spare.kill()
            spare.wait()
            return None
        return spare

    def _spawn(
        self, extra: list[str], out: int | IO[bytes], stdin: int, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "provision.serve.worker", "--place", self.url]
        if self.store.path is not None:
            args += ["--db", str(self.store.path)]
        return subprocess.Popen(  # noqa: S603 - our own interpreter and module
            args + extra,
            stdin=stdin,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, **(env or {})),
            start_new_session=True,  # a Ctrl-C on the service's terminal reaches the service alone
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - prctl must run in the child
        )

    def _stop_workers(self) -> None:
        if self.spare is not None:  # it holds no work: no grace
            self.spare.kill()
            self.spare.wait()
            self.spare = None
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)  # leave: trials run on, the next leader adopts them
        for w in self.workers.values():
            try:
                w.proc.wait(LEAVE_GRACE)
            except subprocess.TimeoutExpired:
                w.proc.kill()
        self.workers.clear()

    def _leave(self) -> None:
        self._stop_workers()
        self.lead.release()
        try:
            self.store.leave(self.id)
            if self.mirror is not None:
                self.mirror.leave(self.id)
        except Exception as e:  # the database is gone: its row ages out
            self.say(f"could not remove this service's row: {e}")
