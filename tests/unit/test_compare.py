"""`eagle3 compare`: the table across run folders reads what each run recorded (eval/results.json, manifests) and
shows τ per method and per benchmark, the serving speedup per concurrency level and τ by benchmark category, with —
where a run lacks a number.

Two small run folders written by hand, shaped as stage 06 writes them: a SmolLM2-like run with the embedded decoder,
n-gram lookup and the serve sweep at 1/4/16, and a serve-only run (the 1.5B recipe's shape) with another benchmark
and other levels. No model is loaded: the reader must not need one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib.common import atomic
from eagle3lib.common.rundir import manifest_file
from eagle3lib.common.stages import get_stage
from eagle3lib.evaluate.keys import EMBEDDED, NGRAM, SERVE


def _acc(tau: float, tokens_per_step: float | None = None, per_pos_rate: list[float] | None = None) -> dict[str, Any]:
    """An acceptance dict with the fields compare reads (the rest of Acceptance.to_dict is not read)."""
    return {"tau": tau, "tokens_per_step": tokens_per_step, "per_pos_rate": per_pos_rate or []}


def _write_run(root: Path, layer_ids: list[int], val_eal: float, seconds: dict[str, float],
               results: dict[str, Any]) -> Path:
    for sid, s in seconds.items():
        metrics = {"02": {"layer_ids": layer_ids}, "05": {"val_eal": val_eal}}.get(sid, {})
        atomic.write_json(manifest_file(root, get_stage(sid)), {"stage": sid, "seconds": s, "metrics": metrics})
    atomic.write_json(root / "eval" / "results.json", results)
    return root


def _runs(tmp_path: Path) -> list[Path]:
    small = _write_run(tmp_path / "smollm2", [2, 15, 27, 30], 2.5, {"02": 40.0, "05": 100.0, "06": 60.0}, {
        "by_method": {EMBEDDED: _acc(2.322, 2.1, [0.61, 0.39, 0.27]), NGRAM: _acc(2.73, 1.41, [0.5, 0.3, 0.2]),
                      SERVE: _acc(2.3371, 2.2)},
        "tau_by_benchmark": {"mt_bench": {
            "questions": 2, "prompts": 4, "by_method": {EMBEDDED: _acc(2.4), SERVE: _acc(2.5689)},
            "by_category": {"writing": {"prompts": 2, "by_method": {EMBEDDED: _acc(2.1), SERVE: _acc(2.2)}},
                            "coding": {"prompts": 2, "by_method": {EMBEDDED: _acc(2.9)}}}}},
        "serve": {"speedup_by_concurrency": {"1": 1.3043, "4": 0.9563, "16": 0.8184}}})
    qwen = _write_run(tmp_path / "qwen15", [2, 14, 24, 27], 3.0, {"02": 50.0, "05": 200.0}, {
        "by_method": {SERVE: _acc(2.9, 2.6)},
        "tau_by_benchmark": {
            "mt_bench": {"questions": 2, "prompts": 4, "by_method": {SERVE: _acc(3.1)},
                         "by_category": {"writing": {"prompts": 2, "by_method": {SERVE: _acc(2.8)}},
                                         "math": {"prompts": 2, "by_method": {SERVE: _acc(3.3)}}}},
            "alpaca_eval": {"questions": 3, "prompts": 3, "by_method": {SERVE: _acc(2.7)}}},
        "serve": {"speedup_by_concurrency": {"64": 0.9, "1": 1.5}}})
    return [small, qwen]


def _tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `text` as rows of {header: cell}."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---") and i > 0:
            header = [c.strip() for c in lines[i - 1].strip("|").split("|")]
            rows = []
            for row in lines[i + 1:]:
                if not row.startswith("| "):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True)))
            tables.append(rows)
    return tables


def test_compare_shows_tau_per_benchmark_the_serving_speedup_per_level_and_tau_by_category(tmp_path, capsys):
    from eagle3lib.cli import main
    from eagle3lib.evaluate.compare import compare_runs

    roots = _runs(tmp_path)
    text = compare_runs(roots)
    print(text)
    main_table, cats = _tables(text)
    # columns: the existing ones kept, τ serve, one per benchmark any run has (first seen first), one per level any
    # run's sweep measured (ascending, numerically: 16 before 64)
    assert list(main_table[0]) == [
        "draft", "aux layers", "val EAL (05)", "τ embedded", "τ vLLM", "τ serve", "τ mt_bench", "τ alpaca_eval",
        "tokens per step", "per position", "×c=1", "×c=4", "×c=16", "×c=64", "train s", "stages s"]
    small, qwen, ngram = main_table
    assert small == {
        "draft": "smollm2", "aux layers": "[2, 15, 27]", "val EAL (05)": "2.500", "τ embedded": "2.322",
        "τ vLLM": "—", "τ serve": "2.337", "τ mt_bench": "2.569",  # the server's row, preferred over embedded's 2.4
        "τ alpaca_eval": "—", "tokens per step": "2.100", "per position": "0.61 / 0.39 / 0.27",
        "×c=1": "1.304", "×c=4": "0.956", "×c=16": "0.818", "×c=64": "—", "train s": "100",
        "stages s": "200"}
    assert qwen == {
        "draft": "qwen15", "aux layers": "[2, 14, 24]", "val EAL (05)": "3.000", "τ embedded": "—", "τ vLLM": "—",
        "τ serve": "2.900", "τ mt_bench": "3.100", "τ alpaca_eval": "2.700", "tokens per step": "2.600",
        "per position": "—", "×c=1": "1.500", "×c=4": "—", "×c=16": "—", "×c=64": "0.900", "train s": "200",
        "stages s": "250"}
    # the n-gram row: τ in the vLLM column as before, nothing in the draft's benchmark or serving columns
    assert ngram["draft"] == "vLLM n-gram lookup (no draft)" and ngram["τ vLLM"] == "2.730"
    assert ngram["tokens per step"] == "1.410" and ngram["per position"] == "0.50 / 0.30 / 0.20"
    assert {ngram[c] for c in ("τ serve", "τ mt_bench", "τ alpaca_eval", "×c=1", "×c=64")} == {"—"}
    # the note says which rows each run's benchmark τ is read from (smollm2's coding category: the embedded row)
    assert "rows read: smollm2: vllm serve + embedded; qwen15: vllm serve)" in text and "×c=N" in text
    # τ by category: one row per (benchmark, category) any run has, one column per run; coding falls back to the
    # embedded row where the serve step did not ask it; alpaca_eval has no categories, so no row
    assert [(r["benchmark"], r["category"], r["smollm2"], r["qwen15"]) for r in cats] == [
        ("mt_bench", "writing", "2.200", "2.800"), ("mt_bench", "coding", "2.900", "—"),
        ("mt_bench", "math", "—", "3.300")]
    capsys.readouterr()
    assert main(["compare", *map(str, roots)]) == 0  # the CLI prints the same table
    assert capsys.readouterr().out.strip() == text


def test_compare_without_benchmarks_or_a_sweep_has_no_such_columns_and_no_category_table(tmp_path):
    """A run that stopped before stage 06 (no eval/results.json): its row is the manifests' numbers and —."""
    from eagle3lib.evaluate.compare import compare_runs

    root = tmp_path / "early"
    atomic.write_json(manifest_file(root, get_stage("05")), {"seconds": 12.5, "metrics": {"val_eal": 1.5}})
    text = compare_runs([root])
    (table,) = _tables(text)
    assert list(table[0]) == ["draft", "aux layers", "val EAL (05)", "τ embedded", "τ vLLM", "τ serve",
                              "tokens per step", "per position", "train s", "stages s"]
    assert table == [{"draft": "early", "aux layers": "—", "val EAL (05)": "1.500", "τ embedded": "—",
                      "τ vLLM": "—", "τ serve": "—", "tokens per step": "—", "per position": "—",
                      "train s": "12", "stages s": "12"}]
    assert "τ by benchmark category" not in text and "×c=N" not in text


