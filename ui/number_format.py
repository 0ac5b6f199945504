"""Numbers as the pages print them: shares that stay truthful when tiny, and log-axis tick labels.

Pure functions (no plotly, no streamlit) so that the text a user reads is tested directly. Tick formats are
d3-format strings of the "%" type with a fixed number of decimals, which Python's format() writes the same way.
"""
from __future__ import annotations

import math


def share_decimals(v: float, significant: int = 2) -> int:
    """Decimals of a percentage that keep `significant` digits of the share `v` (at least 0).

    >>> share_decimals(0.25), share_decimals(2.3e-5), share_decimals(0.004)
    (0, 4, 2)
    """
    pct = abs(v) * 100
    if not pct or not math.isfinite(pct):
        return 0
    return max(0, significant - 1 - math.floor(math.log10(pct)))


def fmt_share(v: float | None, n: int | None = None) -> str:
    """A share as a percentage that never rounds a non-zero share to "0.00%", with the count it stands for
    when the total `n` is known: 23 of 1,000,000 → "0.0023% (23)".

    >>> fmt_share(23 / 1_000_000, 1_000_000), fmt_share(0.1234), fmt_share(0.0), fmt_share(None)
    ('0.0023% (23)', '12.34%', '0%', '—')
    """
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if v == 0:
        text = "0%"
    elif abs(v) * 100 < 1e-4:  # below a millionth of a percent decimals stop being readable
        text = f"{v * 100:.1e}%"
    else:
        text = f"{v:.{max(2, share_decimals(v))}%}"
    return text if n is None else f"{text} ({round(v * n):,})"


def share_tickformat(top: float | None) -> str:
    """d3 tick format for a share axis whose largest value is `top`: enough decimals that ticks a tenth of it
    apart keep a digit of their own (".1%" for shares of a few percent, ".4%" for 23 in a million).

    >>> share_tickformat(0.3), share_tickformat(2.3e-5), share_tickformat(None)
    ('.1%', '.4%', '.1%')
    """
    if not top or not math.isfinite(top):
        return ".1%"
    return f".{max(1, share_decimals(top / 10, significant=1))}%"


def log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """1-2-5 ticks covering [lo, hi] (lo > 0) for a log axis, each labelled with its full value: plotly's own
    "D2" ticks print 0.2 and 0.5 as "2" and "5".

    >>> log_ticks(0.15, 6)
    ([0.2, 0.5, 1.0, 2.0, 5.0], ['0.2', '0.5', '1', '2', '5'])
    """
    if not (lo > 0 and hi >= lo and math.isfinite(hi)):
        return [], []
    vals = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = float(f"{m}e{e}")  # exact decimal value, not m * 10.0 ** e (0.30000000000000004)
            if lo <= v <= hi:
                vals.append(v)
    return vals, [_tick_label(v) for v in vals]


def _tick_label(v: float) -> str:
    if 1e-3 <= v < 1e5:
        return f"{v:g}" if v < 1e4 else f"{v:,.0f}"
    return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")
