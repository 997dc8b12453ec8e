"""What stage 05 hands to its manifest: the curves figure, and the outputs and metrics later stages read.

Why one function: notebook 05, `run(stage)` and the torchrun entry all end the stage through `summarize`, so a
change to the stage's outputs is made here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.rundir import RunDir, StageResult
from eagle3lib.train.curves import plot_curves

METRIC_KEYS = ("val_eal", "val_tau_walk", "val_eal_untrained", "val_loss", "val_full_acc", "train_eal", "global_step",
               "epochs_done", "tokens_per_s", "train_seconds")


@dataclass
class TrainResult(StageResult):
    """Stage 05's result: the manifest's outputs and metrics, plus what notebook 05 shows (not in the manifest)."""

    trained: dict[str, Any] = field(default_factory=dict)  # draft/result.json: checkpoint, headline numbers, settings
    curves: dict[str, Any] = field(default_factory=dict)  # draft/curves.json


def summarize(rd: RunDir, trained: dict[str, Any]) -> TrainResult:
    """Draw figures/05_curves.png from the run's curves and collect stage 05's manifest entries from `trained`
    (the result dict `train` returns and writes to draft/result.json)."""
    curves = json.loads(Path(trained["curves"]).read_text())
    figure = rd.figure_path("05", "curves")
    plot_curves(curves, figure)
    outputs = {"checkpoint": Path(trained["checkpoint"]), "curves": Path(trained["curves"]), "figure": figure}
    metrics = {k: trained.get(k) for k in METRIC_KEYS}
    metrics["resolved"] = trained["resolved"]
    return TrainResult(outputs=outputs, metrics=metrics, trained=trained, curves=curves)
