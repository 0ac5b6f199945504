"""The app under streamlit's AppTest: its script, the pages with their titles, a pages manager that keeps
st.navigation's routing across runs, and what a test reads off a run (errors, texts) or does (open a tab)."""
from __future__ import annotations

from pathlib import Path

from streamlit.runtime.pages_manager import PagesManager
from streamlit.testing.v1 import AppTest, app_test

from helpers import ROOT

APP = str(ROOT / "app.py")
TIMEOUT = 60  # seconds per script run: DuckDB pages on a loaded 2-core machine

PAGES = {  # page file -> its title
    "pages/findings.py": "Findings",
    "pages/overview.py": "Overview",
    "pages/token_drift.py": "Token drift",
    "pages/routing.py": "Routing",
    "pages/expert_load.py": "Expert load",
    "pages/sequences.py": "Sequences",
    "pages/compare.py": "Compare runs",
    "pages/data.py": "Data",
    "pages/lab.py": "Drift lab",
}


class NavigationOnly(PagesManager):
    """AppTest resets PagesManager.uses_pages_directory before every run; with a pages/ folder next to app.py
    it then takes the v1 path from the second run on and runs the page script without app.py (no sidebar).
    A real server keeps the flag that st.navigation set, so pin it the same way here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        PagesManager.uses_pages_directory = False


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


def open_tab(at, key: str, label: str):
    at.session_state[key] = label  # what clicking the tab does (on_change="rerun": the page reruns)
    return at.run()


def app_env(monkeypatch) -> None:
    """What every AppTest of the pages runs under: st.navigation's routing kept, no demo, no prefetch, writable."""
    monkeypatch.setattr(app_test, "PagesManager", NavigationOnly)
    monkeypatch.setenv("DRIFT_NO_DEMO", "1")
    monkeypatch.setenv("DRIFT_PREFETCH", "0")  # no background work between tests (one test turns it on)
    monkeypatch.delenv("DRIFT_READ_ONLY", raising=False)


def open_app(monkeypatch, db: Path, page: str | None = None) -> AppTest:
    monkeypatch.setenv("DRIFT_DB", str(db))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, at.exception
    if page:
        at.switch_page(page).run()
        assert not at.exception, at.exception
    return at


def demo_database(folder: Path) -> Path:
    """A database in `folder` holding every bundled demo run (data/demo), for page tests on the demo."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store
    db = folder / "drift.duckdb"
    store = Store(db)
    outcomes = ingest_paths(store, sorted(p for p in (ROOT / "data" / "demo").iterdir() if p.is_dir()))
    assert outcomes and all(o.status == "loaded" for o in outcomes), [o.line() for o in outcomes]
    store.close()
    return db


def overview_cards(at: AppTest) -> list[dict]:
    """The Overview's headline cards (ui/glossary.cards_html) as drawn: per run its name, note, logging check, and
    its metrics as (label, value, help, captions), read back from the HTML the page sent."""
    from html.parser import HTMLParser

    class Cards(HTMLParser):
        def __init__(self):
            super().__init__()
            self.cards: list[dict] = []
            self.field: str | None = None  # the class of the text being read

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            cls = a.get("class", "")
            if cls == "drift-card":
                self.cards.append({"run": a["data-run"], "note": "", "check": None, "metrics": []})
            elif cls == "drift-metric":
                self.cards[-1]["metrics"].append({"label": a["data-label"], "value": a["data-value"],
                                                  "help": None, "captions": []})
            elif cls == "label" and self.cards and self.cards[-1]["metrics"]:
                self.cards[-1]["metrics"][-1]["help"] = a.get("title")
            elif cls == "drift-card-check":
                self.cards[-1]["check"] = ""
            self.field = cls

        def handle_data(self, data):
            if not self.cards:
                return
            card = self.cards[-1]
            if self.field == "note":
                card["note"] += data
            elif self.field == "line":  # the logging check's words (after its badge)
                card["check"] += data
            elif self.field in ("caption", "caption warn"):
                card["metrics"][-1]["captions"].append(data)

        def handle_endtag(self, tag):
            self.field = None

    parser = Cards()
    for e in at.get("html"):
        if 'class="drift-cards"' in e.proto.body:
            parser.feed(e.proto.body)
    return parser.cards


def static_tables(at: AppTest):
    """The tables ui/state.static_table drew, as pandas frames of strings (column names from the header)."""
    import pandas as pd
    from html.parser import HTMLParser

    class Tables(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables: list[list[list[str]]] = []
            self.cell: list[str] | None = None

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.tables.append([])
            elif tag == "tr":
                self.tables[-1].append([])
            elif tag in ("td", "th"):
                self.cell = []

        def handle_data(self, data):
            if self.cell is not None:
                self.cell.append(data)

        def handle_endtag(self, tag):
            if tag in ("td", "th"):
                self.tables[-1][-1].append("".join(self.cell))
                self.cell = None

    parser = Tables()
    for e in at.get("html"):
        if 'class="drift-table"' in e.proto.body:
            parser.feed(e.proto.body)
    return [pd.DataFrame(t[1:], columns=t[0]) for t in parser.tables]


def pick_table(at: AppTest, key: str = "seq_table"):
    """The rows a ui/pick_table table with widget key `key` was given, as a pandas frame of their values (None
    where a value is missing), in the order the page sent them."""
    import json

    import pandas as pd

    for e in at.get("bidi_component"):
        if e.proto.component_name == "driftscope.pick_table" and e.proto.id.endswith(f"-{key}"):
            data = json.loads(e.proto.json)
            return pd.DataFrame(data["sort"], columns=data["columns"])
    raise AssertionError(f"no pick table with key {key!r} on the page")
