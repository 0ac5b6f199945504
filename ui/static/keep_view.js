// Keeps the user's zoom on a chart through a live redraw. Streamlit 1.67 mounts a new plotly chart whenever
// its figure changes (the element id hashes the spec), so plotly's own uirevision never sees the old view.
// This script remembers, per chart key (the st-key-* class), the axis ranges the user zoomed to, and puts
// them back on the chart that replaces it when the new figure has the same uirevision (ui/charts.py:
// view_revision: same traces, axis types and titles). A double click (autorange) forgets them.
// Constant code: no user text is ever put into it.
(() => {
  if (window.__driftViews) return;
  const views = window.__driftViews = {};
  const keyOf = (gd) => {
    const box = gd.closest("[class*='st-key-']");
    const m = box && box.className.match(/st-key-(\S+)/);
    return m ? m[1] : null;
  };
  const zoomTo = (gd, axis, range) => {
    // the modebar's zoom handler, fed one attribute, applies it as a user relayout (plotly is not global here)
    const buttons = gd._fullLayout._modeBar ? gd._fullLayout._modeBar.buttons.flat() : [];
    const zoom = buttons.find((b) => b && b.name === "zoomIn2d");
    if (!zoom) return;
    zoom.click(gd, {currentTarget: {getAttribute: (a) => (a === "data-attr" ? axis + ".range" : range),
                                    setAttribute: () => {}}});
  };
  const hook = (gd) => {
    if (gd.__driftHooked || !gd._fullLayout || typeof gd.on !== "function") return;
    const key = keyOf(gd);
    if (!key) return;
    gd.__driftHooked = true;
    const rev = gd.layout.uirevision;
    const saved = views[key];
    if (saved && saved.rev === rev) {
      for (const [axis, range] of Object.entries(saved.ranges)) zoomTo(gd, axis, range.slice());
    }
    gd.on("plotly_relayout", (ev) => {
      const view = views[key] && views[key].rev === rev ? views[key] : (views[key] = {rev, ranges: {}});
      for (const attr of Object.keys(ev)) {
        const m = attr.match(/^([xy]axis\d*)\.(range|autorange)/);
        if (!m || !gd._fullLayout[m[1]]) continue;
        if (m[2] === "autorange") delete view.ranges[m[1]];
        else view.ranges[m[1]] = gd._fullLayout[m[1]].range.slice();
      }
    });
  };
  const scan = () => document.querySelectorAll(".js-plotly-plot").forEach(hook);
  new MutationObserver(scan).observe(document.body, {childList: true, subtree: true});
  scan();
})();
