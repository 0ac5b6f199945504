"""verl: one `.pt` (or `.safetensors`) per step with the batch's padded tensors (FORMATS.md, section 3).

    torch.save({**batch.batch, "global_steps": batch.meta_info["global_steps"]}, f"{dir}/step_{step}.pt")

Trained tokens are `response_mask == 1`; sample = batch row, pos = response position j. `routed_experts`
[B, P+R, L, K] is the rollout engine's routing (sampler side; trainer_experts stays NULL); response token j
reads column P + j - 1, the last input position before it, not the "response part" column P + j.
"""
from __future__ import annotations

import json
import struct
import zipfile
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from analysis.ingest.detect import Detected
from analysis.ingest.errors import BadValue, LengthMismatch, MissingColumn, WrongType
from analysis.ingest.frameworks.common import Columns, routing_part, scalar_config
from analysis.ingest.limits import Limits
from analysis.ingest.tensors import load_tensors, masked_token_columns
from analysis.ingest.units import Unit
from analysis.ingest.validate import Batch

FORMAT = "verl"
BATCH_KEYS = {"rollout_log_probs", "old_log_probs", "response_mask", "responses", "prompts", "input_ids",
              "attention_mask", "position_ids", "routed_experts", "advantages", "returns", "token_level_scores",
              "token_level_rewards", "ref_log_prob", "entropys", "global_steps", "step", "run", "meta_info"}
CONFIG_HINT = ("torch.save({**batch.batch, 'global_steps': batch.meta_info['global_steps']}, path) "
               "after old_log_probs is in the batch")


def is_verl_dict(d: Any) -> bool:
    """A verl batch dump: trainer `old_log_probs` plus verl's padded prompt or routing tensors."""
    return isinstance(d, dict) and "old_log_probs" in d and ("routed_experts" in d or "prompts" in d)


def sniff(path: Path) -> bool:
    """Cheap content check (no tensor is read): the dump's key names in a torch zip or safetensors header."""
    try:
        with open(path, "rb") as fp:
            head = fp.read(16)
            if head[:4] == b"PK\x03\x04":
                with zipfile.ZipFile(fp) as z:
                    pkl = next((m for m in z.namelist() if m.endswith("/data.pkl") or m == "data.pkl"), None)
                    if pkl is None or z.getinfo(pkl).file_size > 1 << 20:
                        return False
                    text = z.read(pkl)
                return b"old_log_probs" in text and (b"routed_experts" in text or b"prompts" in text)
            if len(head) >= 9 and head[8:9] == b"{":
                (n,) = struct.unpack("<Q", head[:8])
                if n > 100 << 20:
                    return False
                fp.seek(8)
                keys = json.loads(fp.read(n))
                return is_verl_dict(keys)
    except (OSError, zipfile.BadZipFile, ValueError, KeyError):
        return False
    return False


def adapter(path: Path, limits: Limits) -> tuple[list[Unit], set[Path]]:
    """Claim verl step dumps under a folder; the run defaults to the name of the folder holding each file."""
    if not path.is_dir():
        return [], set()
    units, claimed = [], set()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if f.parent.name in ("rollout_data", "train_data") or not sniff(f):
            continue  # slime's dump folders hold big pickled sample lists: not verl, not worth opening
        fmt = "safetensors" if f.suffix == ".safetensors" else "pt"
        units.append(Unit(str(f.relative_to(path.parent)), [f], Detected(FORMAT, "mixed"),
                          partial(_read_unit, fmt=fmt, run=f.parent.name), {"framework": "verl"}))
        claimed.add(f)
    return units, claimed


def _read_unit(unit, limits: Limits, fmt: str, run: str | None) -> Iterator[Batch]:
    d = load_tensors(unit.paths[0], unit.name, limits, fmt)
    if not is_verl_dict(d):
        raise WrongType(unit.name, None, "not a verl batch dump (needs 'old_log_probs' and 'prompts' or "
                        "'routed_experts')", CONFIG_HINT)
    config: dict = {"framework": "verl"}
    yield from dict_batches(unit.name, d, run=run, config=config)
    unit.config = config  # applied to new runs once the whole unit has loaded


def _tensor(name: str, d: dict, key: str, ndim: int):
    import torch
    v = d[key]
    if not isinstance(v, torch.Tensor) or v.ndim != ndim:
        raise WrongType(name, f"key '{key}'", f"expected a {ndim}-D tensor, got "
                        f"{list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}", CONFIG_HINT)
    return v


def _step(name: str, d: dict) -> int:
    import torch
    for key in ("global_steps", "step"):
        if key in d:
            v = d[key]
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int):
                raise WrongType(name, f"key '{key}'", f"expected an integer step, got {v!r}", CONFIG_HINT)
            return v
    raise MissingColumn(name, None, "no 'global_steps' in the dump", CONFIG_HINT)


