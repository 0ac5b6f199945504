"""The logging checks in a real browser (headless Chromium): a Parquet log whose sampler log-probs were taken after
top-p (processed log-probs), uploaded on the Data page, shows the "check the logging first" banner, and the
Findings page shows its `sampling_params` finding first. Saves data_logging_check.png and
findings_logging_check.png where browser_util.screenshot_dir says."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import browser as bu
from helpers.sampling import synthetic_run

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]


def test_uploaded_processed_logprobs_show_the_banner_and_the_finding_first(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    log = tmp_path / "processed-top-p.parquet"
    synthetic_run("processed-top-p", seed=5, top_p=0.9).write_parquet(log)
    shots = bu.screenshot_dir(tmp_path)
    env = {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "0"}
    with bu.streamlit_server(tmp_path / "drift.duckdb", env=env, log=tmp_path / "server.log") as url:
        with sync_playwright() as p:
            browser = bu.launch_chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                page.goto(url)
                bu.wait_idle(page, timeout_ms=90_000)
                bu.goto_page(page, "Data", "Data", charts=0)
                page.locator("[data-testid='stFileUploaderDropzoneInput']").set_input_files([str(log)])
                load = page.get_by_role("button", name="Load", exact=True)
                expect(load).to_be_enabled(timeout=30_000)
                load.click()
                page.get_by_text("Last upload: 1 loaded, 0 skipped, 0 refused.").wait_for(timeout=60_000)
                bu.wait_idle(page, "Data")
                banner = page.locator("[data-testid='stAlertContentWarning']", has_text="Check the logging first")
                expect(banner).to_have_count(1)
                text = banner.inner_text()
                assert "processed-top-p" in text and "top-p / top-k" in text, text
                bu.full_screenshot(page, shots / "data_logging_check.png")

                bu.goto_page(page, "Findings", "Findings", charts=0)
                cards = page.locator("[data-testid='stMarkdownContainer']", has_text="Rule:").all_inner_texts()
                assert cards, "no finding card"
                assert "sampling_params" in cards[0] and "look processed by sampling parameters" in cards[0], cards[0]
                assert page.locator("[data-testid='stException']").count() == 0
                bu.full_screenshot(page, shots / "findings_logging_check.png")
            finally:
                browser.close()
    server_log = (tmp_path / "server.log").read_text(errors="replace")
    assert "Traceback" not in server_log, server_log[-3000:]
