"""When a dev session is warned and ended (rules/devidle.py), as tables of rounds: an idle
session with nobody logged in, a busy GPU, a login, activity after a warning, its hours,
an extension, a late look, a gap in the rounds; and the round's sessions as the service
reads them (running_sessions)."""

from __future__ import annotations

import dataclasses

import pytest

from provision.core.devsession import DevTerms
from provision.host.protocol import ProbeReport
from provision.rules.devidle import Do, Kept, SessionNow, Why, decide, decide_all, running_sessions
from provision.rules.rounds import Round, host_seen
from provision.rules.tenancy import jobs_json

T0 = 1_800_000_000.0
IDLE, LEAD, HOURS = 3600, 600, 8 * 3600
UNIT = "provision-dev-ana-1a2b-nb-chief-0.service"


def session(utils=(0,), logins=(), until=T0 + HOURS, idle=IDLE) -> SessionNow:
    terms = DevTerms("nb", "ana@lab", T0, until, idle, 5, "root")
    return SessionNow("dev-ana-1a2b-nb", terms, "host-1", (UNIT,), tuple(utils), tuple(logins))


def rounds(start: float, end: float, every: float, s_at, kept: Kept | None = None):
    """decide() at each round from start to end, until it ends the session: [(t, act)],
    the last Kept."""
    acts = []
    t = start
    while t <= end:
        kept, act = decide(s_at(t), kept, t, LEAD)
        if act is not None:
            acts.append((t, act))
            if act.do is Do.END:
                break
        t += every
    return acts, kept


def test_an_idle_session_is_warned_ten_minutes_before_and_ended_at_its_idle_limit():
    acts, _ = rounds(T0, T0 + IDLE + 20, 10, lambda t: session())
    assert [(t - T0, a.do, a.why) for t, a in acts] == [(IDLE - LEAD, Do.WARN, Why.IDLE), (IDLE, Do.END, Why.IDLE)]
    warn, end = acts[0][1], acts[1][1]
    assert warn.at == T0 + IDLE and "ends at" in warn.words and "use a GPU or log in" in warn.words
    assert end.words.startswith("ended by the service: its GPUs below 5 % with nobody logged in for 60m")


@pytest.mark.parametrize(
    "kind",
    [
        {"utils": (0, 40)},  # one of its GPUs busy
        {"utils": (None,)},  # a GPU that says no number: nothing is known
        {"logins": ("ana@pts/3",)},  # someone logged in
        {"logins": ("ana@notty",)},  # an editor's connection
    ],
)
def test_a_busy_gpu_or_a_login_is_never_ended_for_idleness(kind):
    acts, _ = rounds(T0, T0 + 3 * IDLE, 10, lambda t: session(**kind))
    assert acts == []


def test_its_hours_end_it_logged_in_or_not_after_a_warning():
    until = T0 + 2 * 3600
    acts, _ = rounds(T0, until + 20, 10, lambda t: session(logins=("ana@pts/0",), until=until))
    assert [(t - T0, a.do, a.why) for t, a in acts] == [(7200 - LEAD, Do.WARN, Why.HOURS), (7200, Do.END, Why.HOURS)]
    assert "`provision dev --extend 2h nb` keeps it" in acts[0][1].words
    assert "its 2 h are up" in acts[1][1].words


def test_activity_after_the_warning_calls_it_off_and_a_later_end_is_warned_of_again():
    busy_at = T0 + IDLE - 300  # five minutes after the warning, the GPU works for a round

    def at(t):
        return session(utils=(80,) if t == busy_at else (0,))

    acts, _ = rounds(T0, busy_at + IDLE + 20, 10, at)
    assert [(t - T0, a.do) for t, a in acts] == [
        (IDLE - LEAD, Do.WARN),
        (busy_at - T0 + IDLE - LEAD, Do.WARN),  # the new end, warned of: a new key
        (busy_at - T0 + IDLE, Do.END),
    ]
    assert acts[0][1].at != acts[1][1].at


