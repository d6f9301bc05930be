"""The dashboard's pure rules as tables: the Jobs page's numbers (rules/jobrows.py), how a
history row ended (rules/historyview.py), the quotas and who a guaranteed owner's ask would
preempt first (rules/quotas.py, over rules/preemption.decide), and the values' precision."""

from __future__ import annotations

import pytest

from provision.rules.historyview import by_owner_over_days, row_json, state_of, why_of
from provision.rules.jobrows import latest_starts, shown_state, with_extras
from provision.rules.jobsdoc import JobJson, JobsDoc
from provision.rules.priority import Policy
from provision.rules.quotas import quotas
from provision.rules.rounds import HostSeen
from provision.rules.tenancy import HostView
from provision.web.views import sig, took

NOW = 2_000_000_000.0


def job(
    name: str, state: str, hosts: dict, owner: str = "ana", preemptible: bool = False, since: str | None = None
) -> JobJson:
    return {
        "job": name, "owner": owner, "lineage": "L", "state": state, "since": since, "age_seconds": None,
        "queued": None, "priority": "normal", "priority_level": 500, "preemptible": preemptible, "submitted": None,
        "hosts": {h: {"state": s, "gpus": g, "ports": [], "preempted_by": None} for h, (s, g) in hosts.items()},
    }  # fmt: skip


def doc(*jobs: JobJson, free: dict[str, int] | None = None) -> JobsDoc:
    hosts = {
        h: {"error": None, "gpus": 8, "free_gpus": list(range(n)), "held": {}, "foreign_ports": [], "unreadable": []}
        for h, n in (free or {}).items()
    }
    return {"format_version": 1, "jobs": list(jobs), "hosts": hosts}  # type: ignore[typeddict-item]


@pytest.mark.parametrize(
    "j, state",
    [
        (job("a", "ended", {"h1": ("preempted", [0, 1])}), "preempted"),
        (job("a", "ended", {"h1": ("ended", [0])}), "ended"),
        (job("a", "running", {"h1": ("running", [0])}), "running"),
        (job("a", "stale", {"h1": ("preempted", [])}), "preempted"),
    ],
)
def test_a_preempted_job_is_listed_so(j, state):
    assert shown_state(j) == state


def test_the_jobs_numbers():
    d = doc(
        job("pre", "ended", {"h1": ("preempted", list(range(8))), "h2": ("ended", [])}),
        job("q", "queued", {"h1": ("queued", [])}),
        job("run", "running", {"h1": ("running", [0, 1])}, since="2026-01-01T00:00:00Z"),
        job("done", "ended", {"h2": ("ended", [0])}),
        job("study-t3", "queued", {"h1": ("queued", [])}),
    )
    demand = {
        "pre": ((4, frozenset({"h1"})),) * 3,
        "q": ((2, frozenset({"h1"})),) * 2,
        "study": ((1, frozenset({"h1"})),),
    }
    hours = {"run": (3.5, None, 2, 2), "done": (12.0, NOW - 60, 1, 4), "pre": (6.0, NOW - 600, 1, 12)}
    out = with_extras(d, demand=demand, started={"run": NOW - 3600}, hours=hours, now=NOW)
    got = {j["job"]: (j["state"], j["gpus"], j["gpu_hours"], j["ended"]) for j in out["jobs"]}
    assert got == {
        "pre": ("preempted", 12, 6.0, "2033-05-18T03:23:20Z"),  # what it asks for, not the 8 left
        "q": ("queued", 4, None, None),  # its replicas' GPUs, not 0
        "run": ("running", 2, 3.5, None),  # held now; a run open: no end
        "done": ("ended", 4, 12.0, "2033-05-18T03:32:20Z"),  # what its last run held
        "study-t3": ("queued", 1, None, None),  # a trial asks what its study's pools do
    }
    run = next(j for j in out["jobs"] if j["job"] == "run")
    assert run["since"] == "2033-05-18T02:33:20Z" and run["age_seconds"] == 3600  # its latest run's start
    assert d["jobs"][0]["state"] == "ended"  # the hosts' document is left as it is


def test_the_latest_runs_start_is_a_reruns_since():
    runs = [{"run": 1, "at": 100.0, "by": "a"}, {"run": 2, "at": 900.0, "by": "a"}]
    hosts = {
        "h1": HostSeen(HostView("h1", 1), records={"j": {"runs": runs}, "k": {"runs": runs[:1]}}),
        "h2": HostSeen(HostView("h2", 1), records={"j": {"runs": [{"run": 2, "at": 880.0, "by": "a"}]}}),
    }
    assert latest_starts(hosts) == {"j": 880.0, "k": 100.0}


