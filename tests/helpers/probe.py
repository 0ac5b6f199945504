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
