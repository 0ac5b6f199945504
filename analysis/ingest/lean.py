"""What a loading process (`python -m analysis ingest` / `watch`) leaves out of its start, which runs on one core
before the first rows reach DuckDB.

- **pandas**: pyarrow imports it at the first `pa.array` of any kind, only to ask whether the argument is a pandas
  object; nothing in a load uses pandas.
- **scipy**: numba imports `scipy.linalg` when it loads its type registries (the first compiled kernel), only to
  learn whether `np.dot` and friends can use BLAS in compiled code; no kernel of ours calls them.
- **OpenBLAS threads**: numpy starts one per core at import, and they spin for a while after any use; a load does
  no linear algebra.
- **Huge pages for Arrow's buffers**: pyarrow's allocator (mimalloc) backs its memory with transparent huge pages,
  and each batch's buffers, freed and taken again, had the kernel zero a fresh 2 MB page: 7-12 % of a load's CPU
  samples (perf, 10M tokens + 4M routing rows; benchmarks/RESULTS-scale.md) were `clear_page_erms` in the Parquet
  reader's threads. Without them (MIMALLOC_ALLOW_THP=0) the freed pages are reused as they are, at the same peak
  RSS.

pandas and scipy treat the refused import as "not installed" and go on. Measured on the 40M-token benchmark's
routing file: the first batch was checked 1.05–1.28 s after the process started instead of 1.38–2.02 s
(benchmarks/RESULTS-scale.md). The app's process, where pages may use pandas, never calls this.

Standard library only: it must run before numpy is imported.
"""
from __future__ import annotations

import importlib.abc
import os
import sys

REFUSED = ("pandas", "scipy")


class _Refuse(importlib.abc.MetaPathFinder):
    """A finder, first on sys.meta_path, that refuses REFUSED and their submodules."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in REFUSED:
            raise ModuleNotFoundError(f"{name} is not imported by a Driftscope load (analysis/ingest/lean.py)",
                                      name=name)
        return None


def lean_start() -> bool:
    """Refuse REFUSED, keep OpenBLAS to one thread and Arrow's buffers off huge pages in this process; False,
    changing nothing, where either library or numpy is imported already (their state would not change) or where
    this already ran."""
    if any(isinstance(f, _Refuse) for f in sys.meta_path):
        return False
    if any(name in sys.modules for name in REFUSED + ("numpy",)):
        return False
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("MIMALLOC_ALLOW_THP", "0")  # read by pyarrow's allocator when it starts
    sys.meta_path.insert(0, _Refuse())
    return True
