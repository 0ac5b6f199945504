"""Turn a reader's batch into canonical Arrow columns and check SCHEMA.md's rules, vectorised.

Routing batches also get their derived set columns (k, flip, top1_flip, n_common) here, so that
set comparisons are paid once at ingest and never at query time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis import schema
from analysis.ingest import routing_kernel
from analysis.ingest.keys import Runs, run_codes
from analysis.ingest.errors import BadExperts, BadValue, LengthMismatch, MissingColumn, WrongType

ARROW_TYPES = {
    "VARCHAR": pa.string(), "BIGINT": pa.int64(), "INTEGER": pa.int32(), "DOUBLE": pa.float64(),
    "INTEGER[]": pa.list_(pa.int32()), "DOUBLE[]": pa.list_(pa.float64()), "FLOAT[]": pa.list_(pa.float32()), "FLOAT": pa.float32(),
}
FIX_COLUMNS = "see SCHEMA.md for the column names"


@dataclass
class Batch:
    """A slice of one input file, in one canonical table's column names.

    `where(i)` describes row i of this batch for messages (e.g. "row 17" or "line 3 (step 2, sample 5)").
    """
    table: str  # "tokens" | "routing" | "sequences" | "topk"
    data: pa.Table
    where: Callable[[int], str] = field(default=lambda i: f"row {i + 1}")


def as_int(value, integral_floats: bool = False) -> int | None:
    """An integer from Python, numpy or a 0-dim tensor, else None (bools too, so True is never step 1);
    `integral_floats` also takes 3.0 as 3.

    >>> as_int(np.int64(7)), as_int(True), as_int(3.0), as_int(3.0, integral_floats=True), as_int("3")
    (7, None, None, 3, None)
    """
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if integral_floats and isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def row_where(offset: int) -> Callable[[int], str]:
    return lambda i: f"row {offset + i + 1}"


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _cast(file: str, batch: Batch, name: str, target: pa.DataType) -> pa.Array:
    col = batch.data.column(name)
    if col.type == target:
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()  # one chunk: no copy
    try:
        return pc.cast(col, target, safe=True).combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        pass
    # find the first value that does not convert, for the message
    values = col.to_pylist()
    for i, v in enumerate(values):
        try:
            pc.cast(pa.array([v]), target, safe=True)
        except Exception:
            raise WrongType(file, f"{batch.where(i)}, column '{name}'",
                            f"expected {target}, got {v!r}", "fix the value or the column's type") from None
    raise WrongType(file, f"column '{name}'", f"expected {target}, got column of type {col.type}",
                    "store this column with the type SCHEMA.md gives")


def valid_names(data: pa.Table) -> bool:
    """Whether every column name is valid UTF-8 (readers such as Arrow's JSON reader do not check keys)."""
    try:
        data.column_names
        return True
    except UnicodeDecodeError:
        return False


def _one_run(name: str, n: int) -> tuple[pa.Array, Runs]:
    """A run column of n rows that all hold `name`, as a one-entry dictionary: writing the name n times took
    ~7 ms per 491,520-row batch, as long as reading the column from Parquet."""
    return (pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([name], pa.string())),
            (pa.array([name], pa.string()), np.zeros(n, np.int64)))


def _run_column(file: str, batch: Batch, run: str | None) -> tuple[pa.Array, Runs] | None:
    """The run column and its run_codes: `run` in every row if given; a Parquet column of one name (read as a
    dictionary, see long.read_parquet) without turning it into n strings; None where the column is missing."""
    n = batch.data.num_rows
    if run is not None:
        return _one_run(run, n)
    if "run" not in batch.data.column_names:
        return None
    col = batch.data.column("run")
    if pa.types.is_dictionary(col.type) and col.num_chunks == 1 and not col.null_count and n:
        chunk = col.chunk(0)
        if len(chunk.dictionary) == 1 and chunk.dictionary.type == pa.string():
            return _one_run(chunk.dictionary[0].as_py(), n)
    arr = _cast(file, batch, "run", pa.string())
    return arr, (run_codes(pa.chunked_array([arr])) if not arr.null_count else None)


