"""Field mapping: load JSON Lines or Parquet whose keys match no accepted format, by naming which field holds
which SCHEMA column (`ingest --map sampler_logprob=rollout_logprobs ...`, or the Data page's mapping form).

The mapping renames (and, for one-sequence-per-record files, reshapes) each record before the usual validation:
a record whose sampler_logprob field is a list is one sequence (arrays indexed by token, like sequence JSON
Lines); otherwise it is one token row (a long table). Fields already named like a column are taken as they are
unless the mapping says otherwise. Without a `sample` field, sequences are numbered 0, 1, … within each step in
file order. A field mapped to a number column must hold numbers, and per-token fields one value per token, or
the file is refused with the usual message (file, place, rule).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from analysis.ingest.detect import Detected, detect
from analysis.ingest.errors import (CorruptFile, IngestError, LengthMismatch, MissingColumn, UnknownFormat,
                                    WrongType)
from analysis.ingest.limits import Limits
from analysis.ingest.load import load_units, refused
from analysis.ingest.units import Outcome, Unit
from analysis.ingest.sequences import parsed_lines, read_sequence_records
from analysis.ingest.textio import iter_lines, open_text
from analysis.ingest.validate import Batch, row_where
from analysis.store import Store

if TYPE_CHECKING:
    import polars as pl

# column -> (what it holds, key of sequence JSON Lines for one-sequence-per-record files; None: per-token only)
NUMBER, INTEGER, TEXT = "number", "integer", "text"
PER_TOKEN = {  # per-token columns: a list per sequence, or one value per token row
    "sampler_logprob": (NUMBER, "sampler_logprobs"), "trainer_logprob": (NUMBER, "trainer_logprobs"),
    "token_id": (INTEGER, "token_ids"), "token": (TEXT, "tokens"),
    "sampler_entropy": (NUMBER, "sampler_entropies"), "trainer_entropy": (NUMBER, "trainer_entropies"),
}
PER_SEQUENCE = {  # one value per sequence (repeated on each token row of a long table)
    "run": TEXT, "step": INTEGER, "sample": INTEGER, "sampler_version": INTEGER, "trainer_version": INTEGER,
    "reward": NUMBER, "advantage": NUMBER, "prompt": TEXT, "response": TEXT, "response_length": INTEGER,
}
LONG_ONLY = {"pos": INTEGER}
COLUMNS = tuple(PER_SEQUENCE) + ("pos",) + tuple(PER_TOKEN)
# `tokens` names the response tokens whatever they are: ids when the field holds integers, text otherwise
ALIASES = {"sampler_logprobs": "sampler_logprob", "trainer_logprobs": "trainer_logprob",
           "token_ids": "token_id"}
REQUIRED = ("step", "sampler_logprob", "trainer_logprob")
FIX = "map each column to the field that holds it, e.g. --map sampler_logprob=rollout_logprobs"


def parse_map_args(items: Sequence[str]) -> dict[str, str]:
    """["COLUMN=FIELD", ...] -> {column: field}; ValueError says which item is wrong and why."""
    mapping: dict[str, str] = {}
    for item in items:
        column, sep, field = item.partition("=")
        column, field = column.strip(), field.strip()
        if not sep or not column or not field:
            raise ValueError(f"--map {item!r}: expected COLUMN=FIELD, e.g. sampler_logprob=rollout_logprobs")
        column = ALIASES.get(column, column)
        if column not in COLUMNS and column != "tokens":
            raise ValueError(f"--map {item!r}: unknown column {column!r} (columns: {', '.join(COLUMNS)})")
        if column in mapping:
            raise ValueError(f"--map {item!r}: column {column!r} is mapped twice")
        mapping[column] = field
    return mapping


def _field_of(mapping: dict[str, str], column: str, fields) -> str | None:
    """The file's field for `column`: the mapped one, else a field of the same name, else None."""
    if column in mapping:
        return mapping[column]
    return column if column in fields and column not in mapping.values() else None


