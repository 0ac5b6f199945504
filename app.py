"""Driftscope dashboard: `streamlit run app.py`.

Routes with st.navigation over pages/ (one file per page), draws the shared sidebar, and opens the database
once per process (DRIFT_DB, default data/drift.duckdb). An empty database gets the demo runs unless
DRIFT_NO_DEMO=1; DRIFT_READ_ONLY=1 turns the app into a viewer. With an [auth] section in the secrets, nothing but a
sign-in screen shows until the user has signed in (ui/auth.py; docs/hosting.md). Every DRIFT_* setting is checked
before anything is drawn (analysis/settings.py): a bad value is an error on the page, and nothing else.
"""
import streamlit as st

# An emoji icon: the browser draws it into an inline SVG. A material icon is fetched from fonts.gstatic.com (an
# outside request from every visitor, a failed one offline); an image file costs the server's first page the import
# of PIL (~0.2 s of a cold start) to inline it.
st.set_page_config(page_title="Driftscope", page_icon="🔭", layout="wide", initial_sidebar_state="expanded")

from analysis import settings  # noqa: E402  (set_page_config must come first)
from ui import auth, nav, plot, prefetch, sidebar  # noqa: E402
from ui import state as S  # noqa: E402

pages = {section: [st.Page(p.path, title=p.title, icon=p.icon, url_path=p.url, default=p is nav.OVERVIEW)
                   for p in items]
         for section, items in nav.SECTIONS.items()}
try:  # every DRIFT_* value, checked before anything reads one
    settings.check()
    bad_setting = None
except settings.SettingError as e:
    bad_setting = e
# st.navigation runs on every run, the sign-in screen included: it is what keeps Streamlit's pages/ folder routing
# off (ui/auth.py: ensure_routed_through_app). Hidden until the user may see the pages.
page = st.navigation(pages, position="hidden" if bad_setting or not auth.access_granted() else "sidebar")
if bad_setting:
    st.error(f"Driftscope cannot start: {auth.md_escape(str(bad_setting))}. Set it right in the server's "
             "environment, then restart the server.", icon=":material/error:")
    st.stop()
auth.require_login()  # the sign-in screen and st.stop() until the user may see the app
if nav.BY_URL.get(page.url_path, nav.OVERVIEW).charts:  # plotly.js loads in the browser while the queries run
    plot.preload()

try:
    sidebar.render()
except Exception as e:  # a broken database must still leave a readable page
    S.log.exception("sidebar failed")
    st.error(f"Could not open the database: {S.explain(e)}")
    st.stop()

try:  # queue the default views of this page's other tabs and of the other pages (ui/prefetch.py)
    prefetch.start(S.selection(), page.url_path)
except Exception:
    S.log.exception("prefetch failed to start")

try:
    page.run()
finally:  # also after st.stop() or an error: the worker may start once the browser has drawn this page
    prefetch.page_done()
