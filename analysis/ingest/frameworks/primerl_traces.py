"""prime-rl rollout traces with the trainer's annotations (FORMATS.md "2026-H2"; docs/FORMATS.md, "prime-rl traces").

    <output_dir>/rollouts/step_<n>/<kind>/<subset>/traces.jsonl      kind train|eval, subset all|effective

Written by prime-rl's file monitor (src/prime_rl/monitors/file.py:48-55 at 559b447), one line per episode:
verifiers' `Episode.to_record()` (verifiers/v1/episode.py:149-155 at a60a606) = {run: {work: {step, policy:
{start, end}}}, traces: [{agent: {trainable}, ok, rewards: {name: {score, weight} | null}, nodes: [...]}], ...}.
A node (verifiers/v1/graph.py:64-133) adds `token_ids` to its branch, `mask` (True = sampled, trained) parallel to
them, and `logprobs`, the sampler's log-probs of the sampled tokens only ("compact": len = sum(mask)); `advantages`
has the same compact layout. A branch is the path from a root to a leaf (trace.py:450-469); each is one sample.

The trainer's annotations (prime-rl #3444, verifiers #2481, after the commits read here) are read from each node as
`trainer_logprobs`, `entropies`, `mismatch_kl` (rounded to 6 decimals: the file's precision floor is 1e-6) and
`is_masked`, in the compact layout of `logprobs` (or, accepted too, one value per token_id).

step = the `step_<n>` folder (the batch that trained it: orchestrator.py:684), else `run.work.step` (the step the
episode was dispatched at) for a file loaded alone; sample = episode line index * SAMPLE_STRIDE + the index of the
(trace, branch) among the episode's trained ones; pos = index of the token among its branch's sampled tokens.
sampler_version = run.work.policy.start, the oldest policy that generated it; trainer_version = step - 1, the
version batch `step` trains on (prime_rl/orchestrator/utils.py:57-70). Traces that did not train (an error, an
agent marked not trainable: orchestrator/algo/base.py:35-42) give no rows. `is_masked` has no column and is not kept.
"""
from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from analysis.ingest.detect import Detected
from analysis.ingest.errors import BadValue, LengthMismatch, MissingColumn, WrongType
from analysis.ingest.frameworks.common import Columns, flush, json_records
from analysis.ingest.limits import Limits
from analysis.ingest.textio import open_text
from analysis.ingest.units import Unit
from analysis.ingest.validate import Batch, as_int

FORMAT = "prime-rl-traces"
ROLLOUTS = "rollouts"
TRACE_FILE = re.compile(r"traces\.jsonl(\.gz)?")
_STEP_DIR = re.compile(r"step_(\d+)")
SAMPLE_STRIDE = 1000  # trained (trace, branch) pairs of one episode; sample 3002 = episode 3, its third pair
KL_DECIMALS = 6  # prime-rl rounds mismatch_kl to 6 decimals (FORMATS.md, #3525)
KL_FLOOR = 10.0 ** -KL_DECIMALS
ANNOTATIONS = ("trainer_logprobs", "entropies", "mismatch_kl", "is_masked")


def looks_like(obj: dict) -> bool:
    """Whether a JSON record is a verifiers episode (detect.py's test on a file's first line)."""
    return isinstance(obj.get("traces"), list) and "task" in obj


# -- the folder layout ---------------------------------------------------------------------------------
def _rollout_dirs(path: Path) -> list[Path]:
    if path.name == ROLLOUTS:
        return [path]
    return sorted(d for d in path.rglob(ROLLOUTS) if d.is_dir())


