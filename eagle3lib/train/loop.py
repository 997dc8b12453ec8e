"""Stage 05's training loop: speculators' Trainer, driven epoch by epoch by the workbook, once per drafter of
train.algorithms.

Why not speculators' `run_training`: driving `Trainer.train_epoch` / `val_epoch` / `maybe_save_checkpoint` here lets
the stage validate the UNTRAINED draft first (the baseline every later epoch must beat), draw one tqdm bar with
tokens/s, and record per step and per epoch: the loss, the acceptance per draft position and the expected acceptance
length (train and validation: eagle3lib.train.curves).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common import atomic, shards
from eagle3lib.common.config import TrainSection, WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import RunDir
from eagle3lib.train.checkpoint import (
    checkpoint_params,
    checkpoints_dir,
    draft_dir,
    finalize_checkpoint,
    prepare_checkpoint_dir,
)
from eagle3lib.train.curves import add_epoch, curve_point, start_curves
from eagle3lib.train.inputs import TrainInputs, check_shards, inputs_from_run
from eagle3lib.train.loader import make_loaders
from eagle3lib.train.settings import Resolved, resolve_settings
from eagle3lib.train.speculators_glue import (
    build_draft,
    draft_positions,
    ensure_cpu_patch,
    fused_adamw,
    is_rank0,
    quiet_bars_and_capture,
)

log = logging.getLogger("eagle3lib.train")


def train(rd: RunDir, *, device: str | None = None, progress: bool = True,
          resolved: Resolved | None = None) -> dict[str, dict[str, Any]]:
    """Train (or resume training) every drafter of train.algorithms for this run, one after another on the same
    hidden states; returns {algorithm: its result dict} (each also in draft/<algorithm>/result.json, all of them in
    draft/result.json).

    Works in one process and under `torchrun` (speculators' DDP: `maybe_setup_distributed` reads LOCAL_RANK);
    only rank 0 writes the curves and the results (the figures: eagle3lib.train.result.summarize). With
    `train.hidden_states: online` the target computes each batch's states (eagle3lib.train.online); with `spool` a
    producer process does, into a bounded folder (eagle3lib.train.spool), stopped however this call ends (inside
    `interrupt_on_sigterm`, SIGTERM included).
    """
    cfg: WorkbookConfig = rd.cfg
    res = resolved or resolve_settings(cfg.train, device)
    patched = _setup_process(res, cfg.run.seed)
    inp = inputs_from_run(rd)
    t0 = time.perf_counter()
    check_shards(inp, shards.spec_from_metrics(rd.read_manifest("02")["metrics"]))
    checked = time.perf_counter() - t0
    results = {}
    for algorithm in cfg.train.algorithms:
        results[algorithm] = train_one(rd, algorithm, inp, res, patched, progress, {"check_shards": checked})
    if is_rank0():
        atomic.write_json(draft_dir(rd) / "result.json", results)
    return results


def train_one(rd: RunDir, algorithm: str, inp: TrainInputs, res: Resolved, patched: bool, progress: bool,
              phases: dict[str, float]) -> dict[str, Any]:
    """One drafter, with the hidden states from where train.hidden_states says (the target in this process, a spool
    producer, or stage 02's shards)."""
    cfg: WorkbookConfig = rd.cfg
    tcfg = cfg.train
    transfer = spool = None
    guard: Any = contextlib.nullcontext()
    if tcfg.hidden_states == "online":  # the target must fit before anything is written (eagle3lib.train.online)
        from eagle3lib.train.online import make_transfer

        transfer = make_transfer(cfg, inp, res)
    elif tcfg.hidden_states == "spool":
        from eagle3lib.common.processes import interrupt_on_sigterm
        from eagle3lib.extract.capture import shard_spec
        from eagle3lib.train.spool import make_spool

        spool = make_spool(rd.path("spool"), tcfg.spool_bytes, inp.dataset_dir,
                           shard_spec(cfg, inp.layer_ids, inp.hidden_size))
        guard = interrupt_on_sigterm()
    try:
        with guard:
            return _train(rd, algorithm, res, patched, inp, transfer, spool, progress, dict(phases))
    finally:
        if transfer is not None:
            transfer.close()
        if spool is not None:
            spool.close()


def _train(rd: RunDir, algorithm: str, res: Resolved, patched: bool, inp: TrainInputs, transfer: Any, spool: Any,
           progress: bool, phases: dict[str, float]) -> dict[str, Any]:
    """`train_one`'s body. `phases`: seconds per part, into result.json's phase_seconds (on the 1.5B recipe the
    stage took 328 s around a 198 s loop on one H200, 94 s of it validating the untrained draft: where the rest goes
    is measured, not guessed). The loaders come first: in spool mode their batches decide whether the budget holds,
    before anything is written or started, and the producer then starts its engine while the draft is built."""
    from speculators.train.trainer import Trainer

    cfg: WorkbookConfig = rd.cfg
    tcfg = cfg.train.for_drafter(algorithm)  # its own train.drafter_settings over the shared ones
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark
        mark = now

    train_loader, val_loader = make_loaders(inp, tcfg, res, cfg.run.seed, transfer, spool, algorithm)
    lap("loaders")
    own = draft_dir(rd, algorithm)
    if spool is not None:  # the budget is checked against every batch, then the producer starts
        spool.start(cfg, inp, {"train": train_loader.batch_sampler, "validation": val_loader.batch_sampler},
                    tcfg.epochs, own / "spool_producer.log")
        lap("spool_start")
    save_path = _prepare_save_path(checkpoints_dir(rd, algorithm), tcfg, inp.draft_vocab_size, algorithm)

    model, tconf, spec_cfg = build_draft(inp, tcfg, res, save_path, cfg.run.seed, algorithm)
    positions = draft_positions(spec_cfg, algorithm)
    if is_rank0():
        spec_cfg.save(str(save_path))  # speculators' run.yaml + train_command.txt beside the checkpoints
    lap("build_draft")

    curves_path = own / "curves.json"
    with quiet_bars_and_capture() as capture:
        with fused_adamw(res.device):
            trainer = Trainer(model, tconf, train_loader, val_loader)
        lap("trainer_init")
        start_epoch = trainer.current_epoch
        resumed = start_epoch > 0 or trainer.global_step > 0
        curves = start_curves(curves_path, algorithm, positions, res, resumed=resumed, start_epoch=start_epoch,
                              global_step=trainer.global_step)
        if not resumed:
            curves["val"].append(_validate_untrained(trainer, algorithm, positions))
        lap("untrained_validation")
        recorder = _StepRecorder(trainer, train_loader, capture, curves, tcfg,
                                 show=progress and is_rank0(), desc=f"train {algorithm}")
        last_saved = _train_epochs(trainer, tcfg, recorder, curves, curves_path, start_epoch,
                                   trainer.checkpointer.previous_epoch if resumed else None)
        recorder.close()
        elapsed = recorder.elapsed()
        lap("epochs")  # the steps (`train_seconds`), then validation and checkpoints after each epoch

    if last_saved is None:
        last_saved = trainer.checkpointer.previous_epoch
    final = save_path / str(last_saved)
    result: dict[str, Any] = {}
    if is_rank0():
        finalize_checkpoint(final, inp)
        atomic.write_json(curves_path, curves)
        # a resumed drafter counts the tokens and seconds of the calls that trained it before (its last result)
        before = _json_or_empty(own / "result.json") if resumed else {}
        tokens = recorder.tokens + (before.get("train_tokens") or 0)
        seconds = elapsed + (before.get("train_seconds") or 0.0)
        result = _result(final, curves_path, curves, res, patched, last_saved, trainer.global_step, tokens, seconds)
        # what speculators built from train.optimizer (muon: Muon on the 2-D weights, AdamW on the rest), and what
        # the draft saw (a data-volume curve's x: train.train_fraction of stage 02's rows)
        result.update(algorithm=algorithm, positions=positions, hidden_states=tcfg.hidden_states,
                      draft_params=checkpoint_params(final),
                      trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                      optimizers=[type(opt).__name__ for opt in trainer.optimizers],
                      train_rows=len(train_loader.dataset), train_tokens=tokens,
                      drafter_settings=cfg.train.drafter_settings.get(algorithm, {}))
        lap("finalize")
        result.update(phase_seconds={k: round(v, 2) for k, v in phases.items()},
                      **_state_source_figures(transfer, spool, tcfg))
        atomic.write_json(own / "result.json", result)
    return result


def _state_source_figures(transfer: Any, spool: Any, tcfg: TrainSection) -> dict[str, Any]:
    """Where the hidden states came from, in figures: online, the target's share of the time (train and validation
    batches, this process); spool, the budget, the peak the producer saw, its time and tokens, the trainer's wait."""
    out: dict[str, Any] = {}
    if transfer is not None:
        out["online_target"] = {"seconds": round(transfer.seconds, 2), "tokens": transfer.tokens,
                                "tokens_per_s": round(transfer.tokens / transfer.seconds, 1)
                                if transfer.seconds > 0 else None,
                                "forwards": transfer.forwards, "padded_tokens": transfer.padded_tokens,
                                "batches_ahead": tcfg.online_batches_ahead}
    if spool is not None:
        out["spool"] = spool.summary()
    return out


def _json_or_empty(path: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _setup_process(res: Resolved, seed: int) -> bool:
    """This process, before anything touches speculators' Trainer: warnings, the CPU patch, the seed and (under
    torchrun) the process group. Returns whether the CPU patch was applied."""
    from speculators.train import distributed
    from speculators.train.cli import set_seed

    if res.device == "cpu" and res.hidden_states_dtype == "float32":  # the Trainer's autocast is a no-op then
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    patched = ensure_cpu_patch(res.device)
    set_seed(seed)
    distributed.maybe_setup_distributed()  # looked up after the CPU patch, which sets it up on gloo
    return patched


def _barrier() -> None:
    from speculators.train.distributed import is_distributed

    if is_distributed():
        torch.distributed.barrier()


def _prepare_save_path(save_path: Path, tcfg: TrainSection, draft_vocab_size: int, algorithm: str) -> Path:
    """The checkpoints folder, cleaned of what an interrupted run left, before any rank looks for one to resume."""
    save_path.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(save_path)
    for name in prepare_checkpoint_dir(save_path, tcfg, draft_vocab_size, algorithm):
        log.warning("removed the half-written checkpoint %s/%s of an interrupted run", save_path, name)
    _barrier()  # rank 0 cleaned up before any rank looks for a checkpoint
    return save_path


def _validate(trainer: Any, epoch: int) -> dict[str, float] | None:
    """speculators' validation pass, and τ by walking its replies as a decoder would (`walk.WalkRecorder`: the
    served τ the validation rows predict, below validation EAL), as `tau_walk_epoch` beside its metrics."""
    from eagle3lib.train.walk import WalkRecorder

    start = time.perf_counter()
    with WalkRecorder(trainer.model) as walk:
        val = trainer.val_epoch(epoch)
    # its seconds: the untrained draft's pass beside the later ones' tells its warm-up from its work (docs/stages.md)
    seconds = {"val_seconds_epoch": time.perf_counter() - start}
    return None if val is None else {**val, **{f"{k}_epoch": v for k, v in walk.metrics().items()}, **seconds}


def _validate_untrained(trainer: Any, algorithm: str, positions: int) -> dict[str, Any]:
    """The untrained draft's validation: the baseline every later epoch must beat. (Sampler epoch 0: the packing
    sampler's empty cache is keyed -1, and validation batches do not depend on the epoch anyway.)"""
    untrained = _validate(trainer, 0)
    if not untrained:
        raise WorkbookError("validating the untrained draft produced no batches",
                            "check that stage 02's validation rows have hidden-state shards")
    return {"epoch": -1, "step": 0, **curve_point(untrained, algorithm, positions, "_epoch")}


class _StepRecorder:
    """Called after every optimizer step: records the step's loss, acceptance and tokens/s in the curves (rank 0)
    and moves the tqdm bar. Its clock counts training time only (`restart` before each epoch)."""

    def __init__(self, trainer: Any, loader: Any, capture: Any, curves: dict[str, Any], tcfg: TrainSection,
                 show: bool, desc: str = "train draft") -> None:
        from tqdm.auto import tqdm

        self.trainer, self.loader, self.capture, self.curves = trainer, loader, capture, curves
        self.algorithm, self.positions = curves["algorithm"], curves["positions"]
        steps_per_epoch = len(loader)
        total = steps_per_epoch * tcfg.epochs if tcfg.max_steps is None else min(tcfg.max_steps,
                                                                                  steps_per_epoch * tcfg.epochs)
        self.bar = tqdm(total=total, initial=min(trainer.global_step, total), desc=desc, unit="step",
                        disable=not show, dynamic_ncols=True)
        self.t0 = self.t = time.perf_counter()
        self.tokens = 0

    def restart(self) -> None:
        self.t = time.perf_counter()  # validation and saving are not training time

    def on_step(self) -> None:
        now = time.perf_counter()
        n_tok = self.loader.last_tokens
        dt = now - self.t
        self.t = now
        self.tokens += n_tok
        records = self.capture.records
        rec = records[-1] if records and "train" in records[-1] else None
        if rec is not None and is_rank0():
            summ = curve_point(rec["train"], self.algorithm, self.positions)
            self.curves["steps"].append({"step": self.trainer.global_step, "epoch": rec["epoch"], "lr": rec["lr"],
                                         "tokens": n_tok, "tokens_per_s": n_tok / dt if dt > 0 else None, **summ})
            self.bar.set_postfix(loss=f"{summ['loss']:.3f}", eal=f"{summ['eal']:.2f}",
                                 tok_s=f"{self.tokens / max(now - self.t0, 1e-9):,.0f}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _train_epochs(trainer: Any, tcfg: TrainSection, recorder: _StepRecorder, curves: dict[str, Any],
                  curves_path: Path, start_epoch: int, last_saved: int | None) -> int | None:
    """Epochs `start_epoch`.. until train.epochs or train.max_steps: train, checkpoint every save_every epochs,
    validate every val_every epochs (both at the end), write the curves (rank 0). Returns the last epoch saved."""
    for epoch in range(start_epoch, tcfg.epochs):
        if tcfg.max_steps is not None and trainer.global_step >= tcfg.max_steps:
            break
        first_step = len(curves["steps"])
        recorder.restart()
        trainer.train_epoch(epoch, step_callback=recorder.on_step)
        stopping = (epoch == tcfg.epochs - 1) or (tcfg.max_steps is not None
                                                  and trainer.global_step >= tcfg.max_steps)
        _barrier()
        if (epoch + 1) % tcfg.save_every == 0 or stopping:
            trainer.maybe_save_checkpoint(epoch)
            last_saved = epoch
        _barrier()
        val = None
        if (epoch + 1) % tcfg.val_every == 0 or stopping:
            val = _validate(trainer, epoch)
        _barrier()
        if last_saved == epoch:
            trainer.maybe_update_best(epoch, val)
        if is_rank0():
            add_epoch(curves, epoch, trainer.global_step, first_step, val)
            atomic.write_json(curves_path, curves)
        if stopping:
            break
    return last_saved


def _result(final: Path, curves_path: Path, curves: dict[str, Any], res: Resolved, patched: bool, last_saved: int,
            global_step: int, trained_tokens: int, elapsed: float) -> dict[str, Any]:
    """draft/result.json: the checkpoint, the headline numbers (validation EAL before and after training) and the
    settings the run used."""
    val_first = curves["val"][0] if curves["val"] else {}
    val_last = curves["val"][-1] if curves["val"] else {}
    return {
        "checkpoint": str(final), "curves": str(curves_path), "resolved": asdict(res), "cpu_patch": patched,
        "epochs_done": last_saved + 1, "global_step": global_step,
        "val_eal_untrained": val_first.get("eal") if val_first.get("epoch") == -1 else None,
        "val_eal": val_last.get("eal"), "val_loss": val_last.get("loss"),
        "val_full_acc": [val_last.get(f"full_acc_{s}") for s in range(curves["positions"])],
        "val_tau_walk": val_last.get("tau_walk"),
        "val_seconds": [round(v["val_seconds"], 2) for v in curves["val"] if "val_seconds" in v],
        "train_eal": curves["train_epochs"][-1]["eal"] if curves["train_epochs"] else None,
        "tokens_per_s": trained_tokens / elapsed if elapsed > 0 and trained_tokens else None,
        "train_seconds": round(elapsed, 2),
    }
