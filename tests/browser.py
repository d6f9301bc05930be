"""Debian's chromium for the dashboard's browser tests, driven by selenium on loopback.

@pytest.fixture(scope="module")
def browser():
    yield from chromium(height=1000)

shot(browser, "dashboard", "jobs")   # test-artifacts/dashboard/jobs.png (or $PROVISION_ARTIFACTS)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def chromium(height: int) -> Iterator[Any]:
    """A headless chromium 1280 pixels wide, quit when the generator is closed."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.fail("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them)", pytrace=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size=1280,{height}"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        yield b
    finally:
        b.quit()


def shot(browser: Any, folder: str, name: str) -> None:
    """A screenshot of the page as it is, under the test artifacts' FOLDER."""
    root = os.environ.get("PROVISION_ARTIFACTS") or str(Path(__file__).resolve().parents[1] / "test-artifacts")
    where = Path(root) / folder
    where.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(where / f"{name}.png"))
