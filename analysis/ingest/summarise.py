"""Partial summaries of one loaded file, computed with SQL over its rows inside the ingest transaction.

Ingest's load calls `add_tokens` (where the token summaries could not be computed while the file streamed) and
`add_routing` once per loaded file; `add_file` does both for other callers. They read `tokens` / `routing`
WHERE file_id = ? and append that file's rows to the summary tables (schema.py); rows of other files are
never read or rewritten (except to join a routing row to its token's Δ), so loading is O(this file).

The per-token terms are SQL of analysis/summaries/sql.py, which the token-level drill-down SQL
(analysis/metrics/token.py) uses too: a metric from summaries and from token rows differ only by summation order.
"""
from __future__ import annotations

from analysis.schema import ROUTING_STORE, RUN_IDS
from analysis.summaries import schema as S
from analysis.summaries.margins import margin_bin_sql
from analysis.summaries.sql import (bucket_params, bucket_sql, check_sums_sql, edge_params, seq_sums_sql,
                                   token_sums_sql, token_terms_sql, with_bin_sql)

# -- the ingest hook -----------------------------------------------------------------------------------

def tokens_summarised(paths, fmt: str) -> bool:
    """Whether a file's rows are already summarised elsewhere: a Parquet file whose schema metadata holds
    schema.SUMMARISED_KEY = SUMMARISED_VALUE (DriftLogger's sampled token rows). Other formats never are."""
    if fmt != "parquet" or len(paths) != 1:
        return False
    import pyarrow.parquet as pq
    try:
        meta = pq.read_schema(paths[0]).metadata or {}
    except Exception:  # unreadable metadata: the reader refuses the file with its own message
        return False
    return meta.get(S.SUMMARISED_KEY) == S.SUMMARISED_VALUE


def add_file(writer, file_id: int, name: str = "") -> None:
    """Append the summaries of the rows file `file_id` brought, all by SQL over its stored rows (call once, after
    they are inserted and checked, inside the same transaction). Raises IngestError when a token's routing layers
    would span two files. Ingest's own load calls the parts below it needs (analysis/ingest/load.py)."""
    has = writer.execute("SELECT (SELECT count(*) > 0 FROM (SELECT 1 FROM tokens WHERE file_id = $f LIMIT 1)), "
                         "(SELECT count(*) > 0 FROM (SELECT 1 FROM routing WHERE file_id = $f LIMIT 1))",
                         {"f": file_id}).fetchall()[0]
    if has[0]:
        add_tokens(writer, file_id)
        add_seams(writer, file_id)
    if has[1]:
        check_routing_whole(writer, file_id, name)
        add_routing(writer, file_id)


def skip_file(writer, file_id: int) -> None:
    """Record that file `file_id` gets no summaries of its own: its token and routing rows are a sample whose
    summaries come in their own summary file (see `tokens_summarised`)."""
    writer.execute("INSERT INTO summary_skip (file_id) VALUES (?)", [file_id])


_DIM_COLS = {"prob": "b_prob", "position": "b_position", "entropy": "b_entropy", "lag": "b_lag"}
_BAND = S.BAND_SUM_NAMES


