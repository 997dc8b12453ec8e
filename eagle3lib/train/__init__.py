"""Stage 05: train the EAGLE-3 draft with speculators 0.9's own model, losses, data pipeline and Trainer.

The workbook adds the inputs, the settings, the curves and the checks around speculators, not a second EAGLE-3
implementation. It validates the untrained draft first, trains for train.epochs (or train.max_steps), validating
after each epoch, and saves speculators checkpoints (resumed on rerun) that vLLM's eagle3 method loads.
The steps, each in its own module:
    settings.py          'auto' → sdpa/flex attention, eager/fused loss (behavioural probe), fp32/bf16, workers
    inputs.py            stages 02 and 04's outputs, and every hidden-state shard checked before training
    loader.py            speculators' data path in a DataLoader that counts tokens and prefetches to the GPU
    online.py            train.hidden_states: online, each batch's states from the target in this process
    spool.py             train.hidden_states: spool, each batch's states asked of a producer, within a disk budget
    spool_producer.py    the spool's producer process (stage 02's capture) and this process's handle on it
    speculators_glue.py  speculators' config and draft model, and the patches around its Trainer
    loop.py              the Trainer driven epoch by epoch: untrained validation, curves, checkpoints, resume
    checkpoint.py        where checkpoints live; resumable, movable, reloadable
    vllm_loadable.py     what vLLM's eagle3 loader reads from a checkpoint
    curves.py            per step / epoch / validation records, the figure and the table
    result.py            the manifest's outputs and metrics
    launch.py            in this process or under torchrun; the `python -m eagle3lib.train` entry

Run it (notebooks/05_train_draft.ipynb calls the steps one by one; `run(stage)` below is the same stage for a
script or a test):
  one process (CPU or one GPU):   eagle3 run --config configs/demo.yaml --run demo --stages 05
  several GPUs (DDP):             torchrun --nproc-per-node 4 -m eagle3lib.train --config CONFIG --run-name NAME
                                  (or set train.nproc_per_node=4: notebook 05 then launches exactly that command)
  without the notebook:           python -m eagle3lib.train --config CONFIG --run-name NAME
  tiny CPU check:                 pytest tests/unit/test_train.py
Writes (under the run directory): draft/checkpoints/<epoch>/ (speculators format, vLLM eagle3-loadable),
draft/curves.json, draft/result.json, figures/05_curves.png.
"""

from __future__ import annotations

from pathlib import Path

from eagle3lib.common.rundir import StageRun
from eagle3lib.train.checkpoint import prepare_checkpoint_dir, reload_checkpoint
from eagle3lib.train.curves import curves_table, expected_acceptance_length, plot_curves
from eagle3lib.train.inputs import TrainInputs, inputs_from_run
from eagle3lib.train.launch import launch_command, train_or_launch
from eagle3lib.train.loader import make_loaders
from eagle3lib.train.loop import train
from eagle3lib.train.result import TrainResult, summarize
from eagle3lib.train.settings import Resolved, probe_fused_loss, resolve_settings
from eagle3lib.train.speculators_glue import build_draft
from eagle3lib.train.vllm_loadable import check_vllm_config, pin_aux_layer_count, vllm_view

__all__ = ["Resolved", "TrainInputs", "TrainResult", "build_draft", "check_vllm_config", "curves_table",
           "expected_acceptance_length", "inputs_from_run", "launch_command", "make_loaders", "pin_aux_layer_count",
           "plot_curves", "prepare_checkpoint_dir", "probe_fused_loss", "reload_checkpoint", "resolve_settings", "run",
           "summarize", "train", "train_or_launch", "vllm_view"]


def run(stage: StageRun, *, resolved: Resolved | None = None, progress: bool = True, config: str | Path | None = None,
        run_name: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainResult:
    """The whole stage (what notebook 05 does, without the display and the vLLM check): train here, or under torchrun
    when train.nproc_per_node > 1 (`config`, `run_name`, `overrides`: see `train_or_launch`), then the curves
    figure; the caller ends it with stage.finish(result)."""
    trained = train_or_launch(stage, resolved, progress=progress, config=config, run_name=run_name,
                              overrides=overrides)
    return summarize(stage.rd, trained)
