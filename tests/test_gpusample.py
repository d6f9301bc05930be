"""The service's GPU samples (serve/gpusample.py, io/servicestore.py): a round from the
hosts' document, kept an hour in the database, the history and the idle list from them;
and the pages when the database is away (Bad input)."""

from __future__ import annotations

import copy
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from clirun import wait_until
from provision.core.errors import ProvisionError
from provision.io.servicehistory import GpuSample
from provision.io.servicestore import ServiceStore
from provision.rules.rounds import Round
from provision.run.survey import Inventories, KeptContexts
from provision.serve.gpusample import (
    HELD_EVERY,
    IDLE_WINDOW_ENV,
    LOOKING_S,
    QUIET_EVERY,
    SAMPLE_EVERY,
    GpuHistory,
    history_step,
    idle_json,
    idle_of,
    idle_window,
    round_every,
    samples_of,
)
from provision.serve.rounds import GpuRecorder, Rounds
from provision.serve.source import ServiceSource
from provision.web.app import make_app
from provision.web.auth import Auth

DOC: dict[str, Any] = {
    "hosts": {
        "gpu-1": {
            "gpus": 2,
            "held": {"bert": {"gpus": [1], "ports": []}},
            "gpu_use": {"0": {"utilization": 0, "memory_mib": 0}, "1": {"utilization": 87, "memory_mib": 40000}},
        },
        "gpu-2": {"gpus": 1, "error": "connection refused", "gpu_use": {"0": {"utilization": 5}}},
    },
    "jobs": [{"job": "bert", "owner": "ana@example.com", "state": "running"}],
}


def test_a_round_is_every_gpu_that_answered_with_its_holder() -> None:
    got = samples_of(DOC, 100.0)
    assert got == [
        GpuSample("gpu-1", 0, 100.0, 0, 0, None, None, None),
        GpuSample("gpu-1", 1, 100.0, 87, 40000, None, "bert", "ana@example.com"),
    ]
    history = GpuHistory(None, [], [])
    history.add(got, 0.0)
    history.add([GpuSample("gpu-1", 1, 110.0, None, None, None)], 0.0)  # no number: nothing to draw
    assert history.doc == {"gpu-1": {"0": [(100.0, 0.0)], "1": [(100.0, 87.0)]}}


def test_a_long_history_is_averaged_to_a_few_points_a_gpu() -> None:
    step = history_step(360, 1)  # an hour of rounds 10 s apart: 3 rounds a point
    history = GpuHistory(step, [], [])
    for k in range(360):
        history.add([GpuSample("gpu-1", 0, 10.0 * k, k % 2 * 10, 1, 2)], 0.0)
    (points,) = history.doc["gpu-1"].values()
    assert len(points) == 120 and points[0] == (10, 3.3) and points[-1] == (3580, 6.7)


def _s(t: float, util: int | None, job: str | None = "bert", gpu: int = 0) -> GpuSample:
    return GpuSample("gpu-1", gpu, t, util, 1, 2, job, "ana@example.com" if job else None)


def test_idle_is_the_current_holders_run_below_5_percent_for_the_window() -> None:
    samples = [
        _s(0, 1, job="old"),
        _s(10, 2),
        _s(20, 1),
        _s(30, 0),
        _s(0, 1, job=None, gpu=1),
        _s(10, 1, job=None, gpu=1),
    ]
    assert idle_json(samples, 30.0, 20.0) == [
        {"host": "gpu-1", "gpu": 0, "job": "bert", "owner": "ana@example.com", "idle_minutes": 0}
    ]
    # Its samples under "old" do not count for "bert": 20 s of bert's is not 30.
    assert idle_json(samples, 30.0, 30.0) == []
    assert idle_json([_s(0, 1), _s(600, 3), _s(700, 50)], 700.0, 600.0) == []  # busy again


def test_the_idle_window_is_a_test_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_WINDOW_ENV, raising=False)
    assert idle_window() == 600.0
    monkeypatch.setenv(IDLE_WINDOW_ENV, "15")
    assert idle_window() == 15.0
    monkeypatch.setenv(IDLE_WINDOW_ENV, "soon")
    assert idle_window() == 600.0


