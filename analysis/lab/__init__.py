"""The drift lab: a tiny MoE GPT trained by RL on CPU (sort or reverse a word) to show real sampler/trainer drift.

`PRESETS` and `LabConfig` import without torch; `run_lab` loads torch on first use.
"""
from analysis.lab.presets import CORRECTIONS, PRESETS, REPLAY_MODES, LabConfig

__all__ = ["CORRECTIONS", "PRESETS", "REPLAY_MODES", "LabConfig", "run_lab"]


def __getattr__(name: str):
    if name == "run_lab":
        from analysis.lab.run import run_lab
        return run_lab
    raise AttributeError(f"module 'analysis.lab' has no attribute {name!r}")
