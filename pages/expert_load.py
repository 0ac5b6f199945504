"""Expert load: how evenly a run's MoE layers spread tokens over experts and EP ranks, by every engine's definition,
which experts stay hot, and what rebalancing would buy on the next steps."""
import streamlit as st

from analysis.metrics import dashboard, hot_experts, load_views, rebalance
from ui import auth, charts, load_charts, plot
from ui import state as S

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Expert load")
st.caption("Tokens routed to each expert per step and MoE layer (sampler and trainer), from the counts ingest "
           "keeps. An expert-parallel layer runs as slowly as its busiest GPU, so the **straggler** factor "
           "max/mean of tokens per rank is roughly how much slower than a balanced layer it is.")

sel = S.selection()
S.require_runs(sel, what="expert load")
kinds = S.cached(dashboard.routing_kinds, sel.runs)
routed = [r for r in sel.runs if kinds.get(r) != "none"]
if not routed:
    st.info("None of the chosen runs has expert load. Log each token's top-k expert ids (`sampler_experts`, "
            "`trainer_experts`), or load an engine's dump: SGLang's expert-distribution recorder (`.pt`), "
            "TensorRT-LLM's expert statistic (`rank<r>.safetensors`) with `--run NAME`.", icon=":material/hub:")
    st.stop()

S.remember("load_run", "load_side", "load_n_experts", "load_ep_size", "load_layer", "load_domain_layer",
           "load_replicas", "load_nodes", "load_gpus", "load_window")
c1, c2, c3, c4 = st.columns([2, 2, 1, 1])
S.keep_choice("load_run", routed)
run = c1.selectbox("Run", routed, key="load_run")
sides = ["sampler", "trainer"] if kinds.get(run) == "both" else ["sampler"]
S.keep_choice("load_side", sides)
side = c2.radio("Side", sides, key="load_side", horizontal=True)
n_experts = c3.number_input("Experts (0: config)", min_value=0, max_value=4096, value=0, step=1,
                            key="load_n_experts", help="n of the model; 0 takes the run's config `n_experts`, "
                            "else the experts seen")
ep_size = c4.number_input("EP ranks (0: config)", min_value=0, max_value=1024, value=0, step=1, key="load_ep_size",
                          help="0 takes a stored placement (from an engine's dump), else the config's `ep_size`")

