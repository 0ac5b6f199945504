"""Every page headless with streamlit's AppTest on a small seeded database loaded through the real ingest path:
no exception, no error box, widgets driven by key change what is shown, empty states say what to do."""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from helpers import browser as bu
from helpers.apptest import (PAGES, app_env, errors, open_app, open_tab,
                             overview_cards, pick_table, static_tables, texts)

pytestmark = pytest.mark.slow  # AppTest runs whole pages: about 14 s of CPU for the file


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_env(monkeypatch)


@pytest.fixture(scope="module")
def shared_db(app_template_db, tmp_path_factory) -> Path:
    """Read-only use by many tests: one copy opened once by the app."""
    db = tmp_path_factory.mktemp("shared") / "drift.duckdb"
    shutil.copy(app_template_db, db)
    return db


@pytest.fixture
def own_db(app_template_db, tmp_path) -> Path:
    """A private copy for tests that write (config edit, delete, lab)."""
    db = tmp_path / "drift.duckdb"
    shutil.copy(app_template_db, db)
    return db


charts = bu.app_charts  # the charts drawn


def html_bodies(at: AppTest) -> str:
    """The pages' HTML, less ui/plot.preload's element (constant code: the one script the app sends)."""
    from ui import plot
    bodies = [e.proto.body for e in at.get("html")]
    preload = [b for b in bodies if f".st-key-{plot.PRELOAD_KEY}" in b]
    assert len(preload) <= 1 and all(b.count("<script") == 1 for b in preload)
    return "\n".join(b for b in bodies if b not in preload)


# -- every page ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", list(PAGES))
def test_every_page_runs_without_errors(monkeypatch, shared_db, page):
    at = open_app(monkeypatch, shared_db, page)
    assert at.title[0].value == PAGES[page]
    assert not errors(at), errors(at)
    assert at.multiselect(key="sidebar_runs").value == [bu.RUN_BOTH, bu.RUN_REPLAY, bu.RUN_DENSE]
    if page not in ("pages/data.py", "pages/lab.py", "pages/findings.py"):  # findings' first tab: cards
        assert charts(at) > 0


# -- sidebar and overview -----------------------------------------------------------------------------
def _card_values(at: AppTest) -> list[tuple[str, str]]:
    return [(m["label"], m["value"]) for card in overview_cards(at) for m in card["metrics"]]


def test_overview_cards_follow_the_run_selection(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db)
    cards = _card_values(at)
    assert len(cards) == 5 * 3  # five cards per run
    assert [label for label, _ in cards[:5]] == ["KL k3", "max |Δ|", "r > C", "ESS", "tokens with a flip"]
    assert cards[4][1].endswith("%") and cards[9][1] == "—"  # flips only where the trainer's routing exists

    at.multiselect(key="sidebar_runs").set_value([bu.RUN_DENSE]).run()
    assert not at.exception
    dense = _card_values(at)
    assert len(dense) == 5
    assert dense == cards[10:15]  # the dense run's cards, unchanged by what else was selected
    assert dense[0] != cards[0]

    at.multiselect(key="sidebar_runs").set_value([]).run()
    assert "Choose a run in the sidebar" in texts(at.info)


def test_sidebar_cap_and_step_range_change_the_numbers(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db)
    at.multiselect(key="sidebar_runs").set_value([bu.RUN_BOTH]).run()
    before = dict(_card_values(at))
    at.select_slider(key="sidebar_cap").set_value(1.2).run()
    after = dict(_card_values(at))
    assert float(after["r > C"].rstrip("%")) > float(before["r > C"].rstrip("%"))
    assert after["KL k3"] == before["KL k3"]  # the cap does not enter kl_k3

    assert at.slider(key="sidebar_steps").value == (0, 3)
    at.slider(key="sidebar_steps").set_range(0, 0).run()
    assert not at.exception
    assert dict(_card_values(at))["KL k3"] != after["KL k3"]
    assert "steps 0–0" in texts(at.caption)


def test_overview_metric_picker_smoothing_and_configs(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db)
    assert "token_any_flip_rate" in at.multiselect(key="overview_metrics").value
    at.multiselect(key="overview_metrics").set_value(["kl_k1", "chi2_token"])
    at.slider(key="overview_smooth").set_value(3)
    at.toggle(key="overview_logy").set_value(True).run()
    assert not at.exception and not errors(at)
    assert "**kl_k1**" in texts(at.markdown) and "**chi2_token**" in texts(at.markdown)
    cfg = static_tables(at)[-1]  # only the keys that differ
    assert set(cfg["key"]) == {"engine", "replay", "sampler_dtype"}
    at.toggle(key="overview_cfg_diff").set_value(False).run()
    assert "trainer_dtype" in set(static_tables(at)[-1]["key"])
    # another page and back: the page is as it was left
    at.switch_page("pages/sequences.py").run()
    at.switch_page("pages/overview.py").run()
    assert at.multiselect(key="overview_metrics").value == ["kl_k1", "chi2_token"]
    assert at.slider(key="overview_smooth").value == 3 and at.toggle(key="overview_logy").value
    assert not at.toggle(key="overview_cfg_diff").value


