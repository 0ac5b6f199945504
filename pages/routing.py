"""Routing: where the sampler's and the trainer's MoE routers pick different experts, and what that costs."""
import streamlit as st

from analysis.metrics import dashboard, drilldown, routing
from ui import auth, charts, glossary, nav, plot, routing_charts
from ui import state as S

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Routing")
st.caption("For every response token and MoE layer, the top-k experts the sampler's router chose (E_s) and the "
           "ones the trainer's router chose when recomputing (E_t). A **flip** is E_s ≠ E_t as sets: the trainer "
           "then runs the token through other experts, a major source of mismatch in MoE RL.")

sel = S.selection()
S.require_runs(sel, what="routing")
colors = S.run_colors()
kinds = S.cached(dashboard.routing_kinds, sel.runs)
routed = [r for r in sel.runs if kinds.get(r) != "none"]
both = [r for r in sel.runs if kinds.get(r) == "both"]
sampler_only = [r for r in sel.runs if kinds.get(r) == "sampler"]
unrouted = [r for r in sel.runs if kinds.get(r) == "none"]

if not routed:
    st.info("None of the chosen runs has MoE routing, so there is nothing to show here. To see routing flips, log "
            "for each response token and MoE layer the top-k expert ids of the sampler (`sampler_experts`) **and** "
            "of the trainer's recompute (`trainer_experts`): a `routing` long table (SCHEMA.md), "
            "`DriftLogger.log_step(..., sampler_experts=..., trainer_experts=...)`, or `[B, T, L, K]` tensors in a "
            ".pt dump. Dense models have no routing: the Token drift page covers them.",
            icon=":material/alt_route:")
    st.stop()
if unrouted:
    st.caption(f"Without routing (not shown here): {', '.join(unrouted)}.")
if sampler_only:
    st.warning(f"Only the sampler's routing was recorded for {', '.join(sampler_only)} (as in routing-replay "
               "dumps, where the trainer replays the sampler's experts). Flips need the trainer's side too, so "
               "these runs have no flip statistics; their expert load is "
               + ("on the Expert load tab." if both else "shown below."),
               icon=":material/info:")


def expert_load_section() -> None:
    with S.guard("load the expert counts"):
        c1, c2, c3 = st.columns(3)
        S.keep_choice("routing_load_run", routed)
        load_run = c1.selectbox("Run", routed, key="routing_load_run")
        steps = S.cached(drilldown.run_steps, load_run)
        if sel.steps:
            steps = [s for s in steps if sel.steps[0] <= s <= sel.steps[1]] or steps
        S.keep_choice("routing_load_step", steps)
        step = c2.selectbox("Step", steps, key="routing_load_step")
        per_layer = S.cached(routing.routing_metrics, [load_run], by="layer", steps=(step, step))
        layers = sorted(set(per_layer["layer"].to_list())) if "layer" in per_layer.columns else []
        if layers:
            S.keep_choice("routing_load_layer", layers)
            layer = c3.selectbox("Layer", layers, key="routing_load_layer")
        else:
            layer = c3.number_input("Layer", min_value=0, max_value=4095, value=0, step=1,
                                    key="routing_load_layer_n")
        df = S.cached(routing.expert_load, load_run, step, int(layer))
        if df.is_empty():
            st.info(f"No routing recorded for step {step}, layer {layer} of {load_run}.")
        else:
            plot.chart(routing_charts.expert_load, df, key="routing_expert_load")
            st.caption("Share of the routed top-k slots each expert received at this (step, layer), for the "
                       "sampler and the trainer. Imbalance shifts between the two sides when routing flips.")
        st.page_link(nav.EXPERT_LOAD.path, label="Imbalance by every engine's definition, EP ranks, hot experts "
                     "and a rebalancing what-if: the Expert load page", icon=nav.EXPERT_LOAD.icon)


S.remember("routing_run", "routing_layer_metric", "routing_load_run", "routing_load_step", "routing_load_layer",
           "routing_load_layer_n")
if not both:  # sampler-side routing only: no flips, the expert load is all there is
    st.subheader("Expert load")
    expert_load_section()
    st.stop()

# Three tabs; only the open one runs its queries.
layer_tab, token_tab, load_tab = S.tabs(["Flips per layer", "Flips per token", "Expert load"], key="routing_tab")

