"""The dashboard remembers (serve/source.py over a real service database, SQLite here): a
team's week on the service, after its study and its jobs ended. Each test names the problem
a new user met on the page before: a study's page a 404 once its last trial was told, the
Finished section "None.", "No hosts." with nothing running, every trial's link a 404, no
history, no quotas, a preempted job "ended" with too few GPUs, a queued one with 0, empty
GPU-hours and Ended columns, a rerun's "Since" from its first run, a value printed with 16
digits, a discrete axis from 7.45 to 8.55, cancelled trials "stopped early".

The hosts are a stand-in survey (the rounds' `look`): a round of the hosts every inventory the
service knows names, as run/survey.survey would make it, without SSH."""

from __future__ import annotations

import re
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest
from starlette.testclient import TestClient

from provision.core.events import Event, How, Kind
from provision.core.submission import Kind as SubKind
from provision.core.submission import Status
from provision.core.trialend import Ended, Ending
from provision.inventory.inventory import load
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore, Submission
from provision.io.study import Runner, open_study
from provision.rules.jobsdoc import JobsDoc
from provision.rules.priority import Policy
from provision.rules.rounds import HostSeen, Round
from provision.rules.tenancy import HostView, jobs_json
from provision.run.survey import demand_of
from provision.serve.hostsfile import HOSTS_JOB, HostsFile
from provision.serve.rounds import Rounds
from provision.serve.source import Known, ServiceSource
from provision.web.app import make_app
from provision.web.auth import Auth

HERE = ("127.0.0.1", 50000)
STUDY = "walk5-lr"
LR = 0.0002029370528231493
NOW = time.time()
STUDY_YAML = f"""\
job: {STUDY}
ssh: {{user: root}}
hosts:
  - {{name: gpu-1, address: 192.0.2.11, accelerators: {{type: nvidia-h100, count: 8}}}}
pools:
  chief: {{replicas: 1, accelerators: 4, command: [/usr/bin/python3, /opt/train.py]}}
tune:
  metric: {{name: loss, goal: minimize}}
  parameters:
    lr: {{type: double, min: 0.00001, max: 0.1, scale: log}}
    batch: {{type: discrete, values: [8, 16]}}
  max_trials: 6
"""
HOSTS_YAML = """\
ssh: {user: root}
hosts:
  - {name: gpu-9, address: 192.0.2.19, accelerators: {type: nvidia-h100, count: 2}}
"""
ANA, BOB = "ana@example.com", "bob@example.com"


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _host(state: str, gpus: list[int]) -> dict[str, object]:
    return {"state": state, "gpus": gpus, "ports": [], "preempted_by": "gpt" if state == "preempted" else None}


def _job(name: str, owner: str, state: str, hosts: dict[str, dict[str, object]], **more: object) -> dict[str, object]:
    return {
        "job": name, "owner": owner, "lineage": "L-" + name, "state": state, "since": _iso(NOW - 5 * 86400),
        "age_seconds": 5 * 86400, "queued": None, "priority": "normal", "priority_level": 500, "preemptible": True,
        "submitted": None, "hosts": hosts, **more,
    }  # fmt: skip


