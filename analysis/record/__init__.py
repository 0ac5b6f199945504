"""The trainer side: what a training loop calls to log drift (DriftLogger), the torch summaries it writes
at the trainer (summaries.py), the token sample it keeps (token_sample.py), and the MoE router hook
(RouterCapture, capture.py).

    from analysis.record import DriftLogger, RouterCapture

Both load torch on first use of this package's names, not at `import analysis.record`.
"""
from __future__ import annotations

__all__ = ["DriftLogger", "RouterCapture"]


def __getattr__(name: str):
    if name == "DriftLogger":
        from analysis.record.logger import DriftLogger
        return DriftLogger
    if name == "RouterCapture":
        from analysis.record.capture import RouterCapture
        return RouterCapture
    raise AttributeError(f"module 'analysis.record' has no attribute {name!r}")
