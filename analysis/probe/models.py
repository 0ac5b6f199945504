"""The models the probe runs, behind one small interface: any Hugging Face causal LM, and the drift lab's GPT.

A `Target` knows its decoder blocks and, in each, the attention, the MoE/MLP and the router (None in a dense
block), and runs three ways: a prefill that returns a KV cache, one decoding step on that cache, and a full
teacher-forced forward. `Recorder` hooks the four ops of every block of one Target.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

LAB = "lab"  # --model lab: the drift lab's GPT (analysis/lab/model.py) at the lab's default size
ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "moe")
ROUTER_NAMES = ("gate", "router")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ModelError(ValueError):
    """A model the probe cannot build or run; the message names the path and what to change."""


@dataclass
class Layer:
    block: nn.Module
    attn: nn.Module
    mlp: nn.Module
    router: nn.Module | None  # None: a dense block


def _first(out):
    """A module's main output: the first element of a tuple (attention returns (output, weights), some MoE
    blocks (output, router_logits)), else the output itself."""
    return out[0] if isinstance(out, (tuple, list)) else out


class Target:
    """One model in one dtype. `logits` of the three calls are (T, vocab) for a single sequence."""

    name: str
    model: nn.Module
    layers: list[Layer]
    top_k: int | None
    n_experts: int | None  # what a router's logits must be as wide as (None: not stated by the config)

    def cast(self, dtype: torch.dtype) -> "Target":
        raise NotImplementedError

    def prefill(self, ids: torch.Tensor):
        raise NotImplementedError

    def decode(self, token: torch.Tensor, cache):
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LabTarget(Target):
    """The drift lab's GPT: its log-probs serve as logits (a log_softmax of them is the same distribution)."""

    def __init__(self, model, name: str = LAB):
        self.model, self.name = model.eval(), name
        self.top_k, self.n_experts = model.cfg.top_k, model.cfg.n_experts
        self.layers = [Layer(b, b.attn, b.moe, b.moe.gate) for b in model.blocks]

    @classmethod
    def build(cls, seed: int, max_len: int, device: torch.device) -> "LabTarget":
        from analysis.lab.model import GPT, GPTConfig
        with torch.random.fork_rng(devices=[]):  # the constructor draws from the global RNG; init_weights reseeds
            model = GPT(GPTConfig(max_len=max(64, max_len)))
        model.init_weights(torch.Generator().manual_seed(seed))
        return cls(model.to(device).requires_grad_(False))

    def cast(self, dtype):
        return LabTarget(copy.deepcopy(self.model).to(dtype), self.name)

    def prefill(self, ids):
        from analysis.lab.model import KVCache
        cache = KVCache(self.model.cfg.n_layers)
        return self.model(ids[None], cache)[0][0], cache

    def decode(self, token, cache):
        return self.model(token.view(1, 1), cache)[0][0], cache

    def forward(self, ids):
        return self.model(ids[None])[0][0]


def _cache(out):
    """The KV cache of a transformers output (`cache` since 5.x, `past_key_values` before)."""
    return out.cache if "cache" in out else out.past_key_values


