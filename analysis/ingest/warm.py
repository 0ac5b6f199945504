"""Compile the numba kernels before they are needed: `python -m analysis warm`, and the app at start-up.

A fresh install has no compiled kernels: the first ingest (or the first DriftLogger step on the CPU) compiles the
token-summary kernel and the routing kernels, ~7 s of one core (benchmarks/RESULTS-kernel.md), before its first
batch is summarised. numba keeps what it compiles in its on-disk cache (`__pycache__` beside the modules, or
NUMBA_CACHE_DIR), so doing it once ahead is enough: `warm()` calls every kernel once on a few rows, with the
argument types that ingest and DriftLogger pass (tests/test_warm.py checks that a real ingest and a logger step
then compile nothing more). Where the cache already holds them it only loads them (~1 s).

`compiled()` tells whether the cache holds them for this machine (the command line's ingest says, on a terminal,
when it is about to compile them). The app starts `start_in_background()` when it opens a writable database: a
low-priority child process, so that a visitor's first upload does not hold the server for those seconds while
pages wait.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np

from analysis import settings

_started = threading.Event()


def warm() -> None:
    """Compile (or load from the cache) the summary kernel and the routing kernels, as ingest calls them."""
    from analysis.ingest import routing_kernel as R
    from analysis.summaries import kernel as K

    n, per_seq = 64, 32
    s = -np.linspace(0.01, 4.0, n)
    t = s + np.linspace(-0.02, 0.02, n)
    pos, seq = np.arange(n) % per_seq, np.arange(n) // per_seq
    K.Accumulators.zeros(n // per_seq, 1).add(s, t, pos=pos, seq=seq, tok_lag=np.zeros(n, np.int64),
                                              entropy=np.ones(n), flipped=np.zeros(n, np.int64),
                                              seq_sums_out=np.zeros((5, n // per_seq)))  # as ingest's stream
    # expert ids as ingest hands them over: a read-only [rows, k] int32 view of the Arrow list values
    experts = K.read_only(np.arange(16, dtype=np.int32).reshape(2, 8))
    masks, *_ = R.set_masks(experts)
    rows = np.arange(2)
    flags = [np.zeros(2, np.bool_) for _ in range(3)]
    R.compare(experts, experts, rows, masks, masks, flags[0], flags[1], np.zeros(2, np.int16), flags[2])
    R.count_experts(np.zeros(2, np.int64), experts, np.zeros(64, np.int64))
    R.pack(experts, 4, np.empty(2, np.uint64))
    from analysis.summaries.checks import CheckSums  # the logging checks of ingest's stream
    CheckSums().add(s, t, pos, seq)
    from analysis.summaries import residual  # the residual signatures' counts, by ingest and DriftLogger
    residual.ResidualSums().add(t - s, seq, pos, None)
    residual.grid_counts(s.reshape(2, -1), t.reshape(2, -1), np.ones((2, n // 2), np.bool_), seq.reshape(2, -1))
    # top-k rows as ingest hands them over: read-only int32 ids and fp32 log-probs (summaries/fulldist.py)
    from analysis.summaries import fulldist as F
    lp = K.read_only(np.full((2, 8), -2.0, np.float32))
    F.topk_sums(experts, lp, experts, lp, np.zeros(2, np.int64), 1)


def _kernels() -> list:
    from analysis.ingest import routing_kernel as R
    from analysis.summaries import kernel as K
    from analysis.summaries import fulldist as F, residual
    return [K.accumulate, K._seq_sums, K.neighbours, R.set_masks, R.compare, R.count_experts, R.pack,
            residual._counts, residual._lattice_counts, F.trained_floats, F.group_sums]


def compiled() -> bool | None:
    """Whether numba's cache holds every ingest kernel compiled for this machine and this source (None: cannot
    tell; this reads numba's cache index, which is not a public API)."""
    try:
        for kernel in _kernels():
            machine = kernel.targetctx.codegen().magic_tuple()
            if not any(key[1] == machine for key in kernel._cache._cache_file._load_index()):
                return False
        return True
    except Exception:
        return None


def start_in_background() -> subprocess.Popen | None:
    """`python -m analysis warm` in a child process at low priority, once per process (None: already started, or
    DRIFT_NO_WARM=1). Its output is dropped: a failure here only means the first ingest compiles the kernels."""
    if _started.is_set() or settings.NO_WARM.read():
        return None
    _started.set()
    child = subprocess.Popen([sys.executable, "-m", "analysis", "warm"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                             env=os.environ | {settings.WARM_NICE.name: "10"}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    threading.Thread(target=child.wait, name="warm-reaper", daemon=True).start()  # no zombie left behind
    return child
