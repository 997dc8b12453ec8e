"""Stage 04: the verifier's embedding, lm_head and final norm, and the draft vocabulary (t2d / d2t).

Why a stage of its own: the EAGLE-3 draft reuses three tensors of the target (the token embedding, the lm_head it
distils, and the final norm it applies to the verifier's last hidden state) and predicts over a pruned vocabulary.
Reading those three must not load the target: for Kimi-K2.5 the checkpoint is hundreds of GB of INT4 experts, while
the three tensors are a few GB of bf16. So we read the safetensors index, open only the shard(s) holding them and
`get_tensor` just those keys (memory = those tensors), whatever prefix a wrapper puts on the names.

What it writes (run directory):
    verifier/                 a minimal verifier folder, usable as speculators' `--verifier-name-or-path`
        model.safetensors     model.embed_tokens.weight [V, H], model.norm.weight [H], lm_head.weight [V, H]
                              (lm_head absent when tied: speculators then uses the embedding, like transformers)
        config.json           the target's (text) config, quantization_config removed (these tensors are not quantized)
        tokenizer files       copied when the target has them (speculators resolves the mask token from them)
        verifier.json         provenance: source folder and keys, shards opened, shapes, dtypes, tied
    draft_vocab/
        d2t.npy               int64 [k]: offsets, target_id = draft_id + d2t[draft_id]      (speculators' format)
        t2d.npy               bool [V]: True where a target token is in the draft vocabulary (k of them)
        coverage.json         coverage of loss-masked tokens vs k (train, and held-out rows when there are any)
    figures/04_coverage.png

How speculators 0.9 uses these (read from speculators/train/cli.py, model.py, utils/loading.py):
- `speculators train --d2t-path D --t2d-path T` loads both with `np.load` (.npy); d2t's length is the draft vocab
  size and must equal `--draft-vocab-size` when that is given. The maps come from speculators' own
  `build_vocab_mappings_from_distribution` (top-k by frequency, ties by id, padded with low ids), so they are what
  `speculators train` would build itself from token_freq.pt.
- The draft loads the verifier tensors itself, in `Eagle3DraftModel.from_training_args(...).load_verifier_weights()`:
  `load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], verifier_name_or_path)`
  (exact key, else the shortest key with that suffix, opening only the shards that hold them), lm_head falls back to
  the embedding, and is sliced with t2d. It also reads `AutoConfig.from_pretrained(verifier_name_or_path)` (hidden
  size, layer count, vocab) and, without `--mask-token-id`, the tokenizer from the same folder.

What stage 05 should pass to speculators (`speculators_train_args(rd)` returns exactly this):
    --verifier-name-or-path <run>/verifier       (this folder: same tensors, no quantized weights, no remote code)
    --d2t-path <run>/draft_vocab/d2t.npy  --t2d-path <run>/draft_vocab/t2d.npy  --draft-vocab-size <k>
    --target-layer-ids <aux ids from stage 02>
  and afterwards `point_checkpoint_at_target(checkpoint_dir, model_dir)`: the saved draft's config.json records
  `speculators_config.verifier.name_or_path`, which `vllm serve DRAFT` uses as the target, so it must name the real
  target, not this stub folder. For a plain checkpoint (SmolLM2, Llama) passing the target folder itself as
  --verifier-name-or-path also works and loads the same tensors (checked in tests/test_verifier.py).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3lib import atomic, plots
from eagle3lib.errors import WorkbookError

EMBED_KEY = "model.embed_tokens.weight"
NORM_KEY = "model.norm.weight"
LM_HEAD_KEY = "lm_head.weight"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
_PARAM_RE = re.compile(r"^(?P<base>.+?)\.(?P<param>weight\w*|qweight|qzeros|scales|g_idx|bias|SCB)(?:\..*)?$")

# Loading the target with transformers to cross-check is only done automatically below this size.
TRANSFORMERS_CHECK_AUTO_MAX_BYTES = 4 * 1024**3


# --------------------------------------------------------------------------------------------------------------
# Reading the checkpoint
# --------------------------------------------------------------------------------------------------------------


def checkpoint_weight_map(model_dir: Path) -> dict[str, str]:
    """{tensor key: safetensors file name} without reading any tensor: from the index when the checkpoint is
    sharded, else from the header of the single file (or of each *.safetensors file when there is no index)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError) as e:
            raise WorkbookError(f"{index} is not a safetensors index ({e.__class__.__name__})",
                                "restore the checkpoint's model.safetensors.index.json") from None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in model_dir.iterdir())[:8] if model_dir.is_dir() else []
        raise WorkbookError(
            f"no safetensors weights in {model_dir} (found: {', '.join(found) or 'nothing'})",
            "point target.model at an HF checkpoint saved as safetensors (save_pretrained(..., safe_serialization=True))",
        )
    weight_map: dict[str, str] = {}
    for f in files:  # header only: safe_open maps the file, keys() reads no tensor data
        with safe_open(str(f), framework="pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), f.name))
    return weight_map


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


def _tie_flag(cfg: dict[str, Any]) -> bool | None:
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
    keys = resolve_keys(checkpoint_weight_map(model_dir), _tie_flag(cfg), where=str(model_dir))
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
    return out


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
    keys = resolve_keys(checkpoint_weight_map(model_dir), _tie_flag(cfg), where=str(model_dir))
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


def check_against_transformers(model_dir: Path, vt: VerifierTensors) -> dict[str, float]:
    """Load the target with transformers (in the checkpoint's dtype) and compare: max |difference| per tensor.
    Loads the whole model, so only for targets that fit in memory (see VerifierSection.check_with_transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    try:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        norm = getattr(decoder, "norm", None)
        return {"embed_tokens": _max_abs_diff(model.get_input_embeddings().weight.detach(), vt.embed),
                "lm_head": _max_abs_diff(model.get_output_embeddings().weight.detach(), vt.lm_head),
                "norm": _max_abs_diff(norm.weight.detach(), vt.norm) if norm is not None else float("nan")}
    finally:
        del model


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


# --------------------------------------------------------------------------------------------------------------
# Draft vocabulary
# --------------------------------------------------------------------------------------------------------------


def load_token_freq(path: str | Path, vocab_size: int) -> dict[int, int]:
    """token_freq.pt = {token_id: count} over loss-masked train tokens (loaded without unpickling code)."""
    try:
        freq = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise WorkbookError(f"{path} is missing", "rerun stage 02 (it writes token_freq.pt)") from None
    if not isinstance(freq, dict) or not freq:
        raise WorkbookError(f"{path} holds no token counts", "rerun stage 02 with more data (data.num_samples)")
    freq = {int(k): int(v) for k, v in freq.items()}
    bad = [k for k in freq if not 0 <= k < vocab_size]
    if bad:
        raise WorkbookError(f"{path} counts token ids {bad[:5]} outside the target vocabulary (size {vocab_size})",
                            "stage 02 ran with another tokenizer/target: rerun stage 02 for this target")
    return freq


def draft_order(freq: dict[int, int], vocab_size: int) -> np.ndarray:
    """All target ids in the order speculators' build_vocab_mappings_from_distribution picks them: seen tokens by
    count (ties by id), then unseen ids from 0 up. The draft vocabulary of size k is the first k (as a set)."""
    seen = sorted(freq, key=lambda t: (-freq[t], t))
    unseen = np.setdiff1d(np.arange(vocab_size), np.asarray(seen, dtype=np.int64), assume_unique=True)
    return np.concatenate([np.asarray(seen, dtype=np.int64), unseen])


def build_draft_vocab(freq: dict[int, int], draft_vocab_size: int, vocab_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [k] offsets, t2d bool [V]) from speculators' own function, k clipped to the vocabulary."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    k = min(draft_vocab_size, vocab_size)
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq_dict=freq, draft_vocab_size=k,
                                                      target_vocab_size=vocab_size)
    if d2t.shape != (k,) or t2d.shape != (vocab_size,) or int(t2d.sum()) != k:
        raise WorkbookError(f"speculators built d2t {list(d2t.shape)} / t2d with {int(t2d.sum())} tokens for k={k}",
                            "report this: speculators' build_vocab_mappings_from_distribution changed behaviour")
    return d2t, t2d


def coverage_curve(counts_by_rank: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """Share of tokens whose rank (position in draft_order) is below k, for each k."""
    total = counts_by_rank.sum()
    cum = np.concatenate([[0], np.cumsum(counts_by_rank)])
    return cum[np.minimum(ks, len(counts_by_rank))] / max(total, 1)


def coverage_ks(vocab_size: int, chosen: int, points: int = 48) -> np.ndarray:
    ks = np.unique(np.concatenate([np.geomspace(1, vocab_size, points).round().astype(np.int64), [chosen]]))
    return ks[(ks >= 1) & (ks <= vocab_size)]


def val_token_counts(dataset_dir: Path, train_rows: int, val_rows: int, vocab_size: int) -> np.ndarray | None:
    """Counts per target id of the loss-masked tokens of the held-out rows (rows after train_rows)."""
    if not val_rows:
        return None
    from datasets import load_from_disk

    ds = load_from_disk(str(dataset_dir)).select(range(train_rows, train_rows + val_rows))
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in ds.select_columns(["input_ids", "loss_mask"]).with_format("numpy"):
        ids = np.asarray(row["input_ids"])[np.asarray(row["loss_mask"]).astype(bool)]
        np.add.at(counts, ids, 1)
    return counts


@dataclass
class DraftVocab:
    d2t: torch.Tensor
    t2d: torch.Tensor
    k: int
    vocab_size: int
    distinct_train_tokens: int
    ks: np.ndarray
    coverage_train: np.ndarray
    coverage_val: np.ndarray | None

    def coverage_at_k(self) -> tuple[float, float | None]:
        i = int(np.searchsorted(self.ks, self.k))
        return float(self.coverage_train[i]), (float(self.coverage_val[i]) if self.coverage_val is not None else None)


def make_draft_vocab(freq: dict[int, int], draft_vocab_size: int, vocab_size: int,
                     val_counts: np.ndarray | None = None) -> DraftVocab:
    """The maps plus the coverage curves; checks that speculators' chosen set is the first k of draft_order."""
    d2t, t2d = build_draft_vocab(freq, draft_vocab_size, vocab_size)
    k = d2t.shape[0]
    order = draft_order(freq, vocab_size)
    mine = np.zeros(vocab_size, dtype=bool)
    mine[order[:k]] = True
    if not np.array_equal(mine, t2d.numpy()):
        raise WorkbookError("the draft vocabulary speculators built differs from the frequency ranking",
                            "report this: speculators' build_vocab_mappings_from_distribution changed behaviour")
    counts = np.zeros(vocab_size, dtype=np.int64)
    counts[list(freq)] = list(freq.values())
    ks = coverage_ks(vocab_size, k)
    cov_val = coverage_curve(val_counts[order], ks) if val_counts is not None and val_counts.sum() else None
    return DraftVocab(d2t, t2d, k, vocab_size, len(freq), ks, coverage_curve(counts[order], ks), cov_val)


def write_draft_vocab(dv: DraftVocab, out_dir: Path) -> dict[str, Path]:
    """d2t.npy / t2d.npy in the form `speculators train --d2t-path/--t2d-path` np.loads, plus coverage.json."""
    out_dir = Path(out_dir)
    paths = {"d2t": out_dir / "d2t.npy", "t2d": out_dir / "t2d.npy", "coverage": out_dir / "coverage.json"}
    for name, arr in (("d2t", dv.d2t.numpy().astype(np.int64)), ("t2d", dv.t2d.numpy().astype(bool))):
        with atomic.atomic_path(paths[name], suffix=".npy") as tmp:
            np.save(tmp, arr)
    cov, cov_val = dv.coverage_at_k()
    atomic.write_json(paths["coverage"], {
        "k": dv.k, "vocab_size": dv.vocab_size, "distinct_train_tokens": dv.distinct_train_tokens,
        "coverage_train_at_k": cov, "coverage_val_at_k": cov_val, "ks": dv.ks.tolist(),
        "coverage_train": dv.coverage_train.tolist(),
        "coverage_val": None if dv.coverage_val is None else dv.coverage_val.tolist()})
    return paths


def plot_coverage(dv: DraftVocab, path: Path, close: bool = True):
    """Coverage vs k (log k), the chosen k marked, saved as PNG. Closed by default (the notebook shows the PNG, so
    the figure does not also pop up in whichever cell created it); returns the figure."""
    import matplotlib.pyplot as plt

    cov, cov_val = dv.coverage_at_k()
    fig, ax = plots.figure(figsize=(7, 4))
    ax.plot(dv.ks, dv.coverage_train, label="train tokens (token_freq.pt)")
    if dv.coverage_val is not None:
        ax.plot(dv.ks, dv.coverage_val, label="held-out rows", linestyle="--")
    ax.axvline(dv.k, color="gray", linestyle=":")
    label = f"k = {dv.k}: {cov:.1%} train" + (f", {cov_val:.1%} held-out" if cov_val is not None else "")
    ax.scatter([dv.k], [cov], color="C3", zorder=3, label=label)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft vocabulary size k (most frequent tokens first)")
    ax.set_ylabel("share of loss-masked tokens covered")
    ax.set_title(f"Draft vocabulary coverage (target vocab {dv.vocab_size}, {dv.distinct_train_tokens} seen)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    plots.save(fig, path)
    if close:
        plt.close(fig)
    return fig


# --------------------------------------------------------------------------------------------------------------
# The stage, and what stage 05 takes from it
# --------------------------------------------------------------------------------------------------------------


def run(stage: Any, check_speculators: bool = True) -> dict[str, Any]:
    """Everything notebook 04 does, callable without papermill: returns outputs, metrics, tables and the figure."""
    rd, cfg = stage.rd, stage.cfg
    m02 = rd.read_manifest("02")
    model_dir = Path(m02["outputs"]["model_dir"])
    vt, info = extract_verifier(model_dir, rd.path("verifier"))
    vocab_size = vt.embed.shape[0]
    checks: dict[str, dict[str, float]] = {}
    if check_speculators:
        checks["speculators load_model_layers(verifier/)"] = check_against_speculators(rd.path("verifier"), vt)
    mode = cfg.verifier.check_with_transformers
    if mode == "always" or (mode == "auto" and checkpoint_bytes(model_dir) <= TRANSFORMERS_CHECK_AUTO_MAX_BYTES):
        checks["transformers from_pretrained(target)"] = check_against_transformers(model_dir, vt)
    bad = {name: d for name, d in checks.items() if any(v != 0.0 for v in d.values() if v == v)}
    if bad:
        raise WorkbookError(f"the extracted verifier tensors differ from what is loaded back: {bad}",
                            "report this with the checkpoint's key names (verifier/verifier.json)")

    freq = load_token_freq(rd.output("02", "token_freq"), vocab_size)
    metrics02 = m02["metrics"]
    val_counts = None
    if metrics02.get("val_rows") and metrics02.get("train_rows") is not None:
        val_counts = val_token_counts(rd.output("02", "dataset"), int(metrics02["train_rows"]),
                                      int(metrics02["val_rows"]), vocab_size)
    dv = make_draft_vocab(freq, cfg.verifier.draft_vocab_size, vocab_size, val_counts)
    paths = write_draft_vocab(dv, rd.path("draft_vocab"))
    plot_coverage(dv, rd.figure_path("04", "coverage"))
    cov, cov_val = dv.coverage_at_k()
    written = sum(r["bytes"] for r in info["tensors"])
    return {
        "outputs": {"verifier_dir": rd.path("verifier"), "t2d": paths["t2d"], "d2t": paths["d2t"],
                    "coverage": paths["coverage"], "figure": rd.figure_path("04", "coverage")},
        "metrics": {"draft_vocab_size": dv.k, "coverage": round(cov, 6),
                    "coverage_val": None if cov_val is None else round(cov_val, 6), "tied": vt.tied,
                    "target_vocab_size": vocab_size, "distinct_train_tokens": dv.distinct_train_tokens,
                    "dtype": str(vt.embed.dtype).split(".")[-1], "bytes": written,
                    "files_opened": len(info["files_opened"]), "resumed": info["resumed"]},
        "tensors": vt.table(), "info": info, "checks": checks, "draft_vocab": dv,
    }


def speculators_train_args(rd: Any) -> list[str]:
    """The speculators train flags stage 04's outputs supply (see the module docstring)."""
    m04 = rd.read_manifest("04")
    layer_ids = rd.read_manifest("02")["metrics"]["layer_ids"][:-1]  # aux ids; speculators adds the final layer
    return ["--verifier-name-or-path", str(rd.output("04", "verifier_dir")),
            "--d2t-path", str(rd.output("04", "d2t")), "--t2d-path", str(rd.output("04", "t2d")),
            "--draft-vocab-size", str(m04["metrics"]["draft_vocab_size"]),
            "--target-layer-ids", *[str(i) for i in layer_ids]]


def point_checkpoint_at_target(checkpoint_dir: str | Path, model_dir: str | Path) -> None:
    """Make a trained draft name the real target: speculators records --verifier-name-or-path (our stub folder) in
    config.json's speculators_config.verifier, and `vllm serve DRAFT` would load it as the target."""
    path = Path(checkpoint_dir) / "config.json"
    cfg = json.loads(path.read_text())
    target_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    verifier = cfg.setdefault("speculators_config", {}).setdefault("verifier", {})
    verifier["name_or_path"] = str(Path(model_dir).resolve())
    verifier["architectures"] = target_cfg.get("architectures") or []
    atomic.write_json(path, cfg)
