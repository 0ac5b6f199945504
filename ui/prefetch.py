"""Warm the cache for the other pages' default views while the user reads the current one.

On a large database one page's queries take a second (each scans millions of tokens); the user mostly looks at
a page for longer than that. Once a page has run and the browser has had a moment to draw it, one background
thread computes what every page (and every tab) shows first for the same selection, through the same cache,
the current page's other tabs first, so that the next click is served from it; views that read every token row
(READS_TOKENS) come after all the rest. Before each call it waits until no page script is running and the last
one finished GRACE_S ago, because the browser and DuckDB share the machine's cores: computing while the browser
draws delayed the first page by seconds.
Calls that are already cached cost nothing. When a page script starts, the call in flight gives way: its query
is interrupted (in the worker's thread only) and the call is made again once the pages are quiet, so a page never
shares the cores with a background scan; it computes what it needs that is not cached yet itself.
torch is not imported here: it took ~1.3 s of a core and ~300 MB of the server's memory at every start, for a
Lab run that most visits never make (the Lab page imports it when a run starts).
DRIFT_PREFETCH=0 turns this off.
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Callable

from analysis import settings
from analysis.findings import decomposition, pairs
from analysis.findings import ranking as findings
from analysis.metrics import (
    buckets,
    compare,
    context,
    corrections,
    dashboard,
    distributions,
    drilldown,
    load_views,
    routing,
    sampled,
)
from analysis.metrics.frameworks import compare as frameworks
from ui import nav, sequence_view
from ui import state as S

Call = tuple[Callable, tuple, dict]
GRACE_S = 1.0  # after the page's script has finished: the browser draws it before the worker takes the cores
MAX_GIVE_WAY = 20  # interrupted calls made again per selection; past that, the pages compute what they need
# Views whose query reads token rows (every row of the selection, or up to sampled.THIN_TOKENS / quantiles.
# EXACT_TOKENS of them: up to seconds at tens of millions of tokens, where the rest read summaries in tens of
# milliseconds): queued after all the others, so that one of them does not hold up the cheap views of every page.
READS_TOKENS = {distributions.prob_density_2d, findings.findings_table,
                corrections.log_ratio_quantiles,
                frameworks.comparison}  # prime-rl's median and our kl_k3 median need every token


def _steps_in(run: str, steps: tuple[int, int] | None) -> list[int]:
    """The run's logged steps within the sidebar's step range (all of them without one), as the pages list them."""
    return [s for s in S.cached(drilldown.run_steps, run) if not steps or steps[0] <= s <= steps[1]]


def waterfall_default(run: str, steps: tuple[int, int] | None) -> None:
    """Findings › Waterfall as it first shows (pages/findings.py, waterfall_tab, its sliders untouched): the first
    and the last third of the run's steps in the selection. Its decomposition reads token rows (~1 s at 40M
    tokens) with arguments that follow from the run's steps, so it is worked out here, through the page's cache
    keys, rather than listed up front."""
    halves = decomposition.thirds(_steps_in(run, steps))
    if halves is not None:
        a, b = halves
        thin = S.cached(sampled.thin_steps, [run], (a, b))
        S.cached(decomposition.decompose, run, a, b, thin.steps)


def sequences_default(run: str, steps: tuple[int, int] | None) -> None:
    """Sequences as it first shows (pages/sequences.py, no widget touched): the run's first step in the
    selection, its worst sequences by |ΣΔ| with any reward, and the worst one opened (context, tokens, its prompt's
    group, the run's colour scale, routing flips). Its arguments follow from the run's steps and the ranking, so
    they are worked out here."""
    run_steps = _steps_in(run, steps)
    if not run_steps:
        return
    step = sequence_view.nearest(run_steps, 0)  # the step box's default, 0, moved to a logged step
    worst = S.cached(drilldown.worst_sequences, run, step, order=next(iter(sequence_view.ORDERS)),
                     n=sequence_view.WORST_N, **sequence_view.reward_bounds("any", 1.0))
    if worst is None or worst.is_empty():
        return
    sample = int(worst["sample"][0])
    if S.cached(drilldown.sequence_context, run, step, sample) is None:
        return
    S.cached(drilldown.sequence_tokens, run, step, sample)
    S.cached(drilldown.sample_group, run, step, sample)
    S.cached(drilldown.delta_scale, run)
    if S.cached(dashboard.routing_kinds, [run]).get(run) == "both":
        S.cached(drilldown.sequence_flip_grid, run, step, sample)


# called as they are (they make their own cached calls); the rest through the cache
DERIVED = {waterfall_default, sequences_default}
READS_TOKENS.add(waterfall_default)
_started: set[tuple] = set()
_lock = threading.Lock()


def enabled() -> bool:
    return settings.PREFETCH.read()


def default_calls(sel: S.Selection, kinds: dict[str, str], first_page: str | None = None) -> list[Call]:
    """What each page computes before any widget is touched, with the exact arguments the pages use
    (a different argument is a different cache entry). Page by page in the sidebar's order, `first_page`
    (a page's url, e.g. "token_drift") first."""
    runs, steps, cap, clip = sel.runs, sel.steps, sel.cap, sel.clip
    first = runs[0]
    both = [r for r in runs if kinds.get(r) == "both"]
    routed = [r for r in runs if kinds.get(r, "none") != "none"]
    pages: dict[str, list[Call]] = {
        nav.OVERVIEW.url: [
            (dashboard.run_and_step_tables, (runs,), dict(cap=cap, clip=clip, steps=steps)),
            (context.step_context, (runs,), dict(steps=steps)),
            (frameworks.comparison, (runs,), dict(steps=steps)),  # its second tab
        ],
        nav.TOKENS.url: [
            (distributions.drift_histograms, (runs,), dict(n_bins=80, steps=steps)),
            (distributions.step_histogram, (first,), dict(n_bins=60, steps=steps)),
            (distributions.prob_density_2d, ([first],), dict(n_bins=100, steps=steps, thin=True)),
            (sampled.thin_steps, ([first], (steps,)), {}),
            (sampled.sample_label, ([first],), {}),
            (buckets.has_column_data, (runs, "sampler_entropy"), {}),
            (buckets.has_column_data, (runs, "sampler_version"), {}),
            (buckets.mismatch_by, (runs, "prob"), dict(cap=cap, clip=clip, steps=steps, metrics=["kl_k3"])),
            (dashboard.full_distribution, (runs,), dict(steps=steps)),  # decides whether its tab shows
        ],
        nav.ROUTING.url: [
            (routing.routing_metrics, ([both[0]],), dict(by="layer", steps=steps)),
            (routing.layer_profile, (both,), dict(steps=steps)),
            (routing.flip_views, (both,), dict(steps=steps)),  # the page derives its three flip charts
            (dashboard.routing_weight_runs, ([both[0]],), {}),
        ] if both else [],
        # the Expert load page opens on the first run with routing, its sampler side, config n and ranks
        nav.EXPERT_LOAD.url: [(load_views.views, (routed[0], steps, "sampler", None, None), {})] if routed else [],
        nav.SEQUENCES.url: [(drilldown.run_steps, (first,), {}), (sampled.sample_label, ([first],), {}),
                            (sequences_default, (first, steps), {})],
        nav.COMPARE.url: [
            (compare.config_diff, (runs,), {}),
            (pairs.has_partners, (runs,), {}),
            (dashboard.run_and_step_tables, (runs,), dict(cap=cap, clip=clip, steps=steps)),
            (compare.routing_rates, (runs,), dict(steps=steps)),
            (distributions.drift_histograms, (runs,), dict(n_bins=80, steps=steps)),
        ] if len(runs) > 1 else [],
        nav.FINDINGS.url: [
            (findings.findings_table, (runs,), dict(steps=steps, cap=cap, clip=clip, baselines=[])),
            (corrections.compare_methods, ([first], [(m, dict(corrections.METHODS[m].defaults))
                                                     for m in ("icepop", "geo_rs", "seq_rs")]),
             dict(steps=steps, thin=True)),
            (pairs.trainer_self_table, (runs,), dict(steps=steps)),  # its "Against partner runs"
            (pairs.replay_table, (runs,), dict(steps=steps)),
            (sampled.thin_steps, ([first], (steps,)), {}),
            (corrections.log_ratio_quantiles, ([first],), dict(by="step", steps=steps)),
            (waterfall_default, (first, steps), {}),
        ],
    }
    first_page = first_page or nav.OVERVIEW.url  # the default page's url_path is ""
    order = sorted(pages, key=lambda url: url != first_page)  # stable: the rest keep the sidebar's order
    calls: list[Call] = []
    for url in order:
        calls += [c for c in pages[url] if c not in calls]
    return sorted(calls, key=lambda c: c[0] in READS_TOKENS)  # stable: page order kept within each group


class _Worker:
    """One background thread; a newer selection replaces the pending one and interrupts the current one."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._job: tuple[S.AppDB, int, list[Call]] | None = None
        self._thread: threading.Thread | None = None
        self.idle = threading.Event()
        self.idle.set()
        self._page_done = threading.Event()
        self._stopping = False
        self._scripts = 0  # page scripts running now (any session)
        self._quiet_since = time.monotonic()  # when the last one finished
        self._in_call: tuple[object, int] | None = None  # (store, worker thread) while a call runs
        self._gave_way = False  # the running call was interrupted for a page script

    def submit(self, app: S.AppDB, version: int, calls: list[Call]) -> None:
        with self._cv:
            self._job = (app, version, calls)
            self._page_done.clear()
            self.idle.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="driftscope-prefetch", daemon=True)
                self._thread.start()
            self._cv.notify()

    def script_started(self) -> None:
        """A page script starts (any session): the call in flight, if any, gives way. Its query is interrupted
        and the call is made again once the pages are quiet: a prefetch query running on while the user's page
        computes took the page's CPU (a first visit right after the first load: 1.5 s of server CPU, mostly
        the prefetch's token scans, against 0.2 s once the prefetch was done; benchmarks/RESULTS-pages.md)."""
        with self._cv:  # under the lock: the worker clears _in_call, then resumes its thread, after this
            self._scripts += 1
            if self._in_call is not None:
                self._gave_way = True
                store, ident = self._in_call
                store.interrupt_thread(ident)

    def page_done(self) -> None:
        with self._cv:
            self._scripts = max(0, self._scripts - 1)
            self._quiet_since = time.monotonic()
            self._page_done.set()
            self._cv.notify_all()

    def _wait_quiet(self, limit: float = 60.0) -> None:
        """Before each call: wait until no page script runs and the last one finished GRACE_S ago (the browser
        is drawing it), so that a click on another page does not share the cores with a prefetch query started
        meanwhile (one already running is interrupted by `script_started` and made again). At most `limit`
        seconds (a page that never says it finished holds nothing up for long)."""
        deadline = time.monotonic() + limit
        with self._cv:
            while not (self._stopping or self._job is not None):
                now = time.monotonic()
                grace_left = GRACE_S - (now - self._quiet_since)
                if (self._scripts == 0 and grace_left <= 0) or now >= deadline:
                    return
                self._cv.wait(min(grace_left, deadline - now) if self._scripts == 0 else deadline - now)

    def stop(self, timeout: float = 10.0) -> None:
        """At exit: no further call starts; wait for the thread (the Store interrupts a query in flight)."""
        with self._cv:
            self._stopping = True
            self._page_done.set()
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._stopping:
                    self.idle.set()
                    self._cv.wait()
                if self._stopping:
                    self.idle.set()
                    return
                app, version, calls = self._job
                self._job = None
            self._page_done.wait(timeout=60)  # a page that never says so (an error) holds nothing up for long
            path = str(app.store.path)
            todo, gave_way = list(calls), 0
            while todo:
                fn, args, kwargs = todo[0]
                self._wait_quiet()
                if app.version != version or self._job is not None or self._stopping or app.store.closing:
                    break  # stale data, a newer selection, or the process is exiting
                with self._cv:
                    self._in_call, self._gave_way = (app.store, threading.get_ident()), False
                try:
                    if fn in DERIVED:
                        fn(*args, **kwargs)
                    else:
                        S._cached_call(fn.__module__, fn.__qualname__, path, version, args, kwargs)
                except Exception:  # the page shows the error when it asks; nothing to say from here
                    if not self._gave_way:
                        S.log.debug("prefetch of %s failed", fn.__qualname__, exc_info=True)
                finally:
                    with self._cv:
                        self._in_call, interrupted = None, self._gave_way
                    app.store.resume_thread()  # no refusal left behind for this thread's id
                if interrupted and gave_way < MAX_GIVE_WAY:
                    gave_way += 1  # again, once the pages are quiet (a result that did come back is cached)
                    continue
                todo.pop(0)


_worker = _Worker()
atexit.register(_worker.stop)


def start(sel: S.Selection, page: str | None = None) -> None:
    """Prefetch the default views for `sel` once per (database, data version, selection), those of `page`
    (the url of the page being drawn) first: queued before the page runs, computed from GRACE_S after
    `page_done()` (a view the page itself computed is cached by then and costs nothing)."""
    _queue(sel, page)
    # Counted only once start() has returned: app.py's page_done() (in a finally around the page) is then sure
    # to follow. A rerun interrupting start() raises a BaseException that skips that finally; counted before,
    # the worker would wait for a script that is no longer running.
    _worker.script_started()


def _queue(sel: S.Selection, page: str | None) -> None:
    if not enabled() or not sel.runs:
        return
    app = S.db()
    key = (str(app.store.path), app.version, tuple(sel.runs), sel.steps, sel.cap, sel.clip)
    with _lock:
        if key in _started:
            return
        if len(_started) > 256:
            _started.clear()
        _started.add(key)
    kinds = S.cached(dashboard.routing_kinds, sel.runs)
    _worker.submit(app, app.version, default_calls(sel, kinds, page))


def page_done() -> None:
    """app.py calls this when the page's script has finished (whatever way): the worker starts GRACE_S later."""
    _worker.page_done()


def wait_idle(timeout: float) -> bool:
    """For tests and benchmarks: True once the worker has nothing left to compute."""
    return _worker.idle.wait(timeout)
