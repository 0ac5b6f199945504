"""TRL's GRPOTrainer logged through add_drift_logging: real training runs of a few steps on a tiny random model on
CPU (no download), ingested, and every stored value compared with the tensors TRL computed, captured here by
wrapping the same TRL methods outside the hook, and with closed forms (rewards from the reward function on the
decoded text, GRPO's group-normalised advantages)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")  # pinned in requirements-dev.txt: it runs in CI

# torch models train here (slow, as pytest.ini says); trl 1.16.0 calls transformers 5.24's renamed checkpointing API
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")]

from datasets import Dataset  # noqa: E402  (TRL's own dependencies)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from analysis.ingest import ingest_paths  # noqa: E402
from analysis.record.trl import ROW_KEY, add_drift_logging, total_rewards  # noqa: E402
from analysis.store import Store  # noqa: E402

# trl_logprob_pair -> (sampler side, trainer side) as TRL names the tensors: what issue 40 asks of each case
SIDES = {"sampling_vs_old_policy": ("sampling_per_token_logps", "old_per_token_logps"),
         "sampling_vs_current": ("sampling_per_token_logps", "per_token_logps"),
         "old_policy_vs_current": ("old_per_token_logps", "per_token_logps"),
         "current_vs_current": ("per_token_logps", "per_token_logps")}
WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(13)]
PROMPTS = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10 w11"]
G = 4  # completions per prompt


def tiny_model(seed: int):
    """A 2-layer random Qwen2 and a WordLevel tokenizer: no file, no download. The EOS logit is raised so that
    some completions end early and the mask has padding."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config), tokenizer


def reward_w3(completions, **kwargs):
    return [float(c.split().count("w3")) - 0.1 * len(c.split()) for c in completions]


class Witness:
    """TRL's own tensors, per `_compute_loss` call: wraps the trainer's methods outside add_drift_logging's hook,
    so it sees what TRL passed and returned, not what the hook made of it."""

    def __init__(self, trainer):
        self.trainer, self.calls, self._current = trainer, [], None
        compute_loss, logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies

        def witness_logps(*args, **kwargs):
            out = logps(*args, **kwargs)
            if self._current is not None:
                self._current.append(out[0].detach().clone())
            return out

        def witness_compute_loss(model, inputs):
            self._current = []
            before = trainer.state.global_step
            loss = compute_loss(model, inputs)
            self.calls.append({"step": before + 1, "version": before, "current": self._current[0],
                               **{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                  for k, v in inputs.items()}})
            self._current = None
            return loss

        trainer._get_per_token_logps_and_entropies = witness_logps
        trainer._compute_loss = witness_compute_loss


def train(tmp_path, seed, rollout_func=None, **config):
    model, tokenizer = tiny_model(seed)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=G,
                          max_completion_length=6, logging_steps=1, report_to="none", use_cpu=True, seed=seed,
                          save_strategy="no", learning_rate=0.05, beta=0.0, disable_tqdm=True, **config)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_w3, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), rollout_func=rollout_func)
    hook = add_drift_logging(trainer, tmp_path / "logs", run="grpo")  # the user's one line
    with pytest.raises(ValueError, match="already logs to Driftscope"):
        add_drift_logging(trainer, tmp_path / "again")
    witness = Witness(trainer)
    trainer.train()
    store = Store(tmp_path / "drift.duckdb")
    outcomes = ingest_paths(store, [tmp_path / "logs"])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    return hook, witness, store, tokenizer


