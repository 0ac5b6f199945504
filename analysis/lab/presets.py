"""The drift lab's settings and presets, importable without torch (the app's Lab page lists them cheaply)."""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_NAMES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class LabConfig:
    sampler_dtype: str = "bf16"
    trainer_dtype: str = "fp32"
    fp32_head: bool = False       # LM head matmul + log_softmax in fp32, both sides
    fp32_router: bool = False     # router logits in fp32, both sides
    replay: bool = False          # routing replay: the trainer uses the sampler's experts
    lag: int = 0                  # the trainer's weights are `lag` optimizer updates newer than the sampler's
    steps: int = 8
    batch: int = 32               # sequences per step, decoded together by the sampler
    trainer_micro_batch: int = 8  # the trainer's forward batch; differs from the sampler's on purpose
    prompt_len: int = 6
    response_len: int = 24
    lr: float = 1e-3
    vocab: int = 512
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    n_experts: int = 8
    top_k: int = 2

    def __post_init__(self):
        for name in ("sampler_dtype", "trainer_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(f"{name}: expected one of {sorted(DTYPE_NAMES)}, got {getattr(self, name)!r}")
        for name in ("steps", "batch", "trainer_micro_batch", "prompt_len", "response_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.lag < 0:
            raise ValueError(f"lag: expected >= 0, got {self.lag}")


PRESETS: dict[str, LabConfig] = {
    "bf16": LabConfig(),
    "fp16": LabConfig(sampler_dtype="fp16"),
    "fp32": LabConfig(sampler_dtype="fp32"),
    "bf16-fp32-head": LabConfig(fp32_head=True),
    "bf16-replay": LabConfig(replay=True),
    "bf16-async": LabConfig(lag=1),
}
