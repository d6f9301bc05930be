"""The dashboard over a fake Source (Starlette's TestClient): every page answers and shows its
data, the JSON API has the CLI's --json shapes, /metrics is Prometheus text, who may read
and act (loopback, tokens, a trusted header, CSRF), and hostile strings stay text."""

from __future__ import annotations

import re
from typing import Any

import pytest
from starlette.testclient import TestClient

from provision.rules.historyview import HistoryQuery
from provision.rules.studyview import StudyCurves
from provision.web.app import make_app
from provision.web.auth import CSRF_COOKIE, Auth
from provision.web.guard import BadURL, Site
from provision.web.source import SECRET_MASK, USAGE_EXAMPLE, NotFound, Unavailable

EVIL = "<script>alert(1)</script>"
HERE = ("127.0.0.1", 50000)  # the client's address (TestClient's default, "testclient", is no address)


def _jobs_doc() -> dict[str, Any]:
    """As `provision jobs --json` prints it (rules/tenancy.jobs_json), with labels and GPU use."""
    return {
        "format_version": 1,
        "jobs": [
            {
                "job": "bert",
                "owner": "ana",
                "lineage": "l1",
                "state": "running",
                "since": "2026-11-27T01:00:00Z",
                "age_seconds": 60,
                "queued": None,
                "hosts": {"gpu-1": {"state": "running", "gpus": [0, 1], "ports": [29500]}},
            },
            {
                "job": "gpt",
                "owner": "bob",
                "lineage": "l2",
                "state": "queued",
                "since": None,
                "age_seconds": None,
                "queued": {"since": "2026-11-27T01:00:00Z", "waiting_for": "2 GPUs on gpu-1 (held by bert)"},
                "priority": "high",
                "priority_level": 1000,
                "hosts": {"gpu-1": {"state": "queued", "gpus": [], "ports": []}},
            },
            {
                "job": "old",
                "owner": "ana",
                "gpu_hours": 12.25,
                "ended": "2026-11-26T23:00:00Z",
                "lineage": "l1",
                "state": "ended",
                "since": None,
                "age_seconds": None,
                "queued": None,
                "hosts": {"gpu-2": {"state": "ended", "gpus": [0], "ports": []}},
            },
        ],
        "hosts": {
            "gpu-1": {
                "error": None,
                "gpus": 2,
                "free_gpus": [],
                "held": {"bert": {"gpus": [0, 1], "ports": [29500]}},
                "foreign_ports": [],
                "unreadable": [],
                "labels": {"rack": "r1"},
                "gpu_use": {"0": {"utilization": 97, "memory_mib": 30000}, "1": {"utilization": 3, "memory_mib": 10}},
                "gpu_history": {"0": [[1000.0, 90.0], [1010.0, 97.0]]},
            },
            "gpu-2": {
                "error": None,
                "gpus": 1,
                "free_gpus": [0],
                "held": {},
                "foreign_ports": [],
                "unreadable": [],
                "labels": {"rack": "r2"},
            },
            "gpu-3": {"error": "connection refused", "gpus": 2, "free_gpus": None, "held": {}, "foreign_ports": []},
        },
    }


def _study_doc() -> dict[str, Any]:
    trials = [
        {"number": 1, "job": "s-t1", "params": {"lr": 0.001, "opt": "adam"}, "state": "succeeded", "value": 0.5},
        {"number": 2, "job": "s-t2", "params": {"lr": 0.1, "opt": "sgd"}, "state": "stopped early", "value": 2.0},
        {"number": 3, "job": "s-t3", "params": {"lr": 0.01, "opt": EVIL}, "state": "failed", "value": None},
        {"number": 4, "job": "s-t4", "params": {"lr": 0.0001, "opt": "adam"}, "state": "running", "value": 0.4},
    ]
    for t in trials:
        t.update(steps=10, seconds=1.0, why=None, retry_of=None)
    return {
        "format_version": 1,
        "job": "s",
        "metric": {"name": "loss", "goal": "minimize"},
        "max_trials": 8,
        "parallel_trials": 2,
        "max_failed_trials": 2,
        "algorithm": "random",
        "early_stopping": "median",
        "measurement": "last",
        "trials": trials,
        "best": trials[0],
        "counts": {"succeeded": 1, "stopped early": 1, "failed": 1, "running": 1},
        "ended": None,
        "picture": None,
        "space": [
            {"name": "lr", "type": "double", "scale": "log", "min": 1e-4, "max": 0.1, "values": []},
            {
                "name": "opt",
                "type": "categorical",
                "scale": "linear",
                "min": None,
                "max": None,
                "values": ["adam", "sgd"],
            },
        ],
    }


