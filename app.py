"""Driftscope dashboard: `streamlit run app.py`.

Routes with st.navigation over pages/ (one file per page), draws the shared sidebar, and opens the database
once per process (DRIFT_DB, default data/drift.duckdb). An empty database gets the demo runs unless
DRIFT_NO_DEMO=1; DRIFT_READ_ONLY=1 turns the app into a viewer.
"""
import streamlit as st

st.set_page_config(page_title="Driftscope", page_icon=":material/troubleshoot:", layout="wide",
                   initial_sidebar_state="expanded")

from ui import nav, sidebar  # noqa: E402  (set_page_config must come first)
from ui import state as S  # noqa: E402

pages = {section: [st.Page(p.path, title=p.title, icon=p.icon, url_path=p.url, default=p is nav.OVERVIEW)
                   for p in items]
         for section, items in nav.SECTIONS.items()}
page = st.navigation(pages)

try:
    sidebar.render()
except Exception as e:  # a broken database must still leave a readable page
    S.log.exception("sidebar failed")
    st.error(f"Could not open the database: {S.explain(e)}")
    st.stop()

page.run()

try:  # reached only when the page finished (st.stop ends the run before this)
    from ui import prefetch
    prefetch.start(S.selection())
except Exception:
    S.log.exception("prefetch failed to start")
