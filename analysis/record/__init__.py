"""The trainer side: what a training loop calls to log drift (DriftLogger), the torch summaries it writes
at the trainer (summaries.py), the token sample it keeps (token_sample.py), and the MoE router hook
(RouterCapture, capture.py); add_drift_logging (trl.py) wires TRL's GRPOTrainer to DriftLogger.

    from analysis.record import DriftLogger, RouterCapture, add_drift_logging

They load torch on first use of this package's names, not at `import analysis.record` (and TRL only when
add_drift_logging is called).
"""
from __future__ import annotations

__all__ = ["DriftLogger", "RouterCapture", "add_drift_logging"]


def __getattr__(name: str):
    if name == "DriftLogger":
        from analysis.record.logger import DriftLogger
        return DriftLogger
    if name == "RouterCapture":
        from analysis.record.capture import RouterCapture
        return RouterCapture
    if name == "add_drift_logging":
        from analysis.record.trl import add_drift_logging
        return add_drift_logging
    raise AttributeError(f"module 'analysis.record' has no attribute {name!r}")
