"""Stage 04, part 1: the verifier folder, written from the target's embedding, lm_head and final norm.

The three tensors come from eagle3lib.common.checkpoint_head (read from the checkpoint without loading it, whatever
prefix a wrapper puts on the names). The folder written here (`verifier/`, layout in eagle3lib/verifier/__init__.py) is
speculators' `--verifier-name-or-path` and stage 06's source of the final norm and lm_head (`read_head`); the checks
compare it with what speculators and transformers load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3lib.common import atomic
from eagle3lib.common.checkpoint_head import (
    EMBED_KEY,
    LM_HEAD_KEY,
    NORM_KEY,
    ResolvedKeys,
    VerifierTensors,
    read_verifier_tensors,
    resolve_keys,
    rms_eps,
    tie_flag,
)
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.target import checkpoint_weight_map

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")

# Loading the target with transformers to cross-check is only done automatically below this size.
TRANSFORMERS_CHECK_AUTO_MAX_BYTES = 4 * 1024**3


def read_head(verifier_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(final norm weight, lm_head weight, rms eps) as fp32, from the folder stage 04 wrote (`verifier/`).

    Why from there: stage 04 already resolved which tensors are the final norm and the lm_head (prefixed, wrapped,
    tied checkpoints: `resolve_keys`) and wrote them under fixed names; a second search of the checkpoint could pick
    another tensor. Stage 06's offline acceptance applies these to the stored pre-norm final states.
    """
    verifier_dir = Path(verifier_dir)
    path = verifier_dir / WEIGHTS_FILE
    if not path.is_file():
        raise WorkbookError(f"{path} is missing", "rerun stage 04 (it writes verifier/)")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        norm = f.get_tensor(NORM_KEY)
        head = f.get_tensor(LM_HEAD_KEY if LM_HEAD_KEY in keys else EMBED_KEY)  # absent = tied to the embedding
    return norm.float(), head.float(), rms_eps(json.loads((verifier_dir / "config.json").read_text()))



# --------------------------------------------------------------------------------------------------------------
# Writing the verifier folder
# --------------------------------------------------------------------------------------------------------------


