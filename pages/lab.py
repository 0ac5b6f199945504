"""Lab: run the torch drift lab (a tiny MoE GPT sampled with a KV cache and retrained) from the browser; the
result is loaded as a new run."""
import shutil
import sys
import tempfile
from pathlib import Path

import streamlit as st

from analysis.metrics import dashboard, probe
from ui import access, auth, nav, plot, probe_charts
from ui import state as S

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Drift lab")
st.caption("A tiny mixture-of-experts GPT learns to sort or reverse a word (`dcab=` → `abcd.`, `dcab<` → `bacd.`) "
           "by RL: it is sampled token by token (KV cache, the sampler's dtype), rewarded, and recomputed in one "
           "forward pass (the trainer's dtype and batch), with Adam updates in between. All the drift is real "
           "floating-point behaviour of torch; nothing is injected. Each run becomes a new run here.")


PRESET_HELP = {
    "bf16": "bf16 sampler, fp32 trainer: the common setup",
    "fp16": "fp16 sampler, fp32 trainer: more mantissa than bf16, less range",
    "fp32": "fp32 on both sides: only kernel/batch order differences remain (the near-zero baseline)",
    "bf16-fp32-head": "bf16 with the LM head and log-softmax in fp32 on both sides",
    "bf16-replay": "bf16 with routing replay: the trainer reuses the sampler's experts (R3)",
    "bf16-replay-weights": "bf16 replaying the sampler's experts and their combine weights",
    "bf16-async": "bf16 with one step of staleness: the trainer is one update ahead (asynchronous RL)",
    "bf16-async-icepop": "bf16-async with IcePop in the loss (tokens with r outside [0.5, 5] masked)",
    "bf16-async-geo-rs": "bf16-async with geometric rejection in the loss (sequences with exp(mean Δ) "
                         "outside [0.999, 1.001] dropped)",
}
ss = st.session_state


