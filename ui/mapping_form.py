"""The Data page's field mapping: an upload refused because its keys match no format is kept (in this session
only) and offered here, with one dropdown per SCHEMA column over the file's own fields and a preview of its
first rows; loading goes through analysis.ingest.mapping like `ingest --map`."""
from __future__ import annotations

from typing import Callable, Sequence

import streamlit as st

from analysis.ingest import mapping
from analysis.ingest.load import Outcome
from analysis.ingest.uploads import display_name
from ui import state as S

PENDING = "_data_unmapped"  # {file label: uploaded file} refused for unknown keys, waiting for a mapping
NONE = "—"


def remember_unmapped(files: Sequence, outcomes: Sequence[Outcome]) -> None:
    """After an upload: keep the refused files whose fields match no format (JSON Lines / Parquet)."""
    refused = {o.name for o in outcomes if o.status == "refused"}
    pending = st.session_state.setdefault(PENDING, {})
    for f in files:
        label = display_name(f.name)
        if label in refused:
            try:
                if mapping.unmatched_fields(f, label):
                    pending[label] = f
            except Exception:  # an unreadable file keeps its refusal message; nothing to map
                S.log.debug("no fields to map in %s", label, exc_info=True)


def render(store, run: str | None, max_bytes: int, on_loaded: Callable[[Outcome], None]) -> None:
    pending: dict = st.session_state.get(PENDING) or {}
    if not pending:
        return
    st.subheader("Map a file's fields")
    st.caption("Its keys match no accepted format. Pick the field that holds each column (same as "
               "`python -m analysis ingest --map COLUMN=FIELD`); step, sampler_logprob and trainer_logprob are "
               "required. The sampler's log-probs are those the inference engine reported, not a reference "
               "model's (docs/frameworks.md).")
    S.keep_choice("data_map_file", list(pending))
    label = st.selectbox("File", list(pending), key="data_map_file")
    fp = pending[label]
    with S.guard("read the file's fields"):
        fields, head = mapping.preview(fp, label)
        with st.container(key="data_map_preview_box"):
            st.dataframe(head, hide_index=True)
        options = [NONE] + fields
        with st.form("data_map_form"):
            cols = st.columns(4)
            chosen = {}
            for i, column in enumerate(mapping.COLUMNS):
                need = column in mapping.REQUIRED
                chosen[column] = cols[i % 4].selectbox(
                    column + (" (required)" if need else ""), options, key=f"data_map_{column}",
                    index=options.index(column) if column in fields else 0)
            c1, c2 = st.columns([1, 4])
            submitted = c1.form_submit_button("Load with this mapping", type="primary")
            dropped = c2.form_submit_button("Forget this file")
        if dropped:
            pending.pop(label, None)
            st.rerun()
        if submitted:
            outcome = mapping.ingest_mapped_upload(store, label, fp, {c: f for c, f in chosen.items() if f != NONE},
                                                   run=run, max_bytes=max_bytes)
            if outcome.status == "refused":
                st.error(f"refused {outcome.message}", icon=":material/block:")
            else:
                pending.pop(label, None)
                on_loaded(outcome)
