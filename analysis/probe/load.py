"""Load a probe's output folder as a run: its token and routing rows through ingest, its probe.json into the
`probe` table. The file is checked whole first: a refused file leaves the database as it was.

(`python -m analysis ingest` loads the folder's logs and passes over probe.json, which is no log file; this is
the door that loads both.)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa

from analysis import schema
from analysis.store import Store

PROBE_FILE = "probe.json"  # the name analysis/probe/run.py writes
ARROW_TYPES = {"VARCHAR": pa.string(), "BIGINT": pa.int64(), "INTEGER": pa.int32(), "DOUBLE": pa.float64(),
               "BOOLEAN": pa.bool_(), "INTEGER[]": pa.list_(pa.int32())}


def _check_value(col: schema.Column, v, where: str):
    if v is None:
        if col.required:
            raise ValueError(f"{where}: '{col.name}' is required (null found)")
        return None
    t = col.sql_type
    if t == "VARCHAR" and isinstance(v, str):
        return v
    if t in ("BIGINT", "INTEGER") and isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    if t == "DOUBLE" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    if t == "BOOLEAN" and isinstance(v, bool):
        return v
    if t == "INTEGER[]" and isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool)
                                                             and x >= 0 for x in v):
        return v
    kinds = {"VARCHAR": "a string", "BIGINT": "an int >= 0", "INTEGER": "an int >= 0", "BOOLEAN": "true or false",
             "DOUBLE": "a finite number >= 0", "INTEGER[]": "a non-empty list of ints >= 0"}
    raise ValueError(f"{where}: '{col.name}' must be {kinds[t]}, got {json.dumps(v)[:40]}")


def read_probe_file(path: str | Path) -> pa.Table:
    """probe.json as a pyarrow Table of schema.PROBE's columns; ValueError naming the file, row and rule."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON array of probe rows ({e})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON array of probe rows, got {type(rows).__name__}")
    cols = {c.name: [] for c in schema.PROBE}
    runs = set()
    for i, row in enumerate(rows):
        where = f"{path.name}, row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object")
        extra = sorted(set(row) - set(cols))
        if extra:
            raise ValueError(f"{where}: unknown key(s) {extra} (the probe table's columns: docs/SCHEMA.md)")
        for col in schema.PROBE:
            cols[col.name].append(_check_value(col, row.get(col.name), where))
        if row["op"] not in schema.PROBE_OPS:
            raise ValueError(f"{where}: 'op' must be one of {list(schema.PROBE_OPS)}, got {row['op']!r}")
        if (row["op"] == "router") != (row.get("flip") is not None):
            raise ValueError(f"{where}: 'flip' and the router columns belong to op 'router' rows, and only to them")
        runs.add(row["run"])
    if len(runs) > 1:
        raise ValueError(f"{path}: rows of several runs ({sorted(runs)[:3]}); one probe file holds one run")
    return pa.table({c.name: pa.array(cols[c.name], ARROW_TYPES[c.sql_type]) for c in schema.PROBE})


def load_probe(store: Store, run_dir: str | Path) -> tuple[list, int]:
    """Ingest the folder's logs, then replace the run's probe rows. Returns (ingest outcomes, probe rows)."""
    from analysis.ingest import ingest_paths
    run_dir = Path(run_dir)
    table = read_probe_file(run_dir / PROBE_FILE)
    if table.num_rows == 0:
        raise ValueError(f"{run_dir / PROBE_FILE}: no probe rows")
    run = table.column("run")[0].as_py()
    outcomes = ingest_paths(store, [run_dir])
    bad = [o for o in outcomes if o.status in ("refused", "error")]
    if bad:
        raise ValueError(f"{run_dir}: its logs were not loaded: {bad[0].message}")
    if run not in store.run_names():
        raise ValueError(f"{run_dir}: the logs hold no run {run!r}, the run of its probe rows")
    with store.transaction() as w:
        w.replace_probe(run, table)
    return outcomes, table.num_rows
