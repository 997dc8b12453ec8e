"""Stage 06 (notebooks/06_evaluate_acceptance.ipynb): how many tokens the target accepts per step with the trained
draft, what that does to speed, and the run's report card.

It measures acceptance on stage 02's held-out prompts the way vLLM reports it (tau = 1 + accepted / drafts,
per-position and draft acceptance rates) with the configured `evaluate.methods`: offline (the draft teacher-forced
over stored states), embedded (an exact speculative decoder, checked token for token against plain greedy), vllm
(EAGLE-3 in vLLM) and ngram (vLLM's draft-free baseline); `evaluate.benchmarks` (MT-Bench, ...) beside them with
the embedded and offline methods; with `serve` in the methods, the serve step then measures the real `vllm serve`
with and without the draft at each concurrency level (`serve.sweep`); then it draws the figures and writes
`report.md`, which opens with the serve step's verdict (serve the draft up to which concurrency, with which
settings, or not) and the command that serves it.

    inputs.py      what it reads from stages 02, 04 and 05; the held-out prompts
    methods.py     the methods (offline, embedded, vllm, ngram) and resuming after a failed method
    measure.py     `measure`: the configured methods in order, into eval/results.json
    benchmarks.py  evaluate.benchmarks: their prompts asked turn by turn, τ per benchmark, category and turn
    decoder.py     the exact greedy chain speculative decoder and the offline (teacher-forced) simulation
    vllm_child.py  one vLLM run, in a child process
    serve.py       the serve step: `vllm serve` with each draft (each drafter and setting of evaluate.serve_grid) and
                   without one under `vllm bench serve`, per concurrency; the recommendation per level and the verdict
    serve_plan.py  the sweep's servers and their command lines (`vllm serve`, `vllm bench serve`), the order they run
    serve_asks.py  what a server is asked beyond the levels (outputs by held-out group, benchmarks) and the tie check
    server.py      one vLLM server: started on a free local port, waited for, always stopped
    bench_worker.py  vLLM's own `vllm bench serve`, level after level in one child process
    serve_report.py  what the report card (its opening lines) and the figures show of the serve step
    keys.py        the names of results.json's rows, which the figures and the report read back
    figures.py     figures/06_*.png
    report.py      the report card (report.md)
    compare.py     `eagle3 compare`: runs and their drafters side by side

Run it: `eagle3 run --config configs/demo.yaml --stages 06`, or in Python `finish(stage, run(stage))` with
`stage = eagle3lib.common.rundir.open_stage("06", config)`. The notebook calls the same steps one by one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.common.rundir import StageResult, StageRun
from eagle3lib.evaluate.figures import draw_figures
from eagle3lib.evaluate.inputs import EvalInputs, inputs_from_run
from eagle3lib.evaluate.keys import LIVE, VLLM
from eagle3lib.evaluate.measure import measure
from eagle3lib.evaluate.methods import FinishedMethods, run_embedded
from eagle3lib.evaluate.report import (
    benchmark_table,
    held_out_group_table,
    report_for_notebook,
    summary_table,
    write_report,
)
from eagle3lib.evaluate.serve import sweep as serve_sweep

__all__ = ["EvalInputs", "EvaluateResult", "FinishedMethods", "benchmark_table", "draw_figures", "finish",
           "held_out_group_table", "inputs_from_run", "measure", "report_card", "report_for_notebook", "run",
           "run_embedded", "serve_sweep", "summary_table"]


@dataclass
class EvaluateResult(StageResult):
    """Stage 06's result: the manifest's outputs and metrics, plus what notebook 06 shows."""

    results: dict[str, Any] = field(default_factory=dict)  # eval/results.json
    figures: dict[str, Any] = field(default_factory=dict)  # name -> (png path, matplotlib figure)
    report: Path | None = None  # report.md


def metrics_for_manifest(results: dict[str, Any]) -> dict[str, Any]:
    """Stage 06's manifest metrics: k, prompts, tau by method, speed ratio and identical outputs of the live ones,
    the serving speedup at each level's recommended (best) setting, the settings recommended, the step cost (the τ
    the draft needs to pay) by concurrency and the verdict's numbers."""
    m: dict[str, Any] = {"k": results["k"], "prompts": results["prompts"],
                         "tau": {name: a["tau"] for name, a in results["by_method"].items()}}
    for name in LIVE:
        if name in results:  # in-process vLLM batches every prompt: a throughput ratio, not a serving speedup
            m[f"{name}_{'batch_throughput_ratio' if name == VLLM else 'speedup'}"] = results[name].get("speedup")
            m[f"{name}_identical"] = f"{results[name]['identical']}/{results[name]['prompts']}"
    if results.get("tau_by_benchmark"):
        m["tau_by_benchmark"] = {b: {name: a["tau"] for name, a in r["by_method"].items()}
                                 for b, r in results["tau_by_benchmark"].items()}
    serve = results.get("serve")
    if serve:
        verdict = serve.get("verdict") or {}
        m.update(serve_speedup_by_concurrency=serve["speedup_by_concurrency"],
                 serve_recommended_settings={c: r["setting"]
                                             for c, r in (serve.get("recommended_settings") or {}).items()},
                 serve_step_cost_by_concurrency=serve.get("step_cost_by_concurrency"),
                 serve_falls_below_1_at=serve["falls_below_1_at"], serve_tau=serve["acceptance"].get("tau"),
                 serve_identical=f"{serve['identical']}/{serve['prompts']}",
                 serve_verdict={key: verdict.get(key) for key in ("serve", "up_to_concurrency", "settings",
                                                                  "speedup_at_lowest", "break_even_tau",
                                                                  "tau_after_doubling")})
        if serve.get("ngram"):  # the draft-free baseline's server in the same sweep
            m["serve_ngram_speedup_by_concurrency"] = serve["ngram"]["speedup_by_concurrency"]
    return m


def report_card(stage: StageRun, results: dict[str, Any], figs: dict[str, Any]) -> EvaluateResult:
    """Write report.md (this stage's wall time so far stands in for its manifest) and return the stage's result."""
    report = write_report(stage.rd, results, stage06_seconds=time.time() - stage.started)
    return EvaluateResult(outputs={"report": report, "results": stage.rd.path("eval", "results.json"),
                                   **{f"figure_{n}": p for n, (p, _) in figs.items()}},
                          metrics=metrics_for_manifest(results), results=results, figures=figs, report=report)


def run(stage: StageRun, progress: bool = True) -> EvaluateResult:
    """Everything notebook 06 does before its last cell: measure, serve, draw the figures, write the report card."""
    results = serve_sweep(stage, measure(stage, progress=progress), progress=progress)
    return report_card(stage, results, draw_figures(stage, results))


def finish(stage: StageRun, result: EvaluateResult) -> Path:
    """Write stage 06's manifest, then the report card again, now with that manifest and its wall time."""
    path = stage.finish(result)
    write_report(stage.rd, result.results)
    return path
