"""Load test: one `streamlit run app.py` server, N concurrent browser sessions visiting every page in random order.

    python benchmarks/bench_load.py [--sessions 4] [--rounds 2] [--db demo|large|PATH] [--viewer] [--think S]

Each session is its own process with its own headless Chromium (Playwright's sync objects must stay in the thread
that made them). A warm-up visit opens the app once first (on the demo database this loads the demo runs); then
all sessions start together and each visits the seven pages in a new random order per round, timing the click on
the page's sidebar link until the page is idle (script finished, title shown, every plotly chart drawn), then
each of the page's other tabs (`page › tab`) from the click on the tab. Errors
counted: exception boxes, error alerts, pages that never got idle (timeouts), and tracebacks in the server's log.

--db demo (default): a fresh database in benchmarks/work/ that the app fills with the demo runs. --db large: a
copy of benchmarks/work/pages_large.duckdb (bench_pages.py) or of the metrics database (benchmarks/inputs/
metrics_db.py), 5-6M tokens; the copy keeps other benchmarks' files unlocked. --viewer runs the server in viewer
mode (DRIFT_READ_ONLY=1, the hosted setup for an untrusted audience). Results are appended to
benchmarks/RESULTS-load.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np

import harness
from harness import ROOT, WORK, fresh_db, record
from inputs import metrics_db

bu = harness.browser()

RESULTS = ROOT / "benchmarks" / "RESULTS-load.md"
LARGE_SOURCES = [metrics_db.PAGES_LARGE, metrics_db.DB]


def _errors_on_page(page) -> list[str]:
    found = []
    if page.locator("[data-testid='stException']").count():
        found.append("exception box")
    found += [f"error alert: {t[:120]}" for t in
              page.locator("[data-testid='stAlertContentError']").all_inner_texts()]
    return found


def session(idx: int, url: str, rounds: int, think: float, timeout_s: float, seed: int, barrier) -> dict:
    """One browser session (runs in its own process): [(label, seconds | None, [errors])] per visit."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    rng = random.Random(seed * 1000 + idx)
    visits: list[tuple[str, float | None, list[str]]] = []
    with sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        t0 = time.perf_counter()
        page.goto(url)
        bu.wait_idle(page, "Overview", timeout_ms=timeout_s * 1000)
        first = time.perf_counter() - t0
        barrier.wait()  # every session has its page open: start the clicks together
        t_start = time.perf_counter()
        current = "Overview"
        for _ in range(rounds):
            order = bu.PAGES[:]
            rng.shuffle(order)
            if order[0][0] == current:  # clicking the page you are on measures nothing
                order.append(order.pop(0))
            for label, title, _ in order:
                try:
                    seconds = bu.goto_page(page, label, title, timeout_ms=timeout_s * 1000)
                    visits.append((label, seconds, _errors_on_page(page)))
                    current = label
                    for tab, _, seconds in bu.visit_tabs(page, label, timeout_ms=timeout_s * 1000):
                        visits.append((f"{label} › {tab}", seconds, _errors_on_page(page)))
                except PlaywrightTimeout:
                    visits.append((label, None, [f"timeout after {timeout_s:g} s"]))
                    page.goto(url)  # start over from a fresh page load
                    bu.wait_idle(page, "Overview", timeout_ms=timeout_s * 1000)
                    current = "Overview"
                if think:
                    page.wait_for_timeout(think * 1000)
        wall = time.perf_counter() - t_start
        browser.close()
    return {"session": idx, "first_load": first, "wall": wall, "visits": visits}


def _run_session(args) -> dict:
    return session(*args)


def prepare_db(choice: str) -> tuple[Path, dict, str]:
    """(database path, environment, description)."""
    WORK.mkdir(parents=True, exist_ok=True)
    if choice == "demo":
        db = fresh_db(WORK / "load_demo.duckdb")  # the app loads the demo runs into the empty database on start
        return db, {"DRIFT_NO_DEMO": ""}, "demo runs (data/demo, loaded by the app on start)"
    if choice == "large":
        src = next((p for p in LARGE_SOURCES if p.exists()), None)
        if src is None:
            raise SystemExit("no large database: build one with `python benchmarks/bench_metrics.py` "
                             "(or bench_pages.py --only large) first")
        db = WORK / "load_large.duckdb"
        if not db.exists() or db.stat().st_mtime < src.stat().st_mtime:
            shutil.copy(src, db)
        return db, {"DRIFT_NO_DEMO": "1"}, f"copy of {src.relative_to(ROOT)}"
    db = Path(choice).resolve()
    if not db.exists():
        raise SystemExit(f"{db} does not exist")
    return db, {"DRIFT_NO_DEMO": "1"}, str(db)


def db_size(db: Path) -> str:
    import duckdb
    con = duckdb.connect(str(db), read_only=True)
    try:
        n_tok = con.execute("SELECT count(*) FROM tokens").fetchall()[0][0]
        n_rout = con.execute("SELECT count(*) FROM routing").fetchall()[0][0]
        n_runs = con.execute("SELECT count(*) FROM runs").fetchall()[0][0]
    finally:
        con.close()
    return f"{n_tok:,} tokens, {n_rout:,} routing rows, {n_runs} runs"


