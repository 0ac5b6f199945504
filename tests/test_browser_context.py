"""Drift in context, in a real browser: a sample opened by run, step and id shows its prompt, response and reward,
and a link to it opens the same view on a fresh server; the Overview's context panel draws the seeded reward,
length and sequence count per step; the Data page's mapping form loads an OpenRLHF-style file refused for its
keys, with values equal to its fields. One test, so that only the link's check needs a second server."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import polars as pl
import pytest

from analysis.ingest import ingest_paths
from analysis.store import Store

from helpers import browser as bu
from helpers.context import make_sequences, write_openrlhf_jsonl, write_sequence_jsonl

pytestmark = pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")

RUN = "ctx-run"
ENV = {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "0"}

def _sample_view(page) -> str:
    return page.locator("[data-testid='stMain']").inner_text()


def _assert_shows(text: str, q: dict) -> None:
    assert q["prompt"] in text, text[:2000]
    # st.text keeps the response's own characters; the coloured tokens show "\n" as ↵
    assert q["response"].strip().splitlines()[0] in text
    assert f"reward\n{q['reward']:.4g}" in text.replace("\n\n", "\n"), text[:2000]


def _pick(page, key: str, option: str) -> None:
    from playwright.sync_api import expect

    box = page.locator(f".st-key-{key} [role='combobox']")
    box.click()
    box.fill(option)  # filters the (virtualised) list down to the option
    page.locator("[role='listbox'] [role='option']", has_text=option).first.click()
    expect(page.locator(f".st-key-{key} [role='combobox']")).to_have_value(option)


def _map_board_on_data_page(page, board: Path) -> None:
    """Upload the board dump (refused for its keys), pick three fields in the mapping form, load it."""
    from playwright.sync_api import expect

    bu.goto_page(page, "Data", "Data")
    page.locator("[data-testid='stFileUploaderDropzoneInput']").set_input_files(str(board))
    load = page.get_by_role("button", name="Load", exact=True)
    expect(load).to_be_enabled(timeout=30_000)
    page.locator(".st-key-data_run_name input").fill("board")
    page.locator(".st-key-data_run_name input").press("Enter")
    load.click()
    page.get_by_text("Last upload: 0 loaded, 0 skipped, 1 refused.").wait_for(timeout=60_000)
    page.get_by_text("Map a file's fields").wait_for(timeout=30_000)
    bu.wait_idle(page, "Data")
    assert page.locator(".st-key-data_map_preview_box [data-testid='stDataFrame']").count() == 1  # first rows
    _pick(page, "data_map_sampler_logprob", "rollout_logprobs")
    _pick(page, "data_map_trainer_logprob", "logprobs")
    _pick(page, "data_map_token", "response_tokens")
    page.get_by_role("button", name="Load with this mapping").click()
    page.get_by_text("Last upload: 1 loaded, 0 skipped, 0 refused.").wait_for(timeout=60_000)
    bu.wait_idle(page, "Data")
    assert page.locator("[data-testid='stException']").count() == 0
    assert page.get_by_text("Map a file's fields").count() == 0  # loaded: no longer offered


def _assert_board_loaded(db: Path, seqs: list[dict]) -> None:
    """The mapped file's values, as stored, equal its fields."""
    with Store(db, read_only=True) as store:
        tok = store.sql("SELECT * FROM tokens WHERE run = 'board' ORDER BY step, sample, pos")
        sq = store.sql("SELECT * FROM sequences WHERE run = 'board' ORDER BY step, sample")
    want = pl.DataFrame([{"s": s, "t": t, "token": w} for x in seqs for s, t, w in zip(x["s"], x["t"], x["tokens"])])
    assert tok["sampler_logprob"].to_list() == want["s"].to_list()
    assert tok["trainer_logprob"].to_list() == want["t"].to_list()
    assert tok["token"].to_list() == want["token"].to_list()
    assert sq["prompt"].to_list() == [x["prompt"] for x in seqs]
    assert sq["reward"].to_list() == [x["reward"] for x in seqs]


def test_sample_context_link_context_panel_and_mapping_form(tmp_path):
    from playwright.sync_api import sync_playwright

    seqs = make_sequences(21, steps=4, per_step=5)
    db = tmp_path / "drift.duckdb"
    with Store(db) as store:
        assert ingest_paths(store, [write_sequence_jsonl(tmp_path / "seqs.jsonl", seqs, RUN)])[0].status == "loaded"
    q = next(x for x in seqs if x["step"] == 2 and x["sample"] == 3)
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        try:
            with bu.streamlit_server(db, env=ENV) as url:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url + "/sequences")
                bu.wait_idle(page, "Sequences", timeout_ms=90_000)
                bu.fill_number(page, "seq_step", 2)
                bu.wait_idle(page, "Sequences")
                bu.fill_number(page, "seq_sample", 3)
                page.get_by_text("Sample 3 at step 2").wait_for(timeout=30_000)
                bu.wait_idle(page, "Sequences")
                _assert_shows(_sample_view(page), q)
                assert page.locator("[data-testid='stAlertContentError']").count() == 0
                query = parse_qs(urlsplit(page.url).query)
                assert query["seq_step"] == ["2"] and query["seq_sample"] == ["3"], page.url
                link = page.url.replace(url, "")

                bu.goto_page(page, "Overview", "Overview")
                traces = page.evaluate(bu.CONTEXT_JS)
                fixed_batch = page.get_by_text("Every step of the chosen runs holds 5 sequences").count()
                board_seqs = make_sequences(22, steps=2, per_step=3)
                _map_board_on_data_page(page, write_openrlhf_jsonl(tmp_path / "board.jsonl", board_seqs))
            _assert_board_loaded(db, board_seqs)
            by_axis = {t["axis"]: t for t in traces}
            steps = sorted({x["step"] for x in seqs})
            want_reward = [np.mean([x["reward"] for x in seqs if x["step"] == s]) for s in steps]
            want_len = [np.mean([len(x["s"]) for x in seqs if x["step"] == s]) for s in steps]
            want_n = [sum(x["step"] == s for x in seqs) for s in steps]
            want_adv = [np.mean([x["advantage"] for x in seqs if x["step"] == s]) for s in steps]
            assert set(want_n) == {5} and "y5" not in by_axis  # a fixed 5 a step: the count row is left out
            assert fixed_batch == 1
            for axis, want in (("y2", want_reward), ("y3", want_adv), ("y4", want_len)):
                assert by_axis[axis]["x"] == steps
                assert np.allclose(by_axis[axis]["y"], want, rtol=1e-12), (axis, by_axis[axis]["y"], want)
            assert by_axis["y"]["x"] == steps  # the drift curve shares the step axis

            with bu.streamlit_server(db, env=ENV) as fresh:  # a new process: nothing kept from the first
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(fresh + link)
                page.get_by_text("Sample 3 at step 2").wait_for(timeout=90_000)
                bu.wait_idle(page, "Sequences")
                _assert_shows(_sample_view(page), q)
        finally:
            browser.close()
