"""Time each dashboard page in a real browser: from clicking its link in the sidebar (or one of its tabs) to idle
(script finished, every plotly chart drawn), on the demo database and on a large one (≥ 5M tokens).

    python benchmarks/bench_pages.py [--only demo|large|scale] [--rounds 2] [--prefetch on|off] [--think S]
                                     [--profile] [--no-write]
    python benchmarks/bench_pages.py --switch PAGE PAGE [--db PATH] [--clicks 12] [--settle 45]
    python benchmarks/bench_pages.py --fresh [--only demo|scale] [--rounds 3] [--pages all] [--code OTHER]
                                     [--no-write]
    python benchmarks/bench_pages.py --miles [--rounds 3] [--no-write]

The large database is the metrics database (benchmarks/inputs/metrics_db.py: 5M tokens, 8M routing rows, built
with DuckDB SQL when missing) plus a second run (its first 10 steps, 1M tokens, renamed) so that Compare has two
runs. `--only scale` measures the run-scale database instead: the summaries database (inputs/summaries_db.py:
40M tokens over 400 steps, 16M routing rows, with summaries) plus the same second run. Round 1 is cold (each
page's first visit: every query runs); later rounds are warm (the app's per-data-version cache answers). With
--prefetch on (the app's default) the app computes the other pages' default views in the background after each
page; --think S waits S seconds on each page before the next click, as a reader would. Results go to
benchmarks/RESULTS-pages.md.

--switch times warm switches between two pages instead (see `switch`), printing each click's seconds and their
median; only medians taken one after the other (two checkouts, before and after a change) compare.

--fresh times first opens side by side with a bare Streamlit page with one plotly chart (tests/apps/bare_plotly.py),
alternating the two sides: a server's first page (process start → page idle, and the server's peak memory then),
and a page opened by its URL in a fresh browser session (a new browser context: no cookies, no cached scripts) on a
running server, for the issue's pages (`--pages all`: every page). Targets: a fresh open ≤ 1.2× the bare page's,
the server's first page ≤ 2× the bare app's, peak server memory at first view ≤ 400 MB. On the demo database by
default; `--only scale` on the run-scale one (40M tokens, built when missing: minutes, a quiet machine).

--miles times, one tool at a time and alternating, from server start to the first chart of per-step mismatch on the
same run (inputs/miles_dump.py: a miles --dump-details folder, ~655k tokens): miles' own dashboard (radixark/miles at
MILES_COMMIT, `python -m miles.dashboard.serve --dump-details DIR`, its chart dump/mean_abs_lp_diff; its summary
cache removed before each start, and kept: both timed) and Driftscope on a database that ingested the same folder
(ingest timed once; its Overview's per-step curves drawn); with each server's peak memory. miles needs fastapi and
uvicorn, installed apart from the shared environment:
`pip install --target benchmarks/work/miles-env -r benchmarks/requirements-miles.txt`, and its source:
`git --git-dir=MIRROR archive MILES_COMMIT miles | tar -x -C benchmarks/work/miles-src` (or a clone).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import urllib.request
import statistics
import sys
import time
from pathlib import Path

import duckdb

import harness
from harness import ROOT, WORK, fresh_db, record
from inputs import metrics_db, miles_dump, summaries_db

bu = harness.browser()

RESULTS = ROOT / "benchmarks" / "RESULTS-pages.md"
LARGE = metrics_db.PAGES_LARGE
DEMO = WORK / "pages_demo.duckdb"
LARGE_VERSION = "3"  # 3: run codes in the stored rows
SCALE = WORK / "pages_scale.duckdb"
SCALE_VERSION = "4"  # 2: run codes in the stored rows; 3: packed sampler lists (bench_summaries 5); 4: their table
TARGET_S = {"demo": 2.0, "large": 2.0, "scale": 1.0}  # scale: issue 12, every first visit <= 1 s


def build_demo() -> None:
    """The demo database as the app makes it on its first start (the demo runs loaded into an empty database),
    made here once so that a timed server start finds it."""
    from analysis.ingest.demo import ensure_demo
    from analysis.store import Store

    fresh_db(DEMO)
    with Store(DEMO) as store:
        ensure_demo(store)


def build_large() -> None:
    """The large database: the metrics database (inputs/metrics_db.py) plus the second run."""
    source = metrics_db.ensure()
    if not harness.is_built(LARGE, LARGE_VERSION):
        _with_second_run(source, LARGE, LARGE_VERSION)


def build_scale() -> None:
    """The run-scale database: the summaries database (inputs/summaries_db.py: 40M tokens over 400 steps, 16M
    routing rows, summaries) plus the second run."""
    source, _ = summaries_db.ensure()
    if not harness.is_built(SCALE, SCALE_VERSION):
        _with_second_run(source, SCALE, SCALE_VERSION)


def _with_second_run(source: Path, target: Path, version: str) -> None:
    """`target` = a copy of `source` (run 'bench') plus run 'bench-b': the first 10 steps of 'bench' renamed,
    in every stored table with a run column (tokens, the compact routing rows, expert load, the summaries: as
    ingest would have written them for those rows), so that Compare has two runs with different configs."""
    target.unlink(missing_ok=True)
    t0 = time.perf_counter()
    shutil.copy(source, target)
    con = duckdb.connect(str(target))
    tables = [t for (t,) in con.execute(
        """SELECT table_name FROM duckdb_columns() WHERE column_name = 'run' AND NOT internal
           AND table_name IN (SELECT table_name FROM duckdb_tables())
           AND table_name NOT IN ('runs', 'files', 'run_ids') ORDER BY table_name""").fetchall()]
    coded = [t for (t,) in con.execute(
        "SELECT table_name FROM duckdb_columns() WHERE column_name = 'run_id' AND NOT internal AND table_name IN "
        "(SELECT table_name FROM duckdb_tables()) AND table_name <> 'run_ids' ORDER BY table_name").fetchall()]
    con.execute("BEGIN TRANSACTION")
    stepped = {t for (t,) in con.execute("SELECT table_name FROM duckdb_columns() WHERE column_name = 'step'").fetchall()}
    for t in tables:  # a table without steps (expert_placement, probe) is copied whole
        first = " AND step < 10" if t in stepped else ""
        con.execute(f"INSERT INTO {t} SELECT * REPLACE ('bench-b' AS run) FROM {t} WHERE run = 'bench'{first}")
    # token and routing rows hold run codes (schema.RUN_IDS)
    con.execute("INSERT INTO run_ids SELECT max(run_id) + 1, 'bench-b' FROM run_ids")
    for t in coded:
        con.execute(f"""INSERT INTO {t} SELECT * REPLACE ((SELECT run_id FROM run_ids WHERE run = 'bench-b') AS run_id)
                        FROM {t} WHERE run_id = (SELECT run_id FROM run_ids WHERE run = 'bench') AND step < 10""")
    con.execute("""UPDATE runs SET config = '{"sampler_dtype": "bf16", "trainer_dtype": "fp32"}' WHERE run = 'bench'""")
    con.execute("""INSERT INTO runs (run, config) VALUES
                   ('bench-b', '{"sampler_dtype": "fp16", "trainer_dtype": "fp32"}')""")
    harness.stamp_built(con, version)
    con.execute("COMMIT")
    con.execute("CHECKPOINT")
    con.close()
    n, r, _ = sizes(target)
    print(f"built {target} ({', '.join(tables)}): {n:,} tokens, {r:,} routing rows in {time.perf_counter() - t0:.1f}s")


def measure(db: Path, rounds: int, env: dict, think: float = 0.0) -> dict:
    from playwright.sync_api import sync_playwright

    out: dict = {"first_load": None, "pages": {view: [] for view in bu.view_names()}}
    with bu.streamlit_server(db, env=env, timeout=300, log=WORK / f"{db.stem}.server.log") as url, \
            sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        t0 = time.perf_counter()
        page.goto(url)
        bu.wait_idle(page, "Overview", timeout_ms=600_000)
        out["first_load"] = time.perf_counter() - t0
        page.wait_for_timeout(think * 1000)
        order = bu.PAGES[1:] + bu.PAGES[:1]  # start away from the Overview the app opened on
        for _ in range(rounds):
            for label, title, _ in order:
                seconds = bu.goto_page(page, label, title, timeout_ms=300_000)
                if page.locator("[data-testid='stException'], [data-testid='stAlertContentError']").count():
                    raise RuntimeError(f"{label} shows an error on {db.name}")
                out["pages"][label].append(seconds)
                print(f"  {db.stem:12s} {label:12s} {seconds:6.2f}s", flush=True)
                page.wait_for_timeout(think * 1000)
                for tab, _, seconds in bu.visit_tabs(page, label, timeout_ms=300_000):  # each runs its queries
                    if page.locator("[data-testid='stException'], [data-testid='stAlertContentError']").count():
                        raise RuntimeError(f"{label} › {tab} shows an error on {db.name}")
                    out["pages"][f"{label} › {tab}"].append(seconds)
                    print(f"  {db.stem:12s} {label} › {tab}: {seconds:6.2f}s", flush=True)
                    page.wait_for_timeout(think * 1000)
        browser.close()
    return out


def profile(db: Path) -> list[tuple[str, float]]:
    """Seconds of each analysis call behind the pages' default views (what a cold page waits for), run
    directly on the database (no app, no cache)."""
    from analysis.metrics import dashboard
    from analysis.store import Store
    from ui.prefetch import DERIVED, default_calls
    from ui.state import Selection

    store = Store(db, read_only=True)
    try:
        runs = store.run_names()
        sel = Selection(runs=runs, steps=None, cap=2.0, clip=0.2)
        out = []
        for fn, args, kwargs in default_calls(sel, dashboard.routing_kinds(store, runs)):
            if fn in DERIVED:  # they make their own cached calls, through the app's cache: not timed here
                continue
            t0 = time.perf_counter()
            fn(store, *args, **kwargs)
            shown = ", ".join([repr(a) for a in args if isinstance(a, str) and a not in runs] +
                              [f"{k}={v!r}" for k, v in kwargs.items() if k not in ("cap", "clip", "steps")])
            out.append((f"{fn.__module__.split('.')[-1]}.{fn.__name__}({shown})", time.perf_counter() - t0))
        return out
    finally:
        store.close()


def switch(db: Path, a: str, b: str, clicks: int, settle: float) -> list[float]:
    """Seconds of each warm switch between pages `a` and `b` (sidebar labels): the per-click cost of the app itself
    once every query is cached (sidebar, page script, Streamlit's run bookkeeping, the browser's drawing). The app
    opens on `db` with its prefetch on, computes for `settle` seconds (every page's default view), both
    pages are visited twice untimed, then `clicks` clicks alternate between them."""
    from playwright.sync_api import sync_playwright

    titles = {label: title for label, title, _ in bu.PAGES}
    with bu.streamlit_server(db, timeout=300) as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        bu.wait_idle(page, "Overview", timeout_ms=600_000)
        time.sleep(settle)
        for label in (a, b, a, b):
            bu.goto_page(page, label, titles[label], 300_000)
        seconds = [bu.goto_page(page, label, titles[label], 300_000)
                   for label in (a if i % 2 == 0 else b for i in range(clicks))]
        browser.close()
    return seconds


# -- first opens: a fresh session and a fresh server, against a bare Streamlit page ----------------------------
BARE_APP = "tests/apps/bare_plotly.py"
FRESH_PAGES = ("Overview", "Token drift", "Routing", "Sequences", "Findings")  # the pages
FRESH_TARGET, FIRST_TARGET, MEMORY_TARGET_MB = 1.2, 2.0, 400.0
URLS = {"Overview": "overview", "Token drift": "token_drift", "Routing": "routing", "Expert load": "expert_load",
        "Sequences": "sequences", "Compare": "compare", "Findings": "findings", "Data": "data", "Lab": "lab"}
_BARE_IDLE_JS = """() => {
  const app = document.querySelector("[data-testid='stApp']");
  if (!app || app.getAttribute("data-test-script-state") !== "notRunning") return false;
  if (![...document.querySelectorAll("h1")].some(e => e.textContent.trim().startsWith("Bare"))) return false;
  return !!document.querySelector(".js-plotly-plot .main-svg");
}"""


def peak_mb(pid: int) -> float:
    """The peak resident memory of a running process so far (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _wait_bare(page, timeout_ms: float = 120_000) -> None:
    page.wait_for_function(_BARE_IDLE_JS, timeout=timeout_ms, polling=20)


def _wait_page(label: str):
    title = {lab: t for lab, t, _ in bu.PAGES}[label]

    def wait(page, timeout_ms=300_000):
        bu.wait_idle(page, title, timeout_ms, int(label in bu.CHART_PAGES))
        if label == "Sequences":  # its ranking is drawn by the table's own script, after the page is idle
            # (a checkout before ui/pick_table, timed with --code, draws it on a data grid's canvas)
            page.locator(".st-key-seq_table tbody tr, .st-key-seq_table canvas").first.wait_for(timeout=timeout_ms)
    return wait


def open_fresh(browser, url: str, wait) -> float:
    """Seconds from asking for `url` in a new browser context (a fresh session: no cookies, no cached scripts)
    until `wait(page)` returns."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = ctx.new_page()
        t0 = time.perf_counter()
        page.goto(url)
        wait(page)
        return time.perf_counter() - t0
    finally:
        ctx.close()


def server_first(browser, db: Path, app: str, env: dict, wait) -> tuple[float, float]:
    """(seconds from starting the server process to its first page idle in a fresh session, the server's peak
    memory in MB by then)."""
    procs: list = []
    t0 = time.perf_counter()
    with bu.streamlit_server(db, env=env, timeout=300, app=app, procs=procs, poll=0.05) as url:
        ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        page.goto(url)
        wait(page)
        seconds = time.perf_counter() - t0
        mem = peak_mb(procs[0].pid)
        ctx.close()
    return seconds, mem


def fresh(db: Path, rounds: int, pages: list[str], env: dict, settle: float, code: Path | None = None) -> dict:
    """The --fresh measurements on `db` (see the module's docstring), each side alternating with the bare app;
    with `code` (another checkout), its server's fresh opens too, in the same rotation."""
    from playwright.sync_api import sync_playwright

    bare_wait = _wait_bare
    ds_wait = _wait_page("Overview")
    out: dict = {"first": {"bare": [], "driftscope": []}, "memory": {"bare": [], "driftscope": []},
                 "open": {"bare": [], **{p: [] for p in pages}, **{(p, "other"): [] for p in pages if code}},
                 "pages": pages, "other": harness.commit_of(code) if code else None}
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        for r in range(rounds):  # a server's first page: bare, Driftscope, then the other way round
            sides = [("bare", BARE_APP, bare_wait), ("driftscope", "app.py", ds_wait)]
            for name, app, wait in (sides if r % 2 == 0 else sides[::-1]):
                seconds, mem = server_first(browser, db, app, env, wait)
                out["first"][name].append(seconds)
                out["memory"][name].append(mem)
                print(f"  server's first page, {name:10s} {seconds:6.2f}s  peak {mem:5.0f} MB", flush=True)
        with contextlib.ExitStack() as servers:
            url = servers.enter_context(bu.streamlit_server(db, env=env, timeout=300,
                                                            log=WORK / f"{db.stem}.fresh.log"))
            bare_url = servers.enter_context(bu.streamlit_server(db, env=env, timeout=300, app=BARE_APP))
            other_url = servers.enter_context(bu.streamlit_server(db, env=env, timeout=300, code=code)) \
                if code else None
            for label in pages:  # untimed: every page's queries computed once (the server has been used)
                for base in filter(None, (url, other_url)):
                    open_fresh(browser, f"{base}/{URLS[label]}", _wait_page(label))
            open_fresh(browser, bare_url, bare_wait)
            time.sleep(settle)  # the prefetch of the other views, the kernels' warm-up child
            for r in range(rounds):
                for label in (pages if r % 2 == 0 else pages[::-1]):
                    sides = [("bare", bare_url, bare_wait), (label, f"{url}/{URLS[label]}", _wait_page(label))]
                    if other_url:
                        sides.append(((label, "other"), f"{other_url}/{URLS[label]}", _wait_page(label)))
                    for name, target, wait in (sides if r % 2 == 0 else sides[::-1]):
                        seconds = open_fresh(browser, target, wait)
                        out["open"][name].append(seconds)
                        print(f"  fresh session, {' '.join(name) if isinstance(name, tuple) else name:18s} "
                              f"{seconds:6.2f}s", flush=True)
        browser.close()
    return out


def render_fresh(name: str, r: dict) -> str:
    med = statistics.median
    bare = med(r["open"]["bare"])
    lines = [f"**{name}** database, {len(r['open']['bare'])} bare opens alternating with the pages'; medians, "
             f"seconds from asking for the URL in a new browser context to the page idle with its charts drawn "
             f"(target ≤ {FRESH_TARGET:g}× the bare page):", "",
             "| page | seconds (each open) | median | × bare |", "|---|---|---:|---:|",
             f"| bare Streamlit page, one plotly chart | {' '.join(f'{x:.2f}' for x in r['open']['bare'])} | "
             f"{bare:.2f} | 1.00 |"]
    for label in r["pages"]:
        t = r["open"][label]
        ratio = med(t) / bare
        cell = f"**{ratio:.2f}**" if ratio > FRESH_TARGET else f"{ratio:.2f}"
        lines.append(f"| {label} | {' '.join(f'{x:.2f}' for x in t)} | {med(t):.2f} | {cell} |")
        if r.get("other"):
            o = r["open"][(label, "other")]
            lines.append(f"| {label} at {r['other']} (--code) | {' '.join(f'{x:.2f}' for x in o)} | {med(o):.2f} | "
                         f"{med(o) / bare:.2f} |")
    fb, fd = med(r["first"]["bare"]), med(r["first"]["driftscope"])
    mb, md = max(r["memory"]["bare"]), max(r["memory"]["driftscope"])
    lines += ["", "Server's first page (process start → first page idle; target ≤ "
              f"{FIRST_TARGET:g}× the bare app's): "
              f"bare {fb:.2f} s ({', '.join(f'{x:.2f}' for x in r['first']['bare'])}), Driftscope's Overview "
              f"{fd:.2f} s ({', '.join(f'{x:.2f}' for x in r['first']['driftscope'])}): **{fd / fb:.2f}×**. "
              f"Peak server memory at first view (VmHWM, the server process only): bare {mb:.0f} MB, Driftscope "
              f"{md:.0f} MB (target ≤ {MEMORY_TARGET_MB:.0f} MB)."]
    return "\n".join(lines) + "\n"


# -- server start to the first chart of per-step mismatch, beside miles' dashboard ------------------------------
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"  # radixark/miles, read for the dump layout too
MILES_SRC = WORK / "miles-src"
MILES_ENV = WORK / "miles-env"  # fastapi + uvicorn, apart from the shared environment
MILES_DB = WORK / "miles_ds.duckdb"
MILES_CHART = "dump/mean_abs_lp_diff"
_MILES_CHART_JS = """(key) => {
  const title = [...document.querySelectorAll("p.chart-title")].find(e => e.textContent.trim() === key);
  if (!title) return false;
  const panel = title.parentElement;  // its "loading…" line goes once the series is drawn on the canvas
  const canvas = panel.querySelector("canvas");
  return !panel.querySelector("p.muted") && !!canvas && canvas.width > 0;
}"""


# Driftscope's first chart of per-step mismatch: the Overview's per-step curves, drawn (the page may still be
# drawing its other elements and charts)
_CHART_DRAWN_JS = """(key) => {
  const box = document.querySelector(`.st-key-${key} div.drift-chart`);
  return !!box && !box.dataset.pending && !!box.querySelector(".main-svg");
}"""


def _wait_chart(key: str):
    return lambda page, timeout_ms=300_000: page.wait_for_function(_CHART_DRAWN_JS, arg=key, timeout=timeout_ms,
                                                                   polling=20)


def miles_first_chart(browser, dump: Path, cold: bool) -> tuple[float, float]:
    """(seconds from starting miles' server to its dump/mean_abs_lp_diff chart drawn, its peak memory in MB).
    `cold`: its per-rollout summary cache (dump/dashboard/cache) removed first, as on a dump's first view."""
    if cold:
        shutil.rmtree(dump / "dashboard" / "cache", ignore_errors=True)
    port = bu.free_port()
    env = os.environ | {"PYTHONPATH": f"{MILES_SRC}{os.pathsep}{MILES_ENV}"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "miles.dashboard.serve", "--dump-details", str(dump), "--host",
                             "127.0.0.1", "--port", str(port)], cwd=WORK, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"miles' dashboard exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/api/meta", timeout=2):
                    break
            except OSError:
                time.sleep(0.05)
        ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        page.goto(url)
        page.wait_for_function(_MILES_CHART_JS, arg=MILES_CHART, timeout=300_000, polling=20)
        seconds = time.perf_counter() - t0
        mem = peak_mb(proc.pid)
        ctx.close()
        return seconds, mem
    finally:
        proc.terminate()
        proc.wait(20)


def miles(rounds: int) -> dict:
    """--miles: both tools on the same dump, alternating (see the module's docstring)."""
    from playwright.sync_api import sync_playwright

    from analysis.ingest import ingest_paths
    from analysis.store import Store

    if not (MILES_SRC / "miles" / "dashboard" / "serve.py").exists() or not (MILES_ENV / "fastapi").is_dir():
        raise SystemExit(f"--miles needs miles' source in {MILES_SRC} and fastapi + uvicorn in {MILES_ENV}: see "
                         "`python benchmarks/bench_pages.py --help`'s description")
    dump, n_tokens = miles_dump.ensure()
    fresh_db(MILES_DB)
    t0 = time.perf_counter()
    with Store(MILES_DB) as store:
        outcomes = ingest_paths(store, [dump])
    ingest_s = time.perf_counter() - t0
    bad = [o.line() for o in outcomes if o.status != "loaded"]
    if bad:
        raise SystemExit("\n".join(bad))
    env = {"DRIFT_NO_DEMO": "1"}
    out = {"tokens": n_tokens, "ingest": ingest_s, "driftscope": [], "miles cold": [], "miles warm": []}
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        sides = {"driftscope": lambda: server_first(browser, MILES_DB, "app.py", env, _wait_chart("overview_curves")),
                 "miles cold": lambda: miles_first_chart(browser, dump, cold=True),
                 "miles warm": lambda: miles_first_chart(browser, dump, cold=False)}
        for r in range(rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                seconds, mem = sides[name]()
                out[name].append((seconds, mem))
                print(f"  start → first chart, {name:10s} {seconds:6.2f}s  peak {mem:5.0f} MB", flush=True)
        browser.close()
    return out


def render_miles(r: dict) -> str:
    med = statistics.median
    lines = [f"Server start → first chart of per-step mismatch on the same miles dump ({r['tokens']:,} tokens; "
             f"inputs/miles_dump.py), one tool at a time, alternating; miles at {MILES_COMMIT[:7]} (its "
             f"`{MILES_CHART}` chart; cold: its summary cache removed before the start, warm: kept), Driftscope's "
             f"Overview per-step curves drawn, on a database that ingested the folder in {r['ingest']:.2f} s "
             "(once, not in the times):", "",
             "| tool | seconds (each start) | median | peak server memory, MB |", "|---|---|---:|---:|"]
    for name in ("driftscope", "miles cold", "miles warm"):
        t = [s for s, _ in r[name]]
        lines.append(f"| {name} | {' '.join(f'{x:.2f}' for x in t)} | {med(t):.2f} | "
                     f"{max(m for _, m in r[name]):.0f} |")
    d = med([s for s, _ in r["driftscope"]])
    lines += ["", f"Driftscope / miles: {d / med([s for s, _ in r['miles cold']]):.2f}× (cold), "
              f"{d / med([s for s, _ in r['miles warm']]):.2f}× (warm)."]
    return "\n".join(lines) + "\n"


def sizes(db: Path) -> tuple[int, int, int]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return tuple(con.execute(q).fetchall()[0][0] for q in (
            "SELECT count(*) FROM tokens", "SELECT count(*) FROM routing", "SELECT count(*) FROM runs"))
    finally:
        con.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("demo", "large", "scale"), default=None,
                    help="one database (default: demo and large); scale: 40M tokens + 16M routing rows, two runs")
    ap.add_argument("--rounds", type=int, default=2, help="visits per page: the first cold, the rest warm")
    ap.add_argument("--prefetch", choices=("on", "off"), default="on",
                    help="the app's background prefetch of other pages' default views (DRIFT_PREFETCH)")
    ap.add_argument("--think", type=float, default=0.0, help="seconds spent on each page before the next click")
    ap.add_argument("--profile", action="store_true", help="also time each analysis call on the large database")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-pages.md")
    ap.add_argument("--switch", nargs=2, metavar="PAGE", choices=[label for label, _, _ in bu.PAGES],
                    help="instead: time warm switches between two pages (sidebar labels) on --db; prints the "
                         "seconds of each click and their median, writes nothing")
    ap.add_argument("--db", type=Path, help="with --switch: the database (default: the large one, built when missing)")
    ap.add_argument("--clicks", type=int, default=12, help="with --switch: timed clicks (default 12)")
    ap.add_argument("--settle", type=float, default=45.0,
                    help="with --switch: seconds the app computes in the background before the clicks (default 45)")
    ap.add_argument("--fresh", action="store_true",
                    help="instead: first opens (a fresh session, a fresh server) side by side with a bare page")
    ap.add_argument("--pages", choices=("issue", "all"), default="issue",
                    help="with --fresh: the issue's five pages, or every page")
    ap.add_argument("--code", type=Path, help="with --fresh: another checkout whose server's fresh opens are timed "
                                              "in the same rotation (a change side by side with its base)")
    ap.add_argument("--miles", action="store_true",
                    help="instead: server start to the first per-step chart, beside miles' dashboard")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    load = f"load average at the start {os.getloadavg()[0]:.1f} (2 cores shared)"
    if args.fresh:
        pages = list(URLS) if args.pages == "all" else list(FRESH_PAGES)
        env = {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": "1" if args.prefetch == "on" else "0"}
        if args.code:  # two servers on one database: DuckDB lets several processes open it read-only only
            env["DRIFT_READ_ONLY"] = "1"
        if args.only == "scale":
            build_scale()
            db, name = SCALE, "scale"
        else:
            db, name = DEMO, "demo"
            build_demo()
        r = fresh(db, args.rounds, pages, env, settle=args.settle if args.settle != 45.0 else 15.0, code=args.code)
        record(RESULTS, render_fresh(name, r), "# Page speed in a real browser", write=not args.no_write,
               note=load + "; sides alternate, so a busy moment hits both.")
        return 0
    if args.miles:
        record(RESULTS, render_miles(miles(args.rounds)), "# Page speed in a real browser", write=not args.no_write,
               note=load + "; sides alternate, so a busy moment hits both.")
        return 0
    if args.switch:
        if args.db is None:
            build_large()
        a, b = args.switch
        seconds = switch(args.db or LARGE, a, b, args.clicks, args.settle)
        print(" ".join(f"{s:.2f}" for s in seconds))
        print(f"median {statistics.median(seconds):.3f} s over {len(seconds)} clicks ({a} <-> {b})")
        return 0
    results = {}
    prefetch = "1" if args.prefetch == "on" else "0"
    if args.only in (None, "demo"):
        fresh_db(DEMO)  # the app loads the demo runs into the empty database on start
        print("demo database")
        results["demo"] = measure(DEMO, args.rounds, {"DRIFT_NO_DEMO": "", "DRIFT_PREFETCH": prefetch}, args.think)
        results["demo"]["size"] = sizes(DEMO)
    if args.only in (None, "large"):
        build_large()
        print("large database")
        results["large"] = measure(LARGE, args.rounds, {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": prefetch},
                                   args.think)
        results["large"]["size"] = sizes(LARGE)
        if args.profile:
            results["large"]["profile"] = profile(LARGE)
    if args.only == "scale":
        build_scale()
        print("scale database")
        results["scale"] = measure(SCALE, args.rounds, {"DRIFT_NO_DEMO": "1", "DRIFT_PREFETCH": prefetch}, args.think)
        results["scale"]["size"] = sizes(SCALE)
        if args.profile:
            results["scale"]["profile"] = profile(SCALE)
    record(RESULTS, render(results), "# Page speed in a real browser", write=not args.no_write,
           note="Other jobs may share the cores.")
    return 0


def render(results: dict) -> str:
    lines = []
    for name, r in results.items():
        n_tok, n_rout, n_runs = r["size"]
        lines.append(f"- **{name}**: {n_tok:,} tokens, {n_rout:,} routing rows, {n_runs} runs; "
                     f"first load (browser opens → Overview idle; the Overview's queries, and for demo the loading "
                     f"of the demo runs, included) {r['first_load']:.2f} s")
    lines += ["", "Seconds from clicking the page's link (or a tab, `page › tab`) to idle (script done, all charts "
              "drawn). A page opens on its first tab; the other tabs run their queries when clicked. Cold = first "
              "visit (Overview: its first revisit, it was computed by the first load); warm = median of later visits. "
              "Target: " + ", ".join(f"{n} ≤ {TARGET_S[n]:g} s" for n in results)
              + "; a cold visit over it is in bold.",
              ""]
    names = list(results)
    over: dict[str, list[str]] = {n: [] for n in names}  # views whose first visit missed the target
    head = "| page | " + " | ".join(f"{n} cold | {n} warm" for n in names) + " |"
    lines += [head, "|---|" + "---:|---:|" * len(names)]
    for label in bu.view_names():
        cells = []
        for n in names:
            t = results[n]["pages"][label]
            cold = t[0] if t else float("nan")
            warm = statistics.median(t[1:]) if len(t) > 1 else float("nan")
            if cold > TARGET_S[n]:
                over[n].append(label)
            cells += [f"**{cold:.2f}**" if cold > TARGET_S[n] else f"{cold:.2f}", f"{warm:.2f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for n in names:
        lines.append(f"\n{n}: {len(bu.view_names()) - len(over[n])} of {len(bu.view_names())} first visits within "
                     f"{TARGET_S[n]:g} s" + (f"; over it: {', '.join(over[n])}" if over[n] else ""))
    for name, r in results.items():
        if r.get("profile"):
            lines += ["", f"Analysis calls behind the default views on **{name}** (direct, uncached, in order):", "",
                      "| call | seconds |", "|---|---:|"]
            lines += [f"| `{call}` | {sec:.2f} |" for call, sec in r["profile"]]
            lines.append(f"| total | {sum(sec for _, sec in r['profile']):.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