# -- token drift --------------------------------------------------------------------------------------
def test_token_drift_groupings_and_run_choice(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db, "pages/token_drift.py")
    assert [t.label for t in at.tabs] == ["Distribution", "One run in detail", "Where the mismatch lives",
                                          "Extreme tokens"]
    assert charts(at) == 2  # the first tab's two histograms; the other tabs did not run
    at.toggle(key="tokens_logy").set_value(False).run()

    open_tab(at, "tokens_tab", "Where the mismatch lives")
    assert at.radio(key="tokens_dim").options == [
        "sampler probability exp(s)", "position in the response", "response length", "sampler entropy",
        "staleness (lag)"]
    for dim in ("position", "length", "entropy", "lag"):
        at.radio(key="tokens_dim").set_value(dim)
        at.selectbox(key="tokens_bucket_metric").set_value("ratio_frac_high").run()
        assert not at.exception and not errors(at), errors(at)
        assert "**ratio_frac_high**" in texts(at.caption)
    assert "Lag = trainer_version − sampler_version" in texts(at.caption)

    open_tab(at, "tokens_tab", "One run in detail")
    assert charts(at) == 2 and "**ratio_frac_high**" not in texts(at.caption)
    at.selectbox(key="tokens_run").set_value(bu.RUN_DENSE)
    at.toggle(key="tokens_density_log").set_value(True)
    at.toggle(key="tokens_top_show").set_value(True).run()
    assert not at.exception and not errors(at)
    assert "No token occurs at least 5 times" in texts(at.caption)  # the dense run logged no token ids
    at.selectbox(key="tokens_run").set_value(bu.RUN_BOTH).run()
    assert list(at.dataframe[0].value.columns)[:2] == ["token_id", "token"]

    open_tab(at, "tokens_tab", "Extreme tokens")
    assert charts(at) == 1 and not errors(at)
    # the widgets of tabs not shown kept their values
    open_tab(at, "tokens_tab", "Where the mismatch lives")
    assert at.radio(key="tokens_dim").value == "lag"
    assert at.selectbox(key="tokens_bucket_metric").value == "ratio_frac_high"
    open_tab(at, "tokens_tab", "Distribution")
    assert at.toggle(key="tokens_logy").value is False
    open_tab(at, "tokens_tab", "One run in detail")
    assert at.selectbox(key="tokens_run").value == bu.RUN_BOTH and at.toggle(key="tokens_density_log").value

    # a run without versions or entropy: those groupings disappear and the caption says why
    at.multiselect(key="sidebar_runs").set_value([bu.RUN_DENSE]).run()
    open_tab(at, "tokens_tab", "Where the mismatch lives")
    assert at.radio(key="tokens_dim").options == [
        "sampler probability exp(s)", "position in the response", "response length"]
    assert "no `sampler_version` / `trainer_version`" in texts(at.caption)


def test_tabs_run_only_the_open_tabs_queries(monkeypatch, own_db):
    """A page runs the analysis calls of its open tab only: the others cost nothing until clicked."""
    from ui import state as S

    calls: list[str] = []
    real = S._resolve
    monkeypatch.setattr(S, "_resolve", lambda module, name: (calls.append(name), real(module, name))[1])
    at = open_app(monkeypatch, own_db, "pages/token_drift.py")  # a database of its own: nothing cached yet
    assert "drift_histograms" in calls and not {"step_histogram", "prob_density_2d", "mismatch_by"} & set(calls)
    calls.clear()
    open_tab(at, "tokens_tab", "One run in detail")
    assert {"step_histogram", "prob_density_2d"} <= set(calls) and "mismatch_by" not in calls

    calls.clear()
    at = open_app(monkeypatch, own_db, "pages/routing.py")
    assert "layer_profile" in calls and "flip_views" not in calls and "expert_load" not in calls
    open_tab(at, "routing_tab", "Flips per token")
    assert "flip_views" in calls and "expert_load" not in calls
    open_tab(at, "routing_tab", "Expert load")
    assert "expert_load" in calls