def stand_in(found, contexts, number: int) -> Round:  # noqa: ANN001  the rounds' `look`
    """A round of every host the known inventories name (their GPUs free but those the jobs
    below hold), and the jobs the hosts' ledgers hold: a preempted one (the ledgers: "ended",
    8 GPUs left of its 12), a queued one (none), a rerun one (run 2 started an hour ago)."""
    names = {h.name: h.accelerator_count for _, inv in found.values() for h in inv.hosts}
    names.setdefault("gpu-2", 8)
    held = {"gpu-2": {"rerun-job": list(range(8))}}
    doc: JobsDoc = jobs_json([HostView(n, g) for n, g in sorted(names.items())], NOW)
    for name, h in doc["hosts"].items():
        h["held"] = {j: {"gpus": g, "ports": []} for j, g in held.get(name, {}).items()}
        h["free_gpus"] = [] if name in ("gpu-1", "gpu-2") else list(range(names[name]))  # gpu-1's wait for gpt
        h["labels"], h["drain"] = {"rack": "r1"}, False
    doc["jobs"] = [
        _job("bert", BOB, "ended", {"gpu-1": _host("preempted", list(range(8)))}),
        _job("gpt", BOB, "queued", {"gpu-1": _host("queued", [])}, queued={"since": _iso(NOW - 600), "waiting_for": "8 GPUs"}),
        _job("rerun-job", BOB, "running", {"gpu-2": _host("running", list(range(8)))}),
    ]  # fmt: skip
    hosts = {n: HostSeen(HostView(n, g)) for n, g in names.items()}
    runs = [{"run": 1, "at": NOW - 5 * 86400, "by": BOB}, {"run": 2, "at": NOW - 3600, "by": BOB}]
    hosts["gpu-2"] = HostSeen(HostView("gpu-2", 8), records={"rerun-job": {"runs": runs}})
    demand = {j: demand_of(inv) for j, (_, inv) in found.items()}
    demand["bert"] = ((4, frozenset({"gpu-1"})),) * 3
    demand["gpt"] = ((4, frozenset({"gpu-1"})),) * 2
    seen.append(set(found))
    policy = Policy(guarantees=((ANA, 8),))
    return Round(number, time.time(), hosts, doc, demand=demand, policy=policy)


seen: list[set[str]] = []


def _study(journal: Path, inv_path: Path, work: Path) -> None:
    """The study's trials, as its runner left them: four succeeded (with their reports),
    one stopped early, one cancelled; trial 1's lines kept beside it."""
    inv = load(inv_path)
    assert inv.tune is not None
    st = open_study(inv.tune, STUDY, None, journal, seed=1)
    me = Runner("here", 1, "x")
    plan = [
        (Ending.SUCCEEDED, 0.9, ""),
        (Ending.SUCCEEDED, 0.4, ""),
        (Ending.STOPPED_EARLY, 1.5, "median rule at step 3"),
        (Ending.STOPPED_EARLY, 1.2, "cancelled by ana@example.com"),
        (Ending.SUCCEEDED, 0.3, ""),
        (Ending.SUCCEEDED, 0.7, ""),
    ]
    for ending, value, why in plan:
        a = st.ask(inv.tune.max_trials)
        assert a is not None
        st.claim(a.number, me, f"{STUDY}-t{a.number}", phase="running")
        for step in (1, 2, 3) if ending is Ending.STOPPED_EARLY else (1, 2, 3, 4, 5):
            st.report(a.number, value + 1.0 / step, step)
        st.tell(a.number, Ended(ending, why, value, 5))
    st.mark_ended("max_trials reached")
    kept = journal.parent / "trial-1"
    kept.mkdir(parents=True)
    (kept / "chief-0.log").write_text("2026-11-27T10:00:00.000000Z gpu-1 epoch 1 loss 1.9\n")