def normalise(file: str, batch: Batch, run: str | None, file_id: int) -> tuple[pa.Table, "RoutingMatrices | dict | None", Runs]:
    """Canonical, checked Arrow table for `batch.table` with file_id and, for routing, derived set columns;
    the expert-id matrices (for load counts) of routing, the four [n, J] matrices of top-k rows (for their
    summaries); the run_codes of its run column."""
    cols = schema.TABLES[batch.table]
    if not valid_names(batch.data):
        raise WrongType(file, "column names", "a column name (key) is not valid UTF-8",
                        "write column names as UTF-8 text")
    present = set(batch.data.column_names)
    n = batch.data.num_rows
    out: dict[str, pa.Array] = {}
    runs = None
    for c in cols:
        if c.name == "run" and (found := _run_column(file, batch, run)) is not None:
            out["run"], runs = found
            if out["run"].null_count:
                i = _first(np.asarray(out["run"].is_null()))
                raise BadValue(file, f"{batch.where(i)}, column 'run'", "required value is missing (null)",
                               "every row needs a value here")
            continue
        if c.name not in present:
            if c.required:
                hint = "pass --run NAME, or fill in the run name when uploading" if c.name == "run" \
                    else FIX_COLUMNS
                raise MissingColumn(file, None, f"required column '{c.name}' is missing from the {batch.table} "
                                    f"data (columns found: {', '.join(sorted(present)) or 'none'})", hint)
            continue
        arr = _cast(file, batch, c.name, ARROW_TYPES[c.sql_type])
        if c.required and arr.null_count:
            i = _first(np.asarray(arr.is_null()))
            raise BadValue(file, f"{batch.where(i)}, column '{c.name}'", "required value is missing (null)",
                           "every row needs a value here")
        out[c.name] = arr
    matrices = None
    if batch.table == "tokens":
        _check_tokens(file, batch, out)
        _check_context(file, batch, out)
    elif batch.table == "sequences":
        _check_context(file, batch, out)
    elif batch.table == "routing":
        matrices = _check_routing(file, batch, out)
    elif batch.table == "topk":
        matrices = _check_topk(file, batch, out)
    if batch.table in ("tokens", "routing", "sequences", "topk"):
        _check_keys(file, batch, out)
    out["file_id"] = pa.array(np.full(n, file_id, dtype=np.int32))
    return pa.table(out), matrices, runs


def _check_keys(file: str, batch: Batch, out: dict) -> None:
    for name in ("step", "sample", "pos", "layer"):
        if name in out:
            v = out[name].to_numpy(zero_copy_only=False)
            bad = v < 0
            if bad.any():
                i = _first(bad)
                raise BadValue(file, batch.where(i), f"{name} must be >= 0, got {v[i]}",
                               "keys are 0-based indices")


def _check_tokens(file: str, batch: Batch, out: dict) -> None:
    for name in ("sampler_logprob", "trainer_logprob"):
        v = out[name].to_numpy(zero_copy_only=False)
        bad = ~np.isfinite(v) | (v > 0)
        if bad.any():
            i = _first(bad)
            rule = "must be finite" if not np.isfinite(v[i]) else "must be <= 0"
            raise BadValue(file, f"{batch.where(i)}, column '{name}'", f"log-probability {rule}, got {float(v[i])!r}",
                           "log-probs are natural-log probabilities of the sampled token; "
                           "drop untrained/padded tokens rather than writing placeholders")


# Optional context columns and their rule: the first value that breaks it is refused with its place.
CONTEXT_RULES = {
    "reward": ("finite", "a reward must be a finite number"),
    "advantage": ("finite", "an advantage must be a finite number"),
    "segment": ("nonnegative", "a segment (turn index) must be >= 0"),
    "sampling_support": ("positive", "the sampler's support holds at least the sampled token (>= 1)"),
    "response_length": ("nonnegative", "a response length must be >= 0"),
}


def _check_context(file: str, batch: Batch, out: dict) -> None:
    """The rules of CONTEXT_RULES on the columns of `out` that have them (nulls are allowed: every one is
    optional)."""
    for name, (rule, text) in CONTEXT_RULES.items():
        if name not in out or out[name].null_count == len(out[name]):
            continue
        v = out[name].to_numpy(zero_copy_only=False)
        if out[name].null_count:
            v = pc.fill_null(out[name], 0 if rule == "finite" else 1).to_numpy(zero_copy_only=False)
        bad = ~np.isfinite(v) if rule == "finite" else (v < 0) if rule == "nonnegative" else (v < 1)
        if bad.any():
            i = _first(bad)
            got = float(v[i]) if rule == "finite" else int(v[i])
            raise BadValue(file, f"{batch.where(i)}, column '{name}'", f"{text}, got {got!r}",
                           "leave the value out (null) where there is none")


