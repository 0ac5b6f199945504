"""The summaries DriftLogger writes for each step, reduced with torch on the device the tensors are on.

They are the rows of the summary tables that ingest would compute from the step's tokens
(analysis/summaries/schema.py), so a trainer can log every token's contribution while writing only a sample of
the tokens themselves. Every reduction is over float64 (inputs are widened first), with no Python loop per
token or sequence, and only the reduced rows leave the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from analysis.token_sample import Kept, SamplePlan

SUMMARY_KEY = "driftscope.summary"  # schema metadata of a summary file: the summary table its rows belong to
SUMMARISED_KEY = "driftscope.summarised"  # "1" on token/routing files whose summaries come in summary files
SAMPLE_TABLE = "token_samples"  # per (run, step): what the token rows of the step are a sample of


@dataclass
class StepTensors:
    """One step's checked inputs on their device: float64 log-probs, bool mask, int64 ids."""
    s: torch.Tensor  # [B, T] float64
    t: torch.Tensor  # [B, T] float64
    delta: torch.Tensor  # t − s
    mask: torch.Tensor  # [B, T] bool
    samples: torch.Tensor  # [B] int64 sequence ids
    token_ids: torch.Tensor | None  # [B, T]
    sampler_version: torch.Tensor | None  # [B, T] int64
    trainer_version: torch.Tensor | None
    sampler_experts: torch.Tensor | None  # [B, T, L, K]
    trainer_experts: torch.Tensor | None

    @property
    def device(self) -> torch.device:
        return self.s.device


def sample_record(run: str, step: int, kept: Kept, plan: SamplePlan) -> pa.Table:
    """One row saying what the step's token rows are: the summaries cover n_tokens, the rows hold n_kept."""
    return pa.table({
        "run": pa.array([run], pa.string()), "step": pa.array([step], pa.int64()),
        "token_sample": pa.array([float(plan.rate)], pa.float64()),
        "worst_sequences": pa.array([plan.worst_sequences], pa.int64()),
        "top_tokens": pa.array([plan.top_tokens], pa.int64()),
        "n_tokens": pa.array([kept.n_tokens], pa.int64()), "n_kept": pa.array([kept.n_kept], pa.int64()),
        "n_uniform": pa.array([kept.n_uniform], pa.int64()),
        "n_worst_sequence_tokens": pa.array([kept.n_worst_sequence_tokens], pa.int64()),
        "n_top_tokens": pa.array([kept.n_top_tokens], pa.int64()),
    })


def summarise(run: str, step: int, x: StepTensors, kept: Kept, plan: SamplePlan) -> dict[str, pa.Table]:
    """Summary table name -> the step's rows of that table."""
    return {SAMPLE_TABLE: sample_record(run, step, kept, plan)}


__all__ = ["StepTensors", "summarise", "SUMMARY_KEY", "SUMMARISED_KEY", "SAMPLE_TABLE"]
