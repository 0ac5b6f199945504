"""Helpers shared by the page tests, the browser tests and the page benchmarks: a small seeded fixture
database built through the real ingest path, a `streamlit run` subprocess, and a headless Chromium that
waits until a page has finished running and its charts are drawn."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import polars as pl

from helpers import ROOT
from helpers.data import routing_frame

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Token texts include markup on purpose: the Sequences page must show them as text, never as HTML.
VOCAB = ["the", " cat", " sat", "<b>bold</b>", " &amp;", "<script>alert(1)</script>", "\n", " 42", "def", "(",
         ")", ":", " return", " x", " +", " 1", "<img src=x onerror=alert(2)>", " é", "…", "."]

RUN_BOTH = "moe-both"      # tokens + routing of both sides, token text, versions, entropy
RUN_REPLAY = "moe-replay"  # tokens + the sampler's routing only
RUN_DENSE = "dense"        # tokens only, no optional columns (JSON Lines)
CONFIGS = {
    RUN_BOTH: {"sampler_dtype": "bf16", "trainer_dtype": "fp32", "engine": "vllm", "replay": False},
    RUN_REPLAY: {"sampler_dtype": "bf16", "trainer_dtype": "fp32", "engine": "vllm", "replay": True},
    RUN_DENSE: {"sampler_dtype": "fp16", "trainer_dtype": "fp32", "engine": "sglang"},
}


def fixture_tokens(run: str, seed: int, steps: int = 4, n_seq: int = 6, max_len: int = 18, sd: float = 0.05,
                   optional: bool = True) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    parts = []
    for step in range(steps):
        for sample in range(n_seq):
            n = int(rng.integers(4, max_len + 1))
            s = -rng.exponential(1.2, n)
            d = rng.normal(0.0, sd * (1 + step), n)
            d[rng.random(n) < 0.05] *= 15.0
            t = np.minimum(s + d, 0.0)
            ids = rng.integers(0, len(VOCAB), n)
            cols = {"run": [run] * n, "step": [step] * n, "sample": [sample] * n, "pos": np.arange(n, dtype=np.int32),
                    "sampler_logprob": s, "trainer_logprob": t}
            if optional:
                cols |= {"token_id": ids.astype(np.int32), "token": [VOCAB[i] for i in ids],
                         "sampler_version": np.full(n, max(0, step - int(rng.integers(0, 2)))),
                         "trainer_version": np.full(n, step), "sampler_entropy": rng.gamma(2.0, 0.6, n)}
            parts.append(pl.DataFrame(cols))
    return pl.concat(parts)


def fixture_routing(tokens: pl.DataFrame, seed: int, layers: int = 4, k: int = 2, n_experts: int = 8,
                    flip_p: float = 0.15, trainer: bool = True) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    keys = tokens.select("run", "step", "sample", "pos")
    n = keys.height * layers
    S = np.argsort(rng.random((n, n_experts)), axis=1)[:, :k].astype(np.int32)
    T = S.copy()
    flip = rng.random(n) < flip_p * np.tile(np.linspace(0.5, 1.5, layers), keys.height)
    for i in np.flatnonzero(flip):
        unused = np.setdiff1d(np.arange(n_experts), S[i])
        T[i, rng.integers(0, k)] = rng.choice(unused)
    return routing_frame(keys, layers, S, T if trainer else None)


def write_fixture_logs(folder: Path) -> list[Path]:
    """Three small runs as files an RL user would have: Parquet long tables and a JSON Lines one."""
    folder.mkdir(parents=True, exist_ok=True)
    both = fixture_tokens(RUN_BOTH, 1)
    replay = fixture_tokens(RUN_REPLAY, 2, sd=0.03)
    dense = fixture_tokens(RUN_DENSE, 3, steps=5, sd=0.08, optional=False)
    paths = {
        "both-tokens.parquet": both, "both-routing.parquet": fixture_routing(both, 11),
        "replay-tokens.parquet": replay, "replay-routing.parquet": fixture_routing(replay, 12, trainer=False),
        "dense-tokens.jsonl": dense,
    }
    out = []
    for name, df in paths.items():
        p = folder / name
        df.write_parquet(p) if name.endswith(".parquet") else df.write_ndjson(p)
        out.append(p)
    return out


def build_fixture_db(db: Path, logs: Path) -> None:
    """Ingest the fixture logs into a fresh database (then closed, so the app can open it)."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store

    store = Store(db)
    try:
        outcomes = ingest_paths(store, write_fixture_logs(logs))
        bad = [o.line() for o in outcomes if o.status != "loaded"]
        assert not bad, bad
        for run, cfg in CONFIGS.items():
            store.set_run_config(run, cfg)
    finally:
        store.close()


