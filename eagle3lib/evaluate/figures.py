"""Stage 06's figures (up to four, one more with `evaluate.benchmarks`, one more with the serve step), drawn from
the results `measure.measure` and the serve step wrote (figures/06_*.png).

Why from the results only: the same dict is eval/results.json, so a figure can be redrawn from a finished run
without measuring again. The rows are named in `keys`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib.common import plots
from eagle3lib.common.rundir import StageRun
from eagle3lib.evaluate import serve_report
from eagle3lib.evaluate.keys import BENCH_PATH, EMBEDDED, HELD_OUT, HELDOUT_PATH, LIVE, NGRAM_SERVE, serve_row


def _label_and_save(fig: Any, ax: Any, path: Path, title: str, xlabel: str | None, ylabel: str) -> Any:
    """What every stage-06 figure ends with: labels, title, legend, the PNG."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    plots.save(fig, path)
    return fig


def _bars_by_method(ax: Any, results: dict[str, Any], values: Any, first_x: int, label: Any) -> None:
    """One group of bars per x position, one bar per method in the group: `values(acceptance)` gives the heights,
    the first at x = `first_x`."""
    methods = [m for m in results["by_method"] if results["by_method"][m]]
    width = 0.8 / max(len(methods), 1)
    for j, name in enumerate(methods):
        a = results["by_method"][name]
        ys = values(a)
        xs = [first_x + i + (j - (len(methods) - 1) / 2) * width for i in range(len(ys))]
        ax.bar(xs, ys, width=width, label=label(name, a))


def plot_per_position(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    _bars_by_method(ax, results, lambda a: a["per_pos_rate"], first_x=1,
                    label=lambda name, a: f"{name} (tau {a['tau']:.2f})")
    ax.set_ylim(0, 1)
    plots.integer_ticks(ax)
    return _label_and_save(fig, ax, path, "per-position acceptance rate", "draft position",
                           "accepted at position / drafts")


def plot_length_histogram(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    _bars_by_method(ax, results, lambda a: [h / max(sum(a["length_histogram"]), 1) for h in a["length_histogram"]],
                    first_x=0, label=lambda name, a: name)
    plots.integer_ticks(ax)
    return _label_and_save(fig, ax, path, "accepted lengths", "accepted draft tokens in a step", "share of steps")


def plot_tau_vs_k(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    for name, sweep in results["sweep"].items():
        ks = sorted(int(k) for k in sweep)
        ax.plot(ks, [sweep[str(k)]["tau"] if str(k) in sweep else sweep[k]["tau"] for k in ks], marker="o",
                label=name)
    ks_all = sorted({int(k) for s in results["sweep"].values() for k in s})
    if ks_all:
        ax.plot(ks_all, [k + 1 for k in ks_all], ls=":", color="grey", label="ideal (all accepted)")
    plots.integer_ticks(ax)
    return _label_and_save(fig, ax, path, "mean acceptance length vs k", "k (draft tokens per step)",
                           "tau (tokens per target forward)")


def plot_speedup(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    names, base, spec = [], [], []
    for name in LIVE:
        r = results.get(name)
        if r and r.get("baseline_tokens_per_s"):
            names.append(name)
            base.append(r["baseline_tokens_per_s"])
            spec.append(r["spec_tokens_per_s"])
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], base, width=0.4, label="target alone")
    ax.bar([x + 0.2 for x in xs], spec, width=0.4, label="with the draft")
    for x, b, s in zip(xs, base, spec, strict=True):
        ax.text(x + 0.2, s, f"x{s / b:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), names)
    return _label_and_save(fig, ax, path, "tokens/s with and without the draft (embedded: batch 1; vllm: one batch)",
                           None, "generated tokens / s")


def plot_tau_by_benchmark(results: dict[str, Any], path: Path):
    """τ of the held-out split and of each benchmark (and each benchmark category, where it has more than one):
    embedded, the server, offline. The figure widens with the number of bars."""
    by = results["by_method"]
    served = [serve_row(a) for a in results.get("drafts") or {"eagle3": None}]  # each drafter's server
    sets = [(HELD_OUT, {EMBEDDED: by.get(EMBEDDED), **{r: by.get(r) for r in served},
                        NGRAM_SERVE: by.get(NGRAM_SERVE), BENCH_PATH: by.get(HELDOUT_PATH)})]
    for name, b in results["tau_by_benchmark"].items():
        sets.append((name, b["by_method"]))
        cats = b.get("by_category", {})
        sets += [(f"{name}: {cat}", g["by_method"]) for cat, g in cats.items()] if len(cats) > 1 else []
    fig, ax = plots.figure(figsize=(max(7.0, 0.32 * len(sets)), 3.5))
    methods = [m for m in (EMBEDDED, *served, NGRAM_SERVE, BENCH_PATH) if any(s.get(m) for _, s in sets)]
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(sets))]
        ax.bar(xs, [(s.get(m) or {}).get("tau", float("nan")) for _, s in sets], width=width, label=m)
    ax.set_xticks(range(len(sets)), [n for n, _ in sets], rotation=60, ha="right", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.5)
    return _label_and_save(fig, ax, path, f"tau by prompt set (k = {results['k']})", None,
                           "tau (tokens per target forward)")


def _has_rows(results: dict[str, Any]) -> bool:
    return any(results.get("by_method", {}).values())


def _has_sweep(results: dict[str, Any]) -> bool:  # evaluate.sweep_k measured by an offline or embedded method
    return any(results.get("sweep", {}).values())


def _has_speed(results: dict[str, Any]) -> bool:  # a live method timed with and without the draft
    return any((results.get(name) or {}).get("baseline_tokens_per_s") for name in LIVE)


# each figure, drawn only when its numbers exist (`evaluate.methods: [serve]` alone has no sweep and no batch speed)
FIGURES = (("per_position", plot_per_position, _has_rows), ("accepted_lengths", plot_length_histogram, _has_rows),
           ("tau_vs_k", plot_tau_vs_k, _has_sweep), ("speedup", plot_speedup, _has_speed))


def draw_figures(stage: StageRun, results: dict[str, Any]) -> dict[str, Any]:
    """The figures whose numbers the results hold (PNG in the run's figures/; an earlier attempt's figure that this
    one has no numbers for is removed, so the report card shows none), τ by benchmark when there are any, and the
    serving speedup when the serve step ran; returns {name: (path, fig)}."""
    out = {}
    for name, fn, has_numbers in FIGURES:
        path = stage.rd.figure_path("06", name)
        if has_numbers(results):
            out[name] = (path, fn(results, path))
        else:
            path.unlink(missing_ok=True)
    if results.get("tau_by_benchmark"):  # evaluate.benchmarks
        path = stage.rd.figure_path("06", "tau_by_benchmark")
        out["tau_by_benchmark"] = (path, plot_tau_by_benchmark(results, path))
    if results.get("serve"):
        path = stage.rd.figure_path("06", "serve_speedup")
        out["serve_speedup"] = (path, serve_report.plot(results, path))
    return out
