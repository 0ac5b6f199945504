"""miles `--dump-details DIR` (radixark/miles, read at 31f1ca9; docs/FORMATS.md, "miles"):

    DIR/rollout_data/{id}.pt                   the rollout's samples: Sample.to_dict() each (miles/ray/rollout/
                                               debug_data.py:103-117; miles/utils/types.py:153-158)
    DIR/train_data/{id}_{rank}.pt              one rank's shard: {rollout_id, rank, rollout_data: columns, cp_rank,
                                               cp_size, qkv_format} (miles/utils/train_dump_utils.py:24-44)
    DIR/dashboard_columns/rollout_{id}.parquet the per-token rollout mirror, one row per sample in rollout order:
                                               sample_index, response_length, total_length, tokens, loss_mask,
                                               rollout_log_probs (debug_data.py:36-72)

One load unit per rollout id, joined as miles' own dashboard joins them (miles/dashboard/dump_reader.py:335-372):
train rows by `sample_indices`, the first rank holding a field answering for it (tensor-parallel ranks hold
copies, pipeline stages only some fields). step = rollout id; sample = Sample.index; pos = response token index j
of the tokens with loss_mask != 0; token_id = tokens[prompt + j]. Sampler log-probs: the parquet mirror's (it must
agree with the train shard's `rollout_log_probs` where both exist), else the shard's, else the rollout dump's.
Trainer log-probs: the shard's `log_probs`; entropy: its `entropy` (`--use-rollout-entropy`).
sampler_version = the oldest numeric weight version of the sample; trainer_version = the rollout id, so that their
difference is miles' own per-sample staleness (dump_reader.py:628-630). Sequences: reward (the sample's own
`reward`, else the batch-global `raw_reward` at its rollout position: dump_reader.py:340-356), advantage (mean over
trained tokens), prompt and response text from the rollout dump. Context-parallel shards (cp_size > 1) are refused.
"""
from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq

from analysis.ingest.detect import Detected
from analysis.ingest.errors import BadValue, CorruptFile, LengthMismatch, MissingColumn, WrongType
from analysis.ingest.frameworks.common import Columns, flush, need_dict
from analysis.ingest.limits import Limits
from analysis.ingest.tensors import load_tensors
from analysis.ingest.units import Unit
from analysis.ingest.validate import Batch, as_int

FORMAT = "miles"
_ROLLOUT = re.compile(r"(eval_)?(\d+)\.pt")
_TRAIN = re.compile(r"(\d+)_(\d+)\.pt")
_COLUMNS = re.compile(r"rollout_(eval_)?(\d+)\.parquet")
COLUMN_NAMES = ("sample_index", "response_length", "total_length", "tokens", "loss_mask", "rollout_log_probs")
# folders of a dump that hold no log rows to load: the tokenizer and processor (rollout/data_source.py:66-70),
# telemetry and the dashboard's caches (dashboard/args.py:95), conversations, audit events (arguments.py:3187), and
# the per-micro-batch loss dumps, which carry no step or sample id (backends/training_utils/debug_dump.py:24-60)
OTHER_DIRS = ("tokenizer", "processor", "dashboard", "trajectory", "events", "policy_loss_debug")
CONVERT = ('convert it once, in your own trusted environment: python -c "import sys,torch,numpy as np; '
           "d=torch.load(sys.argv[1],weights_only=False); [s.update({k:torch.as_tensor(v) for k,v in s.items() "
           'if isinstance(v,np.ndarray)}) for s in d[\'samples\']]; torch.save(d,sys.argv[2])" in.pt out.pt')
LOAD_FOLDER = "load the whole --dump-details folder (or a zip of it): the unit of a miles dump is one rollout id"


def is_dump(folder: Path) -> bool:
    """A miles dump folder: per-rank train dumps ({id}_{rank}.pt) or the dashboard's parquet mirror."""
    return any(_TRAIN.fullmatch(f.name) for f in (folder / "train_data").glob("*.pt")) \
        or any(_COLUMNS.fullmatch(f.name) for f in (folder / "dashboard_columns").glob("*.parquet"))