# -- a streamlit server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def streamlit_server(db: Path, env: dict | None = None, timeout: float = 60.0,
                     log: Path | None = None, procs: list | None = None, app: str = "app.py",
                     poll: float = 0.3, code: Path | None = None) -> Iterator[str]:
    """`streamlit run app.py` (or `app`, relative to the repository, or to `code`: another checkout, for a
    benchmark's side by side) on a free port with DRIFT_DB=db; yields the base URL once /_stcore/health answers
    (asked every `poll` seconds). `procs`, if given, receives the server's Popen (a test that signals the server
    itself, a benchmark that reads its memory)."""
    port = free_port()
    full_env = os.environ | {"DRIFT_DB": str(db), "PYTHONUNBUFFERED": "1"} | (env or {})
    cmd = [sys.executable, "-m", "streamlit", "run", app, "--server.headless", "true",
           "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--server.port", str(port), "--server.address", "127.0.0.1"]
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=code or ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode}" + (f"; see {log}" if log else ""))
            try:
                with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"streamlit did not answer on {url} within {timeout:.0f} s")
            time.sleep(poll)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if log:
            out.close()


def app_charts(at) -> int:
    """The charts an AppTest run drew: ui/plot.py's component, which AppTest lists as a bidi_component."""
    from ui import plot
    return sum(1 for e in at.get("bidi_component") if e.proto.component_name == plot.COMPONENT)


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


# A page is idle when the script has stopped running, the expected title is shown (not the previous page's),
# no element is still a loading skeleton, at least `charts` plotly charts are on screen (a chart component can
# mount after the script has stopped: without a count, a page whose charts have not mounted yet looks idle),
# and every one of them has drawn its SVG.
_IDLE_JS = """([title, charts]) => {
  const app = document.querySelector("[data-testid='stApp']");
  if (!app || app.getAttribute("data-test-script-state") !== "notRunning") return false;
  const h1 = [...document.querySelectorAll("h1")].map(e => e.textContent.trim());
  if (title && !h1.some(t => t.startsWith(title))) return false;
  if (document.querySelector("[data-testid='stSkeleton']")) return false;
  const all = [...document.querySelectorAll("div.drift-chart")];  // ui/plot.py: pending while plotly draws
  if (all.filter(c => c.offsetParent !== null).length < charts) return false;  // a closed tab's are hidden
  for (const c of all) { if (c.dataset.pending || !c.querySelector(".main-svg")) return false; }
  return true;
}"""

# The pages that draw at least one chart whenever a run is loaded; every tab past a page's first draws one too.
CHART_PAGES = {"Overview", "Token drift", "Routing", "Expert load", "Sequences", "Compare"}


def wait_idle(page, title: str | None = None, timeout_ms: float = 60_000, charts: int = 0) -> None:
    """Wait until the page is idle (see _IDLE_JS) with at least `charts` charts on screen, all drawn."""
    page.wait_for_function(_IDLE_JS, arg=[title, charts], timeout=timeout_ms, polling=50)


def goto_page(page, label: str, title: str, timeout_ms: float = 60_000, charts: int | None = None) -> float:
    """Click a sidebar navigation link; returns seconds until the page is idle with its charts drawn: at least
    `charts` of them (default: one for a page of CHART_PAGES)."""
    link = page.locator("[data-testid='stSidebarNav'] a", has_text=label).first
    t0 = time.perf_counter()
    link.click()
    wait_idle(page, title, timeout_ms, int(label in CHART_PAGES) if charts is None else charts)
    return time.perf_counter() - t0


# the Overview context chart's line traces (its bands are fills) with the axis of each: y the drift, then one
# axis per panel shown (ui/context_charts.py PANELS)
CONTEXT_JS = """() => {
  const gd = document.querySelector(".st-key-overview_context .js-plotly-plot");
  if (!gd || !gd.data) return null;
  return gd.data.filter(t => t.fill !== "toself").map(t => ({axis: t.yaxis || "y", x: Array.from(t.x),
                                                            y: Array.from(t.y)}));
}"""


def fill_number(page, key: str, value: int) -> None:
    """Type `value` into the number input with widget key `key` and submit it."""
    box = page.locator(f".st-key-{key} input")
    box.fill(str(value))
    box.press("Enter")


def goto_tab(page, label: str, timeout_ms: float = 60_000, charts: int = 0) -> float:
    """Click a tab of the current page (its content runs only when open, so the click reruns the page); returns
    seconds until that rerun is idle with the tab's charts drawn (at least `charts` of them)."""
    page.evaluate(_MARK_RUN_JS)
    tab = page.get_by_role("tab", name=label, exact=True)
    t0 = time.perf_counter()
    tab.click()
    page.wait_for_function("() => window.__driftRan === true", timeout=timeout_ms, polling=20)
    wait_idle(page, None, timeout_ms, charts)
    return time.perf_counter() - t0


