"""Figure builders: what the browser is given (colours computed in Python, not by plotly.js)."""
from __future__ import annotations

import plotly.colors
import polars as pl

from ui import charts


def _rgb(color: str) -> tuple[int, ...]:
    return tuple(int(float(c)) for c in color.strip("rgb() ").split(","))


def test_diverging_colors_are_symmetric_around_zero():
    scale = plotly.colors.get_colorscale(charts.DIVERGING)
    low, high = _rgb(scale[0][1]), _rgb(scale[-1][1])
    # the largest |Δ| takes an end of the scale whatever its sign; 0 the middle; -v and v mirror positions
    out = [_rgb(c) for c in charts.diverging_colors([-0.05, 0.0, 0.05, 0.2])]
    assert out[3] == high and out[1] == _rgb(plotly.colors.sample_colorscale(scale, [0.5])[0])
    assert out[0] == _rgb(plotly.colors.sample_colorscale(scale, [0.375])[0])
    assert out[2] == _rgb(plotly.colors.sample_colorscale(scale, [0.625])[0])
    assert [_rgb(c) for c in charts.diverging_colors([-3.0, 1.0])][0] == low
    assert charts.diverging_colors([]) == []
    assert len(set(charts.diverging_colors([0.0, 0.0]))) == 1  # no drift: every bar the middle colour


def test_sequence_delta_bars_carry_colour_strings():
    df = pl.DataFrame({"pos": [0, 1, 2], "token": ["a", None, "c"], "token_id": [5, 6, 7],
                       "sampler_logprob": [-1.0, -2.0, -0.5], "trainer_logprob": [-1.1, -2.0, -0.2],
                       "delta": [-0.1, 0.0, 0.3], "ratio": [0.905, 1.0, 1.35]})
    bar = charts.sequence_delta(df).data[0]
    colors = list(bar.marker.color)
    assert all(isinstance(c, str) and c.startswith("rgb") for c in colors)
    assert colors == charts.diverging_colors([-0.1, 0.0, 0.3])
    assert [d[0] for d in bar.customdata] == ["a", "id 6", "c"]  # a token without text shows its id


def test_signed_log_axis_is_monotone_and_keeps_each_decade_equally_wide():
    import pytest

    from analysis.summaries.schema import DISPLAY_EDGES
    from ui.charts import signed_log
    xs = [signed_log(v) for v in DISPLAY_EDGES]
    assert xs == sorted(xs) and len(set(xs)) == len(xs) and signed_log(0.0) == 0.0
    assert signed_log(1e-3) - signed_log(1e-4) == pytest.approx(1.0) == signed_log(-1e-4) - signed_log(-1e-3)


def test_long_runs_pool_consecutive_steps_into_heat_map_rows():
    """400 steps: rows of 3 consecutive steps (134 rows), each row's shares the pooled counts over its tokens;
    a short run keeps one row per step; lines of 60+ points lose their markers."""
    import numpy as np
    rng = np.random.default_rng(0)
    steps = np.repeat(np.arange(0, 800, 2), 5)  # 400 logged steps (every other one), 5 bins each
    bins = np.tile(np.arange(5), 400).astype(float)
    df = pl.DataFrame({"step": steps, "bin_lo": bins, "bin_hi": bins + 1, "count": rng.integers(1, 50, len(steps))})
    df = df.with_columns(frac=pl.col("count") / pl.col("count").sum().over("step"))
    assert charts.steps_per_row(df) == 3
    pooled = charts.pool_steps(df, 3)
    assert pooled["step"].n_unique() == 134 and pooled["step"].unique().sort().to_list()[:3] == [0, 6, 12]
    for first in (0, 396, 798):  # a full row, another, and the last one, which pools a single step
        mine = df.filter(pl.col("step").is_between(first, first + 5))
        want = mine.group_by("bin_lo").agg(pl.col("count").sum()).sort("bin_lo")["count"].to_numpy()
        got = pooled.filter(pl.col("step") == first).sort("bin_lo")
        assert got["count"].to_list() == want.tolist()
        assert np.allclose(got["frac"].to_numpy(), want / want.sum())
    fig = charts.step_heatmap(df)
    assert len(fig.data[0].y) == 134 and "rows of 3" in fig.layout.yaxis.title.text
    short = df.filter(pl.col("step") < 100)
    assert charts.steps_per_row(short) == 1 and len(charts.step_heatmap(short).data[0].y) == 50
    assert (charts.line_mode(59), charts.line_mode(60)) == ("lines+markers", "lines")


