"""Routing rows from expert-id arrays: the one builder every writer and reader of routing uses.

A routing table has one row per (token, layer), token-major: the token's key columns repeated once per
layer, the layer index, and each side's top-k expert ids as a list<int32> column. Only numpy and pyarrow:
the trainer-side logger imports it without the ingest machinery.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


def experts_column(experts: np.ndarray) -> pa.ListArray:
    """[N, K] integer ids -> list<int32> column of N rows of K ids (from flat values and offsets, no loop).

    >>> experts_column(np.array([[3, 1], [0, 2]])).to_pylist()
    [[3, 1], [0, 2]]
    """
    n, k = experts.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(experts, dtype=np.int32).reshape(-1)))


def list_column(values: np.ndarray) -> pa.ListArray:
    """[N, K] values -> list column of N rows of K values, in the array's own type (float32 weights and
    log-probs stay fp32: SCHEMA.md stores them so).

    >>> list_column(np.array([[0.5, 0.25]], dtype=np.float32)).type
    ListType(list<item: float>)
    """
    n, k = values.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(values).reshape(-1)))


def routing_columns(keys: dict[str, Any], sampler: np.ndarray, trainer: np.ndarray | None = None,
                    sampler_weights: np.ndarray | None = None,
                    trainer_weights: np.ndarray | None = None, sampler_margin: np.ndarray | None = None,
                    trainer_margin: np.ndarray | None = None) -> dict[str, Any]:
    """Columns of the routing rows of n tokens.

    keys: per-token columns (n values each): numpy arrays, or Arrow arrays for values a validator has yet to
    check; each is repeated once per layer. sampler, trainer: [n, L, K] expert ids (trainer optional: the
    column is then left out); sampler_weights, trainer_weights: optional [n, L, K] combine weights (float32 for
    the stored fp32); sampler_margin, trainer_margin: optional [n, L] router margins (stored as fp32). Adds
    `layer` (0..L-1 per token).

    >>> cols = routing_columns({"pos": np.array([5, 6])}, np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]]]))
    >>> cols["pos"].tolist(), cols["layer"].tolist(), cols["sampler_experts"].to_pylist()
    ([5, 5, 6, 6], [0, 1, 0, 1], [[1, 2], [3, 4], [5, 6], [7, 0]])
    """
    n, layers, k = sampler.shape
    cols: dict[str, Any] = {}
    for name, values in keys.items():
        if isinstance(values, pa.Array):
            cols[name] = values.take(pa.array(np.repeat(np.arange(n), layers)))
        else:
            cols[name] = np.repeat(values, layers)
    cols["layer"] = np.tile(np.arange(layers, dtype=np.int32), n)
    cols["sampler_experts"] = experts_column(sampler.reshape(n * layers, k))
    if trainer is not None:
        cols["trainer_experts"] = experts_column(trainer.reshape(n * layers, k))
    for name, w in (("sampler_weights", sampler_weights), ("trainer_weights", trainer_weights)):
        if w is not None:
            cols[name] = list_column(w.reshape(n * layers, k))
    for name, m in (("sampler_margin", sampler_margin), ("trainer_margin", trainer_margin)):
        if m is not None:
            cols[name] = pa.array(np.ascontiguousarray(m, dtype=np.float32).reshape(n * layers))
    return cols
