"""Stage 05's curves: what is recorded per training step, per epoch and per validation, and how it is shown.

`draft/curves.json` holds, for train steps, train epoch means and validation (the untrained draft first, at epoch -1):
the loss, and per TTT step s its loss, full_acc_s and cond_acc_s, and the expected acceptance length
1 + Σ_s full_acc_s (docs/engines.md#speculators-model-and-metrics); validation points also τ by walking the replies as
a decoder would (`tau_walk`, eagle3lib.train.walk: the served τ they predict, below EAL). A resumed run keeps the
history up to its checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3lib.train.settings import Resolved


def expected_acceptance_length(metrics: dict[str, float], ttt_steps: int, suffix: str = "") -> float:
    """1 + Σ_s full_acc_s: the mean number of tokens per verifier step if the draft proposes ttt_steps tokens."""
    return 1.0 + sum(float(metrics.get(f"full_acc_{s}{suffix}", 0.0)) for s in range(ttt_steps))


def curve_point(metrics: dict[str, float], ttt_steps: int, suffix: str = "") -> dict[str, Any]:
    """The numbers a curve needs, in one flat shape for train steps, train epochs and validation."""
    out: dict[str, Any] = {"loss": float(metrics.get(f"loss{suffix}", float("nan")))}
    for s in range(ttt_steps):
        for key in ("loss", "full_acc", "cond_acc"):
            out[f"{key}_{s}"] = float(metrics.get(f"{key}_{s}{suffix}", float("nan")))
    out["eal"] = expected_acceptance_length(metrics, ttt_steps, suffix)
    for key in ("tau_walk", "eal_uniform"):  # validation only (eagle3lib.train.walk)
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


def start_curves(path: Path, ttt_steps: int, res: Resolved, *, resumed: bool, start_epoch: int,
                 global_step: int) -> dict[str, Any]:
    """The curves a run starts from: empty, or when the Trainer resumed a checkpoint, the ones in `path` up to it
    (steps past its global step and epochs from `start_epoch` on, which a killed run recorded, are trained again)."""
    old = (_load_curves(path) if resumed else None) or {}
    return {
        "ttt_steps": ttt_steps, "resolved": asdict(res),
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
        curves["val"].append({"epoch": epoch, "step": global_step, **curve_point(val, curves["ttt_steps"], "_epoch")})


def plot_curves(curves: dict[str, Any], path: str | Path | None = None):
    """Three panels: loss per TTT step, full acceptance per TTT step, expected acceptance length (train steps, train
    epoch means, validation incl. the untrained draft at step 0). Saved as PNG when `path` is given."""
    from eagle3lib.plots import figure, save_show

    k = curves["ttt_steps"]
    fig, axes = figure(1, 3, figsize=(15, 4))
    steps, val = curves["steps"], curves["val"]
    xs = [s["step"] for s in steps]
    vx = [v["step"] for v in val]
    for s in range(k):
        color = f"C{s}"
        axes[0].plot(xs, [p[f"loss_{s}"] for p in steps], color=color, alpha=0.35, lw=1)
        axes[0].plot(vx, [v[f"loss_{s}"] for v in val], "o-", color=color, label=f"step {s} (val)")
        axes[1].plot(xs, [p[f"full_acc_{s}"] for p in steps], color=color, alpha=0.35, lw=1)
        axes[1].plot(vx, [v[f"full_acc_{s}"] for v in val], "o-", color=color, label=f"full_acc_{s} (val)")
    axes[2].plot(xs, [p["eal"] for p in steps], color="C7", alpha=0.4, lw=1, label="train (step)")
    ep = curves["train_epochs"]
    axes[2].plot([e["step"] for e in ep], [e["eal"] for e in ep], "s-", color="C0", label="train (epoch mean)")
    axes[2].plot(vx, [v["eal"] for v in val], "o-", color="C3", label="validation")
    walked = [v for v in val if "tau_walk" in v]
    if walked:  # what a decoder would get on the validation replies (eagle3lib.train.walk): below EAL
        axes[2].plot([v["step"] for v in walked], [v["tau_walk"] for v in walked], "D--", color="C2",
                     label="validation τ by walking")
    titles = ["loss per TTT step (lines: train, dots: val)", "full acceptance per TTT step",
              f"expected acceptance length 1 + Σ full_acc (max {k + 1})"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if path is not None:
        save_show(fig, path)
    return fig


def curves_table(curves: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per validation point: epoch, step, loss, full_acc_s, cond_acc_s, expected acceptance length, and τ
    by walking where it was recorded."""
    k = curves["ttt_steps"]
    rows = []
    for v in curves["val"]:
        row = {"epoch": v["epoch"], "step": v["step"], "loss": round(v["loss"], 4)}
        row |= {f"full_acc_{s}": round(v[f"full_acc_{s}"], 4) for s in range(k)}
        row |= {f"cond_acc_{s}": round(v[f"cond_acc_{s}"], 4) for s in range(k)}
        row["eal"] = round(v["eal"], 4)
        if "tau_walk" in v:
            row["tau_walk"] = round(v["tau_walk"], 4)
        rows.append(row)
    return rows