def server_pid(url: str) -> int | None:
    """The `streamlit run` process listening on url's port (found through /proc; None where there is no /proc)."""
    port = url.rsplit(":", 1)[-1]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"streamlit" in b" ".join(args) and port.encode() in args:
            return int(proc.name)
    return None


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process, in seconds (nan when unknown)."""
    if pid is None:
        return float("nan")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def render(desc: str, size: str, env: dict, warmup: float, results: list[dict], wall: float,
           log_tracebacks: int, phase: tuple[float, float]) -> str:
    times: dict[str, list[float]] = {view: [] for view in bu.view_names()}
    errors: list[str] = []
    for r in results:
        for label, seconds, errs in r["visits"]:
            if seconds is not None:
                times[label].append(seconds)
            errors += [f"session {r['session']}, {label}: {e}" for e in errs]
    every = [t for ts in times.values() for t in ts]
    n_visits = sum(len(r["visits"]) for r in results)
    lines = [f"- Database: {desc}: {size}. Server env: "
             + (", ".join(f"{k}={v or '(empty)'}" for k, v in sorted(env.items())) or "none") + ".",
             f"- Warm-up visit (server started → Overview idle, alone): {warmup:.2f} s. Per-session first load once "
             f"all {len(results)} opened together: "
             + ", ".join(f"{r['first_load']:.1f}" for r in results) + " s.",
             f"- {n_visits} page and tab visits in {wall:.0f} s of concurrent clicking "
             f"({n_visits / wall * 60:.0f} visits/min across sessions).",
             f"- Server process CPU while the sessions ran ({phase[0]:.0f} s, their first loads included): "
             f"{phase[1]:.1f} s, {phase[1] / phase[0]:.0%} of one core, "
             f"{phase[1] / (n_visits + len(results)) * 1000:.0f} ms per page load; the rest of the 2 cores went to "
             "the Chromiums (and other jobs).",
             f"- **Overall time to idle: p50 {pct(every, 50):.2f} s, p95 {pct(every, 95):.2f} s, "
             f"max {max(every, default=float('nan')):.2f} s.**",
             f"- Errors: {len(errors)} on pages" + (": " + "; ".join(errors[:10]) if errors else "")
             + f"; server log tracebacks: {log_tracebacks}.", "",
             "| page › tab | visits | p50 s | p95 s | max s |", "|---|---:|---:|---:|---:|"]
    for label, ts in times.items():
        lines.append(f"| {label} | {len(ts)} | {pct(ts, 50):.2f} | {pct(ts, 95):.2f} | "
                     f"{max(ts, default=float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4, help="concurrent browser sessions (default 4)")
    ap.add_argument("--rounds", type=int, default=2, help="times each session visits every page (default 2)")
    ap.add_argument("--db", default="demo", help="demo (default), large, or a path to a database")
    ap.add_argument("--viewer", action="store_true", help="viewer mode on the server (DRIFT_READ_ONLY=1)")
    ap.add_argument("--prefetch", choices=("on", "off"), default="on", help="the app's background prefetch")
    ap.add_argument("--think", type=float, default=0.0, help="seconds each session waits on a page (default 0)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a page may take before it counts as an "
                                                                 "error (default 120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-limit", default=None, help="DRIFT_MEMORY_LIMIT for the server, e.g. 2GiB")
    ap.add_argument("--threads", default=None, help="DRIFT_THREADS for the server")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-load.md")
    args = ap.parse_args()

    db, env, desc = prepare_db(args.db)
    env["DRIFT_PREFETCH"] = "1" if args.prefetch == "on" else "0"
    if args.viewer:
        env["DRIFT_READ_ONLY"] = "1"
    if args.memory_limit:
        env["DRIFT_MEMORY_LIMIT"] = args.memory_limit
    if args.threads:
        env["DRIFT_THREADS"] = str(args.threads)
    log = WORK / f"load_{args.db if args.db in ('demo', 'large') else 'custom'}.server.log"
    print(f"database: {db} ({desc}); {args.sessions} sessions × {args.rounds} rounds × {len(bu.PAGES)} pages")
    with bu.streamlit_server(db, env=env, timeout=300, log=log) as url:
        from playwright.sync_api import sync_playwright
        with sync_playwright() as p:  # warm-up: the first visit opens the database (and loads the demo)
            browser = bu.launch_chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            t0 = time.perf_counter()
            page.goto(url)
            bu.wait_idle(page, "Overview", timeout_ms=600_000)
            warmup = time.perf_counter() - t0
            browser.close()
        print(f"warm-up {warmup:.1f} s; starting {args.sessions} sessions")
        pid = server_pid(url)
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            barrier = manager.Barrier(args.sessions)
            jobs = [(i, url, args.rounds, args.think, args.timeout, args.seed, barrier) for i in range(args.sessions)]
            t0, cpu0 = time.perf_counter(), cpu_seconds(pid)
            cpu1 = cpu0
            with ctx.Pool(args.sessions) as pool:
                result = pool.map_async(_run_session, jobs)
                while not result.ready():  # the server's CPU time over the sessions' first loads and clicks
                    cpu1 = cpu_seconds(pid)
                    time.sleep(0.5)
                results = result.get()
            phase = (time.perf_counter() - t0, cpu1 - cpu0)
            wall = max(r["wall"] for r in results)
    size = db_size(db)
    tracebacks = log.read_text(errors="replace").count("Traceback")
    report = render(desc, size, env, warmup, results, wall, tracebacks, phase)
    record(RESULTS, report, HEADER, write=not args.no_write,
           note=f"The server and {len(results)} Chromiums share the cores.")
    return 0


HEADER = """# Load: concurrent sessions against one server

`benchmarks/bench_load.py` starts `streamlit run app.py` on a free port, opens the app once (warm-up), then runs
N browser sessions at the same time (one process and one headless Chromium each). Each session visits the seven
pages in a fresh random order per round and times each visit from the click on the sidebar link until the page is
idle: the script has finished, the page's title is shown, every plotly chart has drawn. p50/p95 are over all
visits of all sessions. Errors: exception boxes, error alerts, timeouts, and tracebacks in the server's log.
Every run appends a section below, with its exact command.
"""


if __name__ == "__main__":
    raise SystemExit(main())