def _history_rows() -> list[dict[str, Any]]:
    """As rules/historyview.row_json makes them: a finished run of old, a preempted run of
    bert, a trial of s, a wait."""

    def row(kind: str, job: str, owner: str, state: str, how: str, ended: str | None, gpus: int, hours: float):
        return {
            "kind": kind, "job": job, "owner": owner, "started": "2026-11-26T20:00:00Z", "ended": ended,
            "seconds": 3600.0, "state": state, "how": how, "hosts": ["gpu-2"], "gpus": gpus, "gpu_hours": hours,
            "submission": "sub-1",
        }  # fmt: skip

    return [
        row("run", "old", "ana", "failed", "Failed: chief-0 exited 1", "2026-11-26T23:00:00Z", 4, 12.25),
        row("run", "bert", "ana", "preempted", "Preempted by gpt", "2026-11-26T22:00:00Z", 12, 6.0),
        row("trial", "s-t1", "ana", "succeeded", "succeeded, 0.5", "2026-11-26T21:00:00Z", 1, 1.0),
        row("wait", "gpt", "bob", "waiting", "", None, 2, 0.0),
    ]


def _quotas_doc() -> dict[str, Any]:
    return {
        "format_version": 1,
        "guarantees": True,
        "free": 1,
        "quotas": [
            {
                "quota": "team-a", "members": ["ana"], "guaranteed": 4, "used": 2, "borrowed": 0, "waiting": 0,
                "waiting_jobs": [], "if_asked": {"gpus": 2, "fits": False, "possible": True,
                                                 "victims": [{"job": "bert", "owner": "bob", "why": "borrowing"}]},
            },
            {
                "quota": "bob", "members": [], "guaranteed": 0, "used": 2, "borrowed": 2, "waiting": 2,
                "waiting_jobs": ["gpt"], "if_asked": None,
            },
        ],
    }  # fmt: skip


