"""TRL's GRPOTrainer logs through DriftLogger with one line of user code:

    add_drift_logging(trainer, "drift_logs", run="grpo-qwen")   # after GRPOTrainer(...), before trainer.train()

Why hooks and not a TrainerCallback: a callback sees the trainer's state and logs, never the per-token tensors,
so the trainer's own methods are wrapped on this one instance (its class is left alone) and a callback only
flushes each optimizer step. What is read, from trl 1.16.0's trl/trainer/grpo_trainer.py (the version this was
built and tested on; the methods are private, so another version is checked for them before anything is wrapped):

- `_generate_and_score_completions` (:2324) returns a generation batch's `completion_ids`, `completion_mask`,
  `advantages` and, where TRL computes them, `old_per_token_logps` (:2907: the trainer's recompute at the weights
  that sampled, when a batch is reused across optimizer steps or vLLM's importance sampling is corrected) and
  `sampling_per_token_logps` (:2911: the generator's own log-probs, vLLM or a `rollout_func`). The batch is then
  shuffled and split (:1543), so a row id (ROW_KEY) is added here to travel with each row.
- `_calculate_rewards` (:1579) is given the prompts and decoded completions and returns every reward function's
  value per completion, gathered over processes (:2753).
- `_compute_loss` (:3020) computes the current policy's per-token log-probs with one call of
  `_get_per_token_logps_and_entropies` (:3030) and trains on `completion_mask` (times `tool_mask`, :3027).

Which pair is logged (SAMPLER vs TRAINER below) depends on what TRL holds, and the run's config records it as
`trl_logprob_pair`. Steps are TRL's `global_step` after the optimizer step (1 for the first, as in TRL's logs);
the versions are the number of optimizer steps the weights had seen, so a reused batch shows its staleness.
"""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import torch

from analysis.record.logger import DriftLogger

TESTED_TRL = "1.16.0"
ROW_KEY = "_driftscope_row"  # int64 [B]: the generation row each training row came from
WRAPPED = ("_generate_and_score_completions", "_calculate_rewards", "_compute_loss",
           "_get_per_token_logps_and_entropies")

# trl_logprob_pair -> (sampler side, trainer side), as TRL names the tensors
PAIRS = {
    # the generator's log-probs beside the trainer's recompute at the same weights: the sampler/trainer mismatch
    # TRL corrects with importance sampling (vLLM + vllm_importance_sampling_correction)
    "sampling_vs_old_policy": ("sampling_per_token_logps", "old_per_token_logps"),
    # the generator's log-probs beside the policy being trained (no recompute at generation time)
    "sampling_vs_current": ("sampling_per_token_logps", "per_token_logps"),
    # no generation log-probs (transformers generate): the recompute at sampling weights beside the policy trained
    "old_policy_vs_current": ("old_per_token_logps", "per_token_logps"),
    # TRL held only the current policy's log-probs (it uses them, detached, as the old ones: grpo_trainer.py:3066),
    # so Δ is 0 by construction; the rewards, advantages and text are still logged
    "current_vs_current": ("per_token_logps", "per_token_logps"),
}


def add_drift_logging(trainer, out_dir: str | Path, run: str | None = None, config: dict | None = None,
                      **logger_kwargs) -> "GRPODriftHook":
    """Log every optimizer step of `trainer` (a trl.GRPOTrainer) through a DriftLogger under out_dir/run.

    `logger_kwargs` go to DriftLogger (token_sample, seed, ...); `config` joins the run's config, which also
    records the TRL version and the log-prob pair. Returns the hook (its `logger` exists after the first step)."""
    return GRPODriftHook(trainer, out_dir, run, config, logger_kwargs)


def _text(x) -> str:
    """A prompt or completion as TRL holds it -> text: a string as is; a conversation (a list of messages
    whose content is a string or a list of typed parts) as one 'role: content' line per message."""
    if isinstance(x, str):
        return x
    lines = []
    for message in x:
        content = message.get("content", "")
        if not isinstance(content, str):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        lines.append(f"{message.get('role', '')}: {content}")
    return "\n".join(lines)


def total_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> list[float | None]:
    """Each completion's reward: the weighted sum over reward functions, skipping a function that returned None
    (NaN) for it, and None where every function did. The same total TRL logs as `reward` (trl 1.16.0,
    grpo_trainer.py:2826-2827), computed here in float64."""
    r = per_func.detach().to("cpu", torch.float64)
    w = weights.detach().to("cpu", torch.float64)
    scored = ~torch.isnan(r)
    total = torch.where(scored, r * w[None, :], 0.0).sum(1)
    return [float(v) if any_scored else None for v, any_scored in zip(total.tolist(), scored.any(1).tolist())]


