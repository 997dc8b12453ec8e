"""Stage 05's curves: what is recorded per training step, per epoch and per validation, and how it is shown.

`draft/<algorithm>/curves.json` holds, for train steps, train epoch means and validation (the untrained draft first,
at epoch -1): the loss, per draft position s the acceptance speculators reports there (`full_acc_s`), and the
expected acceptance length (`eal`); EAGLE-3 points also hold each TTT step's loss and cond_acc_s, and validation
points τ by walking the replies as a decoder would (`tau_walk`, eagle3lib.train.walk: the served τ they predict,
below EAL). What full_acc_s and EAL mean per drafter (`acceptance_by_position`, `expected_acceptance_length`;
docs/drafts.md#speculators-model-and-metrics):
- eagle3: full_acc_s = draft steps 0..s all right (a chain), EAL = 1 + Σ_s full_acc_s;
- peagle: full_acc_s = depth s right (speculators' position_s_acc, each depth scored on its own), EAL =
  1 + Σ_s Π_{j<=s} full_acc_j, the chain those rates give if depths erred independently (an estimate: speculators
  reports no chain for P-EAGLE);
- dflash: full_acc_s = block slot s + 1 right (slot 0 is the anchor), EAL = speculators' own `eal` (the mean accepted
  run per block, plus one).
A resumed run keeps the history up to its checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3lib.train.settings import Resolved


def acceptance_by_position(metrics: dict[str, float], algorithm: str, positions: int,
                           suffix: str = "") -> list[float]:
    """Per draft position s (0-based) the acceptance speculators reports for this drafter (module docstring)."""
    if algorithm == "eagle3":
        keys = [f"full_acc_{s}" for s in range(positions)]
    else:  # speculators' position_<p>_acc: P-EAGLE's depth p = s, DFlash's block slot p = s + 1
        first = 1 if algorithm == "dflash" else 0
        keys = [f"position_{s + first}_acc" for s in range(positions)]
    return [float(metrics.get(key + suffix, float("nan"))) for key in keys]


def expected_acceptance_length(metrics: dict[str, float], algorithm: str, positions: int, suffix: str = "") -> float:
    """Mean tokens per verifier step the drafter's metrics imply at `positions` draft tokens (module docstring)."""
    if algorithm == "dflash" and f"eal{suffix}" in metrics:
        return float(metrics[f"eal{suffix}"])
    acc = [0.0 if math.isnan(a) else a for a in acceptance_by_position(metrics, algorithm, positions, suffix)]
    if algorithm == "eagle3":
        return 1.0 + sum(acc)
    return 1.0 + sum(math.prod(acc[: s + 1]) for s in range(len(acc)))


def curve_point(metrics: dict[str, float], algorithm: str, positions: int, suffix: str = "") -> dict[str, Any]:
    """The numbers a curve needs, in one flat shape for train steps, train epochs and validation."""
    out: dict[str, Any] = {"loss": float(metrics.get(f"loss{suffix}", float("nan")))}
    acc = acceptance_by_position(metrics, algorithm, positions, suffix)
    for s in range(positions):
        if algorithm == "eagle3":
            for key in ("loss", "cond_acc"):
                out[f"{key}_{s}"] = float(metrics.get(f"{key}_{s}{suffix}", float("nan")))
        out[f"full_acc_{s}"] = acc[s]
    out["eal"] = expected_acceptance_length(metrics, algorithm, positions, suffix)
    for key in ("tau_walk", "eal_uniform", "val_seconds"):  # validation only (eagle3lib.train.walk, loop._validate)
        if f"{key}{suffix}" in metrics:
            out[key] = float(metrics[f"{key}{suffix}"])
    return out


def _load_curves(path: Path) -> dict[str, Any] | None:
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
    return None


def start_curves(path: Path, algorithm: str, positions: int, res: Resolved, *, resumed: bool, start_epoch: int,
                 global_step: int) -> dict[str, Any]:
    """The curves a run starts from: empty, or when the Trainer resumed a checkpoint, the ones in `path` up to it
    (steps past its global step and epochs from `start_epoch` on, which a killed run recorded, are trained again)."""
    old = (_load_curves(path) if resumed else None) or {}
    return {
        "algorithm": algorithm, "positions": positions, "resolved": asdict(res),
        "steps": [s for s in old.get("steps", []) if s["step"] <= global_step],
        "train_epochs": [e for e in old.get("train_epochs", []) if e["epoch"] < start_epoch],
        "val": [v for v in old.get("val", []) if v["epoch"] < start_epoch],
    }