def dict_batches(name: str, d: dict, run: str | None = None, config: dict | None = None) -> Iterator[Batch]:
    """Canonical batches from one verl step dump (already loaded); fills `config` with run context."""
    import torch

    for key, fix in (("rollout_log_probs", "set actor_rollout_ref.rollout.calculate_log_probs=True so the "
                      "sampler's log-probs are kept"), ("old_log_probs", CONFIG_HINT),
                     ("response_mask", "keep batch['response_mask'] in the dump")):
        if key not in d:
            raise MissingColumn(name, None, f"required tensor '{key}' is missing (keys found: "
                                f"{', '.join(sorted(map(str, d)))})", fix)
    s = _tensor(name, d, "rollout_log_probs", 2)
    t = _tensor(name, d, "old_log_probs", 2)
    mask = _tensor(name, d, "response_mask", 2)
    B, R = s.shape
    for key, v in (("old_log_probs", t), ("response_mask", mask)):
        if tuple(v.shape) != (B, R):
            raise LengthMismatch(name, f"key '{key}'", f"shape {list(v.shape)} differs from rollout_log_probs "
                                 f"{[B, R]}", "all response tensors are [batch, response_length]")
    step = _step(name, d)
    if isinstance(d.get("run"), str) and run is None:
        run = d["run"]
    full_width = next((d[k].shape[1] for k in ("attention_mask", "input_ids", "routed_experts")
                       if isinstance(d.get(k), torch.Tensor) and d[k].ndim >= 2), None)
    if isinstance(d.get("prompts"), torch.Tensor):
        P = int(_tensor(name, d, "prompts", 2).shape[1])
        if full_width is not None and full_width != P + R:
            raise LengthMismatch(name, None, f"prompts ({P} columns) + responses ({R}) != {full_width} columns of "
                                 "attention_mask/input_ids/routed_experts", "save the batch tensors unchanged")
    else:
        P = None if full_width is None else int(full_width) - R

    trained = mask == 1  # never from the log-prob values: 0.0 is both a real log-prob and verl's padding
    if isinstance(d.get("attention_mask"), torch.Tensor) and P is not None:
        am = _tensor(name, d, "attention_mask", 2)
        outside = trained & (am[:, P:] == 0)
        if outside.any():
            b, j = (int(x) for x in torch.nonzero(outside)[0])
            raise BadValue(name, f"sample {b}, response token {j}", "response_mask is 1 where attention_mask is 0 "
                           "(a padding position)", "save response_mask and attention_mask from the same batch")
    b_idx, j_idx, cols = masked_token_columns(s, t, trained, step, run, d.get("responses"))
    b, j = cols["sample"], cols["pos"]
    where = lambda i: f"sample {int(b[i])} (batch row), response token {int(j[i])}"  # noqa: E731
    tokens = Columns("tokens")
    tokens.add(cols, where)
    batch = tokens.flush()
    if batch is None:
        return  # no trained token in this step
    yield batch

    if "routed_experts" in d:
        yield from _routing(name, d, run, step, P, B, R, b_idx, j_idx, config)
    seq = _sequences(d, run, step, trained, P, B, R)
    if seq is not None:
        yield seq
    if config is not None:
        meta = d.get("meta_info") if isinstance(d.get("meta_info"), dict) else {}
        config.update(scalar_config(meta))
        config.update(scalar_config({k: v for k, v in d.items() if k not in BATCH_KEYS}))


def _routing(name, d, run, step, P, B, R, b_idx, j_idx, config) -> Iterator[Batch]:
    import torch

    re = _tensor(name, d, "routed_experts", 4)
    if re.dtype.is_floating_point or re.dtype == torch.bool:
        raise WrongType(name, "key 'routed_experts'", f"expert ids must be integers, got {re.dtype}",
                        "save the routed_experts tensor as verl returns it (int16/int32)")
    if P is None or re.shape[0] != B or re.shape[1] != P + R:
        raise LengthMismatch(name, "key 'routed_experts'", f"expected [{B}, prompt+response columns, layers, k], "
                             f"got {list(re.shape)}", "save routed_experts together with prompts and attention_mask")
    if P < 1:
        raise LengthMismatch(name, "key 'routed_experts'", "no prompt column: the first response token has no "
                             "routing row", "save the prompts tensor with the batch")
    # Dense layers are all-zero over the whole dump; zero is otherwise a valid expert id, so decide per layer.
    moe = (re != 0).any(dim=3).any(dim=1).any(dim=0).numpy()
    if not moe.any():
        return
    if config is not None:
        config["routing"] = "sampler (rollout engine, routed_experts)"
        config["moe_layers"] = np.flatnonzero(moe).tolist()
    rows = P - 1 + j_idx  # routing of response token j = last input position before it
    experts = re[b_idx, rows][:, torch.from_numpy(moe)].to(torch.int32).numpy()
    part = routing_part(run, step, b_idx.numpy(), j_idx.numpy(), experts)
    L = experts.shape[1]
    bb, jj = part["sample"], part["pos"]
    routing = Columns("routing")
    routing.add(part, lambda i: f"sample {int(bb[i])} (batch row), response token {int(jj[i])}, routing column "
                              f"{P - 1 + int(jj[i])}, layer {i % L}")
    batch = routing.flush()
    if batch is not None:
        yield batch


def _sequences(d, run, step, trained, P, B, R) -> Batch | None:
    import torch

    has = trained.any(dim=1)
    if not has.any():
        return None
    rows = torch.nonzero(has, as_tuple=True)[0]
    cols: dict[str, Any] = {"step": np.full(len(rows), step, dtype=np.int64), "sample": rows.numpy().astype(np.int64)}
    am = d.get("attention_mask")
    if isinstance(am, torch.Tensor) and P is not None and am.ndim == 2:
        cols["response_length"] = am[rows, P:].sum(dim=1).numpy().astype(np.int64)
    adv = d.get("advantages")
    if isinstance(adv, torch.Tensor) and tuple(adv.shape) == (B, R):
        m = trained[rows].double()
        cols["advantage"] = ((adv[rows].double() * m).sum(dim=1) / m.sum(dim=1)).numpy()
    if len(cols) == 2:
        return None
    if run is not None:
        cols["run"] = np.full(len(rows), run, dtype=object)
    seq = Columns("sequences")
    sample = cols["sample"]
    seq.add(cols, lambda i: f"sample {int(sample[i])} (batch row)")
    return seq.flush()
