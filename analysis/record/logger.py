"""DriftLogger: the few lines a trainer adds to write SCHEMA.md summaries and token rows, one set per step.

    logger = DriftLogger("drift_logs", run="bf16-baseline", config={"sampler_dtype": "bf16"}, token_sample=0.01)
    logger.log_step(step, rollout_log_probs, old_log_probs, response_mask, token_ids=responses,
                    sampler_experts=routed_experts, rewards=scores, advantages=advantages, prompts=prompt_texts,
                    responses=response_texts, tags=data_sources)

Writes `<out_dir>/<run>/summary-step000012.parquet` (every summary table, over every trained token; SCHEMA.md,
"Summary files"), `tokens-step000012.parquet` and `routing-step000012.parquet` (the rows of the tokens kept by
`token_sample`; none when it is 0) and `run.json`. The context (rewards, advantages, texts, tags, turns, the
sampler's support; analysis/record/context.py) goes with them: per sequence into the summary file, per token
into the token rows. Vectorised torch on the tensors' own device (no Python loop
per token) and byte-deterministic on CPU: the same inputs give the same file bytes.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from analysis.ingest import summary_files
from analysis.record.checks import Warner, stale, step_sums
from analysis.record.context import Context, checked_context
from analysis.record.margins import checked_margins
from analysis.record.summaries import SUMMARISED_KEY, SUMMARISED_VALUE, StepTensors, Workspace, summarise
from analysis.record.token_sample import TOP_TOKENS, WORST_SEQUENCES, SamplePlan, select, step_generator
from analysis.routing_rows import list_column, routing_columns
from analysis.run_names import safe_run_name


def _tensor(x, name: str, device: torch.device | None = None) -> torch.Tensor:
    """Tensor (any device, any dtype), array or nested list -> torch tensor on `device` (default: its own)."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name}: expected a tensor or array, got {type(x).__name__}") from exc
    x = x.detach()
    return x if device is None else x.to(device)


def _expect_shape(arr, shape: tuple, name: str) -> None:
    if tuple(arr.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(arr.shape)}")


def _per_token(x, B: int, T: int, name: str, device: torch.device) -> torch.Tensor:
    """An int, a per-sample [B] or a per-token [B, T] value -> int64 [B, T] (a broadcast view, no copy)."""
    arr = _tensor(x, name, device)
    if arr.ndim == 1:
        _expect_shape(arr, (B,), name)
        arr = arr[:, None]
    elif arr.ndim == 2:
        _expect_shape(arr, (B, T), name)
    elif arr.ndim != 0:
        raise ValueError(f"{name}: expected an int, shape [{B}] or [{B}, {T}], got shape {list(arr.shape)}")
    return arr.to(torch.int64).expand(B, T)


def _all_logprobs(values: torch.Tensor, mask: torch.Tensor, scratch: torch.Tensor | None = None) -> bool:
    """Whether every unmasked value is finite and <= 0, with one min/max (aminmax) rather than the five passes of
    the elementwise test: the smallest is not −inf and the largest is <= 0, NaN included, since aminmax returns
    NaN when any value is NaN (and NaN <= 0 is false). First over every value, which settles it when the padding
    holds valid log-probs too; else over the values with the padding replaced by −1 (a where into `scratch`, a
    buffer of values' shape and dtype)."""
    if values.numel() == 0:
        return True
    lo, hi = torch.aminmax(values)  # one pass, padding included: where padding holds log-probs too (0, say)
    if bool(hi <= 0) and bool(lo > -math.inf):
        return True
    masked = torch.where(mask, values, -1.0) if scratch is None else \
        torch.where(mask, values, torch.tensor(-1.0, dtype=values.dtype), out=scratch)
    lo, hi = torch.aminmax(masked)
    return bool(hi <= 0) and bool(lo > -math.inf)


def _float64(x: torch.Tensor, work: Workspace | None, name: str) -> torch.Tensor:
    """x as float64 (x itself when it is), widened into the workspace's buffer `name` when there is one: a
    fresh 8 MB block per step is mapped anew by the allocator, and its page faults cost more than the copy."""
    if x.dtype == torch.float64:
        return x
    if work is None:
        return x.to(torch.float64)
    return work.get(name, tuple(x.shape), torch.float64, x.device).copy_(x)


def _host(x: torch.Tensor) -> np.ndarray:
    return x.cpu().numpy()


