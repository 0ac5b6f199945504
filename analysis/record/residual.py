"""The counts of the residual signatures (summaries/schema.py RESIDUAL_SUMS) of a logged step, by torch on the
tensors' device: the trainer's twin of summaries/residual.py (the same float64 comparisons, so the same counts
as ingest makes from the step's token rows)."""
from __future__ import annotations

import torch

from analysis.summaries import schema as S

# (rows × segment ids) up to which a segment's first position is found by a dense scatter; above, by a sort
DENSE_KEYS = 1 << 24


def residual_sums(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor,
                  segments: torch.Tensor | None = None) -> dict[str, int]:
    """RESIDUAL_SUMS over the mask==1 tokens of float64 [B, T] log-probs; `segments` [B, T] int64 (>= 0 where
    trained) or None. A segment's first token: its least trained position in the row."""
    d = (t - s)[mask]  # padding may hold anything: only trained tokens are read
    x = d / S.LATTICE_Q
    lattice = (d != 0) & ((x - torch.round(x)).abs_() < S.LATTICE_TOL)
    out = {"n_res_tokens": int(d.numel()), "n_d_nonzero": int(torch.count_nonzero(d)),
           "n_lattice": int(torch.count_nonzero(lattice))}
    zeros = {"n_seg_tokens": 0, "n_seg_first": 0, "n_seg_first_low": 0, "n_seg_rest_low": 0}
    if segments is None or not d.numel():
        return out | zeros
    B, T = mask.shape
    rows, pos = mask.nonzero(as_tuple=True)  # row-major: each row's positions ascending
    seg = segments[rows, pos]
    n_ids = int(seg.max()) + 1
    if B * n_ids <= DENSE_KEYS:
        key = rows * n_ids + seg
        least = torch.full((B * n_ids,), T, dtype=torch.int64, device=d.device)
        least.scatter_reduce_(0, key, pos, "amin")
        first = pos == least[key]
    else:
        _, inverse = torch.unique(torch.stack([rows, seg]), dim=1, return_inverse=True)
        least = torch.full((int(inverse.max()) + 1,), T, dtype=torch.int64, device=d.device)
        least.scatter_reduce_(0, inverse, pos, "amin")
        first = pos == least[inverse]
    low = d < S.BOUNDARY_LOW
    n_first_low = int(torch.count_nonzero(first & low))
    return out | {"n_seg_tokens": int(d.numel()), "n_seg_first": int(torch.count_nonzero(first)),
                  "n_seg_first_low": n_first_low, "n_seg_rest_low": int(torch.count_nonzero(low)) - n_first_low}
