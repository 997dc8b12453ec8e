"""Stage 04 (notebooks/04_verifier_weights.ipynb): the verifier's embedding, lm_head and final norm, and the draft vocabulary (t2d / d2t).

Why a stage of its own: the EAGLE-3 draft reuses three tensors of the target (the token embedding, the lm_head it
distils, and the final norm it applies to the verifier's last hidden state) and predicts over a pruned vocabulary.
Reading those three must not load the target: for Kimi-K2.5 the checkpoint is hundreds of GB of INT4 experts, while
the three tensors are a few GB of bf16. So we read the safetensors index, open only the shard(s) holding them and
`get_tensor` just those keys (memory = those tensors), whatever prefix a wrapper puts on the names. That reader is
eagle3lib.common.checkpoint_head, below the stages, because stage 02's capture probe needs the same tensors earlier.

What it writes (run directory):
    verifier/                 (weights.py) a minimal verifier folder, usable as speculators' `--verifier-name-or-path`
        model.safetensors     model.embed_tokens.weight [V, H], model.norm.weight [H], lm_head.weight [V, H]
                              (lm_head absent when tied: speculators then uses the embedding, like transformers)
        config.json           the target's (text) config, quantization_config removed (these tensors are not quantized)
        tokenizer files       copied when the target has them (speculators resolves the mask token from them)
        verifier.json         provenance: source folder and keys, shards opened, shapes, dtypes, tied
    draft_vocab/              (draft_vocab.py)
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
  --verifier-name-or-path also works and loads the same tensors (checked in tests/unit/test_verifier.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3lib.common import atomic
from eagle3lib.common.causal_lm import causal_lm_refusal
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import StageResult, StageRun
from eagle3lib.common.target import checkpoint_bytes
from eagle3lib.verifier.draft_vocab import (
    DraftVocab,
    load_token_freq,
    make_draft_vocab,
    plot_coverage,
    val_token_counts,
    write_draft_vocab,
)
from eagle3lib.verifier.weights import (
    TRANSFORMERS_CHECK_AUTO_MAX_BYTES,
    check_against_speculators,
    check_against_transformers,
    extract_verifier,
    read_head,
)

if TYPE_CHECKING:
    from eagle3lib.common.rundir import RunDir

__all__ = ["VerifierResult", "point_checkpoint_at_target", "read_head", "run", "speculators_train_args"]




@dataclass
class VerifierResult(StageResult):
    """Stage 04's result: the manifest's outputs and metrics, plus what notebook 04 shows."""

    tensors: list[dict[str, Any]] = field(default_factory=list)  # one row per tensor: source key, shape, dtype, bytes
    info: dict[str, Any] = field(default_factory=dict)  # verifier/verifier.json: provenance, shards opened, resumed
    checks: dict[str, dict[str, float]] = field(default_factory=dict)  # loaded back by: max |difference| per tensor
    draft_vocab: DraftVocab | None = None


def run(stage: StageRun, check_speculators: bool = True) -> VerifierResult:
    """Everything notebook 04 does, callable without papermill (the notebook calls this and shows the result)."""
    rd, cfg = stage.rd, stage.cfg
    m02 = rd.read_manifest("02")
    model_dir = Path(m02["outputs"]["model_dir"])
    vt, info = extract_verifier(model_dir, rd.path("verifier"))
    vocab_size = vt.embed.shape[0]
    checks: dict[str, dict[str, float]] = {}
    if check_speculators:
        checks["speculators load_model_layers(verifier/)"] = check_against_speculators(rd.path("verifier"), vt)
    mode = cfg.verifier.check_with_transformers
    trust = cfg.target.trust_remote_code
    if mode == "always" or (mode == "auto" and checkpoint_bytes(model_dir) <= TRANSFORMERS_CHECK_AUTO_MAX_BYTES
                            and causal_lm_refusal(model_dir, trust) is None):
        checks["transformers from_pretrained(target)"] = check_against_transformers(model_dir, vt, trust)
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
    return VerifierResult(
        outputs={"verifier_dir": rd.path("verifier"), "t2d": paths["t2d"], "d2t": paths["d2t"],
                 "coverage": paths["coverage"], "figure": rd.figure_path("04", "coverage")},
        metrics={"draft_vocab_size": dv.k, "coverage": round(cov, 6),
                    "coverage_val": None if cov_val is None else round(cov_val, 6), "tied": vt.tied,
                    "target_vocab_size": vocab_size, "distinct_train_tokens": dv.distinct_train_tokens,
                    "dtype": str(vt.embed.dtype).split(".")[-1], "bytes": written,
                 "files_opened": len(info["files_opened"]), "resumed": info["resumed"]},
        tensors=vt.table(), info=info, checks=checks, draft_vocab=dv,
    )


def speculators_train_args(rd: RunDir) -> list[str]:
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
