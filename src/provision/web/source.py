"""Where the dashboard's data comes from: a `Source`, whose methods return the JSON shapes the
CLI prints with `--json` (the dashboard reads what run/ and io/ return; it never asks a host
itself). `inventories.InventorySource` is one over inventory files; the service hands its
own (over its state backend and history).

The shapes (docs/dashboard.md):
- hosts(), jobs(): `provision jobs --json` (rules/tenancy.jobs_json); a host may carry
  "labels" ({key: value}) and "gpu_use" ({"<index>": {"utilization": %, "memory_mib": n,
  "memory_total_mib": n}}) and "gpu_history" ({"<index>": [[epoch seconds, utilization %],
  ...]}, the last hour) when the source knows them; a job may carry "priority",
  "gpus" and "gpu_hours", "ended".
- job(name): `provision status --json` (rules/status.JobStatus.to_json) plus "env" (the
  inventory's env with every `secret_env` value masked), "study" (its study's name or null)
  and "actions" (which of stop, rerun, cancel the job's phase allows).
- logs(name, after): {"lines": [{"time", "task", "host", "text"}], "after": cursor,
  "errors": [...]}: the lines after the opaque cursor `after` (None: the last ones).
- study(name): `provision tune --status --json` (rules/studyview.study_json) plus "space"
  (rules/studyview.space_json: each parameter's type and scale).
- usage(): USAGE_EXAMPLE's shape.
- history(q): the service's history rows (rules/historyview.HistoryDoc); quotas(): each
  owner's guarantee and use (rules/quotas.QuotasDoc); curves(name): each trial's reports.
A job's document may carry what the service kept of it (rules/status.JobDoc: its runs,
timeline, kept logs; a trial's row and reports).
- incidents(): the health history (rules/healthlog.report_doc); a host of hosts() may carry
  "health" ({"host": {"state", "reason", ...}, "gpus": {"<index>": {"state", ...}}}).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from provision.core.answers import ActionAnswer, LogsDoc
from provision.core.events import EventsDoc, Kind
from provision.rules.healthlog import HealthReportDoc
from provision.rules.historyview import HistoryDoc, HistoryQuery
from provision.rules.jobsdoc import JobsDoc
from provision.rules.quotas import QuotasDoc
from provision.rules.status import JobDoc
from provision.rules.studyview import StudyCurves, StudyDoc
from provision.rules.usage import UsageDoc

SECRET_MASK = "********"

# usage(): GPU-hours per owner per day and per ISO week, and GPUs held but idle.
USAGE_EXAMPLE: UsageDoc = {
    "format_version": 1,
    "days": [{"day": "2026-11-27", "owner": "ana@example.com", "gpu_hours": 12.5}],
    "weeks": [{"week": "2026-W48", "owner": "ana@example.com", "gpu_hours": 40.0}],
    "idle": [{"host": "gpu-1", "gpu": 3, "job": "bert", "owner": "ana@example.com", "idle_minutes": 14}],
}


class NotFound(LookupError):
    """No job or study of that name; `known` is what exists (the 404 page lists it)."""

    def __init__(self, what: str, known: list[str]):
        super().__init__(what)
        self.what = what
        self.known = known


class Unavailable(RuntimeError):
    """The source cannot answer now (its database is down): the page says so and the next
    request asks again."""


class Source(Protocol):
    def hosts(self) -> JobsDoc: ...

    def jobs(self) -> JobsDoc: ...

    def latest(self) -> JobsDoc:
        """hosts() as /metrics reads it: the source's latest GPU sample where it samples."""
        ...

    def job(self, name: str) -> JobDoc: ...

    def logs(self, name: str, after: str | None) -> LogsDoc: ...

    def studies(self) -> list[str]: ...

    def study(self, name: str) -> StudyDoc: ...

    def usage(self) -> UsageDoc: ...

    def incidents(self) -> HealthReportDoc:
        """`provision health --report --json`'s shape (rules/healthlog.report_doc): the
        hosts and GPUs ranked by incidents, and every incident of the last 30 days."""
        ...

    def events(self, after: int, job: str | None = None, kinds: Sequence[Kind] = ()) -> EventsDoc:
        """`provision events --json`'s shape after event id `after`, and "after": the last
        id given (the next request's)."""
        ...

    def history(self, q: HistoryQuery) -> HistoryDoc:
        """The history rows `q` picks (newest first), a page of them, and how many in all."""
        ...

    def quotas(self) -> QuotasDoc:
        """Each owner's (or group's) guaranteed GPUs, in use, borrowed and waiting."""
        ...

    def curves(self, name: str) -> StudyCurves:
        """Each trial of study `name`'s reports (its learning curve)."""
        ...

    def owner(self, name: str, recent: bool = False) -> str | None:
        """Who owns the job or study `name` (as the hosts' ledgers name them); None: unknown.
        recent: as the hosts were last seen, without waiting for a probe (what a page shows);
        else as a probe of the last few seconds says (before an action)."""
        ...

    # Actions: `who` is the authenticated user (the hosts' history names them). Each returns
    # {"ok": bool, "message": str, ...}; a refusal is ok false with its reason.
    def stop(self, name: str, who: str) -> ActionAnswer: ...

    def rerun(self, name: str, who: str) -> ActionAnswer: ...

    def cancel(self, name: str, who: str) -> ActionAnswer: ...

    def promote(self, name: str, trial: int, who: str) -> ActionAnswer: ...


def masked_env(
    env: list[tuple[str, str]] | tuple[tuple[str, str], ...], secret_names: tuple[str, ...]
) -> dict[str, str]:
    """The env as a page shows it: every secret's value masked, present or not."""
    out = {k: (SECRET_MASK if k in secret_names else v) for k, v in env}
    for k in secret_names:
        out[k] = SECRET_MASK
    return out
