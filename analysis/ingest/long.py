"""Long tables: Parquet, CSV and JSON Lines with one token (or one routing row) per record."""
from __future__ import annotations

import io
import re
from typing import BinaryIO, Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from analysis import schema
from analysis.ingest.errors import CorruptFile, UnknownFormat, WrongType
from analysis.ingest.limits import Limits
from analysis.ingest.suggest import map_hint
from analysis.ingest.textio import iter_lines, json_line
from analysis.ingest.validate import Batch, row_where, valid_names


# a long table of these (with `sample`, without log-probs) holds SCHEMA.md `sequences` rows, one per sequence
SEQUENCE_VALUES = frozenset(c.name for c in schema.SEQUENCES) - set(schema.SEQUENCE_KEY)


def table_kind(columns: list[str] | set[str]) -> str | None:
    """'routing' if the columns hold routing rows, 'tokens' if token log-probs, 'topk' if top-k lists, 'sequences' if
    per-sequence values (reward, advantage, prompt, response, response_length, tag) keyed by sample, else None."""
    cols = set(columns)
    if {"layer", "sampler_experts"} <= cols:
        return "routing"
    if "sampler_topk_ids" in cols and not {"sampler_logprob", "trainer_logprob"} & cols:
        return "topk"
    if {"sampler_logprob", "trainer_logprob"} & cols:
        return "tokens"
    if "sample" in cols and cols & SEQUENCE_VALUES and "pos" not in cols:
        return "sequences"
    return None


def _kind_or_refuse(name: str, columns, first=None) -> str:
    """The table kind of these columns, or a refusal; `first()`: the file's first record (a dict), for the fix to
    suggest a field mapping (JSON Lines and Parquet load with one; CSV does not)."""
    kind = table_kind(columns)
    if kind is None:
        raise UnknownFormat(name, None, f"a long table needs 'sampler_logprob' and 'trainer_logprob' (tokens), "
                            f"'layer' and 'sampler_experts' (routing) or 'sample' with per-sequence values such as "
                            f"'reward' (sequences); found columns {sorted(columns)}",
                            map_hint(first()) if first else "see SCHEMA.md, 'Accepted files'")
    return kind


def _first_record(pf: pq.ParquetFile) -> dict | None:
    try:
        rows = next(pf.iter_batches(batch_size=1), None)
    except (pa.ArrowException, OSError):
        return None
    return rows.to_pylist()[0] if rows is not None and rows.num_rows else None


def read_parquet(fp: BinaryIO, name: str, limits: Limits) -> Iterator[Batch]:
    try:
        # pre_buffer (pyarrow's default) caches what it read ahead for the whole file: peak RSS grew 0.2 -> 0.95 GB
        # reading 40M rows; without it memory stays one row group's worth
        pf = pq.ParquetFile(fp, pre_buffer=False)
        # run names as a dictionary: a column of one name is then one string, not one per row (validate.normalise)
        if "run" in pf.schema_arrow.names and pa.types.is_string(pf.schema_arrow.field("run").type):
            fp.seek(0)
            pf = pq.ParquetFile(fp, pre_buffer=False, read_dictionary=["run"])
    except (pa.ArrowException, OSError) as e:
        raise CorruptFile(name, None, f"not a readable Parquet file ({e})", "re-export the file") from None
    kind = _kind_or_refuse(name, pf.schema_arrow.names, lambda: _first_record(pf))
    offset = 0
    try:
        for rb in pf.iter_batches(batch_size=limits.batch_rows):
            yield Batch(kind, pa.Table.from_batches([rb]), row_where(offset))
            offset += rb.num_rows
    except (pa.ArrowException, OSError) as e:
        raise CorruptFile(name, f"after row {offset}", f"Parquet data cannot be read ({e})",
                          "the file is corrupt or truncated; re-export it") from None


CSV_BLOCK_BYTES = 16 * 1024 * 1024  # what Arrow's CSV reader parses at once (one batch)
# The schema's float columns, read as floats whatever their first rows look like: Arrow's CSV reader takes a
# column's type from the file's first block (CSV_BLOCK_BYTES), so a log-prob column whose first rows were written
# "0" or "-1" was read as integers and its first "-0.5" refused the file.
CSV_FLOATS = sorted({c.name for cols in schema.TABLES.values() for c in cols if c.sql_type in ("DOUBLE", "FLOAT")})
_CSV_CONVERSION = re.compile(r"CSV column #(\d+): CSV conversion error to (\w+): invalid value '(.*)'")


