"""Where stage 05 meets speculators 0.9: its typed config and draft models, and the small patches around its Trainer.

What this module adds around speculators (and nothing else: no second implementation of any drafter):
  * `speculators_train_config` / `build_draft` / `trainer_config`: the drafter's `from_training_args` (eagle3,
    peagle or dflash: eagle3lib.common.drafters) through speculators' own `build_draft_model` (so every default — draft
    layers and architecture, norms, sliding window, rope, DFlash's block size and loss — is speculators' own for that
    drafter), and its TrainerConfig (optimizer, muon, schedule) mapped as `speculators train` maps it, with every
    knob from `cfg.train`;
  * `quiet_bars_and_capture`: speculators' per-step metric dicts routed to the stage, its rich bars silenced;
  * `fused_adamw`: torch's fused AdamW kernel on a GPU;
  * `ensure_cpu_patch`: the Trainer-on-CPU patch from the compat registry (docs/cpu.md#speculators-trainer-on-the-cpu).
Each patch is undone on exit (or revertible through eagle3lib.compat).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common import drafters
from eagle3lib.common.config import TrainSection
from eagle3lib.train.inputs import TrainInputs
from eagle3lib.train.settings import Resolved

SCHEDULERS = {"constant": "none", "linear": "linear", "cosine": "cosine"}
# cfg.train fields passed to speculators' TrainConfig under the same name (None: speculators' default for the drafter)
SAME_NAMES = ("num_layers", "ttt_steps", "ttt_step_loss_decay", "norm_before_fc", "fc_norm", "norm_output",
              "norm_before_residual", "embed_requires_grad", "lr", "weight_decay", "muon_lr",
              "muon_momentum", "muon_weight_decay", "muon_ns_steps", "muon_adjust_lr_fn", "epochs", "max_steps",
              "num_depths", "block_size", "max_anchors")


def mask_token_id(inp: TrainInputs, tcfg: TrainSection, algorithm: str) -> int:
    """The token a drafter's mask positions carry: train.mask_token_id, else speculators' own rule on the target's
    tokenizer (`resolve_mask_token_id`: its mask token, a new one in a spare embedding row, else pad/eos), as its
    train CLI resolves it. EAGLE-3 has no mask positions: 0, so no tokenizer is needed for it."""
    if algorithm == "eagle3":
        return 0
    if tcfg.mask_token_id is not None:
        return tcfg.mask_token_id
    from speculators.train.utils import resolve_mask_token_id
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(inp.model_dir)).get_text_config().vocab_size
    return int(resolve_mask_token_id(str(inp.tokenizer_dir or inp.model_dir), vocab, None))


def speculators_train_config(inp: TrainInputs, tcfg: TrainSection, res: Resolved, save_path: Path, seed: int,
                             algorithm: str = "eagle3"):
    """speculators' own typed TrainConfig for one drafter (its defaults fill every field we leave None)."""
    from speculators.train.config import TrainConfig

    flat: dict[str, Any] = {name: getattr(tcfg, name) for name in SAME_NAMES}
    flat.update({
        "speculator_type": algorithm, "seed": seed, "optimizer": res.optimizer,
        "verifier_name_or_path": str(inp.verifier_dir), "target_layer_ids": inp.aux_layer_ids,
        "draft_vocab_size": inp.draft_vocab_size, "draft_attn_impl": res.attn_impl,
        "mask_token_id": mask_token_id(inp, tcfg, algorithm),
        "data_path": str(inp.dataset_dir), "total_seq_len": tcfg.packing_length,
        "train_data_ratio": inp.train_ratio, "hidden_states_dtype": res.hidden_states_dtype,
        "num_workers": res.num_workers, "prefetch_factor": tcfg.prefetch_factor,
        "loss_implementation": res.loss_implementation, "loss_fn": tcfg.loss,
        "scheduler_type": SCHEDULERS[tcfg.scheduler], "scheduler_warmup_steps": tcfg.warmup_steps,
        "scheduler_warmup_ratio": tcfg.warmup_ratio, "save_path": str(save_path), "checkpoint_freq": 1,
    })
    return TrainConfig.from_flat(flat)


def trainer_config(args: argparse.Namespace, train_kwargs: dict[str, Any], val_kwargs: dict[str, Any]):
    """speculators' TrainerConfig from its flattened TrainConfig, field by field as `speculators train` builds it
    (speculators.train.cli.main): every optimizer and schedule option reaches the Trainer through one mapping.
    The workbook always resumes from the last checkpoint and logs every step (its curves)."""
    from speculators.train.trainer import TrainerConfig

    renamed = {"num_epochs": "epochs"}
    fields = {name: getattr(args, renamed.get(name, name)) for name in TrainerConfig._fields
              if hasattr(args, renamed.get(name, name))}
    fields.update(resume_from_checkpoint=True, train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs,
                  hidden_states_dtype=getattr(torch, args.hidden_states_dtype), log_freq=1)
    return TrainerConfig(**fields)