def test_a_runs_result_json_reads_the_same_rows_as_compare(tmp_path):
    """benchmarks/recipe.py (a recipe run's result JSON, and each arm of benchmarks/peers.py): τ held-out and per
    benchmark from the server's row where the run has one, else the embedded decoder's, beside the stage seconds."""
    import sys

    from eagle3lib.common.rundir import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from recipe import run_summary

    small, qwen = _runs(tmp_path)
    s = run_summary(small)
    assert s["tau_row"] == SERVE and s["tau_by_benchmark"] == {"heldout": 2.3371, "mt_bench": 2.5689}
    assert s["speedup_by_concurrency"] == {"1": 1.3043, "4": 0.9563, "16": 0.8184}
    assert s["stage_seconds"] == {"02": 40.0, "05": 100.0, "06": 60.0} and s["gpu_seconds"] == 200.0
    assert s["val_eal"] == 2.5 and s["train_tokens"] is None  # no draft/result.json: stage 05's manifest alone
    assert run_summary(qwen)["tau_by_benchmark"] == {"heldout": 2.9, "mt_bench": 3.1, "alpaca_eval": 2.7}
    assert s["tau_heldout_by"] is None  # no held-out groups recorded
    embedded_only = _write_run(tmp_path / "embedded", [2, 15, 27, 30], 2.0, {"05": 10.0}, {
        "by_method": {EMBEDDED: _acc(1.9)},
        "tau_by_benchmark": {"mt_bench": {"by_method": {EMBEDDED: _acc(2.2)}}},
        "held_out_groups": {"by": "source", "groups": {
            "bundled": {"prompts": 3, "by_method": {EMBEDDED: _acc(1.6)}},
            "sharegpt": {"prompts": 1, "by_method": {EMBEDDED: _acc(2.8)}}}}})
    s = run_summary(embedded_only)
    assert s["tau_row"] == EMBEDDED and s["tau_by_benchmark"] == {"heldout": 1.9, "mt_bench": 2.2}
    assert s["tau_heldout_by"] == {"by": "source", "tau": {"bundled": 1.6, "sharegpt": 2.8}}
    assert run_summary(tmp_path / "nothing")["tau_by_benchmark"] == {}  # no stage 06: no τ, no error


