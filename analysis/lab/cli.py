"""`python -m analysis lab`: run drift-lab presets and print one summary line per preset."""
from __future__ import annotations

import argparse
import sys

from analysis.lab.presets import CORRECTIONS, DTYPE_NAMES, PRESETS, REPLAY_MODES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m analysis lab",
        description="Sample and retrain a tiny MoE GPT on CPU to produce real sampler/trainer drift logs.")
    parser.add_argument("--preset", default="bf16", choices=[*PRESETS, "all"],
                        help="switch preset (default bf16); 'all' runs every preset")
    parser.add_argument("--out", required=True, help="output folder; each run writes OUT/<run>/")
    parser.add_argument("--steps", type=int, help="RL steps (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--run", help="run name (default: the preset name); needs a single preset")
    parser.add_argument("--token-sample", type=float, default=1.0,
                        help="share of tokens DriftLogger writes as token rows (default 1; summaries cover all)")
    parser.add_argument("--pack", action="store_true",
                        help="merge each run's per-step files into one file per kind (the bundled demo's form)")
    switches = parser.add_argument_group("switch overrides (default: the preset's)")
    switches.add_argument("--sampler-dtype", choices=sorted(DTYPE_NAMES))
    switches.add_argument("--trainer-dtype", choices=sorted(DTYPE_NAMES))
    switches.add_argument("--fp32-head", action=argparse.BooleanOptionalAction, default=None,
                          help="LM head matmul + log_softmax in fp32")
    switches.add_argument("--fp32-router", action=argparse.BooleanOptionalAction, default=None,
                          help="router logits in fp32")
    switches.add_argument("--replay", choices=REPLAY_MODES,
                          help="routing replay: the trainer uses the sampler's expert ids, or ids and weights")
    switches.add_argument("--lag", type=int, help="trainer weights are LAG updates newer than the sampler's")
    switches.add_argument("--correction", choices=CORRECTIONS,
                          help="off-policy correction in the loss (METRICS.md, Corrections)")
    switches.add_argument("--param", action="append", default=[], metavar="K=V",
                          help="a correction parameter (e.g. --param alpha=0.5); default: METRICS.md's")
    switches.add_argument("--batch", type=int, help="sequences per step (the sampler's batch)")
    switches.add_argument("--trainer-micro-batch", type=int, help="the trainer's forward batch")
    switches.add_argument("--sft-steps", type=int, help="supervised warm-start steps before RL")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    if args.run and len(presets) > 1:
        print("error: --run names a single run; drop it with --preset all (runs are named after presets)",
              file=sys.stderr)
        return 2
    overrides = {name: getattr(args, name) for name in (
        "sampler_dtype", "trainer_dtype", "fp32_head", "fp32_router", "replay", "lag", "correction", "batch",
        "trainer_micro_batch", "sft_steps") if getattr(args, name) is not None}
    from analysis.metrics.corrections import parse_param_args
    try:
        if args.param:
            overrides["correction_params"] = parse_param_args(args.param)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from analysis.lab.run import run_lab  # torch loads here, after the arguments are checked

    for preset in presets:
        try:
            summary = run_lab(preset, out_dir=args.out, steps=args.steps, seed=args.seed, device=args.device,
                              run=args.run, token_sample=args.token_sample, pack=args.pack, **overrides)
        except (ValueError, RuntimeError) as exc:
            print(f"error: {preset}: {exc}", file=sys.stderr)
            return 2
        print(f"{summary['run']}: {summary['steps']} steps, {summary['n_tokens']} tokens, "
              f"kl_k3={summary['kl_k3']:.1e}, token_any_flip_rate={summary['token_any_flip_rate']:.3f}, "
              f"reward {summary['reward_first']:.2f} -> {summary['reward_last']:.2f}"
              + (f", {summary['correction']} zeroes {summary['zero_weight_frac']:.3f} of tokens"
                 if summary["correction"] != "none" else "")
              + f" -> {summary['out']} ({summary['seconds']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
