"""The prefetch worker's order (views that read token rows last) and its wait before each call while a page
script runs (ui/prefetch.py)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from analysis.findings import ranking as findings
from analysis.metrics import corrections, dashboard, routing
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


def test_a_page_script_interrupts_the_call_in_flight_and_the_next_waits(monkeypatch):
    """A click on another page while the worker computes "a": the query of "a" is interrupted in the worker's
    thread (Store.interrupt_thread), nothing else starts until that script finished and GRACE_S passed, then
    "a" is made again and "b" follows."""
    monkeypatch.setattr(prefetch, "GRACE_S", 0.3)
    worker = prefetch._Worker()
    done: list[tuple[str, float]] = []
    interrupted = threading.Event()
    threads: list[int] = []

    class FakeStore:
        path, closing = "x.duckdb", False

        def interrupt_thread(self, ident):
            threads.append(ident)
            interrupted.set()

        def resume_thread(self):
            pass

    def fake_call(module, name, path, version, args, kwargs):
        if args[0] == "a" and not threads:
            worker.script_started()  # the user clicks another page while "a" is computed
            assert interrupted.wait(5)  # a query would raise here
            raise RuntimeError("INTERRUPT Error: Interrupted!")
        done.append((args[0], time.monotonic(), threading.get_ident()))

    monkeypatch.setattr(S, "_cached_call", fake_call)
    app = SimpleNamespace(store=FakeStore(), version=0)
    worker.script_started()
    worker.submit(app, 0, [(len, ("a",), {}), (len, ("b",), {})])
    worker.page_done()
    assert interrupted.wait(10)
    time.sleep(0.6)  # well past GRACE_S: nothing runs while the other page's script does
    assert done == []
    t_done = time.monotonic()
    threading.Timer(0, worker.page_done).start()
    assert worker.idle.wait(10)
    assert [n for n, _, _ in done] == ["a", "b"]  # "a" again, then "b"
    assert done[0][1] - t_done >= 0.3  # and the browser had GRACE_S to draw the page
    assert threads == [done[0][2]]  # the worker's own thread was interrupted, once


def test_a_script_between_calls_interrupts_nothing(monkeypatch):
    """A page script that starts while the worker waits between calls: nothing to interrupt, nothing redone."""
    monkeypatch.setattr(prefetch, "GRACE_S", 0.05)
    worker = prefetch._Worker()
    calls: list[str] = []
    monkeypatch.setattr(S, "_cached_call", lambda m, n, p, v, args, kw: calls.append(args[0]))
    store = SimpleNamespace(path="x.duckdb", closing=False, interrupt_thread=lambda ident: calls.append("interrupt"),
                            resume_thread=lambda: None)
    worker.submit(SimpleNamespace(store=store, version=0), 0, [(len, ("a",), {}), (len, ("b",), {})])
    worker.page_done()
    assert worker.idle.wait(10)
    worker.script_started()
    worker.page_done()
    assert calls == ["a", "b"]


def test_store_interrupts_only_the_named_threads_query(tmp_path):
    """Store.interrupt_thread: the long query of one thread raises StoreError and its next ones are refused until
    it calls resume_thread; another thread's query runs as usual."""
    from analysis.store import Store, StoreError
    store = Store(tmp_path / "s.duckdb")
    out: dict[str, object] = {}
    started = threading.Event()

    def long_query():
        out["ident"] = threading.get_ident()
        store.scalar("SELECT 1")  # this thread's cursor exists from here
        started.set()
        try:
            out["long"] = store.scalar("SELECT count(*) FROM range(20000000000) t(x) WHERE x % 7 = 3")
        except StoreError as e:
            out["long"] = e
        try:
            out["after"] = store.scalar("SELECT 41")
        except StoreError as e:
            out["after"] = e
        store.resume_thread()
        out["resumed"] = store.scalar("SELECT 42")

    try:
        t = threading.Thread(target=long_query)
        t.start()
        assert started.wait(10)
        time.sleep(0.3)
        assert store.scalar("SELECT 7") == 7  # this thread's query is not touched
        store.interrupt_thread(out["ident"])
        t.join(10)
        assert not t.is_alive()
        assert isinstance(out["long"], StoreError) and "nterrupt" in str(out["long"]), out["long"]
        assert isinstance(out["after"], StoreError)  # refused until the thread resumes
        assert out["resumed"] == 42
        store.interrupt_thread(threading.get_ident())  # idle: nothing runs, the next query is refused
        with pytest.raises(StoreError, match="gives way"):
            store.scalar("SELECT 8")
        store.resume_thread()
        assert store.scalar("SELECT 9") == 9
    finally:
        store.close()