@pytest.fixture
def svc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PROVISION_OWNER", ANA)
    store = ServiceStore.open_local(tmp_path / "service.sqlite")
    work = tmp_path / "work"
    sid = "20261127-100000-abcdef"
    snap = work / sid
    snap.mkdir(parents=True)
    (snap / "study.yaml").write_text(STUDY_YAML)
    _study(snap / ".provision" / f"{STUDY}.tune" / "study.journal", snap / "study.yaml", work)
    sub = Submission(sid, SubKind.TUNE, STUDY, ANA, "local", "", "study.yaml", {})
    store.submit(sub)
    assert store.claim(sid, "svc") and store.finish(sid, Status.DONE, "max_trials reached")
    for n in range(1, 6):
        store.record(
            HistoryRow(
                "trial",
                f"{STUDY}-t{n}",
                ANA,
                NOW - 7200 + 600 * n,
                NOW - 7000 + 600 * n,
                "succeeded, 0.4",
                ("gpu-1",),
                4,
                sid,
            )
        )
    store.record(
        HistoryRow(
            "run", "old-job", ANA, NOW - 86400, NOW - 86400 + 7200, "Failed: chief-0 exited 1", ("gpu-1",), 4, "s2"
        )
    )
    store.record(
        HistoryRow("run", "bert", BOB, NOW - 3 * 86400, NOW - 2 * 86400, "Preempted by gpt", ("gpu-1",), 12, "s3")
    )
    store.record(HistoryRow("wait", "gpt", BOB, NOW - 600, None, "", ("gpu-1",), 8, "s4"))
    store.record(
        HistoryRow("run", "rerun-job", BOB, NOW - 5 * 86400, NOW - 4 * 86400, "Succeeded", ("gpu-2",), 8, "s5")
    )
    store.record(HistoryRow("run", "rerun-job", BOB, NOW - 3600, None, "", ("gpu-2",), 8, "s5"))
    store.emit([Event(Kind.JOB_ENDED, "end:old-job:1", "old-job", ANA, "gpu-1", "job old-job failed", How.FAILED, 1)])
    store.keep_logs(
        "old-job", 1, [{"time": _iso(NOW - 80000), "task": "chief-0", "host": "gpu-1", "text": "Traceback: <boom>"}]
    )
    (tmp_path / "hosts.yaml").write_text(HOSTS_YAML)
    known = Known(store, work, (), HostsFile(tmp_path / "hosts.yaml", work))
    rounds = Rounds(known.read, lambda job, path: None, [], threading.Event(), lambda s: None, look=stand_in)  # type: ignore[arg-type]
    seen.clear()
    rounds.round()
    source = ServiceSource(store, work, rounds=rounds, known=known)
    client = TestClient(make_app(source, auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    yield client, source, store
    source.close()
    store.close()


def test_the_rounds_survey_finished_work_and_the_hosts_file(svc):
    """`Known` feeds the rounds: a finished study's inventory and the --hosts file's are in
    every round's survey (before: only unfinished submissions and --inventory)."""
    assert {STUDY, HOSTS_JOB} <= seen[-1]


def test_a_studys_page_after_its_end_is_its_page(svc):
    client, _, _ = svc
    page = client.get(f"/studies/{STUDY}")
    assert page.status_code == 200, page.text  # before: 404 "No study walk5-lr. There are none."
    text = page.text
    assert "ended: max_trials reached" in text and 'id="promote"' in text  # Promote stays
    assert 'class="curve succeeded"' in text and 'class="curve pruned"' in text  # the learning curves
    assert re.search(r'<rect x="[\d.]+" y="[\d.]+" width="8" height="8" fill="#ff7f0e" class="pruned">', text)
    assert 'class="importance"' in text  # Optuna's importance
    assert "1 cancelled" in text and "1 stopped early" in text  # before: "2 stopped early"
    assert '<td class="state">cancelled</td>' in text
    # The discrete batch axis: its values, whole (before: 7.45 ... 8.55).
    assert ">8</text>" in text and ">16</text>" in text and "7.45" not in text and "8.55" not in text


def test_a_value_shows_to_a_sensible_precision_and_whole_in_its_tooltip(svc):
    client, source, _ = svc
    study = source.study(STUDY)
    study["trials"][0]["params"]["lr"] = LR  # (the page's document: what a sampler gives)
    text = client.get(f"/studies/{STUDY}").text
    assert f'title="{LR}">0.0002029</td>' in text and f">{LR}<" not in text


def test_every_trial_has_its_page_its_logs_and_reports(svc):
    client, _, _ = svc
    page = client.get(f"/jobs/{STUDY}-t1")
    assert page.status_code == 200, page.text  # before: 404
    assert "Trial 1 of study" in page.text and "Its reports" in page.text and "<polyline" in page.text
    doc = client.get(f"/api/v1/jobs/{STUDY}-t1").json()
    assert doc["trial"]["number"] == 1 and doc["reports"][0] == [1.0, 1.9] and doc["study"] == STUDY
    logs = client.get(f"/api/v1/jobs/{STUDY}-t1/logs").json()
    assert [ln["text"] for ln in logs["lines"]] == ["epoch 1 loss 1.9"] and logs["kept"] is True
    assert client.get(f"/api/v1/jobs/{STUDY}-t1/logs", params={"after": logs["after"]}).json()["lines"] == []
    assert client.get(f"/jobs/{STUDY}-t4").status_code == 200
    assert "cancelled" in client.get(f"/jobs/{STUDY}-t4").text
    assert client.get(f"/jobs/{STUDY}-t99").status_code == 404


def test_the_jobs_pages_numbers_are_right(svc):
    client, _, _ = svc
    text = client.get("/jobs").text
    queued = text[text.index('id="queued"') : text.index('id="running"')]
    running = text[text.index('id="running"') : text.index('id="finished"')]
    finished = text[text.index('id="finished"') :]

    def row(part: str, job: str) -> str:
        m = re.search(rf'<tr data-job="{re.escape(job)}"[^>]*>(.*?)</tr>', part, re.S)
        assert m, (job, part[:2000])
        return m.group(1)

    bert = row(queued, "bert")  # preempted: waits to resume, with the 12 GPUs it held (before: "ended", 8)
    assert "<td>preempted</td>" in bert and '<td class="gpus">12</td>' in bert and "resumes when room returns" in bert
    assert '<td class="gpus">8</td>' in row(queued, "gpt")  # what it asks for (before: 0)
    rerun = row(running, "rerun-job")  # since its latest run (before: its first run's)
    assert f"<td>{_iso(NOW - 3600)}</td>" in rerun
    hours = re.search(r'<td class="gpu-hours">([0-9.]+)</td>', rerun)
    # 8 GPUs x 25 h, and its running hour goes on while the session's tests run
    assert hours and abs(float(hours[1]) - 8 * (25 + (time.time() - NOW) / 3600)) <= 0.051, rerun
    old = row(finished, "old-job")  # the history's (before: "None.")
    assert '<td class="state">failed</td>' in old and '<td class="gpus">4</td>' in old
    assert (
        '<td class="gpu-hours" title="8.0">8.0</td>' in old
        and f'<td class="ended when">{_iso(NOW - 86400 + 7200)}</td>' in old
    )
    assert row(finished, f"{STUDY}-t1")  # trials too
    only = client.get("/jobs", params={"phase": "failed"}).text
    assert 'data-job="old-job"' in only and f'data-job="{STUDY}-t1"' not in only
    assert client.get("/jobs", params={"kind": "nope"}).status_code == 400


def test_a_job_no_inventory_names_has_its_page_from_the_history(svc):
    client, _, _ = svc
    page = client.get("/jobs/old-job")
    assert page.status_code == 200, page.text  # before: 404
    assert 'id="known"' in page.text and "Failed: chief-0 exited 1" in page.text and "timeline" in page.text
    logs = client.get("/api/v1/jobs/old-job/logs").json()
    assert [ln["text"] for ln in logs["lines"]] == ["Traceback: <boom>"] and logs["kept"]
    assert "Traceback: &lt;boom&gt;" not in page.text  # lines come through the API as text, never the page's markup
    assert client.get("/jobs/bert").status_code == 200  # on a ledger, no inventory
    assert client.get("/jobs/nobody-knows").status_code == 404


def test_the_cluster_shows_the_hosts_it_knows_with_their_idle_gpus(svc):
    client, _, _ = svc
    text = client.get("/").text
    assert "No hosts" not in text and 'data-host="gpu-9"' in text and 'data-host="gpu-1"' in text
    assert 'id="idle"' in text and "2 GPUs idle" in text  # gpu-9's (gpu-1's wait for the preemptor)
    assert '<span class="idle-host">idle</span>' in text


def test_the_history_page(svc):
    client, _, _ = svc
    text = client.get("/history").text
    assert "GPU-hours by owner" in text and 'class="hours"' in text
    for job in ("old-job", "bert", "gpt", f"{STUDY}-t3"):
        assert f'data-job="{job}"' in text
    doc = client.get("/api/v1/history", params={"state": "preempted"}).json()
    assert [r["job"] for r in doc["rows"]] == ["bert"] and doc["rows"][0]["gpu_hours"] == 288.0
    doc = client.get("/api/v1/history", params={"owner": BOB, "kind": "wait"}).json()
    assert [(r["job"], r["state"]) for r in doc["rows"]] == [("gpt", "waiting")]
    assert client.get("/history", params={"state": "bogus"}).status_code == 400


def test_the_quotas_page_says_who_would_be_preempted_first(svc):
    client, _, _ = svc
    doc = client.get("/api/v1/quotas").json()
    ana = next(q for q in doc["quotas"] if q["quota"] == ANA)
    bob = next(q for q in doc["quotas"] if q["quota"] == BOB)
    assert (ana["guaranteed"], ana["used"], ana["borrowed"]) == (8, 0, 0)
    assert (bob["used"], bob["borrowed"], bob["waiting"]) == (8, 8, 20)  # gpt's 8 and bert's 12 wait
    assert ana["if_asked"]["victims"] == [
        {"job": "rerun-job", "owner": BOB, "why": "borrowing beyond its owner's guarantee"}
    ]
    text = client.get("/quotas").text
    assert "would preempt, first" in text and 'href="/jobs/rerun-job"' in text


def test_the_new_pages_keep_the_host_and_token_checks(svc, tmp_path):
    client, source, store = svc
    for path in ("/history", "/quotas", "/api/v1/history", "/api/v1/quotas", f"/jobs/{STUDY}-t1", "/jobs/old-job"):
        assert client.get(path, headers={"Host": "attacker.example"}).status_code == 400, path
    tokens = TestClient(
        make_app(source, auth=Auth.token(store)), client=("10.0.0.9", 5), base_url="http://127.0.0.1:8470"
    )
    for path in ("/api/v1/history", "/api/v1/quotas", f"/api/v1/jobs/{STUDY}-t1"):
        assert tokens.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    _, good = store.create_token(BOB, admin=False)
    assert tokens.get("/api/v1/quotas", headers={"Authorization": f"Bearer {good}"}).status_code == 200


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for k, v in attrs:
            if v and ((tag == "a" and k == "href") or (tag in ("link", "script") and k in ("href", "src"))):
                self.links.append(v)


def crawl(client: TestClient, start: list[str], most: int = 400) -> dict[str, int]:
    """Every page the start pages link to (same site, GET), and theirs: path -> status."""
    got: dict[str, int] = {}
    todo = list(start)
    while todo and len(got) < most:
        path = todo.pop(0)
        if path in got:
            continue
        r = client.get(path)
        got[path] = r.status_code
        if "text/html" not in r.headers.get("content-type", ""):
            continue
        p = _Links()
        p.feed(r.text)
        for href in p.links:
            u = urlparse(urljoin("http://127.0.0.1:8470" + path, href))
            if u.netloc == "127.0.0.1:8470":
                todo.append(u.path + (f"?{u.query}" if u.query else ""))
    return got


def test_every_link_on_every_page_answers(svc):
    client, _, _ = svc
    got = crawl(client, ["/", "/jobs", "/history", "/quotas", "/usage", f"/studies/{STUDY}", "/jobs/old-job"])
    bad = {p: s for p, s in got.items() if s != 200}
    assert not bad, bad
    assert len(got) > 20 and f"/jobs/{STUDY}-t2" in got and "/jobs/rerun-job" in got


def test_a_destroyed_jobs_page_says_how_its_last_run_ended():
    """After `destroy` its page said "Pending: not started" and offered Stop."""
    from provision.serve.kept import gone_since

    task = {"task": "chief-0", "role": "chief", "host": "h", "address": "a", "gpus": [0], "state": "Pending",
            "exit_code": None, "restarts": 0, "since_seconds": None, "detail": "not applied", "ended_at": None,
            "last_lines": [], "gpu_util_pct": None}  # fmt: skip
    doc = {"format_version": 2, "job": "j", "phase": "Pending", "reason": "not started", "unreachable": [],
           "tasks": [task], "left_behind": [], "owner": None, "run": None, "setup_lines": {}, "env": {},
           "study": None, "actions": ["stop"]}  # fmt: skip
    run = {"kind": "run", "job": "j", "owner": ANA, "started": "s", "ended": "e", "seconds": 1.0, "state": "succeeded",
           "how": "Succeeded: chief-0 exited 0", "hosts": ["h"], "gpus": 1, "gpu_hours": 0.0, "submission": "x"}  # fmt: skip
    got = gone_since(doc, [run])  # type: ignore[arg-type]
    assert (got["phase"], got["actions"], got["tasks"]) == ("Succeeded", [], [])
    assert got["reason"] == "chief-0 exited 0 (its tasks are no longer on its hosts)"
    assert gone_since(doc, [run, {**run, "ended": None}]) is doc  # a run again (or a wait): as its hosts say  # type: ignore[arg-type]
    running = {**doc, "tasks": [{**task, "detail": "running"}]}
    assert gone_since(running, [run]) is running  # type: ignore[arg-type]
