"""Field mapping (`ingest --map`, analysis/ingest/mapping.py): files whose keys match no format load with values
equal to their fields; a wrong mapping is refused whole with the usual message (file, place, rule)."""
from __future__ import annotations

import json

import polars as pl
import pytest

from analysis.__main__ import main
from analysis.ingest import mapping
from analysis.metrics import drilldown
from analysis.store import Store

from helpers.context import OPENRLHF_MAP, make_sequences, openrlhf_record, write_openrlhf_jsonl


def _cli(db, *args) -> int:
    return main(["ingest", *map(str, args), "--db", str(db)])


def _tokens(db) -> pl.DataFrame:
    with Store(db, read_only=True) as store:
        return store.sql("SELECT * FROM tokens ORDER BY step, sample, pos")


def _nothing_loaded(db) -> bool:
    with Store(db, read_only=True) as store:
        return store.scalar("SELECT (SELECT count(*) FROM tokens) + (SELECT count(*) FROM sequences) + "
                            "(SELECT count(*) FROM runs)") == 0


def test_unmapped_board_dump_is_refused_then_loads_with_map(tmp_path, capsys):
    seqs = make_sequences(3)
    path = write_openrlhf_jsonl(tmp_path / "board.jsonl", seqs)
    db = tmp_path / "d.duckdb"
    assert _cli(db, path) == 1
    assert "match no accepted format" in capsys.readouterr().err
    args = [a for m in OPENRLHF_MAP for a in ("--map", m)]
    assert _cli(db, path, *args, "--run", "board") == 0
    assert "loaded board.jsonl [jsonl+map]" in capsys.readouterr().out

    tok = _tokens(db)
    assert tok.height == sum(len(q["s"]) for q in seqs)
    # sequences are numbered in file order within each step (the board has no sample id)
    for q in seqs:
        got = tok.filter((pl.col("step") == q["step"]) & (pl.col("sample") == q["sample"]))
        assert got["sampler_logprob"].to_list() == q["s"]  # the sampler's = rollout_logprobs
        assert got["trainer_logprob"].to_list() == q["t"]  # the trainer's = logprobs, never ref_logprobs
        assert got["token"].to_list() == q["tokens"] and got["pos"].to_list() == list(range(len(q["s"])))
    with Store(db, read_only=True) as store:
        for q in seqs[:6]:
            ctx = drilldown.sequence_context(store, "board", q["step"], q["sample"])
            assert (ctx["prompt"], ctx["response"], ctx["reward"]) == (q["prompt"], q["response"], q["reward"])
            assert ctx["response_from_tokens"] is False and ctx["advantage"] is None


def test_parquet_long_and_per_sequence_tables(tmp_path):
    seqs = make_sequences(4, steps=2, per_step=3)
    long = pl.DataFrame([{"it": q["step"], "seq": q["sample"], "i": j, "p_roll": s, "p_train": t, "txt": w}
                         for q in seqs for j, (s, t, w) in enumerate(zip(q["s"], q["t"], q["tokens"]))])
    long.write_parquet(tmp_path / "long.parquet")
    db = tmp_path / "long.duckdb"
    m = {"step": "it", "sample": "seq", "pos": "i", "sampler_logprob": "p_roll", "trainer_logprob": "p_train",
         "token": "txt"}
    maps = [a for k, v in m.items() for a in ("--map", f"{k}={v}")]
    assert _cli(db, tmp_path / "long.parquet", "--run", "pq", *maps) == 0
    tok = _tokens(db)
    assert tok["sampler_logprob"].to_list() == long["p_roll"].to_list()
    assert tok["trainer_logprob"].to_list() == long["p_train"].to_list()
    assert tok["token"].to_list() == long["txt"].to_list()

    per_seq = pl.DataFrame([openrlhf_record(q) for q in seqs])
    per_seq.write_parquet(tmp_path / "board.parquet")
    db2 = tmp_path / "seq.duckdb"
    assert _cli(db2, tmp_path / "board.parquet", "--run", "pq", *[a for x in OPENRLHF_MAP for a in ("--map", x)]) == 0
    assert _tokens(db2).drop("file_id").equals(tok.drop("file_id"))


@pytest.mark.parametrize("edit, maps, message", [
    (None, ["sampler_logprob=response", "trainer_logprob=logprobs"],
     "board.jsonl: line 1, field 'response': mapped to sampler_logprob, it must hold a number, got str "),
    ({"line": 3, "key": "logprobs", "drop_last": True}, OPENRLHF_MAP,
     "board.jsonl: line 3, field 'logprobs': mapped to trainer_logprob, it has {n} values but field "
     "'rollout_logprobs' (sampler_logprob) has {m} (map fields that hold one value per response token)"),
    ({"line": 2, "key": "rollout_logprobs", "token": 1, "value": "high"}, OPENRLHF_MAP,
     "board.jsonl: line 2, field 'rollout_logprobs', token 1: mapped to sampler_logprob, it must hold numbers, "
     "got str 'high'"),
    (None, ["sampler_logprob=rollout_logprobs", "trainer_logprob=missing_field"],
     "board.jsonl: line 1: field 'missing_field' (mapped to trainer_logprob) is missing"),
])
def test_wrong_mapping_is_refused_whole(tmp_path, capsys, edit, maps, message):
    seqs = make_sequences(5, steps=2, per_step=2)
    recs = [openrlhf_record(q) for q in seqs]
    if edit and edit.get("drop_last"):
        rec = recs[edit["line"] - 1]
        message = message.format(n=len(rec[edit["key"]]) - 1, m=len(rec["rollout_logprobs"]))
        rec[edit["key"]] = rec[edit["key"]][:-1]
    elif edit:
        recs[edit["line"] - 1][edit["key"]][edit["token"]] = edit["value"]
    path = tmp_path / "board.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    db = tmp_path / "d.duckdb"
    assert _cli(db, path, *[a for x in maps for a in ("--map", x)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("refused " + message), err
    assert _nothing_loaded(db)


def test_map_arguments():
    assert mapping.parse_map_args(["sampler_logprobs=a", " token = b "]) == {"sampler_logprob": "a", "token": "b"}
    for bad, why in (("sampler_logprob", "expected COLUMN=FIELD"), ("logprob=x", "unknown column 'logprob'"),
                     ("=x", "expected COLUMN=FIELD")):
        with pytest.raises(ValueError, match=why):
            mapping.parse_map_args([bad])
    with pytest.raises(ValueError, match="mapped twice"):
        mapping.parse_map_args(["step=a", "step=b"])
    assert main(["ingest", "x.jsonl", "--map", "nope=x", "--db", "unused.duckdb"]) == 2


def test_preview_and_unmatched_fields(tmp_path):
    path = write_openrlhf_jsonl(tmp_path / "board.jsonl", make_sequences(6, steps=1, per_step=7))
    with open(path, "rb") as fp:
        assert mapping.unmatched_fields(fp, "board.jsonl") == ["prompt", "response", "response_tokens", "logprobs",
                                                               "ref_logprobs", "rollout_logprobs", "reward", "step"]
        fields, head = mapping.preview(fp, "board.jsonl", rows=5)
    assert head.height == 5 and head.columns == fields and head["step"].to_list() == ["0"] * 5
    known = tmp_path / "ok.jsonl"
    known.write_text(json.dumps({"step": 0, "sample": 0, "sampler_logprobs": [-1.0], "trainer_logprobs": [-1.0]}))
    with open(known, "rb") as fp:
        assert mapping.unmatched_fields(fp, "ok.jsonl") is None