# -- routing ------------------------------------------------------------------------------------------
def test_routing_states_for_each_kind_of_run(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db, "pages/routing.py")
    assert [t.label for t in at.tabs] == ["Flips per layer", "Flips per token", "Expert load"]
    assert charts(at) == 2  # step × layer heat map and layer profile
    assert "Only the sampler's routing was recorded for moe-replay" in texts(at.warning)
    assert "on the Expert load tab" in texts(at.warning)
    at.radio(key="routing_layer_metric").set_value("overlap").run()
    assert "**overlap**" in texts(at.caption)

    open_tab(at, "routing_tab", "Flips per token")
    assert charts(at) == 3 and not errors(at)
    assert "**token_any_flip_rate**" in texts(at.caption)

    open_tab(at, "routing_tab", "Expert load")
    at.selectbox(key="routing_load_run").set_value(bu.RUN_REPLAY).run()
    at.selectbox(key="routing_load_step").set_value(2)
    at.selectbox(key="routing_load_layer").set_value(3).run()
    assert not at.exception and not errors(at), errors(at)
    assert not texts(at.info) and charts(at) == 1  # the replay run's expert load is drawn
    open_tab(at, "routing_tab", "Flips per layer")
    assert at.radio(key="routing_layer_metric").value == "overlap"  # kept while another tab was shown

    at.multiselect(key="sidebar_runs").set_value([bu.RUN_REPLAY]).run()
    heads = [h.value for h in at.subheader]
    assert heads == ["Expert load"] and charts(at) == 1 and not at.tabs
    assert "Flips need the trainer's side too" in texts(at.warning) and "shown below" in texts(at.warning)

    at.multiselect(key="sidebar_runs").set_value([bu.RUN_DENSE]).run()
    assert "None of the chosen runs has MoE routing" in texts(at.info)
    assert charts(at) == 0


# -- sequences ----------------------------------------------------------------------------------------
def test_sequences_ranking_text_and_escaping(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db, "pages/sequences.py")
    table = pick_table(at)
    assert list(table["seq_log_ratio_abs"]) == sorted(table["seq_log_ratio_abs"], reverse=True)
    at.number_input(key="seq_step").set_value(2)
    at.radio(key="seq_order").set_value("max_log_ratio_abs").run()
    table = pick_table(at)
    assert list(table["max_log_ratio_abs"]) == sorted(table["max_log_ratio_abs"], reverse=True)
    assert at.number_input(key="seq_sample").value is None  # empty box: the worst sequence is shown
    assert f"Sample {table['sample'][0]} at step 2" in [h.value for h in at.subheader]
    assert "Routing flips in this sequence" in [h.value for h in at.subheader]
    # the flip counts show at once (against the routing rows, counted here by numpy), the grid once opened
    import numpy as np

    from ui import state
    run, sample = at.selectbox(key="seq_run").value, int(table["sample"][0])
    rows = state.store().sql("SELECT pos, flip FROM routing WHERE run = $run AND step = 2 AND sample = $sample "
                             "AND flip IS NOT NULL", {"run": run, "sample": sample})  # the app's own connection
    pos, flip = rows["pos"].to_numpy(), rows["flip"].to_numpy().astype(bool)
    line = (f"{len(np.unique(pos[flip])):,} of {len(np.unique(pos)):,} tokens flipped in at least one MoE layer "
            f"({int(flip.sum()):,} of {len(flip):,} token-layer pairs)")
    assert any(c.value.startswith(line) for c in at.caption), (line, [c.value for c in at.caption])
    assert charts(at) == 1
    at.session_state["seq_flip_open"] = True
    assert charts(at.run()) == 2

    # token text is user input: every sample of the step is rendered escaped, markup never passes through
    seen_markup = False
    for sample in table["sample"]:
        at.number_input(key="seq_sample").set_value(int(sample)).run()
        body = html_bodies(at)
        assert "<script" not in body and "<img" not in body and "<b>" not in body
        seen_markup |= "&lt;script&gt;" in body or "&lt;img" in body or "&lt;b&gt;" in body
    assert seen_markup

    assert "n_flips" in table.columns  # this run has the trainer's routing

    at.selectbox(key="seq_run").set_value(bu.RUN_DENSE).run()
    assert not at.exception and not errors(at)
    assert "Routing flips in this sequence" not in [h.value for h in at.subheader]
    # no routing and no sequences file: the columns they would fill are left out, and the caption says so
    dense = pick_table(at)
    assert not {"n_flips", "reward", "advantage"} & set(dense.columns) and "response_length" in dense.columns
    assert "Not in this run's logs, so not shown: n_flips, reward, advantage." in texts(at.caption)


