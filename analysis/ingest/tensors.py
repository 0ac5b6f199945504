"""Tensor dumps (`.pt` via torch.save, `.safetensors`): one step's [B, T] tensors with RL-framework names.

torch is imported here only, lazily: the metrics side of the library never pays for it.
`.pt` files are loaded with `weights_only=True`; a file that needs pickle to load is refused.
"""
from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from analysis.ingest.errors import (CorruptFile, LengthMismatch, MissingColumn, TooLarge, UnsafeFile, WrongType,
                                     parser_message)
from analysis.ingest.limits import Limits, human_size
from analysis.ingest.validate import Batch, as_int
from analysis.routing_rows import routing_columns

SAMPLER_KEYS = ("rollout_log_probs", "sampler_logprobs")
TRAINER_KEYS = ("old_log_probs", "trainer_logprobs")
MASK_KEYS = ("response_mask", "loss_mask")
STEP_KEYS = ("step", "global_steps")


def load_tensors(path: Path, name: str, limits: Limits, fmt: str = "pt", where: str | None = None,
                 pickle_fix: str | None = None) -> Any:
    """The one door for user tensor files: `.safetensors`, or `.pt` via `torch.load(weights_only=True)`,
    memory-mapped so big dumps are not read whole. Pickle is never run: a `.pt` that needs it is refused
    (`pickle_fix` replaces the generic fix in that message); `where` names the file inside a unit of several.
    """
    import torch

    size = os.path.getsize(path)
    if size > limits.max_tensor_file_bytes:
        raise TooLarge(name, where, f"tensor file exceeds the cap of {human_size(limits.max_tensor_file_bytes)}",
                       "dump one step per file, or raise DRIFT_MAX_TENSOR_FILE_MB")
    if fmt == "safetensors":
        from safetensors.torch import load_file
        try:
            return dict(load_file(str(path)))
        except Exception as e:  # the parser's own SafetensorError, or whatever malformed bytes trip
            raise CorruptFile(name, where, f"not a readable safetensors file ({parser_message(e)})",
                              "re-save the tensors") from None
    try:
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # legacy (non-zip) torch.save files cannot be memory-mapped
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"it holds a {found.group(1)} object" if found else "it is not a plain tensor file"
        raise UnsafeFile(name, where, f"refused: loading it would need pickle, which can run code ({what})",
                         pickle_fix or "save plain tensors, lists, numbers and strings; for numpy arrays use "
                         "torch.as_tensor before torch.save (see README, 'Files that need pickle')") from None
    # torch's unpickler fails on garbage with whatever it trips over (IndexError, struct.error, ...), and hands a
    # file named *.safetensors to safetensors: any other failure of this one call on user bytes is a bad file
    except Exception as e:
        raise CorruptFile(name, where, f"not a readable torch file ({parser_message(e)})",
                          "the file may be truncated or still being written; save it again with torch.save") from None
    return obj


def _pick(d: dict, keys: tuple[str, ...]):
    for k in keys:
        if k in d:
            return k, d[k]
    return None, None


def _scalar(name: str, d: dict, keys: tuple[str, ...]) -> int | None:
    import torch
    k, v = _pick(d, keys)
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise WrongType(name, f"key '{k}'", f"expected a scalar, got shape {list(v.shape)}", "store one number")
        v = v.item()
    out = as_int(v, integral_floats=True)
    if out is None:
        raise WrongType(name, f"key '{k}'", f"expected an integer, got {v!r}", "store the step as an int")
    return out


# A dict layout a framework writes that needs its own alignment (verl's padded batch): (is_layout, batches).
Layout = tuple[Callable[[dict], bool], Callable[[str, dict], Iterator[Batch]]]


def read_tensor_dump(path: Path, name: str, limits: Limits, fmt: str,
                     layouts: Sequence[Layout] = ()) -> Iterator[Batch]:
    """Batches of one tensor file: by the first of `layouts` that claims its dict, else SCHEMA.md's names."""
    d = load_tensors(path, name, limits, fmt)
    if not isinstance(d, dict):
        raise WrongType(name, None, f"expected a dict of tensors, got {type(d).__name__}",
                        "torch.save a dict such as {'rollout_log_probs': ..., 'old_log_probs': ..., ...}")
    batches = next((batches for is_layout, batches in layouts if is_layout(d)), tensor_dict_batches)
    yield from batches(name, d)


