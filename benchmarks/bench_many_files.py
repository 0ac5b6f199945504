"""Ingest of a run logged by DriftLogger: many small files, timed per file, this checkout against another.

    python benchmarks/bench_many_files.py [--steps 1000] [--logged 20] [--tokens 999424] [--token-sample 0.001]
                                          [--code OTHER_CHECKOUT] [--repeat 1]

Inputs: `--logged` steps of `--tokens` tokens written by DriftLogger (benchmarks/sim_1b.py: sequences of 4,096,
token_sample 0.001, the worst sequence and the 256 top tokens of each step kept), completed to `--steps` steps
with copies of their files (step column rewritten; sim_1b's --logged), so the files are those of a
`steps` x `tokens` run: one summary file (~0.55 MB) and one sampled tokens file (~85 KB) per step. They are made
once per shape under benchmarks/work/many/ (git-ignored) in a child process.

Then, per repeat and in alternating order, `python -m analysis ingest FOLDER --db fresh.duckdb` from this
checkout and from `--code` (e.g. a `git archive main` copy): wall, CPU (user + system) and peak RSS of that
child from os.wait4, and ms per file. Both databases are then compared table by table (EXCEPT ALL both ways,
file ids and load times aside): the same rows, or the benchmark fails.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import ROOT, alternate, fresh_db, timed

WORK = harness.WORK / "many"


def make_logs(steps: int, logged: int, tokens: int, token_sample: float) -> Path:
    """The run's folder, written once per shape: DriftLogger for `logged` steps, copies up to `steps`."""
    work = WORK / f"s{steps}_l{logged}_t{tokens}_p{token_sample}"
    folder = work / "sim-1b"
    if (work / "DONE").exists():
        return folder
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_1b.py"), "--tokens", str(tokens), "--token-sample",
                    str(token_sample), "--work", str(work), "--steps", str(steps), "--logged", str(logged),
                    "--log-only"], check=True, stdout=subprocess.DEVNULL)
    (work / "DONE").touch()
    return folder


def ingest(folder: Path, db: Path, code: Path) -> dict:
    """`python -m analysis ingest` of the folder from checkout `code`: wall, CPU and peak RSS of that child alone
    (harness.timed), and the files it loaded."""
    r = timed([sys.executable, "-m", "analysis", "ingest", str(folder), "--db", str(fresh_db(db))], cwd=code)
    r["files"] = sum(line.startswith("loaded ") for line in r.pop("stdout").splitlines())
    return r


def same_rows(a: Path, b: Path) -> list[str]:
    """Tables whose rows differ between the two databases (file_id and load/creation times left out)."""
    import duckdb
    con = duckdb.connect()
    con.execute(f"ATTACH '{a}' AS a (READ_ONLY)")
    con.execute(f"ATTACH '{b}' AS b (READ_ONLY)")
    # token and routing rows as readers see them (the views): how they are stored (run codes or names,
    # schema.RUN_IDS) may differ between the two checkouts
    stored = {"token_rows", "token_rows_unordered", "token_rows_full", "routing_rows", "routing_rows_packed",
              "routing_rows_packed_unordered", "run_ids"}
    tables = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = 'a' "
                                        "ORDER BY 1").fetchall() if r[0] not in stored] + ["tokens", "routing"]
    skip = {"files": "file_id, loaded_at", "runs": "created"}
    differ = []
    for t in tables:
        cols = [d[0] for d in con.execute(f"SELECT * FROM a.{t} LIMIT 0").description]
        keep = ", ".join(c for c in cols if c not in skip.get(t, "file_id").split(", ")) or "1"
        n = con.execute(f"SELECT (SELECT count(*) FROM (SELECT {keep} FROM a.{t} EXCEPT ALL SELECT {keep} FROM b.{t})) "
                        f"+ (SELECT count(*) FROM (SELECT {keep} FROM b.{t} EXCEPT ALL SELECT {keep} FROM a.{t}))"
                        ).fetchall()[0][0]
        if n:
            differ.append(f"{t} ({n} rows)")
    con.close()
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000, help="steps of the run (two files each)")
    ap.add_argument("--logged", type=int, default=20, help="steps really logged; the others are copies")
    ap.add_argument("--tokens", type=int, default=999_424, help="tokens per step")
    ap.add_argument("--token-sample", type=float, default=0.001, help="DriftLogger's token_sample")
    ap.add_argument("--code", type=Path, help="another checkout: its ingest is timed too, side by side")
    ap.add_argument("--repeat", type=int, default=1, help="ingests per side, alternating; the best counts")
    a = ap.parse_args()
    t0 = time.perf_counter()
    folder = make_logs(a.steps, min(a.logged, a.steps), a.tokens, a.token_sample)
    files = sorted(p for p in folder.iterdir() if p.suffix == ".parquet")
    print(f"inputs: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.1f} MB ({a.steps} steps x "
          f"{a.tokens:,} tokens, token_sample {a.token_sample}; {time.perf_counter() - t0:.1f} s to prepare); "
          f"python {platform.python_version()}, {os.cpu_count()} cpus, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    sides = {"this": ROOT} | ({"other": a.code.resolve()} if a.code else {})

    def one(name: str) -> dict:
        res = ingest(folder, folder.parent / f"{name}.duckdb", sides[name])
        if res["files"] != len(files):
            raise SystemExit(f"{name}: {res['files']} of {len(files)} files loaded")
        ms = res["seconds"] / len(files) * 1000
        print(f"{name:>5} ({sides[name]}): {res['seconds']:.2f} s wall ({ms:.1f} ms per file), "
              f"{res['cpu_seconds']:.2f} s cpu ({res['cpu_seconds'] / len(files) * 1000:.1f} ms per file), "
              f"peak RSS {res['peak_rss_mb']:.0f} MB, load {os.getloadavg()[0]:.2f}", flush=True)
        return res
    runs = alternate({name: lambda name=name: one(name) for name in sides}, a.repeat)
    best = {name: {"seconds": min(o["seconds"] for o in r.outs), "cpu_seconds": min(o["cpu_seconds"] for o in r.outs),
                   "peak_rss_mb": max(o["peak_rss_mb"] for o in r.outs)} for name, r in runs.items()}
    if "other" in best:
        differ = same_rows(folder.parent / "this.duckdb", folder.parent / "other.duckdb")
        print("databases: " + ("the same rows in every table" if not differ else "DIFFER in " + ", ".join(differ)))
        t, o = best["this"], best["other"]
        print(f"best of {a.repeat}: this {t['seconds']:.2f} s / {t['cpu_seconds']:.2f} s cpu, other "
              f"{o['seconds']:.2f} s / {o['cpu_seconds']:.2f} s cpu: this / other = {t['seconds'] / o['seconds']:.2f}x "
              f"wall, {t['cpu_seconds'] / o['cpu_seconds']:.2f}x cpu")
        if differ:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
