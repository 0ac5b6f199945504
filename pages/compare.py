"""Compare: what differs between runs (configs), how much the mismatch changes, and the overlaid distributions."""
import streamlit as st

from analysis.findings import pairs
from analysis.metrics import compare, dashboard, distributions, routing
from ui import auth, charts, glossary, plot, routing_charts
from ui import state as S

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Compare runs")
st.caption("Put runs side by side: which settings differ (dtypes, engine, mitigation switches) and what that does "
           "to the mismatch.")

sel = S.selection()
S.require_runs(sel, minimum=2, what="a comparison")
colors = S.run_colors()

st.subheader("Config differences")
with S.guard("compare the configs"):
    diff = S.cached(compare.config_diff, sel.runs)
    if diff.is_empty():
        st.info("The chosen runs' configs are identical (or carry none): differences in the numbers below come from "
                "elsewhere (data, seeds, hardware). A run's config can be edited on the Data page.")
    else:
        st.dataframe(diff, hide_index=True, key="compare_cfg_table")

both = [r for r, kind in S.cached(dashboard.routing_kinds, sel.runs).items() if kind == "both"]
S.remember("compare_baseline", "compare_metrics")
partnered = S.cached(pairs.has_partners, sel.runs)
labels = ["Metric deltas", "Distributions"] + (["Routing"] if both else []) + (["Pairs"] if partnered else [])
tabs = S.tabs(labels, key="compare_tab")  # only the open tab runs its queries

if tabs[0].open:
    with tabs[0]:
        S.keep_choice("compare_baseline", sel.runs)
        baseline = st.columns([2, 3])[0].selectbox("Baseline", sel.runs, key="compare_baseline",
                                                   help="Deltas are each run's value minus the baseline's.")
        deltas = None
        with S.guard("compute the metric deltas"):
            # the Overview's run summary (usually cached already) plus the routing rates, pivoted here in polars
            summary = S.cached(dashboard.run_and_step_tables, sel.runs, cap=sel.cap, clip=sel.clip,
                               steps=sel.steps)["run"]
            rates = S.cached(compare.routing_rates, sel.runs, steps=sel.steps)
            deltas = compare.deltas_table(summary, rates, sel.runs, baseline)
            shown = deltas.rename({"baseline": f"{baseline} (baseline)"}) if baseline not in deltas.columns else deltas
            st.dataframe(shown, hide_index=True, key="compare_delta_table", column_config=S.number_columns(shown))
            st.caption(f"Run-level metrics over the selected steps, C = {sel.cap:g}, ε = {sel.clip:g}.")

        if deltas is not None:
            with S.guard("chart the run-level metrics"):
                others = [r for r in sel.runs if r != baseline]
                values = dashboard.run_values(deltas, [baseline] + others)  # the table's numbers, no second query
                options = [c for c in values.columns if c != "run" and values[c].drop_nulls().len()]
                default = ["kl_k3", "log_ratio_abs_max", "ratio_frac_high", "ess", "token_any_flip_rate", "chi2_token"]
                S.keep_choices("compare_metrics", options, default)
                chosen = st.multiselect("Metrics to chart", options, key="compare_metrics")
                if chosen:
                    plot.chart(charts.run_bars, values, chosen, colors, key="compare_bars")
                    st.markdown("\n".join(f"- **{m}**: {glossary.describe(m)}" for m in chosen))

if tabs[1].open:
    with tabs[1]:
        left, right = st.columns(2)
        with S.guard("bin Δ"):
            # Token drift's default binning: one cached pass gives the histogram and the extreme-token curve
            hists = S.cached(distributions.drift_histograms, sel.runs, n_bins=80, steps=sel.steps)
            with left:
                plot.chart(charts.histogram, hists["log_ratio"], colors, "Δ = t − s (signed log axis)",
                           log_y=True, signed_log_x=True, key="compare_hist")
            with right:
                plot.chart(charts.extreme_curve, hists["extreme"], colors, key="compare_extreme")
        with S.guard("compute the per-step kl_k3"):
            per_step = S.cached(dashboard.run_and_step_tables, sel.runs, cap=sel.cap, clip=sel.clip,
                                steps=sel.steps)["step"]
            plot.chart(charts.step_curves, per_step, ["kl_k3", "ess"], colors, key="compare_steps")

if both and tabs[2].open:
    with tabs[2], S.guard("compare the layer profiles"):
        st.markdown("**Routing flip rate per layer**")
        df = S.cached(routing.layer_profile, both, steps=sel.steps)
        plot.chart(routing_charts.layer_profile, df, colors, key="compare_layers")

if partnered and tabs[-1].open:
    with tabs[-1]:
        with S.guard("compare the trainer with itself"):
            own = S.cached(pairs.trainer_self_table, sel.runs, steps=sel.steps)
            if not own.is_empty():
                st.markdown("**The trainer against itself**")
                st.dataframe(own, hide_index=True, key="compare_self_table", column_config=S.number_columns(own))
                st.caption("A rerun of the trainer on the same tokens (`ingest FILES --pair-of RUN`): its mismatch "
                           "with itself beside the engine's. self_share = its kl_k3 / the run's; outside_0_9_1_1 = "
                           "tokens with r outside [0.9, 1.1] (TRL #6789: 8.0 % from trainer chunking alone).")
        with S.guard("compare the replay modes"):
            replay = S.cached(pairs.replay_table, sel.runs, steps=sel.steps)
            if not replay.is_empty():
                st.markdown("**What routing replay removed, and what remains**")
                st.dataframe(replay, hide_index=True, key="compare_replay_table",
                             column_config=S.number_columns(replay))
                st.caption("Runs of one config apart from `replay` (none, ids, ids+weights; labels such as preset "
                           "ignored), from the whole database: kl_k3 removed against the group's none runs, and the "
                           "remaining mismatch's signatures (share of Σ k3 on the first token, of Δ ≠ 0 on "
                           "multiples of 0.125, of Δ < −10 at turn starts and elsewhere).")
