"""The logging checks in the app (AppTest): a processed-log-prob file loaded on the Data page shows the banner
naming the likely setting, Overview's headline card of that run a "check the logging first" badge, and the
Findings page the finding first; an honest run shows none of them."""
from __future__ import annotations

import io
import json

import pytest

from helpers.apptest import app_env, errors, open_app, overview_cards, texts
from helpers.sampling import synthetic_run

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_env(monkeypatch)


def board(name: str, **sampling) -> bytes:
    """A run as JSON Lines of a framework's own field names (one sequence per record), for the mapping form."""
    tok = synthetic_run(name, seed=3, n_seq=32, **sampling)
    lines = []
    for (step, sample), g in tok.group_by(["step", "sample"], maintain_order=True):
        lines.append(json.dumps({"global_step": step, "sample_idx": sample,
                                 "rollout_logprobs": g["sampler_logprob"].to_list(),
                                 "logprobs": g["trainer_logprob"].to_list()}))
    return ("\n".join(lines) + "\n").encode()


def load_mapped(at, name: str, data: bytes) -> None:
    from ui import mapping_form

    at.session_state[mapping_form.PENDING] = {f"{name}.jsonl": io.BytesIO(data)}
    at.text_input(key="data_run_name").set_value(name).run()
    for column, field in (("step", "global_step"), ("sample", "sample_idx"), ("sampler_logprob", "rollout_logprobs"),
                          ("trainer_logprob", "logprobs")):
        at.selectbox(key=f"data_map_{column}").set_value(field)
    next(b for b in at.button if b.label == "Load with this mapping").click().run()
    assert not at.exception and not errors(at), errors(at)
    assert "Last upload: 1 loaded, 0 skipped, 0 refused." in texts(at.success)


def test_processed_upload_shows_the_banner_the_badge_and_the_finding_first(monkeypatch, tmp_path):
    at = open_app(monkeypatch, tmp_path / "drift.duckdb", "pages/data.py")
    load_mapped(at, "honest", board("honest"))
    assert "Check the logging first" not in texts(at.warning)
    load_mapped(at, "processed", board("processed", top_p=0.9))
    banner = texts(at.warning).replace("\\", "")  # shown as markdown with its markup escaped
    assert "Check the logging first" in banner and "processed" in banner and "top-p / top-k" in banner

    at.switch_page("pages/overview.py").run()
    assert not at.exception and not errors(at)
    at.multiselect(key="sidebar_runs").set_value(["honest", "processed"]).run()
    checks = {card["run"]: card["check"] for card in overview_cards(at)}
    assert checks["honest"] is None and "top-p / top-k" in checks["processed"], checks

    at.switch_page("pages/findings.py").run()
    assert not at.exception and not errors(at)
    cards = [str(m.value) for m in at.markdown if "-badge[" in str(m.value)]
    processed = [c for c in cards if "sampling\\_params" in c or "sampling_params" in c]
    assert processed and "look processed by sampling parameters" in processed[0]
