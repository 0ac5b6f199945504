"""Data: load logs (several files or zip archives at once), list runs and files, edit a run's config, delete a
run, download any metrics table as CSV."""
import threading

import streamlit as st
from streamlit.runtime.scriptrunner import add_script_run_ctx, get_script_run_ctx

from analysis.metrics import dashboard, report
from analysis.store import Store
from ui import access, auth, mapping_form
from ui import state as S
from ui.auth import md_escape

auth.ensure_routed_through_app()  # before anything draws: every request goes through app.py

st.title("Data")
st.caption("Everything in the database, and the way in: upload sampler/trainer log-prob logs, inspect what was "
           "loaded, fix a run's config, remove a run.")

sel = S.selection()
store = S.store()
ss = st.session_state

# -- upload -------------------------------------------------------------------------------------------
st.subheader("Load logs")
if access.read_only():
    st.info(access.VIEWER_MESSAGE, icon=":material/visibility:")
else:
    st.markdown("Accepted, recognised by content: long tables (**Parquet, CSV, JSON Lines**) with the SCHEMA.md "
                "columns; **sequence JSON Lines** (`.jsonl`, `.jsonl.gz`); **tensor dumps** (`.pt`, "
                "`.safetensors`) with `rollout_log_probs` / `old_log_probs`; framework exports; **expert-load dumps** "
                "of SGLang and TensorRT-LLM (with a run name below); and **zip** archives of any of these. Loading "
                "the same content twice adds nothing.")

    def _check_lines(runs: list[str]) -> list[tuple[str, str]]:
        """(run, the line naming the likely setting) for each loaded run whose logging checks hold."""
        if not runs:
            return []
        try:
            from analysis.findings.ranking import logging_checks
            return [(run, v.line()) for run, v in logging_checks(store, runs).items() if v.holds]
        except Exception:  # the banner is advice: a failure here must not hide the upload's outcome
            S.log.exception("logging checks after an upload failed")
            return []

    def _record(outcomes) -> None:
        """Show the outcomes after the rerun, select the new runs, drop cached results."""
        S.data_changed()
        ss["data_outcomes"] = [dict(file=o.name, status=o.status,
                                    format=o.format or "", rows=sum(o.rows.values()) if o.rows else 0,
                                    runs=", ".join(o.runs), message=o.message) for o in outcomes]
        new_runs = sorted({r for o in outcomes if o.status == "loaded" for r in o.runs})
        ss["data_checks"] = _check_lines(new_runs)
        n_ok = sum(o.status == "loaded" for o in outcomes)
        S.select_runs_next(new_runs, f"Loaded {n_ok} of {len(outcomes)} files"
                           + (f": runs {', '.join(new_runs)}" if new_runs else ""))
        st.rerun()

    nonce = ss.setdefault("_data_upload_nonce", 0)
    max_bytes = access.max_upload_bytes()
    # the browser refuses a single file over the cap before sending it; the total is checked on Load
    widget_mb = max(1, min(max_bytes // access.MiB, int(st.get_option("server.maxUploadSize"))))
    files = st.file_uploader("Log files", accept_multiple_files=True, key=f"data_upload_{nonce}",
                             max_upload_size=widget_mb,
                             help=f"Pick several files at once, or a zip of a whole log folder; at most "
                                  f"{max_bytes / access.MiB:,.0f} MiB per upload.")
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    run_override = c1.text_input("Run name (optional)", key="data_run_name",
                                 help="Used for files that carry no run name; overrides the files' own names.",
                                 placeholder="taken from the files")
    refusal = access.upload_refusal([f.size for f in files or []], max_bytes)
    load = c2.button("Load", type="primary", key="data_load", disabled=not files or bool(refusal), width="stretch")
    if refusal:
        st.error(refusal, icon=":material/block:")
    elif load and files:
        bar = st.progress(0.0, text="Starting…")
        at = {"i": 0, "n": 1, "name": ""}
        ctx = get_script_run_ctx()

        def _progress(i: int, n: int, name: str) -> None:
            at.update(i=i, n=n, name=name)
            bar.progress(min(1.0, i / n) if n else 1.0, text=f"Loading {name} ({i + 1}/{n})" if name else "Done")

        def _rows(done: int, total: int | None) -> None:
            # called from DuckDB's reading thread: attach this session so the bar may be updated from it
            add_script_run_ctx(threading.current_thread(), ctx)
            share = min(1.0, done / total) if total else 0.0
            i, n = at["i"], at["n"] or 1
            bar.progress(min(1.0, (i + share) / n), text=f"Loading {at['name']} ({i + 1}/{n}): {done:,} rows"
                         + (f" of {total:,}" if total else ""))

        try:
            from analysis.ingest.uploads import ingest_uploads
            outcomes = ingest_uploads(store, [(f.name, f) for f in files], run=run_override.strip() or None,
                                      max_bytes=max_bytes, progress=_progress, on_rows=_rows)
        except Exception as e:  # never a traceback: the upload path reads untrusted bytes
            S.log.exception("upload failed")
            st.error(f"Could not load the upload: {S.explain(e)}")
            outcomes = []
        finally:
            bar.empty()
        if outcomes:
            mapping_form.remember_unmapped(files, outcomes)  # refused for unknown keys: offered for mapping
            ss["_data_upload_nonce"] = nonce + 1  # a fresh, empty uploader
            _record(outcomes)
    if ss.get("data_outcomes"):
        res = ss["data_outcomes"]
        n = {k: sum(r["status"] == k for r in res) for k in ("loaded", "skipped", "refused", "error")}
        msg = f"Last upload: {n['loaded']} loaded, {n['skipped']} skipped, {n['refused']} refused."
        if n["error"]:  # a bug of ours, not a refusal: the table's message says to report it
            st.error(f"{n['error']} file(s) hit an internal error while reading (see the table).")
        (st.warning if n["refused"] else st.success)(msg)
        for run, line in ss.get("data_checks", []):
            st.warning(f"**Check the logging first**: run **{md_escape(run)}**: {md_escape(line)}. No drift number "
                       "means anything until this is fixed; the Findings page ranks it first.",
                       icon=":material/rule:")
        st.dataframe(res, hide_index=True, key="data_outcomes_table",
                     column_config={"message": st.column_config.TextColumn("message", width="large")})
    mapping_form.render(store, run_override.strip() or None, max_bytes, lambda o: _record([o]))

# -- runs and files -----------------------------------------------------------------------------------
st.subheader("Runs")
runs_df = S.runs_table()
names = runs_df["run"].to_list()
if not names:
    st.info("No runs yet: load files above, or generate one on the Lab page.")
else:
    st.dataframe(runs_df.drop("config"), hide_index=True, key="data_runs_table",
                 column_config={"n_tokens": st.column_config.NumberColumn("tokens", format="localized"),
                                "n_steps": "steps", "n_sequences": "sequences",
                                "has_routing": "routing", "has_trainer_routing": "trainer routing",
                                "first_step": "first step", "last_step": "last step"})
    with st.expander("Files loaded"):
        with S.guard("list the files"):
            files_df = S.cached(Store.files)
            st.dataframe(files_df.drop("sha256"), hide_index=True, key="data_files_table",
                         column_config={"size": st.column_config.NumberColumn("bytes", format="localized")})

if names and access.writable():
    left, right = st.columns(2)
    with left:
        st.subheader("Edit a run's config")
        S.keep_choice("data_cfg_run", names, default=sel.runs[0] if sel.runs else None)
        cfg_run = st.selectbox("Run", names, key="data_cfg_run")
        if ss.get("_data_cfg_for") != cfg_run or "data_cfg_text" not in ss:
            with S.guard("read the config"):
                ss["data_cfg_text"] = dashboard.config_text(store.run_config(cfg_run))
            ss["_data_cfg_for"] = cfg_run
        st.text_area("Config (JSON object)", key="data_cfg_text", height=240,
                     help="What changes numerics: dtypes, engine, logprob mode, temperature, top-p, batch size, "
                          "parallelism, mitigation switches. Shown on Overview and compared on Compare.")
        if st.button("Save config", key="data_cfg_save"):
            try:
                config = dashboard.parse_config(ss["data_cfg_text"])
            except ValueError as e:
                st.error(f"Config not saved: {e}")
            else:
                with S.guard("save the config"):
                    store.set_run_config(cfg_run, config)
                    S.data_changed()
                    st.success(f"Saved the config of {cfg_run} ({len(config)} keys).")
    with right:
        st.subheader("Delete a run")
        S.keep_choice("data_del_run", names)
        del_run = st.selectbox("Run to delete", names, key="data_del_run")
        confirm = st.text_input("Type the run's name to confirm", key="data_del_confirm",
                                placeholder=del_run)
        if st.button("Delete run", key="data_del_button", type="primary", disabled=confirm != del_run,
                     help="Removes its tokens, routing, sequences and file records. Cannot be undone."):
            with S.guard(f"delete {del_run}"):
                store.delete_run(del_run)
                S.data_changed()
                ss.pop("data_del_confirm", None)
                S.select_runs_next([], f"Deleted run {del_run}")
                st.rerun()
        st.caption("Deleting removes the run's tokens, routing, sequences and the record of its files, so the "
                   "same files can be loaded again.")

# -- downloads ----------------------------------------------------------------------------------------
if names:
    st.subheader("Download a metrics table")
    tables = {"step": "token metrics per step", "run": "metrics per run", "layer": "routing metrics per (step, layer)"}
    c1, c2, c3 = st.columns([2, 3, 2], vertical_alignment="bottom")
    S.keep_choice("data_dl_by", list(tables))
    by = c1.selectbox("Table", list(tables), key="data_dl_by", format_func=tables.get)
    S.keep_choices("data_dl_runs", names, sel.runs or names[:1])
    dl_runs = c2.multiselect("Runs", names, key="data_dl_runs")
    cap, clip = sel.cap, sel.clip

    def _csv() -> str:
        # runs on a separate thread when the button is clicked: the Store gives that thread its own cursor
        try:
            return report.metrics_table(store, list(dl_runs), by=by, cap=cap, clip=clip).write_csv()
        except Exception as e:
            S.log.exception("metrics download failed")
            return f"error\n{S.explain(e)!r}\n"

    # on_click="ignore": a download needs no rerun, and a rerun racing the deferred fetch of `_csv` could lose it
    c3.download_button("Download CSV", data=_csv, file_name=f"driftscope-metrics-by-{by}.csv", mime="text/csv",
                       key="data_dl_button", disabled=not dl_runs, width="stretch", on_click="ignore")
    st.caption(f"Same columns as `python -m analysis metrics --by {by}` (METRICS.md), with C = {cap:g}, ε = {clip:g}.")
