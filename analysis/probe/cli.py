"""`python -m analysis probe`: run the drift-origin probe, print where the drift starts, optionally load it."""
from __future__ import annotations

import argparse
import sys

DTYPE_CHOICES = ("bf16", "fp16", "fp32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis probe",
        description="Run a model with sampler numerics (KV-cache decoding) and trainer numerics (one teacher-forced "
                    "forward) on the same tokens and compare every block's input, attention output, router logits "
                    "and MoE/MLP output (docs/lab.md, 'Drift origin probe').")
    p.add_argument("--model", required=True, metavar="PATH_OR_CONFIG",
                   help="'lab' (the drift lab's GPT), a Hugging Face model folder, or a folder / file holding only a "
                        "config.json (a randomly initialised model, seeded)")
    p.add_argument("--sampler-dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--trainer-dtype", default="fp32", choices=DTYPE_CHOICES)
    p.add_argument("--prompts", metavar="FILE",
                   help="one prompt per line: token ids separated by spaces, or text (needs the folder's tokenizer); "
                        "default: one random prompt of --prompt-len ids")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, metavar="N", help="response tokens per prompt (default 64)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run", help="run name (default probe-<model>-<sampler dtype>-<trainer dtype>)")
    p.add_argument("--out", required=True, metavar="DIR", help="writes DIR/<run>/ (logs + probe.json)")
    p.add_argument("--db", help="also load the run and its probe rows into this database")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for name in ("tokens", "prompt_len"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    # torch and transformers load here, after the arguments are checked
    from analysis.probe.models import LAB, ModelError
    from analysis.probe.run import read_prompts, run_probe
    try:
        prompts = read_prompts(args.prompts, None if args.model == LAB else args.model) if args.prompts else None
        summary = run_probe(args.model, args.out, args.sampler_dtype, args.trainer_dtype, prompts=prompts,
                            tokens=args.tokens, device=args.device, seed=args.seed, run=args.run,
                            prompt_len=args.prompt_len)
    except (ModelError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{summary['run']}: {summary['model']}, {summary['layers']} layers, {summary['n_tokens']} tokens, "
          f"{summary['n_rows']} probe rows, kl_k3={summary['kl_k3']:.2e} -> {summary['out']} "
          f"({summary['seconds']:.1f} s)", flush=True)
    if args.db:
        from analysis.metrics.probe import by_layer_op, first_above_floor
        from analysis.ingest import open_store
        from analysis.probe.load import load_probe
        from analysis.store import StoreError
        try:
            with open_store(args.db) as store:
                load_probe(store, summary["out"])
                first = first_above_floor(by_layer_op(store, summary["run"]))
        except (StoreError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        where = "nowhere above the fp32 noise floor" if first is None else \
            f"first above the fp32 noise floor at layer {first['layer']} {first['op']} " \
            f"(mean rel L2 {first['rel_l2_mean']:.2e} vs floor {first['floor_rel_l2_mean']:.2e})"
        print(f"loaded into {args.db}: {where}")
    return 0
