"""What stage 05 hands to its manifest: the curves figure, and the outputs and metrics later stages read.

Why one function: notebook 05, `run(stage)` and the torchrun entry all end the stage through `summarize`, so a
change to the stage's outputs is made here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.common.rundir import RunDir, StageResult
from eagle3lib.train.curves import plot_curves

METRIC_KEYS = ("val_eal", "val_tau_walk", "val_eal_untrained", "val_loss", "val_full_acc", "train_eal", "global_step",
               "epochs_done", "tokens_per_s", "train_seconds", "train_tokens", "draft_params", "positions")


@dataclass
class TrainResult(StageResult):
    """Stage 05's result: the manifest's outputs and metrics, plus what notebook 05 shows (not in the manifest)."""

    trained: dict[str, dict[str, Any]] = field(default_factory=dict)  # {algorithm: draft/<algorithm>/result.json}
    curves: dict[str, dict[str, Any]] = field(default_factory=dict)  # {algorithm: draft/<algorithm>/curves.json}


def summarize(rd: RunDir, trained: dict[str, dict[str, Any]]) -> TrainResult:
    """Draw figures/05_curves_<algorithm>.png from each drafter's curves and collect stage 05's manifest entries
    from `trained` (what `train` returns and writes to draft/result.json: {algorithm: result}). The manifest's
    outputs name each drafter's checkpoint, curves and figure (`checkpoint_<algorithm>`, ...); its metrics hold
    each drafter's headline numbers under its name, and `algorithms` lists them in training order."""
    outputs: dict[str, Any] = {}
    metrics: dict[str, Any] = {"algorithms": list(trained)}
    curves = {}
    for algorithm, result in trained.items():
        curves[algorithm] = json.loads(Path(result["curves"]).read_text())
        figure = rd.figure_path("05", f"curves_{algorithm}")
        plot_curves(curves[algorithm], figure)
        outputs |= {f"checkpoint_{algorithm}": Path(result["checkpoint"]), f"curves_{algorithm}": Path(result["curves"]),
                    f"figure_{algorithm}": figure}
        metrics[algorithm] = {k: result.get(k) for k in METRIC_KEYS}
        metrics["resolved"] = result["resolved"]
    return TrainResult(outputs=outputs, metrics=metrics, trained=trained, curves=curves)


def read_results(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """A run folder's stage 05 results by drafter, {algorithm: result} (draft/result.json; a run from before
    train.algorithms wrote one EAGLE-3 result there, read as {"eagle3": it}); {} where stage 05 has not run."""
    try:
        data = json.loads((Path(run_dir) / "draft" / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {"eagle3": data} if "checkpoint" in data else data
