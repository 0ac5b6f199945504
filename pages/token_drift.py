"""Token drift: distributions of Δ and r, per-step heat map, sampler-vs-trainer probability density,
where the mismatch lives (probability, position, length, entropy, staleness) and the extreme-token curve."""
import streamlit as st

from analysis.metrics import buckets, dashboard, distributions, sampled
from ui import auth, charts, glossary, plot
from ui import state as S

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Token drift")
st.caption("Every response token has a sampler log-prob s and a trainer log-prob t. "
           "Δ = t − s is their log-ratio, r = exp(Δ) the importance ratio; with no drift every Δ is 0 and every r is 1.")

sel = S.selection()
S.require_runs(sel, what="token drift")
colors = S.run_colors()

# Four tabs; only the open one runs (a large database takes a query or two per tab). The Δ and r histograms and
# the extreme-token curve come from one shared pass over the tokens.
S.remember("tokens_logy", "tokens_run", "tokens_density_log", "tokens_top_show", "tokens_dim",
           "tokens_bucket_metric", "tokens_tags")
full = S.cached(dashboard.full_distribution, sel.runs, steps=sel.steps)  # per step; empty without top-k
names = ["Distribution", "One run in detail", "Where the mismatch lives", "Extreme tokens"]
dist_tab, run_tab, where_tab, extreme_tab, *full_tab = S.tabs(
    names + (["Full distribution"] if not full.is_empty() else []), key="tokens_tab")

if dist_tab.open:
    with dist_tab:
        # bins are fixed and global (ten per decade of |Δ|, from the summaries): nothing to choose
        log_y = st.toggle("Log y (show the tails)", value=True, key="tokens_logy")
        left, right = st.columns(2)
        with S.guard("bin Δ and r"):
            hists = S.cached(distributions.drift_histograms, sel.runs, n_bins=80, steps=sel.steps)
            with left:
                plot.chart(charts.histogram, hists["log_ratio"], colors, "Δ = t − s (signed log axis)",
                           log_y=log_y, signed_log_x=True, key="tokens_hist_delta")
                st.caption("Histogram of Δ on a signed log axis (each decade of |Δ| equally wide, 0 in the "
                           "middle): mass near 0 means the trainer reproduces the sampler; mass far out is drift.")
            with right:
                plot.chart(charts.histogram, hists["ratio"], colors, "r = π_trainer / π_sampler (log axis)",
                           log_y=log_y, log_x=True, key="tokens_hist_ratio")
                st.caption(f"Histogram of r on a log axis; tokens beyond C = {sel.cap:g} (or below 1/C) are what "
                           "importance sampling corrections cap or reject.")

if run_tab.open:
    with run_tab:
        S.keep_choice("tokens_run", sel.runs)
        run = st.columns([2, 3])[0].selectbox("Run", sel.runs, key="tokens_run",
                                              help="The heat map and the density show one run at a time.")
        sample_note = S.cached(sampled.sample_label, [run])  # the density and the token ids read token rows
        if sample_note:
            st.caption(f"Density and token ids: {sample_note}.")
        thin = S.cached(sampled.thin_steps, [run], (sel.steps,))  # the steps those two read on a large run
        left, right = st.columns(2)
        with left, S.guard("bin Δ per step"):
            df = S.cached(distributions.step_histogram, run, n_bins=60, steps=sel.steps)
            if df.is_empty():
                st.info("No tokens in this step range.")
            else:
                plot.chart(charts.step_heatmap, df, "Δ = t − s (signed log axis)", signed_log_x=True, key="tokens_step_heatmap")
                per_row = charts.steps_per_row(df)
                st.caption("Step × Δ bin, colour = share of the step's tokens (log scale): watch the distribution "
                           "widen or shift as training moves."
                           + (f" Each row pools {per_row} consecutive steps (more steps than the chart has "
                              "pixel rows)." if per_row > 1 else ""))
        with right, S.guard("bin the probability pairs"):
            log_axes = st.toggle("Log axes", key="tokens_density_log",
                                 help="Spread out the low-probability tokens, where most of the drift lives.")
            df = S.cached(distributions.prob_density_2d, [run], n_bins=100, steps=sel.steps, thin=True)
            if df.is_empty():
                st.info("No tokens in this step range.")
            else:
                plot.chart(charts.density_2d, df, log_axes=log_axes, key="tokens_density")
                st.caption("Each token placed at (sampler probability, trainer probability), counted in 100 × 100 "
                           "bins. Perfect agreement puts everything on the dashed diagonal."
                           + (f" It reads token rows: on a run this large, {thin.label()}." if thin.label() else ""))

        with S.guard("list the most mismatched tokens"):
            if st.toggle(f"Show the tokens with the largest mean |Δ| in {run}", key="tokens_top_show",
                         help="Token ids (and texts) seen at least 5 times, ranked by mean |Δ|."):
                top = S.cached(buckets.top_tokens, run, n=20, min_count=5, steps=sel.steps, thin=True)
                if top.is_empty():
                    st.caption("No token occurs at least 5 times in this range.")
                else:
                    st.dataframe(top, hide_index=True, key="tokens_top_table", column_config=S.number_columns(top))
                    if thin.label():
                        st.caption(f"Counted over token rows: on a run this large, {thin.label()}.")

