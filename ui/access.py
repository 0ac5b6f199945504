"""What a deployment allows: viewer mode (DRIFT_READ_ONLY=1 hides every action that changes the database: upload,
delete, config edit, lab runs) and the upload size cap. One place decides, so a hosted deployment can harden it
without touching the pages."""
from __future__ import annotations

from typing import Mapping, Sequence

from analysis import settings

MiB = settings.MiB

VIEWER_MESSAGE = ("This Driftscope is in viewer mode (DRIFT_READ_ONLY=1): uploads, deletions, config edits and "
                  "lab runs are switched off. Run your own copy to load data: `streamlit run app.py`.")


def read_only() -> bool:
    """True when the app must not change the database."""
    return settings.READ_ONLY.read()


def writable() -> bool:
    return not read_only()


def demo_disabled() -> bool:
    """DRIFT_NO_DEMO=1: an empty database stays empty (tests of empty states, deployments without demo)."""
    return settings.NO_DEMO.read()


def max_upload_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The most one upload (all files picked for one Load, summed) may hold, in bytes: DRIFT_MAX_UPLOAD_MB, default
    1024. A value that is not a positive number is a SettingError (the app refuses to start), never a lifted cap."""
    return settings.MAX_UPLOAD.read(environ)


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def upload_refusal(sizes: Sequence[int], cap: int) -> str | None:
    """Why an upload of files with these byte `sizes` is refused as a whole, or None when it fits under `cap`.

    >>> upload_refusal([3 * MiB, 1 * MiB], 4 * MiB) is None
    True
    >>> print(upload_refusal([3 * MiB, 2 * MiB], 4 * MiB))  # doctest: +NORMALIZE_WHITESPACE
    The upload holds 2 files of 5.0 MiB together, over this server's cap of 4.0 MiB per upload
    (DRIFT_MAX_UPLOAD_MB). Load fewer files at once, or split them.
    """
    total = sum(sizes)
    if total <= cap:
        return None
    files = "1 file" if len(sizes) == 1 else f"{len(sizes)} files"
    together = "" if len(sizes) == 1 else " together"
    return (f"The upload holds {files} of {_mib(total)}{together}, over this server's cap of {_mib(cap)} per upload "
            "(DRIFT_MAX_UPLOAD_MB). Load fewer files at once, or split them.")

