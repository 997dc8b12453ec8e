"""Write a Kimi-K2.5-shaped checkpoint with random weights: the real wrapper and per-layer shapes, fewer of them.

Why: Kimi-K2.5 (1T parameters) needs eight GPUs, yet what the workbook must get right for it does not depend on how
many layers, experts or how wide the residual stream is: the `kimi_k25` multimodal wrapper around a DeepseekV3 text
model (MLA attention with its real head sizes, sigmoid-routed MoE), the checkpoint's tensor names and vLLM's GPU
kernels for those shapes. This writes that structure at ~2B parameters in bf16, in seconds on a GPU host, offline.

    python scripts/kimi_shaped.py --out /tmp/kimi-shaped          # the default shape (param_count: ~2.2B, ~4.4 GB)
    python scripts/kimi_shaped.py --out DIR --layers 4 --experts 8 --hidden 1024 --heads 16

Where each value comes from (SOURCE names the files; KIMI_K25 holds the published values):
- Kimi-K2.5's config.json, preprocessor_config.json and tensor names: https://huggingface.co/moonshotai/Kimi-K2.5
- the names vLLM's loader reads: vllm/model_executor/models/kimi_k25.py (`hf_to_vllm_mapper`, `load_weights`),
  kimi_k25_vit.py (MoonViT3dPretrainedModel, KimiK25MultiModalProjector), deepseek_v2.py (`load_weights`)
- the config keys each reader takes: vllm/transformers_utils/configs/kimi_k25.py (vLLM 0.26, its own class) and
  transformers/models/kimi_k25/configuration_kimi_k25.py (vLLM 0.32 and transformers >= 5.17 load it natively, so the
  checkpoint carries no `auto_map` and needs no remote code). The vision config holds both spellings.
The tokenizer is the embedded SmolLM2's (the real one is tiktoken remote code); vocab_size is its size.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SOURCE = {
    "config": "https://huggingface.co/moonshotai/Kimi-K2.5/blob/main/config.json",
    "preprocessor": "https://huggingface.co/moonshotai/Kimi-K2.5/blob/main/preprocessor_config.json",
    "tensor names": "https://huggingface.co/moonshotai/Kimi-K2.5/blob/main/model.safetensors.index.json",
    "loader": "vllm/model_executor/models/kimi_k25.py, kimi_k25_vit.py, deepseek_v2.py",
    "config classes": "vllm/transformers_utils/configs/kimi_k25.py (0.26); transformers/models/kimi_k25 (vLLM 0.32)",
    "text model_type": "transformers/models/kimi_k25/configuration_kimi_k25.py: text_config model_type kimi_k2",
}
# Kimi-K2.5's text_config (SOURCE["config"]): every per-layer value the shaped checkpoint keeps as it is.
KIMI_K25 = {
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "hidden_act": "silu",
    "rope_theta": 50000.0, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "attention_bias": False, "attention_dropout": 0.0,
    "initializer_range": 0.02, "num_nextn_predict_layers": 0, "aux_loss_alpha": 0.001, "seq_aux": True,
    "ep_size": 1, "tie_word_embeddings": False, "use_cache": True,
}
# What the shaped checkpoint makes smaller; Kimi-K2.5 itself (SOURCE["config"]): 61 layers, 384 experts, hidden 7168,
# 64 heads, vocab 163840; a MoonViT of 27 blocks, 16 heads x 72, MLP 4304.
KIMI_K25_SCALE = {"layers": 61, "experts": 384, "hidden": 7168, "heads": 64, "vocab": 163840, "vision_layers": 27,
                  "vision_heads": 16}
DEFAULT_SHAPE = {"layers": 8, "experts": 16, "hidden": 2048, "heads": 64, "vision_layers": 2, "vision_heads": 4}
VISION_HEAD_DIM, VISION_MLP_PER_HEAD = 72, 269  # 1152 / 16 and 4304 / 16 (SOURCE["config"], vision_config)
PATCH, POS_EMB, MERGE = 14, (64, 64, 4), (2, 2)
# preprocessor_config.json's media_proc_cfg (SOURCE["preprocessor"]), read by vLLM's KimiK25FusedVisionProcessor. Only
# the patch limits are smaller: vLLM profiles the vision tower on its largest image (16384 patches -> 4096 tokens,
# more than a short max_model_len holds); 1024 patches give 256 tokens per image.
MEDIA_PROC_CFG = {"in_patch_limit": 1024, "patch_size": PATCH, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": MERGE[0], "fixed_output_tokens": None,
                  "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 1024, "in_patch_limit_video": None,
                  "sample_fps": 2.0, "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4,
                  "timestamp_mode": "hh:mm:ss.fff", "config_type": "media_proc"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt")
# the media placeholder (Kimi's <|media_pad|>): a SmolLM2 special token that no chat text holds
PLACEHOLDER = "<empty_output>"
SHARD_BYTES = 2 * 1024**3


def vision_config(layers: int, heads: int, text_hidden: int) -> dict[str, Any]:
    """MoonViT's config in both spellings: vLLM 0.26's KimiK25VisionConfig (hidden_size, init_pos_emb_*), transformers'
    Kimi_K25VisionConfig (hidden_size, pos_emb_*) and the published file's (vt_*, read by Kimi's remote code)."""
    width, mlp = heads * VISION_HEAD_DIM, heads * VISION_MLP_PER_HEAD
    h, w, t = POS_EMB
    return {"patch_size": PATCH, "init_pos_emb_height": h, "init_pos_emb_width": w, "init_pos_emb_time": t,
            "pos_emb_height": h, "pos_emb_width": w, "pos_emb_time": t, "pos_emb_type": "divided_fixed",
            "num_attention_heads": heads, "num_hidden_layers": layers, "hidden_size": width,
            "intermediate_size": mlp, "vt_num_attention_heads": heads, "vt_num_hidden_layers": layers,
            "vt_hidden_size": width, "vt_intermediate_size": mlp, "hidden_act": "gelu_pytorch_tanh",
            "merge_kernel_size": list(MERGE), "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
            "mm_projector_type": "patchmerger", "mm_hidden_size": width, "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-5, "text_hidden_size": text_hidden}


def config_dict(layers: int, experts: int, hidden: int, heads: int, vocab: int, vision_layers: int,
                vision_heads: int, tokens: dict[str, int]) -> dict[str, Any]:
    """config.json: Kimi-K2.5's wrapper around its text_config (KIMI_K25) at the given scale; `tokens` holds the
    tokenizer's bos/eos/pad and placeholder ids."""
    if experts < KIMI_K25["num_experts_per_tok"]:
        raise ValueError(f"--experts {experts}: Kimi-K2.5 routes each token to {KIMI_K25['num_experts_per_tok']}")
    ids = {k: tokens[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", **KIMI_K25, "vocab_size": vocab,
            "hidden_size": hidden, "num_hidden_layers": layers, "n_routed_experts": experts,
            "num_attention_heads": heads, "num_key_value_heads": heads, "dtype": "bfloat16", **ids}
    vision = vision_config(vision_layers, vision_heads, hidden)
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", **ids,
            "dtype": "bfloat16", "ignore_index": -100, "media_placeholder_token_id": tokens["placeholder"],
            "image_token_id": tokens["placeholder"], "projection_hidden_size": vision["hidden_size"],
            "tie_word_embeddings": False, "use_unified_vision_chunk": True,
            "video_placeholder": "<|kimi_k25_video_placeholder|>", "text_config": text, "vision_config": vision}


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a kimi_k25 config.json, by formula (no weights built): text model, MoonViT and projector."""
    t, v = config["text_config"], config["vision_config"]
    h, n = t["hidden_size"], t["num_attention_heads"]
    q, kv, rope = t["q_lora_rank"], t["kv_lora_rank"], t["qk_rope_head_dim"]
    attention = (h * q + q + q * n * (t["qk_nope_head_dim"] + rope) + h * (kv + rope) + kv
                 + kv * n * (t["qk_nope_head_dim"] + t["v_head_dim"]) + n * t["v_head_dim"] * h)
    dense = 3 * h * t["intermediate_size"]
    moe = (t["n_routed_experts"] + t["n_shared_experts"]) * 3 * h * t["moe_intermediate_size"] \
        + t["n_routed_experts"] * (h + 1)
    n_dense = t["first_k_dense_replace"]
    text = (t["num_hidden_layers"] * (attention + 2 * h) + n_dense * dense
            + (t["num_hidden_layers"] - n_dense) * moe + 2 * t["vocab_size"] * h + h)
    d, mlp, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * math.prod(v["merge_kernel_size"])
    block = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * d * mlp + mlp + d
    tower = 3 * d * PATCH * PATCH + d + math.prod(POS_EMB[:2]) * d + v["num_hidden_layers"] * block + 2 * d
    projector = 2 * d + merged * merged + merged + merged * h + h
    return text + tower + projector


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[list[int], torch.dtype]]:
    """Every tensor, named as Kimi-K2.5's checkpoint names it (SOURCE["tensor names"]), with its shape and dtype."""
    t, v = config["text_config"], config["vision_config"]
    h, n, bf = t["hidden_size"], t["num_attention_heads"], torch.bfloat16
    q, kv, rope, nope = t["q_lora_rank"], t["kv_lora_rank"], t["qk_rope_head_dim"], t["qk_nope_head_dim"]
    out = {"language_model.model.embed_tokens.weight": [t["vocab_size"], h],
           "language_model.model.norm.weight": [h], "language_model.lm_head.weight": [t["vocab_size"], h]}
    for i in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        out |= {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_a_proj.weight": [q, h], p + "self_attn.q_a_layernorm.weight": [q],
                p + "self_attn.q_b_proj.weight": [n * (nope + rope), q],
                p + "self_attn.kv_a_proj_with_mqa.weight": [kv + rope, h], p + "self_attn.kv_a_layernorm.weight": [kv],
                p + "self_attn.kv_b_proj.weight": [n * (nope + t["v_head_dim"]), kv],
                p + "self_attn.o_proj.weight": [h, n * t["v_head_dim"]]}
        if i < t["first_k_dense_replace"]:
            out |= _mlp(p + "mlp.", h, t["intermediate_size"])
            continue
        out |= {p + "mlp.gate.weight": [t["n_routed_experts"], h]}
        for e in range(t["n_routed_experts"]):
            out |= _mlp(f"{p}mlp.experts.{e}.", h, t["moe_intermediate_size"])
        out |= _mlp(p + "mlp.shared_experts.", h, t["n_shared_experts"] * t["moe_intermediate_size"])
    shapes = {k: (s, bf) for k, s in out.items()}
    shapes |= {f"language_model.model.layers.{i}.mlp.gate.e_score_correction_bias": ([t["n_routed_experts"]],
               torch.float32) for i in range(t["first_k_dense_replace"], t["num_hidden_layers"])}
    return shapes | {k: (s, bf) for k, s in _vision_shapes(v, h).items()}