if where_tab.open:
    with where_tab, S.guard("group the tokens"):
        has_entropy = S.cached(buckets.has_column_data, sel.runs, "sampler_entropy")
        has_versions = S.cached(buckets.has_column_data, sel.runs, "sampler_version")
        tags = S.cached(buckets.run_tags, sel.runs)
        has_turns = S.cached(buckets.has_segments, sel.runs)
        dims = (["prob", "position", "length"] + (["entropy"] if has_entropy else [])
                + (["lag"] if has_versions else []) + (["tag"] if tags else []) + (["segment"] if has_turns else []))
        S.keep_choice("tokens_dim", dims)
        bucket_metrics = ["kl_k3", "log_ratio_abs_mean", "log_ratio_abs_max", "ratio_frac_high", "ratio_frac_low",
                          "clip_frac", "prob_abs_diff_mean", "kl_k1"]
        c1, c2 = st.columns([3, 1])
        dim = c1.radio("Group tokens by", dims, key="tokens_dim", horizontal=True, bind="query-params",
                       format_func=lambda d: glossary.DIMENSIONS[d][0])
        S.keep_choice("tokens_bucket_metric", bucket_metrics)
        metric = c2.selectbox("Metric", bucket_metrics, key="tokens_bucket_metric")
        chosen_tags = None
        if tags:
            S.keep_choices("tokens_tags", tags)
            picked = st.multiselect("Only sequences tagged", tags, key="tokens_tags", placeholder="every tag",
                                    help="Keep the tokens of sequences with these tags (DriftLogger `tags=`). "
                                         "Grouped by length or tag this reads the summaries; by a token property "
                                         "or turn, the token rows.")
            chosen_tags = picked or None
        df = S.cached(buckets.mismatch_by, sel.runs, dim, cap=sel.cap, clip=sel.clip, steps=sel.steps,
                      metrics=[metric], tags=chosen_tags)  # the one shown: about half the query of the full table
        if df.is_empty():
            st.info("No tokens to group in this range.")
        else:
            plot.chart(charts.bucket_chart, df, metric, colors, glossary.DIMENSIONS[dim][0],
                       bars=dim in ("lag", "tag", "segment"), key="tokens_bucket_chart")
            if dim == "segment" or (chosen_tags and dim not in buckets.SEQUENCE_DIMENSIONS):
                note = S.cached(sampled.sample_label, sel.runs)
                if note:
                    st.caption(f"Read from the token rows: {note}.")
        missing = []
        if not has_entropy:
            missing.append("no `sampler_entropy`, so no entropy grouping")
        if not has_versions:
            missing.append("no `sampler_version` / `trainer_version`, so no staleness grouping (asynchronous "
                           "trainers should log the policy version each side used)")
        st.caption(f"**{metric}**: {glossary.describe(metric)}. {glossary.DIMENSIONS[dim][1]}"
                   + (f" These runs carry {'; '.join(missing)}." if missing else ""))

if extreme_tab.open:
    with extreme_tab, S.guard("compute the extreme-token curve"):
        hists = S.cached(distributions.drift_histograms, sel.runs, n_bins=80, steps=sel.steps)  # the histograms' pass
        plot.chart(charts.extreme_curve, hists["extreme"], colors, key="tokens_extreme")
        st.caption("F(τ): the share of tokens whose ratio is off by more than a factor τ in either direction "
                   "(max(r, 1/r) > τ). A heavy tail here is what breaks importance-sampling corrections.")

if full_tab and full_tab[0].open:
    with full_tab[0]:
        st.markdown("**Beyond the sampled tokens: the two sides' top-J lists, per step**")
        plot.chart(charts.step_curves, full, ["topk_overlap", "top1_agree"], colors, key="tokens_full_agree")
        plot.chart(charts.step_curves, full, ["kl_k3", "topk_kl_shared", "topk_tv_lower", "topk_tv_upper"], colors,
                   log_y=True, key="tokens_full_divergence")
        without = [r for r in sel.runs if r not in set(full["run"].to_list())]
        st.caption("kl_k3 estimates KL from the sampled tokens alone; the others compare the J most likely tokens "
                   "of each side at every position. "
                   + " ".join(f"**{m}**: {glossary.describe(m)}." for m in dashboard.FULL_DISTRIBUTION[1:])
                   + (f" Without top-k log-probs (not shown): {', '.join(without)}." if without else ""))
        with S.guard("group the full-distribution columns"):
            st.markdown("**By response length and by tag**, with the sampled-token kl_k3 and mean |Δ| beside them")
            dims = ["length"] + (["tag"] if S.cached(buckets.run_tags, sel.runs) else [])
            c1, c2 = st.columns([2, 3])
            S.keep_choice("tokens_full_dim", dims)
            by = c1.radio("Group sequences by", dims, key="tokens_full_dim", horizontal=True,
                          format_func=lambda d: glossary.DIMENSIONS[d][0])
            shown = ["topk_overlap", "top1_agree", "topk_kl_shared", "topk_tv_upper", "kl_k3", "log_ratio_abs_mean"]
            S.keep_choice("tokens_full_metric", shown)
            metric = c2.selectbox("Metric", shown, key="tokens_full_metric")
            grouped = S.cached(buckets.full_distribution_by, sel.runs, by, steps=sel.steps)
            grouped = grouped.filter(grouped["n_topk"] > 0)
            if grouped.is_empty():
                st.info("No sequences with top-k lists to group in this range.")
            else:
                plot.chart(charts.bucket_chart, grouped, metric, colors, glossary.DIMENSIONS[by][0], bars=by == "tag",
                           key="tokens_full_by")
                table = grouped.select("run", "label", "n_sequences", "n_tokens", "kl_k3", "log_ratio_abs_mean",
                                       *dashboard.FULL_DISTRIBUTION[1:])
                st.dataframe(table, hide_index=True, key="tokens_full_by_table",
                             column_config=S.number_columns(table))
                st.caption(f"**{metric}**: {glossary.describe(metric)}. From the per-sequence summaries: every "
                           "token, whatever the token sample.")
