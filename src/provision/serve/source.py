"""The dashboard the service serves (`provision serve --listen`): its Source, and which Auth
an address gets (docs/dashboard.md).

ServiceSource composes what the service has: the inventories it knows (each unfinished
submission's materialised snapshot, plus the `--inventory` files: jobs run from terminals)
read through an InventorySource (a job's status, its logs, a study, the actions, as the
CLI's --json gives them); the hosts from the latest round (serve/rounds.py) with each GPU's
last hour (its GpuRecorder); usage() from the service's history, cancel() through the store
as `provision cancel` does, and the events. It decides nothing.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from provision.core.answers import ActionAnswer, LogLine, LogsDoc
from provision.core.errors import ProvisionError
from provision.core.events import EVENTS_FORMAT, EventsDoc, Kind
from provision.core.model import Inventory
from provision.core.submission import Status
from provision.inventory.inventory import load
from provision.io.servicehistory import GPU_KEEP, HistoryRow
from provision.io.servicestore import ServiceStore, Submission
from provision.rules.gpuuse import IDLE_BELOW_PCT
from provision.rules.healthlog import HealthReportDoc, report_doc
from provision.rules.historyview import HISTORY_FORMAT, HistoryDoc, HistoryQuery, iso
from provision.rules.jobrows import latest_starts, with_extras
from provision.rules.jobsdoc import DevSeenJson, GpuHistoryJson, HostJson, JobJson, JobsDoc
from provision.rules.priority import Policy
from provision.rules.quotas import QuotasDoc, quotas
from provision.rules.status import JobDoc
from provision.rules.studyview import StudyCurves, StudyDoc
from provision.rules.usage import HOLDING, UsageDoc, Use, gpu_hours
from provision.run.survey import Inventories, stamp
from provision.serve.gpusample import QUIET_EVERY, SAMPLE_EVERY, idle_of, idle_window
from provision.serve.health import HealthKeeper
from provision.serve.hostsfile import HOSTS_JOB, HostsFile
from provision.serve.kept import KEPT_CURSOR, gone_since, job_runs, job_timeline, kept_logs, remembered, rows_json
from provision.serve.rounds import GpuRecorder, Rounds, fresh, gpus_of
from provision.serve.snapshot import prepare
from provision.web.auth import Auth, TokenCheck
from provision.web.inventories import TRIAL_NAME, InventorySource, owner_in
from provision.web.recent import Recent
from provision.web.source import NotFound

DEFAULT_LISTEN = "127.0.0.1:8470"
USAGE_DAYS = 14  # days and ISO weeks the Usage page shows
USAGE_WEEKS = 8
USAGE_FRESH, USAGE_STALE = 5.0, 10.0  # seconds: the Usage page is at most USAGE_STALE s old (it says when)
# The pages' hosts: the latest round answers them while it is younger than ROUND_FRESH (a
# round's period and its own time); only older (a follower, a quiet minute), a page looks at
# the hosts for itself. Looking every 2-4 s beside the rounds cost 1,000 hosts' round trips
# and a document of 8,000 GPUs each time (the pages' p95 and the service's memory).
ROUND_FRESH = 2 * SAMPLE_EVERY + 5.0
LATEST_WITHIN = QUIET_EVERY + SAMPLE_EVERY  # seconds: a GPU's latest sample, at the slowest cadence
DAY = 86400.0
HEALTH_DAYS = 30  # days of incidents the Health page ranks
EVENTS_PAGE = 500  # events an answer of /api/v1/events holds at most
POLICY_FRESH = 10.0  # seconds the Quotas page's policy is read again after (`provision policy set` shows within)


KNOWN_FINISHED = 50  # jobs whose finished work the pages (and the rounds) keep showing: the latest


class Known(Inventories):
    """The inventories the service knows, read again at each look: the unfinished
    submissions' snapshots (they come and go), the `--inventory` files, the `--hosts` file's
    hosts, and the latest finished submission of each of the KNOWN_FINISHED jobs that finished
    last (their pages, and their hosts on the Cluster page while they answer). A finished
    one's snapshot is put in place again if its directory is gone (another service ran it);
    one that no longer reads is left out."""

    def __init__(
        self,
        store: ServiceStore,
        work_root: Path,
        extra: Sequence[str | Path] = (),
        hosts_file: HostsFile | None = None,
    ):
        super().__init__()
        self.store, self.work_root, self.extra = store, work_root, [str(p) for p in extra]
        self.hosts_file = hosts_file
        self.finished_only: frozenset[str] = frozenset()  # hosts only finished work names
        self._placed: set[str] = set()  # finished submissions whose snapshot was put in place (or tried)

    def read(self) -> dict[str, tuple[str, Inventory]]:
        subs = self.store.submissions(unfinished=True)
        live = {s.job for s in subs}
        done = [s for s in self.store.finished_submissions(KNOWN_FINISHED) if s.job not in live]
        handed = [str(self.work_root / s.id / s.inventory) for s in subs]
        handed = [p for p in handed if Path(p).is_file()]
        hosts = [str(self.hosts_file.refresh())] if self.hosts_file is not None else []
        ended = [p for s in done if (p := self._placed_path(s)) is not None]
        with self.lock:
            out: dict[str, tuple[str, Inventory]] = {}
            for p in handed + self.extra + hosts:
                out.setdefault(self._load(p).job, (p, self._loaded[p][1]))
            named = {h.name for _, inv in out.values() for h in inv.hosts}
            finished: set[str] = set()
            for p in ended:
                try:
                    inv = self._load(p)
                except ProvisionError:
                    continue  # a snapshot this version no longer reads: not shown
                if inv.job not in out:
                    out[inv.job] = (p, inv)
                    finished |= {h.name for h in inv.hosts}
            self.paths = handed + self.extra + hosts + [p for p, _ in out.values() if p in ended]
            for gone in set(self._loaded) - set(self.paths):
                del self._loaded[gone]
            self.finished_only = frozenset(finished - named)
            return out

    def _load(self, path: str) -> Inventory:
        now = stamp(path)
        got = self._loaded.get(path)
        if got is None or now is None or got[0] != now:
            got = self._loaded[path] = (now, load(path))
        return got[1]

    def _placed_path(self, sub: Submission) -> str | None:
        where = self.work_root / sub.id / sub.inventory
        if not where.is_file() and sub.id not in self._placed:
            self._placed.add(sub.id)
            try:
                prepare(self.store, sub, self.work_root / sub.id)
            except (ProvisionError, OSError):
                return None
        return str(where) if where.is_file() else None


class ServiceSource:
    def __init__(
        self,
        store: ServiceStore,
        work_root: Path,
        extra: Sequence[str | Path] = (),
        *,
        rounds: Rounds | None = None,
        gpus: GpuRecorder | None = None,
        known: Known | None = None,
        policy: Callable[[], Policy] | None = None,
        health: HealthKeeper | None = None,
        dev: Callable[[], Mapping[str, DevSeenJson]] | None = None,
    ):
        self.store = store
        self.keeper = health  # the hosts' health after each round's changes (serve/health.py)
        self.dev = dev  # the service's watch of dev sessions: job -> idle time, logins, ending
        self.known = known or Known(store, work_root, extra)
        self.inventory = InventorySource(self.known)
        self.rounds, self.gpus = rounds, gpus
        self.idle_window = idle_window()
        self._usage: Recent[UsageDoc] = Recent(USAGE_FRESH, USAGE_STALE)
        # The hosts' document with each GPU's last hour, made once per round (and history):
        # /api/v1/hosts encodes the same document once.
        self._with_history: tuple[JobsDoc, dict[str, GpuHistoryJson], JobsDoc] | None = None
        self._jobs_made: tuple[JobsDoc, JobsDoc] | None = None  # (the hosts' document, the Jobs page's)
        self._quotas_made: tuple[JobsDoc, Policy, QuotasDoc] | None = None
        self.policy = policy  # reads the team's policy (None: as the inventories' state named it)
        self._policies: Recent[Policy] = Recent(POLICY_FRESH, POLICY_FRESH)
        self._history: Recent[dict[str, GpuHistoryJson]] = Recent(
            ROUND_FRESH, ROUND_FRESH
        )  # a follower's, read from the database

    # ------------------------------------------------------------------ the hosts: the rounds

    def _looked(self) -> None:
        if self.rounds is not None:
            self.rounds.look()

    def _doc(self) -> JobsDoc:
        """The latest round's hosts when it is recent, else a look at the hosts now."""
        r = fresh(self.rounds.latest if self.rounds is not None else None, ROUND_FRESH)
        return r.doc if r is not None else self.inventory.hosts()  # the round's own (what is made of it is kept by it)

    def hosts(self) -> JobsDoc:
        """The hosts now (a round of the last seconds), each with its GPUs' last hour."""
        self._looked()
        doc = self._doc()
        history = self._gpu_history(doc)
        got = self._with_history
        if got is not None and got[0] is doc and got[1] is history:
            return got[2]
        marks = self.keeper.doc if self.keeper is not None else {}
        gone = self.known.finished_only  # hosts of finished work only: shown while they answer
        hosts: dict[str, HostJson] = {}
        for name, h in doc.get("hosts", {}).items():
            if name in gone and h.get("error"):
                continue
            hosts[name] = {**h, "gpu_history": history.get(name, {})}
            if name in marks:  # the keeper's, after this round's changes
                hosts[name]["health"] = marks[name]
        out: JobsDoc = {**doc, "hosts": hosts}
        self._with_history = (doc, history, out)
        return out

    def _gpu_history(self, doc: JobsDoc) -> dict[str, GpuHistoryJson]:
        g = self.gpus
        if g is not None and g.doc is not None and time.monotonic() - g.at < ROUND_FRESH:
            return g.doc
        recorder = g or GpuRecorder(self.store)
        return self._history.get("", lambda: recorder.read(self.store.now() - GPU_KEEP, gpus_of(doc)).doc)

    def jobs(self) -> JobsDoc:
        """The hosts' document with each job's GPUs, GPU-hours, end and start right
        (rules/jobrows.py: the inventories' demand, the history, the runs' records), made
        once per round."""
        doc = self.hosts()
        got = self._jobs_made
        if got is not None and got[0] is doc:
            return got[1]
        r = fresh(self.rounds.latest if self.rounds is not None else None, ROUND_FRESH)
        now = time.time()
        hours = self.store.jobs_hours([j["job"] for j in doc["jobs"]], now, sorted(HOLDING))
        out = with_extras(
            doc,
            demand=r.demand if r is not None else {},
            started=latest_starts(r.hosts) if r is not None else {},
            hours=hours,
            now=now,
        )
        seen = self.dev() if self.dev is not None else {}
        if seen:  # a dev session's `dev` with what the service sees of it
            out["jobs"] = [_with_dev(j, seen) for j in out["jobs"]]
        self._jobs_made = (doc, out)
        return out

    def latest(self) -> JobsDoc:
        """The latest round's hosts (/metrics' GPU gauges), or a look at them now."""
        self._looked()
        return self._doc()

    # ------------------------------------------------------------------ what the inventories say

    def job(self, name: str) -> JobDoc:
        """The job as its inventory and hosts say (a trial: as its study does), with what the
        service kept of it: its runs, its timeline, whether its logs were kept; a job no
        inventory names any more: from those alone (serve/kept.py)."""
        if name == HOSTS_JOB:
            raise NotFound(f"job {name}", [])  # the --hosts file's: never applied, nothing to show
        now = time.time()
        try:
            doc = self.inventory.job(name)
        except NotFound:
            got = self._remembered(name, now)
            if got is None:
                raise
            return got
        runs = job_runs(self.store, name, now)
        out: JobDoc = {
            **doc,
            "runs": runs,
            "timeline": job_timeline(self.store, name),
            "kept_logs": self.store.has_kept_logs(name),
        }
        if out["owner"] is None and runs:  # a trial its runner removed: on no ledger, its history says whose
            out["owner"] = runs[-1]["owner"]
        return gone_since(out, runs)

    def _remembered(self, name: str, now: float) -> JobDoc | None:
        ledger = next((j for j in self.jobs()["jobs"] if j["job"] == name), None)
        runs = job_runs(self.store, name, now)
        doc = remembered(name, ledger, runs, self.store.has_kept_logs(name))
        if doc is not None:
            doc["runs"], doc["timeline"] = runs, job_timeline(self.store, name)
        return doc

    def logs(self, name: str, after: str | None) -> LogsDoc:
        """The job's lines from its hosts; once they have none (or no inventory names it),
        the copy the service kept (io/servicelogs.py)."""
        if after is not None and after.startswith(KEPT_CURSOR):
            return {"lines": [], "after": after, "errors": [], "kept": True}
        try:
            live = self.inventory.logs(name, after)
        except NotFound:
            got = kept_logs(self.store, name, after)
            if got is not None:
                return got
            if self._remembered(name, time.time()) is None:
                raise
            why = "no inventory the service knows names this job: its hosts cannot be asked, and no lines were kept"
            return {"lines": [], "after": "", "errors": [why]}
        if live["lines"] or after:
            return live
        got = kept_logs(self.store, name, None)
        return got if got is not None else live

    def tail(self, name: str, lines: int) -> list[LogLine] | None:
        """The job's last lines from its hosts (the log keeper's: serve/keeper.py)."""
        return None if name == HOSTS_JOB else self.inventory.tail(name, lines)

    def curves(self, name: str) -> StudyCurves:
        return self.inventory.curves(name)

    def history(self, q: HistoryQuery) -> HistoryDoc:
        """A page of the history's rows `q` picks, newest first, and how many in all."""
        now = self.store.now()
        rows, total = self.store.history_page(q, now)
        return {"format_version": HISTORY_FORMAT, "rows": rows_json(rows, now), "total": total, "as_of": iso(now)}

    def quotas(self) -> QuotasDoc:
        """Each owner's (or group's) guarantee, use, borrowing and waiting work, with the
        team's policy as the inventories' state names it (rules/quotas.py); made once per
        round."""
        doc = self.jobs()
        r = fresh(self.rounds.latest if self.rounds is not None else None, ROUND_FRESH)
        if self.policy is not None:  # the team's as its database has it now (set since the rounds' contexts opened)
            policy = self._policies.get("", self.policy)
        else:
            policy = (r.policy if r is not None else None) or self.inventory.policy() or Policy()
        got = self._quotas_made
        if got is not None and got[0] is doc and got[1] is policy:
            return got[2]
        asks = {j["job"]: j.get("gpus", 1) for j in doc["jobs"]}
        out = quotas(doc, policy, asks)
        self._quotas_made = (doc, policy, out)
        return out

    def studies(self) -> list[str]:
        return self.inventory.studies()

    def study(self, name: str) -> StudyDoc:
        return self.inventory.study(name)

    def stop(self, name: str, who: str) -> ActionAnswer:
        return self.inventory.stop(name, who)

    def rerun(self, name: str, who: str) -> ActionAnswer:
        return self.inventory.rerun(name, who)

    def promote(self, name: str, trial: int, who: str) -> ActionAnswer:
        return self.inventory.promote(name, trial, who)

    def close(self) -> None:
        self.inventory.close()

    # ------------------------------------------------------------------ what the service keeps

    def usage(self) -> UsageDoc:
        """USAGE_EXAMPLE's shape with "as_of" (when it was summed): one sum answers the
        requests of the next USAGE_FRESH s, then is given up to USAGE_STALE s old while the
        next is made behind it (100,000 runs summed took ~250 ms under load)."""
        self._looked()
        # One round trip first: with the database away the page says so (503), not a kept sum.
        self.store.now()
        return self._usage.get("", self._usage_now)

    def _usage_now(self) -> UsageDoc:
        now = self.store.now()
        wins = usage_windows(now)
        doc = usage_doc(wins, self.store.gpu_hours_in([(w[2], w[3]) for w in wins], now, sorted(HOLDING)))
        # The samples reach back a round more than the window: the rule needs the run's start.
        # Only the GPUs held and below the rule's threshold at their latest sample can be idle.
        # A GPU whose latest sample is older than a quiet round's period is on a host that did
        # not answer: not idle now, not a candidate.
        runs = self.store.gpu_idle_runs(
            now - self.idle_window - 2 * SAMPLE_EVERY, IDLE_BELOW_PCT, latest_after=now - LATEST_WITHIN
        )
        as_of = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        return {**doc, "idle": idle_of(runs, now, self.idle_window), "as_of": as_of}

    def incidents(self) -> HealthReportDoc:
        """The health history's last HEALTH_DAYS (rules/healthlog.report_doc): the hosts and
        GPUs ranked, and every incident."""
        self._looked()
        now = self.store.now()
        since = now - HEALTH_DAYS * DAY
        return report_doc(self.store.incidents(since=since), now, since)

    def events(self, after: int, job: str | None = None, kinds: Sequence[Kind] = ()) -> EventsDoc:
        """The events after id `after` (`provision events --json`'s shape, and the cursor of
        the next page). Someone reading them is someone looking: the rounds come sooner."""
        self._looked()
        got = self.store.events(after=after, job=job, kinds=kinds, limit=EVENTS_PAGE)
        last = got[-1].id if got else max(after, 0)
        return {"format_version": EVENTS_FORMAT, "events": [s.to_json() for s in got], "after": last}

    def cancel(self, name: str, who: str) -> ActionAnswer:
        """`provision cancel`: taken back if no worker started it, else its worker stops it."""
        subs = self.store.submissions(unfinished=True, job=name)
        if not subs:
            return {"ok": False, "message": f"job {name}: nothing handed over to the service is unfinished"}
        sub = subs[0]
        try:
            got = self.store.cancel(sub.id, who)
        except ProvisionError as e:
            return {"ok": False, "message": e.message}
        if got is Status.CANCELLED:
            return {"ok": True, "message": f"Took back {sub.id}: nothing of it ran (by {who})."}
        if got is Status.RUNNING:
            return {"ok": True, "message": f"Asked the service to stop {sub.id} (by {who})."}
        return {"ok": False, "message": f"{sub.id} had ended already."}

    def owner(self, name: str, recent: bool = False) -> str | None:
        if (t := TRIAL_NAME.match(name)) is not None and self.inventory.trial(name) is not None:
            name = t["study"]  # a trial's owner: its study's
        # A handed-over job not started yet is on no host's ledger: its submitter owns it.
        subs = self.store.submissions(unfinished=True, job=name)
        if subs:
            return subs[0].owner
        r = fresh(self.rounds.latest if self.rounds is not None else None, ROUND_FRESH)
        if recent and r is not None:
            return owner_in(r.doc, name)
        return self.inventory.owner(name, recent)