def adapter(path: Path, limits: Limits) -> tuple[list[Unit], set[Path]]:
    """One unit per step: its `train/effective` traces (the batch it trained on). The step's other trace files
    are claimed and reported as skipped: `train/all` repeats the effective episodes with the filtered ones,
    `eval/*` never trained."""
    if not path.is_dir():
        return [], set()
    units: list[Unit] = []
    claimed: set[Path] = set()
    base = path.parent
    for rollouts in _rollout_dirs(path):
        output_dir = rollouts.parent
        run = output_dir.name or None
        metrics = output_dir / "metrics.jsonl"  # prime-rl's metric sink (monitors/file.py:25-41): not a log
        if metrics.is_file():
            claimed.add(metrics)
        steps = [d for d in rollouts.iterdir() if d.is_dir() and _STEP_DIR.fullmatch(d.name)]
        for d in sorted(steps, key=lambda d: int(d.name[5:])):
            step = int(d.name[5:])
            files = sorted(f for f in d.rglob("*") if f.is_file() and TRACE_FILE.fullmatch(f.name))
            claimed |= set(files)
            effective = [f for f in files if f.parent.parent.name == "train" and f.parent.name == "effective"]
            for f in files:
                rel = str(f.relative_to(base))
                if f in effective:
                    units.append(Unit(rel, [f], Detected(FORMAT, "mixed"), partial(read_unit, run=run, step=step),
                                      {"framework": "prime-rl"}))
                    continue
                kind, subset = f.parent.parent.name, f.parent.name
                if kind == "eval":
                    why = "evaluation episodes (no trainer side): not loaded"
                elif effective:
                    why = "the step's train/effective traces are loaded; train/all repeats them with the filtered ones"
                else:
                    why = (f"{d.name} has no train/effective/traces.jsonl yet: the batch is not finalised; load the "
                           "folder again once it exists")
                units.append(Unit(rel, [f], Detected(FORMAT, "mixed"), _nothing, skip=f"{kind}/{subset}: {why}"))
    return units, claimed


def _place(path: Path, run: str | None) -> tuple[str | None, int | None]:
    """(run, step) from a traces file's path in prime-rl's layout, else (run, None)."""
    parts = path.parts
    if len(parts) >= 5 and parts[-5] == ROLLOUTS and _STEP_DIR.fullmatch(parts[-4]):
        return run or (path.parents[4].name or None), int(parts[-4][5:])
    return run, None


def _nothing(unit, limits) -> Iterator[Batch]:
    return iter(())


# -- reading -------------------------------------------------------------------------------------------
def read_unit(unit: Unit, limits: Limits, run: str | None = None, step: int | None = None) -> Iterator[Batch]:
    """Reader of one traces file (READERS['prime-rl-traces'] for a file found by content, without its folder)."""
    path = unit.paths[0]
    if step is None:  # a file given alone: its folders may still say which run and step
        run, step = _place(path, run)
    tokens, seqs = Columns("tokens"), Columns("sequences")
    found = {"kl": 0}  # nodes with a mismatch_kl: the file's floor is prime-rl's rounding
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        fp = open_text(raw, unit.name, limits, gz)
        for episode, (where, rec) in enumerate(json_records(fp, unit.name, limits)):
            _episode(unit.name, where, rec, episode, run, step, tokens, seqs, found)
            if tokens.rows >= limits.batch_rows:
                yield from flush(tokens, seqs)
    if found["kl"]:
        unit.precision_floor = KL_FLOOR
    yield from flush(tokens, seqs)


def _need(name: str, where: str, obj: Any, kind: type, what: str, fix: str) -> Any:
    if not isinstance(obj, kind):
        raise WrongType(name, where, f"{what} must be a {kind.__name__}, got {type(obj).__name__}", fix)
    return obj