# -- compare ------------------------------------------------------------------------------------------
def test_compare_needs_two_runs_and_follows_the_baseline(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db, "pages/compare.py")
    cfg = at.dataframe[0].value
    assert set(cfg["key"]) == {"engine", "replay", "sampler_dtype"}
    deltas = at.dataframe[1].value
    assert f"{bu.RUN_REPLAY}_delta" in deltas.columns and f"{bu.RUN_BOTH} (baseline)" in deltas.columns
    at.selectbox(key="compare_baseline").set_value(bu.RUN_DENSE).run()
    deltas = at.dataframe[1].value
    assert f"{bu.RUN_BOTH}_delta" in deltas.columns and f"{bu.RUN_DENSE}_delta" not in deltas.columns
    at.multiselect(key="compare_metrics").set_value(["kl_k2"]).run()
    assert "**kl_k2**" in texts(at.markdown) and charts(at) == 1
    assert [t.label for t in at.tabs] == ["Metric deltas", "Distributions", "Routing"]

    open_tab(at, "compare_tab", "Distributions")
    assert charts(at) == 3 and not errors(at) and len(at.dataframe) == 1  # histogram, F(τ), per-step curves
    open_tab(at, "compare_tab", "Routing")
    assert charts(at) == 1 and "**Routing flip rate per layer**" in texts(at.markdown)
    open_tab(at, "compare_tab", "Metric deltas")  # the baseline and the charted metrics were kept
    assert at.selectbox(key="compare_baseline").value == bu.RUN_DENSE
    assert at.multiselect(key="compare_metrics").value == ["kl_k2"]

    at.multiselect(key="sidebar_runs").set_value([bu.RUN_BOTH, bu.RUN_DENSE]).run()
    assert [t.label for t in at.tabs] == ["Metric deltas", "Distributions", "Routing"]
    at.multiselect(key="sidebar_runs").set_value([bu.RUN_DENSE, bu.RUN_REPLAY]).run()
    assert [t.label for t in at.tabs] == ["Metric deltas", "Distributions"]  # no run with both routing sides

    at.multiselect(key="sidebar_runs").set_value([bu.RUN_BOTH]).run()
    assert "at least 2 runs" in texts(at.info)


# -- data: config edit, delete, downloads ------------------------------------------------------------
def test_data_config_edit_validates_and_saves(monkeypatch, own_db):
    at = open_app(monkeypatch, own_db, "pages/data.py")
    at.selectbox(key="data_cfg_run").set_value(bu.RUN_DENSE).run()
    assert '"engine": "sglang"' in at.text_area(key="data_cfg_text").value

    at.text_area(key="data_cfg_text").set_value('{"engine": "sglang", oops}')
    at.button(key="data_cfg_save").click().run()
    assert any("Config not saved: not valid JSON" in e for e in errors(at))
    at.text_area(key="data_cfg_text").set_value('["not", "an", "object"]')
    at.button(key="data_cfg_save").click().run()
    assert any("expected a JSON object" in e for e in errors(at))

    at.text_area(key="data_cfg_text").set_value('{"engine": "sglang", "sampler_dtype": "fp16", "top_p": 0.95}')
    at.button(key="data_cfg_save").click().run()
    assert not errors(at)
    assert "Saved the config of dense (3 keys)." in texts(at.success)
    at.switch_page("pages/overview.py").run()
    at.toggle(key="overview_cfg_diff").set_value(False).run()
    cfg = static_tables(at)[-1]
    assert cfg.set_index("key").loc["top_p", bu.RUN_DENSE] == "0.95"


def test_data_delete_needs_the_typed_name(monkeypatch, own_db):
    at = open_app(monkeypatch, own_db, "pages/data.py")
    at.selectbox(key="data_del_run").set_value(bu.RUN_REPLAY).run()
    assert at.button(key="data_del_button").disabled
    at.text_input(key="data_del_confirm").set_value("moe").run()
    assert at.button(key="data_del_button").disabled
    at.text_input(key="data_del_confirm").set_value(bu.RUN_REPLAY).run()
    assert not at.button(key="data_del_button").disabled
    at.button(key="data_del_button").click().run()
    assert not at.exception and not errors(at)
    assert at.multiselect(key="sidebar_runs").options == [bu.RUN_BOTH, bu.RUN_DENSE]
    assert bu.RUN_REPLAY not in at.selectbox(key="data_del_run").options
    assert [t.value for t in at.toast] == [f"Deleted run {bu.RUN_REPLAY}"]


def test_data_page_lists_runs_and_offers_downloads(monkeypatch, shared_db):
    at = open_app(monkeypatch, shared_db, "pages/data.py")
    runs = at.dataframe[0].value
    assert list(runs["run"]) == [bu.RUN_BOTH, bu.RUN_REPLAY, bu.RUN_DENSE]
    assert runs["n_tokens"].min() > 0 and list(runs["has_trainer_routing"]) == [True, False, False]
    at.selectbox(key="data_dl_by").set_value("layer").run()
    assert "--by layer" in texts(at.caption)
    assert at.get("download_button")