def usage_windows(now: float) -> list[tuple[str, str, float, float]]:
    """("day" or "week", its label, start, end clipped to now) of each UTC day (the last
    USAGE_DAYS) and ISO week (the last USAGE_WEEKS) the Usage page shows, oldest first."""
    today = now - now % DAY
    out = []
    for k in range(USAGE_DAYS - 1, -1, -1):
        start = today - k * DAY
        out.append(("day", time.strftime("%Y-%m-%d", time.gmtime(start)), start, min(now, start + DAY)))
    monday = today - time.gmtime(today).tm_wday * DAY
    for k in range(USAGE_WEEKS - 1, -1, -1):
        start = monday - k * 7 * DAY
        out.append(("week", time.strftime("%G-W%V", time.gmtime(start)), start, min(now, start + 7 * DAY)))
    return out


def usage_doc(wins: list[tuple[str, str, float, float]], hours: list[dict[str, float]]) -> UsageDoc:
    """USAGE_EXAMPLE's shape from each window's owner -> GPU-hours; idle GPUs are not known here
    (empty: ServiceSource.usage adds them from the samples)."""
    doc: UsageDoc = {"format_version": 1, "days": [], "weeks": [], "idle": []}
    for (kind, label, _, _), per in zip(wins, hours, strict=True):
        for owner, h in per.items():
            if kind == "day":
                doc["days"].append({"day": label, "owner": owner, "gpu_hours": round(h, 3)})
            else:
                doc["weeks"].append({"week": label, "owner": owner, "gpu_hours": round(h, 3)})
    return doc