def read_csv(fp: BinaryIO, name: str, limits: Limits) -> Iterator[Batch]:
    list_cols = ("sampler_experts", "trainer_experts", "sampler_weights", "trainer_weights", "sampler_topk_ids",
                 "sampler_topk_logprobs", "trainer_topk_ids", "trainer_topk_logprobs")
    try:
        reader = pacsv.open_csv(fp, read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES),
                                convert_options=pacsv.ConvertOptions(
                                    # only an empty cell is missing: "nan" must stay a (refused) NaN, not a null
                                    null_values=[""], strings_can_be_null=True,
                                    column_types={c: pa.string() for c in list_cols + ("run", "token")}
                                    | {c: pa.float64() for c in CSV_FLOATS}))
    except (pa.ArrowException, OSError) as e:
        raise CorruptFile(name, "header", f"not a readable CSV file ({e})", "check the delimiter and header") from None
    kind = _kind_or_refuse(name, reader.schema.names)
    offset = 0
    try:
        for rb in reader:
            t = pa.Table.from_batches([rb])
            for c in list_cols:  # lists are written as JSON arrays inside a CSV cell: "[3, 7]"
                if c in t.column_names:
                    t = t.set_column(t.column_names.index(c), c, _parse_json_lists(name, t.column(c), c, offset))
            yield Batch(kind, t, row_where(offset))
            offset += rb.num_rows
    except (pa.ArrowException, OSError) as e:
        bad = _CSV_CONVERSION.search(str(e))
        if bad and int(bad[1]) < len(reader.schema.names):  # a later block's value unlike the first block's
            column, wanted, value = reader.schema.names[int(bad[1])], bad[2], bad[3]
            raise WrongType(name, f"after row {offset}, column '{column}'",
                            f"the value {value!r} is not of the type the column's first rows have ({wanted})",
                            "write every value of a column the same way"
                            + (" (whole numbers as 3, not 3.0)" if wanted.startswith("int") else "")) from None
        raise CorruptFile(name, f"near row {offset + 1}", f"CSV cannot be parsed ({e})",
                          "every row needs the header's number of fields") from None


def _parse_json_lists(name: str, col: pa.ChunkedArray, cname: str, offset: int) -> pa.Array:
    import json
    out = []
    for i, v in enumerate(col.to_pylist()):
        if v is None or v == "":
            out.append(None)
            continue
        try:
            parsed = json.loads(v)
        except ValueError:
            raise WrongType(name, f"row {offset + i + 1}, column '{cname}'", f"expected a JSON list like [3, 7], "
                            f"got {v!r}", "write lists as JSON arrays") from None
        if not isinstance(parsed, list):
            raise WrongType(name, f"row {offset + i + 1}, column '{cname}'", f"expected a list, got {v!r}",
                            "write lists as JSON arrays")
        out.append(parsed)
    try:
        return pa.array(out)
    except (pa.ArrowException, TypeError) as e:
        raise WrongType(name, f"column '{cname}'", f"list values are not numbers ({e})", "use numeric ids") from None


def read_jsonl_long(fp: BinaryIO, name: str, limits: Limits, kind: str) -> Iterator[Batch]:
    """JSON Lines long table, parsed in chunks of lines (a line longer than the cap is refused)."""
    chunk: list[bytes] = []
    size = 0
    first_line = 1
    line_no = 0
    for line_no, line in iter_lines(fp, name, limits):
        if not line.strip():
            continue
        if not chunk:
            first_line = line_no
        chunk.append(line if line.endswith(b"\n") else line + b"\n")
        size += len(line)
        if len(chunk) >= limits.batch_rows or size > 64 * 1024 * 1024:
            yield _jsonl_batch(name, chunk, first_line, kind)
            chunk, size = [], 0
    if chunk:
        yield _jsonl_batch(name, chunk, first_line, kind)


def _jsonl_batch(name: str, lines: list[bytes], first_line: int, kind: str) -> Batch:
    try:
        t = pajson.read_json(io.BytesIO(b"".join(lines)))
    except pa.ArrowException as e:
        for j, line in enumerate(lines):  # locate the bad line for the message
            try:
                json_line(line)
            except ValueError as e2:
                raise CorruptFile(name, f"line {first_line + j}", f"invalid JSON ({e2})",
                                  "each line must be one JSON object") from None
        raise CorruptFile(name, f"lines {first_line}-{first_line + len(lines) - 1}",
                          f"records do not form a table ({e})", "use the same type for a key on every line") from None
    if not valid_names(t):  # Arrow's JSON reader keeps keys' bytes unchecked
        j = next((j for j, line in enumerate(lines) if not _is_utf8(line)), 0)
        raise CorruptFile(name, f"line {first_line + j}", "a key is not valid UTF-8",
                          "write the file as UTF-8 text") from None
    return Batch(kind, t, lambda i: f"line {first_line + i}")


def _is_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
