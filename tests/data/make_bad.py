"""Writes the refused-input samples in tests/data/bad/ (one file per rule; committed, rerun to regenerate).

    python tests/data/make_bad.py
Each `<file>.expected` next to a sample holds the exact message the user must see.
"""
from __future__ import annotations

import gzip
import io
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).parent / "bad"


class NotATensor:  # a custom class: torch.load(weights_only=True) must refuse to build it
    pass


def tokens(n=6, **over):
    cols = {"run": ["r"] * n, "step": [0] * n, "sample": [0] * (n // 2) + [1] * (n - n // 2),
            "pos": [i % (n // 2) for i in range(n)], "sampler_logprob": [-0.5] * n, "trainer_logprob": [-0.4] * n}
    cols.update(over)
    return cols


def seq(**over):
    d = {"run": "r", "step": 1, "sample": 2, "sampler_logprobs": [-0.1, -0.2, -0.3],
         "trainer_logprobs": [-0.1, -0.25, -0.3]}
    d.update(over)
    return json.dumps(d) + "\n"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for p in OUT.iterdir():
        p.unlink()
    t = tokens()
    del t["trainer_logprob"]
    t["trainer_logprob_typo"] = [-0.4] * 6
    pq.write_table(pa.table(t), OUT / "missing_trainer_logprob.parquet")
    (OUT / "nan_logprob.csv").write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\n"
                                         "r,0,0,0,-0.5,-0.4\nr,0,0,1,nan,-0.4\n")
    (OUT / "positive_logprob.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pa.table(
        tokens(trainer_logprob=[-0.4, -0.4, 0.3, -0.4, -0.4, -0.4])).to_pylist()))
    (OUT / "length_mismatch.jsonl").write_text(seq() + seq(sample=3, trainer_logprobs=[-0.1, -0.2]))
    (OUT / "duplicate_key.csv").write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\n"
                                           "r,0,0,0,-0.5,-0.4\nr,0,0,1,-0.5,-0.4\nr,0,0,0,-0.6,-0.4\n")
    pq.write_table(pa.table({"run": ["r"], "step": [0], "sample": [0], "pos": [0], "layer": [0],
                             "sampler_experts": [[1, 2]], "trainer_experts": [[1, 2]]}), OUT / "orphan_routing.parquet")
    (OUT / "k_differs.jsonl").write_text(seq(sampler_experts=[[[0, 1]], [[0, 1]], [[2, 3]]],
                                             trainer_experts=[[[0, 1, 2]], [[0, 1, 2]], [[2, 3, 4]]]))
    (OUT / "repeated_expert.jsonl").write_text(seq(sampler_experts=[[[0, 1]], [[3, 3]], [[2, 3]]]))
    (OUT / "unknown_format.txt").write_text("hello, this is not a log\n")
    good = io.BytesIO()
    pq.write_table(pa.table(tokens()), good)
    (OUT / "truncated.parquet").write_bytes(good.getvalue()[: len(good.getvalue()) // 2] + b"PAR1")
    (OUT / "wrong_type.csv").write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\n"
                                        "r,0,0,0,-0.5,-0.4\nr,one,0,1,-0.5,-0.4\n")
    (OUT / "pickled_object.pt").write_bytes(pickle.dumps({"rollout_log_probs": NotATensor()}, protocol=2))
    gz = gzip.compress((seq() * 200).encode())
    (OUT / "truncated.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (OUT / "empty.csv").write_bytes(b"")
    (OUT / "negative_step.jsonl").write_text(seq(step=-1))
    (OUT / "invalid_json.jsonl").write_text(seq() + '{"run": "r", "step": 2, "sample": 0, "sampler_logprobs": [\n')


if __name__ == "__main__":
    main()