def _dump_dirs(path: Path) -> list[Path]:
    if path.name in ("rollout_data", "train_data", "dashboard_columns"):
        path = path.parent
    found = {path} | {d.parent for name in ("train_data", "dashboard_columns") for d in path.rglob(name) if d.is_dir()}
    return sorted(d for d in found if is_dump(d))


def adapter(path: Path, limits: Limits) -> tuple[list[Unit], set[Path]]:
    """One unit per rollout id of each dump folder; the run defaults to the dump folder's name."""
    if not path.is_dir():
        return [], set()
    units, claimed = [], set()
    for dump in _dump_dirs(path):
        ids: dict[int, dict[str, Any]] = {}
        for sub, pattern in (("rollout_data", _ROLLOUT), ("train_data", _TRAIN), ("dashboard_columns", _COLUMNS)):
            for f in sorted((dump / sub).iterdir()) if (dump / sub).is_dir() else []:
                m = pattern.fullmatch(f.name)
                if not m or not f.is_file():
                    continue
                claimed.add(f)
                if sub == "train_data":
                    ids.setdefault(int(m.group(1)), {}).setdefault("train", []).append((int(m.group(2)), f))
                elif m.group(1):  # eval_{id}: no trainer side
                    units.append(Unit(str(f.relative_to(path.parent)), [f], Detected(FORMAT, "mixed"), _nothing,
                                      skip="evaluation rollout (no trainer side): not loaded"))
                else:
                    ids.setdefault(int(m.group(2)), {})[sub] = f
        for sub in OTHER_DIRS:
            if (dump / sub).is_dir():
                claimed |= {f for f in (dump / sub).rglob("*") if f.is_file()}
        for rid in sorted(ids):
            files = ids[rid]
            ranks = sorted(files.get("train", []))
            train = [f for _, f in ranks]
            paths = [files[k] for k in ("dashboard_columns", "rollout_data") if k in files] + train
            name = f"{dump.relative_to(path.parent)}/{{rollout_data,train_data,dashboard_columns}}/{rid}"
            skip = None
            missing = sorted(set(range(ranks[-1][0] + 1)) - {r for r, _ in ranks}) if ranks else []
            if not train:
                skip = (f"no train_data/{rid}_<rank>.pt beside the rollout of id {rid}: the trainer's log-probs are "
                        "written after its update; load the folder again once they exist")
            elif missing:  # every rank writes its shard: a gap is a file not (yet) there, and its samples with it
                skip = (f"train_data/{rid}_{missing[0]}.pt is missing (ranks {', '.join(str(r) for r, _ in ranks)} "
                        "are there): its samples' trainer log-probs would be absent; load the folder again once "
                        "every rank's file exists")
            units.append(Unit(name, paths, Detected(FORMAT, "mixed"),
                              partial(_read_unit, rid=rid, run=dump.name, train=train,
                                      rollout=files.get("rollout_data"), columns=files.get("dashboard_columns")),
                              {"framework": "miles"}, skip=skip))
    return units, claimed


def _nothing(unit, limits) -> Iterator[Batch]:
    return iter(())


# -- files found alone, by content ----------------------------------------------------------------------
def lone_columns(unit: Unit, limits: Limits) -> Iterator[Batch]:
    """A dashboard_columns parquet without its folder: the sampler's side only."""
    raise MissingColumn(unit.name, None, "a miles dashboard_columns file holds the sampler's log-probs only "
                        "(rollout_log_probs); the trainer's are in train_data/{id}_{rank}.pt beside it", LOAD_FOLDER)
    yield  # pragma: no cover - a generator, like every reader


