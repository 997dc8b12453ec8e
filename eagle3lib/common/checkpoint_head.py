"""The target's embedding, final norm and lm_head, read from a checkpoint's safetensors without loading the model.

Why below the stages: stage 02's capture probe (eagle3lib.extract.probe) needs the head before stage 04 runs, and
stage 04 writes the verifier folder from the same reader (eagle3lib.verifier.weights); one home for the rule that
finds the three tensors, whatever prefix a wrapper puts on the names (`resolve_keys`).

Why not load the target: for Kimi-K2.5 the checkpoint is hundreds of GB of INT4 experts, while the three tensors are a
few GB of bf16. So we read the safetensors index, open only the shard(s) holding them and `get_tensor` just those
keys (memory = those tensors).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.target import INDEX_FILE, checkpoint_weight_map

EMBED_KEY = "model.embed_tokens.weight"
NORM_KEY = "model.norm.weight"
LM_HEAD_KEY = "lm_head.weight"
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}

# Last name of a module that holds each role, in the naming schemes we know (HF Llama/Qwen/DeepSeek/Mistral,
# Meta's consolidated format, GPT-2/NeoX, Mamba backbones).
EMBED_NAMES = ("embed_tokens", "tok_embeddings", "wte", "word_embeddings", "embed_in", "embeddings", "embed")
NORM_NAMES = ("norm", "norm_f", "ln_f", "final_layernorm", "final_norm")
LM_HEAD_NAMES = ("lm_head", "output", "embed_out", "unembed")
# Module path segments that are not the language model's own top level: decoder layers (DeepSeek's MTP layer has
# its own embed_tokens and head), vision/audio towers and projectors of multimodal wrappers.
EXCLUDED_SEGMENTS = {"layers", "h", "blocks", "mtp", "vision_tower", "vision_model", "visual", "vision", "audio_tower",
                     "audio", "multi_modal_projector", "mm_projector", "patch_embed", "image_newline"}
_PARAM_RE = re.compile(r"^(?P<base>.+?)\.(?P<param>weight\w*|qweight|qzeros|scales|g_idx|bias|SCB)(?:\..*)?$")


def _base_of(key: str) -> str | None:
    m = _PARAM_RE.match(key)
    return m.group("base") if m else None


def _excluded(base: str) -> bool:
    return any(seg in EXCLUDED_SEGMENTS or seg.isdigit() for seg in base.split(".")[:-1])


def _pick(bases: set[str], names: tuple[str, ...], prefer_prefix: str | None, role: str) -> str | None:
    """The module base for a role: same prefix as the embedding first, else the shortest candidate (the
    language model's top level), with an error when two equally short candidates compete."""
    cands = [b for b in bases if b.rsplit(".", 1)[-1] in names and not _excluded(b)]
    if not cands:
        return None
    if prefer_prefix is not None:
        for name in names:
            if prefer_prefix + name in cands:
                return prefer_prefix + name
    cands.sort(key=lambda b: (len(b), names.index(b.rsplit(".", 1)[-1]), b))
    if len(cands) > 1 and len(cands[0]) == len(cands[1]) and cands[0].rsplit(".", 1)[-1] == cands[1].rsplit(".", 1)[-1]:
        raise WorkbookError(f"the {role} is ambiguous: {cands[0]}.weight and {cands[1]}.weight",
                            "use a checkpoint with one language model (or rename its tensors)")
    return cands[0]


def _relevant_keys(keys: list[str], limit: int = 12) -> str:
    """A few keys worth showing in an error: top-level ones (embeddings, norms, heads) first, then any others."""
    top = [k for k in keys if not (_base_of(k) and _excluded(_base_of(k) or ""))]
    interesting = [k for k in top if any(w in k.lower() for w in ("embed", "norm", "head", "output", "wte", "ln_f"))]
    shown = (interesting or top or keys)[:limit]
    return f"{', '.join(shown)}{' …' if len(keys) > len(shown) else ''} ({len(keys)} keys)"


@dataclass(frozen=True)
class ResolvedKeys:
    """Which checkpoint keys hold the three tensors (lm_head None = tied to the embedding)."""

    embed: str
    norm: str
    lm_head: str | None
    files: dict[str, str]  # key -> safetensors file name


def resolve_keys(weight_map: dict[str, str], tie_word_embeddings: bool | None, where: str = "the checkpoint"
                 ) -> ResolvedKeys:
    """Find embed / norm / lm_head among the checkpoint's keys, whatever prefix wraps them. Clear errors for a
    missing tensor (naming the keys found) and for a quantized one (naming its quantization tensors)."""
    keys = sorted(weight_map)
    bases = {b for k in keys if (b := _base_of(k))}

    def tensor_key(base: str, role: str) -> str:
        key = f"{base}.weight"
        siblings = sorted(k for k in keys if k.startswith(base + ".") and k not in (key, f"{base}.bias"))
        if siblings:
            raise WorkbookError(
                f"the {role} in {where} is quantized ({', '.join(siblings[:4])}): the draft needs it in "
                "bf16/fp16/fp32",
                "use a checkpoint whose embeddings, lm_head and final norm are not quantized (compressed-tensors: "
                "ignore lm_head; most INT4/FP8 releases keep them bf16), or de-quantize these tensors first",
            )
        if key not in weight_map:
            raise WorkbookError(f"the {role} {key} is not in {where}; keys found: {_relevant_keys(keys)}",
                                "point target.model at the full checkpoint folder")
        return key

    embed_base = _pick(bases, EMBED_NAMES, None, "embedding")
    if embed_base is None:
        raise WorkbookError(
            f"no token embedding in {where} (looked for *.{{{','.join(EMBED_NAMES)}}}.weight); keys found: "
            f"{_relevant_keys(keys)}",
            "point target.model at the full checkpoint folder (its *.safetensors and model.safetensors.index.json)",
        )
    prefix = embed_base[: len(embed_base) - len(embed_base.rsplit(".", 1)[-1])]  # "model." / "language_model.model."
    norm_base = _pick(bases, NORM_NAMES, prefix, "final norm")
    if norm_base is None:
        raise WorkbookError(
            f"no final norm in {where} (looked for {prefix}norm.weight and *.{{{','.join(NORM_NAMES)}}}.weight); keys "
            f"found: {_relevant_keys(keys)}",
            "point target.model at the full checkpoint folder",
        )
    # lm_head sits beside the decoder: "model.embed_tokens" -> "lm_head", "language_model.model." -> "language_model."
    head_prefix = "" if prefix == "model." else prefix[: -len("model.")] if prefix.endswith(".model.") else prefix
    head_base = _pick(bases, LM_HEAD_NAMES, head_prefix, "lm_head")
    embed_key, norm_key = tensor_key(embed_base, "embedding"), tensor_key(norm_base, "final norm")
    head_key = tensor_key(head_base, "lm_head") if head_base is not None else None
    if head_key is None and tie_word_embeddings is False:
        raise WorkbookError(
            f"no lm_head in {where} although its config says tie_word_embeddings: false; keys found: "
            f"{_relevant_keys(keys)}",
            "point target.model at the full checkpoint folder (the lm_head shard is missing)",
        )
    used = [k for k in (embed_key, norm_key, head_key) if k is not None]
    return ResolvedKeys(embed_key, norm_key, head_key, {k: weight_map[k] for k in used})


def tie_flag(cfg: dict[str, Any]) -> bool | None:
    text = cfg.get("text_config") or {}
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    if "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return None


@dataclass
class VerifierTensors:
    """The three tensors, where they came from, and which files were opened to get them."""

    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied
    tied: bool
    keys: ResolvedKeys
    files_opened: list[str] = field(default_factory=list)

    def as_state_dict(self) -> dict[str, torch.Tensor]:
        """The layout speculators' load_model_layers reads (lm_head left out when tied, as HF checkpoints do)."""
        sd = {EMBED_KEY: self.embed.contiguous(), NORM_KEY: self.norm.contiguous()}
        if not self.tied:
            sd[LM_HEAD_KEY] = self.lm_head.contiguous()
        return sd

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for role, t, key in (("embed_tokens", self.embed, self.keys.embed), ("lm_head", self.lm_head,
                             self.keys.lm_head or f"(tied: {self.keys.embed})"), ("final norm", self.norm,
                             self.keys.norm)):
            rows.append({"tensor": role, "source key": key, "shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1],
                         "bytes": 0 if (role == "lm_head" and self.tied) else t.numel() * t.element_size()})
        return rows


def read_verifier_tensors(model_dir: str | Path) -> VerifierTensors:
    """Read embed_tokens, lm_head and the final norm from the checkpoint, opening only the shards that hold them."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
    keys = resolve_keys(checkpoint_weight_map(model_dir), tie_flag(cfg), where=str(model_dir))
    by_file: dict[str, list[str]] = {}
    for key, fname in keys.files.items():
        by_file.setdefault(fname, []).append(key)
    out: dict[str, torch.Tensor] = {}
    opened: list[str] = []
    for fname, wanted in sorted(by_file.items()):
        path = model_dir / fname
        if not path.is_file():
            raise WorkbookError(f"{path} (named by {INDEX_FILE} for {', '.join(wanted)}) is missing",
                                "complete the checkpoint download")
        opened.append(fname)
        with safe_open(str(path), framework="pt") as handle:
            for key in wanted:
                dtype = handle.get_slice(key).get_dtype()
                if dtype not in FLOAT_DTYPES:
                    raise WorkbookError(
                        f"{key} in {path.name} is stored as {dtype}, i.e. quantized: the draft needs bf16/fp16/fp32",
                        "use a checkpoint whose embeddings, lm_head and final norm are not quantized, or de-quantize "
                        "these tensors first",
                    )
                out[key] = handle.get_tensor(key)
    embed, norm = out[keys.embed], out[keys.norm]
    lm_head = out[keys.lm_head] if keys.lm_head else embed
    check_shapes(embed, norm, lm_head, cfg, str(model_dir))
    return VerifierTensors(embed, norm, lm_head, keys.lm_head is None, keys, opened)


def check_shapes(embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, cfg: dict[str, Any], where: str
                 ) -> None:
    """The shapes speculators will assume: embed and lm_head [vocab_size, hidden], norm [hidden] (from config.json)."""
    text = cfg.get("text_config") or cfg
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    problems = []
    if embed.dim() != 2 or lm_head.shape != embed.shape:
        problems.append(f"embed {list(embed.shape)} and lm_head {list(lm_head.shape)} differ")
    if norm.shape != (embed.shape[-1],):
        problems.append(f"norm {list(norm.shape)} is not [hidden={embed.shape[-1]}]")
    if vocab is not None and embed.shape[0] != vocab:
        problems.append(f"embed has {embed.shape[0]} rows but config vocab_size is {vocab}")
    if hidden is not None and embed.shape[-1] != hidden:
        problems.append(f"embed width {embed.shape[-1]} but config hidden_size is {hidden}")
    if problems:
        raise WorkbookError(f"verifier tensors in {where} do not fit its config: {'; '.join(problems)}",
                            "fix the checkpoint's config.json (vocab_size, hidden_size) or its tensors")


def rms_eps(cfg: dict[str, Any]) -> float:
    """The final RMSNorm's epsilon from a (wrapper's or text) config.json."""
    text = cfg.get("text_config") or cfg
    return float(text.get("rms_norm_eps", 1e-6))


def read_checkpoint_head(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(embedding, final norm weight, lm_head weight, rms eps) straight from the checkpoint, before stage 04 ran:
    what stage 02's capture probe needs (eagle3lib.extract.probe). The same resolution as the verifier folder
    (`read_verifier_tensors`); the matrices stay in their stored dtype (eagle3lib.common.head converts them by chunks)."""
    vt = read_verifier_tensors(model_dir)
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return vt.embed, vt.norm.float(), vt.lm_head, rms_eps(cfg)
