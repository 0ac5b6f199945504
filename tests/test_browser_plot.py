"""ui/plot.py's chart element in a real browser: each figure is drawn once, a rerun with the same figure draws
nothing, a new figure is drawn in place (same div, the user's zoom kept), and the file route that serves
plotly.js serves that file and nothing outside its folder."""
from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ui import plot

from helpers import browser as bu

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not Path(bu.CHROMIUM).exists(), reason=f"{bu.CHROMIUM} is not installed")]

# Counts plotly.js's drawing calls per chart: plotly.js defines window.Plotly when its script runs, so a setter
# wraps its entry points before the first chart is drawn.
COUNT_DRAWS = """
window.__draws = {};
let plotly;
Object.defineProperty(window, "Plotly", {configurable: true, get: () => plotly, set: (P) => {
  for (const name of ["newPlot", "react", "relayout", "redraw"]) {
    const orig = P[name];
    P[name] = function (gd, ...rest) {
      const key = (gd.closest("[class*='st-key-']").className.match(/st-key-(\\S+)/) || [])[1];
      window.__draws[key] = (window.__draws[key] || 0) + 1;
      return orig.call(this, gd, ...rest);
    };
  }
  plotly = P;
}});
"""


def draws(page) -> dict[str, int]:
    return page.evaluate("() => ({...window.__draws})")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_each_figure_is_drawn_once_and_redrawn_in_place(tmp_path):
    from playwright.sync_api import sync_playwright

    with bu.streamlit_server(tmp_path / "unused.duckdb", env={"DRIFT_NO_DEMO": "1"}, app="tests/apps/plot_probe.py",
                             log=tmp_path / "server.log") as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.add_init_script(COUNT_DRAWS)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url)
        bu.wait_idle(page, "Plot probe")
        page.wait_for_timeout(500)  # anything drawn after idle would be counted too
        assert draws(page) == {"probe_line": 1, "probe_heatmap": 1}  # st.plotly_chart: 3 each
        line = f".st-key-probe_line div.{plot.CHART_CLASS}"
        assert page.locator(f"{line} .main-svg").count() > 0
        # the chart takes its column's width
        widths = page.evaluate(f"""() => {{ const gd = document.querySelector("{line}");
            return [gd._fullLayout.width, gd.parentElement.getBoundingClientRect().width]; }}""")
        assert abs(widths[0] - widths[1]) <= 2, widths
        page.evaluate(f"""() => {{ document.querySelector("{line}").__probeMark = true; }}""")

        # the user zooms; a rerun with the same figures draws nothing
        page.evaluate(f"""() => window.Plotly.relayout(document.querySelector("{line}"),
                                                       {{"xaxis.range": [10, 20]}})""")
        before = draws(page)
        page.get_by_role("button", name="Same figures").click()
        page.wait_for_function("() => document.body.innerText.includes('version 0')")
        bu.wait_idle(page, "Plot probe")
        page.wait_for_timeout(500)
        assert draws(page) == before

        # a new figure: one draw, in the same div, the zoom kept (same uirevision)
        page.get_by_role("button", name="New figure").click()
        page.wait_for_function("() => document.body.innerText.includes('version 1')")
        bu.wait_idle(page, "Plot probe")
        page.wait_for_function(f"""() => document.querySelector("{line}").data[0].x.length === 51""")
        page.wait_for_timeout(500)
        after = draws(page)
        assert after == {"probe_line": before["probe_line"] + 1, "probe_heatmap": before["probe_heatmap"]}
        kept = page.evaluate(f"""() => {{ const gd = document.querySelector("{line}");
            return [gd.__probeMark === true, gd.layout.xaxis.range]; }}""")
        assert kept == [True, [10, 20]]

        # a narrower window: the chart follows its column
        page.set_viewport_size({"width": 800, "height": 900})
        page.wait_for_function(f"""() => {{ const gd = document.querySelector("{line}");
            return Math.abs(gd._fullLayout.width - gd.parentElement.getBoundingClientRect().width) <= 2; }}""")
        assert errors == []

        # the file route: the vendored cartesian bundle (ui/static/plotly), nothing outside its folder
        src = page.evaluate("() => document.querySelector('script[src*=\"plotly\"]').getAttribute('src')")
        assert src.startswith("component/") and src.endswith("/plotly-cartesian.min.js")
        status, body = get(f"{url}/{src}")
        assert status == 200 and b"plotly.js (cartesian - minified) v3" in body[:200]
        folder = src.rsplit("/", 1)[0]
        for outside in ("../../plot.py", "..%2F..%2Fstate.py", "%2e%2e/%2e%2e/plot.py"):
            status, body = get(f"{url}/{folder}/{outside}")
            assert status in (400, 403, 404), (outside, status)
        # the traces the bundle can draw are the ones ui/plot.py lets a figure use
        assert set(page.evaluate("() => Object.keys(Plotly.PlotSchema.get().traces)")) == plot.TRACES
        browser.close()


# A finished page whose chart component mounts a moment after the script stopped, as a cold server's did once
# (tests/helpers/browser.py, _IDLE_JS); a chart in a closed tab (hidden) does not count as on screen.
LATE_CHART = """<div data-testid="stApp" data-test-script-state="notRunning"><h1>Late</h1>
<div role="tabpanel" hidden><div class="drift-chart"><div class="main-svg"></div></div></div></div>
<script>setTimeout(() => {
  const c = document.createElement("div"); c.className = "drift-chart"; c.dataset.pending = "1";
  document.querySelector("[data-testid='stApp']").appendChild(c);
  setTimeout(() => { c.innerHTML = '<div class="main-svg"></div>'; delete c.dataset.pending; }, 300);
}, 500);</script>"""


def test_idle_check_waits_for_the_charts_a_page_is_expected_to_draw():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        try:
            page = browser.new_page()
            page.set_content(LATE_CHART)
            bu.wait_idle(page, "Late")  # no count asked: idle at once, the late chart not there yet
            assert page.locator("div.drift-chart").count() == 1
            bu.wait_idle(page, "Late", timeout_ms=10_000, charts=1)
            assert page.locator("div.drift-chart").count() == 2
            assert page.locator("div.drift-chart[data-pending]").count() == 0  # drawn, not only mounted
            with pytest.raises(Exception, match="Timeout"):
                bu.wait_idle(page, "Late", timeout_ms=1_000, charts=2)  # the hidden one is not on screen
        finally:
            browser.close()
