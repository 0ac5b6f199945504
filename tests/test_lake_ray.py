"""`summarize --engine ray` on one local Ray session (2 CPUs) for the module: the same summaries as the in-process
engine and as ingesting every token; a task whose worker dies is retried and the result is still exact; a task
that keeps dying is reported by partition while the others complete. Skipped when Ray is not installed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from analysis.ingest import ingest_paths  # noqa: E402
from analysis.lake import partial  # noqa: E402
from analysis.lake.engines import Failed, ray_init, run_ray  # noqa: E402
from analysis.lake.layout import list_partitions  # noqa: E402
from analysis.lake.task import summarize_partition  # noqa: E402
from analysis.store import Store  # noqa: E402

from helpers import lake as lu  # noqa: E402

TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def local_ray():
    # workers import this module (for the crashing tasks below) and helpers.lake from tests/
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, before) if p)
    try:
        ray_init(None, num_cpus=2)
        yield ray
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    root = tmp_path_factory.mktemp("lake")
    tokens, routing = lu.make_rows(seed=21)
    lake = lu.write_lake(root / "lake", tokens, routing)
    store = Store(root / "direct.duckdb")
    assert [o.status for o in ingest_paths(store, lu.write_flat(root / "flat", tokens, routing))] == ["loaded"] * 2
    direct = partial.summary_tables(store)
    store.close()
    return lake, direct


def _merged(results) -> dict:
    results = list(results)
    assert [r for r in results if isinstance(r, Failed) or r.refused] == []
    merged = {t: partial.merge(t, [r.tables[t] for r in results]) for t in partial.MERGED_TABLES
              if t != partial.SAMPLE_TABLE}  # the tables ingest computes
    return {t: d for t, d in merged.items() if d.num_rows}  # as lu.of_run: no sequences or margins logged here


def crash_once(lake, partition, token_sample=0.0, threads=None):
    """Kill the worker process on the first attempt at step 5 (a marker file says it happened)."""
    marker = Path(lake).parent / "crashed-once"
    if partition.step == 5 and not marker.exists():
        marker.write_text(str(os.getpid()))
        os._exit(1)  # no exception, no cleanup: the worker is gone, as when it is OOM-killed
    return summarize_partition(lake, partition, token_sample, threads)


def crash_always(lake, partition, token_sample=0.0, threads=None):
    if partition.step == 0:
        os._exit(1)
    return summarize_partition(lake, partition, token_sample, threads)


def test_killed_task_is_retried_and_exact(local_ray, seeded):
    lake, direct = seeded
    parts = list_partitions(str(lake), run="a").partitions
    marker = Path(lake).parent / "crashed-once"
    marker.unlink(missing_ok=True)
    results = _merged(run_ray(str(lake), parts, task=crash_once))
    assert marker.exists()  # the first attempt really died
    lu.assert_same_summaries(results, lu.of_run(direct, "a"))


def test_task_that_keeps_failing_is_reported_by_partition(local_ray, seeded):
    lake, _ = seeded
    parts = list_partitions(str(lake), run="b").partitions
    results = list(run_ray(str(lake), parts, task=crash_always, max_retries=1))
    failed = [r for r in results if isinstance(r, Failed)]
    assert [f.partition.name for f in failed] == ["run=b/step=0"]
    assert "task failed after Ray retried it 1 times" in failed[0].error
    assert sorted((r.run, r.step) for r in results if not isinstance(r, Failed)) == \
        sorted((p.run, p.step) for p in parts if p.name != "run=b/step=0")


def test_ray_engine_equals_ingesting_every_token(local_ray, seeded, tmp_path):
    """The acceptance check through the command line: the summary files --engine ray writes hold exactly the
    summaries of ingesting every token (the in-process engine is held to the same in test_lake_summarize.py)."""
    from analysis.__main__ import main

    lake, direct = seeded
    assert main(["summarize", str(lake), "--out", str(tmp_path), "--engine", "ray"]) == 0
    for run in ("a", "b", "c"):
        written = lu.read_summary_file(tmp_path / f"run={run}" / "summary.parquet")
        lu.assert_same_summaries(lu.of_run(written, run, only=direct), lu.of_run(direct, run))