def expected_rows(witness, tokenizer, pair):
    """What TRL computed, per trained token and per sequence, from the `_compute_loss` calls it made (rows in
    each call are in TRL's shuffled order: both lists are sorted by the stored keys)."""
    sampler_name, trainer_name = SIDES[pair]
    tokens, seqs, masked = [], [], 0
    for call in witness.calls:
        held = {"per_token_logps": call["current"], **{k: call.get(k) for k in ("old_per_token_logps",
                                                                                 "sampling_per_token_logps")}}
        s, t = held[sampler_name].double(), held[trainer_name].double()
        mask = call["completion_mask"].bool()
        masked += int((~mask).sum())
        for b, row in enumerate(call[ROW_KEY].tolist()):
            # the generation that made this row: the first call that trained it
            gen_version = next(c["version"] for c in witness.calls if row in c[ROW_KEY].tolist())
            for pos in mask[b].nonzero().squeeze(1).tolist():
                tokens.append((call["step"], row, pos, int(call["completion_ids"][b, pos]), float(s[b, pos]),
                               float(t[b, pos]), gen_version,
                               gen_version if trainer_name == "old_per_token_logps" else call["version"]))
            response = tokenizer.decode(call["completion_ids"][b], skip_special_tokens=True)
            seqs.append((call["step"], row, float(np.float32(reward_w3([response])[0])),  # TRL's rewards are fp32
                         float(call["advantages"][b]), tokenizer.decode(call["prompt_ids"][b], skip_special_tokens=True),
                         response))
    assert masked > 0  # some completions ended early: padding is left out
    return sorted(tokens), sorted(seqs)


def check_tokens(store, witness, tokenizer, pair):
    """Every stored token equals what TRL computed: float32 log-probs widen exactly, so equality, no tolerance."""
    tokens = store.sql("SELECT step, sample, pos, token_id, sampler_logprob, trainer_logprob, sampler_version, "
                       "trainer_version FROM tokens WHERE run = 'grpo' ORDER BY step, sample, pos")
    assert list(tokens.iter_rows()) == expected_rows(witness, tokenizer, pair)[0]
    return tokens


def check_sequences(store, witness, tokenizer, pair):
    """Every stored sequence: TRL's advantage, the reward function on the decoded completion, the prompt and
    completion text."""
    seqs = store.sql("SELECT step, sample, reward, advantage, prompt, response FROM sequences WHERE run = 'grpo' "
                     "ORDER BY step, sample")
    assert list(seqs.iter_rows()) == expected_rows(witness, tokenizer, pair)[1]
    assert set(seqs["prompt"]) <= set(PROMPTS)
    return seqs


def check_advantages(seqs, steps_per_batch=1):
    """GRPO's advantage, in closed form from the stored rewards: (r − mean of its group) / (std + 1e-4), the
    group being the G completions of one prompt (consecutive row ids), std the unbiased one."""
    first = seqs.filter(seqs["step"] % steps_per_batch == (1 % steps_per_batch))  # each row's first training
    rows = first["sample"].to_numpy()
    r = first["reward"].to_numpy()
    for group in np.unique(rows // G):
        at = rows // G == group
        assert at.sum() == G
        want = (r[at] - r[at].mean()) / (r[at].std(ddof=1) + 1e-4)
        np.testing.assert_allclose(first["advantage"].to_numpy()[at], want, rtol=1e-5, atol=1e-6)


def test_grpo_without_vllm_logs_the_old_policy_beside_the_current(tmp_path):
    # num_iterations=2: each generation batch trains two optimizer steps, so TRL recomputes the old policy's
    # log-probs at generation time and the second step's current policy has moved
    hook, witness, store, tokenizer = train(tmp_path, seed=3, max_steps=4, num_iterations=2)
    assert hook.pair == "old_policy_vs_current"
    config = store.run_config("grpo")
    assert config["trl_logprob_pair"] == "old_policy_vs_current"
    assert config["trl_version"] == trl.__version__
    assert [c["step"] for c in witness.calls] == [1, 2, 3, 4]
    tokens = check_tokens(store, witness, tokenizer, "old_policy_vs_current")
    seqs = check_sequences(store, witness, tokenizer, "old_policy_vs_current")
    stale = tokens.filter(tokens["trainer_version"] > tokens["sampler_version"])
    assert set(stale["step"].to_list()) == {2, 4}  # the reused batches, one optimizer step late
    d = (stale["trainer_logprob"] - stale["sampler_logprob"]).abs()
    assert d.max() > 1e-4  # the policy moved between generation and the second pass
    # the same rows are trained in steps 1 and 2 (and 3 and 4), with the same rewards and advantages
    assert seqs.filter(seqs["step"] == 1)["sample"].to_list() == seqs.filter(seqs["step"] == 2)["sample"].to_list()
    check_advantages(seqs, steps_per_batch=2)


def bf16_rollout(calls: list):
    """A rollout_func (TRL's hook for a custom generator) that samples with the policy's logits rounded to
    bfloat16 and returns those log-probs: a sampler that differs from the trainer like a real engine. Every
    second batch stops at 3 tokens, so two batches of one optimizer step have different lengths T."""
    def rollout(prompts, trainer):
        model, tokenizer = trainer.model, trainer.processing_class
        g = torch.Generator().manual_seed(len(calls))
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        length = 3 if len(calls) % 2 else trainer.args.max_completion_length
        with torch.no_grad():
            for prompt in prompts:
                ids, completion, logprobs = tokenizer(prompt)["input_ids"], [], []
                for _ in range(length):
                    logits = model(torch.tensor([ids + completion])).logits[0, -1]
                    logp = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=g))
                    completion.append(token)
                    logprobs.append(float(logp[token]))
                    if token == tokenizer.eos_token_id:
                        break
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(completion)
                out["logprobs"].append(logprobs)
        calls.append(out)
        return out
    return rollout


