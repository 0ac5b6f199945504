"""The prefetch worker's order (views that read token rows last) and its wait before each call while a page
script runs (ui/prefetch.py)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from analysis import corrections, dashboard, findings, routing
from ui import prefetch
from ui import state as S


def _sel(runs):
    return S.Selection(runs=runs, steps=None, cap=2.0, clip=0.2)


def test_views_that_read_token_rows_come_after_all_the_others():
    runs = ["a", "b"]
    kinds = {"a": "both", "b": "both"}
    for first_page, first_fn in ((None, dashboard.run_and_step_tables), ("routing", routing.routing_metrics),
                                 ("findings", corrections.compare_methods)):
        calls = prefetch.default_calls(_sel(runs), kinds, first_page)
        reads = [c[0] in prefetch.READS_TOKENS for c in calls]
        assert any(reads) and not all(reads)
        assert reads == sorted(reads), [c[0].__name__ for c in calls]  # every cheap one before every scan
        assert calls[0][0] is first_fn
        assert len(calls) == len(set(map(repr, calls)))  # each view once
    # among the scans, the first page's own come first (Findings: its cards, then its simulator's noise bands;
    # the simulator's defaults read the per-sequence summaries)
    scans = [c[0] for c in prefetch.default_calls(_sel(runs), kinds, "findings") if c[0] in prefetch.READS_TOKENS]
    assert scans[:2] == [findings.findings_table, corrections.log_ratio_quantiles]


def test_no_call_starts_while_a_page_script_runs(monkeypatch):
    """A click on another page after the worker started: its next call waits until that script finished and
    GRACE_S passed; the call already running is not the concern here (it is not stopped)."""
    monkeypatch.setattr(prefetch, "GRACE_S", 0.3)
    monkeypatch.setattr(prefetch, "_warm_lab_import", lambda: None)
    worker = prefetch._Worker()
    done: list[tuple[str, float]] = []

    def fake_call(module, name, path, version, args, kwargs):
        if args[0] == "a":
            worker.script_started()  # the user clicks another page while "a" is computed
        done.append((args[0], time.monotonic()))

    monkeypatch.setattr(S, "_cached_call", fake_call)
    app = SimpleNamespace(store=SimpleNamespace(path="x.duckdb", closing=False), version=0)
    worker.script_started()
    worker.submit(app, 0, [(len, ("a",), {}), (len, ("b",), {})])
    worker.page_done()
    deadline = time.monotonic() + 10
    while len(done) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.6)  # well past GRACE_S: "b" still waits for the other page's script
    assert [n for n, _ in done] == ["a"]
    t_done = time.monotonic()
    threading.Timer(0, worker.page_done).start()
    assert worker.idle.wait(10)
    assert [n for n, _ in done] == ["a", "b"]
    assert done[1][1] - t_done >= 0.3  # and the browser had GRACE_S to draw it