def _pad(x: torch.Tensor, T: int, value) -> torch.Tensor:
    return x if x.shape[1] == T else torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)


class GRPODriftHook:
    """The wrapped methods of one GRPOTrainer and what they saw, flushed to DriftLogger once per optimizer step."""

    def __init__(self, trainer, out_dir, run, config, logger_kwargs):
        import trl  # lazily: the rest of Driftscope runs without TRL
        from transformers import TrainerCallback

        if not isinstance(trainer, trl.GRPOTrainer):
            raise TypeError(f"add_drift_logging: expected a trl.GRPOTrainer, got {type(trainer).__name__}")
        missing = [m for m in WRAPPED if not callable(getattr(trainer, m, None))]
        if missing:
            raise RuntimeError(f"add_drift_logging: trl {trl.__version__}'s GRPOTrainer has no {', '.join(missing)} "
                               f"(built on trl {TESTED_TRL}): pin trl=={TESTED_TRL}")
        if getattr(trainer, "_driftscope_hook", None) is not None:
            raise ValueError("add_drift_logging: this trainer already logs to Driftscope (call it once per trainer)")
        if trainer.accelerator.num_processes > 1:
            if logger_kwargs.get("layout", "folder") == "folder":
                raise ValueError("add_drift_logging: with several processes each writes its own rows: pass "
                                 "layout='lake' (one file per rank and step; docs/SCHEMA.md, 'Lake layout')")
            logger_kwargs = {"rank": trainer.accelerator.process_index, **logger_kwargs}
        self.trainer = trainer
        self.trl_version = trl.__version__
        self.out_dir, self.config, self.logger_kwargs = out_dir, dict(config or {}), dict(logger_kwargs)
        self.run = run or trainer.args.run_name or Path(trainer.args.output_dir).name or "grpo"
        self.logger: DriftLogger | None = None  # made at the first step, when the pair TRL holds is known
        self.pair: str | None = None
        self.generations = 0  # train-mode generation batches so far: the row ids' offset
        self.rows: dict[int, tuple] = {}  # row id -> (prompt, response, reward, version at generation)
        self.pending: list[dict] = []  # this optimizer step's micro-batches
        self._seen_rewards = None
        self._captured: list | None = None
        self._originals = {m: getattr(trainer, m) for m in WRAPPED}
        for m in WRAPPED:
            setattr(trainer, m, getattr(self, f"_wrapped{m}"))
        hook = self

        class _Flush(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                hook.flush(state.global_step)

            def on_train_end(self, args, state, control, **kwargs):
                hook.flush(state.global_step + 1)  # micro-batches of a step that never stepped the optimizer

        trainer.add_callback(_Flush())
        trainer._driftscope_hook = self

    # --- the wrapped methods (same signatures as trl 1.16.0's) ---

    def _wrapped_calculate_rewards(self, *args, **kwargs):
        per_func = self._originals["_calculate_rewards"](*args, **kwargs)
        bound = inspect.signature(self._originals["_calculate_rewards"]).bind(*args, **kwargs)
        self._seen_rewards = (list(bound.arguments["prompts"]), list(bound.arguments["completions"]), per_func)
        return per_func

    def _wrapped_generate_and_score_completions(self, inputs):
        training = self.trainer.model.training
        self._seen_rewards = None
        out = self._originals["_generate_and_score_completions"](inputs)
        if not training or self._seen_rewards is None:
            return out  # evaluation: nothing is trained, nothing logged
        prompts, completions, per_func = self._seen_rewards
        self._seen_rewards = None
        acc = self.trainer.accelerator
        n = len(prompts)
        # rewards are gathered over processes; this process's rows are its slice (grpo_trainer.py:2813)
        rewards = total_rewards(per_func, self.trainer.reward_weights)[acc.process_index * n:
                                                                       (acc.process_index + 1) * n]
        base = (self.generations * acc.num_processes + acc.process_index) * n  # distinct over processes and batches
        self.generations += 1
        version = self.trainer.state.global_step
        # a new generation batch replaces TRL's buffer (grpo_trainer.py:1541-1545): older rows are never trained again
        self.rows = {base + i: (_text(prompts[i]), _text(completions[i]), rewards[i], version) for i in range(n)}
        out[ROW_KEY] = torch.arange(base, base + n, dtype=torch.int64, device=out["completion_ids"].device)
        return out

    def _wrapped_get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = self._originals["_get_per_token_logps_and_entropies"](*args, **kwargs)
        if self._captured is not None:
            self._captured.append(result[0].detach())
        return result

    def _wrapped_compute_loss(self, model, inputs):
        if ROW_KEY not in inputs or not model.training:
            return self._originals["_compute_loss"](model, inputs)
        rows = inputs[ROW_KEY]
        inputs = {k: v for k, v in inputs.items() if k != ROW_KEY}  # TRL sees exactly its own inputs
        self._captured = []
        try:
            loss = self._originals["_compute_loss"](model, inputs)
            captured = self._captured
        finally:
            self._captured = None
        if len(captured) != 1:
            raise RuntimeError(f"add_drift_logging: trl {self.trl_version}'s _compute_loss computed the policy's "
                               f"log-probs {len(captured)} times, not once (built on trl {TESTED_TRL})")
        self._stage(inputs, rows, captured[0])
        return loss

    # --- staging and flushing ---

    def _stage(self, inputs: dict, rows: torch.Tensor, current: torch.Tensor) -> None:
        """Keep one micro-batch's pair, mask and context until its optimizer step ends."""
        have = {"sampling_per_token_logps": inputs.get("sampling_per_token_logps"),
                "old_per_token_logps": inputs.get("old_per_token_logps"), "per_token_logps": current}
        if have["sampling_per_token_logps"] is not None:
            pair = "sampling_vs_old_policy" if have["old_per_token_logps"] is not None else "sampling_vs_current"
        else:
            pair = "old_policy_vs_current" if have["old_per_token_logps"] is not None else "current_vs_current"
        sampler_name, trainer_name = PAIRS[pair]
        s, t = have[sampler_name].detach(), have[trainer_name].detach()
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        # a token vLLM could not score carries NaN; TRL gives it no correction (grpo_trainer.py:2663), and it is
        # left out here too rather than refused by the logger
        mask = (mask != 0) & torch.isfinite(s) & torch.isfinite(t)
        now = self.trainer.state.global_step
        ids = rows.tolist()
        context = [self.rows[i] for i in ids]  # now: the next generation batch replaces self.rows
        gen_version = torch.tensor([c[3] for c in context], dtype=torch.int64, device=s.device)
        self.pending.append({
            "pair": pair, "s": s, "t": t, "mask": mask, "token_ids": inputs["completion_ids"].detach(),
            "advantages": inputs["advantages"].detach(), "rows": ids, "context": context,
            "sampler_version": gen_version,
            "trainer_version": gen_version if trainer_name == "old_per_token_logps" else torch.full_like(gen_version,
                                                                                                         now)})

    def flush(self, step: int) -> None:
        """Log the micro-batches of one optimizer step as one DriftLogger step (rows padded to the longest T). A
        row trained twice within the step (a batch reused inside gradient accumulation) is logged once: no
        optimizer step came between, so both passes gave it the same log-probs."""
        parts, self.pending = self.pending, []
        if not parts:
            return
        pair = parts[0]["pair"]
        if self.logger is None:
            self.pair = pair
            config = {**self.config, "trl_logprob_pair": pair, "trl_version": self.trl_version,
                      "trl_sampler_logprobs": PAIRS[pair][0], "trl_trainer_logprobs": PAIRS[pair][1]}
            self.logger = DriftLogger(self.out_dir, self.run, config=config, **self.logger_kwargs)
        if any(p["pair"] != self.pair for p in parts):
            warnings.warn(f"Driftscope: step {step} holds the pair {parts[-1]['pair']}, the run's config says "
                          f"{self.pair} (trl_logprob_pair)", stacklevel=2)
        seen, keep = set(), []
        for p in parts:
            first = [i for i, r in enumerate(p["rows"]) if r not in seen]
            seen.update(p["rows"])
            if first:
                keep.append((p, first))
        T = max(p["s"].shape[1] for p, _ in keep)
        per_token_adv = any(p["advantages"].ndim == 2 for p, _ in keep)

        def cat(key, value):
            out = []
            for p, first in keep:
                x = p[key][first]
                if key == "advantages" and per_token_adv and x.ndim == 1:
                    x = x[:, None].expand(-1, p["s"].shape[1])
                out.append(_pad(x, T, value) if x.ndim == 2 else x)
            return torch.cat(out)

        rows = [p["rows"][i] for p, first in keep for i in first]
        context = [p["context"][i] for p, first in keep for i in first]
        self.logger.log_step(
            step, cat("s", 0.0), cat("t", 0.0), cat("mask", False), token_ids=cat("token_ids", 0),
            sampler_version=cat("sampler_version", 0), trainer_version=cat("trainer_version", 0),
            sample_ids=torch.tensor(rows, dtype=torch.int64),
            rewards=[c[2] for c in context], advantages=cat("advantages", 0.0),
            prompts=[c[0] for c in context], responses=[c[1] for c in context])


__all__ = ["add_drift_logging", "GRPODriftHook", "PAIRS", "ROW_KEY", "TESTED_TRL", "total_rewards"]
