"""What the vLLM capture tests share (tests/unit/test_vllm_backends.py, test_vllm_deepseek.py): the config of a
capture run, random rows, the transformers reference states, running a backend and its capture probe, the parity
assertion, and tiny random DeepseekV3 / V2 (MLA + MoE) models built from transformers configs."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3lib.common.errors import WorkbookError

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM (vllm-cpu) is not installed")
COS_MIN = 0.9999


# ---- helpers -------------------------------------------------------------------------------------------------------

def make_cfg(root: Path, model_dir: Path, strategy: str, layer_ids: list[int], *extra: str):
    from eagle3lib.common.config import load_config

    return load_config(None, [f"run.output_root={root}", f"run.name=vllm-{strategy}", f"target.model={model_dir}",
                              f"target.layer_ids={layer_ids[:-1]}", "extract.backend=vllm",
                              f"extract.strategy={strategy}", "extract.dtype=float32", "target.dtype=float32",
                              "extract.batch_tokens=64", "extract.max_model_len=128", *extra])


def random_rows(vocab: int, lengths: list[int], seed: int = 0) -> list[tuple[int, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    # row indices deliberately not 0..n-1: the backend must carry the caller's indices through
    return [(10 + 3 * i, torch.randint(0, vocab, (n,), generator=g).tolist()) for i, n in enumerate(lengths)]


def reference(model_dir: Path, rows: list[tuple[int, list[int]]], layer_ids: list[int]) -> dict[int, torch.Tensor]:
    from conftest import reference_states
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {i: reference_states(model, torch.tensor([t]), layer_ids)[0] for i, t in rows}


def run_backend(cfg, model_dir: Path, layer_ids: list[int], rows, extra=None) -> dict[str, Any]:
    """Start the configured backend, capture `rows`, run `extra(backend)` while the engine is up, close it."""
    from eagle3lib.extract.backends import make_backend

    backend = make_backend(cfg, model_dir, layer_ids)
    try:
        out: dict[str, Any] = {"states": materialize(backend.capture(rows), dict(rows)),
                               "start_s": backend.engine_start_s}
        if extra is not None:
            out["extra"] = extra(backend)
    finally:
        backend.close()
    return out


def materialize(captured, token_ids: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Captured states as tensors: a shard file the backend handed on (vLLM's connector file, already in the storage
    dtype) is read, its token ids checked, and deleted, as the shard writer would have adopted it."""
    from safetensors.torch import load_file

    out = {}
    for row, states in captured:
        if isinstance(states, Path):
            data = load_file(states)
            assert data["token_ids"].tolist() == token_ids[row], f"row {row}: the file holds other token ids"
            states.unlink()
            states = data["hidden_states"]
        out[row] = states
    return out


def probe_outcome(cfg, backend, model_dir: Path, layer_ids: list[int], hidden: int, rows, root: Path) -> dict[str, Any]:
    """The capture probe (eagle3lib.extract.probe) on a started backend, as stage 02 runs it before its first shard:
    {"report", "error": None} when it passes, {"report": the failed report, "error": its one message} when not."""
    from eagle3lib.extract import probe

    root.mkdir(parents=True, exist_ok=True)
    try:
        report = probe.run(cfg, backend, model_dir, layer_ids, hidden, [t for _, t in rows], root,
                           probe.compute_dtype(cfg, backend), progress=False)
        assert (root / probe.REPORT_FILE).is_file() and not (root / probe.FAILED_FILE).exists()
        return {"report": report, "error": None}
    except WorkbookError as e:  # the probe's own verdict (its report written), or the backend's own error
        assert not (root / probe.REPORT_FILE).exists()
        failed = root / probe.FAILED_FILE
        return {"report": json.loads(failed.read_text()) if failed.is_file() else None, "error": str(e)}


class Planted:
    """A fault planted on a real backend's output: `fault(states)` rewrites every row's [T, n_slots, H] states (a
    file the backend handed on is read first, as the shard writer would). Everything else (the engine, its
    logprobs, its second capture path) is the backend's own."""

    def __init__(self, inner, fault):
        self.inner, self.fault = inner, fault

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def capture(self, rows):
        for row, states in materialize(self.inner.capture(rows), dict(rows)).items():
            yield row, self.fault(states.clone())


def swap_slots(i: int, j: int):
    def fault(states: torch.Tensor) -> torch.Tensor:
        states[:, [i, j]] = states[:, [j, i]]
        return states
    return fault


def post_norm_final(model_dir: Path):
    """The final slot replaced by what comes out of the target's final norm (weights from the checkpoint)."""
    from eagle3lib.common.checkpoint_head import read_checkpoint_head
    from eagle3lib.common.head import final_norm

    _, norm_w, _, eps = read_checkpoint_head(model_dir)

    def fault(states: torch.Tensor) -> torch.Tensor:
        states[:, -1] = final_norm(states[:, -1], norm_w, eps).to(states.dtype)
        return states
    return fault