def build_draft(inp: TrainInputs, tcfg: TrainSection, res: Resolved, save_path: Path, seed: int = 0,
                algorithm: str = "eagle3"):
    """The drafter's `from_training_args` via speculators' `build_draft_model` (verifier config, layer config, vocab
    maps, verifier weights — all speculators' code). Returns (model, trainer config, its TrainConfig)."""
    from speculators.train.cli import build_draft_model

    if algorithm != "eagle3":
        check_head_dim(inp.verifier_dir, algorithm)
    spec_cfg = speculators_train_config(inp, tcfg, res, save_path, seed, algorithm)
    args = argparse.Namespace(**spec_cfg.flatten())
    model_class = drafters.model_class(algorithm)
    model = build_draft_model(args, model_class, inp.t2d, inp.d2t, inp.draft_vocab_size)
    train_kwargs, val_kwargs = model_class.get_trainer_kwargs(**vars(args))
    return model, trainer_config(args, train_kwargs, val_kwargs), spec_cfg


def check_head_dim(verifier_dir: Path, algorithm: str) -> None:
    """speculators builds a P-EAGLE or DFlash layer as a Qwen3Config with the verifier config's head_dim, which some
    transformers versions refuse as None: stage 04 writes it (`verifier.weights.with_head_dim`); a verifier folder
    from before that gets one clear line instead of transformers' error deep inside speculators."""
    import json

    cfg = json.loads((Path(verifier_dir) / "config.json").read_text())
    if (cfg.get("text_config") or cfg).get("head_dim") is None:
        from eagle3lib.common.errors import WorkbookError

        raise WorkbookError(f"stage 04's verifier config {verifier_dir}/config.json has no head_dim, which speculators "
                            f"builds a {drafters.title(algorithm)} draft layer with",
                            "rerun stage 04 (it writes head_dim), then stage 05")


def draft_positions(spec_cfg: Any, algorithm: str) -> int:
    """How many draft tokens per step the drafter trains (its curves' positions): TTT steps, depths, or the block's
    slots after the anchor, as speculators resolved them."""
    return drafters.DRAFTERS[algorithm].trained_positions(spec_cfg.flatten())


def is_rank0() -> bool:
    """Rank 0 of speculators' process group (or the only process): the one that writes curves, figures and results."""
    from speculators.train.distributed import get_rank

    return get_rank() == 0


class _MetricCapture(logging.Handler):
    """Receives what speculators' Trainer logs on 'speculators.metrics' (a dict per step / per validation)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.records.append(record.msg)


@contextmanager
def quiet_bars_and_capture() -> Iterator[_MetricCapture]:
    """Route speculators' per-step metric dicts to us, and replace its rich per-epoch bars with a passthrough (our
    tqdm bar shows the run instead)."""
    import speculators.train.trainer as trainer_mod

    capture = _MetricCapture()
    mlog = logging.getLogger("speculators.metrics")
    old = (mlog.level, mlog.propagate, trainer_mod.tqdm)
    mlog.setLevel(logging.INFO)
    mlog.propagate = False
    mlog.addHandler(capture)
    trainer_mod.tqdm = lambda it, *a, **k: it  # type: ignore[assignment]
    try:
        yield capture
    finally:
        mlog.removeHandler(capture)
        mlog.setLevel(old[0])
        mlog.propagate = old[1]
        trainer_mod.tqdm = old[2]


@contextmanager
def fused_adamw(device: str) -> Iterator[None]:
    """On a GPU, speculators' AdamW runs as torch's fused kernel (one launch for every parameter instead of a
    foreach loop; the 70.1k tok/s on the H200 in docs/gpu.md#h200-training-throughput were measured with it).
    speculators builds a plain AdamW inside `Trainer.__init__`; the flags are flipped on that fresh optimizer, before
    the Trainer loads a checkpoint's optimizer state, so resumed step counters land on the GPU as the fused kernel
    needs."""
    if device != "cuda":
        yield
        return
    import speculators.train.trainer as trainer_module

    original = trainer_module.build_optimizers

    def build(model: Any, config: Any) -> list[torch.optim.Optimizer]:
        optimizers = original(model, config)
        for opt in optimizers:
            if type(opt) is torch.optim.AdamW:
                opt.defaults.update(fused=True, foreach=False)
                for group in opt.param_groups:
                    group.update(fused=True, foreach=False)
                opt._step_supports_amp_scaling = True  # what AdamW(fused=True) sets
        return optimizers

    trainer_module.build_optimizers = build
    try:
        yield
    finally:
        trainer_module.build_optimizers = original


def ensure_cpu_patch(device: str) -> bool:
    """Apply the speculators-Trainer-on-CPU patch from the compat registry when this machine needs it."""
    if device != "cpu":
        return False
    from eagle3lib.compat import apply_patch
    from eagle3lib.compat.speculators_trainer_cpu import NAME

    return apply_patch(NAME)
