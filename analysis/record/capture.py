"""Record each MoE layer's top-k expert ids during a forward, via forward hooks on the routers, as
[B, T, L, K] tensors for `DriftLogger.log_step(sampler_experts=..., trainer_experts=...)`.

    with RouterCapture(model) as cap:             # Mixtral / Qwen2-MoE / Qwen3-MoE style: finds `*.gate`
        logits = model(input_ids).logits          # (B, T, V)
    experts = response_experts(cap.experts(), prompt_len, response_len)   # (B, R, L, K)
    margins = response_margins(cap.margins(), prompt_len, response_len)   # (B, R, L) router margins

Routing of response token j is the router's choice at position P + j - 1, the last input position
before it (SCHEMA.md), hence `response_experts`.
"""
from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import nn


class RouterCapture:
    """Forward hooks that record the top-k expert ids of each router, per forward of `model`.

    Args:
        model: the module whose forward calls the routers (each call of `model` is one recorded forward).
        names: qualified module names of the modules to hook ('*' matches one name component, e.g.
            "blocks.*.moe"),
            in layer order. Default: every submodule called `gate` whose parent holds `experts` (Hugging
            Face sparse-MoE blocks), which skips dense MLPs and Qwen2-MoE's `shared_expert_gate`.
        top_k: experts per token, needed when a hooked module returns router logits; default: the
            module's or its parent's `top_k`, else `model.config.num_experts_per_tok`.

    What a hooked module may return: router logits (..., E) (an `nn.Linear` gate: top-k of the fp32
    softmax, as Mixtral/Qwen compute it), integer ids (..., K), or a tuple holding the ids (transformers 5
    routers return (logits, weights, ids); a MoE block may return (output, ids)).
    """

    def __init__(self, model: nn.Module, names: Sequence[str] | None = None, top_k: int | None = None):
        self.model = model
        modules = dict(model.named_modules())
        if names is None:
            chosen = [n for n, m in modules.items()
                      if n.rsplit(".", 1)[-1] == "gate" and hasattr(modules.get(n.rpartition(".")[0]), "experts")]
            if not chosen:
                raise ValueError("no MoE router found (no submodule named 'gate' beside 'experts'); pass "
                                 "names=[...] with the router or MoE-block module names and top_k")
        else:
            chosen = []
            for pattern in names:
                # '*' stands for one name component: "blocks.*.moe" matches "blocks.3.moe", not deeper modules
                rx = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
                hits = [n for n in modules if rx.fullmatch(n)]
                if not hits:
                    raise ValueError(f"no module named {pattern!r} in the model (e.g. {list(modules)[1:4]})")
                chosen += [n for n in hits if n not in chosen]
        self.layer_names: list[str] = chosen
        default_k = top_k or getattr(getattr(model, "config", None), "num_experts_per_tok", None)
        self._k = [top_k or getattr(modules[n], "top_k", None)
                   or getattr(modules.get(n.rpartition(".")[0]), "top_k", None) or default_k for n in chosen]
        self._modules = [modules[n] for n in chosen]
        self._handles: list = []
        self._active: list[torch.Tensor | None] | None = None
        self._shape: tuple[int, int] | None = None
        self.forwards: list[torch.Tensor] = []  # one (B, T, L, K) int64 tensor per forward of `model`
        # one (B, T, L) fp32 tensor of router margins per forward (None where a router gave ids without logits)
        self.margin_forwards: list[torch.Tensor | None] = []
        self._active_margins: list[torch.Tensor | None] = []

    # -- hooks -------------------------------------------------------------------------------------
    def __enter__(self) -> "RouterCapture":
        self._handles.append(self.model.register_forward_pre_hook(self._start, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._finish, with_kwargs=True))
        for i, m in enumerate(self._modules):
            self._handles.append(m.register_forward_hook(self._make_hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        self.forwards.clear()
        self.margin_forwards.clear()

    def _start(self, module, args, kwargs):
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        self._shape = tuple(x.shape[:2]) if isinstance(x, torch.Tensor) and x.ndim >= 2 else None
        self._active = [None] * len(self._modules)
        self._active_margins = [None] * len(self._modules)

    def _finish(self, module, args, kwargs, output):
        active, self._active = self._active, None
        missing = [self.layer_names[i] for i, v in enumerate(active or []) if v is None]
        if missing:
            parent = missing[0].rpartition(".")[0] or missing[0]
            raise RuntimeError(f"RouterCapture: {missing[0]} was not called during this forward (the router "
                               f"computed without calling it?); hook a module that is called, e.g. "
                               f"names=[{parent!r}] if it returns the chosen expert ids")
        self.forwards.append(torch.stack(active, dim=2))  # (B, T, L, K)
        margins = self._active_margins
        self.margin_forwards.append(torch.stack(margins, dim=2) if all(m is not None for m in margins) else None)

    def _make_hook(self, i: int):
        def hook(module, args, output):
            # Router calls outside a forward of `model` (e.g. activation-checkpoint recompute in backward)
            # are not new positions: ignore them.
            if self._active is None or self._active[i] is not None:
                return
            self._active[i] = self._ids(i, output)
        return hook

    def _ids(self, i: int, output) -> torch.Tensor:
        ids, logits = None, None
        for x in (output if isinstance(output, (tuple, list)) else (output,)):
            if not isinstance(x, torch.Tensor):
                continue
            if ids is None and not x.is_floating_point() and x.dtype != torch.bool:
                ids = x
            elif logits is None and x.is_floating_point():
                logits = x
        if ids is None:
            if logits is None:
                raise TypeError(f"RouterCapture: {self.layer_names[i]} returned {type(output).__name__}, "
                                "expected router logits or expert ids")
            k = self._k[i]
            if not k:
                raise ValueError(f"RouterCapture: top_k unknown for {self.layer_names[i]}; pass top_k=")
            # fp32 softmax then top-k, as the HF MoE blocks do: the ranking the model itself uses
            ids = torch.topk(torch.softmax(logits.detach().float(), dim=-1), k, dim=-1).indices
        ids = ids.detach().to(device="cpu", dtype=torch.int64)
        margin = router_margin(logits, ids.shape[-1]) if logits is not None else None
        if ids.ndim == 2:  # (B*T, K): routers see flattened tokens
            if self._shape is None or ids.shape[0] != self._shape[0] * self._shape[1]:
                raise RuntimeError(f"RouterCapture: {self.layer_names[i]} saw {ids.shape[0]} tokens; cannot "
                                   f"reshape to the forward's (batch, tokens) = {self._shape}")
            ids = ids.reshape(*self._shape, ids.shape[-1])
        if margin is not None and margin.numel() == ids.shape[0] * ids.shape[1]:
            self._active_margins[i] = margin.reshape(ids.shape[:2])
        if ids.ndim != 3:
            raise RuntimeError(f"RouterCapture: {self.layer_names[i]} gave ids of shape {list(ids.shape)}, "
                               "expected (tokens, k) or (batch, tokens, k)")
        return ids

    # -- results -----------------------------------------------------------------------------------
    def experts(self) -> torch.Tensor:
        """(B, T, L, K) expert ids of every input position, L = hooked layers in `layer_names` order.

        Several forwards (a prefill, then one decode step per token with a KV cache) are joined along the
        token axis: position p's row is then the routing that produced token p + 1.
        """
        if not self.forwards:
            raise RuntimeError("RouterCapture: no forward of the model was recorded")
        batch = {f.shape[0] for f in self.forwards}
        if len(batch) != 1:
            raise RuntimeError(f"RouterCapture: forwards with different batch sizes {sorted(batch)}; read "
                               "`.forwards` one by one (or call .clear() between micro-batches)")
        return torch.cat(self.forwards, dim=1)

    def margins(self) -> torch.Tensor:
        """(B, T, L) fp32 router margins of every input position (`router_margin`), joined over forwards as
        `experts()`: for DriftLogger.log_step(trainer_margins=...). Needs every hooked router to return its
        logits (a module that returns only expert ids has no scores to take a margin of)."""
        self.experts()  # the same checks: a forward recorded, one batch size
        if any(m is None for m in self.margin_forwards):
            raise RuntimeError("RouterCapture: a hooked module returned expert ids without router logits (or has "
                               "no (k+1)-th expert): no margin; hook the router (gate) that returns the logits")
        return torch.cat(self.margin_forwards, dim=1)


def router_margin(logits: torch.Tensor, k: int) -> torch.Tensor | None:
    """METRICS.md v3 router margin of each token: the k-th minus the (k+1)-th largest probability of the fp32
    softmax of its router logits (..., E), as fp32 on the CPU; None where the router has no (k+1)-th expert."""
    if logits.shape[-1] <= k:
        return None
    top = torch.topk(torch.softmax(logits.detach().float(), dim=-1), k + 1, dim=-1).values
    return (top[..., k - 1] - top[..., k]).to("cpu")


def response_margins(margins: torch.Tensor, prompt_lengths: int | torch.Tensor, response_length: int) -> torch.Tensor:
    """(B, R, L) router margins of each response token from `RouterCapture.margins()`, as `response_experts`."""
    return response_experts(margins[..., None], prompt_lengths, response_length)[..., 0]


def gather_positions(experts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out[b, j] = experts[b, rows[b, j]] for (B, T, L, K) experts and (B, R) row indices; -1 where a row is
    outside [0, T) (mask those tokens out)."""
    B, T = experts.shape[:2]
    rows = torch.as_tensor(rows, dtype=torch.long)
    valid = (rows >= 0) & (rows < T)
    idx = rows.clamp(0, T - 1)
    out = experts[torch.arange(B)[:, None], idx]  # (B, R, L, K)
    return torch.where(valid[:, :, None, None], out, torch.full_like(out, -1))


def response_experts(experts: torch.Tensor, prompt_lengths: int | torch.Tensor, response_length: int) -> torch.Tensor:
    """(B, R, L, K) routing of each response token: row j of sample b is experts[b, P_b + j - 1].

    Args:
        experts: (B, T, L, K) from `RouterCapture.experts()` over prompt + response.
        prompt_lengths: P (int, e.g. the padded prompt width of a left-padded batch) or (B,) per sample,
            the position of response token 0 in each row.
        response_length: R.
    """
    P = torch.as_tensor(prompt_lengths, dtype=torch.long).reshape(-1, 1)
    rows = P - 1 + torch.arange(response_length)[None, :]
    return gather_positions(experts, rows.expand(experts.shape[0], -1))