def _is_number(v, integer: bool) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return not integer or isinstance(v, int) or float(v).is_integer()


def _describe(v) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"


class _Remap:
    """Turns one record (a dict of the file's fields) into a canonical one, checking what the mapping asks."""

    def __init__(self, name: str, mapping: dict[str, str], first: dict):
        self.name, self.mapping = name, dict(mapping)
        fields = set(first)
        tokens = self.mapping.pop("tokens", None)
        if tokens is not None:  # ids or text, by what the field holds
            v = first.get(tokens)
            probe = v[0] if isinstance(v, list) and v else v
            column = "token" if isinstance(probe, str) else "token_id"
            if column in self.mapping:
                raise ValueError(f"'tokens' and {column!r} are both mapped")
            self.mapping[column] = tokens
        self.fields = {c: f for c in COLUMNS if (f := _field_of(self.mapping, c, fields)) is not None}
        s = first.get(self.fields.get("sampler_logprob", ""), None)
        self.per_sequence = isinstance(s, list)
        self.samples: dict[object, int] = {}

    def _get(self, obj: dict, column: str, where: str, required: bool):
        field = self.fields.get(column)
        if field is None:
            if required:
                raise MissingColumn(self.name, where, f"no field is mapped to '{column}'",
                                    f"add --map {column}=FIELD (or pick its field in the mapping form)")
            return None
        if field not in obj:
            if required or column in self.mapping:
                raise MissingColumn(self.name, where, f"field '{field}' (mapped to {column}) is missing", FIX)
            return None
        return obj[field]

    def _check_scalar(self, column: str, kind: str, v, where: str):
        if v is None:
            return None
        if kind == TEXT:
            return v if isinstance(v, str) else json.dumps(v)  # e.g. a chat prompt as a list of messages
        if not _is_number(v, kind == INTEGER):
            want = "an integer" if kind == INTEGER else "a number"
            raise WrongType(self.name, f"{where}, field '{self.fields[column]}'",
                            f"mapped to {column}, it must hold {want}, got {_describe(v)}", FIX)
        return v

    def _check_list(self, column: str, kind: str, v, n: int | None, where: str) -> list:
        field = self.fields[column]
        place = f"{where}, field '{field}'"
        if not isinstance(v, list):
            raise WrongType(self.name, place, f"mapped to {column}, it must be a list with one value per token, "
                            f"got {_describe(v)}", FIX)
        if n is not None and len(v) != n:
            raise LengthMismatch(self.name, place, f"mapped to {column}, it has {len(v)} values but field "
                                 f"'{self.fields['sampler_logprob']}' (sampler_logprob) has {n}",
                                 "map fields that hold one value per response token")
        if kind != TEXT:
            for j, x in enumerate(v):
                if x is not None and not _is_number(x, kind == INTEGER):
                    want = "integers" if kind == INTEGER else "numbers"
                    raise WrongType(self.name, f"{place}, token {j}",
                                    f"mapped to {column}, it must hold {want}, got {_describe(x)}", FIX)
        return v

    def sequence(self, obj: dict, where: str) -> dict:
        """A record of sequence JSON Lines (arrays indexed by token)."""
        if not isinstance(obj, dict):
            raise WrongType(self.name, where, f"expected a JSON object, got {type(obj).__name__}", FIX)
        out: dict = {}
        s = self._check_list("sampler_logprob", NUMBER, self._get(obj, "sampler_logprob", where, True), None, where)
        for column, (kind, key) in PER_TOKEN.items():
            v = self._get(obj, column, where, column in REQUIRED)
            if v is not None:
                out[key] = self._check_list(column, kind, v, len(s), where)
        for column, kind in PER_SEQUENCE.items():
            v = self._check_scalar(column, kind, self._get(obj, column, where, column in REQUIRED), where)
            if v is not None:
                out[column] = v
        if "sample" not in out:  # numbered within the step, in file order
            out["sample"] = self.samples.get(out["step"], 0)
        self.samples[out["step"]] = max(self.samples.get(out["step"], 0), int(out["sample"]) + 1)
        return out

    def token_row(self, obj: dict, where: str) -> dict:
        """A row of a long table (one token per record)."""
        out = {}
        for column in COLUMNS:
            kind = PER_SEQUENCE.get(column) or LONG_ONLY.get(column) or PER_TOKEN[column][0]
            v = self._check_scalar(column, kind, self._get(obj, column, where, column in REQUIRED), where)
            if v is not None:
                out[column] = v
        return out