def add_tokens(writer, file_id: int) -> None:
    """One wide aggregation over the file's tokens, into a small temporary table from which the summary tables
    are merged, plus one narrow one for the Δ histogram. The wide one has two grouping sets:

    - per (sequence, ratio band): summary_seq (merged over bands), summary_seq_band, summary_step (merged
      over the sequences);
    - per (step, prob, position, entropy and lag bucket, band), the joint cell of a token: summary_bucket and
      summary_bucket_band, each dimension merged over the other three (four small GROUP BYs), rather than
      counting every token once per dimension.
    Merging partial sums is addition (fsum), so the tables equal a direct aggregation up to summation order.
    Measured on 4M tokens (benchmarks/bench_summary_hook.py): the two sets in one GROUP BY GROUPING SETS take
    ~25% less CPU than two aggregations; adding the histogram as a third set costs more than its own pass."""
    # imported here, not at the top: numba (~70 MB, ~0.2 s) comes with it, and the app opens its database
    # through open_store, where no file usually needs summarising
    from analysis.summaries.residual import residual_sums_sql
    src = ("SELECT run, step, sample, pos, sampler_logprob AS s, trainer_logprob AS t, sampler_entropy, "
           "trainer_version, sampler_version, segment FROM tokens WHERE file_id = $fid")
    terms = token_terms_sql(src)
    fine = with_bin_sql(terms, "d", "de", len(S.D_EDGES), "bin")
    cells = with_bin_sql(f"SELECT *, {', '.join(f'{bucket_sql(d)} AS {c}' for d, c in _DIM_COLS.items())} "
                         f"FROM ({terms}) bt_", "d", "be", len(S.BAND_EDGES), "band")
    sums = [c.name for c in S.TOKEN_SUMS]
    s_cols = ", ".join(sums)
    b_cols = ", ".join(_DIM_COLS.values())

    def run(sql: str) -> None:
        params = {"fid": file_id} | edge_params("de", S.D_EDGES) | edge_params("be", S.BAND_EDGES) | bucket_params()
        writer.execute(sql, {k: v for k, v in params.items() if f"${k}" in sql})
    seqs, cell = "FROM _summary_part WHERE by_cell = 0", "FROM _summary_part WHERE by_cell = 1"
    try:
        run(f"CREATE TEMP TABLE _summary_part AS SELECT run, step, sample, {b_cols}, band, "
            f"grouping(sample) AS by_cell, max(pos) AS max_pos, {token_sums_sql()}, {seq_sums_sql()} FROM ({cells}) "
            f"GROUP BY GROUPING SETS ((run, step, sample, band), (run, step, {b_cols}, band))")
        seq_cols = sums + list(S.SEQ_SUM_NAMES)
        run(f"INSERT INTO summary_seq (run, step, sample, max_pos, {', '.join(seq_cols)}, file_id) "
            f"SELECT run, step, sample, max(max_pos), {S.merge_list('summary_seq', seq_cols)}, $fid {seqs} "
            "GROUP BY run, step, sample")
        run(f"INSERT INTO summary_seq_band (run, step, sample, band, {', '.join(_BAND)}, file_id) "
            f"SELECT run, step, sample, band, {', '.join(_BAND)}, $fid {seqs}")
        # the logging checks' sums and the residual signatures' counts, joined to the step's row
        checks = ", ".join(S.CHECK_SUM_NAMES + S.RESIDUAL_SUM_NAMES)
        run(f"INSERT INTO summary_step (run, step, {s_cols}, {checks}, file_id) "
            f"SELECT p.*, {', '.join('c.' + c for c in S.CHECK_SUM_NAMES)}, "
            f"{', '.join('e.' + c for c in S.RESIDUAL_SUM_NAMES)}, $fid "
            f"FROM (SELECT run, step, {S.merge_list('summary_step', sums)} {seqs} GROUP BY run, step) p "
            f"LEFT JOIN ({check_sums_sql(src)}) c USING (run, step) "
            f"LEFT JOIN ({residual_sums_sql(src)}) e USING (run, step)")
        for dim, col in _DIM_COLS.items():  # NULL bucket: the token lacks the property (entropy, versions)
            run(f"INSERT INTO summary_bucket (run, step, dim, bucket, {s_cols}, file_id) "
                f"SELECT run, step, '{dim}', {col}, {S.merge_list('summary_bucket', sums)}, $fid {cell} "
                f"AND {col} IS NOT NULL GROUP BY run, step, {col}")
            run(f"INSERT INTO summary_bucket_band (run, step, dim, bucket, band, {', '.join(_BAND)}, file_id) "
                f"SELECT run, step, '{dim}', {col}, band, {S.merge_list('summary_bucket_band', _BAND)}, $fid {cell} "
                f"AND {col} IS NOT NULL GROUP BY run, step, {col}, band")
    finally:
        writer.execute("DROP TABLE IF EXISTS _summary_part")
    run("INSERT INTO summary_hist (run, step, bin, n_tokens, sum_rm1, sum_rm1_sq, file_id) "
        f"SELECT run, step, bin, count(*), fsum(rm1), fsum(rm1 * rm1), $fid FROM ({fine}) GROUP BY run, step, bin")