if layer_tab.open:
    with layer_tab:
        c1, c2 = st.columns([2, 3])
        S.keep_choice("routing_run", both)
        run = c1.selectbox("Run", both, key="routing_run")
        layer_metrics = ["flip_rate", "top1_flip_rate", "overlap"]
        S.keep_choice("routing_layer_metric", layer_metrics)
        value = c2.radio("Colour", layer_metrics, key="routing_layer_metric", horizontal=True)
        left, right = st.columns([3, 2])
        with left, S.guard("compute routing metrics per layer"):
            st.markdown(f"**Step × layer** ({run})")
            df = S.cached(routing.routing_metrics, [run], by="layer", steps=sel.steps)
            df = df.filter(df["n_tokens"] > 0) if "n_tokens" in df.columns else df
            if df.is_empty():
                st.info("No routing rows with both sides in this step range.")
            else:
                plot.chart(routing_charts.layer_heatmap, df, value, key="routing_layer_heatmap")
                st.caption(f"**{value}**: {glossary.describe(value)}.")
        weighted = S.cached(dashboard.routing_weight_runs, [run])
        if weighted:
            with left, S.guard("compute the routing-weight mismatch"):
                st.markdown(f"**Routing-weight mismatch, step × layer** ({run})")
                df = S.cached(routing.routing_metrics, [run], by="layer", steps=sel.steps)
                df = df.filter(df["weight_abs_diff_mean"].is_not_null())
                plot.chart(routing_charts.layer_heatmap, df, "weight_abs_diff_mean", key="routing_weight_heatmap")
                st.caption(f"**weight_abs_diff_mean**: {glossary.describe('weight_abs_diff_mean')}. Replaying the "
                           "expert ids alone leaves this; replaying the weights too removes it.")
        with right, S.guard("compute the layer profile"):
            st.markdown("**Flip rate per layer** (all steps, every run with both sides)")
            df = S.cached(routing.layer_profile, both, steps=sel.steps)
            plot.chart(routing_charts.layer_profile, df, colors, "flip_rate", key="routing_layer_profile")
            st.caption("Deeper layers see inputs that already carry upstream drift; a rising profile is typical.")

if token_tab.open:
    # one per-token pass over the routing table feeds the three flip charts
    with token_tab, S.guard("compute flips per token"):
        flips = S.cached(routing.flip_views, both, steps=sel.steps)
        st.markdown("**Tokens with a flip, per step**")
        plot.chart(charts.step_curves, flips["step"], ["token_any_flip_rate", "flipped_layers_per_token"],
                   colors, key="routing_flip_steps")
        st.caption(f"**token_any_flip_rate**: {glossary.describe('token_any_flip_rate')}. "
                   f"**flipped_layers_per_token**: {glossary.describe('flipped_layers_per_token')}.")
        left, right = st.columns(2)
        with left:
            st.markdown("**First layer where a token's experts flip**")
            plot.chart(routing_charts.first_flip, flips["first_flip"], colors, key="routing_first_flip")
            st.caption("Where divergence starts: once one layer routes differently, later layers see different "
                       "inputs.")
        with right:
            st.markdown("**Do flips cost log-prob agreement?**")
            plot.chart(routing_charts.flip_mismatch, flips["mismatch"], colors, key="routing_flip_mismatch")
            st.caption("Mean |Δ| and kl_k3 of tokens with at least one flipped layer against tokens without. A "
                       "large gap says routing replay (R3) would remove much of the mismatch.")
        by_margin = S.cached(routing.flip_rate_by_margin, both, steps=sel.steps)
        if not by_margin.is_empty():
            st.markdown("**Flips happen where the router is undecided**: flip rate and mean |Δ| by router margin")
            plot.chart(routing_charts.flip_by_margin, by_margin, colors, key="routing_flip_margin")
            sides = sorted(set(by_margin["side"].to_list()))
            st.caption(f"**flip_rate_by_margin**: {glossary.describe('flip_rate_by_margin')}. Binned by the "
                       f"{' and '.join(sides)}'s margin.")
        else:
            st.caption("Log router margins (`RouterCapture.margins()`, `log_step(trainer_margins=...)`) to see "
                       "flip rate by margin.")

if load_tab.open:
    with load_tab:
        expert_load_section()
