"""The Overview's "Your framework's numbers" tab on the bundled demo runs, headless with AppTest."""
from __future__ import annotations

import pytest

from helpers.apptest import app_env, errors, open_app, open_tab

pytestmark = pytest.mark.slow  # a whole page in AppTest


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_env(monkeypatch)



def test_the_framework_tab_shows_their_metric_names_beside_ours(monkeypatch, demo_db):
    at = open_app(monkeypatch, demo_db, "pages/overview.py")
    at = open_tab(at, "overview_tab", "Your framework's numbers")
    assert not at.exception, at.exception
    assert not errors(at), errors(at)
    shown = "\n".join(t.value.to_string() for t in at.dataframe)
    assert "rollout_corr/k3_kl" in shown and "kl_k3" in shown and "same definition" in shown
    runs = at.multiselect(key="sidebar_runs").value
    assert runs and len(at.dataframe) == len(runs)  # one table per run; the drift tab's are not drawn
