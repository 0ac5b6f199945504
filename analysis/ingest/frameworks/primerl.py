"""prime-rl token exports (`trainer.enable_token_export`): one JSON object per exported sample
(FORMATS.md, section 1).

    <output_dir>/token_exports/step_<n>/rank_<r>.jsonl   (+ STABLE once every rank flushed)
    <output_dir>/token_exports/rank_<r>.jsonl            (exports before 2026-05-21: all steps in one file)

Trained tokens are exactly `loss_mask`; step = the record's trainer `step`;
sample = rank * 1_000_000 + export_sequence_idx; pos = index of the token among the sample's trained
tokens (0, 1, 2, ... in order; holes such as tool turns are skipped), since a prime-rl sample has no
prompt/completion split. Log-probs are stored as exported (float32 values, read as doubles); the
exported mismatch_kl and ratio columns are ignored: metrics recompute them in double.
"""
from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import pyarrow as pa

from analysis.ingest.detect import Detected
from analysis.ingest.errors import BadValue, IngestError, LengthMismatch, MissingColumn, WrongType
from analysis.ingest.frameworks.common import SAMPLE_STRIDE, Columns, flush, json_records
from analysis.ingest.limits import Limits
from analysis.ingest.textio import open_text
from analysis.ingest.units import Unit
from analysis.ingest.validate import Batch, as_int

FORMAT = "prime-rl"
EXPORT_DIR = "token_exports"
_STEP_DIR = re.compile(r"step_(\d+)")
_RANK_FILE = re.compile(r"rank_(\d+)\.jsonl(\.gz)?")
REQUIRED = ("step", "token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")


def run_for(path: Path) -> str | None:
    """Default run name: the trainer's output_dir, i.e. the folder holding `token_exports/`."""
    for parent in path.parents:
        if parent.name == EXPORT_DIR:
            return parent.parent.name or None
    return None


def _export_dirs(path: Path) -> list[Path]:
    if path.name == EXPORT_DIR:
        return [path]
    if path.parent.name == EXPORT_DIR and _STEP_DIR.fullmatch(path.name):
        return [path.parent]  # one step folder given: handled with its export (for the STABLE check)
    return sorted(d for d in path.rglob(EXPORT_DIR) if d.is_dir())


def _any_stable(export: Path) -> bool:
    return any((d / "STABLE").exists() for d in export.iterdir() if d.is_dir() and _STEP_DIR.fullmatch(d.name))


def _in_progress(step_dir: Path, any_stable: bool | None = None) -> bool:
    """A step folder without STABLE while another step of the same export has one is still being written.
    Exports from before 2026-06-10 have no STABLE anywhere and are complete as found."""
    if (step_dir / "STABLE").exists():
        return False
    return _any_stable(step_dir.parent) if any_stable is None else any_stable


def adapter(path: Path, limits: Limits) -> tuple[list[Unit], set[Path]]:
    """Units for every `token_exports/` under `path`: one per step folder, one per old all-steps rank file."""
    if not path.is_dir():
        return [], set()
    only_step = path if path.parent.name == EXPORT_DIR and _STEP_DIR.fullmatch(path.name) else None
    units, claimed = [], set()
    for export in _export_dirs(path):
        run = export.parent.name or None
        config = {"framework": "prime-rl"}
        any_stable = _any_stable(export)
        base = path.parent
        for d in sorted((d for d in export.iterdir() if d.is_dir() and _STEP_DIR.fullmatch(d.name)),
                        key=lambda d: int(d.name[5:])):
            if only_step is not None and d != only_step:
                continue
            files = sorted((f for f in d.iterdir() if f.is_file() and _RANK_FILE.fullmatch(f.name)),
                           key=lambda f: int(_RANK_FILE.fullmatch(f.name).group(1)))
            claimed |= set(files)
            if not files:
                continue
            skip = None
            if _in_progress(d, any_stable):
                skip = (f"{d.name} has no STABLE marker while other steps do: the trainer is still writing it; "
                        "load the folder again once the step is finished")
            units.append(Unit(str(d.relative_to(base)), files, Detected(FORMAT, "tokens"),
                              partial(read_unit, run=run, check_stable=False), dict(config), skip=skip))
        if only_step is None:
            for f in sorted(f for f in export.iterdir() if f.is_file() and _RANK_FILE.fullmatch(f.name)):
                claimed.add(f)
                units.append(Unit(str(f.relative_to(base)), [f], Detected(FORMAT, "tokens"),
                                  partial(read_unit, run=run, check_stable=False), dict(config)))
    return units, claimed


