"""Live runs: the app follows the log folders its host names and redraws the open page in place as steps land.

Which folders: only `DRIFT_WATCH_DIRS` (folders separated by os.pathsep, read from the server's environment when
the database is opened). No widget, URL parameter or upload can name a folder, so a visitor of a hosted app
cannot make it read a server path.

One writer: DuckDB lets one process open a database file read-write, and while it does no other process may
open it, not even read-only (benchmarks/RESULTS-live.md: 20 of 20 opens fail). So the app does not read a database that a
separate `python -m analysis watch` fills; it runs the same watcher in a thread of its own and loads through its
one Store, whose lock serialises the watcher's transactions with the Data page's; the pages keep reading
through their own cursors meanwhile.

Refresh: each load bumps the data version. A small fragment in the sidebar reruns every DRIFT_WATCH_INTERVAL
seconds (st.fragment(run_every=...)): it redraws the runs' last step and file age, and only when the data
version moved since the page was drawn does it rerun the script. That rerun happens inside the open page:
the browser keeps it, the session keeps its widgets (runs, step range, tab in the URL) and the charts keep
their zoom: ui/charts.py names each figure's view in plotly's uirevision, and ui/plot.py redraws a chart in
place (Plotly.react into the same div), so plotly keeps the user's axis ranges while the view is the same.
The "Follow live runs" toggle pauses it for the session; the watcher itself goes on loading.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from analysis import settings

if TYPE_CHECKING:  # the ingest stack (numba) loads only when a folder is followed: start()
    from analysis.ingest import watch

log = logging.getLogger("driftscope.live")

WATCH_DIRS_ENV = settings.WATCH_DIRS.name
INTERVAL_ENV = settings.WATCH_INTERVAL.name
DEFAULT_INTERVAL = settings.WATCH_INTERVAL.default
SETTLE_S = 1.0  # the least time a file keeps its size and time before it is read
FOLLOW_KEY = "live_follow"
DRAWN = "_live_drawn_version"  # the data version the page on screen was drawn from


def watch_dirs(environ: Mapping[str, str] | None = None) -> list[Path]:
    """The folders the host allows the app to follow: DRIFT_WATCH_DIRS, os.pathsep-separated; nothing else."""
    return list(settings.WATCH_DIRS.read(environ))


def interval(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between polls of the folders and between refreshes of the page (DRIFT_WATCH_INTERVAL, 0.2–60).
    A poll of a folder of 2,000 files costs 0.04–0.1 s of one core (benchmarks/RESULTS-live.md)."""
    return min(60.0, max(0.2, settings.WATCH_INTERVAL.read(environ)))


@dataclass
class LiveWatcher:
    """The app's watcher thread and what the sidebar shows of it."""
    watcher: watch.FolderWatcher
    interval: float
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    refused: deque = field(default_factory=lambda: deque(maxlen=5))  # the latest refusal lines
    n_loaded: int = 0

    def close(self, timeout: float = 10.0) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout)


_running: list[LiveWatcher] = []


def start(app, environ: Mapping[str, str] | None = None) -> LiveWatcher | None:
    """Start following the host's folders into `app.store` (an ui.state.AppDB); None when none are set."""
    folders = watch_dirs(environ)
    if not folders:
        return None
    every = interval(environ)
    from analysis.ingest import watch
    live = LiveWatcher(watch.FolderWatcher(app.store, folders, settle=max(SETTLE_S, every)), every)

    def report(outcome) -> None:
        log.info("%s", outcome.line())
        if outcome.status == "loaded":
            live.n_loaded += 1
            app.changed()  # cached results are dropped; open pages redraw on their next tick
        elif outcome.status == "refused":
            live.refused.append(outcome.line())

    def loop() -> None:
        try:
            live.watcher.run_forever(live.stop, every, report)
        except Exception:  # the pages must go on even if following fails (e.g. the database went away)
            log.exception("the live watcher stopped")

    live.thread = threading.Thread(target=loop, name="driftscope-watch", daemon=True)
    live.thread.start()
    _running.append(live)
    return live


def stop_all() -> None:
    """Stop every watcher this process started (tests)."""
    while _running:
        _running.pop().close()
