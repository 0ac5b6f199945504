"""The app in a real browser (headless Chromium): what AppTest cannot see. Every page draws its plotly charts
(and every tab of those with tabs) without an exception box, an upload through the Data page becomes a run, and
each page's screenshot is saved as <page>.png (a tab's as <page>-<tab>.png): in a temporary folder, or in the
folder DRIFT_SCREENSHOTS names (README: `DRIFT_SCREENSHOTS=docs/screenshots` refreshes the tracked ones)."""
from __future__ import annotations

import io
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from helpers import browser as bu

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]


def _demo_available() -> bool:
    from analysis.ingest.demo import DEMO_DIR
    return DEMO_DIR.is_dir() and any(p.is_dir() for p in DEMO_DIR.iterdir())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`streamlit run app.py` on an empty temp database: the app loads the demo runs on start. Until the demo
    data exists in data/demo, the fixture runs stand in for it (loaded before the start)."""
    root = tmp_path_factory.mktemp("browser")
    db = root / "drift.duckdb"
    if not _demo_available():
        bu.build_fixture_db(db, root / "logs")
    with bu.streamlit_server(db, log=root / "server.log") as url:
        yield url, root


def _upload_files(root: Path) -> list[Path]:
    """A Parquet file and a zip holding a JSON Lines file (two new runs), and a CSV that breaks the schema."""
    tokens = bu.fixture_tokens("browser-upload", 21, steps=2, n_seq=3)
    parquet = root / "browser-upload.parquet"
    tokens.write_parquet(parquet)
    buf = io.BytesIO()
    bu.fixture_tokens("browser-zip", 22, steps=2, n_seq=3, optional=False).write_ndjson(buf)
    archive = root / "more-logs.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("logs/zip-tokens.jsonl", buf.getvalue())
    bad = root / "bad.csv"
    bad.write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\nbad,0,0,0,-0.5,0.25\n")
    return [parquet, archive, bad]


def test_pages_render_and_upload_works(server):
    from playwright.sync_api import expect, sync_playwright

    url, root = server
    SHOTS = bu.screenshot_dir(root)
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))  # an alert() would be injected HTML
        outside: list[str] = []  # a hosted app must not make its visitors' browsers call third parties
        page.on("request", lambda r: outside.append(r.url) if r.url.startswith("http")
                and urlsplit(r.url).hostname not in ("127.0.0.1", "localhost") else None)
        try:
            page.goto(url)
            bu.wait_idle(page, "Overview", timeout_ms=90_000, charts=1)
            for label, title, name in bu.PAGES:
                if label != "Overview":
                    bu.goto_page(page, label, title)
                assert page.locator("[data-testid='stException']").count() == 0, f"exception on {label}"
                errors = page.locator("[data-testid='stAlertContentError']").all_inner_texts()
                assert not errors, f"{label}: {errors}"
                if label in bu.CHART_PAGES:
                    assert page.locator("div.drift-chart .main-svg").count() > 0, label
                bu.full_screenshot(page, SHOTS / f"{name}.png")
                for tab, suffix, _ in bu.visit_tabs(page, label):  # tabs run their content only when opened
                    assert page.locator("[data-testid='stException']").count() == 0, f"exception on {label}/{tab}"
                    errors = page.locator("[data-testid='stAlertContentError']").all_inner_texts()
                    assert not errors, f"{label}/{tab}: {errors}"
                    assert page.locator("div.drift-chart .main-svg").count() > 0, (label, tab)
                    bu.full_screenshot(page, SHOTS / f"{name}-{suffix}.png")

            # a metrics table downloads as CSV (its data is made on click, on another server thread)
            bu.goto_page(page, "Data", "Data")
            with page.expect_download(timeout=60_000) as download:
                page.get_by_role("button", name="Download CSV").click()
            csv = Path(download.value.path()).read_text()
            assert csv.startswith("run,step,n_tokens,"), csv[:200]
            assert len(csv.splitlines()) > 2
            bu.wait_idle(page, "Data")

            # upload two files at once (one a zip) on the Data page: both become runs in the sidebar
            page.locator("[data-testid='stFileUploaderDropzoneInput']").set_input_files(
                [str(f) for f in _upload_files(root)])
            expect(page.locator("[data-testid='stFileChip']")).to_have_count(3, timeout=30_000)
            load = page.get_by_role("button", name="Load", exact=True)
            expect(load).to_be_enabled(timeout=30_000)  # enabled once the uploads reached the server
            load.click()
            page.get_by_text("Last upload: 2 loaded, 0 skipped, 1 refused.").wait_for(timeout=60_000)
            bu.wait_idle(page, "Data")
            chips = page.locator("[data-testid='stSidebar'] [data-testid='stMultiSelect']").inner_text()
            assert "browser-upload" in chips and "browser-zip" in chips and "bad" not in chips.split(), chips
            assert page.locator("[data-testid='stException']").count() == 0
            bu.full_screenshot(page, SHOTS / "data_upload.png")
            assert not dialogs, dialogs
            assert not outside, outside
            icon = page.evaluate("document.querySelector(\"link[rel~='icon']\").href")
            assert icon.startswith("data:image/svg+xml"), icon[:80]  # the emoji icon, drawn into an inline SVG
        finally:
            browser.close()
    log = (root / "server.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]  # the pages catch errors; the server logged none either


def test_a_link_to_a_page_and_tab_opens_it_on_a_fresh_server(app_template_db, tmp_path):
    """A shared link is often the first request a fresh server gets. Streamlit then routes it with its pages/
    folder routing (it knows pages by file stem) before st.navigation takes over: a page whose URL differed from
    its file stem opened under a "Page not found" dialog. A link also names the open tab (bound to the URL)."""
    import shutil

    from playwright.sync_api import sync_playwright

    db = tmp_path / "drift.duckdb"
    shutil.copy(app_template_db, db)
    with bu.streamlit_server(db, env={"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "0"}) as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/token_drift?tokens_tab=Extreme+tokens")
            bu.wait_idle(page, "Token drift", timeout_ms=90_000)
            page.wait_for_timeout(300)  # the dialog, when there was one, came with the first run
            assert page.locator("[role='dialog']").count() == 0, page.locator("[role='dialog']").all_inner_texts()
            assert page.locator("[role='tab'][aria-selected='true']").inner_text() == "Extreme tokens"
            bu.goto_tab(page, "One run in detail")
            assert page.url.endswith("/token_drift?tokens_tab=One+run+in+detail"), page.url
            bu.goto_tab(page, "Distribution")  # the first tab: a clean URL
            assert page.url.endswith("/token_drift"), page.url
        finally:
            browser.close()


def test_every_page_url_is_its_file_stem():
    """What the test above needs of every page: Streamlit's pages/ folder routing finds it under that URL."""
    from ui import nav

    for p in nav.ALL:
        assert p is nav.OVERVIEW or p.url == Path(p.path).stem, p
