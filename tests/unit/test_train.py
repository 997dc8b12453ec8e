"""Stage 05 on the CPU with the real speculators 0.9 Trainer: it learns, checkpoints, resumes, reloads, and the
checkpoint's config is what vLLM's eagle3 loader expects; plus the speculators-Trainer-on-CPU patch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eagle3lib import train
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import RunDir, StageRun
from eagle3lib.common.stages import get_stage

TRAIN_OVERRIDES = {"epochs": 2, "packing_length": 256, "lr": 3e-3}


def with_train(cfg, **updates):
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=updates)})


@pytest.fixture
def trained_run(tiny_run):
    """The tiny run with stage 04 done by the real eagle3lib.verifier, then stage 05 trained for 2 epochs."""
    from eagle3lib import verifier

    cfg, rd = tiny_run
    stage04 = StageRun(get_stage("04"), cfg, rd)
    stage04.finish(verifier.run(stage04, check_speculators=False))
    cfg = with_train(cfg, **TRAIN_OVERRIDES)
    rd = RunDir(rd.root, cfg)
    result = train.train(rd, progress=False)["eagle3"]
    return cfg, rd, result


def test_cpu_patch_detect_apply_idempotent_revert():
    import speculators.train.checkpointer as ckpt
    import speculators.train.trainer as trainer

    from eagle3lib.compat import PATCHES, apply_patch, revert_patch
    from eagle3lib.compat.speculators_trainer_cpu import NAME

    patch = PATCHES[NAME]
    assert patch.detect() is True  # this machine has no accelerator: the Trainer would pick "cuda"
    revert_patch(NAME)
    import speculators.train.distributed as distributed

    originals = (trainer.get_local_rank, torch.accelerator.synchronize, ckpt.get_current_device,
                 distributed.maybe_setup_distributed)
    # (whether the original torch.accelerator.synchronize raises here depends on what else this process imported:
    # after vLLM's CPU platform loads it may not, so only the replacement and its revert are asserted)
    assert apply_patch(NAME) and apply_patch(NAME)  # idempotent
    assert torch.accelerator.synchronize is not originals[1]
    assert trainer.get_local_rank() == "cpu" and ckpt.get_current_device() == "cpu"
    torch.accelerator.synchronize()  # no longer raises
    t = object.__new__(trainer.Trainer)
    t.device_type = "cuda"  # what Trainer.__init__ assigns without an accelerator
    assert t.device_type == "cpu"
    revert_patch(NAME)
    assert (trainer.get_local_rank, torch.accelerator.synchronize, ckpt.get_current_device,
            distributed.maybe_setup_distributed) == originals
    assert "device_type" not in trainer.Trainer.__dict__
    revert_patch(NAME)  # reverting twice is harmless


def test_auto_settings_on_cpu_and_refusals():
    from eagle3lib.common.config import TrainSection

    res = train.resolve_settings(TrainSection(), "cpu")
    assert (res.attn_impl, res.loss_implementation, res.hidden_states_dtype) == ("sdpa", "eager", "float32")
    assert res.num_workers == 0 and len(res.reasons) == 5
    # the optimizer: speculators' CLI default (muon) on a GPU, AdamW on a CPU; a setting other than auto is kept
    assert res.optimizer == "adamw" and any(r.startswith("optimizer adamw: ") for r in res.reasons)
    gpu = train.resolve_settings(TrainSection(), "cuda")
    assert gpu.optimizer == "muon" and any(r.startswith("optimizer muon: ") for r in gpu.reasons)
    assert train.resolve_settings(TrainSection(optimizer="muon"), "cpu").optimizer == "muon"
    assert train.resolve_settings(TrainSection(optimizer="adamw"), "cuda").optimizer == "adamw"
    ok, why = train.probe_fused_loss("cpu")
    assert not ok and "CUDA" in why
    with pytest.raises(WorkbookError, match="loss_implementation=fused needs a GPU"):
        train.resolve_settings(TrainSection(loss_implementation="fused"), "cpu")
    with pytest.raises(WorkbookError, match="flex_attention needs a GPU"):
        train.resolve_settings(TrainSection(draft_attn_impl="flex_attention"), "cpu")


def test_train_ratio_lands_on_stage02_boundary():
    for n in range(2, 400):
        for train_rows in range(1, n):
            inp = train.TrainInputs(None, train_rows, n - train_rows, [], 0, None, None, None, None, 0)  # type: ignore
            assert int(n * inp.train_ratio) == train_rows


def test_trains_checkpoints_resumes_and_reloads(trained_run, tmp_path):
    cfg, rd, result = trained_run
    k = cfg.train.ttt_steps
    # learned: validation expected acceptance length above the untrained draft's
    assert result["val_eal_untrained"] is not None
    untrained = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())["val"][0]
    assert untrained["epoch"] == -1 and all(untrained[f"loss_{s}"] > 0 for s in range(k))  # measured, not defaults
    assert result["val_eal"] > result["val_eal_untrained"]
    # where stage 05's time goes: every part measured, the epochs at least the steps they hold
    phases = result["phase_seconds"]
    assert list(phases) == ["check_shards", "loaders", "build_draft", "trainer_init", "untrained_validation",
                            "epochs", "finalize"] and min(phases.values()) >= 0
    assert phases["epochs"] >= result["train_seconds"] - 0.05
    curves = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())
    assert [v["epoch"] for v in curves["val"]] == [-1, 0, 1]
    step = curves["steps"][-1]
    for s in range(k):
        assert {f"loss_{s}", f"full_acc_{s}", f"cond_acc_{s}"} <= set(step)
    assert step["eal"] == pytest.approx(1 + sum(step[f"full_acc_{s}"] for s in range(k)))
    assert len(curves["train_epochs"]) == 2 and result["global_step"] == len(curves["steps"])
    fig_path = rd.figure_path("05", "curves")
    train.plot_curves(curves, fig_path)
    assert fig_path.stat().st_size > 10_000

    # the checkpoint: what vLLM's eagle3 loader reads, and speculators reloads it with the trained weights
    ckpt = rd.path("draft", "eagle3", "checkpoints", "1")
    assert result["checkpoint"] == str(ckpt)
    m02, m04 = rd.read_manifest("02")["metrics"], rd.read_manifest("04")["metrics"]
    check = dict(hidden_size=m02["hidden_size"], aux_layer_ids=m02["layer_ids"][:-1],
                 draft_vocab_size=m04["draft_vocab_size"], draft_tokens=k, target_vocab_size=m02["vocab_size"])
    assert train.check_vllm_config(ckpt, **check) == []
    assert train.check_vllm_config(ckpt, **{**check, "draft_tokens": k + 1})  # the check can fail
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "model.safetensors"))
    model = train.reload_checkpoint(ckpt)
    assert torch.equal(model.fc.weight.to(saved["fc.weight"].dtype), saved["fc.weight"])
    assert not model.verifier_lm_head.weight.isnan().any()

    # resume: one more epoch continues from checkpoint 1, history kept
    per_epoch = result["global_step"] // 2
    result2 = train.train(RunDir(rd.root, with_train(cfg, **{**TRAIN_OVERRIDES, "epochs": 3})),
                          progress=False)["eagle3"]
    assert result2["global_step"] == result["global_step"] + per_epoch
    assert result2["checkpoint"].endswith("/2") and result2["epochs_done"] == 3
    curves2 = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())
    assert [v["epoch"] for v in curves2["val"]] == [-1, 0, 1, 2]
    assert [s["step"] for s in curves2["steps"]] == list(range(1, result2["global_step"] + 1))

    # a half-written epoch folder (killed during a save) is dropped; another recipe is refused, a longer run is not
    save = rd.path("draft", "eagle3", "checkpoints")
    (save / "9").mkdir()
    (save / "9" / "config.json").write_text("{}")
    n_draft = rd.read_manifest("04")["metrics"]["draft_vocab_size"]
    assert train.prepare_checkpoint_dir(save, with_train(cfg, **TRAIN_OVERRIDES).train, n_draft) == ["9"]
    assert not (save / "9").exists()
    with pytest.raises(WorkbookError, match=r"other settings \(lr changed\)"):
        train.prepare_checkpoint_dir(save, with_train(cfg, **{**TRAIN_OVERRIDES, "lr": 1e-3}).train, n_draft)
    assert train.prepare_checkpoint_dir(save, with_train(cfg, **{**TRAIN_OVERRIDES, "epochs": 9}).train, n_draft) == []

    # the run directory moves: the checkpoint still loads (its verifier is the target, outside the run dir)
    moved = tmp_path / "elsewhere"
    shutil.move(str(rd.root), moved)
    assert train.reload_checkpoint(moved / "draft" / "eagle3" / "checkpoints" / "2") is not None


def test_walk_counts_the_steps_a_decoder_takes():
    """τ by walking (eagle3lib.train.walk): a step from anchor p moves 1 + its chain, never past the reply's end;
    the uniform mean weighs the easy half as much as the hard one, a decoder crosses it in a quarter of the steps."""
    from eagle3lib.train.walk import walk

    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    chain = torch.tensor([3, 3, 3, 3, 3, 0, 0, 0, 0, 3, 3, 3])
    # reply 1 (8 tokens): 1 -> 5 -> 6 -> 7 -> 8 -> end: 5 steps; reply 2 (2 tokens): a chain of 3 capped at 1
    assert walk(chain, mask) == (10, 6)
    easy_then_hard = torch.tensor([3] * 8 + [0] * 8)
    tokens, steps = walk(easy_then_hard, torch.ones(16, dtype=torch.bool))
    assert (tokens, steps) == (16, 10) and 1 + easy_then_hard.float().mean() == 2.5  # τ 1.6 against EAL 2.5


def test_tau_by_walking_reads_speculators_own_chains(trained_run):
    """The chains the walk steps through are speculators' own: from one validation batch, the anchors whose chain
    reaches step s give exactly its full_acc_s count; stage 05 records τ_walk beside validation EAL."""
    from speculators.losses import resolve_loss_config

    from eagle3lib.train import inputs_from_run, make_loaders, resolve_settings
    from eagle3lib.train.walk import WalkRecorder, chains

    cfg, rd, result = trained_run
    k = cfg.train.ttt_steps
    model = train.reload_checkpoint(result["checkpoint"]).float().eval()
    _, val_loader = make_loaders(inputs_from_run(rd), cfg.train, resolve_settings(cfg.train))
    batch = {key: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for key, v in next(iter(val_loader)).items()}
    with torch.no_grad(), WalkRecorder(model) as rec:  # speculators' eager loss: the fused one needs Triton
        draft_tokens, _, metrics = model(**batch, ttt_steps=k, loss_config=resolve_loss_config(cfg.train.loss or "kl_div", "eager"))
    targets = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"]))
    chain, mask = chains(draft_tokens, targets, batch["loss_mask"]), batch["loss_mask"][0].bool()
    n = mask.shape[0]
    for s in range(k):
        reached = (chain[: n - s] >= s + 1) & mask[s:]
        assert int(reached.sum()) == int(metrics[f"full_acc_{s}_sum"])
        assert int(mask[s:].sum()) == int(metrics[f"full_acc_{s}_total"])
    assert "forward" not in vars(model)  # the recorder leaves the model as it found it
    model.forward = own = model.forward  # an instance that holds a forward of its own keeps it
    with WalkRecorder(model):
        assert vars(model)["forward"] is not own
    assert vars(model)["forward"] is own
    walked = rec.metrics()
    assert walked["walk_tokens"] == int(mask.sum()) and 1.0 <= walked["tau_walk"] <= 1 + k
    assert walked["eal_uniform"] == pytest.approx(1 + int(chain[mask].sum()) / int(mask.sum()))
    # stage 05 recorded it at every validation, beside EAL, and in result.json
    curves = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())
    assert all(1.0 <= v["tau_walk"] <= 1 + k for v in curves["val"])
    assert all(v["eal_uniform"] == pytest.approx(v["eal"], abs=0.05) for v in curves["val"])
    assert result["val_tau_walk"] == curves["val"][-1]["tau_walk"]
    # and how long each validation took, the untrained draft's first (why: docs/stages.md, 05 Training the draft)
    assert result["val_seconds"] == [round(v["val_seconds"], 2) for v in curves["val"]]
    assert curves["val"][0]["epoch"] == -1 and all(v["val_seconds"] > 0 for v in curves["val"])


def test_train_fraction_trains_on_the_first_share_of_the_rows(trained_run, tmp_path):
    """train.train_fraction: stage 05 trains on the first half of stage 02's training rows (a data-volume curve's
    point from the same extraction), validates on all the validation rows, and says so in result.json."""
    from datasets import load_from_disk

    from eagle3lib.common.rundir import fork_run

    cfg, rd, full = trained_run
    n_train = rd.read_manifest("02")["metrics"]["train_rows"]
    half_cfg = with_train(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "half"})}),
                          train_fraction=0.5)
    half_rd = RunDir(fork_run(rd.root, rd.root.parent / "half"), half_cfg)
    half = train.train(half_rd, progress=False)["eagle3"]
    assert full["train_rows"] == n_train and half["train_rows"] == -(-n_train // 2)
    lengths = list(load_from_disk(str(rd.output("02", "dataset"))).with_format(None)["seq_len"])
    # every row once per epoch, each less the one token the shift to next-token targets drops
    assert full["train_tokens"] == cfg.train.epochs * sum(n - 1 for n in lengths[:n_train])
    assert half["train_tokens"] == cfg.train.epochs * sum(n - 1 for n in lengths[:half["train_rows"]])
    # the same validation rows: the untrained draft (same seed) scores the same on them in both runs
    untrained = [json.loads(r.path("draft", "eagle3", "curves.json").read_text())["val"][0] for r in (rd, half_rd)]
    assert untrained[0]["epoch"] == untrained[1]["epoch"] == -1 and untrained[0]["loss"] == untrained[1]["loss"]


def test_torchrun_accepts_the_multi_gpu_command():
    """The command notebook 05 and the README give for several GPUs, through the real torchrun launcher, ends in our
    own argument parser. (`--run` did not: torchrun rejects it as an ambiguous prefix of its --run-path, which a GPU
    run found only after the stages before it had run.)"""
    import subprocess
    import sys
    from pathlib import Path

    cmd = train.launch_command("configs/demo.yaml", "some-run", ["train.epochs=1"], 1) + ["--help"]
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), *cmd[1:]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--run-name" in proc.stdout and "usage: torchrun" not in proc.stderr
    bad = [str(torchrun), *[("--run" if a == "--run-name" else a) for a in cmd[1:]]]  # the test can fail
    assert "ambiguous option: --run" in subprocess.run(bad, capture_output=True, text=True, timeout=120).stderr


@pytest.mark.slow
def test_stage_05_under_torchrun_with_two_processes(tiny_run, tmp_path):
    """The multi-GPU command, as notebook 05 and the README give it, with 2 CPU processes (gloo): speculators' DDP
    path end to end. Each rank takes half of the packed batches, rank 0 writes the checkpoint, curves and manifest."""
    import subprocess
    import sys
    from pathlib import Path

    from eagle3lib import verifier

    cfg, rd = tiny_run
    stage04 = StageRun(get_stage("04"), cfg, rd)
    stage04.finish(verifier.run(stage04, check_speculators=False))
    config = tmp_path / "tiny.yaml"
    config.write_text(with_train(cfg, **{**TRAIN_OVERRIDES, "epochs": 1, "packing_length": 96}).to_yaml())
    cmd = train.launch_command(str(config), None, [], 2)
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), *cmd[1:]], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(rd.path("draft", "eagle3", "result.json").read_text())
    curves = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())
    # one process on a copy of the run: each of the 2 ranks took half of its batches
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import fork_run

    single_cfg = load_config(config, [f"run.name={rd.root.name}-single"])
    single = train.train(RunDir(fork_run(rd.root, rd.root.parent / f"{rd.root.name}-single"), single_cfg),
                         progress=False)["eagle3"]
    assert single["global_step"] >= 4 and result["global_step"] == len(curves["steps"]) == single["global_step"] // 2
    assert [v["epoch"] for v in curves["val"]] == [-1, 0]
    assert rd.manifest_path(get_stage("05")).is_file()
    assert train.reload_checkpoint(result["checkpoint"]).fc.weight.shape[1] == 3 * 64



@pytest.mark.slow
def test_a_process_without_validation_batches_is_one_clear_error(tmp_path, tiny_llama_dir):
    """One validation row for 2 torchrun processes: the rank that gets no batch says so (split, rows, rank) instead
    of failing later or leaving the other rank waiting; with no validation rows at all, stage 05 names the fix."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from eagle3lib import verifier
    from tests.conftest import make_tiny_run

    for n_val in (0, 1):
        cfg, rd = make_tiny_run(tmp_path / f"outputs{n_val}", tiny_llama_dir, n_val=n_val)
        stage04 = StageRun(get_stage("04"), cfg, rd)
        stage04.finish(verifier.run(stage04, check_speculators=False))
    cfg = with_train(cfg, **{**TRAIN_OVERRIDES, "epochs": 1, "packing_length": 96})
    with pytest.raises(WorkbookError, match="no validation rows.*data.val_fraction > 0"):
        train.train(RunDir(tmp_path / "outputs0" / "tiny", cfg), progress=False)
    config = tmp_path / "tiny.yaml"
    config.write_text(cfg.to_yaml())
    cmd = train.launch_command(str(config), None, [], 2)
    proc = subprocess.run([str(Path(sys.executable).with_name("torchrun")), *cmd[1:]], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "the val split (rows: 1) gives this process (rank 1 of 2) no batch" in proc.stderr, proc.stderr[-3000:]
    assert not rd.path("draft", "eagle3", "result.json").exists()


def test_every_speculators_training_option_trains_a_draft(tiny_run):
    """The options cfg.train passes to speculators' own TrainConfig and Trainer (muon, its settings, the loss, the
    schedule and its warm-up share, the TTT decay, the draft's norms) train a tiny draft that learns, and each one
    reaches speculators: its resolved run.yaml, the optimizers it built and the learning rate per step say so."""
    from speculators.train.config import TrainConfig

    from eagle3lib import verifier

    cfg, rd = tiny_run
    stage04 = StageRun(get_stage("04"), cfg, rd)
    stage04.finish(verifier.run(stage04, check_speculators=False))
    # (muon at AdamW's 3e-3 barely moves this tiny draft in a few steps: its Muon group gets a larger rate)
    options = dict(optimizer="muon", muon_lr=0.1, muon_momentum=0.9, muon_weight_decay=0.05, muon_ns_steps=4,
                   muon_adjust_lr_fn="original", loss="rkl", ttt_step_loss_decay=0.8, scheduler="linear",
                   warmup_steps=None, warmup_ratio=0.25, norm_before_fc=False, fc_norm=True, norm_output=False,
                   norm_before_residual=False, embed_requires_grad=True, weight_decay=0.01)
    cfg = with_train(cfg, **{**TRAIN_OVERRIDES, "epochs": 5}, **options)
    result = train.train(RunDir(rd.root, cfg), progress=False)["eagle3"]
    assert result["val_eal"] > result["val_eal_untrained"]
    assert result["optimizers"] == ["Muon", "AdamW"]
    # speculators' own record of the run (run.yaml, read back by its own resolver as `--config` would)
    flat = TrainConfig.resolve(["--config", str(rd.path("draft", "eagle3", "checkpoints", "run.yaml"))]).flatten()
    expected = {**{k: v for k, v in options.items() if k not in ("loss", "scheduler", "warmup_steps",
                                                                 "warmup_ratio")},
                "loss_fn": "rkl", "scheduler_type": "linear", "scheduler_warmup_ratio": 0.25,
                "scheduler_warmup_steps": None}
    assert {k: flat.get(k) for k in expected} == expected
    # the learning rate per step, per optimizer as speculators logs it: a linear warm-up over the first quarter,
    # then a linear decay, Muon's from train.muon_lr and AdamW's from train.lr
    steps = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())["steps"]
    assert max(s["lr"]["AdamW"] for s in steps) == pytest.approx(TRAIN_OVERRIDES["lr"])
    lrs = [s["lr"]["Muon"] for s in steps]
    peak = lrs.index(max(lrs))
    assert max(lrs) <= 0.1 + 1e-9 and 0 < peak < len(lrs) - 1
    assert lrs[:peak + 1] == sorted(lrs[:peak + 1]) and lrs[peak:] == sorted(lrs[peak:], reverse=True)
