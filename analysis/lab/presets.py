"""The drift lab's settings and presets, importable without torch (the app's Lab page lists them cheaply)."""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_NAMES = ("bf16", "fp16", "fp32")
GROUP = 4  # answers sampled per prompt: the advantage compares a response with its group
REPLAY_MODES = ("none", "ids", "ids+weights")
# The corrections the policy-gradient loss can apply: METRICS.md "Corrections", the names and parameter defaults
# of analysis.metrics.corrections.METHODS (which holds veto too; the loss applies it as well).
CORRECTIONS = ("none", "tis", "icepop", "geo_rs", "seq_rs", "veto")


@dataclass(frozen=True)
class LabConfig:
    sampler_dtype: str = "bf16"
    trainer_dtype: str = "fp32"
    fp32_head: bool = False       # LM head matmul + log_softmax in fp32, both sides
    fp32_router: bool = False     # router logits in fp32, both sides
    replay: str = "none"          # routing replay: the trainer uses the sampler's expert ids ("ids"), or their
    #                               ids and combine weights ("ids+weights")
    lag: int = 0                  # the trainer's weights are `lag` optimizer updates newer than the sampler's
    correction: str = "none"      # off-policy correction in the policy-gradient loss (CORRECTIONS)
    correction_params: tuple = () # (name, value) pairs overriding the method's METRICS.md defaults
    steps: int = 200
    batch: int = 32               # sequences per step (8 prompts x 4 answers), decoded together by the sampler
    trainer_micro_batch: int = 16 # the trainer's forward batch; differs from the sampler's on purpose
    lr: float = 1e-3              # the RL phase's Adam learning rate
    sft_steps: int = 120          # supervised warm start (fp32, before step 0): a policy that is right sometimes
    sft_lr: float = 3e-3
    d_model: int = 64
    d_ff: int = 64                # hidden width of one expert
    n_heads: int = 4
    n_layers: int = 8
    n_experts: int = 8
    top_k: int = 2

    def __post_init__(self):
        for name in ("sampler_dtype", "trainer_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(f"{name}: expected one of {sorted(DTYPE_NAMES)}, got {getattr(self, name)!r}")
        for name in ("steps", "batch", "trainer_micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.batch % GROUP:
            raise ValueError(f"batch: expected a multiple of {GROUP} (answers per prompt), got {self.batch}")
        for name in ("lag", "sft_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"replay: expected one of {list(REPLAY_MODES)}, got {self.replay!r}")
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction: expected one of {list(CORRECTIONS)}, got {self.correction!r}")
        if self.correction == "none" and self.correction_params:
            raise ValueError("correction_params: given without a correction")


PRESETS: dict[str, LabConfig] = {
    "bf16": LabConfig(),
    "fp16": LabConfig(sampler_dtype="fp16"),
    "fp32": LabConfig(sampler_dtype="fp32"),
    "bf16-fp32-head": LabConfig(fp32_head=True),
    "bf16-replay": LabConfig(replay="ids"),
    "bf16-replay-weights": LabConfig(replay="ids+weights"),
    "bf16-async": LabConfig(lag=1),
    # the same seed as bf16-async with a correction in the loss (METRICS.md defaults): the Overview shows them
    # side by side
    "bf16-async-icepop": LabConfig(lag=1, correction="icepop"),
    "bf16-async-geo-rs": LabConfig(lag=1, correction="geo_rs"),
}
