"""The way forward for a JSON Lines / Parquet file that matches no accepted format: the `--map COLUMN=FIELD` option
(or the Data page's mapping form), and which of its fields look like per-token log-probs (lists of numbers ≤ 0),
the step and the sample ids, judged from its first record."""
from __future__ import annotations

import math

SAMPLER_HINTS = ("rollout", "sampler", "inference", "vllm", "sglang", "behav", "gen")
TRAINER_HINTS = ("old", "trainer", "train", "policy", "actor")
REFERENCE_HINTS = ("ref",)  # a reference model's log-probs: neither side of the mismatch


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def logprob_fields(record: dict) -> list[str]:
    """Fields holding a non-empty list of finite numbers, all ≤ 0 and some < 0 (a 0/1 mask is not one)."""
    return [k for k, v in record.items() if isinstance(v, list) and v and all(_number(x) and x <= 0 for x in v)
            and any(x < 0 for x in v)]


def step_fields(record: dict) -> list[str]:
    return [k for k, v in record.items() if ("step" in k.lower() or "iter" in k.lower())
            and isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def sample_fields(record: dict) -> list[str]:
    def looks(k: str) -> bool:
        k = k.lower()
        return any(w in k for w in ("sample", "uid", "seq_id", "sequence_id")) or k in ("id", "idx", "index")
    return [k for k, v in record.items() if looks(k) and k not in step_fields(record)
            and ((isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, str))]


def _side(name: str) -> int:
    """0: reads like the sampler's, 1: neutral or the trainer's, 2: a reference model's."""
    k = name.lower()
    if any(h in k for h in REFERENCE_HINTS):
        return 2
    return 0 if any(h in k for h in SAMPLER_HINTS) else 1


def map_hint(record: dict | None) -> str:
    """The fix to show: the --map option, the fields that look like what it needs and an example.

    >>> map_hint({"rollout_logprobs": [-0.1, -2.0], "logprobs": [-0.2, -1.9], "global_step": 3, "uid": "a1"})
    "load it with a field mapping, --map COLUMN=FIELD (repeatable; or the Data page's mapping form); fields that look like per-token log-probs (lists of numbers ≤ 0): rollout_logprobs, logprobs; step: global_step; sample ids: uid; e.g. --map sampler_logprob=rollout_logprobs --map trainer_logprob=logprobs --map step=global_step; docs/frameworks.md has the mappings of common frameworks"
    """
    parts = ["load it with a field mapping, --map COLUMN=FIELD (repeatable; or the Data page's mapping form)"]
    if not isinstance(record, dict):
        return parts[0] + "; see SCHEMA.md, 'Accepted files'"
    lp, steps, samples = logprob_fields(record), step_fields(record), sample_fields(record)
    if lp:
        parts.append(f"fields that look like per-token log-probs (lists of numbers ≤ 0): {', '.join(lp)}")
    if steps:
        parts.append(f"step: {', '.join(steps)}")
    if samples:
        parts.append(f"sample ids: {', '.join(samples)}")
    if not (lp or steps or samples):
        parts.append("no field looks like per-token log-probs (lists of numbers ≤ 0)")
    sides = sorted((f for f in lp if _side(f) < 2), key=_side)
    if len(sides) >= 2:
        example = [f"sampler_logprob={sides[0]}", f"trainer_logprob={sides[1]}"]
        example += [f"step={steps[0]}"] if steps and steps[0] != "step" else []
        ints = [f for f in samples if isinstance(record[f], int)]
        example += [f"sample={ints[0]}"] if ints and ints[0] != "sample" else []
        parts.append("e.g. " + " ".join(f"--map {m}" for m in example) + "; docs/frameworks.md has the mappings of "
                     "common frameworks")
    return "; ".join(parts)
