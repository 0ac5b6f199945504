"""Benchmark the drift-origin probe on CPU: a random 4-layer Qwen3-MoE with 16 experts, 256 response tokens.

    python benchmarks/bench_probe.py [--tokens 256] [--hidden 128] [--repeat 1] [--sampler-dtype bf16] [--no-write]

The whole command, `python -m analysis probe --model DIR --tokens N --out OUT` (imports, the random model built
from a config.json, the bf16 KV-cache decode, the fp32 teacher-forced forward, the fp32 floor decode, the
comparisons and the files), runs as a child process timed alone (wall, CPU, peak RSS); the best of `repeat` counts.
The acceptance line of issue 42: under a minute on 2 cores. Results are appended to benchmarks/RESULTS-probe.md.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from harness import ROOT, record, timed

RESULTS = ROOT / "benchmarks" / "RESULTS-probe.md"
INTRO = """# Drift-origin probe benchmarks (benchmarks/bench_probe.py)

Each entry: `python -m analysis probe` on a random Qwen3-MoE built from a config.json (4 layers, 16 experts,
top-2), timed as a child process (wall, CPU, peak RSS). Target (issue 42): 256 tokens in under a minute on 2 cores.
"""


def write_config(folder: Path, hidden: int, layers: int = 4, experts: int = 16) -> Path:
    from transformers import Qwen3MoeConfig
    folder.mkdir(parents=True, exist_ok=True)
    Qwen3MoeConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                   num_experts=experts, num_experts_per_tok=2, max_position_embeddings=1024,
                   ).to_json_file(folder / "config.json")
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--sampler-dtype", default="bf16")
    ap.add_argument("--no-write", action="store_true", help="print the entry, do not append it")
    args = ap.parse_args()
    import torch
    import transformers

    tmp = Path(tempfile.mkdtemp(prefix="bench-probe-"))
    try:
        model = write_config(tmp / "qwen3-moe-4x16", args.hidden)
        runs = []
        for _ in range(args.repeat):
            shutil.rmtree(tmp / "out", ignore_errors=True)
            runs.append(timed(["python", "-m", "analysis", "probe", "--model", model, "--tokens", args.tokens,
                               "--sampler-dtype", args.sampler_dtype, "--out", tmp / "out"]))
        best = min(runs, key=lambda r: r["seconds"])
        each = ", ".join(f"{r['seconds']:.1f}" for r in runs)
        line = best["stdout"].strip().splitlines()[-1]
        body = (f"- {args.tokens} tokens, hidden {args.hidden}, sampler {args.sampler_dtype} / trainer fp32: "
                f"**{best['seconds']:.1f} s** wall, {best['cpu_seconds']:.1f} CPU-s, peak RSS "
                f"{best['peak_rss_mb']:.0f} MB (best of {len(runs)}: {each} s)\n- the probe's own line: `{line}`")
        record(RESULTS, body, INTRO, versions={"torch": torch.__version__, "transformers": transformers.__version__},
               write=not args.no_write)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