with S.guard("compute the expert load"):
    v = S.cached(load_views.views, run, sel.steps, side, int(n_experts) or None, int(ep_size) or None)
    placement = {"stored": "the placement loaded for this run", "contiguous": "experts in contiguous blocks",
                 None: "none (give EP ranks for the rank view)"}[v["placement"]]
    st.caption(f"{v['n_experts']} experts ({v['n_experts_source']}); placement: {placement}.")

    imb_tab, rank_tab, hot_tab, whatif_tab, domain_tab = S.tabs(
        ["Imbalance", "Ranks", "Hot experts", "What-if", "By domain"], key="load_tab")

    if imb_tab.open:
        with imb_tab:
            cols = [f"{c}_{side}" for c in ("straggler_step", "rank_imbalance", "load_max_vio_all", "load_cv")]
            plot.chart(charts.step_curves, v["by_step"], cols, {run: S.run_colors().get(run)}, key="load_steps")
            st.caption("Per step, the mean over layers (straggler_step: Σ max / Σ mean over layers, the step's "
                       "MoE time against perfect balance).")
            st.markdown("**Layer × expert, tokens over the fair share** (selected steps summed)")
            plot.chart(load_charts.expert_heatmap, v["heatmap"], key="load_expert_heatmap")
            st.markdown("**Which definition your engine logs**")
            st.table(load_views.DEFINITIONS, border="horizontal", hide_index=True)

    if rank_tab.open:
        with rank_tab:
            if "ranks" not in v:
                st.info("No placement: give the number of EP ranks above (or `ep_size` in the run's config, or "
                        "load the engine's placement).", icon=":material/info:")
            else:
                plot.chart(load_charts.rank_heatmap, v["ranks"], v["straggler"], key="load_rank_heatmap")
                st.caption("Tokens per EP rank over the mean rank (replicated experts' tokens split evenly), and "
                           "per layer the straggler factor max/mean averaged over steps.")

    if hot_tab.open:
        with hot_tab:
            st.markdown("**Hot experts per step and layer** (tokens above twice the fair share)")
            plot.chart(load_charts.hot_counts, v["hot"], key="load_hot_counts")
            layers = sorted(v["heatmap"]["layer"].unique().to_list())
            S.keep_choice("load_layer", layers)
            layer = st.selectbox("Layer", layers, key="load_layer")
            tl = S.cached(load_views.layer_timeline, run, int(layer), sel.steps, side, int(n_experts) or None)
            plot.chart(load_charts.layer_timeline, tl, key="load_layer_timeline")
            left, right = st.columns(2)
            left.markdown("**Most persistent hot experts** (share of steps hot)")
            left.dataframe(v["persistence"].head(20), hide_index=True, width="stretch")
            drift, note = S.cached(hot_experts.hot_drift, run, sel.steps, n_experts=int(n_experts) or None)
            right.markdown("**Drift of tokens routed to hot experts vs the rest**")
            right.dataframe(drift, hide_index=True, width="stretch")
            right.caption(f"Per (token, layer) routing row, {note}.")
            if side == "trainer" or kinds.get(run) == "both":
                diff = S.cached(hot_experts.side_difference, run, sel.steps, int(n_experts) or None)
                if diff.height:
                    st.caption(f"Sampler vs trainer load: total variation ½ Σ|p_s − p_t| averages "
                               f"{diff['load_tv'].mean():.4f} over (step, layer).")

    if whatif_tab.open:
        with whatif_tab:
            st.caption("Our own hierarchical replicate-and-pack (groups to nodes, hottest experts replicated, "
                       "replicas packed onto GPUs), fitted on a window of steps and judged on the next one.")
            n = int(v["n_experts"])
            gpus0 = v["n_ranks"] or next(g for g in (8, 4, 2, 1) if n % g == 0)
            with st.form("load_whatif"):
                a, b, c, d = st.columns(4)
                replicas = a.number_input("Slots in all", min_value=1, max_value=65536, value=n + gpus0,
                                          key="load_replicas", help="physical expert slots: the experts plus "
                                          "the redundant ones; a multiple of the GPUs")
                nodes = b.number_input("Nodes", min_value=1, max_value=1024, value=1, key="load_nodes")
                gpus = c.number_input("GPUs", min_value=1, max_value=4096, value=gpus0, key="load_gpus")
                window = d.number_input("Window (0: half)", min_value=0, max_value=100000, value=0,
                                        key="load_window", help="steps fitted on; the forecast is the next as many")
                st.form_submit_button("Forecast")
            if v["by_step"].height < 2:
                st.info("The what-if needs at least two steps of expert load: one to fit, one to forecast.",
                        icon=":material/info:")
            else:
                df, _ = S.cached(rebalance.what_if, run, int(replicas), int(nodes), int(gpus), None, None,
                                 int(window) or None, sel.steps, int(n_experts) or None, side)
                plot.chart(load_charts.what_if, df, key="load_whatif_chart")
                st.dataframe(df, hide_index=True, width="stretch")

    if domain_tab.open:
        with domain_tab:
            dom, note = S.cached(hot_experts.domain_load, run, sel.steps)
            if dom.is_empty():
                st.info(f"Nothing to split: {note}. Log a `tag` per sequence (code, prose, tool output) to see "
                        "which experts each domain uses.", icon=":material/label:")
            else:
                layers = sorted(dom["layer"].unique().to_list())
                S.keep_choice("load_domain_layer", layers)
                layer = st.selectbox("Layer", layers, key="load_domain_layer")
                plot.chart(load_charts.domain_split, dom, int(layer), key="load_domain")
                st.caption(f"Sampler side, {note}.")
