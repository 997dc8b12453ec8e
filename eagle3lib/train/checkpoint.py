"""Where stage 05's checkpoints live, and what makes them resumable, movable and reloadable.

Checkpoints are speculators' own, one folder per drafter (`draft/<algorithm>/checkpoints/<epoch>/`), resumed from the
last one on rerun (`prepare_checkpoint_dir` drops half-written ones and refuses another recipe). The final one's config.json names the
TARGET folder as verifier (absolute, outside the run dir) so it still loads after the run directory moves, and
`workbook.json` beside it records the verifier folder relative to the checkpoint (`finalize_checkpoint`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from eagle3lib.common import atomic, drafters
from eagle3lib.common.config import TrainSection
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import RunDir
from eagle3lib.train.inputs import TrainInputs
from eagle3lib.train.speculators_glue import is_rank0
from eagle3lib.train.vllm_loadable import pin_aux_layer_count


def draft_dir(rd: RunDir, algorithm: str | None = None) -> Path:
    """Stage 05's folder (draft/result.json: every drafter's result), or one drafter's (its checkpoints, curves,
    result)."""
    return rd.path("draft") if algorithm is None else rd.path("draft", algorithm)


def checkpoints_dir(rd: RunDir, algorithm: str) -> Path:
    return rd.path("draft", algorithm, "checkpoints")


# Settings that may change between a run and its resumption (how long, how often, how the data is fed); any other
# change would silently continue training a different recipe from the old checkpoint.
RESUMABLE_CHANGES = frozenset({"epochs", "max_steps", "val_every", "save_every", "num_workers", "prefetch_factor",
                               "nproc_per_node", "device_prefetch", "loss_implementation", "draft_attn_impl", "dtype",
                               "spool_bytes"})


def prepare_checkpoint_dir(save_path: Path, tcfg: TrainSection, draft_vocab_size: int,
                           algorithm: str = "eagle3") -> list[str]:
    """Before the Trainer looks for a checkpoint to resume: drop epoch folders a killed run left half-written
    (speculators writes `training_state.json` last), and refuse to resume checkpoints trained with another recipe
    (the train settings that shape this drafter: adding a drafter to train.algorithms, or changing another one's own
    settings, keeps its checkpoints). Returns the folders removed."""
    import shutil

    removed = []
    if save_path.is_dir():
        for d in save_path.iterdir():
            if d.is_dir() and not d.is_symlink() and d.name.isdigit() and not (d / "training_state.json").is_file():
                removed.append(d.name)
                if is_rank0():
                    shutil.rmtree(d)
    skip = RESUMABLE_CHANGES | {"algorithms", "drafter_settings"} | drafters.foreign_fields(algorithm)
    recipe = {k: v for k, v in tcfg.model_dump(mode="json").items() if k not in skip}
    recipe.update(draft_vocab_size=draft_vocab_size, algorithm=algorithm)
    recipe_path = save_path / "workbook_recipe.json"
    has_ckpt = save_path.is_dir() and any(d.name.isdigit() for d in save_path.iterdir() if d.is_dir())
    if has_ckpt and recipe_path.is_file():
        old = json.loads(recipe_path.read_text())
        changed = sorted(k for k in set(old) | set(recipe) if old.get(k) != recipe.get(k))
        if changed:
            raise WorkbookError(
                f"{save_path} holds checkpoints trained with other settings ({', '.join(changed)} changed)",
                f"delete {save_path} to start over, or use another run name (-p run.name=...)")
    if is_rank0():
        atomic.write_json(recipe_path, recipe)
    return removed


def finalize_checkpoint(ckpt: Path, inp: TrainInputs) -> None:
    """Make the checkpoint independent of where the run directory lives.

    config.json's verifier.name_or_path becomes the TARGET folder (what vLLM's eagle3 method treats as the verifier,
    and a full checkpoint speculators can load embed/lm_head/norm from) instead of the run-local stage-04 folder that
    training read. workbook.json records the stage-04 folder relative to the checkpoint for `reload_checkpoint`'s
    fallback.
    """
    from eagle3lib.verifier import point_checkpoint_at_target

    point_checkpoint_at_target(ckpt, inp.model_dir)
    pin_aux_layer_count(ckpt)  # EAGLE-3 and P-EAGLE (vLLM's EAGLE-3 classes); a DFlash config has no such field
    atomic.write_json(ckpt / "workbook.json", {
        "verifier_dir_relative": os.path.relpath(Path(inp.verifier_dir).resolve(), ckpt.resolve()),
        "target_dir": str(Path(inp.model_dir).resolve()),
        "aux_layer_ids": inp.aux_layer_ids, "draft_vocab_size": inp.draft_vocab_size,
    })


def checkpoint_params(ckpt: Path) -> int:
    """Parameters a checkpoint holds (its layers, fc, norms, head, and the embedding copy EAGLE-3 and P-EAGLE keep),
    without the draft-vocabulary maps: what the draft adds to a server beside the target."""
    from safetensors import safe_open

    with safe_open(str(Path(ckpt) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))  # noqa: SIM118


def resolve_verifier(ckpt: Path, verifier: str | Path | None = None) -> str:
    """The verifier folder to load a checkpoint with: an explicit one, else config.json's if it exists, else the
    stage-04 folder recorded relative to the checkpoint (the run directory moved and the target with it)."""
    if verifier is not None:
        return str(verifier)
    ckpt = Path(ckpt)
    name = json.loads((ckpt / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    if name and Path(name).is_dir():
        return name
    meta = ckpt / "workbook.json"
    if meta.is_file():
        rel = (ckpt / json.loads(meta.read_text())["verifier_dir_relative"]).resolve()
        if rel.is_dir():
            return str(rel)
    raise WorkbookError(f"the verifier {name!r} named by {ckpt}/config.json does not exist here",
                        "pass verifier=<target folder> to reload_checkpoint")


def reload_checkpoint(ckpt: str | Path, verifier: str | Path | None = None, attn_impl: str = "sdpa"):
    """Reload a saved draft with speculators (weights, vocab maps, verifier norm/lm_head): the drafter's own
    speculators model class (`Eagle3DraftModel`, `PEagleDraftModel`, `DFlashDraftModel`), the trainable model.
    (Stage 06's decoder has its own `eagle3lib.evaluate.decoder.load_draft`, the EAGLE-3 draft as the workbook's
    decoder runs it.)"""
    ckpt = Path(ckpt)
    model_class = drafters.model_class(drafters.algorithm_of(ckpt))
    config = model_class.config_class.from_pretrained(str(ckpt))
    config.speculators_config.verifier.name_or_path = resolve_verifier(ckpt, verifier)
    config.transformer_layer_config._attn_implementation = attn_impl  # noqa: SLF001 - not serialized by HF
    return model_class.from_pretrained(str(ckpt), config=config)