def _episode(name, where, rec, e, run, step, tokens: Columns, seqs: Columns, found: dict) -> None:
    fix = "use the traces.jsonl prime-rl writes (one verifiers Episode record per line)"
    _need(name, where, rec, dict, "a line", fix)
    traces = rec.get("traces")
    if not isinstance(traces, list):
        raise MissingColumn(name, where, "no 'traces' list: not a verifiers episode record", fix)
    work = (rec.get("run") or {}).get("work") if isinstance(rec.get("run"), dict) else None
    work = work if isinstance(work, dict) else {}
    trainer_version = None
    if step is None:
        step = as_int(work.get("step"))
        if step is None or step < 0:
            raise MissingColumn(name, where, f"no step: 'run.work.step' is {work.get('step')!r} and the file is not "
                                "in a rollouts/step_<n>/ folder", "load the run's output folder (or a zip of it)")
    elif step >= 1:
        trainer_version = step - 1
    policy = work.get("policy") if isinstance(work.get("policy"), dict) else None
    sampler_version = as_int(policy.get("start")) if policy else None
    k = 0
    for t, trace in enumerate(traces):
        tw = f"{where} trace {t}"
        _need(name, tw, trace, dict, "a trace", fix)
        agent = trace.get("agent") if isinstance(trace.get("agent"), dict) else {}
        if not trace.get("ok", False) or agent.get("trainable") is False:
            continue  # not trained (orchestrator/algo/base.py:35-42)
        nodes = _need(name, tw, trace.get("nodes", []), list, "'nodes'", fix)
        parts = [_node(name, f"{tw} node {i}", n, found) for i, n in enumerate(nodes)]
        reward = _reward(trace.get("rewards"))
        for b, path in enumerate(_branches(name, tw, nodes)):
            picked = [parts[i] for i in path if parts[i] is not None]
            if not picked:
                continue
            if k >= SAMPLE_STRIDE:
                raise BadValue(name, tw, f"more than {SAMPLE_STRIDE} trained branches in one episode: sample ids "
                               f"episode * {SAMPLE_STRIDE} + branch would collide", "split the episode")
            sample = e * SAMPLE_STRIDE + k
            k += 1
            _branch(name, f"{tw} branch {b}", run, step, sample, sampler_version, trainer_version, nodes, path,
                    picked, reward, tokens, seqs)


def _branches(name: str, where: str, nodes: list) -> list[list[int]]:
    """Root-to-leaf paths of node indices (a leaf: a node no other node names as its parent)."""
    parents = []
    for i, n in enumerate(nodes):
        p = n.get("parent") if isinstance(n, dict) else None
        if p is not None and (as_int(p) is None or not 0 <= as_int(p) < len(nodes) or as_int(p) == i):
            raise BadValue(name, f"{where} node {i}", f"'parent' {p!r} does not index another of the trace's "
                           f"{len(nodes)} nodes", "use the traces as prime-rl writes them")
        parents.append(None if p is None else as_int(p))
    has_child = {p for p in parents if p is not None}
    paths = []
    for leaf in (i for i in range(len(nodes)) if i not in has_child):
        path, seen, i = [], set(), leaf
        while i is not None:
            if i in seen:
                raise BadValue(name, f"{where} node {leaf}", "the 'parent' links form a cycle",
                               "use the traces as prime-rl writes them")
            seen.add(i)
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    return paths


def _numbers(name, where, key, values, n, allow_null=False) -> np.ndarray:
    bad = next((j for j, v in enumerate(values) if not (isinstance(v, (int, float)) and not isinstance(v, bool))
                and not (allow_null and v is None)), None)
    if bad is not None:
        raise BadValue(name, f"{where}, sampled token {bad}", f"'{key}' is {values[bad]!r}, not a number",
                       "every sampled token needs a finite value")
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64).reshape(n)


def _node(name: str, where: str, node: Any, found: dict) -> dict | None:
    """The sampled tokens of one node with their values; None for a node that adds no sampled token."""
    _need(name, where, node, dict, "a node", "use the traces as prime-rl writes them")
    ids, mask = node.get("token_ids", []), node.get("mask", [])
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise LengthMismatch(name, where, f"'mask' has {len(mask) if isinstance(mask, list) else mask!r} values, "
                             f"'token_ids' {len(ids) if isinstance(ids, list) else ids!r}",
                             "one mask flag per token id (verifiers MessageNode)")
    j = np.flatnonzero(np.fromiter((bool(m) for m in mask), dtype=bool, count=len(mask)))
    n = len(j)
    if not n:
        return None
    out: dict[str, Any] = {"token_id": np.array([ids[i] for i in j], dtype=np.int64)}

    def compact(key: str, required: bool, allow_null: bool = False) -> np.ndarray | None:
        values = node.get(key)
        if values is None:
            if required:
                raise MissingColumn(name, where, f"the node has {n} sampled tokens but no '{key}'",
                                    "every sampled node of a trained trace carries the sampler's 'logprobs' and the "
                                    "trainer's 'trainer_logprobs'")
            return None
        if not isinstance(values, list) or len(values) not in (n, len(ids)):
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise LengthMismatch(name, where, f"'{key}' has {got} values; the node has {n} sampled tokens of "
                                 f"{len(ids)}", "one value per sampled token (the layout of 'logprobs')")
        if len(values) != n:  # widened to every token id: keep the sampled ones
            values = [values[i] for i in j]
        return _numbers(name, where, key, values, n, allow_null)

    out["sampler_logprob"] = compact("logprobs", True)
    out["trainer_logprob"] = compact("trainer_logprobs", False)  # its absence is refused per branch (_branch)
    out["trainer_entropy"] = compact("entropies", False, allow_null=True)
    out["mismatch_kl"] = compact("mismatch_kl", False, allow_null=True)
    found["kl"] += out["mismatch_kl"] is not None
    out["advantage"] = compact("advantages", False, allow_null=True)
    out["text"] = _text((node.get("message") or {}).get("content")) if isinstance(node.get("message"), dict) else ""
    return out


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _reward(rewards: Any) -> float | None:
    """The trace's reward: Σ score · weight over the rewards that ran (verifiers/v1/trace.py:412-414)."""
    if not isinstance(rewards, dict):
        return None
    values = [r for r in rewards.values() if isinstance(r, dict) and isinstance(r.get("score"), (int, float))]
    if not values:
        return None
    return float(sum(float(r["score"]) * float(r.get("weight", 1.0)) for r in values))