def run_tab() -> None:
    if access.read_only():
        st.info(access.VIEWER_MESSAGE, icon=":material/visibility:")
        return

    with S.guard("load the drift lab"):
        import analysis.lab as lab  # presets only: torch loads when a run starts
        PRESETS = lab.PRESETS

        presets = list(PRESETS)
        S.keep_choice("lab_preset", presets)
        c1, c2 = st.columns([2, 3])
        preset = c1.selectbox("Preset", presets, key="lab_preset", format_func=lambda p: p)
        c2.markdown(f"**{preset}**: {PRESET_HELP.get(preset, '')}")
        base = PRESETS[preset]
        if ss.get("_lab_for") != preset:  # a new preset resets the switches to its values
            ss.update(lab_sampler_dtype=base.sampler_dtype, lab_trainer_dtype=base.trainer_dtype,
                      lab_fp32_head=base.fp32_head, lab_fp32_router=base.fp32_router, lab_replay=base.replay,
                      lab_lag=base.lag, lab_correction=base.correction)
            ss["_lab_for"] = preset

        st.markdown("**Switches**")
        dtypes = ["bf16", "fp16", "fp32"]
        c1, c2, c3 = st.columns(3)
        sampler_dtype = c1.selectbox("Sampler dtype", dtypes, key="lab_sampler_dtype")
        trainer_dtype = c2.selectbox("Trainer dtype", dtypes, key="lab_trainer_dtype")
        lag = c3.number_input("Staleness (steps)", 0, 8, step=1, key="lab_lag",
                              help="The trainer's weights are this many optimizer updates newer than the sampler's.")
        c4, c5, c6 = st.columns(3)
        fp32_head = c4.toggle("fp32 LM head", key="lab_fp32_head", help="LM head matmul + log-softmax in fp32, both sides.")
        fp32_router = c5.toggle("fp32 router", key="lab_fp32_router", help="Router logits in fp32, both sides.")
        replay = c6.selectbox("Routing replay", list(lab.REPLAY_MODES), key="lab_replay",
                              help="The trainer uses the sampler's experts (ids, R3), or their combine weights too.")
        correction = st.selectbox("Correction in the loss", list(lab.CORRECTIONS), key="lab_correction",
                                  help="An off-policy correction on r = exp(trainer − sampler log-prob), with the "
                                       "defaults of METRICS.md's Corrections (tis C=2, icepop [0.5, 5], ...).")

        st.markdown("**Size**")
        c1, c2, c3, c4, c5 = st.columns(5)
        steps = c1.number_input("Steps", 1, 400, 10, key="lab_steps")
        batch = c2.number_input("Sequences per step", 4, 256, 32, step=4, key="lab_batch",
                                help="4 answers per prompt: the advantage compares each with its group.")
        sft_steps = c3.number_input("Warm-start steps", 0, 400, base.sft_steps, key="lab_sft_steps",
                                    help="Supervised steps before RL, so the policy is right sometimes.")
        seed = c4.number_input("Seed", 0, 2**31 - 1, 0, key="lab_seed")
        devices = ["cpu"]
        with S.guard("look for a GPU"):
            # without importing torch (seconds): its presence, or an NVIDIA device node, says a GPU may be there;
            # the lab itself refuses cuda with a clear message where CUDA is not usable
            torch = sys.modules.get("torch")
            if (torch.cuda.is_available() if torch is not None else Path("/dev/nvidiactl").exists()):
                devices.append("cuda")
        S.keep_choice("lab_device", devices)
        device = c5.selectbox("Device", devices, key="lab_device")
        names = S.run_names()
        default_name = dashboard.unique_run_name(names, f"lab-{preset}")
        run_name = st.text_input("Run name", key="lab_run_name", placeholder=default_name,
                                 help=f"Empty: {default_name}. Letters, digits and ._+=- only.")
        st.caption(f"About {int(steps) * int(batch) * 7.5:,.0f} tokens (answers average 7.5); on 2 CPU cores the "
                   "warm start and a few steps take tens of seconds.")

        if st.button("Run the lab", type="primary", key="lab_start"):
            name = (run_name or "").strip() or default_name
            overrides = dict(sampler_dtype=sampler_dtype, trainer_dtype=trainer_dtype, lag=int(lag),
                             fp32_head=bool(fp32_head), fp32_router=bool(fp32_router), replay=replay,
                             correction=correction, batch=int(batch), sft_steps=int(sft_steps))
            if int(batch) < base.trainer_micro_batch:
                overrides["trainer_micro_batch"] = int(batch)
            if name in names:
                st.error(f"A run named {name!r} exists already: choose another name (or delete it on the Data page).")
            else:
                out = tempfile.mkdtemp(prefix="driftscope-lab-")
                try:
                    with st.status(f"Running {preset} as {name}…", expanded=True) as status:
                        st.write(f"{int(steps)} steps × {int(batch)} sequences on {device}")
                        summary = lab.run_lab(preset, out_dir=out, steps=int(steps), seed=int(seed), device=device,
                                          run=name, **overrides)
                        st.write(f"Lab finished in {summary['seconds']:.1f} s; loading the logs…")
                        from analysis.ingest import ingest_paths
                        outcomes = ingest_paths(S.store(), [summary["out"]])
                        S.data_changed()
                        refused = [o for o in outcomes if o.status in ("refused", "error")]
                        if refused:
                            status.update(label="The lab ran but its logs were refused", state="error")
                            for o in refused:
                                st.error(o.message)
                        else:
                            status.update(label=f"{name} is ready", state="complete", expanded=False)
                            ss["lab_result"] = summary
                            S.select_runs_next([name], f"Lab run {name} loaded")
                except ValueError as e:  # LabConfig invariants speak for themselves
                    st.error(f"The lab refused these settings: {e}")
                finally:
                    shutil.rmtree(out, ignore_errors=True)

        result = ss.get("lab_result")
        if result:
            st.subheader(f"Last lab run: {result['run']}")
            c1, c2, c3, c4 = st.columns(4)
            c1.metric("tokens", f"{result['n_tokens']:,}")
            c2.metric("KL k3", f"{result['kl_k3']:.3g}", help="low-variance KL(π_sampler‖π_trainer) estimator")
            c3.metric("tokens with a flip", f"{result['token_any_flip_rate']:.1%}")
            c4.metric("reward first → last", f"{result['reward_first']:.3f} → {result['reward_last']:.3f}")
            st.page_link(nav.OVERVIEW.path, label=f"Open {result['run']} on the Overview", icon=":material/arrow_forward:")
            st.page_link(nav.ROUTING.path, label="See its routing flips", icon=nav.ROUTING.icon)

    with st.expander("What the switches do"):
        st.markdown(
            "- **Sampler / trainer dtype**: the precision of each side's weights and activations. bf16 keeps 8 bits of "
            "mantissa, so the KV-cache decode and the one-pass recompute round differently.\n"
            "- **fp32 LM head**: computes the final projection and log-softmax in fp32 on both sides. In dense models "
            "often the largest single fix; in this MoE model router flips carry most of the bf16 mismatch, so it helps "
            "little until routing is replayed.\n"
            "- **fp32 router**: router logits in fp32, so near-tied experts flip less.\n"
            "- **Routing replay**: the trainer reuses the sampler's top-k experts (ids), or their combine weights too "
            "(ids+weights); flips vanish by construction.\n"
            "- **Staleness**: the sampler uses weights that are several optimizer updates old, as in asynchronous RL.\n"
            "- **Correction**: the policy-gradient loss weighs or masks tokens by r (tis, icepop) or drops sequences "
            "(geo_rs, seq_rs, veto), as METRICS.md's Corrections define them.")


