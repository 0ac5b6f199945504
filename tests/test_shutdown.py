"""Stopping the server while the background prefetch queries a large database: a clean exit (status 0, no
DuckDB abort) and a database that opens intact afterwards."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from analysis import schema
from analysis.store import Store
from ui import prefetch

from helpers import browser as bu

pytestmark = pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")

N_TOKENS = 2_500_000  # enough to keep the prefetch in DuckDB for seconds on two cores


def build_large_db(db: Path, n: int) -> None:
    """n token rows written by DuckDB itself (range()), seconds instead of minutes through the ingest path:
    400 steps x 25 sequences x ~250 positions, s <= 0, Δ small with a few larger ones."""
    store = Store(db)
    with store.transaction() as w:
        w.execute("INSERT INTO runs (run, config) VALUES ('big', '{}')")
        w.execute("INSERT INTO files (file_id, sha256, name, size, format, rows) VALUES (1, '0', 'gen', 0, 'gen', ?)",
                  [n])
        w.execute(f"""
            INSERT INTO {schema.TOKEN_STORE} (run_id, step, sample, pos, token_id, sampler_logprob, trainer_logprob,
                                              file_id)
            SELECT {w.run_id('big', now=True)}, i // 6250, (i // 250) % 25, i % 250, (i * 7919) % 5000,
                   -0.05 - ((i * 2654435761) % 1000) / 300.0 AS s,
                   -0.05 - ((i * 2654435761) % 1000) / 300.0 - ((i * 40503) % 100) / 2000.0 * (i % 3), 1
            FROM range(?) t(i)""", [n])
    store.close()


# the page's script has finished (charts may still be drawing): the prefetch worker starts GRACE_S later
SCRIPT_DONE_JS = """() => {
  const app = document.querySelector("[data-testid='stApp']");
  return !!app && app.getAttribute("data-test-script-state") === "notRunning"
    && [...document.querySelectorAll("h1")].some(e => e.textContent.trim().startsWith("Sequences"));
}"""


def test_sigterm_during_prefetch_exits_cleanly(tmp_path):
    from playwright.sync_api import sync_playwright

    db = tmp_path / "big.duckdb"
    build_large_db(db, N_TOKENS)
    log = tmp_path / "server.log"
    procs: list = []
    env = {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "1", "DRIFT_THREADS": "1"}  # one thread: slower queries
    with bu.streamlit_server(db, env=env, log=log, procs=procs) as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        # Sequences draws from one step; the worker then computes every other page's views over all tokens
        page.goto(url + "/sequences")
        page.wait_for_function(SCRIPT_DONE_JS, timeout=60_000, polling=50)
        time.sleep(prefetch.GRACE_S + 0.5)  # past the worker's grace period: it is inside DuckDB now
        proc = procs[0]
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        browser.close()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-2000:]
    assert "terminate called" not in text and "FATAL" not in text and "Traceback" not in text, text[-2000:]
    with Store(db, read_only=True) as store:
        assert store.scalar("SELECT count(*) FROM tokens") == N_TOKENS
        assert store.scalar("SELECT count(DISTINCT step) FROM tokens") == N_TOKENS // 6250