def _branch(name, where, run, step, sample, sampler_version, trainer_version, nodes, path, picked, reward,
            tokens: Columns, seqs: Columns) -> None:
    if any(p["trainer_logprob"] is None for p in picked):
        missing = next(i for i in path if _sampled(nodes[i]) and nodes[i].get("trainer_logprobs") is None)
        raise MissingColumn(name, f"{where} node {missing}", "no trainer annotation: the node has sampled tokens and "
                            "the sampler's 'logprobs' but no 'trainer_logprobs'",
                            "load traces from a prime-rl that stamps the trainer's log-probs on them (#3444, "
                            "2026-08-31) once the trainer has written them, or its token exports "
                            "(trainer.enable_token_export)")
    n = sum(len(p["token_id"]) for p in picked)
    cat = lambda key: np.concatenate([p[key] for p in picked])  # noqa: E731
    cols: dict[str, Any] = {"step": np.full(n, step, dtype=np.int64), "sample": np.full(n, sample, dtype=np.int64),
                            "pos": np.arange(n, dtype=np.int32), "token_id": cat("token_id"),
                            "sampler_logprob": cat("sampler_logprob"), "trainer_logprob": cat("trainer_logprob")}
    if run is not None:
        cols["run"] = np.full(n, run, dtype=object)
    if any(p["trainer_entropy"] is not None for p in picked):
        ent = np.concatenate([p["trainer_entropy"] if p["trainer_entropy"] is not None
                              else np.full(len(p["token_id"]), np.nan) for p in picked])
        cols["trainer_entropy"] = pa.array(ent, pa.float64(), mask=np.isnan(ent))
    if sampler_version is not None:
        cols["sampler_version"] = np.full(n, sampler_version, dtype=np.int64)
    if trainer_version is not None:
        cols["trainer_version"] = np.full(n, trainer_version, dtype=np.int64)
    tokens.add(cols, lambda i, where=where: f"{where}, sampled token {i} (pos {i})")

    seq: dict[str, Any] = {"step": [step], "sample": [sample], "response_length": [n]}
    if run is not None:
        seq["run"] = [run]
    if reward is not None:
        seq["reward"] = [reward]
    adv = [p["advantage"] for p in picked if p["advantage"] is not None]
    if adv:
        a = np.concatenate(adv)
        a = a[np.isfinite(a)]
        if len(a):
            seq["advantage"] = [float(a.mean())]
    first = next(k for k, i in enumerate(path) if _sampled(nodes[i]))
    prompt = "\n\n".join(t for t in (_text(nodes[i].get("message", {}).get("content"))
                                     if isinstance(nodes[i].get("message"), dict) else "" for i in path[:first]) if t)
    if prompt:
        seq["prompt"] = [prompt]
    response = "\n\n".join(p["text"] for p in picked if p["text"])
    if response:
        seq["response"] = [response]
    seqs.add(seq, lambda i, where=where: where)


def _sampled(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("mask"), list) and any(node["mask"])
