"""What the dashboard keeps between requests: a job's status answered from
one probe for a second or two (web/recent.py), a study's document made again only when its
trials changed (InventorySource over io/studyread.py), and what the app makes of a document
(the study page's charts and table, the API's JSON) kept while the document is the same."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from clirun import wait_until
from provision.core.trialend import Ended, Ending
from provision.inventory.inventory import load
from provision.io import studyread
from provision.io.study import Runner, open_study
from provision.run.tune import study_storage
from provision.web import charts
from provision.web.app import make_app
from provision.web.auth import CSRF_COOKIE, Auth
from provision.web.inventories import InventorySource
from provision.web.recent import Recent
from provision.web.views import TRIALS_PAGE
from test_study_loop import INV as SWEEP  # the study loop's one-host sweep
from test_web import HERE, FakeSource, _study_doc

# ------------------------------------------------------------------ Recent


def test_recent_answers_from_one_ask_then_asks_behind_then_asks() -> None:
    asked: list[int] = []

    def ask() -> int:
        asked.append(len(asked) + 1)
        return len(asked)

    r: Recent[int] = Recent(fresh=0.5, stale=2.0)
    assert r.get("j", ask) == 1 and r.get("j", ask) == 1 and asked == [1]  # fresh: one ask
    time.sleep(0.8)  # past fresh, before stale: the old answer now, a new one asked behind it
    assert r.get("j", ask) == 1
    wait_until(lambda: r.get("j", ask) == 2, timeout=5, every=0.01)
    assert asked == [1, 2]
    time.sleep(2.2)  # past stale: the request asks itself
    assert r.get("j", ask) == 3
    r.forget("j")
    assert r.get("j", ask) == 4


def test_recent_one_ask_for_requests_at_once() -> None:
    calls: list[float] = []

    def slow() -> str:
        calls.append(time.monotonic())
        time.sleep(0.3)
        return "status"

    r: Recent[str] = Recent(fresh=1.0, stale=2.0)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(r.get("j", slow))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["status"] * 5 and len(calls) == 1


def test_recent_an_error_is_the_askers() -> None:
    def broken() -> int:
        raise RuntimeError("hosts away")

    r: Recent[int] = Recent(fresh=1.0, stale=2.0)
    with pytest.raises(RuntimeError):
        r.get("j", broken)
    assert r.get("j", lambda: 5) == 5


def test_recent_last_never_waits_once_it_has_an_answer() -> None:
    asked: list[float] = []
    gate = threading.Event()

    def ask() -> int:
        asked.append(time.monotonic())
        if len(asked) > 1:
            gate.wait(5)  # a slow probe: nobody waits for it
        return len(asked)

    r: Recent[int] = Recent(fresh=0.1, stale=0.2)
    assert r.last("h", ask) == 1  # none yet: asked
    time.sleep(0.3)  # past stale: get() would wait; last() answers and asks behind
    t = time.monotonic()
    assert r.last("h", ask) == 1 and r.last("h", ask) == 1 and time.monotonic() - t < 0.5
    gate.set()
    wait_until(lambda: r.last("h", ask) == 2, timeout=5, every=0.01)
    assert len(asked) == 2


# ------------------------------------------------------------------ the app keeps what it made


class SameDoc(FakeSource):
    """A source that gives the same study document until it changes (as InventorySource)."""

    def __init__(self) -> None:
        super().__init__()
        self.doc = _study_doc()

    def study(self, name: str) -> dict[str, Any]:
        super().study(name)  # its NotFound
        return self.doc


def test_a_study_page_is_made_once_per_document(monkeypatch: pytest.MonkeyPatch) -> None:
    src = SameDoc()
    drawn: list[int] = []
    real = charts.objective_svg
    monkeypatch.setattr(charts, "objective_svg", lambda s, shown=None: drawn.append(1) or real(s, shown))
    client = TestClient(make_app(src, auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    pages = [client.get("/studies/s") for _ in range(3)]
    assert all(p.status_code == 200 for p in pages) and len(drawn) == 1
    assert pages[0].text == pages[2].text and 'class="pruned"' in pages[0].text
    # Promote: each row's button submits the page's one form, with this session's CSRF token.
    assert '<form id="promote"' in pages[0].text and 'form="promote" name="trial" value="2"' in pages[0].text
    token = client.cookies.get(CSRF_COOKIE)
    assert f'value="{token}"' in pages[0].text
    assert client.post("/studies/s/promote", data={"csrf": token, "trial": "2"}).status_code == 200
    first = client.get("/api/v1/studies/s").json()
    assert first == client.get("/api/v1/studies/s").json() and len(first["trials"]) == 4
    src.doc = _study_doc()  # the study changed: a new document
    src.doc["trials"] = src.doc["trials"][:2]
    assert client.get("/studies/s").status_code == 200 and len(drawn) == 2
    assert len(client.get("/api/v1/studies/s").json()["trials"]) == 2


def test_a_big_study_page_is_thin_and_paged() -> None:
    """10,000 trials: the charts draw charts.CHART_TRIALS of them and say so; the table
    shows a page of views.TRIALS_PAGE rows, sorted over all of them on the server."""
    src = SameDoc()
    one = src.doc["trials"][0]
    src.doc["trials"] = [
        {
            **one,
            "number": n,
            "job": f"s-t{n}",
            "value": 1.0 + (n * 7919 % 10_000) / 1000,
            "params": {"lr": 1e-3, "opt": "adam"},
        }
        for n in range(1, 10_001)
    ]
    client = TestClient(make_app(src, auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    page = client.get("/studies/s")
    assert page.status_code == 200 and len(page.content) < 2_000_000
    assert f"The charts show {charts.CHART_TRIALS} of 10000 trials" in page.text
    assert page.text.count("<tr class=") == TRIALS_PAGE and 'data-trial="100"' in page.text
    assert "page 1 of 100" in page.text and "sort=number&amp;order=asc&amp;page=100" in page.text
    best = client.get("/studies/s?sort=value&order=asc&page=1").text
    low = min(src.doc["trials"], key=lambda t: t["value"])["number"]
    assert f'data-trial="{low}"' in best
    last = client.get("/studies/s?sort=number&order=asc&page=100").text
    assert 'data-trial="10000"' in last and 'data-trial="1"' not in last
    assert client.get("/studies/s?sort=bogus").status_code == 400


# ------------------------------------------------------------------ InventorySource's study and job

INV = (
    SWEEP
    + """\
