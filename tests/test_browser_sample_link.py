"""First opens in a real browser: a link to one sample (`/sequences?seq_run=…&seq_step=…&seq_sample=…`) opened in
a fresh session on a fresh server shows that sample with its per-token chart drawn, bar for bar the seeded Δ, and
the colour scale at the run's p99 |Δ| (numpy); the demo's "database was empty" toast shows once in a session, not
again on the next pages."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis.ingest import ingest_paths
from analysis.store import Store
from ui import sequence_view

from helpers import browser as bu
from helpers.context import make_sequences, write_sequence_jsonl

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]

RUN = "link-run"
CHART_JS = """() => {
  const gd = document.querySelector(".st-key-seq_delta_chart .js-plotly-plot");
  return gd && gd.data ? {x: Array.from(gd.data[0].x), y: Array.from(gd.data[0].y)} : null;
}"""


def test_a_link_to_a_sample_opens_it_with_its_per_token_chart(tmp_path):
    from playwright.sync_api import sync_playwright

    seqs = make_sequences(44, steps=3, per_step=5, max_len=30)
    db = tmp_path / "link.duckdb"
    with Store(db) as store:
        assert ingest_paths(store, [write_sequence_jsonl(tmp_path / "seqs.jsonl", seqs, RUN)])[0].status == "loaded"
    q = next(x for x in seqs if x["step"] == 2 and x["sample"] == 3)
    d_all = np.concatenate([np.asarray(x["t"]) - np.asarray(x["s"]) for x in seqs])
    want_scale = sequence_view.default_scale(float(np.quantile(np.abs(d_all), 0.99)))
    with bu.streamlit_server(db, env={"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "0"}, log=tmp_path / "server.log") \
            as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/sequences?seq_run={RUN}&seq_step=2&seq_sample=3")
        bu.wait_idle(page, "Sequences", timeout_ms=120_000, charts=1)
        page.get_by_text("Sample 3 at step 2").wait_for(timeout=30_000)
        bu.wait_idle(page, "Sequences", timeout_ms=60_000, charts=1)
        assert page.locator("[data-testid='stException'], [data-testid='stAlertContentError']").count() == 0
        chart = page.evaluate(CHART_JS)
        assert chart is not None, "no per-token chart drawn"
        assert chart["x"] == list(range(len(q["s"])))
        np.testing.assert_allclose(chart["y"], np.asarray(q["t"]) - np.asarray(q["s"]), rtol=0, atol=1e-9)
        shown = float(page.locator(".st-key-seq_scale input").input_value())
        assert shown == pytest.approx(want_scale, rel=1e-3)

        # the ranking: step 2's samples by |ΣΔ| (numpy), the open one marked; a click on a row opens that sample
        step2 = [x for x in seqs if x["step"] == 2]
        ranked = [x["sample"] for x in sorted(step2, key=lambda x: -abs(sum(np.subtract(x["t"], x["s"]))))]
        rows = page.locator(".st-key-seq_table tbody tr")
        assert [int(t) for t in rows.locator("td:first-child").all_inner_texts()] == ranked
        assert rows.nth(ranked.index(3)).get_attribute("class") == "picked"
        target = next(s for s in ranked if s != 3)
        rows.nth(ranked.index(target)).click()
        page.get_by_text(f"Sample {target} at step 2").wait_for(timeout=30_000)
        bu.wait_idle(page, "Sequences", timeout_ms=60_000, charts=1)
        assert f"seq_sample={target}" in page.url
        assert rows.nth(ranked.index(target)).get_attribute("class") == "picked"
        # a header click sorts the rows in the browser: sample ids, largest first, then smallest first
        header = page.locator(".st-key-seq_table th", has_text="sample")
        header.click()
        assert [int(t) for t in rows.locator("td:first-child").all_inner_texts()] == sorted(ranked, reverse=True)
        header.click()
        assert [int(t) for t in rows.locator("td:first-child").all_inner_texts()] == sorted(ranked)
        # the keyboard: Enter on a header sorts it, Enter on a row opens it
        header.focus()
        page.keyboard.press("Enter")
        assert [int(t) for t in rows.locator("td:first-child").all_inner_texts()] == sorted(ranked, reverse=True)
        first = max(ranked)
        rows.nth(0).focus()
        page.keyboard.press("Enter")
        page.get_by_text(f"Sample {first} at step 2").wait_for(timeout=30_000)
        bu.wait_idle(page, "Sequences", timeout_ms=60_000, charts=1)
        assert page.locator(".st-key-seq_table tr[aria-current='true'] td").first.inner_text() == str(first)
        browser.close()


def test_the_demo_toast_shows_once_in_a_session(tmp_path):
    from playwright.sync_api import sync_playwright

    toast = "[data-testid='stToast']"
    with bu.streamlit_server(tmp_path / "empty.duckdb", env={"DRIFT_NO_DEMO": "", "DRIFT_PREFETCH": "0"},
                             timeout=300, log=tmp_path / "server.log") as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        bu.wait_idle(page, "Overview", timeout_ms=300_000, charts=1)
        first = page.locator(toast, has_text="The database was empty: loaded the demo runs")
        first.wait_for(timeout=30_000)
        first.wait_for(state="detached", timeout=30_000)  # Streamlit's toast goes after a few seconds
        for label, title, _ in bu.PAGES[1:4]:
            bu.goto_page(page, label, title, timeout_ms=120_000)
            page.wait_for_timeout(500)  # a toast is sent with the run's first elements: it would be up by now
            assert page.locator(toast, has_text="database was empty").count() == 0, label
        browser.close()
