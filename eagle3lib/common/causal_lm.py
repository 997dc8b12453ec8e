"""The target in transformers: which checkpoints it loads as a causal LM (`causal_lm_refusal`), and loading them.

Why one home: stage 02 (the transformers backend, the generator, the capture probe's reference), stage 04 (its
check) and stage 06 (the embedded decoder, the offline replay, the tie check) load the target in transformers, and
stage 00 refuses beforehand what none of them could load, so the rule and the loader must agree.

A multimodal wrapper without a causal-LM class of its own (Kimi-K2.5's `kimi_k25`) is loaded as its language model
alone: the workbook feeds it text and reads text states. transformers builds Kimi-K2.5's text model as DeepseekV3
(transformers/models/kimi_k25/configuration_kimi_k25.py maps the text model_type `kimi_k2` to `deepseek_v3`), and
its tensors sit under one prefix (`language_model.`) that from_pretrained's `key_mapping` strips
(https://huggingface.co/docs/transformers/main_classes/model#transformers.PreTrainedModel.from_pretrained).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from eagle3lib.common.checkpoint_head import EMBED_KEY  # the text model's embedding, under a wrapper's prefix
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.target import checkpoint_weight_map, read_hf_config, weights_bytes

# of one device's memory a transformers target's weights may take (the rest: activations, the draft)
ONE_DEVICE_SHARE = 0.9
# a wrapper's text model_type -> the causal LM transformers builds for it (configuration_kimi_k25.py, see above)
TEXT_MODEL_TYPES = {"kimi_k2": "deepseek_v3"}


def _causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def text_tower(model_dir: Path) -> tuple[dict[str, Any], str] | None:
    """(the text model's config, its tensors' prefix) of an unquantized multimodal wrapper without a causal-LM class
    of its own whose text model has one; None for any other checkpoint."""
    cfg = read_hf_config(model_dir)
    text = cfg.get("text_config")
    if not isinstance(text, dict) or cfg.get("model_type") in _causal_lm_types():
        return None
    if "quantization_config" in cfg or "quantization_config" in text:
        return None  # e.g. Kimi-K2.5's INT4 experts: its quantization config names the wrapper's tensors, not these
    model_type = TEXT_MODEL_TYPES.get(text.get("model_type"), text.get("model_type"))
    if model_type not in _causal_lm_types():
        return None
    try:
        keys = checkpoint_weight_map(model_dir)
    except WorkbookError:  # no safetensors index or file to find the text model's tensors in
        return None
    prefixes = {k[: -len(EMBED_KEY)] for k in keys if k == EMBED_KEY or k.endswith("." + EMBED_KEY)}
    return ({**text, "model_type": model_type}, prefixes.pop()) if len(prefixes) == 1 else None


def _auto_mapped(cfg: dict[str, Any]) -> bool:
    """The checkpoint names its own causal-LM class (remote code, loaded only under target.trust_remote_code)."""
    return "AutoModelForCausalLM" in (cfg.get("auto_map") or {})


def causal_lm_refusal(model_dir: Path, trust_remote_code: bool, device_bytes: int | None = None) -> str | None:
    """Why `load_causal_lm` cannot load this target (onto one device of `device_bytes`, where given), None when it
    can: its model_type in transformers' causal-LM table, its config's `auto_map` naming a class under
    target.trust_remote_code, or a wrapper's text model (`text_tower`). A run that needs the transformers target
    would otherwise find out only when the stage that loads it starts."""
    cfg = read_hf_config(model_dir)
    model_type = cfg.get("model_type", "?")
    mapped = _auto_mapped(cfg)
    if not (model_type in _causal_lm_types() or (mapped and trust_remote_code) or text_tower(model_dir)):
        return (f"transformers' AutoModelForCausalLM has no class for model_type {model_type!r}"
                + (" without the checkpoint's own code (target.trust_remote_code is off: true runs that code)" if mapped
                   else " and the checkpoint's config names none (no auto_map entry)"))
    size = weights_bytes(model_dir)
    if device_bytes and size > ONE_DEVICE_SHARE * device_bytes:
        return f"its weights ({size / 1e9:.1f} GB) do not fit one device ({device_bytes / 1e9:.1f} GB)"
    return None


class _WithoutLoadReport(logging.Filter):
    """Drops transformers' weight-loading report (transformers/utils/loading_report.py) and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def load_causal_lm(model_dir: Path, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """The target as transformers' causal LM (`kwargs`: from_pretrained's, e.g. dtype, device_map): a wrapper as
    its text model alone (`text_tower`), with one clear error when a text tensor is not in the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = read_hf_config(model_dir)
    tower = None if trust_remote_code and _auto_mapped(cfg) else text_tower(model_dir)
    if tower is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, **kwargs)
    text, prefix = tower
    # transformers reports the wrapper's other tensors (the vision tower) as UNEXPECTED, a table of them on every
    # load; they are left out by design, and a missing text tensor is this function's own error below
    report = logging.getLogger("transformers.modeling_utils")
    quiet = _WithoutLoadReport()
    report.addFilter(quiet)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), config=AutoConfig.for_model(**text), key_mapping={f"^{re.escape(prefix)}": ""},
            output_loading_info=True, **kwargs)
    finally:
        report.removeFilter(quiet)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise WorkbookError(f"{model_dir}'s text model ({text['model_type']} under '{prefix}') lacks "
                            f"{len(missing)} tensors: {', '.join(missing[:4])}",
                            "point target.model at the full checkpoint folder")
    return model