def _context(rewarded: bool, advantaged: bool = False) -> tuple[pl.DataFrame, pl.DataFrame]:
    steps = [0, 1, 2]
    per_step = pl.DataFrame({"run": ["a"] * 3, "step": steps, "kl_k3": [1e-3, 2e-3, 4e-3]})
    ctx = pl.DataFrame({"run": ["a"] * 3, "step": steps, "n_sequences": [4, 4, 5],
                        "n_rewarded": [4, 4, 5] if rewarded else [0, 0, 0],
                        "reward_mean": [0.5, 0.25, 0.75] if rewarded else [None] * 3,
                        "response_length_mean": [10.0, 12.0, 9.0], "response_length_std": [1.0, 2.0, 0.5],
                        "response_length_min": [8, 9, 8], "response_length_max": [12, 15, 10],
                        "advantage_mean": [0.1, None, -0.2] if advantaged else [None] * 3,
                        "advantage_min": [-1.0, None, -1.5] if advantaged else [None] * 3,
                        "advantage_max": [1.0, None, 0.5] if advantaged else [None] * 3,
                        "n_advantaged": [4, 0, 5] if advantaged else [0, 0, 0]},
                       schema_overrides={c: pl.Float64 for c in ("advantage_mean", "advantage_min", "advantage_max")})
    return per_step, ctx


def test_context_over_steps_leaves_out_the_reward_panel_when_no_run_logged_one():
    from ui import context_charts

    def panels(fig):
        return [a.text for a in fig.layout.annotations]

    def lines(fig):  # y axis of each line trace (the length band is a filled polygon), with its values
        return {t.yaxis: list(t.y) for t in fig.data if t.fill != "toself"}

    both = context_charts.context_over_steps(*_context(True, True), "kl_k3", {"a": "#1f77b4"})
    assert panels(both) == ["kl_k3", *context_charts.PANELS[1:]]
    assert lines(both)["y3"] == [0.1, -0.2]  # the steps with advantages only
    bands = [list(t.y) for t in both.data if t.fill == "toself" and t.yaxis == "y3"]
    assert bands == [[1.0, 0.5, -1.5, -1.0]]  # max forward, min back
    with_reward = context_charts.context_over_steps(*_context(True), "kl_k3", {"a": "#1f77b4"})
    assert panels(with_reward) == ["kl_k3", context_charts.REWARD, context_charts.LENGTH, context_charts.COUNT]
    assert lines(with_reward) == {"y": [1e-3, 2e-3, 4e-3], "y2": [0.5, 0.25, 0.75], "y3": [10.0, 12.0, 9.0],
                                  "y4": [4, 4, 5]}
    assert with_reward.layout.xaxis4.title.text == "step"

    without = context_charts.context_over_steps(*_context(False), "kl_k3", {"a": "#1f77b4"})
    assert panels(without) == ["kl_k3", context_charts.LENGTH, context_charts.COUNT]
    assert lines(without) == {"y": [1e-3, 2e-3, 4e-3], "y2": [10.0, 12.0, 9.0], "y3": [4, 4, 5]}
    assert without.layout.xaxis3.title.text == "step" and without.layout.yaxis3.rangemode == "tozero"
    assert without.layout.height < with_reward.layout.height


def test_context_over_steps_leaves_out_a_constant_sequence_count():
    from ui import context_charts
    per_step, ctx = _context(True)
    fixed = ctx.with_columns(pl.lit(4).alias("n_sequences"))
    assert context_charts.constant_count(fixed) == 4 and context_charts.constant_count(ctx) is None
    assert context_charts.constant_count(ctx.clear()) is None
    fig = context_charts.context_over_steps(per_step, fixed, "kl_k3", {"a": "#1f77b4"})
    assert [a.text for a in fig.layout.annotations] == ["kl_k3", context_charts.REWARD, context_charts.LENGTH]
    assert {t.yaxis for t in fig.data} == {"y", "y2", "y3"} and fig.layout.xaxis3.title.text == "step"
    # two runs of different fixed batches: the counts differ, the row stays
    two = pl.concat([fixed, fixed.with_columns(pl.lit("b").alias("run"), pl.lit(8).alias("n_sequences"))])
    fig = context_charts.context_over_steps(pl.concat([per_step, per_step.with_columns(pl.lit("b").alias("run"))]),
                                            two, "kl_k3", {"a": "#1f77b4", "b": "#ff7f0e"})
    assert [a.text for a in fig.layout.annotations][-1] == context_charts.COUNT