class FakeSource:
    def __init__(self) -> None:
        self.done: list[tuple[str, str, str]] = []
        self.down = False
        self.asked: list[HistoryQuery] = []

    def _up(self) -> None:
        if self.down:
            raise Unavailable("the state database does not answer (connection refused)")

    def hosts(self) -> dict[str, Any]:
        self._up()
        return _jobs_doc()

    def jobs(self) -> dict[str, Any]:
        self._up()
        return _jobs_doc()

    def latest(self) -> dict[str, Any]:
        return self.jobs()

    def job(self, name: str) -> dict[str, Any]:
        if name != "bert":
            raise NotFound(f"job {name}", ["bert", "gpt", "old"])
        task = {
            "task": "chief-0",
            "role": "chief",
            "host": "gpu-1",
            "address": "10.0.0.1",
            "gpus": [0, 1],
            "state": "Running",
            "exit_code": None,
            "restarts": 0,
            "since_seconds": 60,
            "detail": EVIL,
            "ended_at": None,
            "last_lines": [],
        }
        return {
            "format_version": 2,
            "job": "bert",
            "phase": "Running",
            "reason": None,
            "unreachable": [],
            "tasks": [task],
            "left_behind": [],
            "owner": "ana",
            "run": {"number": 2, "started_at": "2026-11-27T01:00:00Z", "by": "ana"},
            "setup_lines": {},
            "env": {"EPOCHS": "3", "WANDB_API_KEY": SECRET_MASK},
            "study": None,
            "actions": ["stop"],
        }

    def logs(self, name: str, after: str | None) -> dict[str, Any]:
        self.job(name)
        n = int(after or 0)
        lines = [{"time": "t", "task": "chief-0", "host": "gpu-1", "text": f"line {i} {EVIL}"} for i in range(n, n + 2)]
        return {"lines": lines, "after": str(n + 2), "errors": []}

    def studies(self) -> list[str]:
        return ["s"]

    def study(self, name: str) -> dict[str, Any]:
        if name != "s":
            raise NotFound(f"study {name}", ["s"])
        return _study_doc()

    def usage(self) -> dict[str, Any]:
        return USAGE_EXAMPLE

    def history(self, q: HistoryQuery) -> dict[str, Any]:
        rows = [r for r in _history_rows() if (not q.owner or r["owner"] == q.owner)]
        rows = [r for r in rows if (not q.finished or r["ended"]) and (not q.kinds or r["kind"] in q.kinds)]
        rows = [r for r in rows if not q.state or r["state"] == q.state]
        self.asked.append(q)
        return {"format_version": 1, "rows": rows[q.offset : q.offset + q.limit], "total": len(rows), "as_of": "t"}

    def quotas(self) -> dict[str, Any]:
        return _quotas_doc()

    def curves(self, name: str) -> StudyCurves:
        self.study(name)
        return StudyCurves({1: ((1, 0.9), (5, 0.6), (10, 0.5)), 2: ((1, 2.5), (3, 2.0)), 4: ((1, 0.8), (2, 0.4))})

    def owner(self, name: str, recent: bool = False) -> str | None:
        return {"bert": "ana", "gpt": "bob", "s": "ana"}.get(name)

    def _did(self, what: str, name: str, who: str) -> dict[str, Any]:
        self.done.append((what, name, who))
        return {"ok": True, "message": f"{what} {name} by {who}"}

    def stop(self, name: str, who: str) -> dict[str, Any]:
        return self._did("stop", name, who)

    def rerun(self, name: str, who: str) -> dict[str, Any]:
        return self._did("rerun", name, who)

    def cancel(self, name: str, who: str) -> dict[str, Any]:
        return self._did("cancel", name, who)

    def promote(self, name: str, trial: int, who: str) -> dict[str, Any]:
        self.done.append(("promote", name, who))
        return {"ok": True, "message": f"trial {trial}", "inventory": f"job: s\n# {EVIL}\n"}


class Tokens:
    """An in-memory TokenCheck: token -> (owner, admin)."""

    def __init__(self, table: dict[str, tuple[str, bool]]):
        self.table = table

    def owner_of(self, token: str) -> tuple[str, bool] | None:
        return self.table.get(token)


TOKENS = Tokens(
    {"t-ana": ("ana", False), "t-bob": ("bob", False), "t-reader": ("reader", False), "t-root": ("root", True)}
)


@pytest.fixture
def src() -> FakeSource:
    return FakeSource()


