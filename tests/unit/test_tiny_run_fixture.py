"""The fixture later stages are tested on must itself obey the data contract speculators reads."""

import torch
from datasets import load_from_disk

from eagle3lib.common import shards


def test_tiny_run_matches_the_contract(tiny_run):
    cfg, rd = tiny_run
    manifest = rd.read_manifest("02")
    ds = load_from_disk(str(rd.output("02", "dataset")))
    assert len(ds) == manifest["metrics"]["samples"] == 16
    spec = shards.ShardSpec(4, 64, torch.bfloat16)
    for i in range(len(ds)):
        path = shards.shard_path(rd.output("02", "dataset"), i)
        assert shards.check_shard_file(path, ds[i]["input_ids"], spec) == []
    freq = torch.load(rd.output("02", "token_freq"), weights_only=True)
    assert sum(freq.values()) == 12 * 24


def test_shard_writer_refuses_the_seed_bug(tiny_run, tmp_path):
    """The seed's bug: one layer of four kept and the rest flattened — caught before it reaches the disk."""
    import pytest

    from eagle3lib.common.errors import WorkbookError

    _, rd = tiny_run
    data = shards.read_shard(shards.shard_path(rd.output("02", "dataset"), 0))
    states, ids = data["hidden_states"], data["token_ids"]
    broken = torch.cat([states[:, 0], states[:, 1:].flatten(1)[:, : states.shape[-1] * 0]], dim=-1)
    spec = shards.ShardSpec(4, 64, torch.bfloat16)
    with pytest.raises(WorkbookError, match="sample 7: refusing"):
        shards.write_shard(tmp_path, 7, ids, broken, ids, spec)
    with pytest.raises(WorkbookError, match="token_ids differ"):
        shards.write_shard(tmp_path, 7, ids, states, torch.roll(ids, 1), spec)
    assert not list(tmp_path.glob("hidden_states/*"))
