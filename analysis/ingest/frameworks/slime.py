"""slime `--dump-details DIR`: rollout_data/{id}.pt (sampler, routing) joined with train_data/{id}.pt
(trainer log-probs, loss masks) by `rollout_position` (FORMATS.md, section 2).

One load unit per rollout id; step = rollout id; sample = rollout_position; pos = response token index j.
Routing of response token j is rollout-dump row P + j - 1 (P = total_lengths - response_lengths).
"""
from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from analysis.ingest.detect import Detected
from analysis.ingest.errors import BadValue, LengthMismatch, MissingColumn, WrongType
from analysis.ingest.frameworks import miles
from analysis.ingest.frameworks.common import Columns, flush, need_dict, routing_part, scalar_config
from analysis.ingest.limits import Limits
from analysis.ingest.tensors import load_tensors
from analysis.ingest.units import Unit
from analysis.ingest.validate import Batch, as_int

FORMAT = "slime"
_ID = re.compile(r"(eval_)?(\d+)\.pt")
# slime from 7551dc6 (2025-11-13) to b9b122c (2026-06-21) stored rollout_routed_experts as numpy arrays.
CONVERT = ('convert it once, in your own trusted environment: python -c "import sys,torch,numpy as np; '
           "d=torch.load(sys.argv[1],weights_only=False); [s.update({k:torch.as_tensor(v) for k,v in s.items() "
           'if isinstance(v,np.ndarray)}) for s in d[\'samples\']]; torch.save(d,sys.argv[2])" in.pt out.pt')
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def _dump_dirs(path: Path) -> list[Path]:
    if path.name in ("rollout_data", "train_data"):
        path = path.parent
    found = {path} | {d.parent for name in ("rollout_data", "train_data") for d in path.rglob(name) if d.is_dir()}
    return sorted(d for d in found if any((d / sub).is_dir() and any((d / sub).glob("*.pt"))
                                          for sub in ("rollout_data", "train_data")) and not miles.is_dump(d))


def adapter(path: Path, limits: Limits) -> tuple[list[Unit], set[Path]]:
    """One unit per rollout id of each dump folder; the run defaults to the dump folder's name."""
    if not path.is_dir():
        return [], set()
    units, claimed = [], set()
    for dump in _dump_dirs(path):
        ids: dict[int, dict[str, Path]] = {}
        for sub in ("rollout_data", "train_data"):
            for f in sorted((dump / sub).glob("*.pt")) if (dump / sub).is_dir() else []:
                m = _ID.fullmatch(f.name)
                if not m:
                    continue  # not slime's {rollout_id}.pt: left to the file-by-file scan
                claimed.add(f)
                if m.group(1):  # eval_{id}.pt: no trainer side, and not step {id}
                    units.append(Unit(str(f.relative_to(path.parent)), [f], Detected(FORMAT, "mixed"), _nothing,
                                      skip="evaluation rollout (no trainer side): not loaded"))
                    continue
                ids.setdefault(int(m.group(2)), {})[sub] = f
        # slime saves the tokenizer beside the dumps; it is not a log file
        claimed |= {f for f in (dump / "tokenizer").rglob("*") if f.is_file()} if (dump / "tokenizer").is_dir() else set()
        for rid in sorted(ids):
            files = ids[rid]
            name = f"{dump.relative_to(path.parent)}/{{rollout_data,train_data}}/{rid}.pt"
            paths = [files[k] for k in ("rollout_data", "train_data") if k in files]
            skip = None
            if "train_data" not in files:
                skip = (f"no train_data/{rid}.pt beside rollout_data/{rid}.pt: the trainer log-probs are written "
                        "after the update of this rollout; load the folder again once it exists")
            units.append(Unit(name, paths, Detected(FORMAT, "mixed"),
                              partial(_read_unit, dump=dump, rid=rid, run=dump.name), {"framework": "slime"},
                              skip=skip))
    return units, claimed


def _nothing(unit, limits) -> Iterator[Batch]:
    return iter(())


def _samples(obj: Any, name: str, where: str) -> list:
    d = need_dict(obj, name, where, "a slime dump is a dict with a 'samples' list")
    samples = d.get("samples")
    if not isinstance(samples, list):
        raise MissingColumn(name, where, "no 'samples' list in the dump", "pass the folder given to --dump-details")
    return samples


def _weight_version(versions: Any) -> int | None:
    """The oldest policy version the sampler used for this sample (one version per generate call)."""
    try:
        ints = [int(v) for v in versions or []]
    except (TypeError, ValueError):
        return None  # e.g. SGLang's "default" before the first weight update
    return min(ints) if ints else None


def _np(v: Any) -> np.ndarray:
    return v.numpy() if hasattr(v, "numpy") else np.asarray(v)


