"""The drift-origin probe: where in the network do the sampler's and the trainer's numbers part?

One model runs two ways on the same tokens: sampler numerics (KV-cache decoding in the sampler dtype) and trainer
numerics (one teacher-forced forward in the trainer dtype). Hooks record every block's input, attention output,
router logits and MoE/MLP output; the comparison per (token, layer, op) becomes the `probe` table, next to the
tokens' log-probs (a run like any other). docs/lab.md, "Drift origin probe".

Importing this package does not import torch: `run_probe` (analysis/probe/run.py) does.
"""
