"""The full-distribution sums of a step (summaries/schema.py TOPK_SUMS), on the tensors' device.

The formulas are summaries/fulldist.py's (METRICS.md v3 "Full distribution"). On the CPU, that module's numba
pass over chunks of positions, the exponentials of a chunk's trained positions by torch (vectorised) in two
[chunk, J] buffers of each thread, the chunks shared among torch.get_num_threads() threads. Elsewhere
(`topk_sums_torch`), torch ops over the trained positions in chunks: a chunk's [c, J, J] id comparison bounds
the temporaries (J = 20: 400 bytes a position), and each sum is a float64 reduction of the chunk, added on the
device; only the step's eight numbers leave it.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from analysis.record.pieces import in_pieces
from analysis.summaries import fulldist
from analysis.summaries.schema import TOPK_SUM_NAMES

CHUNK = 1 << 15  # positions per chunk (torch ops)
CPU_CHUNK = 1 << 13  # positions per chunk of the CPU pass: its two [c, J] float64 blocks stay in the L2 cache


def _row(v: list[float]) -> dict[str, float | int]:
    return {name: int(round(x)) if name.startswith("n_") else x for name, x in zip(TOPK_SUM_NAMES, v)}


def topk_sums(s_ids: torch.Tensor, s_lp: torch.Tensor, t_ids: torch.Tensor, t_lp: torch.Tensor,
              mask: torch.Tensor, pool=None, per_row: np.ndarray | None = None) -> dict[str, float | int]:
    """TOPK_SUMS over the mask==True positions of [B, T, J] top-J ids and log-probs of both sides (checked by
    the caller, except on the CPU, where this pass checks them as it reads them: a ValueError naming the
    position and the rule): the numba pass on the CPU (`pool`: an executor for the other threads), torch ops
    elsewhere. per_row: a [B, N_SUMS] float64 array that receives each row's (sequence's) sums, in the same
    pass; the step's sums are then their total."""
    if mask.device.type != "cpu":
        return topk_sums_torch(s_ids, s_lp, t_ids, t_lp, mask, per_row=per_row)
    n_groups = mask.shape[0] if per_row is not None else 1
    J = s_ids.shape[-1]
    n = mask.numel()
    flat = [v.reshape(n, J) for v in (s_ids, s_lp, t_ids, t_lp)]
    # each position's group, −1 at padding: its row where per_row is asked for, else 0 (mask · (row + 1) − 1, two
    # passes for the step, where a numpy where of each chunk cost ~6 ns a trained token)
    groups = mask.to(torch.int64)
    if per_row is not None:
        groups.mul_(torch.arange(1, mask.shape[0] + 1)[:, None])
    groups = groups.sub_(1).reshape(n).numpy()
    broken = []  # per chunk that has one, the first position breaking a rule of the lists

    def start(_) -> tuple:  # a thread's sums and its buffers for the exponentials
        ps = torch.empty(CPU_CHUNK, J, dtype=torch.float64)
        return np.zeros((n_groups, fulldist.N_SUMS)), ps, torch.empty_like(ps)

    def step(state, lo: int, hi: int) -> None:
        out, ps, pt = state
        a, b = _np_floats(flat[1][lo:hi]), _np_floats(flat[3][lo:hi])
        k = fulldist.trained_floats(a, b, groups[lo:hi], ps.numpy(), pt.numpy())  # the trained rows, widened
        ps[:k].exp_()
        pt[:k].exp_()
        bad = fulldist.group_sums(flat[0][lo:hi].numpy(), a, flat[2][lo:hi].numpy(), b, ps.numpy(), pt.numpy(),
                                  groups[lo:hi], out)
        if bad >= 0:
            broken.append(lo + bad)
    threads = min(torch.get_num_threads(), max(1, n // (4 * CPU_CHUNK))) if pool is not None else 1
    states = in_pieces(n, CPU_CHUNK, threads, pool, start, step)
    total = states[0][0]
    for other, _, _ in states[1:]:
        total += other
    if broken:
        b, p = divmod(min(broken), mask.shape[1])
        raise ValueError(position_problem(b, p, s_ids, s_lp, t_ids, t_lp))
    if per_row is not None:
        per_row[:] = total
        total = total.sum(0, keepdims=True)
    return _row(total[0].tolist())


def position_problem(b: int, p: int, s_ids, s_lp, t_ids, t_lp) -> str:
    """The message for trained position (b, p), where the CPU pass found a rule of the top-k lists broken: the
    first of negative ids, non-log-probs, repeated ids, side by side, as the checks before the pass word them."""
    for side, ids, lp in (("sampler", s_ids, s_lp), ("trainer", t_ids, t_lp)):
        row = ids[b, p].tolist()
        for j, v in enumerate(row):
            if v < 0:
                return f"{side}_topk_ids[{b}, {p}, {j}] = {v}: token ids are >= 0"
        for j, v in enumerate(lp[b, p].tolist()):
            if not (-math.inf < v <= 0):
                return (f"{side}_topk_logprobs[{b}, {p}, {j}] = {v!r}: a log-probability must be finite and <= 0 "
                        "(mask the token out if it is padding)")
    for side, ids in (("sampler", s_ids), ("trainer", t_ids)):
        row = ids[b, p].tolist()
        if len(set(row)) < len(row):
            return f"{side}_topk_ids[{b}, {p}] = {row}: the ids of one position must be distinct"
    return f"top-k lists at [{b}, {p}]: a rule is broken"


def routing_problem(b: int, p: int, se, te, sw, tw) -> str:
    """The message for trained position (b, p), where the CPU routing pass found a negative expert id or a weight
    that is not finite, as DriftLogger's checks before the pass word them (the first of: the sampler's ids, the
    trainer's, the sampler's weights, the trainer's)."""
    for name, e in (("sampler_experts", se), ("trainer_experts", te)):
        if e is not None:
            for layer, row in enumerate(e[b, p].tolist()):
                if min(row, default=0) < 0:
                    return f"{name}[{b}, {p}, {layer}] = {row}: expert ids are 0-based (>= 0)"
    for name, w in (("sampler_weights", sw), ("trainer_weights", tw)):
        if w is not None and not bool(torch.isfinite(w[b, p]).all()):
            return f"{name}[{b}, {p}]: a weight is not finite (mask the token out if it is padding)"
    return f"routing at [{b}, {p}]: a rule is broken"


def _np_floats(v: torch.Tensor) -> np.ndarray:
    """A float tensor as numpy (bf16 and fp16 widened to fp32, exactly: numpy has no bf16)."""
    return (v if v.dtype in (torch.float32, torch.float64) else v.to(torch.float32)).numpy()


def topk_sums_torch(s_ids: torch.Tensor, s_lp: torch.Tensor, t_ids: torch.Tensor, t_lp: torch.Tensor,
              mask: torch.Tensor, per_row: np.ndarray | None = None) -> dict[str, float | int]:
    """TOPK_SUMS over the mask==True positions of [B, T, J] top-J ids and log-probs of both sides (J the same on
    both; ids distinct within a position; log-probs finite, checked by the caller); per_row as `topk_sums`."""
    J = s_ids.shape[-1]
    rows = mask.reshape(-1).nonzero().squeeze(1)
    a_ids, b_ids = s_ids.reshape(-1, J), t_ids.reshape(-1, J)
    a_lp, b_lp = s_lp.reshape(-1, J), t_lp.reshape(-1, J)
    f64 = torch.float64
    acc = torch.zeros(len(TOPK_SUM_NAMES) - 1, dtype=f64, device=mask.device)
    rows_acc = torch.zeros(mask.shape[0], len(TOPK_SUM_NAMES), dtype=f64, device=mask.device) \
        if per_row is not None else None
    for lo in range(0, len(rows), CHUNK):
        r = rows[lo:lo + CHUNK]
        a_id, b_id = a_ids[r], b_ids[r]
        a, b = a_lp[r].to(f64), b_lp[r].to(f64)
        eq = a_id[:, :, None] == b_id[:, None, :]  # [c, J, J]
        shared = eq.any(2)
        b_m = torch.where(eq, b[:, None, :], 0.0).sum(2)  # the trainer's log-prob of each shared sampler id
        ps, pt = torch.exp(a), torch.exp(b)
        pt_m = torch.where(shared, torch.exp(b_m), 0.0)
        ps_m = torch.where(shared, ps, 0.0)
        ms, mt = ps_m.sum(1), pt_m.sum(1)
        n_i = shared.sum(1)
        l1 = (ps_m - pt_m).abs_().sum(1)
        many = n_i >= 2
        safe_ms, safe_mt = torch.where(many, ms, 1.0), torch.where(many, mt, 1.0)
        shift = (torch.log(safe_ms) - torch.log(safe_mt))[:, None]
        kl = torch.where(shared, (ps_m / safe_ms[:, None]) * ((a - b_m) - shift), 0.0).sum(1)
        kl = torch.where(many, kl, 0.0)
        agree = a_id.gather(1, a.argmax(1, keepdim=True)) == b_id.gather(1, b.argmax(1, keepdim=True))
        acc += torch.stack([n_i.sum().to(f64) / J, agree.sum().to(f64), ps.sum(), pt.sum(), kl.sum(),
                            0.5 * l1.sum() + 0.5 * (ms - mt).abs().sum(),
                            0.5 * l1.sum() + 0.5 * (1.0 - ms).sum() + 0.5 * (1.0 - mt).sum()])
        if rows_acc is not None:  # the same terms per position, added to the position's row
            terms = torch.stack([torch.ones_like(ms), n_i.to(f64) / J, agree.squeeze(1).to(f64), ps.sum(1),
                                 pt.sum(1), kl, 0.5 * l1 + 0.5 * (ms - mt).abs(),
                                 0.5 * l1 + 0.5 * (1.0 - ms) + 0.5 * (1.0 - mt)], 1)
            rows_acc.index_add_(0, r // mask.shape[1], terms)
    if rows_acc is not None:
        per_row[:] = rows_acc.cpu().numpy()
    return _row([float(len(rows))] + acc.tolist())


def seq_topk_columns(per_row: np.ndarray, row_samples: np.ndarray, samples: np.ndarray) -> dict[str, np.ndarray]:
    """summary_seq's TOPK_SUMS columns for the sequences `samples` from the [B, N_SUMS] sums of `topk_sums`'
    per_row, row b holding sequence row_samples[b]."""
    order = np.argsort(row_samples, kind="stable")
    v = per_row[order[np.searchsorted(row_samples[order], samples)]]
    return {name: np.rint(v[:, j]).astype(np.int64) if name.startswith("n_") else v[:, j]
            for j, name in enumerate(TOPK_SUM_NAMES)}


def weight_diff(se: torch.Tensor, te: torch.Tensor, sw: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
    """Σ_k |w_s(e_k) − w_t(e_k)| per [..., K] row of expert ids and float64 weights, the trainer's weights matched
    to the sampler's by expert id (meaningful where the two id sets are equal: the caller keeps those rows)."""
    eq = se[..., :, None] == te[..., None, :]
    matched = torch.where(eq, tw[..., None, :], 0.0).sum(-1)
    return (sw - matched).abs_().sum(-1)