# -- lab ----------------------------------------------------------------------------------------------
def test_lab_run_is_loaded_as_a_new_run(monkeypatch, own_db):
    """The page's flow (settings → lab → ingest → link) with the lab's compute replaced by a tiny logger run;
    the lab itself is tested by its own tests."""
    import numpy as np

    import analysis.lab
    from analysis.record.logger import DriftLogger

    calls = {}

    def fake_run_lab(preset, out_dir, steps=None, seed=0, device="cpu", run=None, **overrides):
        calls.update(preset=preset, steps=steps, run=run, **overrides)
        log = DriftLogger(out_dir, run, {"preset": preset, **overrides})
        rng = np.random.default_rng(seed)
        for step in range(steps):
            s = -rng.exponential(1.0, (2, 3))
            log.log_step(step, s, np.minimum(s + rng.normal(0, 0.01, (2, 3)), 0.0), np.ones((2, 3)))
        return {"preset": preset, "run": run, "steps": steps, "n_tokens": 6 * steps, "kl_k3": 0.0,
                "token_any_flip_rate": 0.0, "reward_first": 0.5, "reward_last": 0.5, "seconds": 0.1,
                "out": str(log.dir)}

    monkeypatch.setattr(analysis.lab, "run_lab", fake_run_lab)
    at = open_app(monkeypatch, own_db, "pages/lab.py")
    at.selectbox(key="lab_preset").set_value("bf16-replay").run()
    assert at.selectbox(key="lab_replay").value == "ids"  # the preset's switches
    at.selectbox(key="lab_preset").set_value("bf16-async-icepop").run()
    assert at.selectbox(key="lab_replay").value == "none" and at.number_input(key="lab_lag").value == 1
    assert at.selectbox(key="lab_correction").value == "icepop"
    at.selectbox(key="lab_correction").set_value("tis")
    at.selectbox(key="lab_replay").set_value("ids+weights")
    at.toggle(key="lab_fp32_head").set_value(True)
    at.number_input(key="lab_steps").set_value(2)
    at.number_input(key="lab_batch").set_value(4)
    at.text_input(key="lab_run_name").set_value("my-lab").run()
    at.button(key="lab_start").click().run()
    assert not at.exception and not errors(at), errors(at)
    assert calls["preset"] == "bf16-async-icepop" and calls["replay"] == "ids+weights" and calls["fp32_head"] is True
    assert calls["correction"] == "tis" and calls["lag"] == 1
    assert calls["steps"] == 2 and calls["batch"] == 4 and calls["run"] == "my-lab"
    assert "Last lab run: my-lab" in [h.value for h in at.subheader]
    at.run()  # the sidebar picks up the new run and selects it
    assert "my-lab" in at.multiselect(key="sidebar_runs").value

    at.text_input(key="lab_run_name").set_value("my-lab")
    at.button(key="lab_start").click().run()
    assert any("exists already" in e for e in errors(at))


# -- modes and empty states ---------------------------------------------------------------------------
def test_viewer_mode_hides_every_write(monkeypatch, own_db):
    monkeypatch.setenv("DRIFT_READ_ONLY", "1")  # and the database is opened read-only
    at = open_app(monkeypatch, own_db, "pages/data.py")
    assert "viewer mode" in texts(at.info)
    keys = {w.key for w in at.button} | {w.key for w in at.text_area} | {w.key for w in at.text_input}
    assert not keys & {"data_load", "data_cfg_save", "data_cfg_text", "data_del_button", "data_del_confirm"}
    assert list(at.dataframe[0].value["run"])[0] == bu.RUN_BOTH  # reading stays possible
    at.switch_page("pages/lab.py").run()
    assert "viewer mode" in texts(at.info)
    assert not [b for b in at.button if b.key == "lab_start"]


def test_kernels_warmed_only_where_the_app_can_ingest(monkeypatch, own_db, tmp_path):
    from analysis.ingest import warm
    from ui import state
    started = []
    monkeypatch.setattr(warm, "start_in_background", lambda: started.append(time.monotonic()))
    monkeypatch.setattr(state, "WARM_DELAY_S", 0.5)  # after the first page (5 s in the app)
    monkeypatch.setenv("DRIFT_READ_ONLY", "1")
    open_app(monkeypatch, own_db)
    time.sleep(1.0)
    assert started == []  # a viewer never ingests
    monkeypatch.delenv("DRIFT_READ_ONLY")
    writable = tmp_path / "writable.duckdb"
    shutil.copy(own_db, writable)
    t0 = time.monotonic()
    open_app(monkeypatch, writable)
    deadline = time.monotonic() + 10
    while not started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(started) == 1 and started[0] - t0 >= 0.5  # once, and not before the delay


