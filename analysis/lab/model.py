"""A tiny mixture-of-experts GPT for the drift lab: one file, nanoGPT-style, with a KV cache for decoding.

The same weights run in any dtype; the precision choices that matter for sampler/trainer drift are explicit:
the router's top-k softmax always runs in fp32, and two switches put the router logits and the LM head
(matmul + log_softmax) in fp32 whatever the model dtype is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    # Defaults: a generic small MoE GPT (a 512-id vocabulary, 4 layers) for code that builds one without a lab
    # configuration; the lab passes its own sizes (LabConfig and the task: run.model_config).
    vocab: int = 512
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    n_experts: int = 8
    top_k: int = 2
    max_len: int = 64
    d_ff: int = 128             # hidden width of one expert
    fp32_lm_head: bool = False  # head matmul + log_softmax in fp32 (MiniMax-M1-style mitigation)
    fp32_router: bool = False   # router logits in fp32

    def __post_init__(self):
        for name in ("vocab", "d_model", "n_heads", "n_layers", "n_experts", "top_k", "max_len", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}: expected a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.top_k > self.n_experts:
            raise ValueError(f"GPTConfig: top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")


class KVCache:
    """Keys and values of every layer for the positions decoded so far: per layer (B, nh, T, hs)."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    def length(self, layer: int = 0) -> int:
        return 0 if self.k[layer] is None else self.k[layer].size(2)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer: int) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        past = 0 if cache is None else cache.length(layer)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, nh, past + T, hs)
        # A decoding step (T == 1) attends to every cached position; a prefill or full forward is causal.
        if past and T > 1:
            raise ValueError("KV cache: after the prefill, decode one position at a time")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=(past == 0 and T > 1))  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class Expert(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc(x)))


