"""A recovered job's page in a browser: its incidents on the timeline (the outage bars and
the work redone visible), its goodput and incidents in `status`'s words. The job is canned
(tests/test_web_incidents.RecoveredSource: its state's incidents, its runs and events as the
service keeps them), served for real (tests/webserve.py); the screenshot is
docs/images/dashboard-job-incidents.png's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from test_web_incidents import RecoveredSource
from webserve import served


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them)", pytrace=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    yield b
    b.quit()


def test_a_recovered_jobs_page_draws_its_incidents(browser):
    from selenium.webdriver.common.by import By

    with served(RecoveredSource(service=True)) as port:
        browser.get(f"http://127.0.0.1:{port}/jobs/bert")
        outages = browser.find_elements(By.CSS_SELECTOR, "figure.timeline rect.incident")
        assert len(outages) == 2 and all(r.is_displayed() and r.size["width"] > 0 for r in outages)
        assert browser.find_element(By.CSS_SELECTOR, "figure.timeline rect.redone").is_displayed()
        assert browser.find_elements(By.CSS_SELECTOR, "figure.timeline rect.run")  # the runs beside them
        assert browser.find_element(By.ID, "goodput").text.startswith("Goodput: ")
        listed = browser.find_element(By.ID, "incidents").text
        assert "incident 1 (done)" in listed and "11 s of work redone" in listed
        root = os.environ.get("PROVISION_ARTIFACTS") or str(Path(__file__).resolve().parents[2] / "test-artifacts")
        where = Path(root) / "dashboard-incidents"
        where.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(where / "dashboard-job-incidents.png"))
