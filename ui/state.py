"""What every page shares: the one Store, cached analysis calls, the sidebar selection, error handling.

The Store is a process-wide resource (one DuckDB connection; each thread reads through its own cursor).
Analysis results are cached per (database, data version, function, arguments); every write made through the
app bumps the data version, and no other process can write while the app holds the database (DuckDB allows
one read-write process), so a cached result is never stale.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import plotly.colors
import polars as pl
import streamlit as st

from analysis.store import Store, StoreError, default_db_path
from ui import access, glossary

log = logging.getLogger("driftscope.app")

# Sidebar widget keys (pages read them through `selection()`).
RUNS_KEY = "sidebar_runs"
STEPS_KEY = "sidebar_steps"
CAP_KEY = "sidebar_cap"
CLIP_KEY = "sidebar_clip"
BOUNDS_KEY = "_sidebar_step_bounds"
_PENDING_RUNS = "_pending_runs"
_NOTICE = "_pending_notice"

DEFAULT_CAP = 2.0
DEFAULT_CLIP = 0.2
WARM_DELAY_S = 5.0  # seconds from opening a writable database to starting the kernels' warm-up child
PALETTE = plotly.colors.qualitative.Plotly + plotly.colors.qualitative.D3


@dataclass
class AppDB:
    store: Store
    demo_outcomes: list = field(default_factory=list)
    demo_loaded_at: float = 0.0  # time.monotonic() when the demo runs were loaded into an empty database
    demo_error: str | None = None
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    watcher: Any = None  # ui.live.LiveWatcher when the host set DRIFT_WATCH_DIRS

    def changed(self) -> None:
        with self.lock:
            self.version += 1


@st.cache_resource(show_spinner="Opening the database… (an empty one first gets the demo runs: a few seconds)")
def _open(path: str, read_only: bool, load_demo: bool) -> AppDB:
    from pathlib import Path

    from ui import live
    # Viewer mode opens an existing database read-only: even a bug in a page cannot write then. Following live
    # folders (the host's DRIFT_WATCH_DIRS) needs the write side, which then only the watcher uses.
    following = bool(live.watch_dirs())
    ro = read_only and Path(path).exists() and not following
    if ro:
        store = Store(path, read_only=True)
    else:
        from analysis.ingest import open_store  # a writable database: its unsummarised files summarised once
        store = open_store(path)
    app = AppDB(store)
    if load_demo and not ro:
        try:
            from analysis.ingest.demo import ensure_demo
            app.demo_outcomes = ensure_demo(store)
            app.demo_loaded_at = time.monotonic()
        except Exception as e:  # the app must open even if the demo data is broken
            log.exception("demo load failed")
            app.demo_error = str(e)
    if read_only and not ro and not following:  # a viewer on a new database: create it, then hold it read-only
        store.close()
        app.store = Store(path, read_only=True)
    app.watcher = live.start(app)
    if not app.store.read_only:  # uploads and followed folders ingest here: compile the kernels in a child, once
        # the first page has been drawn (its imports and compiles took ~0.3 s of that page's 3 s on 2 cores)
        from analysis.ingest.warm import start_in_background
        timer = threading.Timer(WARM_DELAY_S, start_in_background)
        timer.daemon = True
        timer.start()
    # On SIGTERM / Ctrl-C streamlit stops and the interpreter exits: queries still running in daemon threads
    # (prefetch, script runs) are interrupted and awaited first, or DuckDB aborts the process (exit -6).
    atexit.register(app.store.shutdown)
    return app


def db() -> AppDB:
    return _open(str(default_db_path()), access.read_only(), not access.demo_disabled())


def store() -> Store:
    return db().store


def data_changed() -> None:
    """Call after any write (upload, delete, config edit, lab run): cached results are dropped."""
    db().changed()


def _resolve(module: str, qualname: str) -> Callable:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@st.cache_data(show_spinner=False, max_entries=512)
def _cached_call(module: str, qualname: str, path: str, version: int, args: tuple, kwargs: dict):
    return _resolve(module, qualname)(store(), *args, **kwargs)


def cached(fn: Callable, *args, **kwargs):
    """`fn(store, *args, **kwargs)` for an analysis function (or a Store method), cached per data version."""
    app = db()
    return _cached_call(fn.__module__, fn.__qualname__, str(app.store.path), app.version, args, kwargs)


def runs_table() -> pl.DataFrame:
    return cached(Store.runs)


def run_names() -> list[str]:
    return runs_table()["run"].to_list()


# -- selection shared by the pages ---------------------------------------------------------------------
@dataclass(frozen=True)
class Selection:
    runs: list[str]
    steps: tuple[int, int] | None
    cap: float
    clip: float


def selection() -> Selection:
    ss = st.session_state
    steps = ss.get(STEPS_KEY)
    steps = tuple(int(s) for s in steps) if steps else None
    if steps is not None and steps == ss.get(BOUNDS_KEY):
        steps = None  # the full range: no filter (and the same cache entry as other full-range calls)
    names = set(run_names())
    return Selection(runs=[r for r in ss.get(RUNS_KEY, []) if r in names], steps=steps,
                     cap=float(ss.get(CAP_KEY, DEFAULT_CAP)), clip=float(ss.get(CLIP_KEY, DEFAULT_CLIP)))


def select_runs_next(runs: Sequence[str], notice: str | None = None) -> None:
    """Add runs to the sidebar selection on the next rerun (a widget's value cannot change once drawn)."""
    st.session_state[_PENDING_RUNS] = list(runs)
    if notice:
        st.session_state[_NOTICE] = notice


def take_pending() -> tuple[list[str], str | None]:
    return st.session_state.pop(_PENDING_RUNS, []), st.session_state.pop(_NOTICE, None)


def keep_choice(key: str, options: Sequence, default=None) -> None:
    """Before drawing a selectbox/radio with `key`: drop a remembered value that is no longer an option."""
    if not options:
        st.session_state.pop(key, None)
        return
    if st.session_state.get(key) not in options:
        st.session_state[key] = default if default in options else options[0]


def keep_choices(key: str, options: Sequence, default: Sequence = ()) -> None:
    """Same for a multiselect: keep the remembered values that are still options."""
    if key in st.session_state:
        st.session_state[key] = [v for v in st.session_state[key] if v in options]
    else:
        st.session_state[key] = [v for v in default if v in options]


_KEPT = "_kept_"  # prefix of the copies `remember` keeps


def remember(*keys: str) -> None:
    """Call at the top of a page, before its widgets: the widgets with these keys keep their values while they
    are not drawn (another page, another tab). Streamlit forgets a widget's value after a run that did not draw
    it; a copy under another key is not a widget's, so it stays, and puts the value back on the next draw."""
    ss = st.session_state
    for key in keys:
        if key in ss:
            ss[_KEPT + key] = ss[key]
        elif _KEPT + key in ss:
            ss[key] = ss[_KEPT + key]


def tabs(labels: Sequence[str], key: str) -> list:
    """Tabs that run only the shown tab's content (`if tab.open:`): a page draws one tab's charts, not all of
    them, and clicking a tab reruns the page. The open tab is in the URL (`?<key>=<label>`, none for the first
    tab), so a shared link opens it, and the page reopens on it when the user comes back."""
    return list(st.tabs(list(labels), key=key, on_change="rerun", bind="query-params"))


def expander(label: str, key: str):
    """An expander whose content runs only while it is open (`if box.open: with box: ...`): a collapsed table
    costs the page neither its query nor the browser's grid. Opening it reruns the page."""
    return st.expander(label, key=key, on_change="rerun")


def run_colors() -> dict[str, str]:
    """One colour per run, stable across pages (by the order runs were created)."""
    return {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(run_names())}


# -- errors --------------------------------------------------------------------------------------------
def explain(e: BaseException) -> str:
    if isinstance(e, StoreError):
        return f"the database said: {e}"
    text = str(e).strip() or type(e).__name__
    return text if len(text) < 600 else text[:600] + "…"


@contextmanager
def guard(what: str) -> Iterator[None]:
    """Show a failure as a short error box (never a traceback) and let the rest of the page draw."""
    try:
        yield
    except Exception as e:  # st.stop / st.rerun are BaseException and pass through
        log.exception("failed to %s", what)
        st.error(f"Could not {what}: {explain(e)}", icon=":material/error:")


# -- empty states ----------------------------------------------------------------------------------------
def require_runs(sel: Selection, minimum: int = 1, what: str = "this page") -> None:
    """Stop the page with a hint on what to do when there is nothing to show."""
    from ui import nav
    if not run_names():
        st.info("The database has no runs yet. Load your sampler/trainer log-prob logs on the **Data** page "
                "(Parquet, CSV, JSON Lines, verl/prime-rl dumps, or a zip of them) or generate a run with the "
                "**drift lab**.", icon=":material/inbox:")
        c1, c2, _ = st.columns([1, 1, 3])
        c1.page_link(nav.DATA.path, label="Load data", icon=nav.DATA.icon)
        if access.writable():
            c2.page_link(nav.LAB.path, label="Run the lab", icon=nav.LAB.icon)
        st.stop()
    if len(sel.runs) < minimum:
        need = "a run" if minimum == 1 else f"at least {minimum} runs"
        st.info(f"Choose {need} in the sidebar (**Runs**) to see {what}.", icon=":material/left_panel_open:")
        st.stop()


def run_badge(run: str, color: str, note: str = "") -> None:
    """The run's name with its colour dot (glossary.badge_html)."""
    st.html(glossary.badge_html(run, color, note))


def static_table(df: pl.DataFrame) -> None:
    """A small table as one st.html element: for a page's first view, where st.table or st.dataframe would add
    their code, Arrow's and pandas' (~0.15 s of a cold server's first page) for a few rows. Values are user text:
    escaped."""
    import html
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>" for v in row) + "</tr>"
                   for row in df.iter_rows())
    st.html('<style>.drift-table { border-collapse: collapse; font-size: 0.875rem; } .drift-table th, .drift-table td '
            '{ border: 1px solid rgba(49, 51, 63, 0.15); padding: 0.25rem 0.75rem; text-align: left; } '
            '.drift-table th { font-weight: 600; background: rgba(49, 51, 63, 0.04); }</style>'
            f'<table class="drift-table"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')


def number_columns(df: pl.DataFrame, fmt: str = "%.4g") -> dict:
    """st.dataframe column_config showing every float column with 4 significant digits."""
    return {c: st.column_config.NumberColumn(c, format=fmt) for c, t in df.schema.items() if t.is_float()}