def is_train_dump(d: Any) -> bool:
    """A miles per-rank train dump (train_dump_utils.py:34-44), as the generic tensor reader loads it."""
    return isinstance(d, dict) and isinstance(d.get("rollout_data"), dict) and "rollout_id" in d and "rank" in d


def lone_train_dump(name: str, d: dict) -> Iterator[Batch]:
    raise MissingColumn(name, None, "a miles train_data/{id}_{rank}.pt without its folder: one rank's shard, "
                        "whose samples other ranks repeat (tensor parallelism) and whose prompt, response and "
                        "reward are in rollout_data/{id}.pt", LOAD_FOLDER)
    yield  # pragma: no cover


# -- reading a unit ------------------------------------------------------------------------------------
def _np(v: Any) -> np.ndarray:
    return v.numpy() if hasattr(v, "numpy") else np.asarray(v)


def _min_version(versions: Any) -> int | None:
    """The oldest numeric weight version (dump_reader.py:48-50; "default" and the like are not versions)."""
    if not isinstance(versions, (list, tuple)):
        return None
    ints = [int(v) for v in versions if str(v).isdigit()]
    return min(ints) if ints else None


def _text(v: Any) -> str | None:
    if isinstance(v, str):
        return v or None
    if isinstance(v, list):  # a chat prompt: its messages as JSON, as the framework keeps them
        return json.dumps(v, ensure_ascii=False, default=str)
    return None


def _train_shards(name: str, rid: int, train: list[Path], limits: Limits) -> tuple[list[dict], list[str]]:
    shards, labels = [], []
    for f in train:
        label = f"train_data/{f.name}"
        pack = need_dict(load_tensors(f, name, limits, where=label, pickle_fix=CONVERT), name, label,
                         "a miles train dump is a dict with 'rollout_data'")
        cols = pack.get("rollout_data")
        if not isinstance(cols, dict):
            raise MissingColumn(name, label, "no 'rollout_data' dict of columns", "use miles' train dump unchanged")
        if as_int(pack.get("rollout_id", rid)) != rid:
            raise BadValue(name, label, f"holds rollout {pack.get('rollout_id')!r}, its name says {rid}",
                           "keep the dump's files as miles wrote them")
        cp = as_int(pack.get("cp_size", 1))
        if cp is not None and cp > 1:
            raise BadValue(name, label, f"context-parallel shard (cp_size {cp}): each rank holds a slice of every "
                           "sequence's log-probs, which this importer does not reassemble",
                           "dump from a run with context parallelism 1, or export the joined log-probs as a table")
        for key in ("sample_indices", "response_lengths", "loss_masks"):
            if key not in cols:
                raise MissingColumn(name, label, f"'{key}' is missing", "use miles' train dump unchanged")
        shards.append(cols)
        labels.append(label)
    return shards, labels


def _field(shards: list[dict], locations: list[tuple[int, int]], key: str) -> tuple[Any, int | None]:
    """The first holder's value of a per-sample field (dump_reader.py:233-282: PP stages hold some fields, TP peers
    copies), and which shard gave it."""
    for shard, row in locations:
        col = shards[shard].get(key)
        if col is not None and row < len(col) and col[row] is not None:
            return col[row], shard
    return None, None


def _columns_table(name: str, path: Path) -> dict[int, tuple[int, dict]]:
    """{sample_index: (row = rollout position, row's values)} of a dashboard_columns parquet."""
    label = f"dashboard_columns/{path.name}"
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise CorruptFile(name, label, f"Parquet cannot be read ({e})", "the file is truncated; dump it again") \
            from None
    missing = [c for c in COLUMN_NAMES if c not in table.column_names]
    if missing:
        raise MissingColumn(name, label, f"columns {missing} are missing", "use miles' dashboard_columns unchanged")
    out = {}
    for i, row in enumerate(table.select(list(COLUMN_NAMES)).to_pylist()):
        out[int(row["sample_index"])] = (i, row)
    return out


