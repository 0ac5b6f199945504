"""Overview: headline mismatch numbers per run, per-step curves, the runs' configs; in a second tab, our numbers
beside what each framework's dashboard would show."""
import streamlit as st

from analysis.findings import ranking as findings
from analysis.metrics import compare, context, dashboard
from analysis.metrics.frameworks import compare as frameworks
from analysis.store import Store
from ui import auth, charts, context_charts, glossary, plot
from ui import state as S
from ui.auth import md_escape

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Overview")
st.caption("How far the trainer's recomputed log-probs **t** drift from the log-probs **s** the sampler reported, "
           "per run. Δ = t − s, r = exp(Δ) = π_trainer / π_sampler.")

sel = S.selection()
S.remember("overview_metrics", "overview_smooth", "overview_logy", "overview_cfg_diff",
           "overview_ctx_metric")  # kept across pages
S.require_runs(sel, what="the overview")
colors = S.run_colors()
kinds = S.cached(dashboard.routing_kinds, sel.runs)


def drift_tab() -> None:
    st.subheader("Headline numbers")
    with S.guard("compute the run summary"):
        # the run table and the per-step table below come from one pass (dashboard.run_and_step_tables)
        summary = S.cached(dashboard.run_and_step_tables, sel.runs, cap=sel.cap, clip=sel.clip, steps=sel.steps)["run"]
        checks = S.cached(findings.logging_checks, sel.runs, steps=sel.steps)
        floors = S.cached(Store.precision_floors)  # {run: its files' precision floor} where a log was rounded
        if summary.is_empty():
            st.info("The chosen runs have no tokens in this step range: widen the **Step range** in the sidebar.")
        cards = []
        for run in sel.runs:
            rows = summary.filter(summary["run"] == run)
            if not rows.is_empty():  # a misaligned or processed log: a badge, as no number below means much
                check = checks[run].line() if run in checks and checks[run].holds else None
                cards.append(glossary.headline_card(run, rows.row(0, named=True), colors.get(run, "#888"),
                                                    kinds.get(run), floors.get(run), check))
        if cards:
            st.html(glossary.cards_html(cards))
        st.caption(f"C = {sel.cap:g}, ε = {sel.clip:g}"
                   + (f", steps {sel.steps[0]}–{sel.steps[1]}" if sel.steps else "")
                   + ". Hover a name for its definition.")
        if (box := S.expander("All run-level metrics", key="overview_all_metrics")).open:
            with box:
                st.dataframe(summary, hide_index=True, key="overview_summary_table",
                             column_config=S.number_columns(summary))
                if shown := [r for r in sel.runs if r in floors]:
                    st.caption("Precision floors (the log was rounded; a metric in nats below it measures nothing): "
                               + ", ".join(f"{md_escape(r)} {glossary.fmt_floor(floors[r])}" for r in shown))

    st.subheader("Per step")
    with S.guard("compute the per-step metrics"):
        per_step = S.cached(dashboard.run_and_step_tables, sel.runs, cap=sel.cap, clip=sel.clip,
                            steps=sel.steps)["step"]
        options = [c for c in per_step.columns if c not in ("run", "step")
                   and (c not in ("token_any_flip_rate", "flipped_layers_per_token") or per_step[c].drop_nulls().len())]
        default = ["kl_k3", "log_ratio_abs_max", "ratio_frac_high", "ess"]
        if "token_any_flip_rate" in options:
            default = default[:3] + ["token_any_flip_rate"]
        S.keep_choices("overview_metrics", options, default)
        c1, c2, c3 = st.columns([4, 2, 1])
        chosen = c1.multiselect("Metrics", options, key="overview_metrics", help="One panel per metric; runs overlaid.")
        window = c2.slider("Smoothing (moving average over steps)", 1, 25, 1, key="overview_smooth")
        log_y = c3.toggle("Log y", key="overview_logy")
        if per_step.is_empty():
            st.info("No steps to plot in this range.")
        elif not chosen:
            st.info("Pick at least one metric to plot.")
        else:
            shown = dashboard.smooth(per_step, chosen, window)
            plot.chart(charts.step_curves, shown, chosen, colors, log_y=log_y, key="overview_curves")
            st.markdown("\n".join(f"- **{m}**: {glossary.describe(m)}" for m in chosen))

    st.subheader("Context over steps")
    with S.guard("compute the context per step"):
        ctx = S.cached(context.step_context, sel.runs, steps=sel.steps)
        per_step = S.cached(dashboard.run_and_step_tables, sel.runs, cap=sel.cap, clip=sel.clip,
                            steps=sel.steps)["step"]
        drift_options = [c for c in per_step.columns if c not in ("run", "step") and per_step[c].drop_nulls().len()]
        S.keep_choice("overview_ctx_metric", drift_options, "kl_k3")
        drift = st.selectbox("Drift metric", drift_options, key="overview_ctx_metric",
                             help="Drawn above the mean reward and advantage, the response length and the "
                                  "sequences per step, on the same step axis.")
        if ctx.is_empty():
            st.info("No steps to show in this range.")
        else:
            plot.chart(context_charts.context_over_steps, per_step, ctx, drift, colors, key="overview_context")
            if (n := context_charts.constant_count(ctx)) is not None:
                st.caption(f"Every step of the chosen runs holds {n:,} sequences: that panel is left out.")
            if not ctx["n_rewarded"].sum():
                st.caption("The chosen runs logged no reward (DriftLogger `rewards=`, sequence JSON Lines `reward`, "
                           "or a mapped field): the reward panel is left out.")
            if (box := S.expander("Context per step, as numbers", key="overview_context_numbers")).open:
                with box:
                    st.dataframe(ctx, hide_index=True, key="overview_context_table",
                                 column_config=S.number_columns(ctx))

    st.subheader("Run configs")
    with S.guard("read the run configs"):
        only_diff = st.toggle("Only keys that differ", value=len(sel.runs) > 1, key="overview_cfg_diff",
                              disabled=len(sel.runs) < 2)
        cfg = S.cached(compare.config_diff, sel.runs, all_keys=not only_diff)
        if cfg.is_empty():
            st.caption("The chosen runs carry no config (edit one on the Data page)" if not only_diff
                       else "The chosen runs' configs are identical.")
        else:
            S.static_table(cfg)  # a few keys: no data grid (or Arrow, or pandas) to load on a first view


def frameworks_tab() -> None:
    st.caption("Per run, our number beside what each framework's dashboard would show for the same quantity "
               "(its metric name as it logs it, its default settings), and why the two differ where they do. "
               "Over the selected steps, all of a run's sequences as one batch; C = 2.")
    with S.guard("compute the frameworks' numbers"):
        table = S.cached(frameworks.comparison, sel.runs, steps=sel.steps)
        if table.is_empty():
            st.info("The chosen runs have no tokens in this step range: widen the **Step range** in the sidebar.")
        for run in sel.runs:
            rows = table.filter(table["run"] == run).drop("run")
            if rows.is_empty():
                continue
            S.run_badge(run, colors.get(run, "#888"))
            st.dataframe(rows, hide_index=True, key=f"overview_frameworks_{run}",
                         column_config=S.number_columns(rows, fmt="%.6g"))
        st.caption("\"same definition\": the two agree to 1e-9 on these tokens. `metrics --as FRAMEWORK` gives "
                   "every column a framework logs, with its parameters.")


# only the open tab runs its queries
for tab, draw in zip(S.tabs(["Drift", "Your framework's numbers"], key="overview_tab"), (drift_tab, frameworks_tab)):
    if tab.open:
        with tab:
            draw()