@pytest.mark.parametrize("page", list(PAGES))
def test_empty_database_says_what_to_do(monkeypatch, tmp_path, page):
    at = open_app(monkeypatch, tmp_path / "empty.duckdb", page)
    assert not errors(at)
    shown = texts(at.info)
    if page == "pages/data.py":
        assert "No runs yet" in shown
    elif page == "pages/lab.py":
        assert at.button(key="lab_start")
    else:
        assert "The database has no runs yet" in shown and charts(at) == 0
    assert "No runs yet. Load logs on the Data page" in shown or page in ("pages/data.py", "pages/lab.py")


def test_empty_database_loads_the_demo(monkeypatch, tmp_path):
    """Without DRIFT_NO_DEMO an empty database gets the demo runs (here: the fixture logs as demo folder)."""
    import analysis.ingest.demo

    demo = tmp_path / "demo"
    bu.write_fixture_logs(demo / "fixture")
    real = analysis.ingest.demo.ensure_demo
    monkeypatch.setattr(analysis.ingest.demo, "ensure_demo", lambda store: real(store, demo_dir=demo))
    monkeypatch.delenv("DRIFT_NO_DEMO")
    at = open_app(monkeypatch, tmp_path / "fresh.duckdb")
    assert sorted(at.multiselect(key="sidebar_runs").options) == sorted([bu.RUN_BOTH, bu.RUN_REPLAY, bu.RUN_DENSE])
    assert "loaded the demo runs" in texts(at.toast)
    at.run()
    assert not at.toast  # said once per session
    assert "loaded the demo runs" in texts(open_app(monkeypatch, tmp_path / "fresh.duckdb").toast)  # a new session
    import ui.sidebar
    monkeypatch.setattr(ui.sidebar, "DEMO_NOTICE_S", 0.0)  # a session long after the load is not told
    later = open_app(monkeypatch, tmp_path / "fresh.duckdb")
    assert not later.toast and len(later.multiselect(key="sidebar_runs").options) == 3


def test_prefetch_warms_the_other_pages(monkeypatch, own_db):
    """After the Overview has drawn, the background prefetch computes the other pages' default views with the
    pages' exact arguments, Sequences' worst sequence opened included: visiting them then runs no analysis query
    but the expert-load step's per-layer list and routing details."""
    from ui import prefetch
    from ui import state as S

    monkeypatch.setenv("DRIFT_PREFETCH", "1")
    open_app(monkeypatch, own_db)
    assert prefetch.wait_idle(60)
    misses = []
    real = S._resolve
    monkeypatch.setattr(S, "_resolve", lambda module, name: (misses.append(name), real(module, name))[1])
    monkeypatch.setenv("DRIFT_PREFETCH", "0")
    for page in ("pages/token_drift.py", "pages/routing.py", "pages/compare.py", "pages/sequences.py"):
        open_app(monkeypatch, own_db, page)
    at = open_app(monkeypatch, own_db, "pages/findings.py")
    for tab in ("Waterfall", "Correction simulator"):  # the waterfall's ranges follow from the run's steps
        open_tab(at, "findings_tab", tab)
        assert charts(at) >= 1 and not errors(at), tab
    assert not {"worst_sequences", "sequence_context", "sequence_tokens", "sequence_flip_grid"} & set(misses), misses
    heavy = [m for m in misses if m not in {"expert_load", "Store.files"}]
    # allowed: the expert-load step's per-layer list (one step only) and compare's all-keys-free config table
    assert set(heavy) <= {"routing_metrics", "routing_kinds"}, misses
    assert heavy.count("routing_metrics") <= 1, misses


def test_prefetch_waits_for_the_page_to_finish_and_draw(monkeypatch):
    """The worker computes nothing while the page's script runs, nor in the GRACE_S after it, when the browser
    draws; a newer job (another selection) replaces a queued one."""
    import time
    from types import SimpleNamespace

    from ui import prefetch
    from ui import state as S

    done: list[tuple[str, float]] = []
    monkeypatch.setattr(S, "_cached_call", lambda module, name, path, version, args, kwargs:
                        done.append((args[0], time.monotonic())))
    monkeypatch.setattr(prefetch, "GRACE_S", 0.3)
    app = SimpleNamespace(store=SimpleNamespace(path="x.duckdb", closing=False, resume_thread=lambda: None,
                                                interrupt_thread=lambda ident: None), version=0)
    call = lambda name: (len, (name,), {})  # noqa: E731
    worker = prefetch._Worker()
    worker.submit(app, 0, [call("old")])
    worker.submit(app, 0, [call("a"), call("b")])  # replaces "old" before it started
    time.sleep(0.5)
    assert done == []  # the page has not said it finished
    t0 = time.monotonic()
    worker.page_done()
    assert worker.idle.wait(10)
    assert [name for name, _ in done] == ["a", "b"]
    assert done[0][1] - t0 >= 0.3


