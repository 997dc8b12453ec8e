"""A Qwen2 target with TIED embeddings through stages 04-06, on a tiny random Qwen2 built from its transformers config.

Why tied here: both embedded Qwen2.5-Coder GGUFs turned out untied (checked: each ships output.weight beside
token_embd, quantized differently), and the untied path runs on the real 0.5B in tests/e2e/test_qwen_target.py. Qwen2
differs from the tiny Llama elsewhere in attention biases and in speculators building a Llama-shaped draft layer
from a verifier of another family.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3lib.common.rundir import RunDir, StageRun
from eagle3lib.common.stages import get_stage


def build_tiny_qwen2(out: Path, tie: bool, vocab: int = 512, hidden: int = 64, num_layers: int = 6) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=tie)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out


def test_a_tied_qwen2_target_through_stages_04_to_06(tmp_path):
    from conftest import make_tiny_run
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from eagle3lib import train, verifier
    from eagle3lib.evaluate.decoder import greedy_generate, load_draft, speculative_generate

    model_dir = build_tiny_qwen2(tmp_path / "qwen2", tie=True)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.layers.0.self_attn.q_proj.bias" in f.keys()
    root = tmp_path / "outputs"
    root.mkdir()
    cfg, rd = make_tiny_run(root, model_dir)
    stage04 = StageRun(get_stage("04"), cfg, rd)
    stage04.finish(verifier.run(stage04, check_speculators=False))
    assert rd.read_manifest("04")["metrics"]["tied"] is True
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"epochs": 1, "packing_length": 256})})
    result = train.train(RunDir(rd.root, cfg), progress=False)["eagle3"]
    ckpt = Path(result["checkpoint"])
    layer = json.loads((ckpt / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["hidden_size"] == 64  # speculators' draft layer for any verifier
    assert train.check_vllm_config(ckpt, hidden_size=64, aux_layer_ids=[1, 2, 3], draft_vocab_size=256, draft_tokens=3,
                                   target_vocab_size=512) == []
    # stage 06's embedded decoder with this draft: exactly the tied target's greedy output
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    draft = load_draft(ckpt)
    for prompt in torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3)).tolist():
        ref, _ = greedy_generate(target, prompt, 16)
        assert speculative_generate(target, draft, prompt, 3, 16).output_ids == ref
