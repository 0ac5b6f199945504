"""Router capture on tiny randomly initialised Hugging Face MoE models (built from configs, no downloads)
and on a hand-written MoE, then end to end: two precisions -> DriftLogger -> ingest -> flip metrics."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from analysis.record.capture import RouterCapture, gather_positions, response_experts

pytestmark = pytest.mark.slow  # forward passes of small torch MoE models

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128)


def tiny(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **TINY))
    elif kind == "qwen2_moe":  # with a shared expert whose own sigmoid gate must not be taken for the router
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **TINY))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, moe_intermediate_size=32, **TINY))
    return model.eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_capture_matches_the_models_own_router_logits(kind):
    model = tiny(kind)
    x = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1))
    with RouterCapture(model) as cap, torch.no_grad():
        out = model(x, output_router_logits=True)
    assert cap.layer_names == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    got = cap.experts()
    assert got.shape == (3, 10, 2, 2)
    # reference: the per-layer router logits the model returns, top-2 of the fp32 softmax
    ref = torch.stack([torch.topk(torch.softmax(lg.float(), -1), 2, dim=-1).indices.reshape(3, 10, 2)
                       for lg in out.router_logits], dim=2)
    assert torch.equal(got, ref)
    # hooks are gone after the block
    with torch.no_grad():
        model(x)
    assert len(cap.forwards) == 1


class LinearGateMoE(nn.Module):
    """transformers-4 style block: `gate` is an nn.Linear returning router logits."""

    def __init__(self, d: int, n_experts: int, k: int):
        super().__init__()
        self.top_k = k
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n_experts))

    def forward(self, x):  # (B, T, d)
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # (B*T, k)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            out[tok] += w[tok, slot, None].to(flat.dtype) * expert(flat[tok])
        self.last = idx.reshape(B, T, self.top_k)
        return out.reshape(B, T, d)


class IdsMoE(LinearGateMoE):
    """lab-style block returning (output, chosen ids (B, T, k)); its gate may be bypassed in fp32 mode."""

    def forward(self, x):
        return super().forward(x), self.last


class Toy(nn.Module):
    def __init__(self, block, n_layers=3, d=16, vocab=50, n_experts=6, k=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(block(d, n_experts, k) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.blocks:
            out = blk(h)
            h = h + (out[0] if isinstance(out, tuple) else out)
        return self.head(h)


def test_auto_finds_linear_gates_and_generic_names_hook_blocks():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 7))
    model = Toy(LinearGateMoE)
    with RouterCapture(model) as cap:  # logits from nn.Linear gates; top_k from the parent block
        model(ids)
    want = torch.stack([blk.last for blk in model.blocks], dim=2)
    assert cap.layer_names == ["blocks.0.gate", "blocks.1.gate", "blocks.2.gate"]
    assert torch.equal(cap.experts(), want)

    model = Toy(IdsMoE)
    with RouterCapture(model, names=["blocks.*"], top_k=2) as cap:  # module name + top_k: ids from the output
        model(ids)
    assert cap.layer_names == ["blocks.0", "blocks.1", "blocks.2"]
    assert torch.equal(cap.experts(), torch.stack([blk.last for blk in model.blocks], dim=2))

    with pytest.raises(ValueError, match="no module named 'nope'"):
        RouterCapture(model, names=["nope"])
    with pytest.raises(ValueError, match="no MoE router found"):
        RouterCapture(nn.Sequential(nn.Linear(2, 2)))


def test_forwards_join_along_tokens_like_prefill_then_decode():
    torch.manual_seed(0)
    model = Toy(LinearGateMoE)
    ids = torch.randint(0, 50, (2, 6))
    with RouterCapture(model) as cap:
        model(ids[:, :4])
        model(ids[:, 4:5])
        model(ids[:, 5:6])
    assert [f.shape[1] for f in cap.forwards] == [4, 1, 1]
    assert cap.experts().shape == (2, 6, 3, 2)
    cap.clear()
    with RouterCapture(model) as cap:
        model(ids[:1])
        model(ids)
    with pytest.raises(RuntimeError, match="different batch sizes"):
        cap.experts()


def test_response_alignment_is_p_plus_j_minus_1():
    B, T, L, K = 2, 9, 1, 1
    experts = torch.arange(T).reshape(1, T, 1, 1).repeat(B, 1, L, K)  # row p holds id p
    got = response_experts(experts, 4, 3)
    assert got[:, :, 0, 0].tolist() == [[3, 4, 5], [3, 4, 5]]
    # per-sample prompt lengths (right-padded prompts); rows past the recorded positions are -1
    got = response_experts(experts, torch.tensor([2, 7]), 4)
    assert got[:, :, 0, 0].tolist() == [[1, 2, 3, 4], [6, 7, 8, -1]]
    assert gather_positions(experts, torch.tensor([[0, -1], [8, 2]]))[:, :, 0, 0].tolist() == [[0, -1], [8, 2]]


def _logprobs(model, ids, P, R):
    with torch.no_grad():
        logits = model(ids).logits.float()  # (B, T, V)
    lp = torch.log_softmax(logits[:, P - 1:P - 1 + R], dim=-1)  # position P + j - 1 predicts token P + j
    return lp.gather(-1, ids[:, P:P + R, None]).squeeze(-1).double()  # (B, R)


def test_bf16_sampler_vs_fp32_trainer_gives_flips_end_to_end(tmp_path):
    from analysis.ingest import ingest_paths
    from analysis.store import Store

    trainer = tiny("mixtral", seed=3)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)  # same weights, rounded: the engine's precision
    B, P, R = 4, 12, 40
    ids = torch.randint(0, 128, (B, P + R), generator=torch.Generator().manual_seed(2))
    sides = {}
    for name, model in (("sampler", sampler), ("trainer", trainer)):
        with RouterCapture(model) as cap:
            lp = _logprobs(model, ids, P, R)
        sides[name] = (lp, response_experts(cap.experts(), P, R))  # (B, R), (B, R, L, K)
    mask = torch.ones(B, R, dtype=torch.int64)
    mask[0, R - 5:] = 0  # a shorter first response
    s_lp, s_ex = sides["sampler"]
    t_lp, t_ex = sides["trainer"]
    flips = (s_ex.sort(-1).values != t_ex.sort(-1).values).any(-1)[mask.bool()]  # (n_tokens, L)
    assert flips.any(), "bf16 rounding should move some near-tied router choices"

    out = tmp_path / "logs"
    try:
        from analysis.record.logger import DriftLogger
    except ImportError:  # pragma: no cover - the logger ships with the project
        pytest.skip("analysis.record.logger.DriftLogger not available")
    DriftLogger(out, "tiny-mixtral", config={"sampler_dtype": "bf16", "trainer_dtype": "fp32"}).log_step(
        0, s_lp, t_lp, mask, token_ids=ids[:, P:], sampler_experts=s_ex, trainer_experts=t_ex)
    store = Store(tmp_path / "db.duckdb")
    outcomes = ingest_paths(store, [out])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    n_tokens = int(mask.sum())
    assert store.scalar("SELECT count(*) FROM tokens") == n_tokens
    assert store.scalar("SELECT count(*) FROM routing WHERE flip IS NOT NULL") == n_tokens * 2
    assert store.scalar("SELECT count_if(flip) FROM routing") == int(flips.sum()) > 0
    try:
        from analysis.metrics.routing import routing_metrics
    except ImportError:  # pragma: no cover
        return
    per_layer = routing_metrics(store, ["tiny-mixtral"], by="layer")
    assert per_layer["flip_rate"].sum() > 0
    store.close()
