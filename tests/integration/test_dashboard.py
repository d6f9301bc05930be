"""The dashboard in a real browser: Debian's chromium (through chromium-driver and Selenium)
against a real `provision serve` in token mode (listening off loopback, `--inventory` a job
on a sandbox host), with its GPU sampling. Reading and acting need a token (refused without
one, or with another owner's); the Cluster page shows the host and the GPU the job holds,
and its utilization as the host's stand-in nvidia-smi reports it (a test writes it); the
Usage page flags the GPU when it goes idle (the idle window shortened by the service's test
knob); the Job page its task, a line the task prints appears within 1 s, and Stop (with the
token) stops the job on the host.

Screenshots go to $PROVISION_ARTIFACTS/dashboard/, else test-artifacts/dashboard/ in the
clone (CI keeps that directory)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from browser import chromium, shot
from clirun import cli, ok, sh, status, unit_props, wait_until

pytestmark = pytest.mark.integration

JOB = f"dash-{os.getpid() % 100000}"
IDLE_WINDOW = 15  # seconds: the Usage page's idle rule, shortened for this test (PROVISION_TEST_IDLE_WINDOW_S)
# Prints what the test drops in /tmp/say, as it comes (the line the page must show).
SAY = "while :; do if [ -f /tmp/say ]; then cat /tmp/say; rm -f /tmp/say; fi; sleep 0.05; done"


@pytest.fixture(scope="module")
def hosts(sandbox_factory):
    sb = sandbox_factory(hosts=1, gpus_per_host=1)
    yield sb
    sandbox_factory.down(sb)


@pytest.fixture(scope="module")
def job(hosts, sandbox_inventory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    inv = tmp / "inv.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", SAY]}}
    sandbox_inventory(hosts, job=JOB, pools=pools, path=inv)
    ok(cli("apply", "-y", inv, cwd=tmp))
    wait_until(lambda: status(tmp, inv)["phase"] == "Running", timeout=60, what="the job running")
    yield tmp, inv
    cli("destroy", "-y", inv, cwd=tmp)


@pytest.fixture(scope="module")
def server(job, tmp_path_factory):
    """`provision serve --listen 0.0.0.0:0 --inventory INV` on its own database: token mode.
    Yields (the URL, the job owner's token, another owner's token)."""
    tmp, inv = job
    owner = status(tmp, inv)["owner"]
    svc = tmp_path_factory.mktemp("service")
    env = {"PROVISION_SERVICE_DB": str(svc / "service.sqlite"), "PROVISION_TEST_IDLE_WINDOW_S": str(IDLE_WINDOW)}
    token = ok(cli("serve", "token", "create", "--owner", owner, cwd=tmp, env=env)).stdout.strip()
    other = ok(cli("serve", "token", "create", "--owner", "someone-else", cwd=tmp, env=env)).stdout.strip()
    log = svc / "serve.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "serve", "--poll", "0.5", "--listen", "0.0.0.0:0", "--inventory", inv],
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
    try:
        port = wait_until(
            lambda: re.search(r"Dashboard on http://0\.0\.0\.0:(\d+)/ \(token\)", log.read_text()),
            timeout=60,
            what="the dashboard listening",
        ).group(1)
        yield f"http://127.0.0.1:{port}", token, other
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
        print(log.read_text(errors="replace"))  # pytest shows it when a test failed


@pytest.fixture(scope="module")
def browser():
    yield from chromium(height=1000)


def _shot(browser, name: str) -> None:
    shot(browser, "dashboard", name)


def _call(url: str, token: str | None = None, method: str = "GET") -> int:
    """The HTTP status of a request (with the token as a bearer when given)."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def _utilization(hosts, text: str) -> None:
    """What host-1's stand-in nvidia-smi reports from now on ("GPU PERCENT [MIB]" lines)."""
    sh(hosts, "host-1", f"printf '{text}' > /etc/provision-sandbox/utilization", check=True)


def test_token_mode_reads_and_acts_only_with_the_owners_token(server, browser, hosts):
    from selenium.webdriver.common.by import By

    url, token, other = server
    assert _call(f"{url}/api/v1/hosts") == 401
    assert _call(f"{url}/api/v1/hosts", token) == 200
    # Stop without a token, or with another owner's: refused, and the task runs on.
    assert _call(f"{url}/api/v1/jobs/{JOB}/stop", method="POST") == 401
    assert _call(f"{url}/api/v1/jobs/{JOB}/stop", other, method="POST") == 403
    assert unit_props(hosts, "host-1", JOB, "chief-0")["ActiveState"] == "active"
    # The browser signs in once (an HttpOnly cookie); every page after this reads with it.
    browser.get(url + "/")
    wait_until(lambda: browser.current_url.endswith("/login"), timeout=10, what="the sign-in page")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    wait_until(lambda: not browser.current_url.endswith("/login"), timeout=10, what="signed in")