def add_seams(writer, file_id: int) -> None:
    """The logging checks' pairs of neighbouring tokens (positions p and p + 1 of a sequence) whose two tokens came
    in different files: the file's own summaries count the pairs within it, and each pair across files is counted
    here once, in a summary_step row (n_tokens 0) of the later of its two files (file ids grow with each load, and
    `backfill` goes by file id). Token rows whose summaries came in a summary file (summary_skip) take no part."""
    writer.execute("""
        INSERT INTO summary_step (run, step, n_tokens, n_check_tokens, n_adj, sum_abs_lag_prev, sum_abs_lag_next,
                                  file_id)
        WITH mine AS (SELECT run, step, sample, pos, sampler_logprob AS s, trainer_logprob AS t
                      FROM tokens WHERE file_id = $f),
             other AS (SELECT run, step, sample, pos, sampler_logprob AS s, trainer_logprob AS t FROM tokens
                       WHERE file_id < $f AND file_id NOT IN (SELECT file_id FROM summary_skip)
                         AND step BETWEEN (SELECT min(step) FROM mine) AND (SELECT max(step) FROM mine)
                         AND run IN (SELECT DISTINCT run FROM mine)),
             pairs AS (SELECT m.run, m.step, abs(m.t - o.s) AS lag_prev, abs(o.t - m.s) AS lag_next
                       FROM mine m JOIN other o ON o.run = m.run AND o.step = m.step AND o.sample = m.sample
                                                AND o.pos = m.pos - 1
                       UNION ALL
                       SELECT m.run, m.step, abs(o.t - m.s), abs(m.t - o.s)
                       FROM mine m JOIN other o ON o.run = m.run AND o.step = m.step AND o.sample = m.sample
                                                AND o.pos = m.pos + 1)
        SELECT run, step, 0, 0, count(*), fsum(lag_prev), fsum(lag_next), $f FROM pairs GROUP BY run, step""",
                   {"f": file_id})


def check_routing_whole(writer, file_id: int, name: str) -> None:
    """Refuse a routing file holding a token of which another file already brought routing layers: the
    per-token flip columns (any layer flipped, how many, the first) are computed per file and would count
    such a token twice. Only another file's routing rows in the file's step range can hold one (~0.25 s per 16M
    routing rows where ingest does not know that there are none)."""
    row = writer.execute("""
        WITH mine AS (SELECT DISTINCT run, step, sample, pos FROM routing WHERE file_id = $f)
        SELECT m.run, m.step, m.sample, m.pos FROM mine m
        SEMI JOIN (SELECT run, step, sample, pos FROM routing
                   WHERE file_id <> $f AND step BETWEEN (SELECT min(step) FROM mine) AND (SELECT max(step) FROM mine)) o
          ON o.run = m.run AND o.step = m.step AND o.sample = m.sample AND o.pos = m.pos
        LIMIT 1""", {"f": file_id}).fetchall()
    if row:
        from analysis.ingest.errors import IngestError
        run, step, sample, pos = row[0]
        raise IngestError(name or f"file {file_id}", f"routing of token (run={run!r}, step={step}, sample={sample}, "
                          f"pos={pos})", "other layers of this token were already loaded from another file",
                          "write all MoE layers of a token in one routing file")


