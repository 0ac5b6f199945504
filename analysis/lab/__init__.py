"""The drift lab: a tiny MoE GPT sampled and retrained on CPU to show real sampler/trainer drift.

`PRESETS` and `LabConfig` import without torch; `run_lab` loads torch on first use.
"""
from analysis.lab.presets import PRESETS, LabConfig

__all__ = ["PRESETS", "LabConfig", "run_lab"]


def __getattr__(name: str):
    if name == "run_lab":
        from analysis.lab.run import run_lab
        return run_lab
    raise AttributeError(f"module 'analysis.lab' has no attribute {name!r}")
