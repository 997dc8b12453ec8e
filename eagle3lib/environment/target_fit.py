"""Will the target load where the config runs it (stage 00, before any model loads)? Two checks:

- transformers: the settings that load the target in transformers (`transformers_target_uses`) against what it can
  load (common.causal_lm.causal_lm_refusal: a causal LM, or a multimodal wrapper's text model such as Kimi-K2.5's):
  a model_type transformers has no class for cannot load, nor a 1T target onto one GPU.
- vLLM: the checkpoint's weights per GPU at extract's tensor x pipeline parallel sizes against each engine's share
  (extract.gpu_memory_utilization), so a target that cannot fit stops here, not after an 18-minute load.

docs/running.md#big-targets-and-several-gpus says what to set instead.
"""

from __future__ import annotations

from pathlib import Path

from eagle3lib.common.causal_lm import causal_lm_refusal
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.target import weights_bytes
from eagle3lib.environment.checks import Check

# the settings that load the target with transformers onto ONE device (the others spread it with device_map)
ONE_DEVICE_USES = ("data.generator", "evaluate.methods")
# each of them in vLLM (or from disk) instead
VLLM_INSTEAD = {"data.generator": "data.generator: vllm", "extract.backend": "extract.backend: vllm",
                "train.hidden_states": "train.hidden_states: offline",
                "verifier.check_with_transformers": "verifier.check_with_transformers: never",
                "evaluate.methods": "evaluate.methods: [vllm] or [serve]"}


def transformers_target_uses(cfg: WorkbookConfig) -> list[str]:
    """The settings under which a stage loads the target in transformers (common.causal_lm.load_causal_lm; the
    others run it in vLLM, or read states from disk)."""
    generates = cfg.data.self_distill or any(s.kind == "self_instruct" for s in cfg.data.sources)
    uses = [("data.generator: transformers", generates and cfg.data.generator == "transformers"),
            ("extract.backend: transformers", cfg.extract.backend == "transformers"),
            ("train.hidden_states: online", cfg.train.hidden_states == "online"),  # spool: extract.backend's
            ("verifier.check_with_transformers: always", cfg.verifier.check_with_transformers == "always")]
    uses += [(f"evaluate.methods: {m}", True) for m in cfg.evaluate.methods if m in ("offline", "embedded")]
    return [name for name, used in uses if used]


def transformers_target_check(cfg: WorkbookConfig, model_dir: Path, gpu_bytes: int | None) -> Check:
    """Fails before any model loads when a setting needs the target in transformers and transformers cannot load
    it (common.causal_lm.causal_lm_refusal; onto one GPU of `gpu_bytes` for ONE_DEVICE_USES), naming each such setting
    and the vLLM one to use instead."""
    uses = transformers_target_uses(cfg)
    one_device = [u for u in uses if u.startswith(ONE_DEVICE_USES)]
    refusal, blocked = causal_lm_refusal(model_dir, cfg.target.trust_remote_code), uses
    if refusal is None and one_device:
        refusal, blocked = causal_lm_refusal(model_dir, cfg.target.trust_remote_code, gpu_bytes), one_device
    if refusal is None or not uses:
        return Check("transformers target", "pass", f"transformers loads it ({', '.join(uses)})" if uses
                     else "not needed: every stage runs the target in vLLM or reads its states from disk")
    fixes = dict.fromkeys(VLLM_INSTEAD[use.split(":")[0]] for use in blocked)
    return Check("transformers target", "fail", f"{refusal}, but {', '.join(blocked)} load it there — fix: "
                 f"{', '.join(fixes)} (configs/kimi-k2.5-shaped-1gpu.yaml runs every stage so)")


# below this share of an engine's memory left after the weights, KV cache and activations are tight
KV_ROOM = 0.2


def vllm_memory_check(cfg: WorkbookConfig, model_dir: Path, gpu_bytes: int | None, facts: dict[str, object]) -> Check:
    """The target's weights per GPU in vLLM (the checkpoint's bytes, in its own quantization, split over tensor x
    pipeline parallel ranks) against an engine's share of the smallest GPU; facts["memory"] keeps the figures."""
    e = cfg.extract
    ranks = e.tensor_parallel_size * e.pipeline_parallel_size
    total = weights_bytes(model_dir)
    per_gpu = total / ranks
    share = gpu_bytes * e.gpu_memory_utilization if gpu_bytes else None
    facts["memory"] = {"weights_bytes": total, "ranks": ranks, "weights_per_gpu_bytes": round(per_gpu),
                       "engine_share_bytes": round(share) if share else None}
    detail = (f"{total / 1e9:.1f} GB of weights, {per_gpu / 1e9:.1f} GB per GPU at tensor x pipeline parallel "
              f"{e.tensor_parallel_size} x {e.pipeline_parallel_size}")
    if share is None:
        return Check("target memory per GPU", "pass", detail + " (no GPU visible: not compared)")
    detail += f", of an engine's {share / 1e9:.1f} GB (extract.gpu_memory_utilization {e.gpu_memory_utilization})"
    if per_gpu > share:
        return Check("target memory per GPU", "fail", detail + " — fix: more GPUs (extract.tensor_parallel_size, "
                     "pipeline_parallel_size), GPUs with more memory, or a quantized checkpoint")
    if per_gpu > (1 - KV_ROOM) * share:
        return Check("target memory per GPU", "warn", detail + f": under {KV_ROOM:.0%} of it left for the KV cache "
                     "and activations")
    return Check("target memory per GPU", "pass", detail)