def _read_unit(unit, limits: Limits, dump: Path, rid: int, run: str | None) -> Iterator[Batch]:
    name = unit.name
    train_path = dump / "train_data" / f"{rid}.pt"
    rollout_path = dump / "rollout_data" / f"{rid}.pt"
    train_where = f"train_data/{rid}.pt"
    train_obj = load_tensors(train_path, name, limits, where=train_path.name)
    train = _samples(train_obj, name, train_where)
    step = as_int(train_obj.get("rollout_id", rid))
    if step is None or step < 0:
        raise WrongType(name, train_where, f"'rollout_id' must be an int >= 0, got {train_obj.get('rollout_id')!r}",
                        "use slime's dump unchanged")
    rollout: list | None = None
    if rollout_path.is_file():
        rollout_obj = load_tensors(rollout_path, name, limits, where=rollout_path.name, pickle_fix=CONVERT)
        rollout = _samples(rollout_obj, name, f"rollout_data/{rid}.pt")
        if as_int(rollout_obj.get("rollout_id", step)) != step:
            raise BadValue(name, None, f"rollout_data/{rid}.pt holds rollout {rollout_obj.get('rollout_id')!r} but "
                           f"train_data/{rid}.pt holds rollout {step}", "keep the two dumps of one run together")
    config: dict = {"framework": "slime"}
    moe = _moe_layers(name, rollout) if rollout is not None else None
    if moe is not None and moe.any():
        config["routing"] = "sampler (rollout engine, rollout_routed_experts)"
        config["moe_layers"] = np.flatnonzero(moe).tolist()
    if rollout:
        meta = rollout[0].get("metadata") if isinstance(rollout[0], dict) else None
        if isinstance(meta, dict):
            config.update(scalar_config(meta, SAMPLING_KEYS))
            if isinstance(meta.get("sampling_params"), dict):
                config.update(scalar_config(meta["sampling_params"], SAMPLING_KEYS))

    tokens, routing, seqs = Columns("tokens"), Columns("routing"), Columns("sequences")
    for k, ts in enumerate(train):
        where = f"{train_where} sample {k}"
        ts = need_dict(ts, name, where, "train dump samples are dicts")
        _sample(name, where, ts, rollout, step, run, moe, tokens, routing, seqs)
        if tokens.rows + routing.rows >= limits.batch_rows:
            yield from flush(tokens, routing, seqs)
    yield from flush(tokens, routing, seqs)
    unit.config = config  # applied to new runs once the whole unit has loaded


def _moe_layers(name: str, rollout: list) -> np.ndarray | None:
    """Per layer: any non-zero expert id anywhere in the dump (dense layers are all-zero)."""
    seen = None
    shape = None
    for i, rs in enumerate(rollout):
        x = rs.get("rollout_routed_experts") if isinstance(rs, dict) else None
        if x is None:
            continue
        x = _np(x)
        if x.ndim != 3:
            raise LengthMismatch(name, f"rollout_data sample {i}", f"rollout_routed_experts has shape "
                                 f"{list(x.shape)}, expected [positions, layers, top_k]", "use slime's dump unchanged")
        if shape is not None and x.shape[1:] != shape:
            raise LengthMismatch(name, f"rollout_data sample {i}", f"rollout_routed_experts has [layers, top_k] = "
                                 f"{list(x.shape[1:])}, earlier samples {list(shape)}", "use slime's dump unchanged")
        shape = x.shape[1:]
        nz = (x != 0).any(axis=(0, 2))
        seen = nz if seen is None else seen | nz
    return seen


