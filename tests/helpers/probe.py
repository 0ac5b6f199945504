"""Tiny random model configs for the drift-origin probe's tests: a folder holding only a config.json."""
from __future__ import annotations

from pathlib import Path


def qwen3_moe_config(folder: Path, layers: int = 3, experts: int = 8, top_k: int = 2) -> Path:
    from transformers import Qwen3MoeConfig
    folder.mkdir(parents=True, exist_ok=True)
    Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=256,
                   ).to_json_file(folder / "config.json")
    return folder


def mixtral_config(folder: Path, layers: int = 3, experts: int = 4, top_k: int = 2) -> Path:
    from transformers import MixtralConfig
    folder.mkdir(parents=True, exist_ok=True)
    MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=top_k,
                  max_position_embeddings=256).to_json_file(folder / "config.json")
    return folder


def probe_database(root: Path, run: str = "probe-bf16", prompt: tuple[int, ...] = (1, 2, 3, 4), tokens: int = 12):
    """A database at root/drift.duckdb holding one bf16 probe run of the lab model; returns (db, the first site
    above the floor as metrics.probe.first_above_floor gives it)."""
    from analysis.ingest import open_store
    from analysis.metrics import probe as P
    from analysis.probe.load import load_probe
    from analysis.probe.run import run_probe
    out = run_probe("lab", root / "out", "bf16", "fp32", prompts=[list(prompt)], tokens=tokens, run=run)
    with open_store(root / "drift.duckdb") as store:
        load_probe(store, out["out"])
        first = P.first_above_floor(P.by_layer_op(store, run))
    return root / "drift.duckdb", first


def llama_config(folder: Path, layers: int = 2) -> Path:
    """A dense model: no router anywhere."""
    from transformers import LlamaConfig
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256).to_json_file(folder / "config.json")
    return folder