# -- findings -------------------------------------------------------------------------------------------
def test_findings_cards_waterfall_simulator_and_gates(monkeypatch, shared_db):
    from analysis.findings import ranking as findings
    from ui import state as S
    at = open_app(monkeypatch, shared_db, "pages/findings.py")
    assert not errors(at), errors(at)
    md = texts(at.markdown)
    # what the cards must show: analysis.findings.ranking' own list, from the database the app holds open
    want = findings.findings_many(S.store(), [bu.RUN_BOTH, bu.RUN_REPLAY, bu.RUN_DENSE])
    plain = md.replace("\\", "")  # the page escapes markdown characters
    for run, items in want.items():
        for f in items:
            assert f"`{f.kind}`" in md and f.title in plain and f.source in plain, (run, f.kind, f.title)
    assert "-badge[" in md
    links = {(p.help.split(": ")[-1], p.query_string) for p in (e.proto for e in at.get("page_link"))}
    urls = {f.url for items in want.values() for f in items}
    assert {u for u, _ in links} == urls  # one link per evidence view, with its query (tab, grouping)
    assert all(u.endswith(q) for u, q in links)
    assert [t.label for t in at.tabs] == ["Findings", "Waterfall", "Correction simulator", "Gates"]
    assert charts(at) == 0  # the other tabs did not run

    open_tab(at, "findings_tab", "Waterfall")
    assert charts(at) == 1 and not errors(at)
    open_tab(at, "findings_tab", "Correction simulator")
    assert charts(at) == 2 and not errors(at)  # simulator curves, noise vs bands
    table = at.dataframe[0].value  # the simulator's per-run table: one row per chosen method
    assert list(table["method"]) == ["icepop", "geo_rs", "seq_rs"]
    at.multiselect(key="findings_methods").set_value(["icepop"])
    at.number_input(key="findings_icepop_alpha").set_value(0.99).run()
    assert not at.exception and not errors(at), errors(at)
    table = at.dataframe[0].value
    assert list(table["method"]) == ["icepop"] and '"alpha": 0.99' in table["params"][0]
    # a bad band says what is wrong instead of a traceback
    at.number_input(key="findings_icepop_alpha").set_value(9.0).run()
    assert any("alpha must be < beta" in e for e in errors(at))
    # another run for the waterfall
    at.selectbox(key="findings_run").set_value(bu.RUN_DENSE).run()
    open_tab(at, "findings_tab", "Waterfall")
    assert at.slider(key="findings_b").value[1] == 4 and not at.exception
    open_tab(at, "findings_tab", "Gates")
    assert charts(at) == 1  # the pass/fail grid
    gates = at.dataframe[-1].value
    assert set(gates["run"]) == {bu.RUN_BOTH, bu.RUN_REPLAY, bu.RUN_DENSE} and gates["passed"].dtype == bool


def test_simulator_says_which_choices_read_thinned_token_rows(monkeypatch, own_db):
    """tis (and icepop off the bands) read token rows, thinned on a large selection: the caption names them; the
    default choices come from the summaries and say nothing about thinning."""
    from analysis.metrics import sampled
    monkeypatch.setattr(sampled, "THIN_TOKENS", 50)  # this small database is then "large"
    at = open_app(monkeypatch, own_db, "pages/findings.py")
    open_tab(at, "findings_tab", "Correction simulator")
    assert not errors(at) and not any("from token rows" in str(c.value) for c in at.caption)
    at.multiselect(key="findings_methods").set_value(["tis", "geo_rs"]).run()
    assert not at.exception and not errors(at), errors(at)
    said = [str(c.value) for c in at.caption if "from token rows" in str(c.value)]
    assert len(said) == 1 and said[0].startswith("tis: from token rows") and "estimated from every" in said[0]


# -- drift in context: prompt, response and reward; context over steps; field mapping --------------------
def frame_with(at: AppTest, column: str):
    """The first st.dataframe holding `column` (a display-only dataframe has no key to find it by)."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


@pytest.fixture(scope="module")
def context_db(tmp_path_factory):
    """Sequence JSON Lines with prompts, responses, rewards and advantages (tests/helpers/context.py)."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store

    from helpers.context import make_sequences, write_sequence_jsonl

    root = tmp_path_factory.mktemp("context")
    seqs = make_sequences(31, steps=3, per_step=6)
    with Store(root / "drift.duckdb") as store:
        assert ingest_paths(store, [write_sequence_jsonl(root / "s.jsonl", seqs, "ctx")])[0].status == "loaded"
    return root / "drift.duckdb", seqs


