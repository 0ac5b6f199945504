"""A seeded lake for the summarize tests: several runs, each step split across rank files, routing of both sides
(and of the sampler only in one run), written with analysis.lake.layout; plus the same rows as plain files."""
from __future__ import annotations

from pathlib import Path

import polars as pl

from helpers.data import metrics_make_routing, metrics_make_tokens

RANKS = 2


def make_rows(seed: int = 11, steps=(0, 5)) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Tokens of three runs (staleness, entropy, heavy tails) and routing for every token; run 'c' records the
    sampler's routing only."""
    tokens = metrics_make_tokens(seed=seed, runs=("a", "b", "c"), steps=steps, n_seq=7, max_len=30)
    both = metrics_make_routing(tokens.filter(pl.col("run") != "c"), seed=seed + 1, layers=4, k=2, n_experts=8)
    sampler_only = metrics_make_routing(tokens.filter(pl.col("run") == "c"), seed=seed + 2, layers=4, k=2,
                                        n_experts=8, trainer=False)
    sampler_only = sampler_only.with_columns(trainer_experts=pl.lit(None, dtype=pl.List(pl.Int32)))
    return tokens, pl.concat([both, sampler_only])


def write_lake(root: Path, tokens: pl.DataFrame, routing: pl.DataFrame, ranks: int = RANKS) -> Path:
    """Each (run, step) as `ranks` token files and `ranks` routing files, rows dealt out by sample % ranks."""
    from analysis.lake.layout import write_file, write_run_json

    for (run, step), part in tokens.group_by(["run", "step"], maintain_order=True):
        rout = routing.filter((pl.col("run") == run) & (pl.col("step") == step))
        for rank in range(ranks):
            mine = part.filter(pl.col("sample") % ranks == rank)
            if mine.height:
                write_file(str(root), run, step, "tokens", rank, mine.to_arrow())
            r = rout.filter(pl.col("sample") % ranks == rank)
            if r.height:
                write_file(str(root), run, step, "routing", rank, r.to_arrow())
    for run in tokens["run"].unique().sort():
        write_run_json(str(root), run, {"seeded": run})
    return root


def write_flat(folder: Path, tokens: pl.DataFrame, routing: pl.DataFrame) -> list[Path]:
    """The same rows as one tokens and one routing Parquet file, for a direct `ingest`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens.write_parquet(folder / "tokens.parquet")
    routing.write_parquet(folder / "routing.parquet")
    return [folder / "tokens.parquet", folder / "routing.parquet"]


def assert_same_summaries(got: dict, want: dict, rel: float = 1e-12) -> None:
    """Summary tables (merged, one row per key) equal: same keys and counts exactly, nulls in the same places,
    floating-point sums and extremes within `rel` of the column's largest magnitude."""
    import numpy as np
    import pyarrow as pa

    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for name in want:
        g, w = got[name], want[name]
        assert g.column_names == w.column_names, name
        # every summary table has rows; `sequences` (rows a summary file carries) and `summary_margin` (router
        # margins) only where the logs had some
        assert g.num_rows == w.num_rows and (w.num_rows > 0 or name in ("sequences", "summary_margin")), \
            (name, g.num_rows, w.num_rows)
        for col in w.column_names:
            gc, wc = g.column(col), w.column(col)
            assert gc.is_null().to_pylist() == wc.is_null().to_pylist(), (name, col)
            if pa.types.is_floating(wc.type):
                gv = gc.to_numpy(zero_copy_only=False).astype(float)
                wv = wc.to_numpy(zero_copy_only=False).astype(float)
                ok = ~np.isnan(wv)
                scale = np.abs(wv[ok]).max(initial=0.0)
                np.testing.assert_allclose(gv[ok], wv[ok], rtol=rel, atol=rel * scale, err_msg=f"{name}.{col}")
            else:
                assert gc.to_pylist() == wc.to_pylist(), (name, col)


def assert_same_frames(got, want, rel: float = 1e-12) -> None:
    """Two polars tables of metrics: same columns and rows, text and integers exact, floats within `rel`
    (relative, or of the column's largest magnitude for values near 0), nulls in the same places."""
    import numpy as np
    import polars as pl

    assert got.columns == want.columns and got.height == want.height > 0
    for col in want.columns:
        g, w = got[col], want[col]
        assert g.is_null().to_list() == w.is_null().to_list(), col
        if w.dtype.is_float():
            gv, wv = g.drop_nulls().to_numpy(), w.drop_nulls().to_numpy()
            scale = np.abs(wv[np.isfinite(wv)]).max(initial=0.0)
            np.testing.assert_allclose(gv, wv, rtol=rel, atol=rel * scale, err_msg=col)
        else:
            assert g.cast(pl.String).to_list() == w.cast(pl.String).to_list(), col


def read_summary_file(path) -> dict:
    """table -> merged rows of a summary file, read with ingest's own summary-file reader."""
    from analysis.ingest import summary_files as sf
    from analysis.ingest.limits import Limits
    from analysis.lake import partial

    parts: dict = {}
    with open(path, "rb") as fp:
        for table, rows in sf.read(fp, str(path), Limits()):
            parts.setdefault(table, []).append(rows)
    return {t: partial.merge(t, rows) for t, rows in parts.items()}


def of_run(tables: dict, run: str, only=None) -> dict:
    """The rows of `run` in each table (of the tables named in `only`, when given); a table without rows of
    `run` is left out (a summary file holds no routing tables for a run without routing)."""
    import pyarrow.compute as pc
    rows = {t: d.filter(pc.equal(d.column("run"), run)) for t, d in tables.items() if only is None or t in only}
    return {t: d for t, d in rows.items() if d.num_rows}
