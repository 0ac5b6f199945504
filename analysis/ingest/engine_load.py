"""Inference engines' expert-load dumps as a run's sampler-side load counts (table expert_load, n_trainer 0) and,
where a dump has one, its placement (table expert_placement). Formats (FORMATS.md, "Expert load dumps"), read
from the engines' code:

- SGLang ExpertDistributionRecorder (python/sglang/srt/eplb/expert_distribution.py @02295fe5), a `.pt` written
  by torch.save: mode `stat` (_StatAccumulator.dump) holds {rank, logical_count[buffer, layers, logical experts],
  average_utilization_rate_over_window}: counts per forward pass already mapped to logical experts; buffer row i
  becomes step i (rows without any count, an unfilled buffer's, are left out). Modes `per_pass` / `per_token`
  (_DetailAccumulator.dump) hold {records: [{forward_pass_id, rank, global_physical_count[layers, physical
  slots], ...}], last_physical_to_logical_map[layers, physical slots]}: each record's slot counts are summed
  onto logical experts through the map (as _convert_global_physical_count_to_logical_count does), step =
  forward_pass_id, and the map becomes the placement (ranks unknown: the run's config `ep_size` splits it).
- TensorRT-LLM expert statistic (tensorrt_llm/_torch/expert_statistic.py, ExpertStatistic._set_iter and
  _maybe_add_info; read by examples/wide_ep/ep_load_balancer/utils.py @7ce477f3 load_expert_statistic):
  `rank{r}.safetensors` with one int32 tensor [experts] per key "<iter>_<layer>" (a bincount of the rank's routed
  ids; ranks add up); step = iter. `meta_info.json` beside it is metadata, passed over in a folder. The placement
  YAML (generate_eplb_config.py @76a646e9): {num_slots, initial_global_assignments: {layer: [expert per slot]},
  ep_size (optional)}.

Engine dumps carry no run name: `--run NAME` (or the upload's run name) says whose load it is.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from analysis.ingest.errors import BadValue, IngestError, MissingColumn, WrongType
from analysis.ingest.limits import Limits

FORMATS = ("sglang-load", "trtllm-load", "trtllm-placement")
TRT_KEY = re.compile(r"(\d+)_(\d+)")
SGLANG_PASS_KEYS = (b"records", b"last_physical_to_logical_map", b"global_physical_count")
TRT_YAML_KEYS = ("initial_global_assignments", "num_slots", "layer_updates_per_iter", "ep_size")


def looks_like_sglang(pickle_head: bytes) -> bool:
    """Whether a torch zip's data.pkl (its first bytes) names the recorder's keys: detection by content."""
    stat = b"logical_count" in pickle_head and b"rank" in pickle_head
    per_pass = all(k in pickle_head for k in SGLANG_PASS_KEYS)
    return stat or per_pass


def looks_like_trt_yaml(first_line: bytes) -> bool:
    return any(first_line.startswith(k.encode() + b":") for k in TRT_YAML_KEYS)


def _int_array(name: str, where: str, t, dims: int, what: str) -> np.ndarray:
    import torch
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype.is_floating_point or t.dtype == torch.bool:
        got = f"a {t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise WrongType(name, where, f"expected {what} as a {dims}-D integer tensor, got {got}",
                        "load the file exactly as the engine wrote it")
    a = t.numpy().astype(np.int64)
    if a.size and a.min() < 0:
        i = np.unravel_index(int(np.argmin(a)), a.shape)
        raise BadValue(name, f"{where}{list(map(int, i))}", f"negative value {int(a.min())}",
                       "counts and expert ids are ≥ 0")
    return a


def _load_rows(run: str, step: np.ndarray, layer: np.ndarray, expert: np.ndarray, n: np.ndarray) -> pa.Table:
    keep = n > 0
    return pa.table({"run": pa.array([run] * int(keep.sum()), pa.string()),
                     "step": pa.array(step[keep], pa.int64()), "layer": pa.array(layer[keep], pa.int32()),
                     "expert": pa.array(expert[keep], pa.int32()), "n_sampler": pa.array(n[keep], pa.int64()),
                     "n_trainer": pa.array(np.zeros(int(keep.sum()), np.int64), pa.int64())})


def _cube_rows(run: str, steps: np.ndarray, cube: np.ndarray) -> pa.Table:
    """Rows of counts cube[i, layer, expert] at steps[i]."""
    S, Ly, E = cube.shape
    si, li, ei = np.meshgrid(np.arange(S), np.arange(Ly), np.arange(E), indexing="ij")
    return _load_rows(run, steps[si.reshape(-1)], li.reshape(-1), ei.reshape(-1), cube.reshape(-1))


def _placement_rows(run: str, maps: dict[int, np.ndarray], n_ranks: int | None) -> pa.Table:
    layers = [np.full(len(m), layer) for layer, m in maps.items()]
    slots = [np.arange(len(m)) for m in maps.values()]
    n = sum(len(m) for m in maps.values())
    return pa.table({"run": pa.array([run] * n, pa.string()),
                     "layer": pa.array(np.concatenate(layers) if layers else [], pa.int32()),
                     "slot": pa.array(np.concatenate(slots) if slots else [], pa.int32()),
                     "expert": pa.array(np.concatenate(list(maps.values())) if maps else [], pa.int32()),
                     "n_ranks": pa.array([n_ranks] * n, pa.int32())})


def _need_run(name: str, run: str | None) -> str:
    if not run:
        raise MissingColumn(name, None, "an engine's expert-load dump names no run",
                            "pass --run NAME (or give the run name when uploading)")
    return run


def read_sglang(path: Path, name: str, limits: Limits, run: str | None) -> dict[str, pa.Table]:
    """{table: rows} of an SGLang recorder dump (stat or per_pass / per_token)."""
    from analysis.ingest.tensors import load_tensors
    d = load_tensors(path, name, limits, "pt")
    run = _need_run(name, run)
    if not isinstance(d, dict):
        raise WrongType(name, None, f"expected the recorder's dict, got {type(d).__name__}", "see FORMATS.md")
    if "logical_count" in d:
        cube = _int_array(name, "logical_count", d["logical_count"], 3, "logical_count [buffer, layers, experts]")
        live = np.flatnonzero(cube.sum((1, 2)) > 0)
        return {"expert_load": _cube_rows(run, live, cube[live])}
    if "records" not in d or "last_physical_to_logical_map" not in d:
        raise MissingColumn(name, None, "neither `logical_count` (stat mode) nor `records` with "
                            "`last_physical_to_logical_map` (per_pass mode)", "load the file as SGLang wrote it")
    m = _int_array(name, "last_physical_to_logical_map", d["last_physical_to_logical_map"], 2,
                   "last_physical_to_logical_map [layers, physical slots]")
    if not isinstance(d["records"], list):
        raise WrongType(name, "records", "expected a list of records", "load the file as SGLang wrote it")
    L, P = m.shape
    E = int(m.max()) + 1 if m.size else 0
    parts = []
    for i, rec in enumerate(d["records"]):
        where = f"records[{i}]"
        if not isinstance(rec, dict) or "global_physical_count" not in rec or "forward_pass_id" not in rec:
            raise MissingColumn(name, where, "a record needs forward_pass_id and global_physical_count",
                                "load the file as SGLang wrote it")
        c = _int_array(name, f"{where}.global_physical_count", rec["global_physical_count"], 2,
                       "global_physical_count [layers, physical slots]")
        if c.shape != (L, P):
            raise BadValue(name, f"{where}.global_physical_count", f"shape {list(c.shape)} differs from the "
                           f"map's {[L, P]}", "every record counts the slots the map names")
        logical = np.zeros((L, E), np.int64)
        for layer in range(L):
            np.add.at(logical[layer], m[layer], c[layer])
        step = rec["forward_pass_id"]
        if not isinstance(step, int) or step < 0:
            raise BadValue(name, f"{where}.forward_pass_id", f"expected an integer ≥ 0, got {step!r}",
                           "load the file as SGLang wrote it")
        parts.append(_cube_rows(run, np.array([step]), logical[None]))
    load = pa.concat_tables(parts) if parts else _load_rows(run, *(np.zeros(0, np.int64),) * 4)
    return {"expert_load": load, "expert_placement": _placement_rows(run, {li: m[li] for li in range(L)}, None)}


def read_trt_statistic(path: Path, name: str, limits: Limits, run: str | None) -> dict[str, pa.Table]:
    """{table: rows} of one TensorRT-LLM `rank<r>.safetensors` expert statistic."""
    from analysis.ingest.tensors import load_tensors
    d = load_tensors(path, name, limits, "safetensors")
    run = _need_run(name, run)
    parts = []
    for key, t in sorted(d.items()):
        found = TRT_KEY.fullmatch(key)
        if not found:
            raise BadValue(name, f"key {key!r}", "expected keys '<iteration>_<layer>'",
                           "load TensorRT-LLM's rank<r>.safetensors as written")
        c = _int_array(name, f"key {key!r}", t, 1, "the expert counts")
        it, layer = int(found.group(1)), int(found.group(2))
        e = np.arange(len(c))
        parts.append(_load_rows(run, np.full(len(c), it), np.full(len(c), layer), e, c))
    if not parts:
        raise BadValue(name, None, "the statistic holds no counts", "dump at least one iteration")
    return {"expert_load": pa.concat_tables(parts)}


def read_trt_placement(path: Path, name: str, limits: Limits, run: str | None) -> dict[str, pa.Table]:
    """{table: rows} of a TensorRT-LLM EPLB placement YAML (safe_load: plain data only)."""
    import yaml
    if path.stat().st_size > limits.max_line_bytes:
        raise BadValue(name, None, "placement YAML larger than DRIFT_MAX_LINE_MB", "is it the right file?")
    try:
        doc: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise IngestError(name, None, f"not readable YAML ({str(e).splitlines()[0][:200]})",
                          "load the file generate_eplb_config.py wrote") from None
    run = _need_run(name, run)
    if not isinstance(doc, dict) or not isinstance(doc.get("initial_global_assignments"), dict):
        raise MissingColumn(name, "initial_global_assignments", "expected a mapping {layer: [expert per slot]}",
                            "load the file generate_eplb_config.py wrote")
    n_slots, ep = doc.get("num_slots"), doc.get("ep_size")
    maps = {}
    for layer, slots in doc["initial_global_assignments"].items():
        where = f"initial_global_assignments[{layer!r}]"
        if not isinstance(layer, int) or layer < 0 or not isinstance(slots, list) or not slots \
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in slots):
            raise BadValue(name, where, "expected layer: [expert id ≥ 0 per slot]", "see FORMATS.md")
        if isinstance(n_slots, int) and len(slots) != n_slots:
            raise BadValue(name, where, f"{len(slots)} slots, but num_slots is {n_slots}",
                           "every layer lists num_slots experts")
        maps[layer] = np.asarray(slots, np.int64)
    if isinstance(ep, int) and ep > 0 and any(len(m) % ep for m in maps.values()):
        raise BadValue(name, "ep_size", f"{ep} ranks do not divide the slots", "num_slots is a multiple of ep_size")
    return {"expert_placement": _placement_rows(run, maps, ep if isinstance(ep, int) and ep > 0 else None)}


READERS = {"sglang-load": read_sglang, "trtllm-load": read_trt_statistic, "trtllm-placement": read_trt_placement}