@pytest.mark.parametrize(
    "kind, how, ended, state",
    [
        ("run", "Succeeded", 1.0, "succeeded"),
        ("run", "Failed: chief-0 exited 1", 1.0, "failed"),
        ("run", "Preempted by big (priority high)", 1.0, "preempted"),
        ("run", "stopped by ana", 1.0, "stopped"),
        ("trial", "stopped early, 0.3: median rule", 1.0, "stopped early"),
        ("trial", "succeeded, 0.25", 1.0, "succeeded"),
        ("study", "done: max_trials reached", 1.0, "succeeded"),
        ("study", "cancelled: cancelled by ana", 1.0, "cancelled"),
        ("wait", "gave up", 1.0, "gave up"),
        ("wait", "fitted", 1.0, "fitted"),
        ("run", "job term was destroyed while it ran (gone from h1)", 1.0, "destroyed"),
        ("run", "gone from its hosts (destroyed)", 1.0, "destroyed"),
        ("run", "", None, "running"),
        ("wait", "", None, "waiting"),
        ("run", "who knows", 1.0, "ended"),
    ],
)
def test_how_a_row_ended_in_one_word(kind, how, ended, state):
    assert state_of(kind, how, ended) == state


def test_a_rows_words_and_hours():
    assert why_of("Failed: chief-0 exited 1") == "chief-0 exited 1" and why_of("fitted") == "fitted"
    r = {"kind": "run", "job": "j", "owner": "a", "started": NOW - 7200, "ended": None, "how": "", "hosts": ("h",),
         "gpus": 4, "submission": "s"}  # fmt: skip
    got = row_json(r, NOW)  # type: ignore[arg-type]
    assert (got["state"], got["seconds"], got["gpu_hours"], got["ended"]) == ("running", 7200.0, 8.0, None)
    assert row_json({**r, "kind": "wait"}, NOW)["gpu_hours"] == 0.0  # type: ignore[typeddict-item]


def test_gpu_hours_by_owner_over_days_keeps_the_top_and_sums_the_others():
    days = [
        {"day": "2026-11-2" + str(d), "owner": f"o{k}", "gpu_hours": float(k + d)} for d in range(3) for k in range(4)
    ]
    axis, owners, series = by_owner_over_days(days, top=2)
    assert axis == ["2026-11-20", "2026-11-21", "2026-11-22"] and owners == ["o3", "o2", "others"]
    assert series["o3"] == [3.0, 4.0, 5.0] and series["others"] == [1.0, 3.0, 5.0]


def test_quotas_and_who_a_guaranteed_owner_would_preempt_first():
    policy = Policy(guarantees=(("team", 6), ("cy", 2)), groups=(("ana", "team"), ("bo", "team")))
    d = doc(
        job(
            "big",
            "running",
            {"h1": ("running", list(range(8)))},
            owner="dee",
            preemptible=True,
            since="2026-01-02T00:00:00Z",
        ),
        job("old", "running", {"h2": ("running", [0, 1])}, owner="dee", preemptible=True, since="2026-01-01T00:00:00Z"),
        job("mine", "running", {"h2": ("running", [2, 3])}, owner="ana"),
        job("wants", "queued", {"h1": ("queued", [])}, owner="bo"),
        free={"h1": 0, "h2": 4},
    )
    got = {q["quota"]: q for q in quotas(d, policy, {"wants": 3})["quotas"]}
    assert [q for q in got] == ["team", "cy", "dee"]  # guaranteed first, then by use
    team, cy, dee = got["team"], got["cy"], got["dee"]
    assert cy["if_asked"] == {"gpus": 2, "fits": True, "possible": True, "victims": []}
    assert (team["members"], team["guaranteed"], team["used"], team["borrowed"]) == (["ana", "bo"], 6, 2, 0)
    assert (team["waiting"], team["waiting_jobs"]) == (3, ["wants"])
    assert (dee["used"], dee["borrowed"], dee["if_asked"]) == (10, 10, None)
    # team asks for its 4 left: 4 free on h2, it fits; cy asks for 2: fits too.
    assert team["if_asked"] == {"gpus": 4, "fits": True, "possible": True, "victims": []}
    full = doc(*d["jobs"], free={"h1": 0, "h2": 0})
    team = next(q for q in quotas(full, policy, {})["quotas"] if q["quota"] == "team")
    # Nothing free: a borrower leaves, the one started last first (the least work lost).
    assert team["if_asked"]["victims"] == [
        {"job": "big", "owner": "dee", "why": "borrowing beyond its owner's guarantee"}
    ]
    assert quotas(doc(), Policy(), {})["quotas"] == []


@pytest.mark.parametrize(
    "v, shown",
    [(0.0002029370528231493, "0.0002029"), (123456.789, "1.235e+05"), (0.5, "0.5"), (3, "3"), (None, ""), ("adam", "adam"),
     (float("inf"), "inf"), (True, "True")],
)  # fmt: skip
def test_a_value_to_a_sensible_precision(v, shown):
    assert sig(v) == shown


def test_durations_in_words():
    assert [took(s) for s in (None, 45, 600, 7200, 3 * 86400)] == ["", "45 s", "10 min", "2.0 h", "3.0 d"]