def tensor_dict_batches(name: str, d: dict) -> Iterator[Batch]:
    """Batches from a dict of [B, T] tensors in SCHEMA.md's names (experts already aligned to tokens)."""
    import torch

    sk, s = _pick(d, SAMPLER_KEYS)
    tk, t = _pick(d, TRAINER_KEYS)
    mk, mask = _pick(d, MASK_KEYS)
    for key, v in ((SAMPLER_KEYS[0], s), (TRAINER_KEYS[0], t), (MASK_KEYS[0], mask)):
        if v is None:
            raise MissingColumn(name, None, f"required tensor '{key}' is missing (keys found: {', '.join(sorted(map(str, d)))})",
                                "see SCHEMA.md, tensor dumps")
        if not isinstance(v, torch.Tensor) or v.ndim != 2:
            raise WrongType(name, f"key '{key}'", f"expected a [B, T] tensor, got {getattr(v, 'shape', type(v).__name__)}",
                            "store one row per sequence")
    if s.shape != t.shape or s.shape != mask.shape:
        raise LengthMismatch(name, None, f"shapes differ: {sk} {list(s.shape)}, {tk} {list(t.shape)}, "
                             f"{mk} {list(mask.shape)}", "all [B, T] tensors must share B and T")
    step = _scalar(name, d, STEP_KEYS)
    if step is None:
        raise MissingColumn(name, None, "no 'step' (or 'global_steps') scalar in the dump",
                            "add the trainer step: torch.save({..., 'step': step}, path)")
    run = d["run"] if isinstance(d.get("run"), str) else None
    b_idx, t_idx, cols = masked_token_columns(s, t, mask.bool(), step, run, d.get("responses"))
    b, pos = cols["sample"], cols["pos"]
    where = lambda i: f"sequence {int(b[i])} (batch row), token {int(pos[i])}"  # noqa: E731
    for key in ("sampler_version", "trainer_version"):
        v = _scalar(name, d, (key,))
        if v is not None:
            cols[key] = np.full(len(b), v, dtype=np.int64)
    yield Batch("tokens", pa.table(cols), where)
    experts = {k: d[k] for k in ("sampler_experts", "trainer_experts") if k in d}
    if experts:
        yield routing_batch(name, b_idx, t_idx, step, experts, s.shape, run=cols.get("run"))


def masked_token_columns(s, t, trained, step: int, run: str | None = None, token_ids=None):
    """(b_idx, t_idx, token columns) for the positions where `trained` ([B, T] bool) is true.

    Padding is wherever the mask is false, whatever value it holds there (0.0, -9999, NaN): those values are
    never read. Log-probs are widened to float64 after selection."""
    import torch

    b_idx, t_idx = torch.nonzero(trained, as_tuple=True)
    cols: dict[str, Any] = {"step": np.full(len(b_idx), step, dtype=np.int64),
                            "sample": b_idx.numpy().astype(np.int64), "pos": t_idx.numpy().astype(np.int32),
                            "sampler_logprob": s[b_idx, t_idx].double().numpy(),
                            "trainer_logprob": t[b_idx, t_idx].double().numpy()}
    if run is not None:
        cols["run"] = np.full(len(b_idx), run, dtype=object)
    if isinstance(token_ids, torch.Tensor) and token_ids.shape == s.shape:
        cols["token_id"] = token_ids[b_idx, t_idx].numpy().astype(np.int64)
    return b_idx, t_idx, cols


def routing_batch(name: str, b_idx, t_idx, step: int, experts: dict, bt_shape, run=None) -> Batch:
    """Routing rows for the masked tokens from [B, T, L, K] expert tensors (token-aligned)."""
    import torch

    if "sampler_experts" not in experts:
        raise MissingColumn(name, None, "'trainer_experts' given without 'sampler_experts'",
                            "routing needs the sampler's experts")
    mats = {}
    for k, v in experts.items():
        if not isinstance(v, torch.Tensor) or v.ndim != 4 or tuple(v.shape[:2]) != tuple(bt_shape):
            raise LengthMismatch(name, f"key '{k}'", f"expected [B, T, L, K] = [{bt_shape[0]}, {bt_shape[1]}, L, K], "
                                 f"got {list(getattr(v, 'shape', []))}", "index experts [sequence][token][layer][rank]")
        if v.dtype.is_floating_point:
            raise WrongType(name, f"key '{k}'", f"expert ids must be integers, got {v.dtype}", "store int ids")
        mats[k] = v[b_idx, t_idx].to(torch.int32).numpy()  # (n, L, K)
    S = mats["sampler_experts"]
    if "trainer_experts" in mats and mats["trainer_experts"].shape != S.shape:
        raise LengthMismatch(name, None, f"trainer_experts has [L, K] {list(mats['trainer_experts'].shape[1:])}, "
                             f"sampler_experts {list(S.shape[1:])}", "both sides need the same layers and k")
    L = S.shape[1]
    keys: dict[str, Any] = {"step": np.full(len(S), step, dtype=np.int64),
                            "sample": b_idx.numpy().astype(np.int64), "pos": t_idx.numpy().astype(np.int32)}
    if run is not None:
        keys["run"] = run
    cols = routing_columns(keys, S, mats.get("trainer_experts"))
    b, p = cols["sample"], cols["pos"]
    return Batch("routing", pa.table(cols), lambda i: f"sequence {int(b[i])} (batch row), token {int(p[i])}, "
                                                      f"layer {i % L}")