def read_unit(unit, limits: Limits, run: str | None = None, check_stable: bool = True) -> Iterator[Batch]:
    """Reader for a unit of rank files (READERS['prime-rl'] for a single file found by content; the folder
    adapter has already checked STABLE for its units)."""
    tokens, seqs = Columns("tokens"), Columns("sequences")
    for path in unit.paths:
        if run is None:
            run = run_for(path)
        if check_stable and path.parent.parent.name == EXPORT_DIR and _STEP_DIR.fullmatch(path.parent.name) \
                and _in_progress(path.parent):
            raise IngestError(unit.name, None, f"{path.parent.name} has no STABLE marker while other steps do: "
                              "the trainer is still writing it", "load it again once the step is finished")
        m = _RANK_FILE.fullmatch(path.name)
        file_rank = int(m.group(1)) if m else None
        label = "" if unit.name.endswith(path.name) else f"{path.name} "  # step units hold several rank files
        with open(path, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            for batch in _read_file(open_text(raw, unit.name, limits, gz), unit.name, label, limits, run, file_rank,
                                    tokens, seqs):
                yield batch
    yield from flush(tokens, seqs)


def _read_file(fp: BinaryIO, name: str, label: str, limits: Limits, run: str | None, file_rank: int | None,
               tokens: Columns, seqs: Columns) -> Iterator[Batch]:
    counters: dict[tuple[int, int], int] = {}  # (step, rank) -> records seen, for exports without the index
    for where, rec in json_records(fp, name, limits, label):
        _record(name, where, rec, run, file_rank, counters, tokens, seqs)
        if tokens.rows >= limits.batch_rows:
            yield from flush(tokens, seqs)


def _int(name: str, where: str, rec: dict, key: str, default: Any = None) -> int:
    v = rec.get(key, default)
    out = as_int(v)
    if out is None or out < 0:
        raise WrongType(name, where, f"'{key}' must be an integer >= 0, got {v!r}", "use the exporter's records")
    return out


def _record(name, where, rec, run, file_rank, counters, tokens: Columns, seqs: Columns) -> None:
    if not isinstance(rec, dict):
        raise WrongType(name, where, f"expected a JSON object, got {type(rec).__name__}", "one record per line")
    for key in REQUIRED:
        if key not in rec:
            raise MissingColumn(name, where, f"required key '{key}' is missing",
                                "a prime-rl token export record (trainer.enable_token_export)")
    step = _int(name, where, rec, "step")
    rank = _int(name, where, rec, "rank", file_rank if file_rank is not None else 0)
    if "export_sequence_idx" in rec:
        idx = _int(name, where, rec, "export_sequence_idx")
    else:
        idx = counters.get((step, rank), 0)
    counters[(step, rank)] = max(counters.get((step, rank), 0), idx + 1)
    if idx >= SAMPLE_STRIDE:
        raise BadValue(name, where, f"export_sequence_idx {idx} >= {SAMPLE_STRIDE}: the sample id "
                       f"rank * {SAMPLE_STRIDE} + export_sequence_idx would collide", "split the export by step")
    sample = rank * SAMPLE_STRIDE + idx
    where = f"{where} (step {step}, rank {rank}, export_sequence_idx {idx})"
    n = len(rec["token_ids"]) if isinstance(rec["token_ids"], list) else -1
    for key in ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs"):
        v = rec[key]
        if not isinstance(v, list) or len(v) != n:
            raise LengthMismatch(name, where, f"'{key}' has {len(v) if isinstance(v, list) else type(v).__name__} "
                                 f"values, 'token_ids' has {n}", "every per-token list has one value per token")
    mask = np.fromiter((bool(x) for x in rec["loss_mask"]), dtype=bool, count=n)
    j = np.flatnonzero(mask)  # trained tokens: loss_mask only, never the 0.0 of non-sampled log-probs
    if not len(j):
        return
    cols: dict[str, Any] = {"step": np.full(len(j), step, dtype=np.int64),
                            "sample": np.full(len(j), sample, dtype=np.int64),
                            "pos": np.arange(len(j), dtype=np.int32)}
    if run is not None:
        cols["run"] = np.full(len(j), run, dtype=object)
    ids = rec["token_ids"]
    cols["token_id"] = np.array([ids[i] for i in j], dtype=np.int64)
    for key, col in (("inference_logprobs", "sampler_logprob"), ("trainer_logprobs", "trainer_logprob")):
        values = rec[key]
        picked = [values[i] for i in j]
        bad = next((k for k, v in enumerate(picked) if not isinstance(v, (int, float)) or isinstance(v, bool)), None)
        if bad is not None:
            raise BadValue(name, f"{where}, token {int(j[bad])}", f"'{key}' is {picked[bad]!r} on a trained token "
                           "(the exporter writes non-finite values as null)",
                           "a trained token needs finite log-probs from both sides")
        cols[col] = np.asarray(picked, dtype=np.float64)
    ent = rec.get("entropy")
    if isinstance(ent, list) and len(ent) == n:
        cols["trainer_entropy"] = pa.array([ent[i] if isinstance(ent[i], (int, float)) else None for i in j],
                                           pa.float64())
    tokens.add(cols, lambda i, j=j, where=where: f"{where}, token {int(j[i])} (pos {i})")
    adv = rec.get("advantages")
    seq: dict[str, Any] = {"step": [step], "sample": [sample]}
    if run is not None:
        seq["run"] = [run]
    if isinstance(adv, list) and len(adv) == n:
        vals = [adv[i] for i in j if isinstance(adv[i], (int, float))]
        if vals:
            seq["advantage"] = [float(np.mean(vals))]
    if isinstance(rec.get("rewards"), (int, float)) and not isinstance(rec.get("rewards"), bool):
        seq["reward"] = [float(rec["rewards"])]
    if len(seq) > 2 + ("run" in seq):
        seqs.add(seq, lambda i, where=where: where)