def verifier_config_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the verifier folder: the target's own, minus its quantization (the tensors written here
    are not quantized). A wrapper that needs remote code (auto_map, e.g. Kimi-K2.5) is replaced by its text config
    when transformers knows that one, because speculators reads this config without trust_remote_code."""
    out = json.loads(json.dumps(cfg))
    text = out.get("text_config")
    if "auto_map" in out and isinstance(text, dict) and text.get("model_type"):
        from transformers import CONFIG_MAPPING

        if text["model_type"] in CONFIG_MAPPING and "auto_map" not in text:
            out = text
    out.pop("quantization_config", None)
    if isinstance(out.get("text_config"), dict):
        out["text_config"].pop("quantization_config", None)
    with_head_dim(out.get("text_config") if isinstance(out.get("text_config"), dict) else out)
    return out


def with_head_dim(cfg: dict[str, Any]) -> None:
    """Write out the attention head size where the target's config leaves it implicit (Qwen2: hidden_size /
    num_attention_heads). Why: speculators builds a P-EAGLE or DFlash draft layer as a Qwen3Config with the verifier's
    `head_dim`, and the transformers of the GPU image (5.17) refuses None there ("Field 'head_dim' expected int",
    docs/drafts.md#drafters). The value is the one transformers itself derives for the model type."""
    if cfg.get("head_dim") is not None or not cfg.get("model_type") or not cfg.get("num_attention_heads"):
        return
    from transformers import AutoConfig

    try:
        derived = getattr(AutoConfig.for_model(**cfg), "head_dim", None)
    except (ValueError, TypeError, KeyError):
        derived = None
    cfg["head_dim"] = int(derived or cfg["hidden_size"] // cfg["num_attention_heads"])


def _fingerprint(model_dir: Path, keys: ResolvedKeys) -> dict[str, Any]:
    files = {}
    for fname in sorted(set(keys.files.values())):
        st = (model_dir / fname).stat()
        files[fname] = [st.st_size, st.st_mtime_ns]
    return {"model_dir": str(model_dir.resolve()), "keys": [keys.embed, keys.norm, keys.lm_head], "files": files}


def write_verifier_dir(vt: VerifierTensors, model_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Write the verifier folder atomically (see the module docstring for its layout); return its verifier.json."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    info = {
        "source": _fingerprint(model_dir, vt.keys),
        "files_opened": vt.files_opened,
        "tied": vt.tied,
        "tensors": vt.table(),
        "written_keys": sorted(vt.as_state_dict()),
        "note": "Only the verifier's embedding, lm_head and final norm: a stand-in for speculators' "
                "--verifier-name-or-path, not a loadable model.",
    }
    with atomic.atomic_dir(out_dir) as tmp:
        save_file(vt.as_state_dict(), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        atomic.write_json(tmp / "config.json", verifier_config_dict(cfg))
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        atomic.write_json(tmp / "verifier.json", info)
    return info


def extract_verifier(model_dir: str | Path, out_dir: str | Path) -> tuple[VerifierTensors, dict[str, Any]]:
    """Read the three tensors and write the verifier folder; a rerun on an unchanged checkpoint reuses the folder
    (only the checkpoint's index/headers are read to tell)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    keys = resolve_keys(checkpoint_weight_map(model_dir), tie_flag(cfg), where=str(model_dir))
    meta = out_dir / "verifier.json"
    if meta.is_file() and (out_dir / WEIGHTS_FILE).is_file():
        info = json.loads(meta.read_text())
        if info.get("source") == _fingerprint(model_dir, keys):
            sd = load_file(str(out_dir / WEIGHTS_FILE))
            tied = LM_HEAD_KEY not in sd
            vt = VerifierTensors(sd[EMBED_KEY], sd[NORM_KEY], sd[EMBED_KEY] if tied else sd[LM_HEAD_KEY], tied, keys,
                                 [])
            return vt, {**info, "resumed": True}
    vt = read_verifier_tensors(model_dir)
    return vt, {**write_verifier_dir(vt, model_dir, out_dir), "resumed": False}


# --------------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------------


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check_against_speculators(verifier_dir: Path, vt: VerifierTensors) -> dict[str, float]:
    """What speculators itself reads from the verifier folder (its load_model_layers, same fallback for a tied
    lm_head) must equal the tensors read from the checkpoint: max |difference| per tensor (0.0 = identical)."""
    from loguru import logger
    from speculators.utils.loading import load_model_layers

    logger.disable("speculators.utils.loading")  # its info/warning lines ("index not found") are noise here
    try:
        got = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(verifier_dir))
    finally:
        logger.enable("speculators.utils.loading")
    lm_head = got.get("lm_head.weight", got["embed_tokens.weight"])
    return {"embed_tokens": _max_abs_diff(got["embed_tokens.weight"], vt.embed),
            "lm_head": _max_abs_diff(lm_head, vt.lm_head), "norm": _max_abs_diff(got["model.norm.weight"], vt.norm)}


def check_against_transformers(model_dir: Path, vt: VerifierTensors, trust_remote_code: bool = False) -> dict[str, float]:
    """Load the target with transformers (in the checkpoint's dtype) and compare: max |difference| per tensor.
    Loads the whole model, so only for targets that fit in memory (see VerifierSection.check_with_transformers)."""
    from eagle3lib.common.causal_lm import load_causal_lm

    model = load_causal_lm(model_dir, trust_remote_code, dtype="auto")
    try:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        norm = getattr(decoder, "norm", None)
        return {"embed_tokens": _max_abs_diff(model.get_input_embeddings().weight.detach(), vt.embed),
                "lm_head": _max_abs_diff(model.get_output_embeddings().weight.detach(), vt.lm_head),
                "norm": _max_abs_diff(norm.weight.detach(), vt.norm) if norm is not None else float("nan")}
    finally:
        del model
