"""The dashboard in a real browser: Debian's chromium (through chromium-driver and Selenium)
against uvicorn serving an InventorySource over a job on sandbox hosts. The Cluster page
shows the host and the GPU the job holds, the Job page its task, a line the task prints
appears within 1 s, and Stop stops the job on the host. Screenshots go to
$PROVISION_SCREENSHOTS when set (CI keeps them)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from clirun import cli, ok, sh, status, unit_props, wait_until

pytestmark = pytest.mark.integration

JOB = f"dash-{os.getpid() % 100000}"
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
def server(job):
    import uvicorn

    from provision.web.app import make_app
    from provision.web.auth import Auth
    from provision.web.inventories import InventorySource

    tmp, inv = job
    source = InventorySource([inv])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(
        uvicorn.Config(make_app(source, auth=Auth.loopback()), host="127.0.0.1", port=port, log_level="warning")
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    wait_until(lambda: srv.started, timeout=30, every=0.05, what="uvicorn listening")
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(timeout=10)
    source.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them)", pytrace=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    yield b
    b.quit()


def _shot(browser, name: str) -> None:
    where = os.environ.get("PROVISION_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(where) / f"dashboard-{name}.png"))


def test_cluster_page_shows_the_gpu_the_job_holds(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server + "/")
    row = browser.find_element(By.CSS_SELECTOR, 'tr.gpu[data-host="host-1"][data-gpu="0"]')
    assert "held" in row.text and JOB in row.text, row.text
    _shot(browser, "cluster")


def test_job_page_follows_the_logs_and_stops_the_job(server, browser, hosts, job):
    from selenium.webdriver.common.by import By

    browser.get(f"{server}/jobs/{JOB}")
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