def add_routing(writer, file_id: int, routed_tokens: str | None = None) -> None:
    """The routing summaries of file `file_id` (summary_step, summary_seq and summary_layer rows). `routed_tokens`:
    a temporary table of the file's routed tokens, one row each with its flip counts and log-probs s and t (made
    by ingest's orphan check, Writer.join_token_logprobs), where there is one."""
    params = {"fid": file_id}
    # one row per token with trainer routing, with its flip counts and the log-probs of its token row: read from
    # the table the orphan check made of the tokens staged while the file streamed, where there is one (no GROUP
    # BY or join here), else grouped from its (token, layer) rows (~0.26 s per 16M rows) and joined with the
    # token rows (Writer.with_token_logprobs)
    if routed_tokens:
        tokflip = f"SELECT run, step, sample, pos, n_fl, first_flip, s, t FROM {routed_tokens} WHERE n_both > 0"
    else:
        per_token = """SELECT run, step, sample, pos, count_if(flip) AS n_fl, min(layer) FILTER (WHERE flip) AS first_flip
                       FROM routing WHERE file_id = $fid AND flip IS NOT NULL GROUP BY run, step, sample, pos"""
        tokflip = writer.with_token_logprobs(f"({per_token})")
    sql = f"""CREATE TEMP TABLE _summary_flip AS
        SELECT run, step, sample, pos, n_fl, first_flip, abs(d) AS abs_d, k3
        FROM ({token_terms_sql(tokflip)}) tt_"""
    writer.execute(sql, {k: v for k, v in params.items() if f"${k}" in sql})
    counts = ("min(k) AS k, count(*) AS n_rows, count(flip) AS n_both, count_if(flip) AS n_flip, "
              "count_if(top1_flip) AS n_top1, sum(n_common) AS sum_common")
    coded_routing = writer.by_run_id("routing", ("step", "layer", "k", "flip", "top1_flip", "n_common"))
    layer_counts = (f"""SELECT c.run, g.* EXCLUDE (run_id) FROM (
                            SELECT run_id, step, layer, {counts} FROM ({coded_routing}) WHERE file_id = $fid
                            GROUP BY run_id, step, layer) g JOIN {RUN_IDS} c USING (run_id)""" if coded_routing else
                    f"SELECT run, step, layer, {counts} FROM routing WHERE file_id = $fid GROUP BY run, step, layer")
    try:
        writer.execute("""INSERT INTO summary_step (run, step, n_tokens, n_routed, n_any_flip, sum_flipped_layers,
                              sum_abs_d_flip, sum_k3_flip, sum_abs_d_noflip, sum_k3_noflip, file_id)
            SELECT run, step, 0, count(*), count_if(n_fl > 0), sum(n_fl),
                   coalesce(fsum(abs_d) FILTER (WHERE n_fl > 0), 0), coalesce(fsum(k3) FILTER (WHERE n_fl > 0), 0),
                   coalesce(fsum(abs_d) FILTER (WHERE n_fl = 0), 0), coalesce(fsum(k3) FILTER (WHERE n_fl = 0), 0), $fid
            FROM _summary_flip GROUP BY run, step""", {"fid": file_id})
        writer.execute("""INSERT INTO summary_seq (run, step, sample, n_tokens, n_flip_tokens, file_id)
            SELECT run, step, sample, 0, count_if(n_fl > 0), $fid FROM _summary_flip
            GROUP BY run, step, sample""", {"fid": file_id})
        weights = _weight_sums_sql(writer, file_id)
        margins = margin_sums_sql(writer, file_id)
        writer.execute(f"""INSERT INTO summary_layer (run, step, layer, k, n_rows, n_both, n_flip, n_top1, sum_common,
                              n_first_flip, {', '.join(S.WEIGHT_SUM_NAMES)}, {', '.join(S.MARGIN_SUM_NAMES)}, file_id)
            WITH c AS ({layer_counts}),
                 ff AS (SELECT run, step, first_flip AS layer, count(*) AS n_first_flip FROM _summary_flip
                        WHERE first_flip IS NOT NULL GROUP BY ALL),
                 wt AS ({weights}),
                 mg AS ({margins or _no_margins()})
            SELECT c.run, c.step, c.layer, c.k, c.n_rows, c.n_both, c.n_flip, c.n_top1, coalesce(c.sum_common, 0),
                   coalesce(ff.n_first_flip, 0), {', '.join('wt.' + n for n in S.WEIGHT_SUM_NAMES)},
                   {', '.join('mg.' + n for n in S.MARGIN_SUM_NAMES)}, $fid
            FROM c LEFT JOIN ff USING (run, step, layer) LEFT JOIN wt USING (run, step, layer)
                   LEFT JOIN mg USING (run, step, layer)""", {"fid": file_id})
        if margins:
            add_margin_bins(writer, file_id)
    finally:
        writer.execute("DROP TABLE _summary_flip")


def _weight_sums_sql(writer, file_id: int) -> str:
    """SELECT run, step, layer and schema.WEIGHT_SUMS of file `file_id`'s routing rows with both sides' weights
    and equal expert sets (flip false): d = Σ_k |w_s(e_k) − w_t(e_k)|, the trainer's weight of e_k found at e_k's
    rank in its own list (summaries/fulldist.weight_abs_diff). No rows where the file has no trainer weights
    (probed first on the one stored table that holds weights: schema.ROUTING_STORE)."""
    none = "SELECT NULL::VARCHAR AS run, NULL::BIGINT AS step, NULL::INTEGER AS layer, " + ", ".join(
        f"NULL::{c.sql_type} AS {c.name}" for c in S.WEIGHT_SUMS) + " WHERE false"
    if not writer.execute(f"SELECT 1 FROM {ROUTING_STORE} WHERE file_id = ? AND trainer_weights IS NOT NULL "
                          "AND sampler_weights IS NOT NULL LIMIT 1", [file_id]).fetchall():
        return none
    d = ("list_sum(list_transform(range(1, k + 1), lambda i: abs(sampler_weights[i]::DOUBLE - "
         "trainer_weights[list_position(trainer_experts, sampler_experts[i])]::DOUBLE)))")
    return f"""SELECT run, step, layer, count(*)::BIGINT AS n_weight_rows, fsum(d) AS sum_weight_abs_diff,
                      max(d) AS max_weight_abs_diff
               FROM (SELECT run, step, layer, {d} AS d FROM routing
                     WHERE file_id = $fid AND flip = false AND sampler_weights IS NOT NULL
                       AND trainer_weights IS NOT NULL) w_
               GROUP BY run, step, layer"""


