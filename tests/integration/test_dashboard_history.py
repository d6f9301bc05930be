"""The dashboard remembers, in a real browser (Debian's chromium through Selenium, as
test_dashboard.py drives it) against a real `provision serve --hosts FILE` on sandbox hosts:
after a handed-over study and a handed-over job ended (the job destroyed, its host's journal
emptied), the study's page has its curves and trials, a trial's page its kept lines, the Jobs
page its finished rows with their numbers, the History and Quotas pages answer, the Cluster
page shows both hosts with their idle GPUs, and every link of every page answers 200. The
new pages keep the Host check and refuse a wrong token.

Screenshots go to $PROVISION_ARTIFACTS/dashboard-history/ (else test-artifacts/ in the
clone); the ones in docs/images/ were taken by this test."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest
import yaml

from browser import chromium, shot
from clirun import cli, ok, sh, wait_until
from provision import sandbox

pytestmark = pytest.mark.integration

TRAINER = Path(__file__).resolve().parents[1] / "fixtures" / "tune" / "trainer.py"
STUDY = f"walk-{os.getpid() % 100000}"
JOB = f"printer-{os.getpid() % 100000}"
OWNER = "ann@example.com"
BOB = "bob@example.com"
HOG = f"hog-{os.getpid() % 100000}"
LINES = 3000


@pytest.fixture(scope="module")
def hosts(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


@pytest.fixture(scope="module")
def env(tmp_path_factory, postgres):
    """A team's: the state, the study and the service's tables in PostgreSQL (the team's
    policy lives there)."""
    pytest.importorskip("psycopg")
    tmp = tmp_path_factory.mktemp("remembers")
    # A team database of its own: the policy it sets is no other test's.
    postgres.sql("CREATE DATABASE remembers")
    return tmp, {
        **postgres.env(),
        "PROVISION_STATE": postgres.url(database="remembers"),
        "PROVISION_SERVICE_DB": str(tmp / "svc" / "service.sqlite"),
        "PROVISION_OWNER": OWNER,
        "PROVISION_QUEUE_POLL": "1",
    }


@pytest.fixture(scope="module")
def served(hosts, env, sandbox_inventory):
    """The service (loopback pages, --hosts FILE naming both hosts), a study of 4 trials on
    host-1 and a job that prints LINES lines on host-2, both handed over, both ended; the job
    destroyed and host-2's journal emptied. Yields the pages' URL."""
    tmp, e = env
    shutil.copy(TRAINER, tmp / "trainer.py")
    study = tmp / "study.yaml"
    sandbox_inventory(
        hosts, job=STUDY, path=study, hosts=["host-1"],
        files=[{"src": "trainer.py", "dest": f"/opt/{STUDY}/trainer.py"}],
        pools={"chief": {"replicas": 1, "accelerators": 1,
                         "command": ["python3", f"/opt/{STUDY}/trainer.py", "--steps=4", "--step_seconds=0.3"]}},
        tune={"metric": {"name": "loss", "goal": "minimize"},
              "parameters": {"quality": {"type": "double", "min": 0.0001, "max": 0.01, "scale": "log"},
                             "batch": {"type": "discrete", "values": [8, 16]}},
              "algorithm": "random", "max_trials": 4, "parallel_trials": 2},
    )  # fmt: skip
    job = tmp / "job.yaml"
    printer = f"for i in $(seq 1 {LINES}); do echo printed line $i; done"
    sandbox_inventory(
        hosts, job=JOB, path=job, hosts=["host-2"],
        pools={"chief": {"replicas": 1, "accelerators": 2, "command": ["/bin/sh", "-c", printer]}},
    )  # fmt: skip
    sandbox_inventory(
        hosts, job=HOG, path=tmp / "hog.yaml", preemptible=True,
        pools={"chief": {"replicas": 1, "accelerators": 2, "command": ["sleep", "900"]},
               "worker": {"replicas": 1, "accelerators": 2, "command": ["sleep", "900"]}},
    )  # fmt: skip
    inv = sandbox.inventory_dict(hosts)
    listed = tmp / "hosts.yaml"
    listed.write_text(yaml.safe_dump({"ssh": inv["ssh"], "hosts": inv["hosts"]}, sort_keys=False))
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "serve", "--poll", "0.5", "--listen", "127.0.0.1:0", "--hosts", listed],
            cwd=tmp, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **e},
        )  # fmt: skip
    try:
        port = wait_until(
            lambda: re.search(r"Dashboard on http://127\.0\.0\.1:(\d+)/", log.read_text()), timeout=60, what="pages"
        ).group(1)
        ok(cli("tune", "--detach", "--poll", "0.3", study, cwd=tmp, env=e))
        ok(cli("apply", "--queue", "--detach", job, cwd=tmp, env=e))

        def study_ended() -> bool:
            r = cli("tune", "--status", "--json", study, cwd=tmp, env=e)
            return r.returncode == 0 and json.loads(r.stdout)["ended"] is not None

        wait_until(study_ended, timeout=600, every=2, what="the study's end")
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _kept(url), timeout=300, every=2, what="the printer's lines kept by the service")
        ok(cli("destroy", "-y", job, cwd=tmp, env=e))
        sh(
            hosts,
            "host-2",
            "journalctl --rotate >/dev/null 2>&1; journalctl --vacuum-time=1s >/dev/null 2>&1",
            check=True,
        )
        yield url
    finally:
        cli("destroy", "-y", tmp / "hog.yaml", cwd=tmp, env={**e, "PROVISION_OWNER": BOB})
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
        print(log.read_text(errors="replace"))
        for w in sorted((tmp / "svc" / "work").glob("*.log")):
            print(f"==== {w}\n{w.read_text(errors='replace')}")


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


def _kept(url: str) -> bool:
    """The service kept the printer's run (its job's page says so)."""
    code, text = _get(f"{url}/api/v1/jobs/{JOB}")
    return code == 200 and bool(json.loads(text).get("kept_logs"))


@pytest.fixture(scope="module")
def browser():
    yield from chromium(height=1400)


def _shot(browser, name: str) -> None:
    shot(browser, "dashboard-history", name)


def test_the_study_page_after_its_end_has_its_curves(served, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{served}/studies/{STUDY}")
    assert "ended:" in browser.find_element(By.TAG_NAME, "main").text
    curves = browser.find_elements(By.CSS_SELECTOR, "#curves polyline.curve")
    assert len(curves) == 4, len(curves)  # each trial's reports
    assert browser.find_elements(By.CSS_SELECTOR, "#importance rect.importance")
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.trials tbody tr")) == 4
    assert browser.find_elements(By.CSS_SELECTOR, "button[form=promote]")  # Promote stays
    _shot(browser, "study")


def test_a_trials_page_has_its_kept_lines(served, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{served}/jobs/{STUDY}-t1")
    log = browser.find_element(By.ID, "log")
    wait_until(lambda: "step=4 loss=" in log.text, timeout=30, what="the trial's kept lines")
    assert "Trial 1 of study" in browser.find_element(By.TAG_NAME, "h1").text
    assert browser.find_elements(By.CSS_SELECTOR, "figure.reports circle.report")
    _shot(browser, "trial")


def test_the_jobs_page_lists_what_ended_with_its_numbers(served, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{served}/jobs")
    rows = {r.get_attribute("data-job"): r for r in browser.find_elements(By.CSS_SELECTOR, "#finished tr[data-job]")}
    assert {f"{STUDY}-t{n}" for n in range(1, 5)} | {JOB, STUDY} <= set(rows), sorted(rows)
    printer = rows[JOB]
    assert printer.find_element(By.CSS_SELECTOR, "td.gpus").text == "2"
    assert printer.find_element(By.CSS_SELECTOR, "td.state").text == "succeeded"
    assert printer.find_element(By.CSS_SELECTOR, "td.ended").text.endswith("Z")
    trial = rows[f"{STUDY}-t1"]
    assert trial.find_element(By.CSS_SELECTOR, "td.gpus").text == "1"
    assert float(trial.find_element(By.CSS_SELECTOR, "td.gpu-hours").get_attribute("title")) > 0
    _shot(browser, "jobs")


def test_a_destroyed_jobs_page_has_the_lines_the_service_kept(served, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{served}/jobs/{JOB}")
    log = browser.find_element(By.ID, "log")
    wait_until(lambda: f"printed line {LINES}" in log.text, timeout=30, what="the kept lines")
    assert browser.find_element(By.ID, "log-kept").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "table.runs tbody tr")
    _shot(browser, "job-kept-logs")


def test_the_history_and_cluster_pages(served, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{served}/history")
    jobs = [r.get_attribute("data-job") for r in browser.find_elements(By.CSS_SELECTOR, "table.history tr[data-job]")]
    assert {JOB, STUDY, f"{STUDY}-t2"} <= set(jobs), jobs
    assert jobs.count(JOB) == 1, jobs  # its run once (its worker's), not twice
    assert browser.find_elements(By.CSS_SELECTOR, "figure.hours rect.hours")  # GPU-hours by owner
    _shot(browser, "history")
    browser.get(f"{served}/")
    for h in ("host-1", "host-2"):  # nothing runs: both there, their GPUs idle
        assert browser.find_elements(By.CSS_SELECTOR, f'tr.host[data-host="{h}"] .idle-host')
    assert "4 GPUs idle" in browser.find_element(By.ID, "idle").text
    _shot(browser, "cluster-idle")


def test_the_quotas_page_with_the_teams_policy(served, browser, env):
    """bob's preemptible job takes every GPU (a terminal's apply, on the --hosts file's
    hosts); ann is guaranteed 2: if she asked now, bob's job would be preempted first."""
    from selenium.webdriver.common.by import By

    tmp, e = env
    ok(cli("apply", "-y", tmp / "hog.yaml", cwd=tmp, env={**e, "PROVISION_OWNER": BOB}))
    policy = tmp / "policy.yaml"
    policy.write_text(f"guarantees: {{{OWNER}: 2}}\n")
    ok(cli("policy", "set", policy, cwd=tmp, env=e))

    def asked() -> dict | None:
        doc = json.loads(_get(f"{served}/api/v1/quotas")[1])
        ann = next((q for q in doc["quotas"] if q["quota"] == OWNER), None)
        return ann if ann and ann["if_asked"] and ann["if_asked"]["victims"] else None

    ann = wait_until(asked, timeout=120, every=2, what="the quotas with bob's job in a round")
    assert (ann["guaranteed"], ann["used"]) == (2, 0)
    assert [v["job"] for v in ann["if_asked"]["victims"]] == [HOG]
    browser.get(f"{served}/quotas")
    bob = browser.find_element(By.CSS_SELECTOR, f'table.quotas tr[data-quota="{BOB}"]')
    assert bob.find_element(By.CSS_SELECTOR, "td.borrowed").text == "4"
    text = browser.find_element(By.CSS_SELECTOR, f'table.quotas tr[data-quota="{OWNER}"] td.if-asked').text
    assert f"would preempt, first {HOG}" in text, text
    _shot(browser, "quotas")


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [v for k, v in attrs if v and k in ("href", "src") and tag in ("a", "link", "script")]


def test_every_link_on_every_page_answers(served):
    seen: dict[str, int] = {}
    todo = ["/", "/jobs", "/history", "/quotas", "/usage", f"/studies/{STUDY}", f"/jobs/{JOB}"]
    while todo and len(seen) < 300:
        path = todo.pop(0)
        if path in seen:
            continue
        code, text = _get(served + path)
        seen[path] = code
        p = _Links()
        p.feed(text)
        for href in p.links:
            u = urlparse(urljoin(served + path, href))
            if f"{u.scheme}://{u.netloc}" == served:
                todo.append(u.path + (f"?{u.query}" if u.query else ""))
    assert not {p: c for p, c in seen.items() if c != 200}, seen
    assert f"/jobs/{STUDY}-t3" in seen and len(seen) > 20


def test_the_new_pages_keep_the_host_and_token_checks(served):
    port = urlparse(served).port
    for path in ("/history", "/quotas", "/api/v1/history", "/api/v1/quotas", f"/jobs/{STUDY}-t1"):
        assert _get(served + path, {"Host": f"attacker.example:{port}"})[0] == 400, path
        assert _get(served + path, {"Authorization": "Bearer not-a-token"})[0] == 401, path
