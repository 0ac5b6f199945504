"""The sidebar every page shares: database status, run picker, step range, C and ε."""
from __future__ import annotations

import time

import streamlit as st

from analysis.metrics.sampled import count_text
from analysis.summaries.schema import CAPS, CLIPS
from ui import access, nav
from ui import live as L
from ui.auth import md_escape  # run names and file names are user text
from ui import state as S

_BOUNDS = S.BOUNDS_KEY
# Sessions that start this long after the demo runs were loaded are not told the database "was empty": on a
# hosted app that loaded them at its first start, a visitor a day later would read it as news about now.
DEMO_NOTICE_S = 300.0


def _status(app: S.AppDB, runs) -> None:
    n_tokens = int(runs["n_tokens"].sum()) if runs.height else 0
    mode = " · **viewer mode**" if access.read_only() else ""
    st.caption(f"Database `{app.store.path.name}` · {runs.height} runs · {count_text(n_tokens)} tokens{mode}",
               help=f"DuckDB file: {app.store.path} (set DRIFT_DB to open another)")
    if app.demo_error:
        st.warning(f"The demo data could not be loaded: {app.demo_error}")


def _step_range(runs_df, chosen: list[str]) -> None:
    ss = st.session_state
    sel = runs_df.filter(runs_df["run"].is_in(chosen))
    lo, hi = (sel["first_step"].min(), sel["last_step"].max()) if sel.height else (None, None)
    if lo is None or hi is None:
        ss.pop(S.STEPS_KEY, None)
        ss.pop(_BOUNDS, None)
        return
    lo, hi = int(lo), int(hi)
    if lo == hi:
        st.caption(f"Steps: only step {lo} in the chosen runs")
        ss.pop(S.STEPS_KEY, None)
        ss[_BOUNDS] = (lo, hi)
        return
    old_bounds = ss.get(_BOUNDS)
    value = ss.get(S.STEPS_KEY)
    # a full range follows the runs' bounds; a narrowed range is kept while it fits
    if value is None or tuple(value) == old_bounds or value[0] < lo or value[1] > hi or value[0] > value[1]:
        ss[S.STEPS_KEY] = (lo, hi)
    ss[_BOUNDS] = (lo, hi)
    st.slider("Step range", min_value=lo, max_value=hi, key=S.STEPS_KEY,
              help="Only steps in this range enter the metrics, charts and tables.")


_CHOSEN_BY_USER = "_runs_chosen_by_user"  # the user changed the run choice: new runs no longer join it


def _chosen_by_user() -> None:
    st.session_state[_CHOSEN_BY_USER] = True


def render() -> None:
    ss = st.session_state
    app = S.db()
    runs_df = S.runs_table()
    names = runs_df["run"].to_list()
    pending, notice = S.take_pending()
    fresh_demo = app.demo_outcomes and time.monotonic() - app.demo_loaded_at < DEMO_NOTICE_S
    if fresh_demo and not ss.get("_demo_told"):
        ss["_demo_told"] = True
        loaded = sorted({r for o in app.demo_outcomes for r in o.runs})
        st.toast(f"The database was empty: loaded the demo runs ({', '.join(loaded) or 'none'}).",
                 icon=":material/science:")
    if notice:
        st.toast(notice, icon=":material/check_circle:")

    with st.sidebar:
        _status(app, runs_df)
        _live(app)  # the live folders' status; reruns the page when new files were loaded
        if not names:
            st.info("No runs yet. Load logs on the Data page or run the drift lab.")
            st.page_link(nav.DATA.path, label="Load data", icon=nav.DATA.icon)
            if access.writable():
                st.page_link(nav.LAB.path, label="Run the lab", icon=nav.LAB.icon)
            ss.pop(S.RUNS_KEY, None)  # the first runs to arrive (a live folder, an upload) get the default choice
            ss.pop(_CHOSEN_BY_USER, None)
            ss.pop(S.STEPS_KEY, None)
            return
        if S.RUNS_KEY not in ss:
            ss[S.RUNS_KEY] = names if len(names) <= 6 else names[:4]
        elif not ss.get(_CHOSEN_BY_USER) and len(names) <= 6:
            # until the user picks runs, runs that arrive join the default choice: a live folder's first files
            # load run after run, and a page drawn between two runs' files had kept only the first run
            ss[S.RUNS_KEY] = names
        chosen = [r for r in ss[S.RUNS_KEY] if r in names]
        chosen += [r for r in pending if r in names and r not in chosen]
        ss[S.RUNS_KEY] = chosen
        st.multiselect("Runs", names, key=S.RUNS_KEY, placeholder="Choose one or more runs",
                       on_change=_chosen_by_user,
                       help="Runs shown on every page; each run keeps its colour everywhere.")
        _step_range(runs_df, ss[S.RUNS_KEY])
        # the values the summaries answer exactly (analysis/summaries/schema.py); others only through the API
        if ss.get(S.CAP_KEY) not in CAPS:
            ss[S.CAP_KEY] = S.DEFAULT_CAP
        if ss.get(S.CLIP_KEY) not in CLIPS:
            ss[S.CLIP_KEY] = S.DEFAULT_CLIP
        c1, c2 = st.columns(2)
        c1.select_slider("Cap C", options=list(CAPS), key=S.CAP_KEY,
                         help="Importance-ratio cap C: ratio_frac_high counts r > C, ratio_frac_low r < 1/C, "
                              "and the ESS uses weights clamped to [1/C, C].")
        c2.select_slider("Clip ε", options=list(CLIPS), key=S.CLIP_KEY,
                         help="PPO clip range ε: clip_frac counts tokens with |r − 1| > ε.")


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _live(app) -> None:
    """Inside `with st.sidebar`: the follow toggle and the live status; reruns the page when new data landed."""
    live: L.LiveWatcher | None = getattr(app, "watcher", None)
    if live is None:
        return
    ss = st.session_state
    ss[L.DRAWN] = app.version
    ss.setdefault(L.FOLLOW_KEY, True)
    follow = st.toggle("Follow live runs", key=L.FOLLOW_KEY,
                       help=f"Loads new files from the folders this server follows and redraws the page every "
                            f"{live.interval:g} s, keeping your runs, tab and zoom. Off: the page stays as it is "
                            "(the files are still loaded).")

    @st.fragment(run_every=live.interval if follow else None)
    def status() -> None:
        if follow and ss.get(L.DRAWN) != app.version:
            st.rerun()  # new data: the page redraws in place
        runs = sorted(live.watcher.runs)
        waiting = live.watcher.missing_folders()
        n = len(live.watcher.folders)
        st.caption(f"Following {n} folder{'s' if n > 1 else ''} set by the host"
                   + (f" ({len(waiting)} not there yet)" if waiting else "")
                   + ("" if follow else " · **paused**"))
        if runs:
            from analysis.ingest import watch  # the ingest stack (numba): only where live folders are followed
            df = S.cached(watch.last_files, runs)
            stale = max(30.0, 10 * live.interval)
            for row in df.iter_rows(named=True):
                age = max(0.0, time.time() - row["last_file_at"])
                mark = "🟢 live" if age < stale else "⚪ quiet"
                st.caption(f"{mark} · **{md_escape(row['run'])}** · step {row['last_step']} · "
                           f"last file {_age(age)} ago")
        for line in list(live.refused)[-2:]:
            st.caption(f"⚠️ {md_escape(line[:300])}")

    status()

