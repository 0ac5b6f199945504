"""The Expert load page in a real browser: opened from the sidebar on the page tests' fixture database (whose
routed run is given `ep_size` so the rank view draws), every tab shows without an exception or error box, the
charts draw, and the what-if forecasts."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from analysis.store import Store

from helpers import browser as bu

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]

ENV = {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "0"}


def _clean(page, where: str) -> None:
    assert page.locator("[data-testid='stException']").count() == 0, f"exception on {where}"
    errors = page.locator("[data-testid='stAlertContentError']").all_inner_texts()
    assert not errors, f"{where}: {errors}"


def test_expert_load_page_in_the_browser(app_template_db, tmp_path):
    from playwright.sync_api import sync_playwright

    db = tmp_path / "drift.duckdb"
    shutil.copy(app_template_db, db)
    store = Store(db)
    store.set_run_config(bu.RUN_BOTH, store.run_config(bu.RUN_BOTH) | {"ep_size": 4})
    store.close()
    shots = bu.screenshot_dir(tmp_path)
    with bu.streamlit_server(db, env=ENV, log=tmp_path / "server.log") as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            bu.wait_idle(page, "Overview", timeout_ms=90_000, charts=1)
            bu.goto_page(page, "Expert load", "Expert load", charts=2)
            _clean(page, "Expert load")
            assert "vLLM" in page.locator("[data-testid='stMain']").inner_text()  # which engine logs what
            bu.full_screenshot(page, shots / "expert_load.png")
            for tab, charts in (("Ranks", 1), ("Hot experts", 2), ("What-if", 1), ("By domain", 0)):
                bu.goto_tab(page, tab, charts=charts)
                _clean(page, f"Expert load › {tab}")
                if charts:
                    assert page.locator("div.drift-chart .main-svg").count() >= charts, tab
                bu.full_screenshot(page, shots / f"expert_load-{tab.lower().replace(' ', '_')}.png")
            assert "no tags logged" in page.locator("[data-testid='stMain']").inner_text()
        finally:
            browser.close()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