def _read_unit(unit: Unit, limits: Limits, rid: int, run: str | None, train: list[Path], rollout: Path | None,
               columns: Path | None) -> Iterator[Batch]:
    name = unit.name
    shards, labels = _train_shards(name, rid, train, limits)
    mirror = _columns_table(name, columns) if columns is not None else {}
    samples: dict[int, tuple[int, dict]] = {}
    if rollout is not None:
        pack = need_dict(load_tensors(rollout, name, limits, where=f"rollout_data/{rollout.name}", pickle_fix=CONVERT),
                         name, f"rollout_data/{rollout.name}", "a miles rollout dump is a dict with 'samples'")
        if as_int(pack.get("rollout_id", rid)) != rid:
            raise BadValue(name, f"rollout_data/{rollout.name}", f"holds rollout {pack.get('rollout_id')!r}",
                           "keep the dump's files as miles wrote them")
        for i, s in enumerate(pack.get("samples") or []):
            if isinstance(s, dict) and as_int(s.get("index")) is not None:
                samples[as_int(s["index"])] = (i, s)
    index: dict[int, list[tuple[int, int]]] = {}
    for k, cols in enumerate(shards):
        for row, si in enumerate(_np(cols["sample_indices"]).reshape(-1).tolist()):
            index.setdefault(int(si), []).append((k, row))
    tokens, seqs = Columns("tokens"), Columns("sequences")
    for si in sorted(index):
        _sample(name, labels, shards, index[si], si, rid, run, mirror.get(si), samples.get(si), tokens, seqs)
        if tokens.rows >= limits.batch_rows:
            yield from flush(tokens, seqs)
    yield from flush(tokens, seqs)


def _per_token(name: str, where: str, key: str, v: Any, R: int) -> np.ndarray:
    x = _np(v).astype(np.float64).reshape(-1)
    if len(x) != R:
        raise LengthMismatch(name, where, f"'{key}' has {len(x)} values, response_lengths is {R}",
                             "every per-token column has one value per response token")
    return x


