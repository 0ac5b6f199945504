"""The Findings page in a real browser (headless Chromium) on the bundled demo: finding cards, the waterfall, the
correction simulator, the gates, and a card's link that opens its evidence view (tab and grouping) on the Token
drift page. Saves findings.png and findings-<tab>.png where helpers.browser.screenshot_dir says."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import browser as bu

pytestmark = pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`streamlit run app.py` on an empty database: the app loads the demo runs on start."""
    root = tmp_path_factory.mktemp("browser-findings")
    with bu.streamlit_server(root / "drift.duckdb", env={"DRIFT_PREFETCH": "0"}, log=root / "server.log") as url:
        yield url, root


def _no_errors(page, where: str) -> None:
    assert page.locator("[data-testid='stException']").count() == 0, f"exception on {where}"
    errors = page.locator("[data-testid='stAlertContentError']").all_inner_texts()
    assert not errors, f"{where}: {errors}"


def test_findings_page_cards_waterfall_simulator_and_evidence_link(server):
    from playwright.sync_api import sync_playwright

    server, root = server
    SHOTS = bu.screenshot_dir(root)
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(server)
            bu.wait_idle(page, "Overview", timeout_ms=120_000)
            seconds = bu.goto_page(page, "Findings", "Findings")
            print(f"Findings page: {seconds:.2f} s to idle (first visit, charts drawn)")
            _no_errors(page, "Findings")
            # the sidebar lists Findings first under Analyse
            nav = page.locator("[data-testid='stSidebarNav'] a").all_inner_texts()
            assert nav[0].strip().endswith("Findings"), nav
            # cards: the stale demo run's lead finding, with its numbers and a link
            title = page.get_by_text("Stale tokens (lag > 0", exact=False).first
            assert "100.0% of the mismatch" in title.inner_text()  # stale runs: only step 0 is at lag 0
            assert page.get_by_text("AReaL", exact=False).count() > 0  # the advice's source
            assert page.get_by_text("routing_flips").count() > 0
            bu.full_screenshot(page, SHOTS / "findings.png")
            # the other tabs: the waterfall, the simulator (curves, table, noise vs bands), the gates
            for tab, suffix, seconds in bu.visit_tabs(page, "Findings"):
                print(f"Findings › {tab}: {seconds:.2f} s")
                _no_errors(page, f"Findings › {tab}")
                if tab == "Waterfall":
                    # floating bars (ui/findings_charts.waterfall): kl_k3 over A, the terms, kl_k3 over B
                    bars = page.locator(".st-key-findings_waterfall .barlayer .point")
                    assert bars.count() >= 3, bars.count()
                if tab == "Correction simulator":
                    assert page.locator("div.drift-chart").count() == 2
                    assert page.locator("[data-testid='stDataFrame']").count() == 1
                if tab == "Gates":  # the pass/fail grid; the demo runs' band over their configuration, the published table
                    assert page.locator("[data-testid='stDataFrame']").count() == 2
                    assert page.get_by_text("Each metric over the other runs of the database").count() == 1
                    assert page.locator("div.drift-chart").count() == 1
                bu.full_screenshot(page, SHOTS / f"findings-{suffix}.png")
            # the link opens the evidence view: Token drift, its "Where the mismatch lives" tab, grouped by lag
            link = page.locator("xpath=//*[contains(text(), 'Stale tokens (lag')]"
                                "/following::a[contains(., 'Open the evidence')][1]").first  # 3 stale demo runs
            assert "tokens_dim=staleness" in link.get_attribute("href")
            link.click()
            bu.wait_idle(page, "Token drift")
            _no_errors(page, "Token drift from a finding")
            assert "/token_drift" in page.url and "tokens_tab=Where" in page.url
            tab = page.get_by_role("tab", name="Where the mismatch lives", exact=True)
            assert tab.get_attribute("aria-selected") == "true"
            assert page.get_by_role("radio", name="staleness (lag)").is_checked()
            assert page.locator("div.drift-chart .main-svg").count() >= 1
        finally:
            browser.close()
