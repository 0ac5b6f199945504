"""Old import path of RouterCapture, kept for one release: use `from analysis.record import RouterCapture`."""
import warnings

from analysis.record.capture import RouterCapture  # noqa: F401 (re-exported)

warnings.warn("analysis.capture moved to analysis.record (from analysis.record import RouterCapture); "
              "the old path goes in the next release", DeprecationWarning, stacklevel=2)