class MoE(nn.Module):
    """Gate -> torch.topk -> fp32 softmax over the k chosen scores -> weighted sum of the chosen experts."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.fp32_router = cfg.fp32_router
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None,
                forced_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output, the chosen experts (B, T, k) and their combine weights (B, T, k) fp32.

        forced: (B, T, k) expert ids to use instead of the top-k (routing replay). forced_weights: (B, T, k)
        combine weights to use as well (replay of ids+weights): the forward then uses exactly these values, while
        the gradient still flows through this model's own softmax (a straight-through replacement), so the
        router keeps learning as it does under plain ids replay.
        """
        B, T, C = x.size()
        flat = x.view(B * T, C)
        if self.fp32_router:  # the gate weight is kept in fp32 by GPT.cast_params
            scores = F.linear(flat.float(), self.gate.weight.float())  # (B*T, n_experts) fp32
        else:
            scores = self.gate(flat)  # (B*T, n_experts) in the model dtype: near-ties flip under bf16
        if forced is None:
            top_scores, chosen = torch.topk(scores, self.top_k, dim=-1)  # (B*T, k)
        else:  # routing replay: the experts are given, only their weights are computed here
            chosen = forced.reshape(B * T, self.top_k).to(device=x.device, dtype=torch.long)
            top_scores = scores.gather(-1, chosen)
        weights32 = F.softmax(top_scores, dim=-1, dtype=torch.float32)  # (B*T, k)
        if forced_weights is not None:
            given = forced_weights.reshape(B * T, self.top_k).to(device=x.device, dtype=torch.float32)
            weights32 = weights32 + (given - weights32).detach()
        weights = weights32.to(x.dtype)
        # Every expert runs on every token and an unchosen one gets weight 0: the same function as a sparse
        # dispatch, as two matmuls over the experts side by side (at this size ops, not FLOPs, cost time).
        # The combine weight scales an expert's hidden units, before its output matmul (a linear map, so the
        # same sum as weighting the expert's output, in another order of rounding).
        dense = torch.zeros(B * T, len(self.experts), dtype=x.dtype, device=x.device)  # (N, E)
        dense.scatter_(1, chosen, weights)
        w1 = torch.cat([e.fc.weight for e in self.experts])        # (E * d_ff, C)
        b1 = torch.cat([e.fc.bias for e in self.experts])          # (E * d_ff,)
        w2 = torch.cat([e.out.weight for e in self.experts], 1)    # (C, E * d_ff)
        b2 = torch.stack([e.out.bias for e in self.experts])       # (E, C)
        h = F.relu(F.linear(flat, w1, b1)).view(B * T, len(self.experts), -1)  # (N, E, d_ff)
        out = F.linear((h * dense[:, :, None]).flatten(1), w2) + dense @ b2    # (N, C)
        return out.view(B, T, C), chosen.view(B, T, self.top_k), weights32.detach().view(B, T, self.top_k)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, x, cache, layer, forced, forced_weights):
        x = x + self.attn(self.ln_1(x), cache, layer)
        moe_out, chosen, weights = self.moe(self.ln_2(x), forced, forced_weights)
        return x + moe_out, chosen, weights


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 init (normal 0.02, zero biases), seeded by `generator` when given."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02, generator=generator)
        n_layers, d_model = self.cfg.n_layers, self.cfg.d_model
        for block in self.blocks:  # scaled init of the residual projections
            nn.init.normal_(block.attn.proj.weight, std=0.02 / math.sqrt(2 * n_layers), generator=generator)
            # A larger gate than GPT-2's 0.02 spreads the router scores like a trained router's.
            nn.init.normal_(block.moe.gate.weight, std=1.0 / math.sqrt(d_model), generator=generator)
        # A larger head gives the untrained model peaked next-token distributions, like a pretrained policy.
        nn.init.normal_(self.lm_head.weight, std=1.0 / math.sqrt(d_model), generator=generator)

    def fp32_param_names(self) -> set[str]:
        """Parameters that stay fp32 whatever the compute dtype, as the precision switches say."""
        keep = set()
        if self.cfg.fp32_lm_head:
            keep.add("lm_head.weight")
        if self.cfg.fp32_router:
            keep.update(f"blocks.{i}.moe.gate.weight" for i in range(self.cfg.n_layers))
        return keep

    def cast_params(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Parameters cast to `dtype` (differentiable, for torch.func.functional_call), switches respected."""
        keep = self.fp32_param_names()
        return {n: p.float() if n in keep else p.to(dtype) for n, p in self.named_parameters()}

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                forced_experts: list[torch.Tensor | None] | None = None,
                forced_weights: list[torch.Tensor | None] | None = None, with_weights: bool = False):
        """Next-token log-probs and the router's choices for every input position.

        idx: (B, T) token ids, at positions past ... past + T - 1 (past = cache.length(), 0 without cache).
        forced_experts: per layer None or (B, T, k) expert ids to use instead of the router's top-k.
        forced_weights: per layer None or (B, T, k) combine weights to replay with them (MoE.forward).
        Returns logprobs (B, T, vocab), fp32 when fp32_lm_head else in the model dtype,
        and experts (B, T, n_layers, k) int64; with_weights adds the combine weights (B, T, n_layers, k) fp32.
        """
        B, T = idx.size()
        past = 0 if cache is None else cache.length()
        if past + T > self.cfg.max_len:
            raise ValueError(f"sequence length {past + T} exceeds max_len {self.cfg.max_len}")
        pos = torch.arange(past, past + T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        chosen, combine = [], []
        for layer, block in enumerate(self.blocks):
            forced = None if forced_experts is None else forced_experts[layer]
            forced_w = None if forced_weights is None else forced_weights[layer]
            x, layer_chosen, layer_weights = block(x, cache, layer, forced, forced_w)
            chosen.append(layer_chosen)  # (B, T, k)
            combine.append(layer_weights)
        x = self.ln_f(x)
        if self.cfg.fp32_lm_head:
            logits = F.linear(x.float(), self.lm_head.weight.float())  # (B, T, vocab) fp32
            logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        else:  # head and log_softmax in the model dtype, as an unmodified inference engine does
            logprobs = F.log_softmax(self.lm_head(x), dim=-1)
        if with_weights:
            return logprobs, torch.stack(chosen, dim=2), torch.stack(combine, dim=2)
        return logprobs, torch.stack(chosen, dim=2)  # (B, T, vocab), (B, T, L, k)