class residual_left_out:  # noqa: N801 - used as a context manager, named for what it plants
    """The capture worker's hooks take a layer's `out[0]` (and its input's hidden) without the residual: the bug the
    adapters exist to avoid (docs/capture.md#the-capture-worker). Planted in the adapter the hooks call (in-process
    engine: the hooks run in this process)."""

    def __enter__(self):
        from eagle3lib.extract.backends import adapters

        self.saved = adapters.Family.__dict__["layer_input"], adapters.Family.__dict__["layer_output"]
        layer_input = self.saved[0].__func__
        adapters.Family.layer_input = staticmethod(lambda args, kwargs: (layer_input(args, kwargs)[0], None))
        adapters.Family.layer_output = staticmethod(lambda out: out[0] if isinstance(out, tuple) else out)
        return self

    def __exit__(self, *exc):
        from eagle3lib.extract.backends import adapters

        adapters.Family.layer_input, adapters.Family.layer_output = self.saved


def probe_checks(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [c for c in report["checks"] if c["check"] == name]


def assert_probe_passed(outcome: dict[str, Any], second_paths: int) -> dict[str, Any]:
    """A correct capture passes with the final state reproducing the engine's distribution and every slot matching
    its layer in each second path that ran (fp32: top-1 1.0, errors of rounding only)."""
    assert outcome["error"] is None, outcome["error"]
    report = outcome["report"]
    ran = [p for p in report["second_paths"] if p["ran"]]
    assert len(ran) == second_paths, report["second_paths"]
    final = probe_checks(report, "final state")[0]["measured"]
    assert final["top1_agreement"] == 1.0 and final["mean_logprob_error"] < 1e-3, final
    layers = probe_checks(report, "layer")
    assert layers and all(c["ok"] and c["measured"]["min_cos"] > 0.9999 for c in layers)
    print(f"probe: {report['seconds']} s, final {final}, min cos {min(c['measured']['min_cos'] for c in layers)}")
    return report


def assert_probe_failed(outcome: dict[str, Any], *needles: str) -> str:
    msg = outcome["error"]
    assert msg is not None, "the planted fault passed the probe"
    assert msg.startswith("the capture probe failed before the first shard: ") and "likely causes: " in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"
    return msg


def assert_parity(states: dict[int, torch.Tensor], ref: dict[int, torch.Tensor], rows, layer_ids, what: str):
    assert sorted(states) == sorted(i for i, _ in rows), f"{what}: rows returned {sorted(states)}"
    worst = 1.0
    for i, toks in rows:
        got = states[i]
        assert list(got.shape) == [len(toks), len(layer_ids), ref[i].shape[-1]], f"{what} row {i}: {got.shape}"
        cos = torch.nn.functional.cosine_similarity(got.float(), ref[i].float(), dim=-1)  # [T, n_slots]
        for j, k in enumerate(layer_ids):
            low = cos[:, j].min().item()
            worst = min(worst, low)
            assert low >= COS_MIN, f"{what} row {i} layer id {k}: min cos {low:.6f} < {COS_MIN}"
    print(f"{what}: min cosine over {len(rows)} rows x {len(layer_ids)} slots = {worst:.6f}")


def fix_deepseek_config(model_dir: Path, **fields: Any) -> None:
    """Fields transformers 5 does not save but vLLM reads (docs/cpu.md#router-config-fields): without them vLLM skips the router bias (V3)."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg, indent=2))


MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None)  # 512+64=576


def build_tiny_deepseek_v3(out: Path, seed: int = 0) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                           n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=1, max_position_embeddings=512, tie_word_embeddings=False, **MLA)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves the router bias at 0: make routing depend on it
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        # sharp attention: at the default init the scores are so flat that a wrong rotary op hardly shows (vLLM's
        # unpatched CPU rotary gave min cos 0.996 here); with q and the rope key 10x the rope part dominates (0.6)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(10)
    model.save_pretrained(out, safe_serialization=True)
    fix_deepseek_config(out, topk_method="noaux_tc", scoring_func="sigmoid")
    return out


def build_tiny_deepseek_v2(out: Path, seed: int = 0) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                           max_position_embeddings=512, tie_word_embeddings=False, topk_method="greedy",
                           norm_topk_prob=False, n_group=1, topk_group=1, **MLA)
    model = DeepseekV2ForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    # vLLM always routes V2 through grouped top-k (asserts topk_group is set); one group = plain top-k
    fix_deepseek_config(out, topk_method="greedy", norm_topk_prob=False, n_group=1, topk_group=1)
    return out