def test_sequences_show_a_typed_sample_in_context(monkeypatch, context_db):
    db, seqs = context_db
    at = open_app(monkeypatch, db, "pages/sequences.py")
    at.number_input(key="seq_step").set_value(1)
    at.number_input(key="seq_sample").set_value(4).run()
    assert not at.exception and not errors(at)
    q = next(x for x in seqs if x["step"] == 1 and x["sample"] == 4)
    shown = [t.value for t in at.text]
    assert q["prompt"] in shown and q["response"] in shown
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["reward"] == f"{q['reward']:.4g}" and metrics["response length"] == str(len(q["s"]))
    assert float(metrics["advantage"]) == pytest.approx(q["advantage"], abs=5e-4)
    at.session_state["seq_numbers"] = True  # the token table is drawn once its expander is opened
    table = frame_with(at.run(), "Δ")
    assert list(table.columns) == ["pos", "token_id", "token", "s", "t", "Δ", "r", "flipped_layers"]
    assert list(table["s"]) == q["s"] and list(table["t"]) == q["t"] and list(table["token"]) == q["tokens"]
    assert list(table["Δ"]) == pytest.approx([t - s for s, t in zip(q["s"], q["t"])], abs=1e-12)

    at.selectbox(key="seq_reward").set_value("at_least").run()
    at.number_input(key="seq_reward_at").set_value(1.0).run()
    worst = pick_table(at)
    assert set(worst["reward"]) == {1.0}
    assert sorted(worst["sample"]) == sorted(x["sample"] for x in seqs if x["step"] == 1 and x["reward"] >= 1)
    at.number_input(key="seq_sample").set_value(99).run()
    assert "No sample 99 at step 1 of ctx: its samples are 0–5." in texts(at.info)


def test_overview_context_table_holds_the_seeded_numbers(monkeypatch, context_db):
    db, seqs = context_db
    at = open_app(monkeypatch, db)
    assert not [d for d in at.dataframe if "reward_mean" in d.value.columns]  # drawn once its expander is open
    at.session_state["overview_context_numbers"] = True
    ctx = frame_with(at.run(), "reward_mean")
    for row in ctx.itertuples():
        qs = [x for x in seqs if x.get("step") == row.step]
        assert row.n_sequences == len(qs)
        assert row.reward_mean == pytest.approx(sum(x["reward"] for x in qs) / len(qs), rel=1e-12)
        assert row.response_length_mean == pytest.approx(sum(len(x["s"]) for x in qs) / len(qs), rel=1e-12)
    assert list(ctx["step"]) == [0, 1, 2]
    # the r > C card gives the count of tokens beside its share (C = 2)
    n = sum(len(x["s"]) for x in seqs)
    high = sum(t - s > math.log(2.0) for x in seqs for s, t in zip(x["s"], x["t"]))
    assert f"{high:,} of {n:,} tokens" in [c for card in overview_cards(at) for m in card["metrics"]
                                            for c in m["captions"]]


def test_data_mapping_form_loads_and_refuses(monkeypatch, tmp_path):
    """The form a refused upload is offered (here put in the session directly: AppTest cannot upload)."""
    import io

    from ui import mapping_form

    from helpers.context import make_sequences, openrlhf_record

    seqs = make_sequences(32, steps=2, per_step=2)
    data = "".join(json.dumps(openrlhf_record(q)) + "\n" for q in seqs).encode()
    db = tmp_path / "drift.duckdb"
    at = open_app(monkeypatch, db, "pages/data.py")
    at.session_state[mapping_form.PENDING] = {"board.jsonl": io.BytesIO(data)}
    at.text_input(key="data_run_name").set_value("board").run()  # the board's records name no run
    assert "Map a file's fields" in [h.value for h in at.subheader]
    assert at.selectbox(key="data_map_step").value == "step"  # same-named fields are preselected
    at.selectbox(key="data_map_sampler_logprob").set_value("response")
    at.selectbox(key="data_map_trainer_logprob").set_value("logprobs")
    submit = lambda: next(b for b in at.button if b.label == "Load with this mapping")  # noqa: E731
    submit().click().run()
    assert errors(at) == ["refused board.jsonl: line 1, field 'response': mapped to sampler_logprob, it must hold a "
                          f"number, got str {seqs[0]['response']!r} (map each column to the field that holds it, "
                          "e.g. --map sampler_logprob=rollout_logprobs)"]
    assert any("No runs yet" in t for t in texts(at.info).splitlines())  # nothing of the refused file was loaded
    at.selectbox(key="data_map_sampler_logprob").set_value("rollout_logprobs")
    submit().click().run()
    assert not at.exception and not errors(at)
    assert "Last upload: 1 loaded, 0 skipped, 0 refused." in texts(at.success)
    runs = frame_with(at, "n_tokens")
    assert list(runs["n_tokens"]) == [sum(len(q["s"]) for q in seqs)]

