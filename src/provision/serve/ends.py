"""How a submission's worker ends (its exit code) and what its end records: the submission's
new status (a compare-and-set in the store), its study's history row, and the events of
the end (study.ended, submission.ended), each once by its key. The worker and the service
(a watched job gone from its hosts) end submissions through record_end alone."""

from __future__ import annotations

from provision.core.events import Event, How, Kind
from provision.core.submission import Kind as SubKind
from provision.core.submission import Status
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore, Submission

LEFT = 130  # a worker that left its work (asked to, or its storage away): the work goes on with another
SERVICE_ENV = "PROVISION_SERVICE_ID"  # the service that started a worker (its claim on the work)


def _how(status: Status) -> How:
    return How.SUCCEEDED if status is Status.DONE else How.CANCELLED if status is Status.CANCELLED else How.FAILED


def record_end(store: ServiceStore, sub: Submission, status: Status, why: str) -> None:
    """The submission's new status (WATCHING, QUEUED, or its end), its study's history row and
    the events of its end: a study's and the submission's."""
    if status is Status.WATCHING:
        store.watching(sub.id, why)
        return
    if status is Status.QUEUED:
        store.queued(sub.id, why)
        return
    ended: list[Event] = []
    if sub.kind is SubKind.TUNE:
        began = sub.started if sub.started is not None else sub.created
        store.record(
            HistoryRow("study", sub.job, sub.owner, began, store.now(), f"{status.value}: {why}", (), 0, sub.id)
        )
        how = _how(status)
        ended.append(
            Event(
                Kind.STUDY_ENDED,
                f"study:{sub.id}",
                sub.job,
                sub.owner,
                words=f"study {sub.job} {status.value}: {why}",
                how=how,
            )
        )
    if store.finish(sub.id, status, why):
        how = _how(status)
        words = f"submission {sub.id} ({sub.kind.value} of job {sub.job}) {status.value}: {why}"
        ended.append(Event(Kind.SUBMISSION_ENDED, f"submission:{sub.id}", sub.job, sub.owner, words=words, how=how))
    store.emit(ended)
