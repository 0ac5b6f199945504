"""The logging checks' sums of a step (summaries/schema.py CHECK_SUMS) on the tensors' device, and DriftLogger's
warning.

The sums go into the step's summary_step row, so the checks (summaries/checks.py) hold from summaries alone; the
logger also evaluates them on each step and warns once, at the first step where one holds, in one line naming
the likely setting: a processed-log-prob or temperature mismatch makes every drift number meaningless.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from analysis.summaries import checks, kernel
from analysis.summaries import schema as S


class LoggingCheckWarning(UserWarning):
    """The logged log-probs fail a logging check (summaries/checks.py): fix the logging before reading drift."""


def check_sums(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor,
               buffer: Callable[[str, tuple], torch.Tensor] | None = None) -> dict[str, float | int]:
    """CHECK_SUMS of a step's [B, T] float64 log-probs (position = column, one sequence per row) over the
    mask==1 tokens, on their device (on the CPU by the one-pass loop of summaries/kernel.py); pairs are neighbouring
    columns both in the mask. `buffer(name, shape)`: a float64 tensor kept from step to step (the logger's
    Workspace), for the [B, T] temporaries of the torch reductions."""
    if s.device.type == "cpu":
        return kernel.grid_sums(s.numpy(), t.numpy(), mask.numpy())
    return torch_check_sums(s, t, mask, buffer)


def torch_check_sums(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor,
                     buffer: Callable[[str, tuple], torch.Tensor] | None = None) -> dict[str, float | int]:
    """check_sums by torch reductions on the tensors' device (an accelerator's)."""
    B, T = s.shape

    def buf(name: str, shape: tuple) -> torch.Tensor | None:
        return buffer(name, shape) if buffer is not None else None
    full = bool(mask.all())
    if not full:  # padding may hold anything (NaN included): 0 there, and the pairs need both tokens
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        s = torch.where(mask, s, zero, out=buf("check_s", (B, T)))
        t = torch.where(mask, t, zero, out=buf("check_t", (B, T)))
    flat_s = s.reshape(-1)
    d = torch.sub(t, s, out=buf("check_d", (B, T))).reshape(-1)
    sums = {"sum_s": float(flat_s.sum()), "sum_s2": float(torch.dot(flat_s, flat_s)),
            "sum_sd": float(torch.dot(flat_s, d))}
    lag = buf("check_lag", (B, max(T - 1, 0)))
    adj = None if full else mask[:, 1:] & mask[:, :-1]
    for name, a, b in (("sum_abs_lag_prev", t[:, 1:], s[:, :-1]), ("sum_abs_lag_next", t[:, :-1], s[:, 1:])):
        diff = torch.sub(a, b, out=lag).abs_()  # |t_(p+1) − s_p|, then |t_p − s_(p+1)|
        sums[name] = float(diff.sum() if full else torch.where(adj, diff, 0.0).sum())
    n, n_adj = (mask.numel(), B * max(T - 1, 0)) if full else (int(mask.sum()), int(adj.sum()))
    return {"n_check_tokens": n, "n_adj": n_adj} | sums


def step_sums(summary_step: dict, s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> dict:
    """The scalar sums the checks read for a step: its summary_step row (columns as lists of one value), or,
    where the logger writes no summaries (the lake layout), the few sums computed here."""
    if summary_step:
        return {k: v[0] for k, v in summary_step.items()}
    n = int(mask.sum())
    if n == 0:
        return {"n_tokens": 0}
    inf = torch.tensor(float("inf"), dtype=s.dtype, device=s.device)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    d = torch.where(mask, t - s, zero).reshape(-1)
    rm1 = torch.clamp(d, -S.CLAMP, S.CLAMP).expm1_()  # 0 at padding
    m = mask.reshape(-1)
    s_flat = s.reshape(-1)
    return {"n_tokens": n, "sum_rm1": float(rm1.sum()), "sum_rm1_sq": float(torch.dot(rm1, rm1)),
            "sum_d": float(d.sum()), "sum_d2": float(torch.dot(d, d)), "sum_abs_d": float(d.abs().sum()),
            "min_d": float(torch.where(m, d, inf).min()), "max_d": float(torch.where(m, d, -inf).max()),
            "min_s": float(torch.where(m, s_flat, inf).min()), "max_s": float(torch.where(m, s_flat, -inf).max())
            } | check_sums(s, t, mask)


def stale(sampler_version: torch.Tensor | None, trainer_version: torch.Tensor | None, mask: torch.Tensor) -> bool:
    """Whether some trained token was recomputed with newer weights than it was sampled with."""
    if sampler_version is None or trainer_version is None:
        return False
    return bool(((trainer_version > sampler_version) & mask).any())


class Warner:
    """Warns once per logger, at the first step whose checks hold."""

    def __init__(self, run: str):
        self.run = run
        self.warned = False

    def step(self, step: int, sums: dict, stale: bool = False) -> checks.Verdict:
        """stale: some trained token's trainer version is newer than its sampler version."""
        found = checks.verdict(checks.values(sums), stale) if sums.get("n_tokens") else checks.Verdict()
        if found.holds and not self.warned:
            self.warned = True
            warnings.warn(f"DriftLogger run {self.run!r}, step {step}: {found.line()}", LoggingCheckWarning,
                          stacklevel=3)
        return found
