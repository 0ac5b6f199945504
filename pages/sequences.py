"""Sequences: the worst sequences of a step, any sequence token by token beside its prompt, response and reward,
and its routing flips. Run, step and sample are in the URL (`?seq_run=…&seq_step=…&seq_sample=…`): a link opens
the same sequence."""
import streamlit as st

from analysis.metrics import dashboard, drilldown, sampled
from ui import auth, charts, pick_table, plot, routing_charts, sequence_view
from ui import state as S

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Sequences")
st.caption("Find the responses whose log-probs disagree most, then read one token by token: each token is shaded "
           "by Δ = t − s, full colour from the run's p99 |Δ|; hover a token for s, t, Δ and r.")

sel = S.selection()
S.remember("seq_run", "seq_step", "seq_order", "seq_sample", "seq_scale", "seq_reward",
           "seq_reward_at", "seq_value")  # kept across pages
S.require_runs(sel, what="sequences")
ss = st.session_state

c1, c2, c3 = st.columns([2, 1, 2])
runs = sel.runs + [r for r in S.run_names() if r not in sel.runs]  # a link may name a run not in the sidebar
if ss.get("seq_run") is not None and ss["seq_run"] not in runs:
    ss.pop("seq_run")
run = c1.selectbox("Run", runs, key="seq_run", bind="query-params")
with S.guard("list the run's steps"):
    steps = S.cached(drilldown.run_steps, run)
    if sel.steps and run in sel.runs:
        steps = [s for s in steps if sel.steps[0] <= s <= sel.steps[1]]
if not steps:
    st.info(f"{run} has no steps in the chosen range: widen the **Step range** in the sidebar.")
    st.stop()
# A number box, not a list: it takes thousands of steps; +/- move by the usual gap between logged steps.
typed = c2.number_input("Step", min_value=0, step=sequence_view.step_increment(steps), key="seq_step",
                        bind="query-params", help=f"Steps {steps[0]}–{steps[-1]} ({len(steps):,} with tokens).")
step = sequence_view.nearest(steps, int(typed))
if step != typed and typed != 0:  # 0 is the box's default, not something the user asked for
    c2.caption(f"No tokens at step {typed}: showing step {step}.")
orders = sequence_view.ORDERS
S.keep_choice("seq_order", list(orders))
order = c3.radio("Rank by", list(orders), key="seq_order", format_func=orders.get, horizontal=True)

filters = {"any": "any reward", "at_least": "reward ≥", "below": "reward <"}
f1, f2, _ = st.columns([1, 1, 3], vertical_alignment="bottom")
S.keep_choice("seq_reward", list(filters))
reward_filter = f1.selectbox("Filter by reward", list(filters), key="seq_reward", format_func=filters.get,
                             help="e.g. reward ≥ 1 keeps the correct responses of a 0/1 reward; sequences "
                                  "without a reward are left out by either bound.")
ss.setdefault("seq_reward_at", 1.0)
threshold = f2.number_input("threshold", key="seq_reward_at", disabled=reward_filter == "any", step=0.5,
                            label_visibility="hidden")
bounds = sequence_view.reward_bounds(reward_filter, threshold)

worst = None
with S.guard("rank the sequences"):
    worst = S.cached(drilldown.worst_sequences, run, step, order=order, n=sequence_view.WORST_N, **bounds)
st.subheader(f"Worst sequences at step {step}")
sample_note = S.cached(sampled.sample_label, [run])  # the tokens below are token rows
if sample_note:
    st.caption(f"The table counts every token (summaries); a sequence's tokens below: {sample_note}.")
default_sample = int(worst["sample"][0]) if worst is not None and worst.height else None
if worst is None or worst.is_empty():
    st.info(f"No sequences at step {step} of {run}" + (" with this reward." if reward_filter != "any" else "."))
else:
    # columns the run's logs leave empty in every row (no trainer routing, no sequences file) are not shown
    shown, empty = sequence_view.without_empty(worst)
    shown_sample = ss.get("seq_sample")
    pick_table.pick_table(shown, "sample", key="seq_table", on_open=sequence_view.open_sample,
                          picked=default_sample if shown_sample is None else int(shown_sample))
    st.caption(sequence_view.worst_caption(empty))

box, _ = st.columns([1, 3])
typed_sample = box.number_input("Sample id", min_value=0, value=None, step=1, key="seq_sample", bind="query-params",
                               placeholder=f"worst: {default_sample}" if default_sample is not None else "sample id",
                               help="Type any sample id of this step, or click a row above. Empty: the worst.")
sample = default_sample if typed_sample is None else int(typed_sample)
if sample is None:
    st.stop()