class HFTarget(Target):
    """A transformers AutoModelForCausalLM. Decoder blocks: the first ModuleList as long as the config's
    num_hidden_layers; in each, attention / MLP / router found by their usual attribute names."""

    def __init__(self, model, name: str):
        self.model, self.name = model.eval(), name
        cfg = model.config
        n = getattr(cfg, "num_hidden_layers", None)
        blocks = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n), None)
        if blocks is None:
            raise ModelError(f"{name}: no list of {n} decoder blocks found in {type(model).__name__}")
        self.layers = []
        for i, block in enumerate(blocks):
            attn = next((getattr(block, a) for a in ATTN_NAMES if isinstance(getattr(block, a, None), nn.Module)), None)
            mlp = next((getattr(block, a) for a in MLP_NAMES if isinstance(getattr(block, a, None), nn.Module)), None)
            if attn is None or mlp is None:
                raise ModelError(f"{name}: decoder block {i} ({type(block).__name__}) has no attention "
                                 f"({'/'.join(ATTN_NAMES)}) or MLP ({'/'.join(MLP_NAMES)}) submodule")
            router = next((getattr(mlp, a) for a in ROUTER_NAMES if isinstance(getattr(mlp, a, None), nn.Module)), None)
            self.layers.append(Layer(block, attn, mlp, router))
        self.top_k = next((getattr(cfg, a) for a in ("num_experts_per_tok", "moe_topk", "top_k")
                           if isinstance(getattr(cfg, a, None), int)), None)
        self.n_experts = next((getattr(cfg, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
                               if isinstance(getattr(cfg, a, None), int)), None)
        if any(layer.router is not None for layer in self.layers) and self.top_k is None:
            raise ModelError(f"{name}: the config names no top-k (num_experts_per_tok) for its routers")

    def cast(self, dtype):
        return HFTarget(copy.deepcopy(self.model).to(dtype), self.name)

    def prefill(self, ids):
        out = self.model(input_ids=ids[None], use_cache=True)
        return out.logits[0], _cache(out)

    def decode(self, token, cache):
        out = self.model(input_ids=token.view(1, 1), cache=cache, use_cache=True)
        return out.logits[0], _cache(out)

    def forward(self, ids):
        return self.model(input_ids=ids[None], use_cache=False).logits[0]


def load_target(spec: str, seed: int = 0, device: str | torch.device = "cpu", max_len: int = 64) -> Target:
    """`spec`: 'lab', a config.json file, or a folder with a config.json (and weights, or none: then a randomly
    initialised model, seeded). fp32 weights on `device`. Never runs code from the folder (no remote code)."""
    device = torch.device(device)
    if spec == LAB:
        return LabTarget.build(seed, max_len, device)
    path = Path(spec)
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"--model {spec}: no such file or folder with a config.json (or use --model lab)")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"{config_file}: not a readable JSON config ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ModelError(f"{config_file}: a Hugging Face config needs a 'model_type' string")
    import transformers
    weights = path.is_dir() and any(f.name.endswith(WEIGHT_SUFFIXES) for f in path.iterdir())
    try:
        if weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, local_files_only=True, trust_remote_code=False)
        else:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
            config = transformers.AutoConfig.for_model(raw["model_type"], **fields)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise ModelError(f"{config_file}: transformers cannot build a causal LM from it ({e})") from None
    return HFTarget(model.to(device).requires_grad_(False), path.name or str(path))


class Recorder:
    """Hooks on every block of a Target: per (layer, op) the activations of each call, (tokens, features).

    `perturb` = (layer, op, scale, seed) adds seeded Gaussian noise of `scale` times the activation's RMS to that
    op's output (op 'input', 'attn' or 'mlp'): the tests' planted divergence. Activations are kept on the CPU in
    their own dtype; `take()` hands them over, concatenated over calls, and clears them."""

    def __init__(self, target: Target, perturb: tuple[int, str, float, int] | None = None):
        self.records: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.handles = []
        noise = None
        if perturb is not None:
            layer, op, scale, seed = perturb
            if op not in ("input", "attn", "mlp") or not 0 <= layer < len(target.layers):
                raise ValueError(f"perturb: op input/attn/mlp of a layer in 0..{len(target.layers) - 1}, "
                                 f"got layer {layer} op {op!r}")
            gen = torch.Generator().manual_seed(seed)

            def noise(x):
                n = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device)
                rms = x.float().pow(2).mean().sqrt()
                return x + (scale * rms * n).to(x.dtype)
        for i, layer in enumerate(target.layers):
            if noise is not None and perturb[0] == i:
                self._perturb(layer, perturb[1], noise)
            self.handles.append(layer.block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(layer.attn.register_forward_hook(self._post(i, "attn")))
            if layer.router is not None:
                self.handles.append(layer.router.register_forward_hook(self._post(i, "router")))
            self.handles.append(layer.mlp.register_forward_hook(self._post(i, "mlp")))

    def _perturb(self, layer: Layer, op: str, noise) -> None:
        if op == "input":
            def pre(module, args, kwargs):
                if args:
                    return (noise(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": noise(kwargs["hidden_states"])}
            self.handles.append(layer.block.register_forward_pre_hook(pre, with_kwargs=True))
            return

        def post(module, args, out):
            if isinstance(out, tuple):
                return (noise(out[0]), *out[1:])
            return noise(out)
        self.handles.append((layer.attn if op == "attn" else layer.mlp).register_forward_hook(post))

    def _keep(self, key, x: torch.Tensor) -> None:
        self.records.setdefault(key, []).append(x.detach().reshape(-1, x.shape[-1]).to("cpu", copy=True))

    def _pre(self, i):
        def hook(module, args, kwargs):
            self._keep((i, "input"), args[0] if args else kwargs["hidden_states"])
        return hook

    def _post(self, i, op):
        def hook(module, args, out):
            self._keep((i, op), _first(out))
        return hook

    def take(self) -> dict[tuple[int, str], torch.Tensor]:
        out = {k: torch.cat(v) for k, v in self.records.items()}
        self.records = {}
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
