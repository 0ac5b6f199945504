"""Sequence JSON Lines (plain or gzip): one sequence per line, arrays indexed by token (SCHEMA.md family 2)."""
from __future__ import annotations

import json
from typing import BinaryIO, Iterator

import numpy as np
import pyarrow as pa

from analysis.ingest.errors import BadExperts, CorruptFile, LengthMismatch, MissingColumn, WrongType
from analysis.ingest.limits import Limits
from analysis.ingest.textio import iter_lines, json_line
from analysis.ingest.validate import Batch
from analysis.routing_rows import list_column, routing_columns

SEQ_REQUIRED = ("step", "sample", "sampler_logprobs", "trainer_logprobs")
# per-token arrays: key in the file -> tokens column
TOKEN_ARRAYS = {"sampler_logprobs": "sampler_logprob", "trainer_logprobs": "trainer_logprob",
                "token_ids": "token_id", "tokens": "token",
                "sampler_entropies": "sampler_entropy", "trainer_entropies": "trainer_entropy",
                "segment_ids": "segment", "sampling_support": "sampling_support"}
# `advantage` is a sequence field when it is a number and a per-token array when it is a list (one per token)
TOKEN_OR_SEQ = {"advantage": "advantage"}
SCALARS = {"sampler_version": "sampler_version", "trainer_version": "trainer_version"}
SEQ_FIELDS = ("reward", "advantage", "prompt", "response", "response_length", "tag")


class _Chunk:
    """Per-line column parts (dict of equal-length Arrow arrays), joined into batches on flush."""

    def __init__(self):
        self.tok: list[dict[str, pa.Array]] = []
        self.tok_where: list[tuple[int, int]] = []  # (line, token index) per token row
        self.rt: list[dict[str, pa.Array]] = []
        self.rt_where: list[tuple[int, int]] = []
        self.tk: list[dict[str, pa.Array]] = []  # top-k rows (schema.TOPK)
        self.tk_where: list[tuple[int, int]] = []
        self.seq: list[dict] = []
        self.seq_where: list[int] = []
        self.meta: dict[int, str] = {}  # line -> "step s, sample x"
        self.n_tokens = 0


def read_sequence_jsonl(fp: BinaryIO, name: str, limits: Limits) -> Iterator[Batch]:
    yield from read_sequence_records(parsed_lines(fp, name, limits), name, limits)


