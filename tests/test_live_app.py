"""The app's live following, headless: only the host's DRIFT_WATCH_DIRS decides which folders are read (a
visitor's URL parameters or session keys name none), the sidebar shows each followed run's last step and file
age, and a viewer-mode app still follows (its database opened for the watcher's writes) and stays a viewer."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest, app_test

from analysis.record.logger import DriftLogger
from analysis.settings import SettingError
from analysis.store import Store
from ui import live
from ui.auth import md_escape

from helpers import browser as bu
from helpers.apptest import TIMEOUT, NavigationOnly
from helpers.logger import step_arrays

APP = str(bu.ROOT / "app.py")


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    monkeypatch.setattr(app_test, "PagesManager", NavigationOnly)
    monkeypatch.setenv("DRIFT_NO_DEMO", "1")
    monkeypatch.setenv("DRIFT_PREFETCH", "0")
    monkeypatch.setenv(live.INTERVAL_ENV, "0.2")
    monkeypatch.delenv("DRIFT_READ_ONLY", raising=False)
    yield
    live.stop_all()


def test_the_followed_folders_are_the_hosts_setting_and_nothing_else():
    a, b = os.path.join("srv", "logs-a"), os.path.join("srv", "logs b")
    assert live.watch_dirs({live.WATCH_DIRS_ENV: f"{a}{os.pathsep}{b}{os.pathsep} "}) == [Path(a), Path(b)]
    assert live.watch_dirs({}) == [] and live.watch_dirs({live.WATCH_DIRS_ENV: ""}) == []
    assert live.interval({}) == live.DEFAULT_INTERVAL
    assert live.interval({live.INTERVAL_ENV: "0.01"}) == 0.2 and live.interval({live.INTERVAL_ENV: "1e9"}) == 60.0
    for bad in ("0", "nan", "soon"):  # no longer the default in silence: the app refuses to start (test_settings.py)
        with pytest.raises(SettingError, match=f"^DRIFT_WATCH_INTERVAL='{bad}': expected a positive number of "):
            live.interval({live.INTERVAL_ENV: bad})


def run_app(monkeypatch, db: Path, query: dict | None = None, session: dict | None = None) -> AppTest:
    monkeypatch.setenv("DRIFT_DB", str(db))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    for k, v in (query or {}).items():
        at.query_params[k] = v
    for k, v in (session or {}).items():
        at.session_state[k] = v
    return at.run()


def wait_loaded(at: AppTest, run: str, timeout: float = 20.0) -> AppTest:
    """Rerun until the sidebar lists `run` as followed (the watcher thread loads in the background)."""
    deadline = time.monotonic() + timeout
    while not any(f"**{md_escape(run)}**" in c.value for c in at.sidebar.caption):
        assert time.monotonic() < deadline, [c.value for c in at.sidebar.caption]
        time.sleep(0.2)
        at.run()
    return at


def test_a_visitor_cannot_make_the_app_follow_another_folder(monkeypatch, tmp_path):
    allowed, other = tmp_path / "allowed", tmp_path / "elsewhere"
    DriftLogger(allowed, run="hosts-run").log_step(1, *step_arrays(1))
    DriftLogger(other, run="visitors-run").log_step(1, *step_arrays(2))
    monkeypatch.setenv(live.WATCH_DIRS_ENV, str(allowed))
    tries = {k: str(other) for k in ("watch", "dir", "folder", "path", live.WATCH_DIRS_ENV)}
    at = run_app(monkeypatch, tmp_path / "drift.duckdb", query=tries, session=dict(tries))
    at = wait_loaded(at, "hosts-run")
    assert not at.exception
    [caption] = [c.value for c in at.sidebar.caption if "**hosts\\-run**" in c.value]
    assert "live" in caption and "step 1" in caption and "last file" in caption
    assert [t.label for t in at.sidebar.toggle] == ["Follow live runs"] and at.sidebar.toggle[0].value
    assert not at.sidebar.text_input  # nowhere to type a folder
    time.sleep(1.0)  # several more polls: the other folder is never read
    at.run()
    [watcher] = live._running
    assert watcher.watcher.folders == [allowed]
    assert at.sidebar.multiselect[0].options == ["hosts-run"]  # the only run in the database


def test_without_the_setting_nothing_is_followed_whatever_the_url_says(monkeypatch, tmp_path):
    other = tmp_path / "elsewhere"
    DriftLogger(other, run="visitors-run").log_step(1, *step_arrays(2))
    monkeypatch.delenv(live.WATCH_DIRS_ENV, raising=False)
    at = run_app(monkeypatch, tmp_path / "drift.duckdb", query={live.WATCH_DIRS_ENV: str(other), "watch": str(other)})
    time.sleep(0.5)
    at.run()
    assert not at.exception
    assert live._running == [] and not at.sidebar.toggle
    assert not any("visitors-run" in c.value for c in at.sidebar.caption)


def test_a_viewer_mode_app_follows_the_hosts_folders_and_stays_in_viewer_mode(monkeypatch, tmp_path):
    logs = tmp_path / "logs"
    DriftLogger(logs, run="viewed").log_step(0, *step_arrays(0))
    Store(tmp_path / "drift.duckdb").close()  # an existing database: viewer mode would open it read-only
    monkeypatch.setenv("DRIFT_READ_ONLY", "1")
    monkeypatch.setenv(live.WATCH_DIRS_ENV, str(logs))
    at = wait_loaded(run_app(monkeypatch, tmp_path / "drift.duckdb"), "viewed")
    assert not at.exception
    assert any("viewer mode" in c.value for c in at.sidebar.caption)
