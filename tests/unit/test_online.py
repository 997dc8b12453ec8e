"""Online hidden states (train.hidden_states: online, eagle3lib.train.online): stage 05 gets each batch's states from
the target through stage 02's own capture backend, and what it trains on equals stage 02's shards of the same rows.

On the CPU in fp32 with the tiny random Llama (tests/conftest.py). Tolerances: the same rows captured in the same
batch composition (one row per forward on both sides, extract.batch_tokens = the row length) are bitwise equal;
captured in other compositions (a whole packed batch in one forward, or conftest's 16-row reference forward) they
differ by fp32 rounding only: max abs diff <= 1e-5 x max |value|.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3lib import inspect_tensors, train
from eagle3lib.common import shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import RunDir, StageRun
from eagle3lib.common.stages import get_stage
from eagle3lib.extract import capture
from eagle3lib.train.inputs import check_shards
from tests.conftest import make_tiny_run, stage02_inputs, stage02_shards

SEQ = 48
TRAIN = {"epochs": 2, "packing_length": 256, "lr": 3e-3}
ROUNDING = 1e-5  # max abs diff / max |value| between captures of the same rows in different batch compositions


def _with_train(cfg, **updates):
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=updates)})


def _batches(rd, online: bool, cfg=None):
    """Every train batch of one epoch through the real loaders, and the transfer (online) that made them."""
    from eagle3lib.train.online import make_transfer

    cfg = cfg or rd.cfg
    res = train.resolve_settings(cfg.train, "cpu")
    inp = stage02_inputs(rd)
    transfer = make_transfer(cfg, inp, res) if online else None
    loader, _ = train.make_loaders(inp, cfg.train, res, seed=0, transfer=transfer)
    loader.batch_sampler.set_epoch(0)
    try:
        return [dict(b) for b in loader], transfer
    finally:
        if transfer is not None:
            transfer.close()


def test_online_batches_equal_stage_02_shards(tmp_path, tiny_llama_dir):
    """(a) One epoch of train batches, online and from stage 02's shards of the same rows: the same batches in the same
    order, every tensor bitwise equal when both captured one row per forward; within fp32 rounding when the online
    side captures each packed batch in one forward, and against conftest's 16-row reference forward."""
    one_row = (f"extract.batch_tokens={SEQ}",)
    cfg_off, rd_off = make_tiny_run(tmp_path / "off", tiny_llama_dir, dtype="float32", overrides=one_row)
    reference = {i: shards.read_shard(shards.shard_path(rd_off.path("dataset"), i))["hidden_states"] for i in range(16)}
    stage02_shards(cfg_off, rd_off)
    cfg_on, rd_on = make_tiny_run(tmp_path / "on", tiny_llama_dir, dtype="float32", hidden_states="online", overrides=one_row)
    cfg_on = cfg_on.model_copy(update={"train": cfg_on.train.model_copy(update={"packing_length": 256})})
    cfg_off = cfg_off.model_copy(update={"train": cfg_off.train.model_copy(update={"packing_length": 256})})

    offline, _ = _batches(rd_off, online=False, cfg=cfg_off)
    online, transfer = _batches(rd_on, online=True, cfg=cfg_on)
    assert len(offline) == len(online) >= 3
    assert transfer.tokens == 12 * SEQ  # every train row once, nothing captured twice
    for b_off, b_on in zip(offline, online, strict=True):
        assert b_on.keys() == b_off.keys()
        for k, v in b_off.items():
            if isinstance(v, torch.Tensor):
                assert b_on[k].device == v.device and b_on[k].dtype == v.dtype, k
                assert torch.equal(b_on[k], v), k  # bitwise: the same capture, the same composition
            else:
                assert b_on[k] == v, k

    assert transfer.forwards == 12  # one row per forward, the epoch's rows captured together (batches ahead: 16)

    # other compositions: every batch of the epoch in one forward (train.online_batches_ahead 16, the default), each
    # packed batch in one forward (1); conftest's reference (all 16 rows at once)
    cfg_big = cfg_on.model_copy(update={"extract": cfg_on.extract.model_copy(update={"batch_tokens": 8192})})
    for ahead, forwards in ((16, 1), (1, len(offline))):
        batched, transfer = _batches(rd_on, online=True, cfg=_with_train(cfg_big, online_batches_ahead=ahead))
        assert (transfer.forwards, transfer.tokens) == (forwards, 12 * SEQ), ahead
        assert transfer.padded_tokens == 12 * SEQ  # rows of one length: nothing to pad
        for b_off, b_on in zip(offline, batched, strict=True):
            x, y = b_off["hidden_states"], b_on["hidden_states"]
            assert torch.equal(b_on["input_ids"], b_off["input_ids"])
            assert (x - y).abs().max() <= ROUNDING * x.abs().max()
    for i in range(16):
        ours = shards.read_shard(shards.shard_path(rd_off.path("dataset"), i))["hidden_states"]
        assert (ours - reference[i]).abs().max() <= ROUNDING * reference[i].abs().max()