def _parquet_records(fp: BinaryIO, name: str, rows: int = 1024) -> Iterator[tuple[int, dict]]:
    try:
        pf = pq.ParquetFile(fp)
        offset = 0
        for rb in pf.iter_batches(batch_size=rows):
            for i, rec in enumerate(rb.to_pylist()):
                yield offset + i + 1, rec
            offset += rb.num_rows
    except (pa.ArrowException, OSError) as e:
        raise CorruptFile(name, None, f"Parquet data cannot be read ({e})", "re-export the file") from None


def _records(fp: BinaryIO, name: str, limits: Limits, fmt: str, gz: bool) -> Iterator[tuple[int, dict]]:
    if fmt == "parquet":
        return _parquet_records(fp, name)
    return parsed_lines(open_text(fp, name, limits, gz), name, limits)


def _read_mapped(mapping: dict[str, str], fmt: str, gz: bool) -> Callable[[Unit, Limits], Iterator[Batch]]:
    place = "row" if fmt == "parquet" else "line"

    def read(unit: Unit, limits: Limits) -> Iterator[Batch]:
        with open(unit.paths[0], "rb") as fp:
            records = _records(fp, unit.name, limits, fmt, gz)
            first = next(records, None)
            if first is None:
                return
            if not isinstance(first[1], dict):
                raise WrongType(unit.name, f"{place} {first[0]}", f"expected an object, got "
                                f"{type(first[1]).__name__}", FIX)
            try:
                remap = _Remap(unit.name, mapping, first[1])
            except ValueError as e:
                raise UnknownFormat(unit.name, None, str(e), FIX) from None

            def all_records():
                yield first
                yield from records

            if remap.per_sequence:
                yield from read_sequence_records(
                    ((n, remap.sequence(obj, f"{place} {n}")) for n, obj in all_records()), unit.name, limits)
                return
            rows: list[dict] = []
            start = first[0]
            for n, obj in all_records():
                if not rows:
                    start = n
                rows.append(remap.token_row(obj, f"{place} {n}"))
                if len(rows) >= min(limits.batch_rows, 65_536):
                    yield _token_batch(rows, start, place)
                    rows = []
            if rows:
                yield _token_batch(rows, start, place)
    return read


def _token_batch(rows: list[dict], start: int, place: str) -> Batch:
    where = row_where(start - 1) if place == "row" else (lambda i: f"line {start + i}")
    return Batch("tokens", pa.Table.from_pylist(rows), where)


def _format(path: Path, name: str) -> tuple[str, bool]:
    """("parquet" | "jsonl", gzip?) from the content; other files cannot be mapped."""
    with open(path, "rb") as fp:
        head = fp.read(4)
    if head == b"PAR1":
        return "parquet", False
    gz = head[:2] == b"\x1f\x8b"
    limits = Limits.from_env()
    with open(path, "rb") as fp:
        first = next((line for _, line in iter_lines(open_text(fp, name, limits, gz), name, limits)
                      if line.strip()), b"")
    if first.lstrip().startswith(b"{"):
        return "jsonl", gz
    raise UnknownFormat(name, None, "a field mapping applies to JSON Lines (.jsonl, .jsonl.gz) or Parquet only",
                        "convert the file to JSON Lines or Parquet, or load it without --map")


