"""ui/plot.py without a browser: the figure cache's digest (equal inputs share a figure, any changed value does
not), `chart` building a view once per process, the refusal of a trace the bundled plotly.js lacks, the Findings
waterfall drawn as floating bars (against the running total worked out by hand); and ui/state.static_table's
escaping."""
import hashlib

import numpy as np
import plotly.graph_objects as go
import polars as pl
import pytest

from ui import findings_charts, plot


def digest(build, *args, **kwargs):
    return plot._digest(build, args, kwargs)


def frame(seed: int = 0, n: int = 300) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    return pl.DataFrame({"run": rng.choice(["a", "b"], n), "step": np.arange(n), "kl_k3": rng.random(n)})


def line(df: pl.DataFrame, metric: str, colors: dict | None = None) -> go.Figure:
    return go.Figure(go.Scatter(x=df["step"].to_list(), y=df[metric].to_list()))


def test_equal_inputs_give_one_digest_and_any_changed_value_another():
    base = digest(line, frame(), "kl_k3", colors={"a": "#000"})
    assert base == digest(line, frame(), "kl_k3", colors={"a": "#000"})  # a copy of the same values
    f = frame()
    changed = [
        digest(line, f.with_columns(pl.when(pl.col("step") == 217).then(0.5).otherwise(pl.col("kl_k3"))
                                    .alias("kl_k3")), "kl_k3", colors={"a": "#000"}),  # one value of 300
        digest(line, f.rename({"kl_k3": "ess"}), "kl_k3", colors={"a": "#000"}),  # a column's name
        digest(line, f.with_columns(pl.col("step").cast(pl.Int32)), "kl_k3", colors={"a": "#000"}),  # a dtype
        digest(line, f.head(299), "kl_k3", colors={"a": "#000"}),  # a row fewer
        digest(line, f, "ess", colors={"a": "#000"}),  # a plain argument
        digest(line, f, "kl_k3", colors={"a": "#111"}),  # a keyword's value
        digest(line, f, "kl_k3", colors={"b": "#000"}),
        digest(line, f, "kl_k3"),
        digest(findings_charts.waterfall, f, "kl_k3", colors={"a": "#000"}),  # another builder
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    # plain values by type and exact repr: 1 and 1.0 and True are three inputs, 0.1 + 0.2 is not 0.3
    assert len({digest(line, x) for x in (1, 1.0, True, 0.1 + 0.2, 0.3, "1", None, (1,), [1])}) == 9


def test_an_input_without_a_fingerprint_builds_every_time():
    assert digest(line, frame(), object()) is None
    calls = []

    def build(marker):
        calls.append(1)
        return go.Figure(go.Scatter(x=[0, 1], y=[1, 2]))
    sent = []
    orig = plot._chart
    try:
        plot._chart = lambda data, key: sent.append(data["figure"])
        marker = object()
        plot.chart(build, marker, key="k")
        plot.chart(build, marker, key="k")
    finally:
        plot._chart = orig
    assert len(calls) == 2 and sent[0] == sent[1]


def test_chart_builds_a_view_once_and_sends_the_same_figure_as_show():
    calls = []

    def build(df, metric):
        calls.append(metric)
        return line(df, metric)
    sent = []
    orig = plot._chart
    try:
        plot._chart = lambda data, key: sent.append((key, data["figure"]))
        seed = int(hashlib.sha256(b"test_plot").hexdigest()[:6], 16)  # inputs no other test caches
        for _ in range(3):
            plot.chart(build, frame(seed), "kl_k3", key="a")
        plot.chart(build, frame(seed + 1), "kl_k3", key="a")
        plot.show(line(frame(seed), "kl_k3"), key="b")
    finally:
        plot._chart = orig
    assert calls == ["kl_k3", "kl_k3"]  # the second frame is new; the first was built once
    assert sent[0][1] == sent[1][1] == sent[2][1] == sent[4][1] != sent[3][1]


def test_a_trace_the_bundle_lacks_is_refused():
    with pytest.raises(ValueError, match="no \\['waterfall'\\] trace"):
        plot.show(go.Figure(go.Waterfall(x=["a", "b"], y=[1, 2])), key="w")
    assert {"scatter", "bar", "heatmap"} <= plot.TRACES


def test_waterfall_bars_span_the_running_total():
    terms = pl.DataFrame({"term": ["A", "mix_lag", "mix_length", "within", "B"],
                          "label": ["", "lag mix", "length mix", "within cells", ""],
                          "value": [0.50, 0.20, -0.35, 0.05, 0.40]})
    fig = findings_charts.waterfall(terms, (0, 9), (10, 19))
    (bars,) = fig.data
    assert bars.type == "bar"
    lo = np.array(bars.base, dtype=float)
    hi = lo + np.array(bars.y, dtype=float)
    # by hand: A from 0 to 0.5; +0.2 -> 0.7; -0.35 -> 0.35; +0.05 -> 0.4; B from 0 to 0.4
    np.testing.assert_allclose(lo, [0.0, 0.5, 0.35, 0.35, 0.0], atol=1e-15)
    np.testing.assert_allclose(hi, [0.5, 0.7, 0.7, 0.4, 0.4], atol=1e-15)
    assert list(bars.marker.color) == ["#1f77b4", "#d62728", "#2ca02c", "#d62728", "#1f77b4"]
    assert list(bars.text) == ["0.5", "+0.2", "-0.35", "+0.05", "0.4"]
    assert list(bars.x) == ["kl_k3, steps 0–9", "lag mix", "length mix", "within cells", "kl_k3, steps 10–19"]
    # a connector at the total carried from each bar to the next
    np.testing.assert_allclose([s.y0 for s in fig.layout.shapes], [0.5, 0.7, 0.35, 0.4], atol=1e-15)


def test_static_table_escapes_user_text(monkeypatch):
    from ui import state
    sent = []
    monkeypatch.setattr(state.st, "html", sent.append)
    state.static_table(pl.DataFrame({"key": ["<script>x</script>", "b&c"], "run <i>": [None, "1 < 2"]}))
    (body,) = sent
    assert "<script>x" not in body and "<i>" not in body
    assert "&lt;script&gt;x&lt;/script&gt;" in body and "b&amp;c" in body and "1 &lt; 2" in body
    assert body.count("<tr>") == 3 and "<th>run &lt;i&gt;</th>" in body
