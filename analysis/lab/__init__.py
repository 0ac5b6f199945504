"""The drift lab: a tiny MoE GPT sampled and retrained on CPU to show real sampler/trainer drift (issue 4)."""
from analysis.lab.run import PRESETS, LabConfig, run_lab

__all__ = ["PRESETS", "LabConfig", "run_lab"]
