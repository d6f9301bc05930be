"""The dashboard the service serves (`provision serve --listen`): its Source, and which Auth
an address gets (docs/dashboard.md).

ServiceSource is an InventorySource over the inventories the service knows: each
unfinished submission's materialised snapshot, plus the `--inventory` files (jobs run from
terminals); usage() from the service's history, cancel() through the store as `provision
cancel` does; the GPUs' samples (serve/gpusample.py) for each GPU's last hour, the idle
list and /metrics.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.model import Inventory
from provision.io.servicestore import GPU_KEEP, GpuSample, HistoryRow, ServiceStore, Status
from provision.rules.gpuuse import IDLE_BELOW_PCT
from provision.rules.usage import HOLDING, Use, gpu_hours
from provision.serve.gpusample import (
    QUIET_EVERY,
    SAMPLE_EVERY,
    GpuHistory,
    history_step,
    idle_of,
    idle_window,
    round_every,
    samples_of,
)
from provision.serve.watch import QUIET, Watched, to_look_at
from provision.web.auth import Auth, TokenCheck
from provision.web.inventories import InventorySource
from provision.web.recent import Recent

DEFAULT_LISTEN = "127.0.0.1:8470"
USAGE_DAYS = 14  # days and ISO weeks the Usage page shows
USAGE_WEEKS = 8
USAGE_FRESH, USAGE_STALE = 5.0, 10.0  # seconds: the Usage page is at most USAGE_STALE s old (it says when)
# The pages' hosts: the sampler's rounds (every SAMPLE_EVERY s while someone looks) answer
# them, a round's period and its own time; only older, a page probes for itself (behind the
# answer, up to PAGES_STALE). Probing every 2-4 s beside the rounds cost 1,000 hosts' round
# trips and a document of 8,000 GPUs each time (issue 41's p95 spikes and memory).
PAGES_FRESH, PAGES_STALE = SAMPLE_EVERY + 3.0, 2 * SAMPLE_EVERY + 5.0
LATEST_WITHIN = QUIET_EVERY + SAMPLE_EVERY  # seconds: a GPU's latest sample, at the slowest cadence
DAY = 86400.0


class ServiceSource(InventorySource):
    def __init__(self, store: ServiceStore, work_root: Path, extra: Sequence[str | Path] = ()):
        super().__init__(extra)
        self._hosts = Recent(PAGES_FRESH, PAGES_STALE)  # the rounds answer the pages (PAGES_FRESH)
        self.store = store
        self.work_root = work_root
        self.extra = [str(p) for p in extra]
        self.idle_window = idle_window()
        self._sampled: tuple[float, dict[str, Any]] | None = None  # (monotonic, the last round's hosts)
        # The GPUs' last hour by host, made again by each round as it stores its samples (a
        # page waits for none); older than a round's period, as the hosts above.
        self._history: Recent[dict[str, Any]] = Recent(PAGES_FRESH, PAGES_STALE)
        self._kept_history: GpuHistory | None = None  # the sampler's (its thread's only)
        self._with_history: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = (
            None  # (hosts, history, both)
        )
        self._round: tuple[float, dict[str, Any]] | None = None  # (time.time() it began, the hosts)
        self._verdict: tuple[Any, tuple[set[str], set[str]]] | None = None  # to_look_at's last (key, answer)
        self._looked = -math.inf  # (monotonic) when a page last read the samples
        self._changing = False  # the last round saw a job not simply running
        self._new_watch = False  # a job is watched that no round has seen yet
        self._usage: Recent[dict[str, Any]] = Recent(USAGE_FRESH, USAGE_STALE)

    def to_look_at(self, watched: Sequence[Watched]) -> tuple[set[str], set[str]]:
        """The watched submissions a worker must look at, and those gone from every host,
        by the last sampling round (serve/watch.py); nothing before the first round."""
        got = self._round
        if got is None or not watched:
            return set(), set()
        key = (got[0], tuple(watched))
        if self._verdict is not None and self._verdict[0] == key:  # the service asks every poll; rounds come every 10 s
            return self._verdict[1]
        invs = self._inventories()
        full = [
            dataclasses.replace(w, hosts=frozenset(h.name for h in invs[w.job][1].hosts)) if w.job in invs else w
            for w in watched
        ]
        answer = to_look_at(got[1], got[0], full)
        self._new_watch = any(w.since > got[0] for w in watched)
        self._verdict = (key, answer)
        return answer

    # ------------------------------------------------------------------ GPU samples

    def sample(self) -> int:
        """One round: every host probed (gpusample.Sampler calls this every SAMPLE_EVERY s),
        its GPUs' samples stored; how many."""
        began, started = time.time(), time.monotonic()
        doc = InventorySource.hosts(self, fresh=True)
        self._sampled = (time.monotonic(), doc)
        self._round = (began, doc)
        self._changing = any(j.get("state") not in QUIET for j in doc.get("jobs") or [])
        t = self.store.now()
        got = samples_of(doc, t)
        self.store.add_gpu_samples(got)
        self._history.put("", self._history_round(got, t - GPU_KEEP, _gpus(doc)), started)
        return len(got)

    def _history_round(self, got: Sequence[GpuSample], since: float, gpus: int) -> dict[str, Any]:
        """The GPUs' last hour with this round's samples: added to the kept history, or all
        of it read again when its points change width (gpusample.history_step)."""
        kept = self._kept_history
        if kept is None or history_step(kept.rounds_after(since), gpus) != kept.step:
            kept = self._kept_history = self._history_read(since, gpus)
        else:
            kept.add(got, since)
        return kept.doc

    def _history_read(self, since: float, gpus: int) -> GpuHistory:
        rounds = self.store.gpu_round_times(since)
        step = history_step(len(rounds), gpus)
        return GpuHistory(step, self.store.gpu_history(since, step), rounds)

    def every(self) -> float:
        """Seconds between sampling rounds now (gpusample.round_every)."""
        return round_every(time.monotonic() - self._looked, self._changing or self._new_watch)

    def hosts(self, *, fresh: bool = False) -> dict[str, Any]:
        """The hosts now (a probe of the last seconds), each with its GPUs' last hour."""
        if not fresh:  # a page's (the rounds ask fresh)
            self._looked = time.monotonic()
        doc = super().hosts(fresh=fresh)
        history = self._history.get("", lambda: self._history_now(doc))
        got = self._with_history
        if got is not None and got[0] is doc and got[1] is history:
            return got[2]  # the same document for the same round: /api/v1/hosts encodes it once
        hosts = {name: {**h, "gpu_history": history.get(name, {})} for name, h in doc.get("hosts", {}).items()}
        out = {**doc, "hosts": hosts}
        self._with_history = (doc, history, out)
        return out

    def _history_now(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Each GPU's last hour read now (no round recent: a follower's pages, a quiet minute)."""
        return self._history_read(self.store.now() - GPU_KEEP, _gpus(doc)).doc

    def latest(self) -> dict[str, Any]:
        """The last round's hosts (/metrics' GPU gauges), or a probe now when none is recent."""
        self._looked = time.monotonic()
        got = self._sampled
        if got is not None and time.monotonic() - got[0] < 2 * SAMPLE_EVERY:
            return got[1]
        return super().latest()

    def _inventories(self) -> dict[str, tuple[str, Inventory]]:
        # The submissions come and go: the paths are looked up again on each request.
        subs = self.store.submissions(unfinished=True)
        handed = [self.work_root / s.id / s.inventory for s in subs]
        with self._reading:
            self.paths = [str(p) for p in handed if p.is_file()] + self.extra
            return super()._inventories()

    def usage(self) -> dict[str, Any]:
        """USAGE_EXAMPLE's shape with "as_of" (when it was summed): one sum answers the
        requests of the next USAGE_FRESH s, then is given up to USAGE_STALE s old while the
        next is made behind it (100,000 runs summed took ~250 ms under load: issue 41)."""
        self._looked = time.monotonic()
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
        return subs[0].owner if subs else super().owner(name, recent)


def _gpus(doc: dict[str, Any]) -> int:
    return sum(int(h.get("gpus") or 0) for h in doc.get("hosts", {}).values())


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