def _mlp(prefix: str, hidden: int, inner: int) -> dict[str, list[int]]:
    return {prefix + "gate_proj.weight": [inner, hidden], prefix + "up_proj.weight": [inner, hidden],
            prefix + "down_proj.weight": [hidden, inner]}


def _vision_shapes(v: dict[str, Any], text_hidden: int) -> dict[str, list[int]]:
    d, mlp, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * math.prod(v["merge_kernel_size"])
    out = {"vision_tower.patch_embed.proj.weight": [d, 3, PATCH, PATCH], "vision_tower.patch_embed.proj.bias": [d],
           "vision_tower.patch_embed.pos_emb.weight": [*POS_EMB[:2], d],
           "vision_tower.encoder.final_layernorm.weight": [d], "vision_tower.encoder.final_layernorm.bias": [d],
           "mm_projector.pre_norm.weight": [d], "mm_projector.pre_norm.bias": [d],
           "mm_projector.proj.0.weight": [merged, merged], "mm_projector.proj.0.bias": [merged],
           "mm_projector.proj.2.weight": [text_hidden, merged], "mm_projector.proj.2.bias": [text_hidden]}
    for b in range(v["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        out |= {p + "norm0.weight": [d], p + "norm0.bias": [d], p + "norm1.weight": [d], p + "norm1.bias": [d],
                p + "wqkv.weight": [3 * d, d], p + "wqkv.bias": [3 * d], p + "wo.weight": [d, d], p + "wo.bias": [d],
                p + "mlp.fc0.weight": [mlp, d], p + "mlp.fc0.bias": [mlp], p + "mlp.fc1.weight": [d, mlp],
                p + "mlp.fc1.bias": [d]}
    return out


def random_tensor(name: str, shape: list[int], dtype: torch.dtype, gen: torch.Generator, std: float) -> torch.Tensor:
    """Norm weights near 1 (not exactly 1, so a post-norm state differs from a pre-norm one), the router's bias 0
    (float32, as Kimi-K2.5 stores it), everything else N(0, std): activations stay finite in bf16."""
    device = gen.device
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=dtype)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if "norm" in name and name.endswith(".weight") and len(shape) == 1:
        x = 1.0 + 0.1 * x
    else:
        x = std * x
    return x.to(dtype).cpu()


