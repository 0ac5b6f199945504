"""The Lab page's Drift origin tab in a real browser (headless Chromium): a database with one probe run of the lab
model (bf16 sampler), the tab opened by a click, its three charts drawn and the first site above the floor named.
Saves lab-drift-origin.png where helpers.browser.screenshot_dir says."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import browser as bu

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from helpers.probe import probe_database

    root = tmp_path_factory.mktemp("browser-probe")
    db, first = probe_database(root, prompt=(7, 8, 9, 10), tokens=16)
    env = {"DRIFT_PREFETCH": "0", "DRIFT_NO_DEMO": "1"}
    with bu.streamlit_server(db, env=env, log=root / "server.log") as url:
        yield url, root, first


def test_drift_origin_view_opens_and_draws(server):
    from playwright.sync_api import sync_playwright

    url, root, first = server
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(url)
            bu.wait_idle(page, timeout_ms=120_000)
            bu.goto_page(page, "Lab", "Drift lab", charts=0)
            seconds = bu.goto_tab(page, "Drift origin", charts=3)
            print(f"Lab › Drift origin: {seconds:.2f} s to idle, 3 charts drawn")
            assert page.locator("[data-testid='stException']").count() == 0
            assert not page.locator("[data-testid='stAlertContentError']").all_inner_texts()
            assert "lab_tab=Drift" in page.url
            assert page.get_by_text(f"Drift starts at layer {first['layer']}, {first['op']}", exact=False).count() == 1
            assert page.locator("div.drift-chart .main-svg").count() >= 3
            assert page.get_by_text("first above the floor", exact=False).count() >= 1  # the chart's marker
            bu.full_screenshot(page, bu.screenshot_dir(root) / "lab-drift-origin.png")
        finally:
            browser.close()