with S.guard("load the sequence"):
    context = S.cached(drilldown.sequence_context, run, step, sample)
    if context is None:
        ids = S.cached(drilldown.step_samples, run, step)
        st.info(f"No sample {sample} at step {step} of {run}: its samples are "
                f"{sequence_view.id_ranges(ids)}.")
        st.stop()
    toks = S.cached(drilldown.sequence_tokens, run, step, sample)
    st.subheader(f"Sample {sample} at step {step}" + (f" · {context['tag']}" if context["tag"] else ""))
    group = S.cached(drilldown.sample_group, run, step, sample)
    if len(group) > 1:  # the other responses to the same prompt (a GRPO group)
        prev, nxt = sequence_view.neighbours(group, sample)
        g1, g2, g3 = st.columns([1, 1, 6], vertical_alignment="center")
        g1.button("◀ previous", key="seq_prev", disabled=prev is None, on_click=sequence_view.open_sample,
                  args=(prev,), help="The previous response to the same prompt at this step.")
        g2.button("next ▶", key="seq_next", disabled=nxt is None, on_click=sequence_view.open_sample, args=(nxt,),
                  help="The next response to the same prompt at this step.")
        g3.caption(f"Response {group.index(sample) + 1} of {len(group)} to this prompt at step {step} "
                   f"(samples {sequence_view.id_ranges(group)}).")
    p99 = S.cached(drilldown.delta_scale, run)
    if ss.get("_seq_scale_for") != run or not ss.get("seq_scale"):  # each run opens on its own spread
        ss["_seq_scale_for"] = run
        ss["seq_scale"] = sequence_view.default_scale(p99)
    if not context["n_token_rows"]:
        st.info(f"Every token of sample {sample} is in the summaries (the numbers below), but none of its "
                "token rows was kept: the run logged a sample of its tokens.")
    else:
        v1, v2, _ = st.columns([2, 2, 3], vertical_alignment="bottom")
        S.keep_choice("seq_value", list(charts.SEQUENCE_VALUES))
        value = v1.radio("Per token", list(charts.SEQUENCE_VALUES), key="seq_value", horizontal=True,
                         format_func=charts.SEQUENCE_VALUES.get)
        scale = v2.number_input("|Δ| for full colour", min_value=1e-12, max_value=50.0, step=0.001, format="%.3g",
                                key="seq_scale", help=sequence_view.scale_help(p99))
        plot.chart(charts.sequence_delta, toks, value, scale, drilldown.prompt_token_count(context["prompt"]),
                   key="seq_delta_chart")
    left, right = st.columns([2, 3])
    with left:
        m1, m2, m3 = st.columns(3)
        m1.metric("reward", sequence_view.fmt_number(context["reward"]))
        m2.metric("advantage", sequence_view.fmt_number(context["advantage"]))
        m3.metric("response length", f"{context['response_length']:,}")
        st.caption(f"ΣΔ = {context['seq_log_ratio']:+.4g} · kl_k3 = {context['kl_k3']:.4g} · "
                   f"{context['n_tokens']:,} tokens, {context['n_token_rows']:,} kept as rows")
        for label, text, height, key in (("Prompt", context["prompt"], 160, "seq_prompt_box"),
                                         ("Response", context["response"], 200, "seq_response_box")):
            if not text:  # nothing logged: one line, not an empty box
                st.markdown(f"**{label}** · *{'none logged' if text is None else 'empty'}*")
                continue
            st.markdown(f"**{label}**" + (" (the tokens' text joined)" if label == "Response"
                                          and context["response_from_tokens"] else ""))
            with st.container(border=True, height=sequence_view.box_height(text, height), key=key):
                st.text(text)
    if not context["n_token_rows"]:
        st.stop()
    with right:
        st.html(sequence_view.legend_html(scale))
        with st.container(border=True):
            st.html(sequence_view.sequence_html(toks, scale))
    # drawn only once opened: a closed expander's table is still sent and drawn, a second grid on a fresh open
    numbers = st.expander("Token by token, as numbers", key="seq_numbers", on_change="rerun")
    with numbers:
        if numbers.open:
            table = sequence_view.token_table(toks)
            st.dataframe(table, hide_index=True, key="seq_token_table",
                         column_config=S.number_columns(table, "%.6g"))
            st.download_button("Download CSV", data=table.write_csv(), mime="text/csv", key="seq_token_csv",
                               file_name=f"sequence-step{step}-sample{sample}.csv", on_click="ignore")
            st.caption("s = sampler log-prob, t = trainer log-prob, Δ = t − s, r = exp(Δ) (clamped to |Δ| ≤ 20); "
                       "flipped_layers = MoE layers whose expert set differs at this token. Select cells and "
                       "Ctrl+C to copy.")

kinds = S.cached(dashboard.routing_kinds, [run])
if kinds.get(run) == "both":
    with S.guard("load the sequence's routing"):
        grid = S.cached(drilldown.sequence_flip_grid, run, step, sample)
        if not grid.is_empty():
            st.subheader("Routing flips in this sequence")
            flips = grid.filter(grid["flip"])
            st.caption(f"{flips['pos'].n_unique():,} of {grid['pos'].n_unique():,} tokens flipped in at least one "
                       f"MoE layer ({flips.height:,} of {grid.height:,} token-layer pairs): the top-k expert set "
                       "differs between the sampler and the trainer.")
            # the grid on demand: its chart was a tenth of a fresh open of this page (benchmarks/RESULTS-pages.md)
            if (box := S.expander("Position × layer grid", key="seq_flip_open")).open:
                with box:
                    plot.chart(routing_charts.flip_grid, grid, key="seq_flip_grid")
                    st.caption("A red cell is a token whose top-k expert set differs between the sampler and the "
                               "trainer at that layer.")
elif kinds.get(run) == "sampler":
    st.caption("Routing flips need the trainer's routing too; this run recorded the sampler's only.")