tune:
  metric: {name: loss, goal: minimize}
  parameters:
    lr: {type: double, min: 0.00001, max: 0.1, scale: log}
  algorithm: random
  max_trials: 20
"""
)


def _trial(study: Any, value: float) -> None:
    a = study.ask(20)
    study.claim(a.number, Runner("here", 1, "x"), f"sweep-t{a.number}")
    study.tell(a.number, Ended(Ending.SUCCEEDED, "", value, 3))


def test_a_study_is_read_again_only_when_it_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROVISION_STATE", raising=False)
    monkeypatch.setattr(studyread, "FRESH", 0.0)
    path = tmp_path / "sweep.yaml"
    path.write_text(INV)
    inv = load(path)
    assert inv.tune is not None
    url, journal, _ = study_storage(str(path), inv)
    assert url is None
    src = InventorySource([path])
    assert src.study("sweep")["trials"] == []  # not started: no trials
    study = open_study(inv.tune, "sweep", url, journal, seed=1)
    _trial(study, 0.5)
    doc = src.study("sweep")
    assert [t["number"] for t in doc["trials"]] == [1] and doc["counts"]["succeeded"] == 1
    assert src.study("sweep") is doc  # unchanged: the same document, nothing made again
    (reader,) = src._readers.values()
    reads = reader.reads
    assert src.study("sweep") is doc and reader.reads == reads
    _trial(study, 0.25)
    doc2 = src.study("sweep")
    assert doc2 is not doc and [t["number"] for t in doc2["trials"]] == [1, 2]
    assert doc2["best"]["number"] == 2
    app = TestClient(make_app(src, auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    metrics = app.get("/metrics").text
    assert 'provision_trials{study="sweep",state="succeeded"} 2' in metrics
    src.close()


def test_a_jobs_status_is_asked_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    src = InventorySource([])
    probes: list[str] = []
    monkeypatch.setattr(src, "_job", lambda name: probes.append(name) or {"job": name, "n": len(probes)})
    assert src.job("bert") == {"job": "bert", "n": 1}
    assert src.job("bert") == {"job": "bert", "n": 1} and probes == ["bert"]
    src._jobs.forget("bert")  # as stop and rerun do
    assert src.job("bert")["n"] == 2


def test_the_log_keepers_read_is_bounded_per_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper's tail asks each host for at most KEEP_READ_LIMIT bytes; a job whose every
    host refused (sent more) is an error the keeper says, not an empty copy kept."""
    from contextlib import contextmanager

    from provision.core.errors import ProvisionError
    from provision.web import inventories

    path = tmp_path / "sweep.yaml"
    path.write_text(INV)
    src = InventorySource([path])
    asked: list[int | None] = []
    answer: tuple[list[Any], dict[str, Any], list[str]] = ([], {}, [])

    def fake_entries(ctx: Any, *, tail: int | None, cursors: Any, limit: int | None = None) -> Any:
        asked.append(limit)
        return answer

    monkeypatch.setattr(inventories, "log_entries", fake_entries)
    monkeypatch.setattr(InventorySource, "_ctx", contextmanager(lambda self, *a, **k: iter([None])))
    assert src.tail("sweep", 20_000) == [] and asked == [inventories.KEEP_READ_LIMIT]
    answer = ([], {}, ["host-1: sent more than 67108864 bytes in answer to one command: refused"])
    with pytest.raises(ProvisionError, match="sent more than 67108864 bytes"):
        src.tail("sweep", 20_000)
    src.close()