def add_epoch(curves: dict[str, Any], epoch: int, global_step: int, first_step: int,
              val: dict[str, float] | None) -> None:
    """After an epoch: the mean of its steps (from index `first_step` of curves["steps"]) and its validation."""
    ep_steps = curves["steps"][first_step:]
    if ep_steps:
        keys = [k for k in ep_steps[0] if k not in ("step", "epoch", "lr", "tokens", "tokens_per_s")]
        mean = {k: sum(s[k] for s in ep_steps) / len(ep_steps) for k in keys}
        tokens = sum(s["tokens"] for s in ep_steps)
        curves["train_epochs"].append({"epoch": epoch, "step": global_step, **mean, "tokens": tokens})
    if val is not None:
        curves["val"].append({"epoch": epoch, "step": global_step,
                              **curve_point(val, curves["algorithm"], curves["positions"], "_epoch")})


def plot_curves(curves: dict[str, Any], path: str | Path | None = None):
    """Three panels: the loss (EAGLE-3: per TTT step), the acceptance per draft position, the expected acceptance
    length (train steps, train epoch means, validation incl. the untrained draft at step 0). Saved as PNG when `path`
    is given."""
    from eagle3lib.common.drafters import title
    from eagle3lib.common.plots import figure, integer_ticks, save_show

    algorithm, k = curves["algorithm"], curves["positions"]
    fig, axes = figure(1, 3, figsize=(15, 4))
    steps, val = curves["steps"], curves["val"]
    xs = [s["step"] for s in steps]
    vx = [v["step"] for v in val]
    if algorithm != "eagle3":
        axes[0].plot(xs, [p["loss"] for p in steps], color="C0", alpha=0.35, lw=1)
        axes[0].plot(vx, [v["loss"] for v in val], "o-", color="C0", label="loss (val)")
    for s in range(k):
        color = f"C{s % 10}"
        if algorithm == "eagle3":
            axes[0].plot(xs, [p[f"loss_{s}"] for p in steps], color=color, alpha=0.35, lw=1)
            axes[0].plot(vx, [v[f"loss_{s}"] for v in val], "o-", color=color, label=f"step {s} (val)")
        axes[1].plot(xs, [p[f"full_acc_{s}"] for p in steps], color=color, alpha=0.35, lw=1)
        axes[1].plot(vx, [v[f"full_acc_{s}"] for v in val], "o-", color=color, label=f"position {s} (val)")
    axes[2].plot(xs, [p["eal"] for p in steps], color="C7", alpha=0.4, lw=1, label="train (step)")
    ep = curves["train_epochs"]
    axes[2].plot([e["step"] for e in ep], [e["eal"] for e in ep], "s-", color="C0", label="train (epoch mean)")
    axes[2].plot(vx, [v["eal"] for v in val], "o-", color="C3", label="validation")
    walked = [v for v in val if "tau_walk" in v]
    if walked:  # what a decoder would get on the validation replies (eagle3lib.train.walk): below EAL
        axes[2].plot([v["step"] for v in walked], [v["tau_walk"] for v in walked], "D--", color="C2",
                     label="validation τ by walking")
    titles = [f"{title(algorithm)}: " + ("loss of each TTT step (lines: train, dots: val)" if algorithm == "eagle3"
                                         else "loss (lines: train, dots: val)"),
              "acceptance per draft position" + (" (steps 0..s all right)" if algorithm == "eagle3" else ""),
              f"expected acceptance length (at most {k + 1})"]
    for ax, text in zip(axes, titles, strict=True):
        ax.set_title(text, fontsize=10)
        ax.set_xlabel("optimizer step")
        integer_ticks(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2 if k > 4 else 1)
    if path is not None:
        save_show(fig, path)
    return fig


def curves_table(curves: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per validation point: epoch, step, the loss (EAGLE-3: the sum of its TTT steps' losses, which the
    figure draws one by one), acceptance per draft position, EAGLE-3's cond_acc_s, the expected acceptance length,
    and τ by walking where it was recorded."""
    algorithm, k = curves["algorithm"], curves["positions"]
    rows = []
    for v in curves["val"]:
        loss = "loss (sum of TTT steps)" if algorithm == "eagle3" else "loss"
        row = {"epoch": v["epoch"], "step": v["step"], loss: round(v["loss"], 4)}
        row |= {f"full_acc_{s}": round(v[f"full_acc_{s}"], 4) for s in range(k)}
        if algorithm == "eagle3":
            row |= {f"cond_acc_{s}": round(v[f"cond_acc_{s}"], 4) for s in range(k)}
        row["eal"] = round(v["eal"], 4)
        if "tau_walk" in v:
            row["tau_walk"] = round(v["tau_walk"], 4)
        rows.append(row)
    return rows
