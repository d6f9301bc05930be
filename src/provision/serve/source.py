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
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.events import EVENTS_FORMAT, Kind
from provision.core.model import Inventory
from provision.core.submission import Status
from provision.io.servicehistory import GPU_KEEP, HistoryRow
from provision.io.servicestore import ServiceStore
from provision.rules.gpuuse import IDLE_BELOW_PCT
from provision.rules.usage import HOLDING, Use, gpu_hours
from provision.run.survey import Inventories
from provision.serve.gpusample import QUIET_EVERY, SAMPLE_EVERY, idle_of, idle_window
from provision.serve.rounds import GpuRecorder, Rounds, fresh, gpus_of
from provision.web.auth import Auth, TokenCheck
from provision.web.inventories import InventorySource, owner_in
from provision.web.recent import Recent

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
EVENTS_PAGE = 500  # events an answer of /api/v1/events holds at most


class Known(Inventories):
    """The inventories the service knows, read again at each look: the unfinished
    submissions' snapshots (they come and go) and the `--inventory` files."""

    def __init__(self, store: ServiceStore, work_root: Path, extra: Sequence[str | Path] = ()):
        super().__init__()
        self.store, self.work_root, self.extra = store, work_root, [str(p) for p in extra]

    def read(self) -> dict[str, tuple[str, Inventory]]:
        subs = self.store.submissions(unfinished=True)
        handed = [self.work_root / s.id / s.inventory for s in subs]
        with self.lock:
            self.paths = [str(p) for p in handed if p.is_file()] + self.extra
            return super().read()


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
        dev: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
    ):
        self.store = store
        self.dev = dev  # the service's watch of dev sessions: job -> idle time, logins, ending
        self.known = known or Known(store, work_root, extra)
        self.inventory = InventorySource(self.known)
        self.rounds, self.gpus = rounds, gpus
        self.idle_window = idle_window()
        self._usage: Recent[dict[str, Any]] = Recent(USAGE_FRESH, USAGE_STALE)
        # The hosts' document with each GPU's last hour, made once per round (and history):
        # /api/v1/hosts encodes the same document once.
        self._with_history: tuple[Any, Any, dict[str, Any]] | None = None
        self._history: Recent[dict[str, Any]] = Recent(ROUND_FRESH, ROUND_FRESH)  # a follower's, read from the database

    # ------------------------------------------------------------------ the hosts: the rounds

    def _looked(self) -> None:
        if self.rounds is not None:
            self.rounds.look()

    def _doc(self) -> dict[str, Any]:
        """The latest round's hosts when it is recent, else a look at the hosts now."""
        r = fresh(self.rounds.latest if self.rounds is not None else None, ROUND_FRESH)
        return dict(r.doc) if r is not None else self.inventory.hosts()

    def hosts(self) -> dict[str, Any]:
        """The hosts now (a round of the last seconds), each with its GPUs' last hour."""
        self._looked()
        doc = self._doc()
        history = self._gpu_history(doc)
        got = self._with_history
        if got is not None and got[0] is doc and got[1] is history:
            return got[2]
        hosts = {name: {**h, "gpu_history": history.get(name, {})} for name, h in doc.get("hosts", {}).items()}
        out = {**doc, "hosts": hosts}
        self._with_history = (doc, history, out)
        return out

    def _gpu_history(self, doc: dict[str, Any]) -> dict[str, Any]:
        g = self.gpus
        if g is not None and g.doc is not None and time.monotonic() - g.at < ROUND_FRESH:
            return g.doc
        recorder = g or GpuRecorder(self.store)
        return self._history.get("", lambda: recorder.read(self.store.now() - GPU_KEEP, gpus_of(doc)).doc)

    def jobs(self) -> dict[str, Any]:
        """The hosts' document; a dev session's `dev` with what the service sees of it."""
        doc = self.hosts()
        seen = self.dev() if self.dev is not None else {}
        if not seen:
            return doc
        jobs = [
            {**j, "dev": {**j["dev"], **seen[j["job"]]}} if j.get("dev") and j.get("job") in seen else j
            for j in doc.get("jobs") or []
        ]
        return {**doc, "jobs": jobs}

    def latest(self) -> dict[str, Any]:
        """The latest round's hosts (/metrics' GPU gauges), or a look at them now."""
        self._looked()
        return self._doc()

    # ------------------------------------------------------------------ what the inventories say

    def job(self, name: str) -> dict[str, Any]:
        return self.inventory.job(name)

    def logs(self, name: str, after: str | None) -> dict[str, Any]:
        return self.inventory.logs(name, after)

    def studies(self) -> list[str]:
        return self.inventory.studies()

    def study(self, name: str) -> dict[str, Any]:
        return self.inventory.study(name)

    def stop(self, name: str, who: str) -> dict[str, Any]:
        return self.inventory.stop(name, who)

    def rerun(self, name: str, who: str) -> dict[str, Any]:
        return self.inventory.rerun(name, who)

    def promote(self, name: str, trial: int, who: str) -> dict[str, Any]:
        return self.inventory.promote(name, trial, who)

    def close(self) -> None:
        self.inventory.close()

    # ------------------------------------------------------------------ what the service keeps

    def usage(self) -> dict[str, Any]:
        """USAGE_EXAMPLE's shape with "as_of" (when it was summed): one sum answers the
        requests of the next USAGE_FRESH s, then is given up to USAGE_STALE s old while the
        next is made behind it (100,000 runs summed took ~250 ms under load)."""
        self._looked()
        # One round trip first: with the database away the page says so (503), not a kept sum.
        self.store.now()
        return self._usage.get("", self._usage_now)

    def _usage_now(self) -> dict[str, Any]:
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

    def events(self, after: int, job: str | None = None, kinds: Sequence[Kind] = ()) -> dict[str, Any]:
        """The events after id `after` (`provision events --json`'s shape, and the cursor of
        the next page). Someone reading them is someone looking: the rounds come sooner."""
        self._looked()
        got = self.store.events(after=after, job=job, kinds=kinds, limit=EVENTS_PAGE)
        last = got[-1].id if got else max(after, 0)
        return {"format_version": EVENTS_FORMAT, "events": [s.to_json() for s in got], "after": last}

    def cancel(self, name: str, who: str) -> dict[str, Any]:
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


def usage_doc(wins: list[tuple[str, str, float, float]], hours: list[dict[str, float]]) -> dict[str, Any]:
    """USAGE_EXAMPLE's shape from each window's owner -> GPU-hours; idle GPUs are not known here
    (empty: ServiceSource.usage adds them from the samples)."""
    doc: dict[str, Any] = {"format_version": 1, "days": [], "weeks": [], "idle": []}
    for (kind, label, _, _), per in zip(wins, hours, strict=True):
        for owner, h in per.items():
            doc[f"{kind}s"].append({kind: label, "owner": owner, "gpu_hours": round(h, 3)})
    return doc


def usage_json(events: Iterable[HistoryRow], now: float) -> dict[str, Any]:
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