def test_compare_says_when_runs_asked_different_held_out_prompts(tmp_path):
    """Stage 06's held_out_digest: runs on the same held-out prompts compare as they are; different prompts, or one
    run that recorded its prompts beside one that predates the digest, get one line that says which held-out τ do
    not compare (the benchmarks' questions are the same)."""
    from eagle3lib.evaluate.compare import compare_runs

    def run(name: str, digest: str | None) -> Path:
        return _write_run(tmp_path / name, [2, 15, 27, 30], 2.0, {"05": 10.0},
                          {"by_method": {SERVE: _acc(1.5)}, **({"held_out_digest": digest} if digest else {})})

    same = [run("a", "0123abcd"), run("b", "0123abcd")]
    assert "held-out prompts differ" not in compare_runs(same)
    other = run("c", "feedbeef")
    text = compare_runs([*same, other])
    assert "**The held-out prompts differ or are not known to match** (stage 06's held_out_digest: a, b: 0123abcd; " \
           "c: feedbeef)" in text
    old = run("old", None)
    assert "old: not recorded" in compare_runs([same[0], old])
    assert "held-out prompts differ" not in compare_runs([old, run("old2", None)])  # as before the digest


def test_compare_says_when_runs_measured_their_servers_differently(tmp_path):
    """Stage 06's serve sweep records whether its servers shared the GPU (`side_by_side`): runs measured the same way
    compare as they are; one side by side beside one alone gets one line naming which was which."""
    from eagle3lib.evaluate.compare import compare_runs

    def run(name: str, side_by_side: bool) -> Path:
        return _write_run(tmp_path / name, [2, 15, 27, 30], 2.0, {"05": 10.0}, {
            "by_method": {SERVE: _acc(1.5)},
            "serve": {"speedup_by_concurrency": {"1": 1.1}, "side_by_side": side_by_side}})

    alone = run("alone", False)
    assert "measured differently" not in compare_runs([alone, run("alone2", False)])
    text = compare_runs([alone, run("shared", True)])
    assert ("**The servers were measured differently**: side by side on one GPU in shared; each alone in alone. "
            "Their ×c=N columns do not compare") in text

