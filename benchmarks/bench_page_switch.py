"""Time warm switches between two pages in a real browser: the per-click cost of the app itself once every
query is cached (sidebar, page script, Streamlit's run bookkeeping, the browser's drawing).

    python benchmarks/bench_page_switch.py DB "Lab" "Findings" [--clicks 12] [--settle 45]

It opens the app on DB (prefetch on, as the app runs by default), waits --settle seconds so the prefetch has
computed every page's default view and imported the lab, visits both pages twice untimed, then clicks between
them and prints each click's seconds to idle (script done, all charts drawn) and their median. Run it on two
checkouts (or before and after a change) one after the other: only side-by-side medians compare.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import browser as bu  # noqa: E402  (tests/helpers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db", type=Path)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--clicks", type=int, default=12)
    ap.add_argument("--settle", type=float, default=45.0)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    titles = {label: title for label, title, _ in bu.PAGES}
    with bu.streamlit_server(args.db, timeout=300) as url, sync_playwright() as p:
        browser = bu.launch_chromium(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        bu.wait_idle(page, "Overview", timeout_ms=600_000)
        time.sleep(args.settle)
        for label in (args.a, args.b, args.a, args.b):
            bu.goto_page(page, label, titles[label], 300_000)
        seconds = []
        for i in range(args.clicks):
            label = args.a if i % 2 == 0 else args.b
            seconds.append(bu.goto_page(page, label, titles[label], 300_000))
        browser.close()
    print(" ".join(f"{s:.2f}" for s in seconds))
    print(f"median {statistics.median(seconds):.3f} s over {len(seconds)} clicks ({args.a} <-> {args.b})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
