"""Runs sampled from processed distributions (numpy): the logging checks' synthetic sampler/trainer pairs."""
from __future__ import annotations

import numpy as np
import polars as pl


def softmax_log(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def processed(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """Log-probs after temperature, top-k and top-p, in that order (as transformers' warpers apply them)."""
    z = logits / temperature
    if top_k:
        kth = np.sort(z, -1)[..., -top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    if top_p < 1.0:
        lp = softmax_log(z)
        order = np.argsort(-lp, -1)
        sorted_p = np.take_along_axis(np.exp(lp), order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p  # mass of the tokens ranked above
        drop = np.zeros_like(z, dtype=bool)
        np.put_along_axis(drop, order, before >= top_p, -1)
        z = np.where(drop, -np.inf, z)
    return softmax_log(z)


def synthetic_run(name: str, seed: int = 0, n_seq: int = 48, T: int = 32, V: int = 128, shift: bool = False,
                  **sampling) -> pl.DataFrame:
    """Tokens sampled from the sampler's (processed) distribution at each position, with the sampler's logged
    log-prob of the processed distribution and the trainer's of the raw one (its logits differ by bf16-sized
    noise); shift: the trainer's log-probs one position early, as an off-by-one gather gives."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n_seq, T, V)) * 3.0
    trainer = softmax_log(logits + rng.standard_normal(logits.shape) * 0.01)
    sampler = processed(logits, **sampling)
    u = rng.random((n_seq, T, 1))
    x = (np.cumsum(np.exp(sampler), -1) < u).sum(-1).clip(max=V - 1)
    s = np.take_along_axis(sampler, x[..., None], -1)[..., 0]
    t = np.take_along_axis(trainer, x[..., None], -1)[..., 0]
    if shift:
        t, s = t[:, 1:], s[:, :-1]
    B, n = s.shape
    return pl.DataFrame({"run": [name] * (B * n), "step": np.repeat(np.arange(B) // 16, n),
                         "sample": np.repeat(np.arange(B), n), "pos": np.tile(np.arange(n), B),
                         "sampler_logprob": s.ravel(), "trainer_logprob": t.ravel()})
