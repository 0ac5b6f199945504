"""Shared pytest fixtures, and only fixtures: what they build comes from tests/helpers/. Each fixture group is
named after its owner's topic (metrics_*: analysis metrics)."""
from __future__ import annotations

import pytest

from helpers.data import MetricsData, metrics_load, metrics_make_routing, metrics_make_tokens


@pytest.fixture(scope="session")
def metrics_data(tmp_path_factory) -> tuple[object, MetricsData]:
    """(Store, MetricsData): two runs, three steps, routing with both sides (session-wide, read only)."""
    tokens = metrics_make_tokens(seed=7)
    routing = metrics_make_routing(tokens, seed=8)
    store = metrics_load(tmp_path_factory.mktemp("metrics"), tokens, routing)
    yield store, MetricsData(tokens, routing)
    store.close()


@pytest.fixture
def metrics_store_from(tmp_path):
    """Factory: metrics_store_from(tokens, routing=None, fmt="parquet") -> Store on a fresh database."""
    stores = []

    def make(tokens, routing=None, fmt="parquet", sub="db"):
        store = metrics_load(tmp_path / sub, tokens, routing, fmt)
        stores.append(store)
        return store
    yield make
    for s in stores:
        try:
            s.close()
        except Exception:
            pass


@pytest.fixture
def store(tmp_path_factory):
    """An empty Store whose database lives outside `tmp_path`: tests ingest that folder (and its parents)."""
    from analysis.store import Store
    s = Store(tmp_path_factory.mktemp("db") / "db.duckdb")
    yield s
    s.close()


@pytest.fixture(scope="session")
def app_template_db(tmp_path_factory):
    """The page tests' fixture database (tests/helpers/browser.py), built once per session; tests copy it."""
    from helpers import browser as bu
    root = tmp_path_factory.mktemp("app-template")
    db = root / "template.duckdb"
    bu.build_fixture_db(db, root / "logs")
    return db


@pytest.fixture(scope="session")
def demo_db(tmp_path_factory):
    """A database holding every bundled demo run (data/demo), built once per session for the page tests on the
    demo; they only read it."""
    from helpers.apptest import demo_database
    return demo_database(tmp_path_factory.mktemp("demo"))
