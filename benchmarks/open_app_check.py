"""Open the app headless (AppTest) on a database and time the first visit of a few pages; prints errors and the
sample label. Usage: python benchmarks/open_app_check.py benchmarks/work/sim1b/sim.duckdb"""
import os, sys, time
sys.path.insert(0, ".")
os.environ.update(DRIFT_DB=sys.argv[1], DRIFT_NO_DEMO="1", DRIFT_PREFETCH="0", DRIFT_READ_ONLY="1")
from streamlit.testing.v1 import AppTest, app_test
from streamlit.runtime.pages_manager import PagesManager
from ui import plot
class NavOnly(PagesManager):
    def __init__(self, *a, **k):
        super().__init__(*a, **k); PagesManager.uses_pages_directory = False
app_test.PagesManager = NavOnly
at = AppTest.from_file(os.path.abspath("app.py"), default_timeout=300)
t0 = time.perf_counter(); at.run(); print("overview", round(time.perf_counter() - t0, 2), "s", "exception:", at.exception)
print([e.value for e in at.error], sum(1 for e in at.get("bidi_component") if e.proto.component_name == plot.COMPONENT), "charts")
for page in ("pages/token_drift.py", "pages/sequences.py", "pages/routing.py"):
    t0 = time.perf_counter(); at.switch_page(page).run()
    print(page, round(time.perf_counter() - t0, 2), "s", "exception:", bool(at.exception), [e.value for e in at.error][:2],
          [c.value for c in at.caption if "sample" in str(c.value)][:1])
