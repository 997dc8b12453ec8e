"""benchmarks/data_curve.py on committed GPU runs' small files (benchmarks/results/runs/): the step between two
separate runs compares only what both asked (the benchmarks' questions), never held-out prompts drawn apart or
validation rows of their own; the verdict reads that step's gain."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "benchmarks" / "results" / "runs"


def test_a_step_between_two_runs_compares_only_the_benchmarks(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import data_curve

    from eagle3lib.evaluate.serve_verdict import read_data_curve

    one = data_curve.point(RUNS / "qwen-coder-1.5b-h200-workbook-muon-2026-12-05")  # 1x data, 2 epochs
    four = data_curve.point(RUNS / "qwen-coder-1.5b-x4-h200-2026-12-05")  # 4x data, 1 epoch
    assert one["held_out_digest"] != four["held_out_digest"]  # each run drew its own held-out prompts
    [step] = data_curve.per_doubling([one, four])
    assert step["across_validation_sets"] is True
    assert 1.9 < step["doublings"] < 2.1
    gains = step["tau_gain_per_doubling"]
    assert "vllm serve" not in gains  # held-out tau: different prompts, no gain
    assert set(gains) == {f"{b}/vllm serve" for b in ("mt_bench", "gsm8k", "math500", "humaneval")}
    assert gains["mt_bench/vllm serve"] == round(
        (four["tau_by_benchmark"]["mt_bench"]["vllm serve"] - one["tau_by_benchmark"]["mt_bench"]["vllm serve"])
        / step["doublings"], 4)

    # the same two points as one run's forks (one split: the same digest) give the held-out gain too
    fork = {**four, "held_out_digest": one["held_out_digest"]}
    [same] = data_curve.per_doubling([one, fork])
    assert "across_validation_sets" not in same and "vllm serve" in same["tau_gain_per_doubling"]

    # the verdict's "one more doubling": the held-out tau gain where the step has one, else validation EAL's
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"per_doubling": [step]}))
    assert read_data_curve(path)["of"] == "validation EAL"
    path.write_text(json.dumps({"per_doubling": [same]}))
    assert read_data_curve(path)["of"] == "τ vllm serve"
