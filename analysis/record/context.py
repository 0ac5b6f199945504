"""What a trainer knows about a step besides the log-probs, as DriftLogger takes it: per sequence the reward,
advantage, prompt, response text and a tag; per token the advantage, the turn (segment) and the sampler's support.

Checked here (a ValueError naming the argument, the shape or rule and what was given), then written by the
logger: the per-sequence values as `sequences` rows of the step's summary file, for every sequence whatever the
token sample (they are a few bytes each, and the reward panels read them); the per-token ones as columns of the
kept token rows (SCHEMA.md `tokens`: advantage, segment, sampling_support).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch

SEQUENCE_COLUMNS = ("reward", "advantage", "prompt", "response", "tag")


@dataclass
class Context:
    """A step's checked context; every part optional. Per sequence: host values, one per row b of the step."""
    rewards: list[float | None] | None = None
    advantages: list[float | None] | None = None  # given [B], or [B, T] constant over a row's trained tokens
    prompts: list[str | None] | None = None
    responses: list[str | None] | None = None
    tags: list[str | None] | None = None
    token_advantages: torch.Tensor | None = None  # [B, T] float64
    segments: torch.Tensor | None = None  # [B, T] int64
    support: torch.Tensor | None = None  # [B, T] int64

    def sequence_columns(self) -> dict[str, list] | None:
        """{column: one value per row b} of the per-sequence values given (None when none is)."""
        given = {c: v for c, v in zip(SEQUENCE_COLUMNS, (self.rewards, self.advantages, self.prompts,
                                                          self.responses, self.tags)) if v is not None}
        return given or None

    def token_columns(self, rows: torch.Tensor) -> dict[str, np.ndarray]:
        """The per-token columns of the kept tokens `rows` (flat indices into [B, T])."""
        out = {}
        for name, value, dtype in (("advantage", self.token_advantages, torch.float64),
                                   ("segment", self.segments, torch.int32),
                                   ("sampling_support", self.support, torch.int32)):
            if value is not None:
                out[name] = value.reshape(-1)[rows].to(dtype).cpu().numpy()
        return out


def _as_tensor(x, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name}: expected a tensor or array, got {type(x).__name__}") from exc
    return x.detach().to(device)


def _per_sequence_numbers(x, B: int, name: str, what: str) -> list[float | None]:
    """[B] finite numbers (a list may hold None for a sequence without one) -> list of float or None."""
    if isinstance(x, (list, tuple)):
        if len(x) != B:
            raise ValueError(f"{name}: expected {B} values (one per sequence, shape [{B}]), got {len(x)}")
        out = []
        for b, v in enumerate(x):
            if v is None:
                out.append(None)
                continue
            if isinstance(v, torch.Tensor):
                v = v.item() if v.numel() == 1 else v
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"{name}[{b}]: expected a number or None, got {type(v).__name__}") from None
            if not math.isfinite(f):
                raise ValueError(f"{name}[{b}] = {f!r}: {what} must be finite (None where there is none)")
            out.append(f)
        return out
    arr = _as_tensor(x, name, torch.device("cpu"))
    if tuple(arr.shape) != (B,):
        raise ValueError(f"{name}: expected shape [{B}], got {list(arr.shape)}")
    values = arr.to(torch.float64)
    bad = ~torch.isfinite(values)
    if bad.any():
        b = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{b}] = {float(values[b])!r}: {what} must be finite (None where there is none)")
    return values.tolist()


def _texts(x, B: int, name: str) -> list[str | None]:
    if isinstance(x, str) or not isinstance(x, (list, tuple, np.ndarray)):
        raise ValueError(f"{name}: expected a list of {B} strings (one per sequence), got {type(x).__name__}")
    if len(x) != B:
        raise ValueError(f"{name}: expected {B} strings (one per sequence), got {len(x)}")
    for b, v in enumerate(x):
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{name}[{b}]: expected a string or None, got {type(v).__name__}")
    return [None if v is None else str(v) for v in x]