def mapped_unit(path: Path, mapping: dict[str, str], name: str | None = None) -> Unit:
    name = name or path.name
    fmt, gz = _format(path, name)
    return Unit(name, [path], Detected(f"{fmt}+map", "mixed", gz), _read_mapped(mapping, fmt, gz))


def _files(paths: Sequence[Path]) -> tuple[list[Path], list[Outcome]]:
    files, missing = [], []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith((".jsonl", ".jsonl.gz",
                                                                                          ".parquet")))
        elif p.is_file():
            files.append(p)
        else:
            missing.append(Outcome(str(p), "refused", message=f"{p}: no such file or folder", rule="no such file"))
    return files, missing


def ingest_mapped(store: Store, paths: Sequence[str | Path], mapping: dict[str, str], run: str | None = None,
                  limits: Limits | None = None, names: Sequence[str] | None = None) -> list[Outcome]:
    """Load JSON Lines / Parquet files (folders: every .jsonl, .jsonl.gz, .parquet inside) through `mapping`;
    one Outcome per file, all-or-nothing each."""
    limits = limits or Limits.from_env()
    files, outcomes = _files([Path(p) for p in paths])
    units = []
    for i, f in enumerate(files):
        name = names[i] if names else f.name
        try:
            units.append(mapped_unit(f, mapping, name))
        except IngestError as e:
            outcomes.append(refused(name, e))
    return outcomes + load_units(store, units, run, limits)


def ingest_mapped_upload(store: Store, name: str, fp: BinaryIO, mapping: dict[str, str], run: str | None = None,
                         max_bytes: int | None = None) -> Outcome:
    """The Data page's mapping form: spool one upload to a private temp file (generated name) and load it."""
    from analysis.ingest.uploads import _spool, display_name
    label = display_name(name)
    tmp = Path(tempfile.mkdtemp(prefix="driftscope-mapped-"))
    try:
        path = tmp / "data"
        fp.seek(0)
        try:
            _spool(fp, path, max_bytes)
        except IngestError as e:
            return Outcome(label, "refused", message=str(e).replace(f"{e.file}:", f"{label}:", 1))
        return ingest_mapped(store, [path], mapping, run, names=[label])[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- for the mapping form ---------------------------------------------------------------------------------
def unmatched_fields(fp: BinaryIO, name: str) -> list[str] | None:
    """The fields of a JSON Lines / Parquet file whose keys match no accepted format (what the mapping form
    offers), or None when the file is recognised, or is not JSON Lines / Parquet."""
    try:
        det = detect(fp, name)
    except UnknownFormat as e:
        if "match no accepted format" not in e.detail:
            return None
        fields, _ = preview(fp, name, rows=1)
        return fields
    except IngestError:
        return None
    if det.format == "parquet" and det.kind == "unknown":
        return preview(fp, name, rows=1)[0]
    return None


def preview(fp: BinaryIO, name: str, rows: int = 5) -> tuple[list[str], pl.DataFrame]:
    """(fields in file order, the first `rows` records with each value shown as short text)."""
    fp.seek(0)
    head = fp.read(4)
    fp.seek(0)
    limits = Limits.from_env()
    try:
        recs = _records(fp, name, limits, "parquet" if head == b"PAR1" else "jsonl", head[:2] == b"\x1f\x8b")
        firsts = [obj for _, (_, obj) in zip(range(rows), recs) if isinstance(obj, dict)]
    finally:
        fp.seek(0)
    fields = list(dict.fromkeys(k for obj in firsts for k in obj))

    def short(v) -> str:
        text = v if isinstance(v, str) else json.dumps(v)
        return text if len(text) <= 80 else text[:77] + "…"
    import polars as pl  # here: the command line imports this module for every load, which never shows a preview
    return fields, pl.DataFrame({f: [short(o.get(f)) for o in firsts] for f in fields}) if fields else pl.DataFrame()