def test_an_extension_moves_the_end_and_its_warning():
    def at(t):
        return session(logins=("ana@pts/0",), until=T0 + 3600 if t < T0 + 3300 else T0 + 3 * 3600)

    acts, _ = rounds(T0, T0 + 3 * 3600 + 10, 10, at)
    assert [(t - T0, a.do) for t, a in acts] == [(3000, Do.WARN), (3 * 3600 - LEAD, Do.WARN), (3 * 3600, Do.END)]


def test_an_end_comes_no_sooner_than_its_warning_said():
    """A service that looks late (it was down) warns first, and ends `lead` later."""
    late = T0 + IDLE + 100
    acts, _ = rounds(late, late + LEAD + 10, 10, lambda t: session(), Kept(T0))
    assert [(t - late, a.do) for t, a in acts] == [(0, Do.WARN), (LEAD, Do.END)]
    assert acts[0][1].at == late + LEAD


def test_after_a_gap_in_the_rounds_the_idle_time_counts_from_the_round_after_it():
    s = session()
    kept, acts = decide_all([s], {s.job: Kept(T0)}, T0 + 2 * IDLE, LEAD, gap=True)
    assert acts == [] and kept[s.job].active_at == T0 + 2 * IDLE
    kept, acts = decide_all([s], {s.job: Kept(T0)}, T0 + 2 * IDLE, LEAD, gap=False)
    assert [a.do for a in acts] == [Do.WARN]


def test_what_is_kept_reads_back():
    for k in (Kept(T0), Kept(T0, Why.IDLE, T0 + 5, T0 + 600)):
        assert Kept.from_json(k.to_json()) == k
    assert Kept.from_json({"active_at": T0, "why": "later", "due": 1, "end_at": 2}) == Kept(T0)
    assert Kept.from_json("nonsense") is None


def _round(entry: dict, use: dict, logins: dict) -> Round:
    """A round of one host whose ledger has `entry` running, its GPUs' `use` and `logins`."""
    report = ProbeReport(
        ledger={entry["job"]: entry},
        ledger_units={UNIT: {"ActiveState": "active", "SubState": "running"}},
        logins=logins,
    )
    hs = host_seen("host-1", 2, report, T0, "team")
    doc = jobs_json([hs.view], T0)
    doc["hosts"]["host-1"]["gpu_use"] = use
    return Round(1, T0, {"host-1": hs}, doc)


def test_the_rounds_sessions_their_gpus_numbers_and_logins_bounded_as_read():
    terms = DevTerms("nb", "ana@lab", T0, T0 + HOURS, IDLE, 5, "root")
    entry = {
        "job": "dev-ana-1a2b-nb",
        "owner": {"lineage": "L", "who": "ana@lab", "host": "ws", "pid": 1, "state": "/s"},
        "since": T0,
        "updated": T0,
        "token": "t",
        "gpus": [0, 1],
        "ports": [2222],
        "units": [UNIT],
        "started": True,
        "preemptible": True,
        "dev": terms.to_json(),
    }
    use = {"0": {"utilization": 3}, "1": {"utilization": "lots"}}
    logins = {UNIT: ["ana@pts/1", "x; rm -rf /@pts/2", 7], "provision-x.service": "not a list"}
    (s,) = running_sessions(_round(entry, use, logins))
    assert (s.job, s.host, s.units, s.utils, s.logins) == (
        "dev-ana-1a2b-nb",
        "host-1",
        (UNIT,),
        (3, None),
        ("ana@pts/1",),
    )
    assert s.terms == terms and s.busy  # a GPU whose number is not one: busy
    plain = {k: v for k, v in entry.items() if k != "dev"}
    assert running_sessions(_round(plain, use, logins)) == []  # a job that is no dev session
    bad = {**entry, "dev": {**terms.to_json(), "idle_s": -5}}
    assert running_sessions(_round(bad, use, logins)) == []  # terms out of range: none
    r = _round(entry, use, logins)
    ended = ProbeReport(ledger={entry["job"]: entry}, ledger_units={UNIT: {"ActiveState": "inactive"}})
    hs = host_seen("host-1", 2, ended, T0, "team")
    assert running_sessions(dataclasses.replace(r, hosts={"host-1": hs})) == []  # ended: not the service's now