def test_online_and_offline_training_take_the_same_steps(tmp_path, tiny_llama_dir):
    """(b) The same tiny run trained online and offline (same seed and settings): the same batches (tokens) in the
    same order, the same loss per step within 1e-5, and validation before and after training alike. Stage 02 of the
    online run wrote 4 sample shards only; stage 03 validates exactly those and says so; stage 05 skips the rest."""
    from eagle3lib import verifier

    curves, results = {}, {}
    for mode in ("offline", "online"):
        cfg, rd = make_tiny_run(tmp_path / mode, tiny_llama_dir, dtype="float32", hidden_states=mode,
                                overrides=("extract.online_sample_rows=4",))
        stage04 = StageRun(get_stage("04"), cfg, rd)
        stage04.finish(verifier.run(stage04, check_speculators=False))
        if mode == "online":
            written = sorted(int(p.stem[3:]) for p in shards.shard_dir(rd.path("dataset")).glob("hs_*.safetensors"))
            assert written == capture.online_sample_rows(12, 4, 4) == [0, 1, 2, 12]
            res03 = inspect_tensors.scan_stage(StageRun(get_stage("03"), cfg, rd))
            assert res03.metrics["shards"] == 4 and res03.metrics["invalid"] == 0
            assert res03.inspection.mode.startswith("online: the 4 sample shards stage 02 wrote")
        cfg = _with_train(cfg, **TRAIN)
        results[mode] = train.train(RunDir(rd.root, cfg), progress=False)["eagle3"]
        curves[mode] = json.loads(rd.path("draft", "eagle3", "curves.json").read_text())
    off, on = curves["offline"]["steps"], curves["online"]["steps"]
    assert len(off) == len(on) >= 6
    for a, b in zip(off, on, strict=True):
        assert (a["step"], a["epoch"], a["tokens"]) == (b["step"], b["epoch"], b["tokens"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), a["step"]
    for a, b in zip(curves["offline"]["val"], curves["online"]["val"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    target = results["online"]["online_target"]
    assert results["online"]["hidden_states"] == "online" and target["tokens"] > 0
    assert target["padded_tokens"] >= target["tokens"] and 0 < target["forwards"] and target["batches_ahead"] == 16
    assert results["online"]["val_eal"] > results["online"]["val_eal_untrained"]


def test_online_refuses_workers_and_a_target_that_does_not_fit(tmp_path, tiny_llama_dir, monkeypatch):
    """(c) Each bad input is one WorkbookError naming the fix, raised before stage 05 writes anything."""
    from eagle3lib.common import device as devices
    from eagle3lib.common.config import TrainSection
    from eagle3lib.extract.backends.transformers_backend import target_bytes

    with pytest.raises(WorkbookError, match="online needs train.num_workers 0, got 2") as e:
        train.resolve_settings(TrainSection(hidden_states="online", num_workers=2), "cpu")
    assert "train.num_workers: auto" in e.value.fix
    res = train.resolve_settings(TrainSection(hidden_states="online"), "cpu")
    assert res.num_workers == 0 and any("online hidden states" in r for r in res.reasons)

    from eagle3lib import verifier

    cfg, rd = make_tiny_run(tmp_path, tiny_llama_dir, dtype="float32", hidden_states="online")
    stage04 = StageRun(get_stage("04"), cfg, rd)
    stage04.finish(verifier.run(stage04, check_speculators=False))
    with pytest.raises(WorkbookError, match="num_workers 0"):
        train.train(RunDir(rd.root, _with_train(cfg, **TRAIN, num_workers=2)), progress=False)
    # the target's fp32 weights against a device with less free memory than they take (our own free-memory probe
    # reports a small number: the CPU box has plenty)
    need = target_bytes(tiny_llama_dir, torch.float32)
    monkeypatch.setattr(devices, "free_bytes", lambda device: need)
    with pytest.raises(WorkbookError, match=r"online loads the target .* on the training device cpu") as e:
        train.train(RunDir(rd.root, _with_train(cfg, **TRAIN)), progress=False)
    assert "train.hidden_states: offline" in e.value.fix
    assert not rd.path("draft").exists()  # nothing written, nothing lost
    # offline training from an online stage 02 is refused: stage 02's manifest records train.hidden_states
    with pytest.raises(WorkbookError, match=r"stage 02_extract_hidden_states .* different config .*train.hidden_states"):
        train.inputs_from_run(RunDir(rd.root, cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"hidden_states": "offline"})})))


def test_stage_02_online_writes_only_the_sample_rows(tmp_path, tiny_llama_dir):
    """capture.extract with the online sample rows: those shards and the table, nothing else; the rule takes the
    first train rows and the first validation rows in proportion."""
    assert capture.online_sample_rows(900, 100, 64) == list(range(58)) + list(range(900, 906))
    assert capture.online_sample_rows(10, 0, 4) == [0, 1, 2, 3]
    assert capture.online_sample_rows(12, 4, 64) == list(range(16))
    assert capture.online_sample_rows(50, 1, 4) == [0, 1, 2, 50]
    cfg, rd = make_tiny_run(tmp_path, tiny_llama_dir, dtype="float32", hidden_states="online",
                            overrides=("extract.online_sample_rows=3",))
    from datasets import load_from_disk

    dataset = rd.path("dataset")
    for p in shards.shard_dir(dataset).glob("hs_*.safetensors"):
        p.unlink()
    ds = load_from_disk(str(dataset)).with_format(None)
    m = rd.read_manifest("02")["metrics"]
    assert m["shard_rows"] == [0, 1, 12] and shards.shard_rows(m, 16) == [0, 1, 12]
    ext = capture.extract(cfg, dataset, tiny_llama_dir, m["layer_ids"], m["hidden_size"], ds["input_ids"],
                          ds["loss_mask"], progress=False, shard_rows=m["shard_rows"])
    assert ext["computed_shards"] == 3
    assert sorted(p.name for p in shards.shard_dir(dataset).glob("*")) == [f"hs_{i}.safetensors" for i in (0, 1, 12)]
    check_shards(stage02_inputs(rd), shards.spec_from_metrics(m))  # the 13 rows without a shard are not an error
    shards.shard_path(dataset, 12).unlink()
    with pytest.raises(WorkbookError, match=r"1 of 3 hidden-state shards .* are invalid \(rows \[12\]\)"):
        check_shards(stage02_inputs(rd), shards.spec_from_metrics(m))
