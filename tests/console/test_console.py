"""The operator console in a real headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium): two peered registries, one stopped, its breaker seen opening."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.client import RegistryClient
from tests.db.proc import databases
from tests.db.test_federation_process import Cluster
from tests.helpers import system_tool

DEADLINE_S = 60.0  # a stopped peer's breaker opens after 5 refused pulls (~8 s of backoff)
ROOT = Path(__file__).resolve().parents[2]


def artifacts() -> Path:
    """Where CI keeps what a run leaves to look at (CI_ARTIFACTS_DIR, else ./artifacts)."""
    where = Path(os.environ.get("CI_ARTIFACTS_DIR") or ROOT / "artifacts")
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = system_tool("chromium", "chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,900")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(
        service=Service(executable_path=system_tool("chromedriver", "chromium-driver")),
        options=options,
    )
    try:
        yield driver
    finally:
        driver.quit()


def wait(what: str, probe: Callable[[], Any], driver: Any) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(str(e) for e in driver.get_log("browser"))
            raise AssertionError(f"not within {DEADLINE_S}s: {what}\nbrowser console:\n{logs}")
        time.sleep(0.1)


def text(driver: Any, selector: str) -> str | None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return str(driver.find_element(By.CSS_SELECTOR, selector).text)
    except (NoSuchElementException, StaleElementReferenceException):
        return None


def test_the_console_shows_the_federation_and_a_breaker_opening(
    database_url: str, tmp_path: Path, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    with databases(database_url) as new_database:
        cluster = Cluster(tmp_path, new_database, "ab")
        try:
            cluster.start("a", "b")
            a, b = cluster["a"], cluster["b"]
            with RegistryClient(a.url) as client:
                token = client.sign_in(cluster.admin)["sessionToken"]

            browser.get(a.url + "/console/")
            # Keyboard only: the field is focusable and Enter submits.
            field = browser.find_element(By.ID, "token")
            field.send_keys(token + Keys.ENTER)
            # Signed in: A's identity, its health, B as a peer with a closed breaker, and the
            # event stream live (the page's script and socket allowed by its own policy).
            wait("the registry's DID", lambda: text(browser, "#registry") == a.did, browser)
            wait("the event stream live", lambda: text(browser, "#live") == "live", browser)
            row = f'tr[data-peer="{b.did}"] .breaker'
            wait("B's breaker closed", lambda: text(browser, row) == "closed", browser)
            assert "ok" in (text(browser, "#status") or "")
            assert "database ok" in (text(browser, "#checks") or "")
            # Readable on a phone: nothing wider than the screen but the peers' own scroller.
            browser.set_window_size(390, 844)
            width = browser.execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth]"
            )
            assert width[0] <= width[1], width
            browser.save_screenshot(str(artifacts() / "console-phone.png"))
            browser.set_window_size(1280, 900)

            # B stops: A's pulls fail, and the console shows its breaker open.
            cluster.stop("b")
            wait("B's breaker open", lambda: text(browser, row) == "open", browser)
            failures = browser.find_element(
                By.CSS_SELECTOR, f'tr[data-peer="{b.did}"] td:nth-child(3)'
            )
            assert int(failures.text) >= 5
            # The same in A's metrics, as Prometheus reads them.
            metrics = httpx.get(
                a.url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10
            ).text
            peer = f'peer="{b.did}"'
            assert f'registry_peer_breaker_state{{{peer},state="open"}} 1.0' in metrics
            failed = re.search(
                rf"^registry_peer_consecutive_failures\{{{peer}\}} (\d+)", metrics, re.M
            )
            assert failed is not None
            assert int(failed.group(1)) >= 5
            browser.save_screenshot(str(artifacts() / "console.png"))
            # Nothing the page loaded broke its Content-Security-Policy, nor failed.
            problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
            assert problems == []
        finally:
            cluster.close()
