"""Stage 06 (notebooks/06_evaluate_acceptance.ipynb): how many tokens the target accepts per step with the trained
draft, what that does to speed, and the run's report card.

It measures acceptance on stage 02's held-out prompts the way vLLM reports it (tau = 1 + accepted / drafts,
per-position and draft acceptance rates) with the configured `evaluate.methods`: offline (the draft teacher-forced
over stored states), embedded (an exact speculative decoder, checked token for token against plain greedy), vllm
(EAGLE-3 in vLLM) and ngram (vLLM's draft-free baseline); `evaluate.benchmarks` (MT-Bench, ...) beside them with
the embedded and offline methods; then draws the figures and writes `report.md`.

    inputs.py      what it reads from stages 02, 04 and 05; the held-out prompts
    methods.py     the four methods, `measure` (eval/results.json) and resuming after a failed method
    benchmarks.py  evaluate.benchmarks: their prompts asked turn by turn, τ per benchmark, category and turn
    decoder.py     the exact greedy chain speculative decoder and the offline (teacher-forced) simulation
    vllm_child.py  one vLLM run, in a child process
    keys.py        the names of results.json's rows, which the figures and the report read back
    figures.py     figures/06_*.png
    report.py      the report card (report.md) and `eagle3 compare`

Run it: `eagle3 run --config configs/demo.yaml --stages 06`, or in Python `finish(stage, run(stage))` with
`stage = eagle3lib.rundir.open_stage("06", config)`. The notebook calls the same steps one by one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.evaluate.figures import draw_figures
from eagle3lib.evaluate.inputs import EvalInputs, inputs_from_run
from eagle3lib.evaluate.keys import LIVE
from eagle3lib.evaluate.methods import FinishedMethods, measure, run_embedded
from eagle3lib.evaluate.report import benchmark_table, summary_table, write_report
from eagle3lib.rundir import StageResult, StageRun

__all__ = ["EvalInputs", "EvaluateResult", "FinishedMethods", "benchmark_table", "draw_figures", "finish",
           "inputs_from_run", "measure", "report_card", "run", "run_embedded", "summary_table"]


@dataclass
class EvaluateResult(StageResult):
    """Stage 06's result: the manifest's outputs and metrics, plus what notebook 06 shows."""

    results: dict[str, Any] = field(default_factory=dict)  # eval/results.json
    figures: dict[str, Any] = field(default_factory=dict)  # name -> (png path, matplotlib figure)
    report: Path | None = None  # report.md


def metrics_for_manifest(results: dict[str, Any]) -> dict[str, Any]:
    """Stage 06's manifest metrics: k, prompts, tau by method, and speedup and identical outputs of the live ones."""
    m: dict[str, Any] = {"k": results["k"], "prompts": results["prompts"],
                         "tau": {name: a["tau"] for name, a in results["by_method"].items()}}
    for name in LIVE:
        if name in results:
            m[f"{name}_speedup"] = results[name].get("speedup")
            m[f"{name}_identical"] = f"{results[name]['identical']}/{results[name]['prompts']}"
    if results.get("tau_by_benchmark"):
        m["tau_by_benchmark"] = {b: {name: a["tau"] for name, a in r["by_method"].items()}
                                 for b, r in results["tau_by_benchmark"].items()}
    return m


def report_card(stage: StageRun, results: dict[str, Any], figs: dict[str, Any]) -> EvaluateResult:
    """Write report.md (this stage's wall time so far stands in for its manifest) and return the stage's result."""
    report = write_report(stage.rd, results, stage06_seconds=time.time() - stage.started)
    return EvaluateResult(outputs={"report": report, "results": stage.rd.path("eval", "results.json"),
                                   **{f"figure_{n}": p for n, (p, _) in figs.items()}},
                          metrics=metrics_for_manifest(results), results=results, figures=figs, report=report)


def run(stage: StageRun, progress: bool = True) -> EvaluateResult:
    """Everything notebook 06 does before its last cell: measure, draw the figures, write the report card."""
    results = measure(stage, progress=progress)
    return report_card(stage, results, draw_figures(stage, results))


def finish(stage: StageRun, result: EvaluateResult) -> Path:
    """Write stage 06's manifest, then the report card again, now with that manifest and its wall time."""
    path = stage.finish(result)
    write_report(stage.rd, result.results)
    return path
