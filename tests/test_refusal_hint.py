"""A JSON Lines or Parquet file that matches no accepted format is refused with the way forward: the --map option,
the fields that look like per-token log-probs (lists of numbers ≤ 0), the step and the sample ids, and an example
mapping that then loads the file."""
from __future__ import annotations

import json

import polars as pl
import pytest

from analysis.ingest import ingest_paths
from analysis.ingest.suggest import logprob_fields, map_hint, sample_fields, step_fields
from analysis.store import Store

RECORD = {"prompt": "2+2", "response_tokens": [17, 4], "logprobs": [-0.12, -2.5], "ref_logprobs": [-0.4, -2.9],
          "rollout_logprobs": [-0.1, -2.4], "loss_mask": [1, 1], "zeros": [0, 0], "reward": 1.0,
          "global_step": 3, "sample_idx": 5, "uid": "q-1"}
HINT = ("load it with a field mapping, --map COLUMN=FIELD (repeatable; or the Data page's mapping form); fields that "
        "look like per-token log-probs (lists of numbers ≤ 0): logprobs, ref_logprobs, rollout_logprobs; step: "
        "global_step; sample ids: sample_idx, uid; e.g. --map sampler_logprob=rollout_logprobs --map "
        "trainer_logprob=logprobs --map step=global_step --map sample=sample_idx; docs/frameworks.md has the "
        "mappings of common frameworks")


def test_which_fields_look_like_what():
    assert logprob_fields(RECORD) == ["logprobs", "ref_logprobs", "rollout_logprobs"]  # not the mask nor zeros
    assert step_fields(RECORD) == ["global_step"]
    assert sample_fields(RECORD) == ["sample_idx", "uid"]
    assert logprob_fields({"x": [-1, True], "y": [], "z": [-0.5, float("nan")], "w": "-1"}) == []


def test_hint_without_anything_recognisable():
    assert map_hint({"a": 1, "b": [1, 2]}) == (
        "load it with a field mapping, --map COLUMN=FIELD (repeatable; or the Data page's mapping form); no field "
        "looks like per-token log-probs (lists of numbers ≤ 0)")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_unmatched_file_is_refused_with_the_mapping_to_try(tmp_path, fmt):
    path = tmp_path / f"board.{fmt}"
    records = [RECORD | {"sample_idx": i} for i in range(3)]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        pl.DataFrame(records).write_parquet(path)
    store = Store(tmp_path / "db.duckdb")
    (out,) = ingest_paths(store, [path])
    assert out.status == "refused"
    assert out.message.endswith(f"({HINT})"), out.message
    if fmt == "jsonl":
        assert "match no accepted format" in out.message
    # the example it gives loads the file
    from analysis.ingest.mapping import ingest_mapped, parse_map_args
    mapping = parse_map_args(["sampler_logprob=rollout_logprobs", "trainer_logprob=logprobs", "step=global_step",
                              "sample=sample_idx"])
    (loaded,) = ingest_mapped(store, [path], mapping, run="board")
    assert loaded.status == "loaded", loaded.line()
    assert store.scalar("SELECT count(*) FROM tokens") == 6
    store.close()
