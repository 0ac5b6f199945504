"""Old import path of DriftLogger, kept for one release: use `from analysis.record import DriftLogger`."""
import warnings

from analysis.record.logger import DriftLogger, encodings  # noqa: F401 (re-exported)

warnings.warn("analysis.logger moved to analysis.record (from analysis.record import DriftLogger); "
              "the old path goes in the next release", DeprecationWarning, stacklevel=2)
