"""benchmarks/peers.py's arms on the CPU: speculators' own `speculators train` (its CLI, its defaults) trains on the
workbook's FP8 shards of a forked run (through speculators' fp8 hidden-states backend), its draft becomes the fork's
stage 05 and stage 06's inputs find it; a workbook variant arm trains its fork with its overrides; the harness's
JSON reads the arms back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eagle3lib.common.rundir import RunDir, StageRun
from eagle3lib.common.stages import get_stage

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_speculators_cli_arm_trains_on_the_workbooks_shards(tiny_llama_dir, out_root, monkeypatch, tmp_path):
    from speculators.train.config import TrainConfig

    from eagle3lib import evaluate, train, verifier
    from eagle3lib.common.config import load_config

    sys.path.insert(0, str(REPO / "benchmarks"))
    import peers

    from tests.conftest import make_tiny_run

    cfg, rd = make_tiny_run(out_root, tiny_llama_dir, fp8=True)  # FP8 shards: speculators' fp8 backend reads them
    stage04 = StageRun(get_stage("04"), cfg, rd)
    stage04.finish(verifier.run(stage04, check_speculators=False))
    monkeypatch.chdir(REPO)

    fork = peers.train_arm(rd.root, "speculators_cli")  # the fork runs with the run's own config.yaml
    frd = RunDir(fork, load_config(fork / "config.yaml", [f"run.name={fork.name}"]))
    # speculators' defaults, not the workbook's: its optimizer (muon), its learning rate and seed; the run's rows
    flat = TrainConfig.resolve(["--config", str(fork / "draft" / "eagle3" / "checkpoints" / "run.yaml")]).flatten()
    assert (flat["optimizer"], flat["lr"], flat["seed"], flat["epochs"]) == ("muon", 1e-3, 42, cfg.train.epochs)
    assert flat["train_data_ratio"] == pytest.approx(train.inputs_from_run(frd).train_ratio)
    assert flat["data_path"] == str(frd.output("02", "dataset")) and flat["hidden_states_backend"] == "fp8"
    # its draft is the fork's stage 05: reloadable, with speculators' own validation metrics
    m05 = frd.read_manifest("05")
    ckpt = frd.output("05", "checkpoint_eagle3")
    assert ckpt.name == str(cfg.train.epochs - 1) and train.reload_checkpoint(ckpt) is not None
    assert 1.0 <= m05["metrics"]["eagle3"]["val_eal"] <= 1.0 + cfg.train.ttt_steps
    assert m05["metrics"]["eagle3"]["trained_by"] == "speculators train" and m05["metrics"]["eagle3"]["global_step"] > 0
    stage06 = StageRun(get_stage("06"), frd.cfg, frd)
    assert evaluate.inputs.inputs_from_run(stage06).checkpoint == ckpt
    # the base run (the workbook arm) is untouched: no draft of its own yet
    assert not rd.path("draft").exists()

    # the workbook with AdamW, its optimizer before it took the CLI's defaults: its own stage 05 on another fork, the
    # overrides recorded
    variant = peers.train_arm(rd.root, "workbook_adamw")
    vrd = RunDir(variant, load_config(variant / "config.yaml", [f"run.name={variant.name}"]))
    assert (vrd.cfg.train.optimizer, vrd.cfg.train.scheduler, vrd.cfg.train.warmup_steps) == ("adamw", "cosine", 100)
    assert json.loads((variant / "draft" / "eagle3" / "result.json").read_text())["optimizers"] == ["AdamW"]

    out = tmp_path / "peers.json"
    result = peers.report(rd.root, ["speculators_cli", "workbook_adamw", "workbook_epochs_x2"], out, "tiny CPU check")
    arm = result["arms"]["speculators_cli"]
    assert arm["val_eal"] == m05["metrics"]["eagle3"]["val_eal"] and arm["train_tokens"] > 0
    assert result["arms"]["workbook_adamw"]["optimizers"] == ["AdamW"]
    # the arms' training side by side, from the workbook's curves and from the records speculators' CLI logged
    cli_curve, adamw_curve = peers.training_curve(fork), peers.training_curve(variant)
    assert len(cli_curve["step"]) == m05["metrics"]["eagle3"]["global_step"] and len(adamw_curve["eal"]) > 0
    assert all(1.0 <= e <= 1.0 + cfg.train.ttt_steps for e in cli_curve["eal"] + adamw_curve["eal"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "skipped" in result["arms"]["specforge"] and json.loads(out.read_text())["arms"].keys() == result["arms"].keys()
    assert "workbook_epochs_x2" not in result["arms"]  # never trained: no fork
    # the workbook arm has no draft here: reported as failed, as is a fork whose training failed, with its log's
    # last line
    assert "failed" in result["arms"]["workbook"]
    (fork / "manifests" / "05_train_draft.json").unlink()
    (fork / "draft" / "eagle3" / "speculators_train.log").write_text("...\nValueError: what went wrong\n")
    failed = peers.report(rd.root, ["speculators_cli"], out, "tiny CPU check")["arms"]["speculators_cli"]
    assert "failed" in failed and "ValueError: what went wrong" in failed["failed"]
    assert out.with_suffix(".md").read_text().count("\n") == 3 + 2  # header, rule, one row per arm


def test_paired_difference_over_the_categories_both_arms_answered():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import peers

    ref = {"tau_by_category": {"mt_bench/writing": 1.8, "mt_bench/math": 2.0, "gsm8k/gsm8k": 2.2}}
    arm = {"tau_by_category": {"mt_bench/writing": 1.9, "mt_bench/math": 2.3, "humaneval/humaneval": 3.0}}
    d = peers.paired_difference(arm, ref)
    assert d["categories"] == 2 and d["mean"] == pytest.approx(0.2)
    assert d["standard_error"] == pytest.approx(0.1)  # differences 0.1 and 0.3: sd 0.1414, / sqrt(2)
    assert peers.paired_difference({"tau_by_category": {"gsm8k/gsm8k": 2.0}}, ref) is None  # one cell: no spread