@pytest.fixture
def local(src: FakeSource) -> TestClient:
    return TestClient(make_app(src, auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")


def _csrf(client: TestClient, path: str = "/jobs/bert") -> str:
    page = client.get(path)
    assert page.status_code == 200
    m = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert m, page.text
    assert client.cookies.get(CSRF_COOKIE) == m.group(1)
    return m.group(1)


# --------------------------------------------------------------------------- pages


def test_every_page_answers_with_its_data(local: TestClient) -> None:
    cluster = local.get("/")
    assert cluster.status_code == 200
    for text in (
        "rack=r1",
        "rack=r2",
        "gpu-1",
        "bert",
        "ana",
        "97 %",
        "free",
        "unreachable: connection refused",
        "<svg",
    ):
        assert text in cluster.text, text
    jobs = local.get("/jobs")
    assert jobs.status_code == 200
    assert "2 GPUs on gpu-1 (held by bert)" in jobs.text and "12.2" in jobs.text and "2026-11-26T23:00:00Z" in jobs.text
    job = local.get("/jobs/bert")
    assert job.status_code == 200 and "chief-0" in job.text and 'id="stop"' in job.text and "Run 2, started" in job.text
    study = local.get("/studies/s")
    assert study.status_code == 200
    assert "<svg" in study.text and 'class="pruned"' in study.text and "lr (log)" in study.text
    usage = local.get("/usage")
    assert usage.status_code == 200 and "2026-W48" in usage.text and "idle" in usage.text
    assert local.get("/static/logs.js").status_code == 200


def test_jobs_filter_and_a_malformed_one(local: TestClient) -> None:
    r = local.get("/jobs", params={"owner": "bob"})
    assert 'data-job="gpt"' in r.text and 'data-job="bert"' not in r.text
    assert "<td>high</td>" in r.text  # its priority
    r = local.get("/jobs", params={"q": "ol"})
    assert 'data-job="old"' in r.text and 'data-job="gpt"' not in r.text
    r = local.get("/jobs", params={"phase": "bogus"})
    assert r.status_code == 400 and r.text.startswith("phase:")
    assert local.get("/jobs", params={"page": "x"}).status_code == 400
    assert local.get("/api/v1/jobs", params={"phase": "queued"}).json()["jobs"][0]["job"] == "gpt"


def test_unknown_job_or_study_says_what_exists(local: TestClient) -> None:
    r = local.get("/jobs/nope")
    assert r.status_code == 404 and "No job nope" in r.text and "<li>gpt</li>" in r.text
    r = local.get("/api/v1/studies/nope")
    assert r.status_code == 404 and r.json() == {"error": "no study nope", "known": ["s"]}


def test_the_database_down_is_a_page_that_says_so_and_it_comes_back(src: FakeSource, local: TestClient) -> None:
    src.down = True
    r = local.get("/")
    assert r.status_code == 503 and "does not answer" in r.text
    src.down = False
    assert local.get("/").status_code == 200


def test_secrets_are_masked(local: TestClient) -> None:
    r = local.get("/jobs/bert")
    assert SECRET_MASK in r.text and "EPOCHS" in r.text


# --------------------------------------------------------------------------- the API and /metrics


def test_api_shapes(local: TestClient) -> None:
    hosts = local.get("/api/v1/hosts").json()
    assert hosts["format_version"] == 1 and set(hosts["hosts"]) == {"gpu-1", "gpu-2", "gpu-3"}
    jobs = local.get("/api/v1/jobs").json()
    assert jobs["format_version"] == 1 and [j["job"] for j in jobs["jobs"]] == ["bert", "gpt", "old"]
    job = local.get("/api/v1/jobs/bert").json()
    assert job["format_version"] == 2 and job["tasks"][0]["task"] == "chief-0"
    study = local.get("/api/v1/studies/s").json()
    assert study["format_version"] == 1 and len(study["trials"]) == 4
    usage = local.get("/api/v1/usage").json()
    assert set(usage) == {"format_version", "days", "weeks", "idle"}
    logs = local.get("/api/v1/jobs/bert/logs", params={"after": "2"}).json()
    assert logs["after"] == "4" and logs["lines"][0]["text"].startswith("line 2")


def parse_prometheus(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The text format's samples (name, labels) -> value; fails on a line it cannot read."""
    sample = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (-?[0-9.e+]+|NaN|\+Inf|-Inf)$")
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')
    out = {}
    typed = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = sample.match(line)
        assert m, f"not a sample: {line!r}"
        assert m.group(1) in typed, f"{m.group(1)} has no TYPE line"
        labels = frozenset(label.findall(m.group(2) or ""))
        assert ",".join(f'{k}="{v}"' for k, v in sorted(labels)) or not m.group(2)
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def test_metrics_are_prometheus_text(local: TestClient) -> None:
    r = local.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_prometheus(r.text)
    util = {"host": "gpu-1", "gpu": "0", "job": "bert", "owner": "ana"}
    assert m[("provision_gpu_utilization_percent", frozenset(util.items()))] == 97
    assert m[("provision_gpu_memory_used_mib", frozenset(util.items()))] == 30000
    assert m[("provision_jobs", frozenset({("state", "queued")}))] == 1
    assert m[("provision_queue_length", frozenset())] == 1
    assert m[("provision_trials", frozenset({("study", "s"), ("state", "stopped early")}))] == 1
    assert m[("provision_host_up", frozenset({("host", "gpu-3")}))] == 0


# --------------------------------------------------------------------------- who may read and act


def test_loopback_mode_serves_only_loopback(src: FakeSource) -> None:
    far = TestClient(make_app(src, auth=Auth.loopback()), client=("10.1.2.3", 5000), base_url="http://127.0.0.1:8470")
    r = far.get("/api/v1/jobs")
    assert r.status_code == 401 and "loopback" in r.json()["error"]
    named = TestClient(
        make_app(src, auth=Auth.loopback()), client=("localhost", 5000), base_url="http://127.0.0.1:8470"
    )
    assert named.get("/api/v1/jobs").status_code == 401  # a name, not the address a socket has


def test_token_mode_reads_with_a_token_only(src: FakeSource) -> None:
    c = TestClient(make_app(src, auth=Auth.token(TOKENS)), client=("10.1.2.3", 5000), base_url="http://127.0.0.1:8470")
    assert c.get("/api/v1/jobs").status_code == 401
    assert c.get("/", follow_redirects=False).headers["location"] == "/login"
    r = c.get("/api/v1/jobs", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"] == "this token is not valid (wrong or revoked)"
    assert c.get("/api/v1/jobs", headers={"Authorization": "Bearer t-reader"}).status_code == 200
    r = c.post("/login", data={"token": "t-reader"}, follow_redirects=False)
    assert r.status_code == 303
    assert c.get("/jobs/bert").status_code == 200


def test_actions_need_the_owner_or_an_admin(src: FakeSource) -> None:
    c = TestClient(make_app(src, auth=Auth.token(TOKENS)), client=HERE, base_url="http://127.0.0.1:8470")

    def stop(token: str) -> int:
        return c.post("/api/v1/jobs/bert/stop", headers={"Authorization": f"Bearer {token}"}).status_code

    assert stop("t-reader") == 403
    assert stop("t-bob") == 403
    assert src.done == []
    assert stop("t-ana") == 200 and stop("t-root") == 200
    assert src.done == [("stop", "bert", "ana"), ("stop", "bert", "root")]
    c.post("/login", data={"token": "t-reader"})
    assert 'id="stop"' not in c.get("/jobs/bert").text  # no button for those who may not


def test_a_browser_post_needs_its_csrf_token(src: FakeSource, local: TestClient) -> None:
    token = _csrf(local)
    assert local.post("/jobs/bert/stop", data={}).status_code == 403
    assert local.post("/jobs/bert/stop", data={"csrf": "forged"}).status_code == 403
    r = local.post("/jobs/bert/stop", data={"csrf": token}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    assert src.done == []
    r = local.post("/jobs/bert/stop", data={"csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/jobs/bert?done=")
    assert src.done == [("stop", "bert", "local")]
    assert "stop bert by local" in local.get(r.headers["location"]).text


def test_promote_from_the_study_page(src: FakeSource, local: TestClient) -> None:
    token = _csrf(local, "/studies/s")
    r = local.post("/studies/s/promote", data={"csrf": token, "trial": "1"})
    assert r.status_code == 200 and "trial 1" in r.text and EVIL not in r.text
    assert local.post("/studies/s/promote", data={"csrf": token, "trial": "x"}).status_code == 400


def test_trusted_header_only_on_loopback(src: FakeSource) -> None:
    with pytest.raises(ValueError, match="loopback"):
        Auth.trusted_header(listening="0.0.0.0")
    auth = Auth.trusted_header(listening="127.0.0.1", admins=frozenset({"root"}))
    c = TestClient(make_app(src, auth=auth), client=HERE, base_url="http://127.0.0.1:8470")
    assert c.get("/api/v1/jobs").status_code == 401
    assert c.get("/api/v1/jobs", headers={"X-Forwarded-User": "bob"}).status_code == 200
    c.headers["X-Forwarded-User"] = "ana"
    csrf = _csrf(c)
    c.headers["X-Forwarded-User"] = "bob"
    assert c.post("/jobs/bert/stop", data={"csrf": csrf}).status_code == 403  # bert is ana's
    c.headers["X-Forwarded-User"] = "ana"
    assert c.post("/jobs/bert/stop", data={"csrf": csrf}, follow_redirects=False).status_code == 303


# --------------------------------------------------------------------------- hostile strings


def test_hostile_strings_are_shown_as_text(local: TestClient) -> None:
    for path in ("/jobs/bert", "/studies/s"):
        r = local.get(path)
        assert EVIL not in r.text, path
        assert "&lt;script&gt;" in r.text, path
    r = local.get("/jobs/%3Cscript%3E")
    assert r.status_code == 404 and EVIL not in r.text


# --------------------------------------------------------------------------- the names it answers as


@pytest.mark.parametrize(
    ("listen", "public", "host", "ok"),
    [
        ("127.0.0.1", None, "127.0.0.1:8470", True),
        ("127.0.0.1", None, "localhost:8470", True),
        ("127.0.0.1", None, "[::1]:8470", True),
        ("127.0.0.1", None, "attacker.example:8470", False),
        ("127.0.0.1", None, "127.0.0.1:8471", False),
        ("127.0.0.1", None, "127.0.0.1", False),  # port 80, not 8470
        ("127.0.0.1", None, "", False),
        ("127.0.0.1", None, "127.0.0.1:8470:1", False),
        ("::1", None, "[::1]:8470", True),
        ("10.0.0.5", None, "10.0.0.5:8470", True),
        ("10.0.0.5", None, "10.0.0.6:8470", False),
        ("10.0.0.5", None, "localhost:8470", False),
        ("0.0.0.0", None, "192.168.1.9:8470", True),  # a wildcard: any address, on its port
        ("0.0.0.0", None, "[fe80::1]:8470", True),
        ("0.0.0.0", None, "192.168.1.9:80", False),
        ("0.0.0.0", None, "gpu-head:8470", True),  # the machine's name
        ("0.0.0.0", None, "GPU-HEAD:8470", True),
        ("0.0.0.0", None, "gpu-head.attacker.example:8470", False),
        ("0.0.0.0", None, "1.2.3.4.nip.io:8470", False),
        ("127.0.0.1", "https://dash.example.com/", "dash.example.com", True),
        ("127.0.0.1", "https://dash.example.com/", "dash.example.com:443", True),
        ("127.0.0.1", "https://dash.example.com/", "dash.example.com:8470", False),
        ("127.0.0.1", "http://Dash.Example.com:9000/x", "dash.example.com:9000", True),
        ("127.0.0.1", "http://[fd00::5]:9000", "[fd00::5]:9000", True),
    ],
)
def test_the_hosts_a_service_answers_as(listen: str, public: str | None, host: str, ok: bool) -> None:
    assert Site.listening(listen, 8470, public, names=["gpu-head"]).host_ok(host) is ok


def test_the_origins_a_post_may_come_from() -> None:
    site = Site.listening("127.0.0.1", 8470, "https://dash.example.com/")
    assert site.origin_ok("http://127.0.0.1:8470") and site.origin_ok("http://localhost:8470/jobs/x")
    assert site.origin_ok("https://dash.example.com") and site.origin_ok("https://dash.example.com/studies/s")
    for other in ("http://dash.example.com", "https://127.0.0.1:8470", "null", "http://evil.example", "http://[x"):
        assert not site.origin_ok(other), other
    with pytest.raises(BadURL):
        Site.listening("127.0.0.1", 8470, "dash.example.com")
