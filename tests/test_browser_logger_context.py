"""A run logged through DriftLogger with every context argument (rewards, advantages, prompts, responses, tags,
segment_ids, sampling_support), in a real browser: Sequences shows a sample's reward, advantage, tag, prompt and
response; the Overview's context panel draws the mean reward and the mean advantage per step, equal to the logged
values."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis.ingest import ingest_paths
from analysis.record.logger import DriftLogger
from analysis.store import Store

from helpers import browser as bu
from helpers.logger_context import TAGS, context_step

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]

ENV = {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "0"}
STEPS = (2, 5)
# the context chart's line traces by axis (bu.CONTEXT_JS): y drift, y2 reward, y3 advantage, y4 length, y5 count


def test_logger_context_on_sequences_and_overview(tmp_path):
    from playwright.sync_api import sync_playwright

    log = DriftLogger(tmp_path / "logs", "ctx", token_sample=0.1)
    steps = {step: context_step(step) for step in STEPS}
    for step, data in steps.items():
        log.log_step(step, **data)
    db = tmp_path / "drift.duckdb"
    with Store(db) as store:
        assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    data, b = steps[STEPS[0]], 4
    sample = int(data["sample_ids"][b])
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        try:
            with bu.streamlit_server(db, env=ENV) as url:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url + "/sequences")
                bu.wait_idle(page, "Sequences", timeout_ms=90_000)
                bu.fill_number(page, "seq_step", STEPS[0])
                bu.wait_idle(page, "Sequences")
                bu.fill_number(page, "seq_sample", sample)
                page.get_by_text(f"Sample {sample} at step {STEPS[0]}").wait_for(timeout=30_000)
                bu.wait_idle(page, "Sequences")
                text = page.locator("[data-testid='stMain']").inner_text().replace("\n\n", "\n")
                assert page.locator("[data-testid='stAlertContentError']").count() == 0
                assert f"reward\n{float(data['rewards'][b]):.4g}" in text, text[:3000]
                assert f"advantage\n{float(data['advantages'][b, 0]):.4g}" in text, text[:3000]
                assert f"Sample {sample} at step {STEPS[0]} · {TAGS[b % 3]}" in text
                assert data["prompts"][b] in text
                for line in data["responses"][b].splitlines():
                    assert line in text, (line, text[:3000])

                bu.goto_page(page, "Overview", "Overview")
                traces = page.evaluate(bu.CONTEXT_JS)
        finally:
            browser.close()
    assert traces, "no context chart on the Overview"
    by_axis = {t["axis"]: t for t in traces}
    want_reward = [float(np.mean(steps[s]["rewards"].numpy())) for s in STEPS]
    # row 1 of each step has per-token advantages that differ: it has no sequence advantage
    want_adv = [float(np.mean([steps[s]["advantages"][i, 0] for i in range(10) if i != 1])) for s in STEPS]
    for axis, want in (("y2", want_reward), ("y3", want_adv)):
        assert by_axis[axis]["x"] == list(STEPS)
        assert np.allclose(by_axis[axis]["y"], want, rtol=1e-12), (axis, by_axis[axis]["y"], want)