def parsed_lines(fp: BinaryIO, name: str, limits: Limits) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON value) per non-empty line."""
    for line_no, line in iter_lines(fp, name, limits):
        if not line.strip():
            continue
        try:
            obj = json_line(line)
        except ValueError as e:
            raise CorruptFile(name, f"line {line_no}", f"invalid JSON ({e})",
                              "each line must be one complete JSON object; the file may be truncated") from None
        yield line_no, obj


def read_sequence_records(records: Iterator[tuple[int, object]], name: str, limits: Limits) -> Iterator[Batch]:
    """Batches from (line number, sequence object) pairs in the keys of sequence JSON Lines (the field mapping
    feeds renamed records of other files through here)."""
    chunk = _Chunk()
    for line_no, obj in records:
        _add_sequence(name, line_no, obj, chunk)
        if chunk.n_tokens >= limits.batch_rows:
            yield from _flush(name, chunk)
            chunk = _Chunk()
    yield from _flush(name, chunk)


def _where(lines: list[tuple[int, int]], meta: dict[int, str]):
    return lambda i: f"line {lines[i][0]} ({meta[lines[i][0]]}, token {lines[i][1]})"


def _join(parts: list[dict[str, pa.Array]]) -> pa.Table:
    cols = list(dict.fromkeys(c for p in parts for c in p))
    lengths = [len(next(iter(p.values()))) for p in parts]
    return pa.table({c: _concat([p[c] if c in p else pa.nulls(n) for p, n in zip(parts, lengths)]) for c in cols})


def _flush(name: str, chunk: _Chunk) -> Iterator[Batch]:
    meta = chunk.meta
    if chunk.tok_where:
        yield Batch("tokens", _join(chunk.tok), _where(chunk.tok_where, meta))
    if chunk.rt_where:
        yield Batch("routing", _join(chunk.rt), _where(chunk.rt_where, meta))
    if chunk.tk_where:
        yield Batch("topk", _join(chunk.tk), _where(chunk.tk_where, meta))
    if chunk.seq:
        lines = chunk.seq_where
        where = lambda i: f"line {lines[i]} ({meta.get(lines[i], '')})"  # noqa: E731
        yield Batch("sequences", _sequence_table(name, chunk.seq, lines), where)


def _sequence_table(name: str, rows: list[dict], lines: list[int]) -> pa.Table:
    """The per-sequence fields as a table; a value Arrow cannot hold is refused at its line."""
    fix = "numbers for reward, advantage and response_length, a string for the prompt"
    columns = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row.get(key) for row in rows]
        try:
            columns[key] = pa.array(values)
        except (pa.ArrowException, TypeError, OverflowError):
            for value, line in zip(values, lines):  # the first value that fails alone, else mixed types
                _array(name, f"line {line}", key, [value], fix)
            _array(name, f"lines {lines[0]}-{lines[-1]}", key, values, fix)
    return pa.table(columns)


def _concat(parts: list) -> pa.Array:
    arrays = [p if isinstance(p, pa.Array) else pa.array(p) for p in parts]
    if not arrays:
        return pa.array([])
    types = {a.type for a in arrays if a.type != pa.null()}
    if len(types) > 1:
        # e.g. ints on one line, floats on another: let the validator cast to the canonical type
        target = pa.float64() if all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in types) else pa.string()
        arrays = [a.cast(target) for a in arrays]
    elif types:
        t = types.pop()
        arrays = [a.cast(t) if a.type == pa.null() else a for a in arrays]
    return pa.concat_arrays(arrays)


def _add_sequence(name: str, line_no: int, obj, chunk: _Chunk) -> None:
    if not isinstance(obj, dict):
        raise WrongType(name, f"line {line_no}", f"expected a JSON object, got {type(obj).__name__}",
                        "one sequence object per line")
    for key in SEQ_REQUIRED:
        if key not in obj:
            raise MissingColumn(name, f"line {line_no}", f"required key '{key}' is missing",
                                "see SCHEMA.md, sequence JSON Lines")
    step, sample = obj["step"], obj["sample"]
    label = f"step {step}, sample {sample}"
    chunk.meta[line_no] = label
    where = f"line {line_no} ({label})"
    n = len(obj["sampler_logprobs"])
    arrays = {}
    per_token = {k: c for k, c in TOKEN_OR_SEQ.items() if isinstance(obj.get(k), list)}
    for key, col in (TOKEN_ARRAYS | per_token).items():
        if key in obj and obj[key] is not None:
            v = obj[key]
            if not isinstance(v, list):
                raise WrongType(name, where, f"'{key}' must be a list, got {type(v).__name__}", "one value per token")
            if len(v) != n:
                raise LengthMismatch(name, where, f"'{key}' has {len(v)} values but 'sampler_logprobs' has {n}",
                                     "every per-token array needs one value per response token")
            arrays[col] = v
    mask = obj.get("loss_mask")
    keep = np.arange(n)
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != n:
            raise LengthMismatch(name, where, f"'loss_mask' has {len(mask) if isinstance(mask, list) else '?'} "
                                 f"values but 'sampler_logprobs' has {n}", "one mask value per token")
        keep = np.flatnonzero(np.asarray(mask, dtype=bool))
    m = len(keep)
    part: dict[str, pa.Array] = {}
    for col, v in arrays.items():
        arr = _array(name, where, col, v, "numbers for log-probs, ids, advantages, segments and supports, "
                     "strings for tokens")
        part[col] = arr.take(pa.array(keep)) if mask is not None else arr
    base = {"run": obj.get("run"), "step": step, "sample": sample}
    for col, value in base.items():
        part[col] = _array(name, where, col, [value] * m, "a string for the run, integers for step and sample")
    part["pos"] = pa.array(keep.astype(np.int64))
    for key, col in SCALARS.items():
        if key in obj:
            part[col] = _array(name, where, col, [obj[key]] * m, "an integer weight version")
    if m:
        chunk.tok.append(part)
    chunk.tok_where.extend((line_no, int(j)) for j in keep)
    chunk.n_tokens += m
    _add_routing(name, where, line_no, obj, n, keep, base, chunk)
    _add_topk(name, where, line_no, obj, n, keep, base, chunk)
    seq = {k: obj[k] for k in SEQ_FIELDS if k in obj and k not in per_token}
    if isinstance(seq.get("prompt"), list):  # prompt token ids: kept as their JSON text, as DriftLogger keeps them
        ids = seq["prompt"]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise WrongType(name, f"line {line_no}", "'prompt' values have mixed or wrong types (a prompt is a "
                            "string, or a list of token ids: integers >= 0)", "write the prompt's text, or its ids")
        seq["prompt"] = json.dumps(ids)
    if seq:
        chunk.seq.append({**base, **seq})
        chunk.seq_where.append(line_no)


def _array(name: str, where: str, col: str, values: list, fix: str) -> pa.Array:
    """`values` as an Arrow array; values Arrow cannot hold (an object, an int over 64 bits) are refused."""
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, OverflowError) as e:
        raise WrongType(name, where, f"'{col}' values have mixed or wrong types ({e})", fix) from None


def _add_routing(name, where, line_no, obj, n, keep, base, chunk: _Chunk) -> None:
    for key, side in (("sampler_weights", "sampler_experts"), ("trainer_weights", "trainer_experts"),
                      ("sampler_margins", "sampler_experts"), ("trainer_margins", "trainer_experts")):
        if obj.get(key) is not None and obj.get(side) is None:
            raise MissingColumn(name, where, f"'{key}' given without '{side}'",
                                "a weight belongs to the expert at its rank: give both")
    if obj.get("sampler_experts") is None:
        if obj.get("trainer_experts") is not None:
            raise MissingColumn(name, where, "'trainer_experts' given without 'sampler_experts'",
                                "routing needs the sampler's experts")
        return
    sides = {}
    for key in ("sampler_experts", "trainer_experts", "sampler_weights", "trainer_weights"):
        v = obj.get(key)
        if v is None:
            continue
        if key.endswith("_weights"):
            try:
                arr = np.asarray(v, dtype=np.float64)
            except (ValueError, TypeError):
                raise WrongType(name, where, f"'{key}' is ragged or not numbers",
                                "index it [token][layer][rank] like the experts, one weight per id") from None
            want = sides[key.replace("_weights", "_experts")].shape
            if arr.shape != (n,) + want[1:]:
                raise LengthMismatch(name, where, f"'{key}' has shape {list(arr.shape)}, expected "
                                     f"{[n] + list(want[1:])} (the shape of its experts)",
                                     "one weight per expert id, in the same order")
            sides[key] = arr[keep]
            continue
        try:
            arr = np.asarray(v, dtype=np.int64)
        except (ValueError, TypeError, OverflowError):  # OverflowError: an id beyond 64 bits
            raise BadExperts(name, where, f"'{key}' is ragged or not integers",
                             "index it [token][layer][rank] with the same number of layers and k everywhere") from None
        if arr.ndim != 3 or arr.shape[0] != n:
            raise LengthMismatch(name, where, f"'{key}' has shape {list(arr.shape)}, expected [{n}, layers, k]",
                                 "one [layer][rank] block per response token")
        sides[key] = arr[keep]
    S = sides["sampler_experts"]
    T = sides.get("trainer_experts")
    if T is not None and T.shape[1:] != S.shape[1:]:
        raise LengthMismatch(name, where, f"trainer_experts has [layers, k] = {list(T.shape[1:])}, "
                             f"sampler_experts has {list(S.shape[1:])}", "both sides need the same layers and k")
    m, L, _ = S.shape
    for key in ("sampler_margins", "trainer_margins"):  # [token][layer]: the router margin (validator: in [0, 1])
        v = obj.get(key)
        if v is None:
            continue
        try:
            arr = np.asarray(v, dtype=np.float64)
        except (ValueError, TypeError):
            raise WrongType(name, where, f"'{key}' is ragged or not numbers",
                            "index it [token][layer], one margin per routing layer") from None
        if arr.shape != (n, L):
            raise LengthMismatch(name, where, f"'{key}' has shape {list(arr.shape)}, expected {[n, L]}",
                                 "one margin per response token and routing layer")
        sides[key] = arr[keep]
    if not m * L:
        return
    # the line's run, step and sample are still unchecked JSON values: Arrow arrays, cast by the validator
    keys = {c: pa.array([base[c]] * m) for c in ("run", "step", "sample")} | {"pos": keep}
    chunk.rt.append(routing_columns(keys, S, T, sides.get("sampler_weights"), sides.get("trainer_weights"),
                                    sides.get("sampler_margins"), sides.get("trainer_margins")))
    chunk.rt_where.extend((line_no, int(j)) for j in np.repeat(keep, L))


TOPK_ARRAYS = ("sampler_topk_ids", "sampler_topk_logprobs", "trainer_topk_ids", "trainer_topk_logprobs")


def _add_topk(name, where, line_no, obj, n, keep, base, chunk: _Chunk) -> None:
    """The line's top-J lists ([token][j] each, all four or none) as rows of the table `topk`, for the kept
    (loss_mask) tokens; their values are checked by the validator."""
    given = [k for k in TOPK_ARRAYS if obj.get(k) is not None]
    if not given:
        return
    if len(given) < 4:
        missing = [k for k in TOPK_ARRAYS if k not in given]
        raise MissingColumn(name, where, f"{', '.join(map(repr, missing))} missing while {', '.join(map(repr, given))} "
                            "given", "the full-distribution columns compare both sides: give ids and log-probs of each")
    mats = {}
    shape = None  # the first array's [n, J], which the others must match
    for key in TOPK_ARRAYS:
        try:
            arr = np.asarray(obj[key], dtype=np.int64 if key.endswith("_ids") else np.float64)
        except (ValueError, TypeError, OverflowError):
            raise WrongType(name, where, f"'{key}' is ragged or not {'integers' if key.endswith('_ids') else 'numbers'}",
                            "index it [token][j] with the same J on every token and both sides") from None
        if arr.ndim != 2 or arr.shape[0] != n or (shape is not None and arr.shape != shape):
            raise LengthMismatch(name, where, f"'{key}' has shape {list(arr.shape)}, expected [{n}, J] with the J "
                                 "of the other top-k arrays", "one list of the J most likely tokens per response token")
        shape = arr.shape
        mats[key] = arr[keep]
    m = len(keep)
    if not m:
        return
    part = {c: pa.array([base[c]] * m) for c in ("run", "step", "sample")} | {"pos": pa.array(keep.astype(np.int64))}
    part |= {k: list_column(v) for k, v in mats.items()}
    chunk.tk.append(part)
    chunk.tk_where.extend((line_no, int(j)) for j in keep)
