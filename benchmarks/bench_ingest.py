"""Ingest benchmark: `ingest_paths` vs DuckDB's own CREATE TABLE AS SELECT * FROM read_parquet(...), same files, same run.

    python benchmarks/bench_ingest.py [--tokens 5000000] [--routing-tokens 250000] [--layers 32] [--repeat 1]
                                      [--floor]

Writes the Parquet inputs once under benchmarks/work/ (git-ignored), then, for each repeat, loads them
(a) with plain DuckDB CTAS into a fresh database and (b) with Driftscope's validated, all-or-nothing ingest
into another fresh database, each in its own subprocess so peak RSS is measured per side. --floor adds two
native-SQL lower bounds for loading into the stored schema (see `floor`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / "work" / "ingest"


def make_inputs(n_tokens: int, routing_tokens: int, layers: int, n_files: int) -> list[Path]:
    import duckdb

    tag = f"v2_t{n_tokens}_r{routing_tokens}_l{layers}_f{n_files}"
    out = WORK / tag
    done = out / "DONE"
    if done.exists():
        return sorted(out.glob("*.parquet"))
    out.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    per = n_tokens // n_files
    seq_len = 500
    for f in range(n_files):
        # tokens: run 'bench', one step per file, sequences of 500 tokens; t = s + small noise, kept <= 0
        con.execute(f"""COPY (
            SELECT run, step, sample, pos, token_id, s AS sampler_logprob,
                   least(0.0, s + (random() - 0.5) * 0.02) AS trainer_logprob
            FROM (SELECT 'bench' AS run, {f} AS step, (i // {seq_len})::BIGINT AS sample,
                         (i % {seq_len})::INTEGER AS pos, (hash(i, {f}) % 50000)::INTEGER AS token_id,
                         -(random() * 5) AS s
                  FROM range({per}) t(i))) TO '{out}/tokens_{f:02d}.parquet' (FORMAT parquet)""")
    # routing: `routing_tokens` tokens of step 0..n_files-1 spread evenly, `layers` layers, top-8 of 64
    per_r = routing_tokens // n_files
    for f in range(n_files):
        con.execute(f"""COPY (
            WITH base AS (
                SELECT 'bench' AS run, {f} AS step, (i // {seq_len})::BIGINT AS sample, (i % {seq_len})::INTEGER AS pos,
                       l::INTEGER AS layer,
                       list_transform(range(8), lambda e: (e * 8 + hash(i, l, e, {f}) % 8)::INTEGER) AS se,
                       hash(i, l, {f}, 7) % 100 < 3 AS flip
                FROM range({per_r}) t(i), range({layers}) u(l))
            SELECT run, step, sample, pos, layer, se AS sampler_experts,
                   CASE WHEN flip THEN list_transform(range(8), lambda e:
                        CASE WHEN e = 0 THEN ((se[1] + 1) % 8)::INTEGER ELSE se[e + 1] END)
                        ELSE se END AS trainer_experts
            FROM base ORDER BY sample, pos, layer) TO '{out}/routing_{f:02d}.parquet' (FORMAT parquet)""")
    done.touch()
    return sorted(out.glob("*.parquet"))


def side(which: str, db: str, files: list[str]) -> None:
    """Child process: load the files one way, print JSON {seconds, cpu_seconds, peak_rss_mb}."""
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = ru0.ru_utime + ru0.ru_stime
    t0 = time.perf_counter()
    if which == "duckdb":
        import duckdb
        con = duckdb.connect(db)
        tok = [f for f in files if Path(f).name.startswith("tokens")]
        rt = [f for f in files if Path(f).name.startswith("routing")]
        con.execute("CREATE TABLE tokens AS SELECT * FROM read_parquet(?)", [tok])
        con.execute("CREATE TABLE routing AS SELECT * FROM read_parquet(?)", [rt])
        con.close()
    elif which in ("floor-insert", "floor-sets"):
        floor(which, db, files)
    else:
        sys.path.insert(0, str(ROOT))
        from analysis.ingest import ingest_paths
        from analysis.store import Store
        store = Store(db)
        outcomes = ingest_paths(store, files, run=None)
        bad = [o for o in outcomes if o.status != "loaded"]
        if bad:
            raise SystemExit(f"ingest refused: {bad[0].message}")
        store.close()
    secs = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": secs, "cpu_seconds": ru.ru_utime + ru.ru_stime - cpu0,
                      "peak_rss_mb": ru.ru_maxrss / 1024}))


def floor(which: str, db: str, files: list[str]) -> None:
    """What any validated load into Driftscope's stored schema pays at least, with DuckDB doing all the work
    natively (no Python per row): one transaction per file, INSERT ... SELECT FROM read_parquet into the
    stored tables (derived columns and file_id included).

    floor-insert: derived routing columns as constants, no checks at all.
    floor-sets: the set columns computed in SQL from 64-bit masks of the expert ids (k = 8 assumed, as in
    these files) plus per-row checks (log-probs <= 0 and finite, keys >= 0, k, distinct ids, ids in 0..63)
    that abort the statement. Still without expert-load counts, duplicate/orphan checks or content hashes.
    """
    import duckdb
    sys.path.insert(0, str(ROOT))
    from analysis import schema
    con = duckdb.connect(db)
    for t in ("tokens", "routing"):  # these token files have no optional column but token_id: the narrow table
        cols = schema.stored_columns(t, narrow=t == "tokens")
        con.execute(f"CREATE TABLE {t} ({', '.join(f'{c.name} {c.sql_type}' for c in cols)})")
    check = which == "floor-sets"
    tok_check = ("WHERE CASE WHEN sampler_logprob > 0 OR trainer_logprob > 0 OR NOT isfinite(sampler_logprob) "
                 "OR NOT isfinite(trainer_logprob) OR step < 0 OR sample < 0 OR pos < 0 THEN error('bad row') "
                 "ELSE true END") if check else ""
    mask = lambda c: " | ".join(f"(1::UBIGINT << {c}[{i}])" for i in range(1, 9))  # noqa: E731
    if check:
        derived = "8::SMALLINT, ms <> mt, se[1] <> te[1], bit_count(ms & mt)::SMALLINT"
        src = (f"(SELECT run, step, sample, pos, layer, sampler_experts AS se, trainer_experts AS te, "
               f"{mask('sampler_experts')} AS ms, {mask('trainer_experts')} AS mt FROM read_parquet($f))")
        rt_check = ("WHERE CASE WHEN len(se) <> 8 OR len(te) <> 8 OR bit_count(ms) <> 8 OR bit_count(mt) <> 8 "
                    "OR list_min(se) < 0 OR list_max(se) > 63 OR list_min(te) < 0 OR list_max(te) > 63 "
                    "OR step < 0 OR sample < 0 OR pos < 0 OR layer < 0 THEN error('bad row') ELSE true END")
    else:
        derived = "8::SMALLINT, false, false, 8::SMALLINT"
        src = ("(SELECT run, step, sample, pos, layer, sampler_experts AS se, trainer_experts AS te "
               "FROM read_parquet($f))")
        rt_check = ""
    for fid, f in enumerate(files):
        con.execute("BEGIN")
        if Path(f).name.startswith("tokens"):
            con.execute(f"""INSERT INTO tokens (run, step, sample, pos, token_id, sampler_logprob, trainer_logprob,
                                               file_id)
                SELECT run, step, sample, pos, token_id, sampler_logprob, trainer_logprob, $fid
                FROM read_parquet($f) {tok_check}""", {"f": f, "fid": fid})
        else:
            con.execute(f"""INSERT INTO routing (run, step, sample, pos, layer, sampler_experts, trainer_experts,
                                                k, flip, top1_flip, n_common, file_id)
                SELECT run, step, sample, pos, layer, se, te, {derived}, $fid FROM {src} {rt_check}""",
                        {"f": f, "fid": fid})
        con.execute("COMMIT")
    con.close()


def run_side(which: str, files: list[Path]) -> dict:
    db = WORK / f"{which}.duckdb"
    for p in (db, Path(f"{db}.wal")):
        p.unlink(missing_ok=True)
    out = subprocess.run([sys.executable, __file__, "--side", which, "--db", str(db), *map(str, files)],
                         check=True, capture_output=True, text=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["db_mb"] = db.stat().st_size / 2**20
    db.unlink(missing_ok=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=5_000_000)
    ap.add_argument("--routing-tokens", type=int, default=250_000)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--floor", action="store_true",
                    help="also time the native-SQL floors (floor-insert, floor-sets): see floor()")
    ap.add_argument("--side", choices=("duckdb", "driftscope", "floor-insert", "floor-sets"))
    ap.add_argument("--db")
    ap.add_argument("inputs", nargs="*")
    a = ap.parse_args()
    if a.side:
        side(a.side, a.db, a.inputs)
        return
    t0 = time.perf_counter()
    files = make_inputs(a.tokens, a.routing_tokens, a.layers, a.files)
    print(f"inputs: {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.0f} MiB "
          f"({time.perf_counter() - t0:.1f} s to prepare)")
    print(f"{a.tokens:,} tokens + {a.routing_tokens * a.layers:,} routing rows (top-8 of 64); "
          f"python {platform.python_version()}, {os.cpu_count()} cpus")
    best = {}
    for r in range(a.repeat):  # alternate the sides so background load hits both alike
        for which in ("duckdb", "driftscope") + (("floor-insert", "floor-sets") if a.floor else ()):
            res = run_side(which, files)
            for key in ("seconds", "cpu_seconds", "peak_rss_mb"):
                best.setdefault(which, {}).setdefault(key, []).append(res[key])
            print(f"repeat {r + 1} {which:>10}: {res['seconds']:6.2f} s wall, {res['cpu_seconds']:6.2f} s cpu, "
                  f"{res['peak_rss_mb']:5.0f} MB peak RSS, db {res['db_mb']:.0f} MiB")
    b, o = best["duckdb"], best["driftscope"]
    for which in ("floor-insert", "floor-sets"):
        if which in best:
            f = best[which]
            print(f"best of {a.repeat}: {which} {min(f['seconds']):.2f} s = {min(f['seconds']) / min(b['seconds']):.2f}x "
                  f"CTAS wall, {min(f['cpu_seconds']) / min(b['cpu_seconds']):.2f}x cpu")
    print(f"best of {a.repeat}: duckdb CTAS {min(b['seconds']):.2f} s | driftscope {min(o['seconds']):.2f} s | "
          f"wall ratio {min(o['seconds']) / min(b['seconds']):.2f}x | cpu ratio "
          f"{min(o['cpu_seconds']) / min(b['cpu_seconds']):.2f}x | peak RSS {max(o['peak_rss_mb']):.0f} MB "
          f"(duckdb {max(b['peak_rss_mb']):.0f} MB)")


if __name__ == "__main__":
    main()
