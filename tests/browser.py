"""Headless Chromium for the dashboard's tests: the OS packages' browser and chromedriver, driven by Selenium
(nothing is downloaded at test time). `MISSING` is why one cannot start here, or None."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
except ImportError:
    webdriver = None  # type: ignore[assignment]

MISSING = (
    "needs Chromium and its driver from the OS packages (apt-get install chromium chromium-driver) "
    "and the selenium Python package"
    if webdriver is None or CHROMIUM is None or CHROMEDRIVER is None
    else None
)
# No sandbox as root in a container; no background networking: this machine has no network to reach.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1000",
)


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    assert MISSING is None, MISSING
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def points(driver: Any, title: str) -> int:
    """How many points the dashboard's chart titled `title` draws (its canvas's data-points)."""
    cards = driver.find_elements(By.CSS_SELECTOR, f'.chart[data-title="{title}"] canvas')
    return int(cards[0].get_attribute("data-points") or 0) if cards else 0
