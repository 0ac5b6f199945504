"""Run names that can be folder names: the one pattern the logger, the lake writer and the app's run namer share.

Torch-free on purpose: the app imports it at start-up (analysis/metrics/dashboard.py), where the logger's torch must not load.
"""
from __future__ import annotations

import re

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")


def safe_run_name(run: str) -> str:
    """Return `run` unchanged if it can be a directory name; else raise ValueError suggesting a slug.

    Letters, digits and `. _ + = -`, at most 128 characters, starting with a letter or digit, no "..".
    """
    if isinstance(run, str) and _RUN_NAME.fullmatch(run) and ".." not in run:
        return run
    slug = run_name_slug(str(run))
    raise ValueError(f"run name {run!r} cannot be used as a directory name: use letters, digits and "
                     f"'._+=-' (no path separators, no '..'), for example {slug!r}")


def run_name_slug(text: str) -> str:
    """`text` made into a name safe_run_name accepts: other characters become '-', at most 128 characters.

    >>> run_name_slug("bf16 run #2")
    'bf16-run-2'
    """
    return re.sub(r"[^A-Za-z0-9._+=-]+", "-", text).replace("..", "-").strip(".-_")[:128] or "run"
