"""Sequences: the worst sequences of a step, one sequence token by token, and its routing flips."""
import streamlit as st

from analysis import inspect, sampled, views
from ui import charts, routing_charts, sequence_view
from ui import state as S

st.title("Sequences")
st.caption("Find the responses whose log-probs disagree most, then read one token by token: each token is shaded "
           "by Δ = t − s; hover a token for s, t, Δ and r.")

sel = S.selection()
S.remember("seq_run", "seq_step", "seq_order", "seq_sample", "seq_scale")  # kept across pages
S.require_runs(sel, what="sequences")

c1, c2, c3 = st.columns([2, 1, 2])
S.keep_choice("seq_run", sel.runs)
run = c1.selectbox("Run", sel.runs, key="seq_run")
with S.guard("list the run's steps"):
    steps = S.cached(inspect.run_steps, run)
    if sel.steps:
        steps = [s for s in steps if sel.steps[0] <= s <= sel.steps[1]]
if not steps:
    st.info(f"{run} has no steps in the chosen range: widen the **Step range** in the sidebar.")
    st.stop()
S.keep_choice("seq_step", steps)
step = c2.selectbox("Step", steps, key="seq_step")
orders = {"seq_log_ratio_abs": "|ΣΔ| (whole sequence)", "max_log_ratio_abs": "max |Δ| (worst token)"}
S.keep_choice("seq_order", list(orders))
order = c3.radio("Rank by", list(orders), key="seq_order", format_func=orders.get, horizontal=True)

worst = None
with S.guard("rank the sequences"):
    worst = S.cached(inspect.worst_sequences, run, step, order=order, n=20)
if worst is None or worst.is_empty():
    st.info(f"No sequences at step {step} of {run}.")
    st.stop()

st.subheader(f"Worst sequences at step {step}")
sample_note = S.cached(sampled.sample_label, [run])  # this page reads token rows
if sample_note:
    st.caption(f"Sequences and their tokens: {sample_note}.")
st.dataframe(worst, hide_index=True, key="seq_table", column_config=S.number_columns(worst))
st.caption("seq_log_ratio = ΣΔ over the response (the sequence-level log importance ratio); "
           "max_log_ratio_abs = the largest single-token |Δ|; n_flips = token-layer pairs whose experts flipped.")

samples = worst["sample"].to_list()
S.keep_choice("seq_sample", samples)
sample = st.selectbox("Sequence (sample id)", samples, key="seq_sample",
                      format_func=lambda s: f"sample {s}")

with S.guard("load the sequence"):
    toks = S.cached(inspect.sequence_tokens, run, step, sample)
    if toks.is_empty():
        st.info("This sequence has no tokens.")
    else:
        st.subheader(f"Sample {sample}, token by token")
        scale = st.slider("|Δ| for full colour", 0.001, 2.0, 0.1, step=0.001, format="%.3f", key="seq_scale",
                          help="Tokens with |Δ| at or above this get the strongest shade.")
        st.html(sequence_view.legend_html(scale))
        with st.container(border=True):
            st.html(sequence_view.sequence_html(toks, scale))
        st.plotly_chart(charts.sequence_delta(toks), key="seq_delta_chart")

kinds = S.cached(views.routing_kinds, [run])
if kinds.get(run) == "both":
    with S.guard("load the sequence's routing"):
        grid = S.cached(inspect.sequence_flip_grid, run, step, sample)
        if not grid.is_empty():
            st.subheader("Routing flips in this sequence")
            st.plotly_chart(routing_charts.flip_grid(grid), key="seq_flip_grid")
            st.caption("Position × MoE layer; a red cell is a token whose top-k expert set differs between the "
                       "sampler and the trainer at that layer.")
elif kinds.get(run) == "sampler":
    st.caption("Routing flips need the trainer's routing too; this run recorded the sampler's only.")
