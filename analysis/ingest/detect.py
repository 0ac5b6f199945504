"""Recognise an input file by its content (magic bytes, header, first record), never by its name alone."""
from __future__ import annotations

import gzip
import json
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO

import pyarrow.parquet as pq

from analysis.ingest.errors import CorruptFile, NotALogFile, UnknownFormat
from analysis.ingest import engine_load, summary_files
from analysis.ingest.long import table_kind
from analysis.ingest.suggest import map_hint

# What zipfile raises on a damaged archive: besides BadZipFile, a mangled member name fails to decode
# (UnicodeDecodeError is a ValueError) and a cut directory record fails to unpack.
# The columns of miles' per-token dashboard mirror (miles/ray/rollout/debug_data.py:47-54 at 31f1ca9).
MILES_COLUMNS = {"sample_index", "response_length", "total_length", "tokens", "loss_mask", "rollout_log_probs"}
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, struct.error)


@dataclass(frozen=True)
class Detected:
    format: str
    kind: str  # "tokens", "routing" or "mixed" (a file that can hold both)
    gz: bool = False


def _first_line(fp: BinaryIO, cap: int = 1 << 20) -> bytes:
    while True:
        line = fp.readline(cap)
        if not line or line.strip():
            return line


def detect(fp: BinaryIO, name: str) -> Detected:
    """Sniff `fp` (left at position 0 afterwards)."""
    fp.seek(0)
    head = fp.read(16)
    fp.seek(0)
    try:
        if not head:
            raise NotALogFile(name, None, "the file is empty", "upload a log file; SCHEMA.md lists the accepted ones")
        if head[:4] == b"PAR1":
            try:
                arrow_schema = pq.ParquetFile(fp).schema_arrow
            except Exception as e:
                raise CorruptFile(name, None, f"Parquet footer cannot be read ({e})",
                                  "the file is truncated or corrupt; re-export it") from None
            if summary_files.is_summary_file(arrow_schema.metadata):  # DriftLogger's per-step summaries
                return Detected("summary", "summary")
            if MILES_COLUMNS <= set(arrow_schema.names):  # miles' dashboard_columns mirror (sampler side only)
                return Detected("miles-columns", "tokens")
            return Detected("parquet", table_kind(arrow_schema.names) or "unknown")
        if head[:2] == b"\x1f\x8b":
            try:
                line = _first_line(gzip.GzipFile(fileobj=fp, mode="rb"))
            except (OSError, EOFError, zlib.error) as e:
                raise CorruptFile(name, None, f"gzip stream cannot be read ({e})", "the file is truncated") from None
            return _json_kind(name, line, gz=True)
        if head[:4] == b"PK\x03\x04":
            try:
                members = zipfile.ZipFile(fp).namelist()
            except ZIP_ERRORS as e:
                raise CorruptFile(name, None, f"zip archive cannot be read ({e})", "the file is truncated") from None
            if any(m.endswith("data.pkl") for m in members):
                return _pt_kind(fp, [m for m in members if m.endswith("data.pkl")][0])
            return Detected("zip", "mixed")
        if head[:1] == b"\x80":  # pickle protocol 2+: legacy torch.save or a plain pickle
            return Detected("pt", "mixed")
        if len(head) >= 9:
            (n,) = struct.unpack("<Q", head[:8])
            if head[8:9] == b"{" and 0 < n < 100 * 1024 * 1024:
                return _safetensors_kind(fp, n, name)
        line = _first_line(fp)
        stripped = line.lstrip()
        if engine_load.looks_like_trt_yaml(stripped):  # TensorRT-LLM's EPLB placement (FORMATS.md)
            return Detected("trtllm-placement", "load")
        if stripped.startswith(b"{"):
            return _json_kind(name, line, gz=False)
        try:
            header = line.decode("utf-8").strip().split(",")
        except UnicodeDecodeError:
            header = []
        if len(header) > 1:
            kind = table_kind([h.strip().strip('"') for h in header])
            if kind:
                return Detected("csv", kind)
        raise NotALogFile(name, None, "not a recognised log file (expected Parquet, CSV, JSON Lines, "
                            ".pt or .safetensors in SCHEMA.md's columns)", "see SCHEMA.md, 'Accepted files'")
    finally:
        fp.seek(0)


# An SGLang recorder dump names its keys in the first bytes of the pickle inside the torch zip
PICKLE_SNIFF = 1 << 16


def _pt_kind(fp: BinaryIO, member: str) -> Detected:
    """A torch zip: SGLang's expert-distribution dump (its keys in data.pkl) or any other tensor dump."""
    try:
        with zipfile.ZipFile(fp).open(member) as f:
            head = f.read(PICKLE_SNIFF)
    except (*ZIP_ERRORS, zlib.error):
        head = b""  # the tensor reader reports the damage
    if engine_load.looks_like_sglang(head):
        return Detected("sglang-load", "load")
    return Detected("pt", "mixed")


def _safetensors_kind(fp: BinaryIO, n: int, name: str) -> Detected:
    """TensorRT-LLM's expert statistic (every key '<iter>_<layer>', 1-D integer tensors) or any other tensors."""
    fp.seek(8)
    try:
        header = json.loads(fp.read(n))
    except ValueError:
        return Detected("safetensors", "mixed")  # the reader reports the broken header
    keys = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else {}
    if keys and all(engine_load.TRT_KEY.fullmatch(k) for k in keys):
        if all(isinstance(v, dict) and len(v.get("shape", ())) == 1 and str(v.get("dtype", "")).startswith(("I", "U"))
               for v in keys.values()):
            return Detected("trtllm-load", "load")
        raise NotALogFile(name, None, "TensorRT-LLM co-occurrence or raw expert ids (keys '<iter>_<layer>' of "
                          "2-D tensors): not loaded", "load the rank<r>.safetensors counts beside it")
    return Detected("safetensors", "mixed")


def _json_kind(name: str, line: bytes, gz: bool) -> Detected:
    try:
        obj = json.loads(line)
    except ValueError:
        # a first line over the sniffing window, or broken JSON: the reader will report the exact place
        text = line[:2000].decode("utf-8", "replace")
        if '"sampler_logprobs"' in text:
            return Detected("sequence-jsonl", "mixed", gz)
        if '"traces"' in text and '"task"' in text:  # a long verifiers episode
            return Detected("prime-rl-traces", "mixed", gz)
        raise CorruptFile(name, "line 1", "invalid JSON", "each line must be one JSON object") from None
    if not isinstance(obj, dict):
        raise UnknownFormat(name, "line 1", "expected a JSON object per line", "see SCHEMA.md")
    if "num_experts" in obj and set(obj) <= {"num_experts", "num_experts_per_token", "ep_size"}:
        raise NotALogFile(name, None, "TensorRT-LLM expert-statistic metadata (meta_info.json): nothing to load; "
                          "the counts are in the rank<r>.safetensors beside it", "load those files")
    if "inference_logprobs" in obj and "loss_mask" in obj:
        return Detected("prime-rl", "tokens", gz)
    if isinstance(obj.get("traces"), list) and "task" in obj:  # verifiers Episode.to_record(): prime-rl traces
        return Detected("prime-rl-traces", "mixed", gz)
    if isinstance(obj.get("sampler_logprobs"), list):
        return Detected("sequence-jsonl", "mixed", gz)
    kind = table_kind(obj.keys())
    if kind:
        return Detected("jsonl", kind, gz)
    raise UnknownFormat(name, "line 1", f"JSON keys {sorted(obj)[:12]} match no accepted format", map_hint(obj))
