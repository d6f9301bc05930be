"""The rule for a pushed file two jobs list (rules/plan.py): who may change it, and what a
finished job's claim means."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from provision.host.protocol import FileInfo
from provision.render.files import FileKind
from provision.rules.plan import _Draft, _judged_as_shared
from provision.rules.sharing import OtherJob, _other_owner_problem, finished_users_note

V1, V2 = "1" * 64, "2" * 64
PATH = "/opt/x/train.py"


def want(sha: str) -> SimpleNamespace:
    return SimpleNamespace(sha256=sha)


@pytest.mark.parametrize(
    "host, mine, other, refused",
    [
        (V1, V2, OtherJob("b", V1, "bo", running=True), True),  # b runs with v1: not under it
        (V1, V2, OtherJob("b", V1, "bo", running=False), False),  # b finished: its claim holds nothing
        (V1, V2, OtherJob("b", V1, "bo"), True),  # not known to be finished: runs
        (V2, V1, OtherJob("a", V2, "ana", running=True), True),  # b's rerun under a running a
        (V2, V1, OtherJob("a", V2, "ana", running=False), False),
        (V2, V1, OtherJob("a", V1, "ana", running=True), False),  # edited by hand: both want v1 back
        (V1, V1, OtherJob("b", V2, "bo", running=True), False),  # nothing written
    ],
)
def test_who_may_change_a_shared_file(host, mine, other, refused):
    why = _other_owner_problem(PATH, want(mine), FileInfo("file", sha256=host), {"sha256": V1}, [other])
    assert (why is not None) is refused, why
    if refused:
        assert why == (
            f"{PATH} is shared with job {other.job} ({other.who}): changing it would change what that job runs; "
            "give this job's files: entry another dest"
        )


def test_plan_says_what_a_finished_jobs_rerun_meets():
    note = finished_users_note(PATH, want(V2), FileInfo("file", sha256=V1), [OtherJob("b", V1, "bo", running=False)])
    assert note == (
        f"{PATH} is shared with job b, which has finished: this apply changes it; a rerun of b writes its "
        "own bytes back, and is refused while a running job uses these"
    )
    assert finished_users_note(PATH, want(V2), FileInfo("file", sha256=V1), [OtherJob("b", V1, "bo")]) is None
    assert finished_users_note(PATH, want(V1), FileInfo("file", sha256=V1), [OtherJob("b", V2, running=False)]) is None


def test_a_finished_jobs_file_changed_by_a_running_one_is_left_and_blocks_its_start():
    """The finished variant's own plan after the original changed the file: nothing to
    write (the variant reads nothing), no refusal; starting it (--rerun) is refused while
    the original runs with its bytes."""
    hp = _Draft()
    f = SimpleNamespace(sha256=V1, kind=FileKind.FILE)
    a = FileInfo("file", sha256=V2)
    settled = _judged_as_shared(hp, PATH, f, a, {"sha256": V1}, [OtherJob("orig", V2, "ana", running=True)])
    assert settled and hp.problems == [] and hp.taken == [(PATH, "orig")]
    assert hp.warnings == [
        f"{PATH} was changed by job orig (ana), which shares it and runs, after this job had finished: left as "
        "it is; this job cannot start again while orig runs with it"
    ]
    # The original finished too: the variant writes its own bytes back (a plain update).
    hp = _Draft()
    assert not _judged_as_shared(hp, PATH, f, a, {"sha256": V1}, [OtherJob("orig", V2, "ana", running=False)])
    assert hp.problems == [] and hp.taken == []