def _sample(name, labels, shards, locations, si, rid, run, mirror, rollout, tokens: Columns, seqs: Columns) -> None:
    where = f"{labels[locations[0][0]]} sample_index {si}"
    R = as_int(_field(shards, locations, "response_lengths")[0])
    if R is None or R <= 0:
        raise WrongType(name, where, f"response_lengths is {_field(shards, locations, 'response_lengths')[0]!r}",
                        "use miles' train dump unchanged")
    mask = _np(_field(shards, locations, "loss_masks")[0]).reshape(-1)
    if len(mask) != R:
        raise LengthMismatch(name, where, f"'loss_masks' has {len(mask)} values, response_lengths is {R}",
                             "use miles' train dump unchanged")
    j = np.flatnonzero(mask != 0)
    if not len(j):
        return  # a removed sample: all-zero loss mask, trained on nothing
    lp, holder = _field(shards, locations, "log_probs")
    if lp is None:
        raise MissingColumn(name, where, "no rank holds 'log_probs' (the trainer's log-probs) for this sample",
                            "dump with the train data of every pipeline stage (--dump-details writes them)")
    t = _per_token(name, f"{labels[holder]} sample_index {si}", "log_probs", lp, R)
    shard_s, s_holder = _field(shards, locations, "rollout_log_probs")
    s = None
    if mirror is not None:
        row = mirror[1]
        if as_int(row["response_length"]) != R:
            raise LengthMismatch(name, f"dashboard_columns row {mirror[0]} (sample_index {si})",
                                 f"response_length {row['response_length']} but the train dump says {R}",
                                 "keep the dump's files of one run together")
        if row["rollout_log_probs"] is not None:
            s = _per_token(name, f"dashboard_columns row {mirror[0]} (sample_index {si})", "rollout_log_probs",
                           row["rollout_log_probs"], R)
            if shard_s is not None:
                other = _per_token(name, f"{labels[s_holder]} sample_index {si}", "rollout_log_probs", shard_s, R)
                if not np.array_equal(np.float32(s), np.float32(other)):
                    k = int(np.flatnonzero(np.float32(s) != np.float32(other))[0])
                    raise BadValue(name, f"sample_index {si}, response token {k}", f"the sampler's log-prob is "
                                   f"{s[k]!r} in dashboard_columns but {other[k]!r} in {labels[s_holder]}",
                                   "the files must come from one dump of one run")
    if s is None and shard_s is not None:
        s = _per_token(name, f"{labels[s_holder]} sample_index {si}", "rollout_log_probs", shard_s, R)
    if s is None and rollout is not None and rollout[1].get("rollout_log_probs") is not None:
        s = _per_token(name, f"rollout_data sample {rollout[0]}", "rollout_log_probs",
                       rollout[1]["rollout_log_probs"], R)
    if s is None:
        raise MissingColumn(name, where, "no sampler log-probs ('rollout_log_probs') in dashboard_columns, train_data "
                            "or rollout_data", "miles keeps them when the rollout returns log-probs (the default)")
    ids, _ = _field(shards, locations, "tokens")
    if ids is None and mirror is not None:
        ids = mirror[1]["tokens"]
    ids = None if ids is None else _np(ids).reshape(-1)
    cols: dict[str, Any] = {"step": np.full(len(j), rid, np.int64), "sample": np.full(len(j), si, np.int64),
                            "pos": j.astype(np.int32), "sampler_logprob": s[j], "trainer_logprob": t[j]}
    if run is not None:
        cols["run"] = np.full(len(j), run, dtype=object)
    if ids is not None:
        if len(ids) < R:
            raise LengthMismatch(name, where, f"'tokens' has {len(ids)} ids, fewer than the {R} response tokens",
                                 "use miles' dump unchanged")
        cols["token_id"] = ids[len(ids) - R + j].astype(np.int64)
    ent, e_holder = _field(shards, locations, "entropy")
    if ent is not None:
        cols["trainer_entropy"] = _per_token(name, f"{labels[e_holder]} sample_index {si}", "entropy", ent, R)[j]
    versions = _field(shards, locations, "weight_versions")[0]
    if versions is None and rollout is not None:
        versions = rollout[1].get("weight_versions")
    version = _min_version(versions)
    if version is not None:
        cols["sampler_version"] = np.full(len(j), version, np.int64)
        cols["trainer_version"] = np.full(len(j), rid, np.int64)
    tokens.add(cols, lambda i, j=j: f"{where}, response token {int(j[i])}")

    seq: dict[str, Any] = {"step": [rid], "sample": [si], "response_length": [R]}
    if run is not None:
        seq["run"] = [run]
    reward = rollout[1].get("reward") if rollout is not None else None
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        raw, _ = _raw_reward(shards, rollout[0] if rollout is not None else mirror[0] if mirror is not None else None)
        reward = raw
    if isinstance(reward, (int, float)) and not isinstance(reward, bool) and np.isfinite(reward):
        seq["reward"] = [float(reward)]
    adv, a_holder = _field(shards, locations, "advantages")
    if adv is not None:
        seq["advantage"] = [float(_per_token(name, f"{labels[a_holder]} sample_index {si}", "advantages", adv, R)[j]
                                  .mean())]
    if rollout is not None:
        for key in ("prompt", "response"):
            text = _text(rollout[1].get(key))
            if text is not None:
                seq[key] = [text]
    seqs.add(seq, lambda i: where)


def _raw_reward(shards: list[dict], position: int | None) -> tuple[float | None, int | None]:
    """The batch-global `raw_reward` at a sample's rollout position (dump_reader.py:340-356)."""
    if position is None:
        return None, None
    for k, cols in enumerate(shards):
        raw = cols.get("raw_reward")
        if raw is not None and position < len(raw):
            v = raw[position]
            v = v.item() if hasattr(v, "item") else v
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v), k
    return None, None