def _prompts(x, B: int) -> list[str | None]:
    """Prompt texts, or prompt token ids ([B, P] or a list of B lists of ids), kept as the JSON text of the ids
    ("[151644, 872, ...]"): the logger has no tokenizer to decode them."""
    if isinstance(x, str) or isinstance(x, (list, tuple)) and all(v is None or isinstance(v, str) for v in x):
        return _texts(x, B, "prompts")
    if isinstance(x, (list, tuple)):
        if len(x) != B:
            raise ValueError(f"prompts: expected {B} prompts (one per sequence), got {len(x)}")
        rows = list(x)
    else:
        arr = _as_tensor(x, "prompts", torch.device("cpu"))
        if arr.ndim != 2 or arr.shape[0] != B:
            raise ValueError(f"prompts: expected {B} strings or prompt token ids of shape [{B}, P], "
                             f"got shape {list(arr.shape)}")
        rows = list(arr)
    out = []
    for b, row in enumerate(rows):
        if row is None:
            out.append(None)
            continue
        try:
            ids = np.asarray(row.cpu() if isinstance(row, torch.Tensor) else row)
        except (TypeError, ValueError):
            ids = np.asarray([object()])
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"prompts[{b}]: expected a string or a list of token ids (integers), got "
                             f"{type(row).__name__}")
        if (ids < 0).any():
            raise ValueError(f"prompts[{b}]: token ids are >= 0, got {int(ids.min())}")
        out.append(json.dumps([int(i) for i in ids]))
    return out


def _per_token(x, B: int, T: int, name: str, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    arr = _as_tensor(x, name, mask.device)
    if tuple(arr.shape) != (B, T):
        raise ValueError(f"{name}: expected shape [{B}, {T}], got {list(arr.shape)}")
    if dtype != torch.float64 and arr.is_floating_point():
        whole = torch.where(mask, arr, 0) == torch.where(mask, arr, 0).round()
        if not bool(whole.all()):
            b, p = (int(i) for i in (~whole).nonzero()[0])
            raise ValueError(f"{name}[{b}, {p}] = {float(arr[b, p])!r}: expected whole numbers")
    return arr.to(dtype)


def _first_bad(bad: torch.Tensor, values: torch.Tensor, name: str, rule: str) -> None:
    if bool(bad.any()):
        b, p = (int(i) for i in bad.nonzero()[0])
        v = values[b, p].item()
        raise ValueError(f"{name}[{b}, {p}] = {v!r}: {rule} at a trained token (mask 1)")


def checked_context(B: int, T: int, mask: torch.Tensor, rewards=None, advantages=None, prompts=None,
                    responses=None, tags=None, segment_ids=None, sampling_support=None) -> Context:
    """The context arguments of `DriftLogger.log_step` checked against the step's [B, T] `mask` (bool, on the
    log-probs' device). Per-token values are checked at trained tokens only: padding may hold anything."""
    ctx = Context()
    if rewards is not None:
        ctx.rewards = _per_sequence_numbers(rewards, B, "rewards", "a reward")
    if advantages is not None:
        is_2d = not isinstance(advantages, (list, tuple)) or any(isinstance(v, (list, tuple)) for v in advantages)
        arr = _as_tensor(advantages, "advantages", mask.device) if is_2d else None
        if arr is not None and arr.ndim == 2:
            a = _per_token(arr, B, T, "advantages", mask, torch.float64)
            _first_bad(mask & ~torch.isfinite(a), a, "advantages", "an advantage must be finite")
            ctx.token_advantages = a
            # one value per sequence where its trained tokens share it (GRPO broadcasts a sequence's advantage)
            big = torch.tensor(math.inf, dtype=torch.float64, device=a.device)
            lo = torch.where(mask, a, big).amin(1)
            hi = torch.where(mask, a, -big).amax(1)
            ctx.advantages = [float(v) if same else None for v, same in zip(lo.tolist(), (lo == hi).tolist())]
        elif arr is not None and arr.ndim != 1:
            raise ValueError(f"advantages: expected shape [{B}] or [{B}, {T}], got {list(arr.shape)}")
        else:
            ctx.advantages = _per_sequence_numbers(advantages if arr is None else arr, B, "advantages",
                                                   "an advantage")
    if prompts is not None:
        ctx.prompts = _prompts(prompts, B)
    if responses is not None:
        ctx.responses = _texts(responses, B, "responses")
    if tags is not None:
        ctx.tags = _texts(tags, B, "tags")
    if segment_ids is not None:
        seg = _per_token(segment_ids, B, T, "segment_ids", mask, torch.int64)
        _first_bad(mask & (seg < 0), seg, "segment_ids", "a segment (turn index) must be >= 0")
        ctx.segments = torch.where(mask, seg, 0)
    if sampling_support is not None:
        sup = _per_token(sampling_support, B, T, "sampling_support", mask, torch.int64)
        _first_bad(mask & (sup < 1), sup, "sampling_support",
                   "the sampler's support holds at least the sampled token (>= 1)")
        ctx.support = sup
    return ctx
