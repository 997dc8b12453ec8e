"""benchmarks/data_curve.py on committed GPU runs' small files (benchmarks/results/runs/): the step between two
separate runs compares only what both asked (the benchmarks' questions), never held-out prompts drawn apart or
validation rows of their own; the verdict reads that step's gain. A curve of DFlash drafts reads their results and
their server's rows only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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


def test_a_curve_of_dflash_drafts_reads_only_theirs(tmp_path):
    """The 1.5B's DFlash drafts of one extraction, on half the training rows (a run that also trained and served
    EAGLE-3 and P-EAGLE) and on all of them: each point reads the DFlash result and its server's rows only, the step
    gives the held-out gain (the same held-out prompts), the verdict reads the DFlash server's gain from a curve that
    names its drafter, and an EAGLE-3 curve cannot be extended with DFlash points."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import data_curve

    from eagle3lib.evaluate.serve_verdict import read_data_curve

    three = RUNS / "qwen-coder-1.5b-h200-drafters-2026-12-07"
    half = data_curve.point(three, "dflash")
    full = data_curve.point(RUNS / "qwen-coder-1.5b-h200-dflash-6m-tokens-2026-12-07", "dflash")
    eagle = data_curve.point(three)
    assert set(half["tau_heldout"]) == set(full["tau_heldout"]) == {"vllm serve dflash"}
    assert set(half["tau_by_benchmark"]["gsm8k"]) == {"vllm serve dflash"}
    assert "vllm serve" in eagle["tau_heldout"] and "vllm serve dflash" not in eagle["tau_heldout"]
    assert half["val_eal"] != eagle["val_eal"] and len(half["val_full_acc"]) == 15  # DFlash's 15 block slots
    [step] = data_curve.per_doubling([half, full])
    assert "across_validation_sets" not in step and 0.95 < step["doublings"] < 1.05
    gain = step["tau_gain_per_doubling"]["vllm serve dflash"]
    assert gain == round((full["tau_heldout"]["vllm serve dflash"] - half["tau_heldout"]["vllm serve dflash"])
                         / step["doublings"], 4)
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"drafter": "dflash", "per_doubling": [step]}))
    curve = read_data_curve(path)
    assert (curve["drafter"], curve["of"], curve["gain_per_doubling"]) == ("dflash", "τ vllm serve dflash", gain)
    eagle3_curve = REPO / "benchmarks" / "results" / "data_curve_qwen15_muon_h200_2026-12-05.json"
    with pytest.raises(SystemExit, match=r"measured EAGLE-3 drafts, not DFlash ones: .*\(--drafter eagle3\)"):
        data_curve.curve_points(eagle3_curve, "dflash")