def _sample(name, where, ts, rollout, step, run, moe, tokens: Columns, routing: Columns, seqs: Columns) -> None:
    for key in ("loss_masks", "log_probs", "response_lengths", "total_lengths"):
        if key not in ts:
            raise MissingColumn(name, where, f"'{key}' is missing", "use the train dump of --dump-details "
                                "(--save-debug-train-data) from a current slime")
    mask = _np(ts["loss_masks"]).reshape(-1)
    trained = np.flatnonzero(mask != 0)
    if not len(trained):
        return  # removed sample (remove_sample=True): all-zero loss mask, trained on nothing
    R, total = as_int(ts["response_lengths"]), as_int(ts["total_lengths"])
    if R is None or total is None or not 0 < R <= total:
        raise WrongType(name, where, f"response_lengths {ts['response_lengths']!r} / total_lengths "
                        f"{ts['total_lengths']!r} are not lengths", "use slime's dump unchanged")
    P = total - R
    pos_r = as_int(ts.get("rollout_position"))
    rs = None
    if rollout is not None:
        if pos_r is None or not 0 <= pos_r < len(rollout):
            raise BadValue(name, where, f"rollout_position {pos_r!r} does not index the rollout dump's "
                           f"{len(rollout)} samples", "keep the two dumps of one rollout together")
        rs = need_dict(rollout[pos_r], name, f"rollout_data sample {pos_r}", "rollout samples are dicts")
    sample = pos_r if pos_r is not None else as_int(ts.get("sample_index"))
    if sample is None:
        raise MissingColumn(name, where, "no 'rollout_position' (nor 'sample_index') to identify the sample",
                            "use the train dump of a current slime (format_version 2)")
    t = _np(ts["log_probs"]).astype(np.float64).reshape(-1)
    s_src = ts.get("rollout_log_probs")
    if s_src is None and rs is not None:
        s_src = rs.get("rollout_log_probs")
    if s_src is None:
        raise MissingColumn(name, where, "no 'rollout_log_probs' (sampler log-probs) in either dump",
                            "slime keeps them when the rollout returns log-probs (the default)")
    s = np.asarray(_np(s_src), dtype=np.float64).reshape(-1)
    for key, v in (("loss_masks", mask), ("log_probs", t), ("rollout_log_probs", s)):
        if len(v) != R:
            raise LengthMismatch(name, where, f"'{key}' has {len(v)} values, response_lengths is {R}",
                                 "every train-dump per-token tensor has one value per response token")
    ids = _np(ts["tokens"]).reshape(-1) if "tokens" in ts else None
    if ids is not None and len(ids) != total:
        raise LengthMismatch(name, where, f"'tokens' has {len(ids)} ids, total_lengths is {total}",
                             "use slime's dump unchanged")
    if rs is not None and ids is not None and rs.get("tokens") is not None:
        r_ids = np.asarray(rs["tokens"]).reshape(-1)
        if len(r_ids) != total or not np.array_equal(r_ids, ids):
            raise BadValue(name, where, f"tokens differ from rollout_data sample {pos_r} (rollout_position)",
                           "the rollout and train dumps must come from the same rollout id of one run")
    j = trained
    w = lambda i, j=j: f"{where} (rollout_position {sample}), response token {int(j[i])}"  # noqa: E731
    cols: dict[str, Any] = {"step": np.full(len(j), step, dtype=np.int64), "sample": np.full(len(j), sample, np.int64),
                            "pos": j.astype(np.int32), "sampler_logprob": s[j], "trainer_logprob": t[j]}
    if run is not None:
        cols["run"] = np.full(len(j), run, dtype=object)
    if ids is not None:
        cols["token_id"] = ids[P + j].astype(np.int64)
    if "entropy" in ts and ts["entropy"] is not None and len(_np(ts["entropy"]).reshape(-1)) == R:
        cols["trainer_entropy"] = _np(ts["entropy"]).astype(np.float64).reshape(-1)[j]
    version = _weight_version(rs.get("weight_versions")) if rs is not None else None
    if version is not None:
        cols["sampler_version"] = np.full(len(j), version, dtype=np.int64)
    tokens.add(cols, w)

    x = rs.get("rollout_routed_experts") if rs is not None else None
    if x is not None and moe is not None and moe.any():
        x = _np(x)
        rows = P + j - 1  # routing of response token j: the engine's row for the last input before it
        if P < 1 or rows[-1] >= x.shape[0]:
            raise LengthMismatch(name, f"rollout_data sample {pos_r}", f"rollout_routed_experts has {x.shape[0]} "
                                 f"rows; response token {int(j[-1])} needs row {int(rows[-1])} (prompt {P} tokens)",
                                 "the engine returns one row per input position (len(tokens) - 1)")
        experts = x[rows][:, moe].astype(np.int32)
        part = routing_part(run, step, np.full(len(j), sample), j, experts)
        L = experts.shape[1]
        routing.add(part, lambda i, j=j, rows=rows: f"rollout_data sample {pos_r}, response token {int(j[i // L])} "
                    f"(routing row {int(rows[i // L])}), layer {i % L}")

    seq: dict[str, Any] = {"step": [step], "sample": [sample], "response_length": [R]}
    if run is not None:
        seq["run"] = [run]
    if rs is not None:
        reward = rs.get("reward")
        if isinstance(reward, (int, float)) and not isinstance(reward, bool):
            seq["reward"] = [float(reward)]
        if isinstance(rs.get("prompt"), str):
            seq["prompt"] = [rs["prompt"]]
    if ts.get("advantages") is not None:
        adv = _np(ts["advantages"]).astype(np.float64).reshape(-1)
        if len(adv) == R:
            seq["advantage"] = [float(adv[j].mean())]
    seqs.add(seq, lambda i: f"{where} (rollout_position {sample})")
