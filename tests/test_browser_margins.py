"""The Routing page's flip rate by router margin and Token drift's full distribution by length, in a real browser
(headless Chromium): a database with one DriftLogger run that logged router margins, top-k lists and tags; each
tab opened by a click and its charts drawn. Saves routing-margins.png where helpers.browser.screenshot_dir says."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import browser as bu

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from analysis.ingest import ingest_paths
    from analysis.store import Store
    from helpers.margins import margin_logs

    root = tmp_path_factory.mktemp("browser-margins")
    margin_logs(root / "logs", plain=False)
    store = Store(root / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [root / "logs"])} == {"loaded"}
    store.close()
    env = {"DRIFT_PREFETCH": "0", "DRIFT_NO_DEMO": "1"}
    with bu.streamlit_server(root / "db.duckdb", env=env, log=root / "server.log") as url:
        yield url, root


def test_margin_chart_opens_and_draws(server):
    from playwright.sync_api import sync_playwright

    url, root = server
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(url)
            bu.wait_idle(page, timeout_ms=120_000)
            bu.goto_page(page, "Routing", "Routing")
            seconds = bu.goto_tab(page, "Flips per token", charts=4)
            print(f"Routing › Flips per token: {seconds:.2f} s to idle, 4 charts drawn")
            assert page.locator("[data-testid='stException']").count() == 0
            assert not page.locator("[data-testid='stAlertContentError']").all_inner_texts()
            assert page.get_by_text("Flips happen where the router is undecided", exact=False).count() == 1
            assert page.get_by_text("router margin (flip rate)", exact=False).count() >= 1  # the chart's axis
            bu.full_screenshot(page, bu.screenshot_dir(root) / "routing-margins.png")

            bu.goto_page(page, "Token drift", "Token drift")
            bu.goto_tab(page, "Full distribution", charts=3)
            assert page.locator("[data-testid='stException']").count() == 0
            assert page.get_by_text("By response length and by tag", exact=False).count() == 1
        finally:
            browser.close()
