"""FP8 hidden-state shards (extract.fp8_shards): speculators' own format (hs_connectors), read back by its
FP8Transfer exactly as by the workbook, half the disk, validated by stages 02, 03 and 05, and a draft trained on
them learns like one trained on the same states in bf16."""

from __future__ import annotations

import pytest
import torch
from hs_connectors.transfer import FileTransfer, FP8Transfer

from eagle3lib import inspect_tensors, train
from eagle3lib.common import shards
from eagle3lib.common.rundir import RunDir, StageRun
from eagle3lib.common.stages import get_stage
from tests.conftest import make_tiny_run


def test_fp8_shards_are_speculators_format_and_half_the_disk(tmp_path, tiny_llama_dir):
    _, bf = make_tiny_run(tmp_path / "a", tiny_llama_dir)
    _, f8 = make_tiny_run(tmp_path / "b", tiny_llama_dir, fp8=True)
    bdir, fdir = bf.path("dataset"), f8.path("dataset")
    sizes = [sum(p.stat().st_size for p in shards.shard_dir(d).glob("*.safetensors")) for d in (bdir, fdir)]
    assert 0.45 < sizes[1] / sizes[0] < 0.6  # 1 byte per value + a 4-byte scale per token, vs 2 bytes
    spec = shards.spec_from_metrics(f8.read_manifest("02")["metrics"])
    assert spec.fp8 and spec.stored_dtype == torch.float8_e4m3fn
    assert spec.bytes_per_token() < shards.spec_from_metrics(bf.read_manifest("02")["metrics"]).bytes_per_token()
    for i in (0, 7):
        ref = FileTransfer(shards.shard_dir(bdir)).get_cached(i)["hidden_states"]  # the same states in bf16
        theirs = FP8Transfer(shards.shard_dir(fdir), dequantize_dtype=torch.bfloat16).get_cached(i)
        ours = shards.read_shard(shards.shard_path(fdir, i), torch.bfloat16)
        assert set(theirs) == {"token_ids", "hidden_states"} and torch.equal(theirs["hidden_states"],
                                                                            ours["hidden_states"])
        assert torch.equal(theirs["token_ids"], ours["token_ids"])
        # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, + the bf16 rounding of the dequantized
        # product (2^-8), + half a subnormal step (2^-10) of the token's scale (its max / 448)
        amax = ref.float().abs().amax(dim=(1, 2), keepdim=True)
        err = (ours["hidden_states"].float() - ref.float()).abs()
        assert (err <= ref.float().abs() * (2 ** -4 + 2 ** -8) + amax / 448 * 2 ** -10).all()
        cos = torch.nn.functional.cosine_similarity(ours["hidden_states"].float(), ref.float(), dim=-1)
        assert cos.min() > 0.99
    # validation: the FP8 run's own shards pass; a bf16 shard in an FP8 run (or the other way) is named as such
    assert not shards.check_shard_file(shards.shard_path(fdir, 0), None, spec)
    assert not shards.check_shard_header(shards.shard_path(fdir, 0), None, spec)
    for check in (shards.check_shard_file, shards.check_shard_header):
        found = check(shards.shard_path(bdir, 0), None, spec)
        assert found and "stored as torch.bfloat16" in found[0] and "fp8_shards: true" in found[0]
        bspec = shards.ShardSpec(spec.n_slots, spec.hidden_size, torch.bfloat16)
        assert "fp8_shards: false" in check(shards.shard_path(fdir, 0), None, bspec)[0]


def test_stage_03_validates_and_stage_05_trains_on_fp8_shards(tmp_path, tiny_llama_dir):
    """The same states (same seed) in bf16 and in FP8: stage 03 passes both with near-equal statistics; stage 05
    trains on both through speculators' data path and reaches about the same validation acceptance."""
    from eagle3lib import verifier
    from eagle3lib.evaluate.report import build_report

    results = {}
    for fp8 in (False, True):
        cfg, rd = make_tiny_run(tmp_path / str(fp8), tiny_llama_dir, fp8=fp8)
        disk = next(row for row in build_report(rd).splitlines() if row.startswith("| hidden states on disk"))
        assert ("FP8 e4m3" in disk) == fp8, disk  # the report card names the format the shards are stored in
        stage03 = StageRun(get_stage("03"), cfg, rd)
        res03 = inspect_tensors.run(stage03)  # raises on any invalid shard
        assert res03.metrics["invalid"] == 0 and res03.metrics["shards"] == 16
        stage04 = StageRun(get_stage("04"), cfg, rd)
        stage04.finish(verifier.run(stage04, check_speculators=False))
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"epochs": 2, "packing_length": 256,
                                                                           "lr": 3e-3})})
        results[fp8] = (res03, train.train(RunDir(rd.root, cfg), progress=False)["eagle3"])
    (s_bf, t_bf), (s_f8, t_f8) = results[False], results[True]
    assert t_f8["val_eal"] > t_f8["val_eal_untrained"]  # it learned from FP8 states
    assert abs(t_f8["val_eal"] - t_bf["val_eal"]) < 0.1 * t_bf["val_eal"]
    assert s_f8.metrics["norm_mean"] == pytest.approx(s_bf.metrics["norm_mean"], rel=0.02)


def test_fp8_shards_checked_as_stored_get_the_verdict_of_their_dequantized_states(tmp_path):
    """Stage 03 checks an FP8 shard outside its statistics sample without dequantizing it (the bytes: NaN
    patterns, zero and equal slots; the scales): on every planted fault and on a valid shard, the same problems
    as the dequantized check names."""
    from safetensors.torch import load_file, save_file

    spec = shards.ShardSpec(4, 64, torch.bfloat16, fp8=True)
    ids = torch.arange(24)
    base = torch.randn(24, 4, 64).bfloat16()
    faults = {
        "valid": lambda d: None,
        "nan byte": lambda d: d["hidden_states"].view(torch.uint8)[3, 1].__setitem__(5, 0x7F),
        "negative nan byte": lambda d: d["hidden_states"].view(torch.uint8)[20, 3].__setitem__(63, 0xFF),
        "inf scale": lambda d: d[shards.SCALES_KEY].__setitem__((7, 0, 0), float("inf")),
        "duplicated slot": lambda d: d["hidden_states"][:, 2].copy_(d["hidden_states"][:, 1]),
        "zero slot": lambda d: d["hidden_states"].view(torch.uint8)[:, 3].zero_(),
        "shifted ids": lambda d: d.__setitem__("token_ids", torch.roll(d["token_ids"], 1)),
    }
    for n, (name, plant) in enumerate(faults.items()):
        path = shards.write_shard(tmp_path, n, ids, base, ids, spec)
        data = load_file(str(path))
        plant(data)
        save_file(data, str(path))
        full, states = inspect_tensors.check_shard(path, ids.tolist(), 24, spec, [2, 3, 5, 8])
        stored, none = inspect_tensors.check_shard(path, ids.tolist(), 24, spec, [2, 3, 5, 8], need_states=False)
        assert stored == full and none is None, (name, stored, full)
        assert bool(full) == (name != "valid") and (states is not None) == (name == "valid"), (name, full)
    assert shards.has_fp8_nan(torch.full((3,), float("nan")).to(torch.float8_e4m3fn))  # odd size: byte-wise path
    assert not shards.has_fp8_nan(torch.tensor([448.0, -448.0, 0.0]).to(torch.float8_e4m3fn))