def test_grpo_with_generation_logprobs_logs_the_sampler_beside_the_current(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollouts = []
    # two generation batches per optimizer step (gradient accumulation), logged as one step of 16 sequences
    hook, witness, store, tokenizer = train(tmp_path, seed=5, max_steps=2, rollout_func=bf16_rollout(rollouts),
                                            gradient_accumulation_steps=2, steps_per_generation=1)
    assert hook.pair == "sampling_vs_current"
    assert [c["step"] for c in witness.calls] == [1, 1, 2, 2]
    assert witness.calls[0]["completion_ids"].shape[1] != witness.calls[1]["completion_ids"].shape[1]  # padded
    assert store.run_config("grpo")["trl_logprob_pair"] == "sampling_vs_current"
    tokens = check_tokens(store, witness, tokenizer, "sampling_vs_current")
    seqs = check_sequences(store, witness, tokenizer, "sampling_vs_current")
    # the sampler side is also exactly what the generator returned, row by row (rows are ids in generation order)
    by_row = {}
    for batch_index, out in enumerate(rollouts):
        for i, lps in enumerate(out["logprobs"]):
            by_row[batch_index * len(out["logprobs"]) + i] = lps
    for step, sample, pos, s in tokens.select("step", "sample", "pos", "sampler_logprob").iter_rows():
        assert s == by_row[sample][pos]
    assert (tokens["trainer_logprob"] - tokens["sampler_logprob"]).abs().max() > 0  # bf16 logits drift
    assert (tokens["trainer_version"] == tokens["sampler_version"]).all()
    assert seqs.group_by("step").len().sort("step").rows() == [(1, 16), (2, 16)]
    check_advantages(seqs)


def test_grpo_without_generation_logprobs_or_reuse_logs_the_current_policy_twice(tmp_path):
    # TRL holds only the policy's own log-probs here (it skips the recompute), and the run says so
    hook, witness, store, tokenizer = train(tmp_path, seed=7, max_steps=1)
    assert store.run_config("grpo")["trl_logprob_pair"] == "current_vs_current"
    tokens = check_tokens(store, witness, tokenizer, "current_vs_current")
    assert (tokens["trainer_logprob"] == tokens["sampler_logprob"]).all()
    check_sequences(store, witness, tokenizer, "current_vs_current")


def test_total_rewards_skips_unscored_functions():
    per_func = torch.tensor([[1.0, 2.0], [float("nan"), 3.0], [float("nan"), float("nan")]])
    assert total_rewards(per_func, torch.tensor([0.5, 2.0])) == [0.5 + 4.0, 6.0, None]


def test_refuses_what_is_not_a_grpo_trainer(tmp_path):
    with pytest.raises(TypeError, match="expected a trl.GRPOTrainer, got object"):
        add_drift_logging(object(), tmp_path)