def _experts_matrix(file: str, batch: Batch, name: str, arr: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(valid rows, [n_valid, k] ids) for a list column whose rows all have the same length."""
    if arr.null_count == 0:  # the usual case: offsets give the lengths, no validity bitmap to unpack
        valid = np.ones(len(arr), dtype=bool)
        lengths = np.diff(arr.offsets.to_numpy())
    else:
        valid = ~np.asarray(arr.is_null())
        lengths = pc.list_value_length(arr).fill_null(0).to_numpy()
    vals = arr.flatten()
    if vals.null_count:
        pos = np.repeat(np.arange(len(arr)), lengths)
        i = int(pos[_first(np.asarray(vals.is_null()))])
        raise BadExperts(file, f"{batch.where(i)}, column '{name}'", "expert id is null", "ids are integers >= 0")
    flat = vals.to_numpy(zero_copy_only=True)  # no nulls (refused above): a view, not a ~30 ms copy per batch
    k = lengths[valid]
    if len(k) and (k != k[0]).any():
        i = int(np.flatnonzero(valid)[_first(k != k[0])])
        raise BadExperts(file, f"{batch.where(i)}, column '{name}'",
                         f"top-k has {lengths[i]} experts where earlier rows have {k[0]}",
                         "every routing row needs the same k")
    kk = int(k[0]) if len(k) else 0
    if len(k) and kk == 0:
        i = int(np.flatnonzero(valid)[0])
        raise BadExperts(file, f"{batch.where(i)}, column '{name}'", "empty top-k list", "record at least one expert")
    return valid, flat.reshape(-1, kk) if kk else flat.reshape(0, 0)


def _check_routing(file: str, batch: Batch, out: dict) -> "RoutingMatrices":
    n = batch.data.num_rows
    _, S = _experts_matrix(file, batch, "sampler_experts", out["sampler_experts"])
    k = S.shape[1]
    s_mask, top = _check_ids(file, batch, "sampler_experts", S, np.arange(n))
    out["k"] = pa.array(np.full(n, k, dtype=np.int16))
    flip = np.zeros(n, dtype=bool)
    top1 = np.zeros(n, dtype=bool)
    common = np.zeros(n, dtype=np.int16)
    has_t = np.zeros(n, dtype=bool)
    T, rows = None, np.zeros(0, dtype=np.int64)
    same = np.zeros(n, dtype=bool)  # both sides list the same experts in the same order
    if "trainer_experts" in out:
        t_valid, T = _experts_matrix(file, batch, "trainer_experts", out["trainer_experts"])
        rows = np.flatnonzero(t_valid)
        if len(rows) and T.shape[1] != k:
            raise BadExperts(file, f"{batch.where(int(rows[0]))}", f"trainer top-k has {T.shape[1]} experts, "
                             f"sampler top-k has {k}", "both sides must record the same k")
        t_mask, _ = _check_ids(file, batch, "trainer_experts", T, rows)
        if not len(rows):
            pass  # a trainer_experts column of nulls only (sampler side alone) gives T of shape (0, 0)
        elif s_mask is not None and t_mask is not None:
            # sets as 64-bit masks: equality is set equality, popcount of the AND is |E_s ∩ E_t|
            routing_kernel.compare(S, T, rows, s_mask, t_mask, flip, top1, common, same)
        else:
            Ss, Ts = np.sort(S[rows], axis=1), np.sort(T, axis=1)
            flip[rows] = (Ss != Ts).any(axis=1)
            for lo in range(0, len(rows), 262144):  # bounded (n, k, k) temporaries
                hi = lo + 262144
                common[rows[lo:hi]] = (Ss[lo:hi, :, None] == Ts[lo:hi, None, :]).sum(axis=(1, 2))
            top1[rows] = S[rows, 0] != T[:, 0]
            same[rows] = (S[rows] == T).all(axis=1)
        has_t[rows] = True
    for name, side in (("sampler_weights", "sampler_experts"), ("trainer_weights", "trainer_experts")):
        if name in out:
            w = out[name]
            flat = w.flatten().to_numpy(zero_copy_only=False)
            if not np.isfinite(flat).all():  # nulls inside a list read as NaN here
                pos = np.repeat(np.arange(n), pc.list_value_length(w).fill_null(0).to_numpy())
                i = int(pos[_first(~np.isfinite(flat))])
                raise BadValue(file, f"{batch.where(i)}, column '{name}'", "a weight is missing or not finite",
                               "give one finite weight per expert id")
            wl = pc.list_value_length(w).fill_null(0).to_numpy()
            if side in out:
                el = pc.list_value_length(out[side]).fill_null(0).to_numpy()
                has_ids = ~np.asarray(out[side].is_null())
            else:
                el, has_ids = np.zeros(n, dtype=wl.dtype), np.zeros(n, dtype=bool)
            # weights need their ids: one per id, and none where the ids are missing
            bad = ~np.asarray(w.is_null()) & (~has_ids | (wl != el))
            if bad.any():
                i = _first(bad)
                raise LengthMismatch(file, f"{batch.where(i)}, column '{name}'",
                                     f"{int(wl[i])} weights for {int(el[i])} experts",
                                     f"give one weight per id of {side}, in the same order")
    _check_margins(file, batch, out, n)
    if same.any():  # stored once (schema.ROUTING_STORE); the `routing` view shows the trainer's list again
        # only the lists that differ are kept, in buffers of their own: the batch's full buffer of trainer ids
        # (~16 MB per 491,520 rows, top-8) is not held while the batch waits for DuckDB
        keep = has_t & ~same
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(np.where(keep, k, 0), out=offsets[1:])
        values = np.ascontiguousarray(T[keep[rows]]).reshape(-1)
        out["trainer_experts"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32()),
                                                          mask=pa.array(~keep))
    _pack_sampler(out, S, top)  # kept: the 40M-token ingest took 1.4-1.8 CPU-s (7-9 %) more without it
    mask = ~has_t
    out["flip"] = pa.array(flip, mask=mask)
    out["top1_flip"] = pa.array(top1, mask=mask)
    out["n_common"] = pa.array(common, mask=mask)
    return RoutingMatrices(S, T, rows)


def _check_margins(file: str, batch: Batch, out: dict, n: int) -> None:
    """Router margins (METRICS.md v3): a difference of two probabilities, so in [0, 1] (a null: none recorded),
    and only beside that side's experts."""
    for name, side in (("sampler_margin", "sampler_experts"), ("trainer_margin", "trainer_experts")):
        if name not in out or out[name].null_count == n:
            continue
        m = out[name]
        has = ~np.asarray(m.is_null())
        v = pc.fill_null(m, 0.0).to_numpy(zero_copy_only=False)
        bad = has & ~((v >= 0) & (v <= 1))
        if bad.any():
            i = _first(bad)
            raise BadValue(file, f"{batch.where(i)}, column '{name}'", f"a router margin (k-th minus (k+1)-th "
                           f"expert probability) is in [0, 1], got {float(v[i])!r}",
                           "give the margin of the softmax probabilities, or null where there is none")
        ids = out.get(side) if side != "sampler_experts" else None
        if ids is not None and (bad := has & np.asarray(ids.is_null())).any():
            i = _first(bad)
            raise MissingColumn(file, f"{batch.where(i)}, column '{name}'", f"a margin without {side}",
                                "a margin belongs to that side's routing: give both")
        if side == "trainer_experts" and "trainer_experts" not in out:
            raise MissingColumn(file, f"column '{name}'", "trainer margins without trainer_experts",
                                "a margin belongs to that side's routing: give both")


@dataclass
class RoutingMatrices:
    """Expert ids of a routing batch: S [n, k]; T [len(t_rows), k] for the rows that have a trainer side."""
    S: np.ndarray
    T: np.ndarray | None
    t_rows: np.ndarray


def _pack_sampler(out: dict, S: np.ndarray, top: int) -> None:
    """Store the sampler's ids of every row as one integer (schema.ROUTING_PACKED) in place of its list, where
    k ids of the batch's bit width fit 64 bits: DuckDB inserts a UBIGINT for ~40 % less CPU than an INTEGER[],
    in about the same bytes (benchmarks/RESULTS-scale.md). Wider batches keep the list."""
    n, k = S.shape
    bits = max(1, int(top).bit_length())
    if not n or k * bits > 64:
        return
    packed = np.empty(n, np.uint64)
    routing_kernel.pack(S, bits, packed)
    del out["sampler_experts"]
    out["sampler_packed"] = pa.array(packed)
    out["id_bits"] = pa.array(np.full(n, bits, np.uint8))


def _check_ids(file: str, batch: Batch, name: str, M: np.ndarray,
               rows: np.ndarray) -> tuple[np.ndarray | None, int]:
    """Refuse negative or repeated ids; return (the rows' 64-bit set masks when every id is < 64, else None;
    the largest id, −1 for none)."""
    if M.size == 0:
        return np.zeros(0, dtype=np.uint64), -1
    mask, neg, rep, top = routing_kernel.set_masks(M)
    if neg >= 0:
        raise BadExperts(file, f"{batch.where(int(rows[neg]))}, column '{name}'",
                         f"negative expert id in {M[neg].tolist()}", "expert ids are 0-based")
    if top >= 64:  # ids that do not fit a 64-bit mask: repeats by sorting each row
        mask = None
        srt = np.sort(M, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        rep = _first(dup) if dup.any() else -1
    if rep >= 0:
        j = rep
        raise BadExperts(file, f"{batch.where(int(rows[j]))}, column '{name}'",
                         f"expert ids repeat within one top-k: {M[j].tolist()}",
                         "a top-k holds distinct experts; check the layer/rank axes of the dump")
    return mask, int(top)


def _list_matrix(file: str, batch: Batch, name: str, arr: pa.ListArray, j: int | None) -> np.ndarray:
    """[n, J] values of a list column whose rows all hold J values (J from the first row unless given)."""
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy()
    want = int(lengths[0]) if j is None and len(lengths) else j
    bad = lengths != want
    if bad.any() or want == 0:
        i = _first(bad) if bad.any() else 0
        raise LengthMismatch(file, f"{batch.where(i)}, column '{name}'",
                             f"{int(lengths[i])} values where {'earlier rows have' if j is None else 'the sampler has'}"
                             f" {want}" if want else "an empty top-k list",
                             "give the same J (>= 1) most likely tokens on both sides of every row")
    vals = arr.flatten()
    if vals.null_count:
        pos = np.repeat(np.arange(len(arr)), lengths)
        i = int(pos[_first(np.asarray(vals.is_null()))])
        raise BadValue(file, f"{batch.where(i)}, column '{name}'", "a value inside the list is null",
                       "give every id and log-prob of the top-k")
    return vals.to_numpy(zero_copy_only=False).reshape(len(arr), want)


def _check_topk(file: str, batch: Batch, out: dict) -> dict[str, np.ndarray]:
    """Top-J rows (schema.TOPK): one J per row on both sides (and per batch), ids >= 0 and distinct within a row,
    log-probs finite and <= 0. Returns the four [n, J] matrices (log-probs as stored, fp32), for the summaries."""
    j = None
    mats = {}
    for side in ("sampler", "trainer"):
        for part in ("ids", "logprobs"):
            name = f"{side}_topk_{part}"
            mats[name] = m = _list_matrix(file, batch, name, out[name], j)
            j = m.shape[1]
        ids, lp = mats[f"{side}_topk_ids"], mats[f"{side}_topk_logprobs"]
        neg = (ids < 0).any(1)
        if neg.any():
            i = _first(neg)
            raise BadValue(file, f"{batch.where(i)}, column '{side}_topk_ids'", f"negative token id in {ids[i].tolist()}",
                           "token ids are >= 0")
        srt = np.sort(ids, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]).any(1)
        if dup.any():
            i = _first(dup)
            raise BadValue(file, f"{batch.where(i)}, column '{side}_topk_ids'",
                           f"token ids repeat within one top-k: {ids[i].tolist()}", "a top-k holds distinct ids")
        bad = (~np.isfinite(lp) | (lp > 0)).any(1)
        if bad.any():
            i = _first(bad)
            raise BadValue(file, f"{batch.where(i)}, column '{side}_topk_logprobs'",
                           f"log-probabilities must be finite and <= 0, got {lp[i].tolist()}",
                           "natural-log probabilities of the listed tokens")
    return mats