def encodings(schema: pa.Schema) -> dict:
    """pq.write_table options for DriftLogger's files. Doubles are byte-stream-split: their exponent bytes (and
    the zero low bytes of widened fp32/bf16 log-probs) then compress (23% smaller summary files than the
    defaults). Integers are delta-encoded: positions and sequence ids mostly step by +1 and steps and versions
    repeat, where a dictionary of up to 4,096 positions cost ~2 bytes per token (token rows 25% smaller,
    benchmarks/RESULTS-logger.md). Strings (run, table and dimension names) keep the dictionary."""
    floats = [f.name for f in schema if pa.types.is_floating(f.type)]
    ints = [f.name for f in schema if pa.types.is_integer(f.type)]
    return {"use_dictionary": [f.name for f in schema if f.name not in floats and f.name not in ints],
            "column_encoding": {c: "BYTE_STREAM_SPLIT" for c in floats} | {c: "DELTA_BINARY_PACKED" for c in ints}}


def _write(table: pa.Table, path: Path, metadata: dict[str, str] | None = None) -> None:
    # Written to a hidden temporary name, then renamed: a reader never sees half a shard.
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd", store_schema=True, write_statistics=True, **encodings(table.schema))
    os.replace(tmp, path)


class DriftLogger:
    """Writes the summaries of every `log_step` call, plus token rows (and routing rows when experts are given)
    for the share `token_sample` of its tokens (see analysis/record/token_sample.py for what a sample keeps)."""

    def __init__(self, out_dir: str | os.PathLike, run: str, config: dict | None = None, token_sample: float = 1.0,
                 worst_sequences: int = WORST_SEQUENCES, top_tokens: int = TOP_TOKENS, seed: int = 0,
                 layout: str = "folder", rank: int = 0):
        self.run = safe_run_name(run)
        self.checks = Warner(self.run)  # warns once, at the first step whose logging checks hold
        self.plan = SamplePlan(token_sample, worst_sequences, top_tokens, seed)
        # layout="lake": every token of each step into out_dir/run=<run>/step=<n>/, one file per rank and kind
        # (docs/SCHEMA.md, "Lake layout"); `python -m analysis summarize` computes the summaries from there
        self.lake = None
        if layout == "lake":
            from analysis.lake.writer import LakeWriter
            if token_sample != 1.0:
                raise ValueError("layout='lake' keeps every token (token_sample=1.0): summarize --token-sample P "
                                 "samples when it writes the summaries")
            self.lake = LakeWriter(str(out_dir), self.run, rank, config)
            return
        if layout != "folder":
            raise ValueError(f"layout: expected 'folder' or 'lake', got {layout!r}")
        self.work = Workspace()  # the summaries' buffers, reused from step to step
        self.dir = Path(out_dir) / self.run
        self.dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"run": self.run, "config": config}, indent=2, sort_keys=True)
        (self.dir / "run.json").write_text(text + "\n", encoding="utf-8")

    def log_step(self, step: int, sampler_logprobs, trainer_logprobs, mask, token_ids=None,
                 sampler_experts=None, trainer_experts=None, sampler_version=None, trainer_version=None,
                 sample_ids=None, *, rewards=None, advantages=None, prompts=None, responses=None, tags=None,
                 segment_ids=None, sampling_support=None, sampler_weights=None, trainer_weights=None,
                 sampler_topk_ids=None, sampler_topk_logprobs=None, trainer_topk_ids=None,
                 trainer_topk_logprobs=None, sampler_margins=None, trainer_margins=None) -> dict[str, Path]:
        """Summarise the mask==1 tokens of one step and write the sampled ones; returns the paths written.

        Args:
            step: trainer step (int >= 0).
            sampler_logprobs, trainer_logprobs: [B, T] log-probs of the response tokens (T = response positions).
            mask: [B, T], 1 (or True) where the trainer trains on the token.
            token_ids: optional [B, T] vocabulary ids.
            sampler_experts, trainer_experts: optional [B, T, L, K] top-k expert ids at the position that
                produced each token; trainer_experts needs sampler_experts.
            sampler_version, trainer_version: optional int, [B] or [B, T] policy versions.
            sample_ids: optional [B] sequence ids (default: the row index b).
            rewards: optional [B] numbers (None in a list: that sequence has none).
            advantages: optional [B], or [B, T] per token (a row's value is also its sequence's where its
                trained tokens share it).
            prompts: optional list of B strings, or prompt token ids [B, P] (or B lists), kept as JSON text.
            responses, tags: optional lists of B strings (tags: a task label such as "code", "math", "chat").
            segment_ids: optional [B, T] turn index of each token (multi-turn rollouts), >= 0.
            sampling_support: optional [B, T] number of tokens the sampler's top-p / top-k kept, >= 1.
            sampler_weights, trainer_weights: optional [B, T, L, K] router combine weights, in the order of
                sampler_experts / trainer_experts (each needs its side's experts); stored as fp32.
            sampler_topk_ids, sampler_topk_logprobs, trainer_topk_ids, trainer_topk_logprobs: optional [B, T, J]
                the J most likely token ids of each position and their log-probs, on each side (all four or
                none; ids distinct within a position); log-probs stored as fp32.
            sampler_margins, trainer_margins: optional [B, T, L] router margins, the k-th minus the (k+1)-th
                router probability (RouterCapture.margins()), in [0, 1]; each needs its side's experts; fp32.
        Tensors stay on their device: the summaries are reduced there and only the kept tokens' rows move.
        """
        x = self._checked(step, sampler_logprobs, trainer_logprobs, mask, token_ids, sampler_experts,
                          trainer_experts, sampler_version, trainer_version, sample_ids)
        ctx = checked_context(*x.mask.shape, x.mask, rewards=rewards, advantages=advantages, prompts=prompts,
                              responses=responses, tags=tags, segment_ids=segment_ids,
                              sampling_support=sampling_support)
        x.segments = ctx.segments
        x.sampler_weights, x.trainer_weights = _weights(x, sampler_weights, trainer_weights, x.routing_in_pass)
        x.topk = _topk(x, sampler_topk_ids, sampler_topk_logprobs, trainer_topk_ids, trainer_topk_logprobs)
        margins = {"sampler": checked_margins(sampler_margins, x.sampler_experts, x.mask, "sampler_margins",
                                              "sampler_experts"),
                   "trainer": checked_margins(trainer_margins, x.trainer_experts, x.mask, "trainer_margins",
                                              "trainer_experts")}
        x.margins = margins if any(v is not None for v in margins.values()) else None
        if self.lake is not None and (x.topk is not None or x.sampler_weights is not None or x.margins):
            raise ValueError("layout='lake' does not carry top-k log-probs or routing weights, nor router margins: "
                             "log them with layout='folder'")
        if self.lake is not None:  # full rows, no summaries: those come from summarize
            rows = x.mask.reshape(-1).nonzero().squeeze(1)
            routing = self._routing_rows(step, x, rows) if x.sampler_experts is not None else None
            written = self.lake.write_step(step, self._token_rows(step, x, rows, ctx), routing,
                                           self._sequence_rows(step, x, ctx))
            self.checks.step(step, step_sums({}, x.s, x.t, x.mask),
                             stale(x.sampler_version, x.trainer_version, x.mask))
            return written
        delta = None  # Δ = t − s: read only to draw a partial sample (token_sample strictly between 0 and 1)
        if 0.0 < self.plan.rate < 1.0:
            B, T = x.mask.shape
            delta = torch.sub(x.t, x.s, out=self.work.get("input_delta", (B, T), torch.float64, x.device))
        keep, kept = select(delta, x.mask, self.plan, step_generator(self.plan.seed, self.run, step, x.device))
        summary = summarise(x, kept, self.plan, self.work)
        sequences = ctx.sequence_columns()
        if sequences is not None:  # every sequence's, whatever the token sample
            summary["sequences"] = {"sample": _host(x.samples)} | sequences
        tables = {"summary": (summary_files.build(self.run, step, summary), None)}
        if self.plan.rate > 0:  # token_sample=0 writes summaries only
            rows = keep.reshape(-1).nonzero().squeeze(1)  # row-major: sample, then position
            tables["tokens"] = (self._token_rows(step, x, rows, ctx), {SUMMARISED_KEY: SUMMARISED_VALUE})
            if x.sampler_experts is not None:
                tables["routing"] = (self._routing_rows(step, x, rows), {SUMMARISED_KEY: SUMMARISED_VALUE})
            if x.topk is not None:
                tables["topk"] = (self._topk_rows(step, x, rows), {SUMMARISED_KEY: SUMMARISED_VALUE})
        # Everything is checked before the first write: bad input leaves no shard behind.
        written = {}
        for kind, (table, metadata) in tables.items():
            written[kind] = self.dir / f"{kind}-step{step:06d}.parquet"
            _write(table, written[kind], metadata)
        self.checks.step(step, step_sums(summary.get("summary_step"), x.s, x.t, x.mask),
                         stale(x.sampler_version, x.trainer_version, x.mask))
        return written

    def _checked(self, step, sampler_logprobs, trainer_logprobs, mask, token_ids, sampler_experts,
                 trainer_experts, sampler_version, trainer_version, sample_ids) -> StepTensors:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        s = _tensor(sampler_logprobs, "sampler_logprobs")
        if s.ndim != 2:
            raise ValueError(f"sampler_logprobs: expected shape [B, T], got {list(s.shape)}")
        device = s.device
        B, T = s.shape
        t = _tensor(trainer_logprobs, "trainer_logprobs", device)
        _expect_shape(t, (B, T), "trainer_logprobs")
        m = _tensor(mask, "mask", device)
        _expect_shape(m, (B, T), "mask")
        m = m if m.dtype == torch.bool else m != 0
        # float64 before any arithmetic: bf16/fp32 widen exactly, and every sum is then a float64 sum. The step's
        # [B, T] blocks go into buffers kept from step to step (none in the lake layout, which keeps no workspace).
        work = getattr(self, "work", None)
        s, t = _float64(s, work, "input_s"), _float64(t, work, "input_t")

        def block(name: str) -> torch.Tensor | None:
            return work.get(name, (B, T), torch.float64, device) if work is not None else None
        for name, values in (("sampler_logprobs", s), ("trainer_logprobs", t)):
            if _all_logprobs(values, m, block("input_check")):
                continue
            bad = m & ~(torch.isfinite(values) & (values <= 0))  # which token: only for the message
            if bad.any():
                b, p = divmod(int(bad.reshape(-1).nonzero()[0]), T)
                raise ValueError(f"{name}[{b}, {p}] = {float(values[b, p])!r}: a log-probability must be "
                                 f"finite and <= 0 (mask the token out if it is padding)")
        if sample_ids is None:
            samples = torch.arange(B, dtype=torch.int64, device=device)
        else:
            samples = _tensor(sample_ids, "sample_ids", device).to(torch.int64)
            _expect_shape(samples, (B,), "sample_ids")
            if torch.unique(samples).numel() != B:
                raise ValueError("sample_ids: expected distinct ids, got duplicates")
        ids = None
        if token_ids is not None:
            ids = _tensor(token_ids, "token_ids", device)
            _expect_shape(ids, (B, T), "token_ids")
        versions = {name: _per_token(value, B, T, name, device) if value is not None else None
                    for name, value in (("sampler_version", sampler_version), ("trainer_version", trainer_version))}
        if trainer_experts is not None and sampler_experts is None:
            raise ValueError("trainer_experts: given without sampler_experts (SCHEMA.md: sampler side is required)")
        se = te = None
        if sampler_experts is not None:
            se = _tensor(sampler_experts, "sampler_experts", device)
            if se.ndim != 4 or tuple(se.shape[:2]) != (B, T):
                raise ValueError(f"sampler_experts: expected shape [{B}, {T}, L, K], got {list(se.shape)}")
            if trainer_experts is not None:
                te = _tensor(trainer_experts, "trainer_experts", device)
                _expect_shape(te, tuple(se.shape), "trainer_experts")
        # On the CPU (folder layout) the routing pass of the summaries checks the ids as it reads them, before
        # anything is written (a pass of their own over [B, T, L, K] cost as much as the routing sums)
        in_pass = device.type == "cpu" and work is not None
        for name, e in (("sampler_experts", se), ("trainer_experts", te)):
            if e is not None and not in_pass:
                _check_experts(e, m, name)
        return StepTensors(s, t, m, samples, ids, versions["sampler_version"], versions["trainer_version"],
                           se, te, routing_in_pass=in_pass)

    def _sequence_rows(self, step: int, x: StepTensors, ctx: Context) -> pa.Table | None:
        """The step's `sequences` rows (lake layout), one per sequence, where the context has per-sequence values."""
        columns = ctx.sequence_columns()
        if columns is None:
            return None
        return summary_files.step_rows(self.run, step, "sequences", {"sample": _host(x.samples)} | columns)

    def _token_rows(self, step: int, x: StepTensors, rows: torch.Tensor, ctx: Context | None = None) -> pa.Table:
        n = len(rows)
        T = x.mask.shape[1]
        columns = {
            "run": pa.repeat(pa.scalar(self.run, pa.string()), n),
            "step": pa.array(np.full(n, step, dtype=np.int64)),
            "sample": pa.array(_host(x.samples[rows // T])),
            "pos": pa.array(_host((rows % T).to(torch.int32))),
        }
        if x.token_ids is not None:
            columns["token_id"] = pa.array(_host(x.token_ids.reshape(-1)[rows].to(torch.int32)))
        columns["sampler_logprob"] = pa.array(_host(x.s.reshape(-1)[rows]))
        columns["trainer_logprob"] = pa.array(_host(x.t.reshape(-1)[rows]))
        for name, value in (("sampler_version", x.sampler_version), ("trainer_version", x.trainer_version)):
            if value is not None:
                columns[name] = pa.array(_host(value.reshape(-1)[rows]))
        if ctx is not None:
            columns |= {name: pa.array(values) for name, values in ctx.token_columns(rows).items()}
        return pa.table(columns)

    def _routing_rows(self, step: int, x: StepTensors, rows: torch.Tensor) -> pa.Table:
        B, T, L, K = x.sampler_experts.shape

        def experts(e):  # [kept tokens, L, K] on the host
            return _host(e.reshape(B * T, L, K)[rows].to(torch.int32))

        def weights(w):  # [kept tokens, L, K] fp32 on the host (SCHEMA.md: weights are stored as fp32)
            return _host(w.reshape(B * T, L, K)[rows].to(torch.float32)) if w is not None else None

        te = x.trainer_experts
        keys = {"step": np.full(len(rows), step, dtype=np.int64), "sample": _host(x.samples[rows // T]),
                "pos": _host((rows % T).to(torch.int32))}
        def margins(side):  # [kept tokens, L] fp32 on the host
            m = (x.margins or {}).get(side)
            return _host(m.reshape(B * T, L)[rows].to(torch.float32)) if m is not None else None
        cols = routing_columns(keys, experts(x.sampler_experts), experts(te) if te is not None else None,
                               weights(x.sampler_weights), weights(x.trainer_weights), margins("sampler"),
                               margins("trainer"))
        n = len(cols["layer"])
        cols["run"] = pa.repeat(pa.scalar(self.run, pa.string()), n)
        cols.setdefault("trainer_experts", pa.nulls(n, pa.list_(pa.int32())))
        names = ["run", "step", "sample", "pos", "layer", "sampler_experts", "trainer_experts"]
        extra = ("sampler_weights", "trainer_weights", "sampler_margin", "trainer_margin")
        return pa.table({c: cols[c] for c in names + [w for w in extra if w in cols]})

    def _topk_rows(self, step: int, x: StepTensors, rows: torch.Tensor) -> pa.Table:
        """The kept tokens' top-J lists (SCHEMA.md table `topk`): ids int32, log-probs fp32."""
        T = x.mask.shape[1]
        n = len(rows)
        J = x.topk[0].shape[-1]

        def lists(v: torch.Tensor, dtype: torch.dtype) -> pa.ListArray:
            return list_column(_host(v.reshape(-1, J)[rows].to(dtype)))
        s_ids, s_lp, t_ids, t_lp = x.topk
        return pa.table({"run": pa.repeat(pa.scalar(self.run, pa.string()), n),
                         "step": pa.array(np.full(n, step, dtype=np.int64)),
                         "sample": pa.array(_host(x.samples[rows // T])),
                         "pos": pa.array(_host((rows % T).to(torch.int32))),
                         "sampler_topk_ids": lists(s_ids, torch.int32),
                         "sampler_topk_logprobs": lists(s_lp, torch.float32),
                         "trainer_topk_ids": lists(t_ids, torch.int32),
                         "trainer_topk_logprobs": lists(t_lp, torch.float32)})


def _check_experts(e: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """Refuse a negative id in a trained token's top-k: expert load counts index by id. (Repeated ids within a
    top-k are left to ingest, which refuses the routing rows it is given.)"""
    if not e.numel() or bool(e.min() >= 0):  # one pass, padding included, settles the usual case
        return
    bad = (e < 0).any(-1) & mask[..., None]  # [B, T, L]
    if bad.any():
        b, p, layer = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}[{b}, {p}, {layer}] = {e[b, p, layer].tolist()}: expert ids are 0-based (>= 0)")


def _weights(x: StepTensors, sampler_weights, trainer_weights,
             in_pass: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The router combine weights [B, T, L, K] in their own float dtype, checked: each side's needs that side's
    experts, of the same shape, and is finite at the trained positions (`in_pass`, with both sides' weights: left
    to the summaries' CPU routing pass, which reads them all anyway)."""
    in_pass = in_pass and sampler_weights is not None and trainer_weights is not None
    out = []
    for name, value, experts, side in (("sampler_weights", sampler_weights, x.sampler_experts, "sampler_experts"),
                                       ("trainer_weights", trainer_weights, x.trainer_experts, "trainer_experts")):
        if value is None:
            out.append(None)
            continue
        if experts is None:
            raise ValueError(f"{name}: given without {side} (a weight belongs to the expert at its rank)")
        w = _tensor(value, name, x.device)
        if not w.is_floating_point():
            raise ValueError(f"{name}: expected floating-point weights, got dtype {w.dtype}")
        _expect_shape(w, tuple(experts.shape), name)
        if in_pass:
            out.append(w)
            continue
        lo, hi = torch.aminmax(w) if w.numel() else (torch.zeros(()), torch.zeros(()))  # one pass; NaN fails both
        if bool(lo > -math.inf) and bool(hi < math.inf):
            out.append(w)
            continue
        bad = ~torch.isfinite(w).all(-1).all(-1) & x.mask  # [B, T]: the padding may hold anything
        if bad.any():
            b, p = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{name}[{b}, {p}]: a weight is not finite (mask the token out if it is padding)")
        out.append(w)
    return out[0], out[1]


def _first_repeat(ids: torch.Tensor, mask: torch.Tensor) -> int | None:
    """The flat index b·T + p of the first trained position whose ids repeat one, or None, by a sort."""
    srt = ids.sort(-1).values
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1) & mask
    return int(dup.reshape(-1).nonzero()[0]) if dup.any() else None


def _topk(x: StepTensors, s_ids, s_lp, t_ids, t_lp, in_pass: bool | None = None) -> tuple | None:
    """The four top-J tensors, checked: all four or none, each [B, T, J] with one J, ids integers >= 0 and
    distinct within a trained position, log-probs finite and <= 0 there. Kept in their dtypes (widened to
    float64 chunk by chunk where the sums read them). On the CPU (`in_pass`, default: whether the tensors are
    there) the values' rules are left to the top-k pass, which checks them as it reads them
    (record/fulldist.topk_sums), still before anything is written: passes of their own over [B, T, J] (a sort per
    position for the repeats) cost more than the sums."""
    given = {"sampler_topk_ids": s_ids, "sampler_topk_logprobs": s_lp, "trainer_topk_ids": t_ids,
             "trainer_topk_logprobs": t_lp}
    have = [k for k, v in given.items() if v is not None]
    if not have:
        return None
    if len(have) < 4:
        missing = [k for k in given if k not in have]
        raise ValueError(f"{', '.join(missing)}: missing, while {', '.join(have)} given (the full-distribution "
                         "columns compare both sides: give ids and log-probs of each)")
    B, T = x.mask.shape
    first = _tensor(s_ids, "sampler_topk_ids", x.device)
    if first.ndim != 3 or tuple(first.shape[:2]) != (B, T) or first.shape[2] < 1:
        raise ValueError(f"sampler_topk_ids: expected shape [{B}, {T}, J] with J >= 1, got {list(first.shape)}")
    shape = tuple(first.shape)
    out = []
    m = x.mask[..., None]
    in_pass = x.device.type == "cpu" if in_pass is None else in_pass
    for name, value in given.items():
        v = first if name == "sampler_topk_ids" else _tensor(value, name, x.device)
        _expect_shape(v, shape, name)
        if name.endswith("_ids"):
            if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
                raise ValueError(f"{name}: expected integer token ids, got dtype {v.dtype}")
            if not in_pass and v.numel() and bool(v.min() < 0):  # one pass; the padding may hold anything
                bad = (v < 0) & m
                if bad.any():
                    b, p, j = (int(i) for i in bad.nonzero()[0])
                    raise ValueError(f"{name}[{b}, {p}, {j}] = {int(v[b, p, j])}: token ids are >= 0")
            row = None if in_pass else _first_repeat(v, x.mask)
            if row is not None:
                b, p = divmod(row, T)
                raise ValueError(f"{name}[{b}, {p}] = {v[b, p].tolist()}: the ids of one position must be distinct")
        else:
            if not v.is_floating_point():
                raise ValueError(f"{name}: expected floating-point log-probs, got dtype {v.dtype}")
            if not in_pass and not _all_logprobs(v, m):
                bad = m & ~(torch.isfinite(v) & (v <= 0))
                b, p, j = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"{name}[{b}, {p}, {j}] = {float(v[b, p, j])!r}: a log-probability must be finite "
                                 "and <= 0 (mask the token out if it is padding)")
        out.append(v)
    return tuple(out)
