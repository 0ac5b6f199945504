"""An overlap of `python -m analysis ingest`, timed with and without, alternating, in child processes:

    python benchmarks/bench_overlap.py [--pairs 4] [--tokens FILE]

- **start**: a process's start of an ingest (the imports of the CLI's load path and the first call of the token
  kernel) with the file's sha256 started ahead by `hash_ahead`, as the CLI does, and without; then the time
  at which that hash is done. Without it the hash (`hash alone`) runs later, beside the insert.

The default file is bench_scale's 40M-token tokens.parquet (run bench_scale.py --keep first).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / "work" / "scale"
DEFAULT = WORK / "t40000000_s400_r500000_l32" / "tokens.parquet"

START = """
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[2])
f, on = sys.argv[1], sys.argv[3] == "1"
import analysis.ingest.hashing as hashing
if on:
    hashing.hash_ahead([f])
import numpy as np
import analysis.ingest.load
from analysis.summaries import kernel
kernel.Accumulators.zeros(4).add(np.full(8, -1.0), np.full(8, -1.0), pos=np.arange(8), seq=np.zeros(8, np.int64))
t1 = time.perf_counter()
if on:
    hashing.take_ahead([__import__("pathlib").Path(f)]).result()
else:
    hashing.content_hash([f])
t2 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "hash_done": t2 - t0}))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--tokens", type=Path, default=DEFAULT)
    a = ap.parse_args()
    if not a.tokens.exists():
        raise SystemExit(f"{a.tokens} missing: run `python benchmarks/bench_scale.py --keep` first")
    print(f"{a.tokens} ({a.tokens.stat().st_size / 2**20:.0f} MiB), {a.pairs} pairs, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs: dict[str, list[dict]] = {"start off": [], "start on": []}
    for i in range(a.pairs):
        for on in ("0", "1") if i % 2 == 0 else ("1", "0"):
            runs[f"start {'on' if on == '1' else 'off'}"].append(child(START, str(a.tokens), str(ROOT), on))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])
    for side in ("off", "on"):
        name = f"start {side}"
        print(f"start, hash ahead {side:>3}: imports + first kernel call {med(name, 'imports'):.2f} s, hash done at "
              f"{med(name, 'hash_done'):.2f} s after the process started (medians)")


if __name__ == "__main__":
    main()
