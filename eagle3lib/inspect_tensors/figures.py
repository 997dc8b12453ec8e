"""Stage 03's five figures (each function returns the matplotlib figure; `make_figure` saves it as
figures/03_<name>.png and shows it inline in a notebook).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3lib.common import plots, shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.inspect_tensors.stats import HIST_BINS, HIST_LOG10, POS_BUCKETS, SlotStats, bucket_label

if TYPE_CHECKING:
    from eagle3lib.common.rundir import RunDir


def _slot_names(layer_ids: list[int]) -> list[str]:
    return [f"layer {lid}" + (" (final, pre-norm)" if s == len(layer_ids) - 1 else "") for s, lid in
            enumerate(layer_ids)]


def fig_norm_hist(stats: SlotStats, layer_ids: list[int]):
    """Token-norm histograms per slot on a log axis: slots should differ, none should sit at zero."""
    fig, ax = plots.figure(figsize=(8, 3.8))
    edges = torch.logspace(*HIST_LOG10, HIST_BINS + 1, dtype=torch.float64)
    used = stats.hist[:, 1:-1].sum(0).nonzero().flatten()
    lo, hi = (int(used.min()), int(used.max()) + 1) if len(used) else (0, HIST_BINS)
    for s, name in enumerate(_slot_names(layer_ids)):
        counts = stats.hist[s, 1:-1].double()
        frac = counts / counts.sum().clamp_min(1)
        ax.stairs(frac[lo:hi].numpy(), edges[lo:hi + 1].numpy(), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("token L2 norm")
    ax.set_ylabel("share of tokens")
    ax.set_title(f"Hidden-state norms per slot ({stats.tokens} tokens, {stats.shards} shards)")
    ax.legend(fontsize=8)
    return fig


def fig_dim_std(stats: SlotStats, layer_ids: list[int]):
    """Per-dimension std per slot: spikes are outlier dimensions (massive activations)."""
    n = stats.n_slots
    fig, axes = plots.figure(n, 1, figsize=(9, 1.7 * n + 0.6), sharex=True, squeeze=False)
    std = stats.dim.std
    for s, name in enumerate(_slot_names(layer_ids)):
        ax = axes[s, 0]
        ax.plot(std[s].numpy(), lw=0.7)
        ax.set_yscale("log")
        ax.set_ylabel("std", fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("hidden dimension")
    fig.suptitle("Per-dimension standard deviation per slot")
    fig.tight_layout()
    return fig


def fig_cos_heatmap(stats: SlotStats, layer_ids: list[int]):
    """Mean per-token cosine between slots: near 1 off the diagonal means two slots carry almost the same state."""
    fig, ax = plots.figure(figsize=(4.8, 4))
    cos = stats.cos.mean.numpy()
    im = ax.imshow(cos, vmin=-1, vmax=1, cmap="RdBu_r")
    labels = [str(lid) for lid in layer_ids]
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yticks(range(len(labels)), labels)
    for a in range(len(labels)):
        for b in range(len(labels)):
            ax.text(b, a, f"{cos[a, b]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("layer id (last = final, pre-norm)")
    ax.set_title("Slot-to-slot cosine (mean over tokens)")
    fig.colorbar(im, ax=ax, shrink=0.8)
    return fig


def fig_norm_by_position(stats: SlotStats, layer_ids: list[int]):
    """Mean norm (± std) by token position, power-of-two buckets: how norms grow along the sequence."""
    fig, ax = plots.figure(figsize=(8, 3.8))
    used = [k for k in range(POS_BUCKETS) if float(stats.pos.count[k, 0]) > 0]
    xs = list(range(len(used)))
    for s, name in enumerate(_slot_names(layer_ids)):
        mean = stats.pos.mean[used, s].numpy()
        std = stats.pos.std[used, s].numpy()
        ax.plot(xs, mean, marker="o", ms=3, label=name)
        ax.fill_between(xs, mean - std, mean + std, alpha=0.15)
    ax.set_xticks(xs, [bucket_label(k) for k in used], rotation=45, fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("mean L2 norm")
    ax.set_title("Norm by token position")
    ax.legend(fontsize=8)
    return fig


def load_example(dataset_dir: Path, index: int, rows: int) -> torch.Tensor:
    if not 0 <= index < rows:
        raise WorkbookError(f"inspect.example_index={index} but the dataset has {rows} rows",
                            f"set inspect.example_index to 0..{rows - 1}")
    return shards.read_shard(shards.shard_path(dataset_dir, index))["hidden_states"]


def fig_example_heatmap(hidden_states: torch.Tensor, layer_ids: list[int], index: int):
    """Token × dimension values of one sample, per slot; colours clipped at the 99.5th percentile of |value| so the
    few outlier dimensions do not wash out the rest (they show as saturated stripes)."""
    n = hidden_states.shape[1]
    fig, axes = plots.figure(1, n, figsize=(3.2 * n + 1, 4.2), squeeze=False)
    x = hidden_states.to(torch.float32)
    for s, name in enumerate(_slot_names(layer_ids)):
        ax = axes[0, s]
        v = x[:, s]
        flat = v.abs().flatten()
        k = max(1, math.ceil(0.995 * flat.numel()))
        clip = float(flat.kthvalue(k).values) or 1.0
        im = ax.imshow(v.numpy(), aspect="auto", cmap="RdBu_r", vmin=-clip, vmax=clip, interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("dimension")
        if s == 0:
            ax.set_ylabel("token position")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(f"Sample {index}: token × dimension (clipped at the 99.5th percentile of |value|)")
    fig.tight_layout()
    return fig


FIGURES = ("norm_hist", "dim_std", "cos_heatmap", "norm_by_position", "example_heatmap")


def make_figure(result: Any, name: str, rd: RunDir, example_index: int = 0) -> Path:
    """One stage-03 figure (a name of FIGURES) of a pass's result (the stage's `Inspection`: its stats, layer ids,
    dataset and rows), saved as figures/03_<name>.png (and shown inline in a notebook)."""
    if name == "example_heatmap":
        if result.online_rows is not None and example_index not in result.online_rows:
            raise WorkbookError(f"inspect.example_index={example_index} has no shard: stage 02 ran "
                                f"{result.hidden_states} and wrote "
                                f"shards for rows {result.online_rows[:8]}{' ...' if len(result.online_rows) > 8 else ''}",
                                "set inspect.example_index to one of them")
        example = load_example(result.dataset_dir, example_index, result.rows)
        fig = fig_example_heatmap(example, result.layer_ids, example_index)
    else:
        draw = {"norm_hist": fig_norm_hist, "dim_std": fig_dim_std, "cos_heatmap": fig_cos_heatmap,
                "norm_by_position": fig_norm_by_position}[name]
        fig = draw(result.stats, result.layer_ids)
    return plots.save_show(fig, rd.figure_path("03", name))
