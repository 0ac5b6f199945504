"""DriftLogger: the few lines a trainer adds to write SCHEMA.md long-table Parquet shards, one per step.

    logger = DriftLogger("drift_logs", run="bf16-baseline", config={"sampler_dtype": "bf16"})
    logger.log_step(step, rollout_log_probs, old_log_probs, response_mask, token_ids=responses,
                    sampler_experts=routed_experts)

Writes `<out_dir>/<run>/tokens-step000012.parquet`, `routing-step000012.parquet` and `run.json`.
Vectorised (no Python loop per token) and byte-deterministic: the same inputs give the same file bytes.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.routing_rows import routing_columns

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")


def safe_run_name(run: str) -> str:
    """Return `run` unchanged if it can be a directory name; else raise ValueError suggesting a slug.

    Letters, digits and `. _ + = -`, at most 128 characters, starting with a letter or digit, no "..".
    """
    if isinstance(run, str) and _RUN_NAME.fullmatch(run) and ".." not in run:
        return run
    slug = run_name_slug(str(run))
    raise ValueError(f"run name {run!r} cannot be used as a directory name: use letters, digits and "
                     f"'._+=-' (no path separators, no '..'), for example {slug!r}")


def run_name_slug(text: str) -> str:
    """`text` made into a name safe_run_name accepts: other characters become '-', at most 128 characters.

    >>> run_name_slug("bf16 run #2")
    'bf16-run-2'
    """
    return re.sub(r"[^A-Za-z0-9._+=-]+", "-", text).replace("..", "-").strip(".-_")[:128] or "run"


def _numpy(x, name: str) -> np.ndarray:
    """Tensor (any device, any dtype), array or nested list -> numpy array, without importing torch."""
    if hasattr(x, "detach"):  # torch.Tensor; bf16 has no numpy dtype, so widen floats first
        x = x.detach()
        if x.is_floating_point():
            x = x.double()
        x = x.cpu().numpy()
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a tensor or array, got {type(x).__name__}") from exc


def _expect_shape(arr: np.ndarray, shape: tuple, name: str) -> None:
    if arr.shape != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(arr.shape)}")


def _per_token(x, B: int, T: int, name: str) -> np.ndarray:
    """An int, a per-sample [B] or a per-token [B, T] value -> int64 [B, T]."""
    arr = _numpy(x, name)
    if arr.ndim == 1:
        _expect_shape(arr, (B,), name)
        arr = arr[:, None]
    elif arr.ndim == 2:
        _expect_shape(arr, (B, T), name)
    elif arr.ndim != 0:
        raise ValueError(f"{name}: expected an int, shape [{B}] or [{B}, {T}], got shape {list(arr.shape)}")
    return np.broadcast_to(arr.astype(np.int64), (B, T))


def _write(table: pa.Table, path: Path) -> None:
    # Written to a hidden temporary name, then renamed: a reader never sees half a shard.
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd", store_schema=True, write_statistics=True)
    os.replace(tmp, path)


class DriftLogger:
    """Writes one tokens shard (and one routing shard when experts are given) per `log_step` call."""

    def __init__(self, out_dir: str | os.PathLike, run: str, config: dict | None = None):
        self.run = safe_run_name(run)
        self.dir = Path(out_dir) / self.run
        self.dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"run": self.run, "config": config}, indent=2, sort_keys=True)
        (self.dir / "run.json").write_text(text + "\n", encoding="utf-8")

    def log_step(self, step: int, sampler_logprobs, trainer_logprobs, mask, token_ids=None,
                 sampler_experts=None, trainer_experts=None, sampler_version=None, trainer_version=None,
                 sample_ids=None) -> dict[str, Path]:
        """Write the mask==1 tokens of one step; returns the paths written.

        Args:
            step: trainer step (int >= 0).
            sampler_logprobs, trainer_logprobs: [B, T] log-probs of the response tokens (T = response positions).
            mask: [B, T], 1 (or True) where the trainer trains on the token.
            token_ids: optional [B, T] vocabulary ids.
            sampler_experts, trainer_experts: optional [B, T, L, K] top-k expert ids at the position that
                produced each token; trainer_experts needs sampler_experts.
            sampler_version, trainer_version: optional int, [B] or [B, T] policy versions.
            sample_ids: optional [B] sequence ids (default: the row index b).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        s = _numpy(sampler_logprobs, "sampler_logprobs")
        if s.ndim != 2:
            raise ValueError(f"sampler_logprobs: expected shape [B, T], got {list(s.shape)}")
        B, T = s.shape
        t = _numpy(trainer_logprobs, "trainer_logprobs")
        _expect_shape(t, (B, T), "trainer_logprobs")
        m = _numpy(mask, "mask")
        _expect_shape(m, (B, T), "mask")
        keep = m.astype(bool).reshape(-1)
        rows_b, rows_t = np.divmod(np.flatnonzero(keep), T)  # row-major: sample, then position
        s = s.astype(np.float64).reshape(-1)[keep]
        t = t.astype(np.float64).reshape(-1)[keep]
        for name, values in (("sampler_logprobs", s), ("trainer_logprobs", t)):
            bad = ~np.isfinite(values) | (values > 0)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"{name}[{rows_b[i]}, {rows_t[i]}] = {float(values[i])!r}: a log-probability must be "
                                 f"finite and <= 0 (mask the token out if it is padding)")
        if sample_ids is None:
            samples = np.arange(B, dtype=np.int64)
        else:
            samples = _numpy(sample_ids, "sample_ids").astype(np.int64)
            _expect_shape(samples, (B,), "sample_ids")
            if len(np.unique(samples)) != B:
                raise ValueError("sample_ids: expected distinct ids, got duplicates")
        n = len(s)
        columns = {
            "run": pa.repeat(pa.scalar(self.run, pa.string()), n),
            "step": pa.array(np.full(n, step, dtype=np.int64)),
            "sample": pa.array(samples[rows_b]),
            "pos": pa.array(rows_t.astype(np.int32)),
        }
        if token_ids is not None:
            ids = _numpy(token_ids, "token_ids")
            _expect_shape(ids, (B, T), "token_ids")
            columns["token_id"] = pa.array(ids.astype(np.int32).reshape(-1)[keep])
        columns["sampler_logprob"] = pa.array(s)
        columns["trainer_logprob"] = pa.array(t)
        for name, value in (("sampler_version", sampler_version), ("trainer_version", trainer_version)):
            if value is not None:
                columns[name] = pa.array(_per_token(value, B, T, name).reshape(-1)[keep])
        tables = {"tokens": pa.table(columns)}
        if trainer_experts is not None and sampler_experts is None:
            raise ValueError("trainer_experts: given without sampler_experts (SCHEMA.md: sampler side is required)")
        if sampler_experts is not None:
            tables["routing"] = self._routing(step, sampler_experts, trainer_experts, keep, samples[rows_b],
                                              rows_t, B, T)
        # Everything is checked before the first write: bad input leaves no shard behind.
        written = {}
        for kind, table in tables.items():
            written[kind] = self.dir / f"{kind}-step{step:06d}.parquet"
            _write(table, written[kind])
        return written

    def _routing(self, step, sampler_experts, trainer_experts, keep, samples, positions, B, T) -> pa.Table:
        se = _numpy(sampler_experts, "sampler_experts")
        if se.ndim != 4 or se.shape[:2] != (B, T):
            raise ValueError(f"sampler_experts: expected shape [{B}, {T}, L, K], got {list(se.shape)}")
        L, K = se.shape[2:]
        every = bool(keep.all())  # skip the boolean-mask copy in the common all-kept case
        se = se.astype(np.int32, copy=False).reshape(B * T, L, K)
        se = se if every else se[keep]  # [tokens, L, K]
        te = None
        if trainer_experts is not None:
            te = _numpy(trainer_experts, "trainer_experts")
            _expect_shape(te, (B, T, L, K), "trainer_experts")
            te = te.astype(np.int32, copy=False).reshape(B * T, L, K)
            te = te if every else te[keep]
        keys = {"step": np.full(len(se), step, dtype=np.int64), "sample": samples, "pos": positions.astype(np.int32)}
        cols = routing_columns(keys, se, te)
        n = len(cols["layer"])
        cols["run"] = pa.repeat(pa.scalar(self.run, pa.string()), n)
        cols.setdefault("trainer_experts", pa.nulls(n, pa.list_(pa.int32())))
        return pa.table({c: cols[c] for c in ("run", "step", "sample", "pos", "layer", "sampler_experts",
                                              "trainer_experts")})