# Sets window.__driftRan once the click's rerun shows: the script state turns "running", or the open tab's panel
# (empty before: a closed tab draws nothing) receives elements. The state alone once left bench_pages waiting 300 s
# after a tab click whose rerun did finish; the likely cause (not confirmed) is a rerun fast enough to go from
# running to notRunning within one React render, so that the attribute never changes in the DOM.
_MARK_RUN_JS = """() => {
  window.__driftRan = false;
  const app = document.querySelector("[data-testid='stApp']");
  const done = () => { window.__driftRan = true; state.disconnect(); panels.disconnect(); };
  const state = new MutationObserver(() => {
    if (app.getAttribute("data-test-script-state") === "running") done();
  });
  state.observe(app, {attributes: true, attributeFilter: ["data-test-script-state"]});
  const panels = new MutationObserver((records) => {
    for (const r of records) {
      const panel = r.target.closest && r.target.closest("[role='tabpanel']");
      if (panel && !panel.hidden && [...r.addedNodes].some(n => n.nodeType === 1)) { done(); return; }
    }
  });
  panels.observe(app, {childList: true, subtree: true});
}"""

# The tabs of each page that has them, in order: (tab label, screenshot suffix). A page opens on its first
# tab, and reopens on the tab last shown (it is in the URL).
TABS = {
    "Token drift": [("Distribution", ""), ("One run in detail", "run"), ("Where the mismatch lives", "where"),
                    ("Extreme tokens", "extreme")],
    "Routing": [("Flips per layer", ""), ("Flips per token", "tokens"), ("Expert load", "load")],
    # the tabs that draw a chart for any routed run (Ranks needs a placement, By domain sequence tags)
    "Expert load": [("Imbalance", ""), ("Hot experts", "hot"), ("What-if", "whatif")],
    "Compare": [("Metric deltas", ""), ("Distributions", "distributions"), ("Routing", "routing")],
    "Findings": [("Findings", ""), ("Waterfall", "waterfall"), ("Correction simulator", "simulator"),
                 ("Gates", "gates")],
}


def visit_tabs(page, label: str, timeout_ms: float = 60_000) -> Iterator[tuple[str, str, float]]:
    """On page `label` (open on its first tab): click each other tab in order, yielding (tab, screenshot
    suffix, seconds to idle with at least one chart drawn) after each; then back to the first tab, untimed, so
    the next visit opens on it."""
    tabs = TABS.get(label, [])
    for tab, suffix in tabs[1:]:
        yield tab, suffix, goto_tab(page, tab, timeout_ms, charts=1)
    if len(tabs) > 1:
        goto_tab(page, tabs[0][0], timeout_ms)


def view_names() -> list[str]:
    """What the benchmarks time: each page (on its first tab), then "<page> › <tab>" for each other tab."""
    return [v for label, _, _ in PAGES for v in [label] + [f"{label} › {tab}" for tab, _ in TABS.get(label, [])[1:]]]


PAGES = [  # (sidebar label, page title h1, screenshot name)
    ("Overview", "Overview", "overview"),
    ("Token drift", "Token drift", "token_drift"),
    ("Routing", "Routing", "routing"),
    ("Expert load", "Expert load", "expert_load"),
    ("Sequences", "Sequences", "sequences"),
    ("Compare", "Compare runs", "compare"),
    ("Findings", "Findings", "findings"),
    ("Data", "Data", "data"),
    ("Lab", "Drift lab", "lab"),
]




def screenshot_dir(scratch: Path) -> Path:
    """Where a browser test saves its screenshots: the folder DRIFT_SCREENSHOTS names (relative to the repo;
    `DRIFT_SCREENSHOTS=docs/screenshots` refreshes the tracked ones), else `scratch`: a plain test run never
    rewrites tracked files."""
    name = os.environ.get("DRIFT_SCREENSHOTS")
    folder = ROOT / name if name else scratch / "shots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def full_screenshot(page, path: Path, width: int = 1400) -> None:
    """Screenshot of the whole page: Streamlit scrolls inside its main container, so grow the viewport first.
    Only when DRIFT_SCREENSHOTS asks for the tracked ones: growing the viewport and back makes plotly redraw
    every chart twice (~1.5 s a page, a third of test_browser's time), so a plain run keeps the cheap shot of
    the viewport, enough to see what a failing test saw."""
    if not os.environ.get("DRIFT_SCREENSHOTS"):
        page.screenshot(path=str(path))
        return
    height = page.evaluate("""() => {
        const m = document.querySelector("[data-testid='stMain']");
        return Math.max(m ? m.scrollHeight : 0, document.body.scrollHeight);
    }""")
    old = page.viewport_size
    page.set_viewport_size({"width": width, "height": min(int(height) + 40, 12000)})
    page.wait_for_timeout(400)  # plotly redraws on resize
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(old)
