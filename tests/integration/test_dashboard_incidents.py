"""A recovered job's page in a browser: its incidents on the timeline (the outage bars and
the work redone visible), its goodput and incidents in `status`'s words. The job is canned
(tests/test_web_incidents.RecoveredSource: its state's incidents, its runs and events as the
service keeps them), served for real (tests/webserve.py); the screenshot is
docs/images/dashboard-job-incidents.png's."""

from __future__ import annotations

import pytest

from browser import chromium, shot
from test_web_incidents import RecoveredSource
from webserve import served


@pytest.fixture(scope="module")
def browser():
    yield from chromium(height=900)


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
        shot(browser, "dashboard-incidents", "dashboard-job-incidents")