def read_tokens(tokenizer_dir: Path) -> tuple[int, dict[str, int]]:
    """The tokenizer's size and the ids config.json names. Why vocab_size = its size: a random model's argmax over
    an id the tokenizer cannot decode would break vLLM's detokenizer (and stage 02's replies) at the first token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    placeholder = tok.convert_tokens_to_ids(PLACEHOLDER)
    if not isinstance(placeholder, int) or placeholder == tok.unk_token_id:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no {PLACEHOLDER} token for the media placeholder")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return len(tok), {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": pad,
                      "placeholder": placeholder}


def write_weights(folder: Path, config: dict[str, Any], seed: int, device: str) -> int:
    """Random tensors into model-0000i-of-0000n.safetensors shards of at most SHARD_BYTES, and their index."""
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config["text_config"]["initializer_range"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, (shape, dtype) in tensor_shapes(config).items():
        nbytes = math.prod(shape) * dtype.itemsize
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = random_tensor(name, shape, dtype, gen, std)
        size, total = size + nbytes, total + nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def build(out: Path, tokenizer: Path | None = None, seed: int = 0, device: str | None = None, vocab: int | None = None,
          **shape: int) -> Path:
    """Write the checkpoint folder `out` (atomically: built aside, swapped in) and return it. `shape` overrides
    DEFAULT_SHAPE's keys; `tokenizer` is a folder with tokenizer files (None: the embedded SmolLM2's)."""
    from eagle3lib.common.atomic import atomic_dir

    unknown = set(shape) - set(DEFAULT_SHAPE)
    if unknown:
        raise TypeError(f"unknown shape keys {sorted(unknown)}; known: {sorted(DEFAULT_SHAPE)}")
    if tokenizer is None:
        from eagle3lib.common.target import ensure_embedded_target

        tokenizer = ensure_embedded_target()
    size, tokens = read_tokens(Path(tokenizer))
    if vocab is not None and vocab < size:
        raise ValueError(f"--vocab {vocab} is smaller than the tokenizer's {size} tokens")
    config = config_dict(**{**DEFAULT_SHAPE, **shape}, vocab=vocab or size, tokens=tokens)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with atomic_dir(out) as tmp:
        write_weights(tmp, config, seed, device)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        ids = {k: tokens[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
        (tmp / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (Path(tokenizer) / name).is_file():
                shutil.copy2(Path(tokenizer) / name, tmp / name)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write (replaced if it exists)")
    for key, value in DEFAULT_SHAPE.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, dest=key,
                        help=f"default {value}; Kimi-K2.5: {KIMI_K25_SCALE[key]}")
    ap.add_argument("--vocab", type=int, default=None, help="default and least: the tokenizer's size (above it the "
                    "model can emit ids the tokenizer cannot decode)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: the embedded SmolLM2's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="where the random numbers are drawn (default: cuda if present)")
    args = vars(ap.parse_args(argv))
    out = build(args.pop("out"), **args)
    config = json.loads((out / "config.json").read_text())
    gb = sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e9
    print(f"{out}: {param_count(config) / 1e9:.2f}B parameters, {gb:.1f} GB")


if __name__ == "__main__":
    main()