def probe_form() -> None:
    """Probe the lab model from the browser (a model folder is named on the command line only: no path here)."""
    with st.expander("Probe the lab model here", expanded=False):
        c1, c2, c3 = st.columns(3)
        s_dtype = c1.selectbox("Sampler dtype", ["bf16", "fp16", "fp32"], key="probe_sampler_dtype")
        t_dtype = c2.selectbox("Trainer dtype", ["fp32", "bf16"], key="probe_trainer_dtype")
        n = c3.number_input("Tokens", 4, 256, 32, key="probe_tokens")
        if st.button("Run the probe", key="probe_start"):
            name = dashboard.unique_run_name(S.run_names(), f"probe-lab-{s_dtype}-{t_dtype}")
            out = tempfile.mkdtemp(prefix="driftscope-probe-")
            try:
                with st.spinner(f"Probing the lab model as {name}…"):
                    from analysis.probe.load import load_probe
                    from analysis.probe.run import run_probe
                    summary = run_probe("lab", out, s_dtype, t_dtype, tokens=int(n), run=name)
                    load_probe(S.store(), summary["out"])
                    S.data_changed()
                ss["probe_run"] = name
                st.success(f"{name} is loaded ({summary['n_rows']:,} probe rows, {summary['seconds']:.1f} s)")
            finally:
                shutil.rmtree(out, ignore_errors=True)


def origin_tab() -> None:
    st.caption("The drift-origin probe runs one model two ways on the same tokens: the sampler's (KV-cache decoding "
               "in its dtype) and the trainer's (one teacher-forced forward in its dtype), and compares every "
               "block's input, attention output, router logits and MoE/MLP output. The floor is the same "
               "comparison with both sides in fp32: what the two code paths differ by when no precision does. "
               "From the command line: `python -m analysis probe --model lab|FOLDER --out DIR --db DB`.")
    if access.writable():
        with S.guard("run the probe"):
            probe_form()
    with S.guard("read the probe"):
        runs = S.cached(probe.probe_runs)
        if not runs:
            st.info("No probe run in this database yet: run one above or with `python -m analysis probe`.",
                    icon=":material/inbox:")
            return
        S.keep_choice("probe_run", runs)
        run = st.selectbox("Probe run", runs, key="probe_run")
        table = S.cached(probe.by_layer_op, run)
        first = probe.first_above_floor(table)
        if first is None:
            st.success("Nowhere above the fp32 noise floor: the sampler and the trainer differ only as much as two "
                       "fp32 code paths do.")
        else:
            st.markdown(f"**Drift starts at layer {first['layer']}, {first['op']}**: mean relative L2 "
                        f"{first['rel_l2_mean']:.3g} against a floor of {first['floor_rel_l2_mean']:.3g} "
                        f"(above the floor: more than {probe.FLOOR_FACTOR:g}× the floor + {probe.FLOOR_ABS:g}).")
        plot.chart(probe_charts.divergence_by_site, table, first, key="probe_sites")
        flips = S.cached(probe.first_flips, run)
        if flips.height:
            st.markdown("**First flipped layer per token** (none: its router top-k sets agree in every layer)")
            plot.chart(probe_charts.first_flip_layers, flips, key="probe_first_flip")
        tokens = S.cached(probe.token_deltas, run)
        if tokens.height:
            st.markdown("**One token through the layers** (largest |Δ| first)")
            labels = [f"sample {r['sample']}, position {r['pos']}: Δ = {r['delta']:+.3g}"
                      for r in tokens.head(200).iter_rows(named=True)]
            S.keep_choice("probe_token", labels)
            pick = st.selectbox("Token", labels, key="probe_token")
            row = tokens.row(labels.index(pick), named=True)
            path = S.cached(probe.token_path, run, row["sample"], row["pos"])
            plot.chart(probe_charts.token_path, path, key="probe_path")
            st.dataframe(path.drop("op_index", "site"), hide_index=True, key="probe_path_table")


for tab, draw in zip(S.tabs(["Run the lab", "Drift origin"], key="lab_tab"), (run_tab, origin_tab)):
    if tab.open:
        with tab:
            draw()