def margin_sums_sql(writer, file_id: int) -> str | None:
    """SELECT run, step, layer and schema.MARGIN_SUMS of file `file_id`'s routing rows (count and Σ of each side's
    router margin, the stored fp32 widened); None where the file has no margins (probed first on the one stored
    table that holds them: schema.ROUTING_STORE)."""
    if not writer.execute(f"SELECT 1 FROM {ROUTING_STORE} WHERE file_id = ? AND (sampler_margin IS NOT NULL "
                          "OR trainer_margin IS NOT NULL) LIMIT 1", [file_id]).fetchall():
        return None
    return """SELECT run, step, layer, count(sampler_margin)::BIGINT AS n_margin_sampler,
                     fsum(sampler_margin::DOUBLE) AS sum_margin_sampler,
                     count(trainer_margin)::BIGINT AS n_margin_trainer, fsum(trainer_margin::DOUBLE) AS sum_margin_trainer
              FROM routing WHERE file_id = $fid AND (sampler_margin IS NOT NULL OR trainer_margin IS NOT NULL)
              GROUP BY run, step, layer"""


def _no_margins() -> str:
    return "SELECT NULL::VARCHAR AS run, NULL::BIGINT AS step, NULL::INTEGER AS layer, " + ", ".join(
        f"NULL::{c.sql_type} AS {c.name}" for c in S.MARGIN_SUMS) + " WHERE false"


def add_margin_bins(writer, file_id: int) -> None:
    """summary_margin rows of file `file_id` (after add_routing made _summary_flip, its routed tokens' |Δ|): per
    (step, layer, side, margin bin) the rows with both sides' experts and that side's margin, their flips and
    Σ |Δ| of their tokens (summaries/margins.py)."""
    sides = " UNION ALL ".join(
        f"SELECT run, step, sample, pos, layer, flip, '{side}' AS side, {margin_bin_sql(side + '_margin')} AS margin_bin "
        f"FROM routing WHERE file_id = $fid AND flip IS NOT NULL AND {side}_margin IS NOT NULL"
        for side in S.MARGIN_SIDES)
    writer.execute(f"""INSERT INTO summary_margin (run, step, layer, side, margin_bin, n_rows, n_flip, sum_abs_d,
                                                   file_id)
        SELECT r.run, r.step, r.layer, r.side, r.margin_bin, count(*), count_if(r.flip), fsum(f.abs_d), $fid
        FROM ({sides}) r JOIN _summary_flip f USING (run, step, sample, pos)
        GROUP BY r.run, r.step, r.layer, r.side, r.margin_bin""", {"fid": file_id})


def unsummarised_files(cur) -> list[int]:
    """Files with token or routing rows but no summary rows (loaded before summaries existed), token files first.

    Every open of a writable database asks this, so the candidates come from the small `files` table, and each
    is checked with one LIMIT 1 probe per table rather than a DISTINCT over every token and routing row."""
    candidates = [r[0] for r in cur.execute("""
        SELECT file_id FROM files
        WHERE file_id NOT IN (SELECT file_id FROM summary_step UNION SELECT file_id FROM summary_layer
                              UNION SELECT file_id FROM summary_skip)
        ORDER BY file_id""").fetchall()]

    def holds(table: str, fid: int) -> bool:
        return bool(cur.execute(f"SELECT 1 FROM {table} WHERE file_id = ? LIMIT 1", [fid]).fetchall())

    with_tokens = [f for f in candidates if holds("tokens", f)]
    return with_tokens + [f for f in candidates if f not in with_tokens and holds("routing", f)]


def backfill(store) -> int:
    """Summarise the files a database holds without summaries (one transaction each); returns how many.
    Legacy routing whose layers of a token span files is accepted here (its per-token flip counts are then per
    file), since refusing would leave the rows unsummarised for good."""
    done = 0
    for fid in unsummarised_files(store.cursor()):
        with store.transaction() as w:
            if w.execute("SELECT count(*) FROM tokens WHERE file_id = ?", [fid]).fetchall()[0][0]:
                add_tokens(w, fid)
                add_seams(w, fid)
            if w.execute("SELECT count(*) FROM routing WHERE file_id = ?", [fid]).fetchall()[0][0]:
                add_routing(w, fid)
        done += 1
    return done


def open_store(path=None, **kwargs):
    """The database opened for writing by ingest's callers (the CLI, `watch`, the app): a Store, whose own
    opening runs the layout migrations (analysis/migrations.py), and then, once, the summaries of files loaded
    before summaries existed (`backfill`: it needs this module's SQL, which the store does not import)."""
    from analysis.store import Store
    store = Store(path, **kwargs)
    backfill(store)
    return store
