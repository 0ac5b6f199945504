"""`python -m analysis lab`: run drift-lab presets and print one summary line per preset."""
from __future__ import annotations

import argparse
import sys

from analysis.lab.presets import DTYPE_NAMES, PRESETS


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
    switches = parser.add_argument_group("switch overrides (default: the preset's)")
    switches.add_argument("--sampler-dtype", choices=sorted(DTYPE_NAMES))
    switches.add_argument("--trainer-dtype", choices=sorted(DTYPE_NAMES))
    switches.add_argument("--fp32-head", action=argparse.BooleanOptionalAction, default=None,
                          help="LM head matmul + log_softmax in fp32")
    switches.add_argument("--fp32-router", action=argparse.BooleanOptionalAction, default=None,
                          help="router logits in fp32")
    switches.add_argument("--replay", action=argparse.BooleanOptionalAction, default=None,
                          help="routing replay: the trainer uses the sampler's experts")
    switches.add_argument("--lag", type=int, help="trainer weights are LAG updates newer than the sampler's")
    switches.add_argument("--batch", type=int, help="sequences per step (the sampler's batch)")
    switches.add_argument("--trainer-micro-batch", type=int, help="the trainer's forward batch")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    if args.run and len(presets) > 1:
        print("error: --run names a single run; drop it with --preset all (runs are named after presets)",
              file=sys.stderr)
        return 2
    overrides = {name: getattr(args, name) for name in (
        "sampler_dtype", "trainer_dtype", "fp32_head", "fp32_router", "replay", "lag", "batch",
        "trainer_micro_batch") if getattr(args, name) is not None}
    from analysis.lab.run import run_lab  # torch loads here, after the arguments are checked

    for preset in presets:
        try:
            summary = run_lab(preset, out_dir=args.out, steps=args.steps, seed=args.seed, device=args.device,
                              run=args.run, **overrides)
        except (ValueError, RuntimeError) as exc:
            print(f"error: {preset}: {exc}", file=sys.stderr)
            return 2
        print(f"{summary['run']}: {summary['steps']} steps, {summary['n_tokens']} tokens, "
              f"kl_k3={summary['kl_k3']:.1e}, token_any_flip_rate={summary['token_any_flip_rate']:.3f} "
              f"-> {summary['out']} ({summary['seconds']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