def usage_json(events: Iterable[HistoryRow], now: float) -> UsageDoc:
    """usage_doc from history rows in hand (the service sums its database's: ServiceStore.gpu_hours_in)."""
    uses = [Use(e.owner, e.kind, e.gpus, e.started, e.ended) for e in events]
    wins = usage_windows(now)
    return usage_doc(wins, [gpu_hours(uses, end, start) for _, _, start, end in wins])


# --------------------------------------------------------------------------- the address and its Auth


@dataclass(frozen=True)
class Listen:
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_listen(text: str) -> Listen | None:
    """`HOST:PORT` (`[::1]:PORT` for IPv6; port 0: any free one); None for `none` (no pages); ProvisionError else."""
    if text.strip().lower() == "none":
        return None
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or int(port) > 65535:
        raise ProvisionError(f"--listen: expected HOST:PORT (such as {DEFAULT_LISTEN}) or none, got {text!r}")
    return Listen(host, int(port))


def choose_auth(listen: Listen, trust_header: str | None, tokens: TokenCheck, have_tokens: bool) -> Auth:
    """Loopback: no token (or the proxy's header when asked); any other address: tokens,
    refused when none exists yet."""
    if trust_header:
        if not listen.loopback:
            raise ProvisionError(
                f"--trust-header goes with a loopback --listen (127.0.0.1:PORT behind the proxy), not {listen.host}: "
                "anyone could send the header"
            )
        return Auth.trusted_header(listening=listen.host, header=trust_header)
    if listen.loopback:
        return Auth.loopback(tokens)  # a script's bearer token is checked there too
    if not have_tokens:
        raise ProvisionError(
            f"--listen {listen.host}: pages off this machine need tokens; make one with "
            "`provision serve token create --owner NAME`"
        )
    return Auth.token(tokens)


def _with_dev(j: JobJson, seen: Mapping[str, DevSeenJson]) -> JobJson:
    """A dev session's job with what the service's watch sees of it (idle time, logins,
    its end near)."""
    dev = j["dev"]
    if dev is None or j["job"] not in seen:
        return j
    return {**j, "dev": {**dev, **seen[j["job"]]}}