def test_cluster_page_shows_the_gpu_the_job_holds_busy(server, browser, hosts, job):
    from selenium.webdriver.common.by import By

    url = server[0]
    _utilization(hosts, "0 87 40000\\n")
    # The task's own process on the GPU (--query-compute-apps), tied to the job by its cgroup.
    pid = unit_props(hosts, "host-1", JOB, "chief-0")["MainPID"]
    sh(hosts, "host-1", f"echo '0 {pid} python3 39000' > /etc/provision-sandbox/busy-gpus", check=True)

    def busy() -> str | None:
        browser.get(url + "/")
        row = browser.find_element(By.CSS_SELECTOR, 'tr.gpu[data-host="host-1"][data-gpu="0"]')
        return row.text if "87 %" in row.text and pid in row.text else None

    text = wait_until(busy, timeout=30, every=1, what="87 % and the task's process on the Cluster page")
    assert "held" in text and JOB in text and "40000 MiB" in text, text
    assert f"{pid} python3, 39000 MiB ({JOB})" in text, text
    # `provision status` shows the task's utilization too, from its own probe.
    tmp, inv = job
    assert status(tmp, inv)["tasks"][0]["gpu_util_pct"] == 87
    assert " 87% " in ok(cli("status", inv, cwd=tmp)).stdout
    # The sampler's history of the last hour is there too (a round every 10 s): three points.
    points = "return (document.querySelector('tr.gpu[data-gpu=\"0\"] details polyline') || {getAttribute: () => ''})"
    points += ".getAttribute('points')"
    wait_until(
        lambda: browser.get(url + "/") or len((browser.execute_script(points) or "").split()) >= 3,
        timeout=60,
        every=2,
        what="the GPU's last hour",
    )
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    _shot(browser, "cluster")


def test_usage_page_flags_the_held_gpu_gone_idle(server, browser, hosts):
    from selenium.webdriver.common.by import By

    url = server[0]
    _utilization(hosts, "0 1 40000\\n")

    def flagged() -> str | None:
        browser.get(url + "/usage")
        rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "table.idle tr.idle")]
        return next((r for r in rows if JOB in r), None)

    # The window is IDLE_WINDOW s (the knob) and the service samples every 10 s.
    text = wait_until(flagged, timeout=IDLE_WINDOW + 60, every=2, what="the idle GPU on the Usage page")
    assert text.startswith("host-1 0 ") and "min" in text, text
    _shot(browser, "usage")
    _utilization(hosts, "")
    sh(hosts, "host-1", "rm -f /etc/provision-sandbox/busy-gpus", check=True)


def test_job_page_follows_the_logs_and_stops_the_job_with_the_token(server, browser, hosts, job):
    from selenium.webdriver.common.by import By

    browser.get(f"{server[0]}/jobs/{JOB}")
    assert "chief-0" in browser.find_element(By.CSS_SELECTOR, "table.tasks").text
    log = browser.find_element(By.ID, "log")
    # The page's first answer (the lines so far) is in before the new line is written.
    wait_until(lambda: log.get_attribute("data-polls") not in (None, "0"), every=0.05, what="the first poll")
    marker = f"hello from the host <b>{time.time()}</b>"
    sh(hosts, "host-1", f"printf '%s\\n' '{marker}' > /tmp/say.tmp && mv /tmp/say.tmp /tmp/say", check=True)
    written = time.monotonic()
    wait_until(lambda: marker in log.text, timeout=10, every=0.02, what="the line in the page")
    took = time.monotonic() - written
    _shot(browser, "job")
    assert took <= 1.0, f"the line took {took:.2f}s to appear"

    browser.find_element(By.ID, "stop").click()
    # The POST answers with the job's page again, saying what was done.
    wait_until(lambda: "done=" in browser.current_url, timeout=60, what="the stop")
    said = browser.find_element(By.CSS_SELECTOR, "p.done").text
    assert said.startswith("Stopped 1 task"), said
    assert browser.find_element(By.ID, "phase").text == "Stopped"
    tmp, inv = job
    assert unit_props(hosts, "host-1", JOB, "chief-0")["ActiveState"] in ("inactive", "failed")
    assert status(tmp, inv)["phase"] == "Stopped"
    _shot(browser, "stopped")