def test_the_store_keeps_an_hour(tmp_path: Path) -> None:
    store = ServiceStore.open_local(tmp_path / "s.sqlite")
    store.add_gpu_samples([_s(1000.0, 3), _s(1000.0, 4, gpu=1)])
    store.add_gpu_samples([_s(4000.0, 5)])
    assert [(s.t, s.gpu) for s in store.gpu_samples(0)] == [(1000.0, 0), (4000.0, 0), (1000.0, 1)]
    store.add_gpu_samples([_s(4601.0, 6)])  # an hour after the first round: it goes
    assert [(s.t, s.util) for s in store.gpu_samples(0)] == [(4000.0, 5), (4601.0, 6)]
    assert store.gpu_samples(4500.0)[0] == _s(4601.0, 6)
    store.add_gpu_samples([])
    store.close()


def test_a_point_per_round_until_a_gpu_has_its_points_then_wider_points() -> None:
    # A fresh service draws a point per round at once (the browser test: 3 points within a minute).
    assert history_step(1, 16) is None and history_step(120, 16) is None
    assert history_step(121, 16) == 2 * SAMPLE_EVERY  # an hour at a round every 10 s: 360 samples
    assert history_step(360, 16) == 3 * SAMPLE_EVERY  # ... 120 points
    # A large cluster: fewer points a GPU (HISTORY_BUDGET in all), 12 at least.
    assert history_step(32, 1000) is None and history_step(33, 1000) == 2 * SAMPLE_EVERY
    assert history_step(12, 8000) is None and history_step(360, 8000) == 30 * SAMPLE_EVERY
    for gpus in (1, 16, 1000, 8000):
        for n in range(1, 400):
            step = history_step(n, gpus)
            most = max(12, min(120, 32_000 // gpus))
            # n rounds SAMPLE_EVERY apart (at most an hour's) in slots of `step`: a point per
            # slot, at most one more than the points a GPU gets.
            times = [1_000_003.7 + SAMPLE_EVERY * k for k in range(min(n, 361))]
            points = len(times) if step is None else len({t // step for t in times})
            assert points <= most + 1, (n, gpus)
    assert history_step(361, 16) == history_step(360, 16)  # an hour's round more now and then: the same points


def test_the_kept_history_adds_each_round_to_its_last_point_and_drops_the_hour_gone() -> None:
    rows = [("h", 0, 0.0, 10.4, 50.0, 2), ("h", 0, 1.0, 40.0, 7.26, 1)]  # slots of 30 s
    h = GpuHistory(30.0, rows, [0.0, 20.0, 40.0])
    assert h.doc == {"h": {"0": [(10, 50.0), (40, 7.3)]}}
    before = h.doc["h"]["0"]
    assert h.rounds_after(0.0) == 4
    h.add([GpuSample("h", 0, 50.0, 10, 1, 2), GpuSample("gpu-1", 1, 50.0, 99, 1, 2)], 0.0)
    assert h.doc == {"h": {"0": [(10, 50.0), (45, 8.6)]}, "gpu-1": {"1": [(50, 99.0)]}}
    assert before == [(10, 50.0), (40, 7.3)]  # what a page holds is not changed under it
    h.add([_s(65.0, 20, gpu=1)], 30.0)  # the slot [0, 30) has ended an hour ago
    assert h.doc == {"h": {"0": [(45, 8.6)]}, "gpu-1": {"1": [(50, 99.0), (65, 20.0)]}}
    assert h.rounds == [40.0, 50.0, 65.0]
    each = GpuHistory(None, [("h", 0, 5.0, 5.0, 1.0, 1)], [5.0])  # a point per round
    each.add([GpuSample("h", 0, 15.0, 2, 1, 2)], 6.0)
    assert each.doc == {"h": {"0": [(15, 2.0)]}}


def test_gpus_of_equal_points_share_them_and_their_json_is_as_before() -> None:
    h = GpuHistory(None, [("a", 0, 5.0, 5.0, 50.0, 1), ("b", 0, 5.0, 5.0, 50.0, 1)], [5.0])
    assert h.doc["a"]["0"][0] is h.doc["b"]["0"][0]  # one tuple for both
    h.add([GpuSample("a", 0, 15.0, 50, 1, 2), GpuSample("b", 0, 15.0, 50, 1, 2), GpuSample("c", 0, 15.0, 7, 1, 2)], 0.0)
    assert h.doc["a"]["0"][1] is h.doc["b"]["0"][1] and h.doc["a"]["0"][1] is not h.doc["c"]["0"][0]
    # a sample's whole number and an average's float are not merged (the JSON says each as it did)
    assert [type(p[1]) for p in h.doc["a"]["0"]] == [float, int] and h.doc["a"]["0"][0] == (5, 50.0)
    h.add([GpuSample("a", 0, 3700.0, 1, 1, 2)], 3600.0)  # the hour past the first points: they go
    assert h.doc == {"a": {"0": [(3700, 1)]}}
    assert h.doc["a"]["0"][0] is h._shared(3700.0, 1)


def test_each_round_makes_the_history_a_point_per_round(tmp_path: Path) -> None:
    store = ServiceStore.open_local(tmp_path / "s.sqlite")
    docs = []
    for util in (10, 20, 30):
        got = copy.deepcopy(DOC)
        got["hosts"]["gpu-1"]["gpu_use"]["0"]["utilization"] = util
        docs.append(got)
    rounds, gpus = _rounds(store, docs)
    src = ServiceSource(store, tmp_path / "work", rounds=rounds, gpus=gpus)
    for k in range(3):
        rounds.round()
        got = src.hosts()["hosts"]["gpu-1"]["gpu_history"]["0"]
        assert [u for _, u in got] == [10.0, 20.0, 30.0][: k + 1]  # this round's point is in at once
    store.close()


def _rounds(store: ServiceStore, docs: Any, subscribers: Any = None) -> tuple[Rounds, GpuRecorder]:
    """Rounds over stand-in surveys (each call: the next of `docs`), with a GPU recorder."""
    gpus = GpuRecorder(store)
    it = iter(docs)

    def look(found: Any, contexts: Any, n: int) -> Round:
        return Round(n, time.time(), {}, next(it))

    lead = threading.Event()
    lead.set()
    r = Rounds(dict, None, [gpus] if subscribers is None else subscribers, lead, print, look=look)  # type: ignore[arg-type]
    return r, gpus


def _round(store: ServiceStore, t: float, utils: list[int | None], job: str | None = "bert") -> None:
    store.add_gpu_samples([_s(t, u, job=job, gpu=g) for g, u in enumerate(utils)])


def _check_the_database_averages_and_picks_idle_candidates(store: ServiceStore, t0: float) -> None:
    for k in range(6):  # GPU 0 busy, GPU 1 idle, GPU 2 idle but free, GPU 3 idle until the last round
        _round(store, t0 + 10 * k, [80 + k, 1, 0, 1 if k < 5 else 50])
    store.add_gpu_samples([_s(t0 + 55, 0, job=None, gpu=2)])  # its latest: no job holds it
    assert len(store.gpu_round_times(t0)) == 7  # GPU 2, sampled last: 6 rounds and 1
    assert store.gpu_round_times(t0 + 45) == [t0 + 50, t0 + 55]
    each = store.gpu_history(t0, None)  # a point per sample: a round's
    assert [round(u) for _, g, _, _, u, _ in each if g == 0] == [80, 81, 82, 83, 84, 85]
    got = store.gpu_history(t0, 30.0)
    # Slots [3000, 3030) and [3030, 3060): 100 and 101 of 30 s.
    assert [(g, s, round(u, 1), n) for _, g, s, _, u, n in got if g == 0] == [(0, 100.0, 81.0, 3), (0, 101.0, 84.0, 3)]
    assert {g for _, g, _, _, _, _ in got} == {0, 1, 2, 3}
    assert store.gpu_idle_runs(t0, 5, t0) == [("gpu-1", 1, "bert", "ana@example.com", t0)]
    # Only a latest sample of the last rounds counts: a GPU not sampled since is on a host
    # that did not answer, not idle now.
    assert [r[1] for r in store.gpu_idle_runs(t0, 5, latest_after=t0 + 45)] == [1]
    assert store.gpu_idle_runs(t0, 5, latest_after=t0 + 51) == []
    assert len(store.gpu_samples(t0)) == 25
    # The database's runs are idle_json's rule: another holder's samples are not the job's, a
    # sample at or above 5 % or without a number ends a run.
    t1 = t0 + 100
    for k, (u4, job4, u5) in enumerate(
        [(1, "old", 1), (50, "bert", None), (1, "bert", 2), (2, None, 3), (1, "bert", 1)]
    ):
        store.add_gpu_samples([_s(t1 + 10 * k, u4, job=job4, gpu=4), _s(t1 + 10 * k, u5, gpu=5)])
    for now, window in [(t1 + 40, 10.0), (t1 + 40, 20.0), (t1 + 40, 30.0), (t1 + 45, 30.0)]:
        want = idle_json(store.gpu_samples(t1), now, window)
        assert idle_of(store.gpu_idle_runs(t1, 5, t1 + 35), now, window) == want, (now, window)
    assert [i["gpu"] for i in idle_json(store.gpu_samples(t1), t1 + 40, 10.0)] == [4, 5]


def test_the_database_averages_the_history_and_picks_the_idle_candidates(tmp_path: Path) -> None:
    store = ServiceStore.open_local(tmp_path / "s.sqlite")
    _check_the_database_averages_and_picks_idle_candidates(store, 3000.0)
    store.close()


def test_postgresql_averages_the_history_and_picks_the_idle_candidates(postgres, monkeypatch) -> None:
    for k, v in postgres.env().items():
        monkeypatch.setenv(k, v)
    store = ServiceStore.open_pg(postgres.url(), "the team's database")
    store._do("DELETE FROM provision_service_gpu_samples")
    _check_the_database_averages_and_picks_idle_candidates(store, 3000.0)
    store.close()


class FlakyStore(ServiceStore):
    """The embedded store, with its database made to go away and come back."""

    down = False

    def _all(self, sql: str, args: Any = ()) -> list[Any]:
        if self.down:
            raise ProvisionError("postgresql://db:5432/team: the service's database: connection refused")
        return super()._all(sql, args)


@pytest.fixture
def flaky(tmp_path: Path) -> FlakyStore:
    s = ServiceStore.open_local(tmp_path / "s.sqlite")
    s.__class__ = FlakyStore
    return s  # type: ignore[return-value]


def test_the_database_down_is_a_page_that_says_so_and_pages_come_back(flaky: FlakyStore, tmp_path: Path) -> None:
    src = ServiceSource(flaky, tmp_path / "work")
    client = TestClient(
        make_app(src, auth=Auth.loopback()), client=("127.0.0.1", 5000), base_url="http://127.0.0.1:8470"
    )
    assert client.get("/usage").status_code == 200
    flaky.down = True
    for path in ("/", "/usage", "/jobs", "/jobs/bert"):
        r = client.get(path)
        assert r.status_code == 503 and "out of reach" in r.text and "connection refused" in r.text, (path, r.text)
    r = client.get("/api/v1/usage")
    assert r.status_code == 503 and "connection refused" in r.json()["error"]
    flaky.down = False
    assert client.get("/usage").status_code == 200 and client.get("/").status_code == 200


def test_token_pages_with_the_database_down_say_so(flaky: FlakyStore, tmp_path: Path) -> None:
    _, token = flaky.create_token("ana@example.com", False)
    client = TestClient(
        make_app(ServiceSource(flaky, tmp_path / "work"), auth=Auth.token(flaky)), base_url="http://127.0.0.1:8470"
    )
    flaky.down = True
    r = client.get("/usage", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 503 and "connection refused" in r.text
    flaky.down = False
    assert client.get("/usage", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_a_round_says_a_failing_subscriber_once_and_goes_on(tmp_path: Path) -> None:
    said: list[str] = []
    calls = iter([ProvisionError("db away"), ProvisionError("db away"), None])
    seen: list[int] = []

    class Flaky:
        name = "GPU samples"

        def on_round(self, r: Round) -> None:
            got = next(calls)
            if got is not None:
                raise got

    class Other:
        name = "events"

        def on_round(self, r: Round) -> None:
            seen.append(r.number)

    rounds, _ = _rounds(ServiceStore.open_local(tmp_path / "s.sqlite"), [DOC] * 3, [Flaky(), Other()])
    rounds.say = said.append
    for _ in range(3):
        assert rounds.round() is not None
    assert said == ["GPU samples: not stored this round: db away", "GPU samples: stored again"]
    assert seen == [1, 2, 3]  # the others had every round


def test_postgresql_stopped_and_started_again_the_pages_say_so_then_work(postgres, monkeypatch, tmp_path: Path) -> None:
    """on a real server: the service's database stopped, every page says
    so (503) without the service restarting; started again, the next request is answered."""
    for k, v in postgres.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "2")
    store = ServiceStore.open_pg(postgres.url(), "the team's database")
    store.add_gpu_samples([_s(store.now(), 1)])
    client = TestClient(
        make_app(ServiceSource(store, tmp_path / "work"), auth=Auth.loopback()),
        client=("127.0.0.1", 1),
        base_url="http://127.0.0.1:8470",
    )
    assert client.get("/usage").status_code == 200
    postgres.stop()
    try:
        for path in ("/usage", "/"):
            r = client.get(path)
            assert r.status_code == 503 and "out of reach" in r.text, (path, r.text)
    finally:
        postgres.start()
    assert client.get("/usage").status_code == 200 and client.get("/").status_code == 200
    assert store.gpu_samples(0)
    store.close()


def test_metrics_gpu_gauges_come_from_the_latest_round(tmp_path: Path) -> None:
    store = ServiceStore.open_local(tmp_path / "s.sqlite")
    rounds, gpus = _rounds(store, [DOC])
    rounds.round()  # what the last round saw
    src = ServiceSource(store, tmp_path / "work", rounds=rounds, gpus=gpus)
    text = (
        TestClient(make_app(src, auth=Auth.loopback()), client=("127.0.0.1", 1), base_url="http://127.0.0.1:8470")
        .get("/metrics")
        .text
    )
    assert 'provision_gpu_utilization_percent{host="gpu-1",gpu="1",job="bert",owner="ana@example.com"} 87' in text
    assert 'provision_gpu_memory_used_mib{host="gpu-1",gpu="0"} 0' in text
    assert 'provision_host_up{host="gpu-2"} 0' in text


@pytest.mark.parametrize(
    ("looked_ago", "busy", "held", "every"),
    [
        (5.0, False, False, SAMPLE_EVERY),  # a page read the samples just now
        (LOOKING_S - 1, False, False, SAMPLE_EVERY),
        (LOOKING_S + 1, False, False, QUIET_EVERY),  # nobody looks, nothing changes
        (math.inf, True, False, SAMPLE_EVERY),  # a job ending, preempted or new to the watch
        (5.0, False, True, HELD_EVERY),  # ... and a job holds a GPU: an Xid told within 10 s
        (math.inf, True, True, HELD_EVERY),
        (LOOKING_S + 1, False, True, QUIET_EVERY),  # held, but nobody looks and nothing changes
    ],
)
def test_rounds_come_every_10_s_while_looked_at_or_changing_else_every_minute(
    looked_ago: float, busy: bool, held: bool, every: float
) -> None:
    assert round_every(looked_ago, busy, held) == every
    assert HELD_EVERY < SAMPLE_EVERY and 10.0 - HELD_EVERY >= 4.0  # the round's own time fits beside the wait


def test_a_round_that_saw_a_gpu_held_brings_the_held_pace(tmp_path: Path) -> None:
    from provision.rules.rounds import HostSeen
    from provision.rules.tenancy import Hold, Holder, HostView

    store = ServiceStore.open_local(tmp_path / "s.sqlite")
    held = HostView("gpu-1", 2, (Holder("gpu-1", "bert", None, (1,), (), 1.0, Hold.RUNNING, "t"),))
    free = HostView("gpu-1", 2)
    rounds, _ = _rounds(store, [DOC, DOC], [])
    looks = iter([{"gpu-1": HostSeen(held)}, {"gpu-1": HostSeen(free)}])
    rounds.survey = lambda found, contexts, n: Round(n, time.time(), next(looks), DOC)
    rounds.look()  # a page reads
    rounds.round()
    assert rounds.every() == HELD_EVERY
    rounds.round()
    assert rounds.every() == SAMPLE_EVERY


def test_the_rounds_ask_their_period_again_every_second(tmp_path: Path) -> None:
    """A quiet minute's wait ends when a page comes: the next round within a second."""
    stamps: list[float] = []
    period = [QUIET_EVERY]

    class Stamp:
        name = "stamps"

        def on_round(self, r: Round) -> None:
            stamps.append(time.monotonic())

    rounds, _ = _rounds(ServiceStore.open_local(tmp_path / "s.sqlite"), [DOC] * 100, [Stamp()])
    rounds.every = lambda: period[0]  # type: ignore[method-assign]
    rounds.contexts = KeptContexts(Inventories())
    rounds.start()
    try:
        wait_until(lambda: len(stamps) == 1, timeout=5, every=0.02, what="the first round at once")
        time.sleep(1.2)
        assert len(stamps) == 1  # the next one is a minute away
        period[0] = 0.1
        asked = time.monotonic()
        wait_until(lambda: len(stamps) >= 3, timeout=5, every=0.02, what="rounds at the short period")
        assert stamps[1] - asked <= 1.1, stamps
    finally:
        rounds.stop()


def test_the_service_samples_fast_while_a_page_reads_or_a_job_changes(tmp_path: Path) -> None:
    store = ServiceStore.open_local(tmp_path / "s.sqlite")
    preempted = {**DOC, "jobs": [{"job": "bert", "owner": "ana@example.com", "state": "preempted"}]}
    rounds, gpus = _rounds(store, [DOC, preempted])
    src = ServiceSource(store, tmp_path / "work", rounds=rounds, gpus=gpus)
    assert rounds.every() == QUIET_EVERY  # nobody looked yet, no round
    ServiceSource.usage(src)  # a page reads
    assert rounds.every() == SAMPLE_EVERY
    rounds.looked -= LOOKING_S + 1
    assert rounds.every() == QUIET_EVERY
    rounds.round()
    assert rounds.every() == QUIET_EVERY  # running as applied
    rounds.round()
    assert rounds.every() == SAMPLE_EVERY  # a job not simply running


def test_a_round_answers_the_pages_without_a_probe_of_their_own(tmp_path: Path) -> None:
    """At 1,000 hosts, the pages looking every 2-4 s beside the rounds were the p95."""
    store = ServiceStore.open_local(tmp_path / "s.sqlite")
    rounds, gpus = _rounds(store, [DOC])
    src = ServiceSource(store, tmp_path / "work", rounds=rounds, gpus=gpus)
    looks: list[str] = []
    src.inventory.hosts = lambda: looks.append("page") or DOC  # type: ignore[method-assign]
    src.hosts()
    assert looks == ["page"]  # no round yet: the page looks itself
    rounds.round()
    assert src.hosts()["jobs"] == DOC["jobs"] and src.latest() == DOC
    assert looks == ["page"]  # ... and not while a round is recent


def test_a_round_gives_the_freed_heap_back_where_it_can() -> None:
    from provision.serve.gpusample import give_back_memory

    give_back_memory()  # glibc's malloc_trim here; elsewhere nothing
