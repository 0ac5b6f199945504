"""Findings: what carries each run's mismatch (ranked cards with their evidence), how kl_k3 changed between two
step ranges (waterfall), what each off-policy correction would mask (simulator), and the published gates."""
import streamlit as st

from analysis.findings import decomposition, gates, pairs
from analysis.findings import ranking as findings
from analysis.metrics import corrections, dashboard, drilldown, sampled
from ui import auth, findings_charts, nav, plot
from ui import state as S
from ui.auth import md_escape

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Findings")
st.caption("Each finding comes from a stated rule on this data, with the numbers behind it, a link to the view that "
           "shows them, and what to try (with its source, so you can judge it). Severity: "
           ":red-badge[alert] breaks a CI gate · :orange-badge[warn] a cause or band worth fixing · "
           ":blue-badge[info] context.")

sel = S.selection()
S.require_runs(sel, what="findings")
S.remember("findings_run", "findings_a", "findings_b", "findings_methods", "findings_baselines",
           *(f"findings_{m}_{k}" for m, spec in corrections.METHODS.items() for k in spec.defaults))
PAGES = {p.url: p for p in nav.ALL}
TABS = ["Findings", *findings.FINDINGS_TABS]  # the evidence links of findings name the other three


def _number(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(map(str, v[:8])) + ("…" if len(v) > 8 else "")
    return str(v)


def finding_card(group: list[dict]) -> None:
    """One card: a finding, or all of a run's findings of one symptom kind (band violations, noise floors)."""
    f = group[0]
    ev = f["evidence"]
    with st.container(border=True):
        color = findings_charts.SEVERITY_COLORS[f["severity"]]
        lines = [f":{color}-badge[{f['severity']}] `{f['kind']}` **{md_escape(f['title'])}**"]
        lines += [f"- :{findings_charts.SEVERITY_COLORS[g['severity']]}[{g['severity']}] {md_escape(g['title'])} — "
                  f"*{md_escape(g['source'])}*" for g in group[1:]]
        numbers = " · ".join(f"{md_escape(k)} = {md_escape(_number(v))}" for k, v in ev["numbers"].items())
        lines.append(f"**Try:** {md_escape(f['action'])} — *{md_escape(f['source'])}*  \n:gray[{numbers}. Rule: {md_escape(f['rule'])}]")
        st.markdown("\n\n".join(lines))
        page = PAGES.get(ev["page"])
        if page is not None:
            st.page_link(page.path, label="Open the evidence", icon=":material/open_in_new:",
                         query_params=ev["query"], help=f"{page.title}: {ev['url']}")


def grouped(items: list[dict]) -> list[list[dict]]:
    """Findings in rank order, a run's band violations and noise floors each folded into one card."""
    out: list[list[dict]] = []
    seen: dict[str, list[dict]] = {}
    for f in items:
        if f["kind"] in ("band_violation", "noise_floor"):
            if f["kind"] in seen:
                seen[f["kind"]].append(f)
                continue
            seen[f["kind"]] = [f]
            out.append(seen[f["kind"]])
        else:
            out.append([f])
    return out



def cards_tab() -> None:
    with S.guard("find the causes"):
        found = S.cached(findings.findings_table, sel.runs, steps=sel.steps, cap=sel.cap, clip=sel.clip,
                         baselines=baselines())
        colors = S.run_colors()
        for run in sel.runs:
            mine = [f for f in found if f["run"] == run]
            S.run_badge(run, colors.get(run, "#888"), f"{len(mine)} finding{'s' if len(mine) != 1 else ''}")
            if not mine:
                st.caption("No tokens in this step range.")
            main = [f for f in mine if f["severity"] != "info"] or mine[:1]
            for group in grouped(main):
                finding_card(group)
            rest = [f for f in mine if f not in main]
            if rest:
                with st.expander(f"{len(rest)} more (info)"):
                    for group in grouped(rest):
                        finding_card(group)
    partners()


def partners() -> None:
    """The trainer against itself and the replay groups beside the engine's numbers (findings/pairs.py)."""
    with S.guard("read the partner runs"):
        own = S.cached(pairs.trainer_self_table, sel.runs, steps=sel.steps)
        replay = S.cached(pairs.replay_table, sel.runs, steps=sel.steps)
        if own.is_empty() and replay.is_empty():
            return
        st.markdown("**Against partner runs**")
        if not own.is_empty():
            st.dataframe(own, hide_index=True, key="findings_self_table", column_config=S.number_columns(own))
            st.caption("The trainer against itself on the same tokens (`ingest --pair-of`) beside the engine's "
                       "mismatch: trainer_self fires when its kl_k3 is 30 % of the run's or more.")
        if not replay.is_empty():
            st.dataframe(replay, hide_index=True, key="findings_replay_table", column_config=S.number_columns(replay))
            st.caption("kl_k3 each routing-replay mode removed against the runs of the same config without replay, "
                       "and the signatures of what remains (Compare, Pairs).")


def baselines() -> list[str]:
    """The baseline runs chosen on the Gates tab (still in the database), for the corridor gates."""
    known = S.run_names()
    return [r for r in st.session_state.get("findings_baselines") or [] if r in known]


def pick_run() -> str:
    S.keep_choice("findings_run", sel.runs)
    return st.columns([2, 3])[0].selectbox("Run", sel.runs, key="findings_run",
                                           help="The waterfall and the simulator show one run at a time.")


def waterfall_tab() -> None:
    run = pick_run()
    with S.guard("decompose the change of kl_k3"):
        steps = S.cached(drilldown.run_steps, run)
        if sel.steps:
            steps = [s for s in steps if sel.steps[0] <= s <= sel.steps[1]]
        halves = decomposition.thirds(steps)
        if halves is None:
            st.info("The decomposition needs at least two steps in the chosen range.")
            return
        lo, hi = steps[0], steps[-1]
        for key, default in (("findings_a", halves[0]), ("findings_b", halves[1])):
            value = st.session_state.get(key)
            if not value or value[0] < lo or value[1] > hi:
                st.session_state[key] = default
        c1, c2 = st.columns(2)
        a = c1.slider("Steps A (before)", lo, hi, key="findings_a")
        b = c2.slider("Steps B (after)", lo, hi, key="findings_b")
        thin = S.cached(sampled.thin_steps, [run], (tuple(a), tuple(b)))
        terms = S.cached(decomposition.decompose, run, tuple(a), tuple(b), thin.steps)
        if terms.is_empty():
            st.info("One of the two ranges has no tokens.")
            return
        plot.chart(findings_charts.waterfall, terms, a, b, key="findings_waterfall")
        if thin.label():
            st.caption(f"The decomposition reads token rows: on a run this large it is {thin.label()} of each "
                       "range, to stay interactive.")
        st.caption("How kl_k3 changed from steps A to steps B: the shift of tokens between buckets (response "
                   "length, sampler probability decade, routing flip, staleness; switched in that order) and the "
                   "drift of kl_k3 within buckets. The bars add up exactly; the split between mix terms depends on "
                   "that order.")


def simulator_tab() -> None:
    run = pick_run()
    st.caption("What each off-policy correction would do to this run's logged tokens, per step (METRICS.md, "
               "Corrections). Rewards and advantages come from the `sequences` table where the trainer logged them.")
    with S.guard("simulate the corrections"):
        methods = list(corrections.METHODS)
        S.keep_choices("findings_methods", methods, ["icepop", "geo_rs", "seq_rs"])  # as ui/prefetch.py warms
        chosen = st.multiselect("Methods", methods, key="findings_methods",
                                format_func=lambda m: f"{m}: {corrections.METHODS[m].rule}")
        choices = []
        if chosen:
            for col, m in zip(st.columns(len(chosen)), chosen):
                spec = corrections.METHODS[m]
                col.markdown(f"**{m}** · {md_escape(spec.source)}")
                params = {k: col.number_input(k, value=st.session_state.get(f"findings_{m}_{k}", default),
                                              min_value=0.0, format="%g", key=f"findings_{m}_{k}")
                          for k, default in spec.defaults.items()}
                choices.append((m, params))
        if not choices:
            st.info("Pick at least one method.")
            return
        sim = S.cached(corrections.compare_methods, [run], choices, steps=sel.steps, thin=True)
        per_step, per_run = sim["step"], sim["run"]
        on_tokens = [m for m, p in choices if corrections.reads_tokens(m, p)]
        thin = S.cached(sampled.thin_steps, [run], (sel.steps,)) if on_tokens else None
        if thin is not None and thin.label():
            st.caption(f"{', '.join(on_tokens)}: from token rows (tis always, its weights not being clamped below; "
                       "icepop where a threshold lies off the sidebar's C and 1 ± ε values); on a run this large that "
                       f"is {thin.label()}, and the per-run row is over those steps. The other methods count every "
                       "token, from the per-sequence summaries.")
        plot.chart(findings_charts.simulator_curves, per_step, [
            ("masked_token_frac", "masked tokens"), ("masked_seq_frac", "masked sequences"),
            ("ess_after", "ESS after")], key="findings_sim_curves")
        st.dataframe(per_run, hide_index=True, key="findings_sim_table", column_config=S.number_columns(per_run))
        if per_run["masked_reward_mean"].null_count() == per_run.height and \
                per_run["kept_reward_mean"].null_count() == per_run.height:
            st.caption("This run logged no rewards: the reward columns stay empty.")
        q = S.cached(corrections.log_ratio_quantiles, [run], by="step", steps=sel.steps)
        bands = [(m, corrections.BAND_QUANTITY[m], corrections.band_log_width(m, p)) for m, p in choices]
        plot.chart(findings_charts.noise_vs_bands, q, bands, corrections.QUANTITY_LABELS, key="findings_noise")
        st.caption("Measured p50 (solid) and p99 (dotted) of what each method acts on, per step, against how far its "
                   "band reaches from Δ = 0 on its narrower side: a band below the p50 masks ordinary noise "
                   "(verl-omni RFC #280).")


def history_gates() -> None:
    """Corridors around baseline runs and the band of a configuration (analysis/findings/gates.py)."""
    with S.guard("check the corridors"):
        st.markdown("**Against trusted earlier runs**")
        S.keep_choices("findings_baselines", S.run_names())
        chosen = st.multiselect("Baseline runs", S.run_names(), key="findings_baselines",
                                help="Each metric of the chosen runs must lie in a corridor around the mean of these "
                                     "runs' values (a run is never its own baseline).")
        if chosen:
            table = S.cached(gates.corridor_gates, sel.runs, chosen, steps=sel.steps, cap=sel.cap, clip=sel.clip)
            st.dataframe(table.drop("passed"), hide_index=True, key="findings_corridor",
                         column_config=S.number_columns(table))
            c = gates.Corridor()
            st.caption(f"Corridor {c.text()}, ref the baselines' mean (miles' CI metric-history gate; `findings "
                       "--baseline RUN --corridor K=V` sets others); NaN is an error. For a maximum over tokens, "
                       "n_beyond counts the tokens beyond the edge it crossed: a few tokens are outliers, not the "
                       "distribution.")
    with S.guard("compare with the runs of the same configuration"):
        st.markdown("**Normal for this configuration**")
        band = S.cached(gates.config_bands, sel.runs, steps=sel.steps, cap=sel.cap, clip=sel.clip)
        if band.is_empty():
            st.caption(f"None of these runs has {', '.join(gates.CONFIG_KEYS)} in its config (Data page).")
        else:
            st.dataframe(band, hide_index=True, key="findings_config_band", column_config=S.number_columns(band))
            st.caption(f"Each metric over the other runs of the database whose config has the same "
                       f"{', '.join(gates.CONFIG_KEYS)}: position below / above says the run lies outside all of "
                       f"them (with at least {gates.MIN_PEERS} such runs).")


def gates_tab() -> None:
    history_gates()
    st.markdown("**Published bands and CI gates**")
    with S.guard("check the gates"):
        tables = S.cached(dashboard.run_and_step_tables, sel.runs, cap=sel.cap, clip=sel.clip, steps=sel.steps)
        table = gates.gate_table(tables["run"], tables["step"], sel.runs)
        plot.chart(findings_charts.gates_matrix, table, key="findings_gates_matrix")
        st.dataframe(table, hide_index=True, key="findings_gates",
                     column_config={"passed": st.column_config.CheckboxColumn("pass"),
                                    "value": st.column_config.NumberColumn("value", format="%.4g")})
        st.caption("Published bands and CI gates (docs/DIAGNOSIS.md), each with its source: prime-rl adds a model at "
                   "mean mismatch KL < 0.015 over 20 steps; NeMo RL gates mult_prob_error < 1.05 / 1.1; slime's CI "
                   "log_ratio_abs_mean ≤ 0.1; verl's rollout-correction warning bands.")


# Four tabs; only the open one runs its queries (the findings' own evidence links open the other tabs)
for tab, draw in zip(S.tabs(TABS, key="findings_tab"), (cards_tab, waterfall_tab, simulator_tab, gates_tab)):
    if tab.open:
        with tab:
            draw()
