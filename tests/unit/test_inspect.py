"""Stage 03 on real stage 02 outputs (a tiny random Llama's forward): the validator catches planted faults and names
them by index, the statistics are the numbers a direct computation gives and do not depend on order or chunking,
sampled mode says what it did, and the notebook runs headless."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3lib import inspect_tensors as hs_inspect
from eagle3lib.common import shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import StageRun
from eagle3lib.common.stages import get_stage


def _stage(cfg, rd) -> StageRun:
    return StageRun(get_stage("03"), cfg, rd)


def _spec(rd):
    return hs_inspect.spec_from_manifest(rd.read_manifest("02")["metrics"])


def _load(rd, i):
    return shards.read_shard(shards.shard_path(rd.output("02", "dataset"), i))


def _save(rd, i, token_ids, hidden_states):
    save_file({"token_ids": token_ids.contiguous(), "hidden_states": hidden_states.contiguous()},
              str(shards.shard_path(rd.output("02", "dataset"), i)))


def test_valid_run_writes_report_figures_manifest_with_the_right_numbers(tiny_run):
    cfg, rd = tiny_run
    stage = _stage(cfg, rd)
    out = hs_inspect.run(stage)
    stage.finish(out)
    report = json.loads((rd.path("inspect/report.json")).read_text())
    assert report["validation"]["checked"] == 16 and report["validation"]["invalid"] == 0
    assert report["statistics"]["mode"] == "all 16 shards" and not report["statistics"]["sampled"]
    for name in ("norm_hist", "dim_std", "cos_heatmap", "norm_by_position", "example_heatmap"):
        png = rd.figure_path("03", name)
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    manifest = rd.read_manifest("03")
    assert manifest["metrics"] == out.metrics and manifest["metrics"]["tokens"] == 16 * 48
    # the same numbers computed directly from every shard at once
    x = torch.cat([_load(rd, i)["hidden_states"] for i in range(16)]).double()  # [N, S, H]
    norms = x.norm(dim=-1)
    assert manifest["metrics"]["norm_mean"] == pytest.approx(norms.mean(0).tolist(), abs=1e-6)
    slots = report["statistics"]["slots"]
    assert [s["norm_std"] for s in slots] == pytest.approx(norms.std(0, unbiased=False).tolist(), rel=1e-9)
    cos = torch.nn.functional.cosine_similarity(x[:, :-1], x[:, 1:], dim=-1).mean(0)
    assert manifest["metrics"]["cos_consecutive"] == pytest.approx(cos.tolist(), abs=1e-6)
    assert manifest["metrics"]["cos_last_aux_final"] == pytest.approx(float(cos[-1]), abs=1e-9)
    assert [s["max_abs"] for s in slots] == pytest.approx(x.abs().amax(dim=(0, 2)).tolist())
    assert [s["dim_std_max"] for s in slots] == pytest.approx(x.std(0, unbiased=False).amax(-1).tolist(), rel=1e-9)
    by_pos = report["statistics"]["norm_by_position"]
    assert by_pos[0]["positions"] == "0" and by_pos[0]["mean"] == pytest.approx(norms[::48].mean(0).tolist())
    assert sum(b["tokens"] for b in by_pos) == 16 * 48


def test_planted_faults_are_caught_and_named_by_index(tiny_run):
    cfg, rd = tiny_run
    spec, layer_ids = _spec(rd)
    d = rd.output("02", "dataset")
    good = {i: _load(rd, i) for i in range(10)}
    ids, hs = (lambda i: good[i]["token_ids"]), (lambda i: good[i]["hidden_states"].clone())
    dup = hs(1)
    dup[:, 2] = dup[:, 1]  # slot 2 holds slot 1's layer again: a wrong layer index
    _save(rd, 1, ids(1), dup)
    nan = hs(2)
    nan[5, 0, 3] = float("nan")
    _save(rd, 2, ids(2), nan)
    raw = shards.shard_path(d, 3).read_bytes()
    shards.shard_path(d, 3).write_bytes(raw[: len(raw) // 2])  # truncated
    shards.shard_path(d, 4).write_bytes(b"")  # empty file
    _save(rd, 5, torch.roll(ids(5), 1), hs(5))  # token ids shifted by one position
    _save(rd, 6, ids(6), hs(6).float())  # wrong dtype
    zero = hs(7)
    zero[:, 3] = 0
    _save(rd, 7, ids(7), zero)  # all-zero slot
    _save(rd, 8, ids(8)[:-1], hs(8)[:-1])  # one token short of its row
    shards.shard_path(d, 9).unlink()  # missing

    result = hs_inspect.scan(d, spec, layer_ids, progress=False)
    bad = result.validation.invalid
    assert sorted(bad) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    expect = {1: "slot 1 (layer 2) and slot 2 (layer 3) are identical", 2: "NaN", 3: "unreadable", 4: "unreadable",
              5: "token_ids differ", 6: "stored as torch.float32, this run stores torch.bfloat16",
              7: "slot 3 (layer 6) is all zeros", 8: "47 tokens but the row's seq_len is 48", 9: "missing"}
    for i, needle in expect.items():
        assert any(needle in p for p in bad[i]), (i, bad[i])
    counts = result.validation.counts()
    assert counts["unreadable file"] == 2 and counts["duplicated slots"] == 1 and counts["NaN or inf"] == 1
    assert result.stats.shards == 16 - 9  # only valid shards enter the statistics

    cfg_file = rd.root / "tiny.yaml"
    with pytest.raises(WorkbookError) as err:
        hs_inspect.run(StageRun(get_stage("03"), cfg, rd, config_file=cfg_file))
    msg = str(err.value)
    assert "9 of 16 hidden-state shards are invalid" in msg and "hs_1: " in msg
    # one fix, the real command: this run's config file and name, stages 02 and 03 again
    assert msg.count("fix:") == 1 and f"eagle3 run --config {cfg_file} --run {cfg.run.name} --stages 02-03" in msg
    assert "\n" not in msg
    report = json.loads(rd.path("inspect/report.json").read_text())  # written before the stage fails
    assert report["validation"]["invalid_indices"] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert report["validation"]["first_invalid"][0]["index"] == 1
    assert not rd.manifest_path(get_stage("03")).is_file()


def _same(a: hs_inspect.SlotStats, b: hs_inspect.SlotStats) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for k in ta:
        if ta[k].is_floating_point():
            torch.testing.assert_close(ta[k], tb[k], rtol=1e-10, atol=1e-12, msg=k)
        else:
            assert torch.equal(ta[k], tb[k]), k


def test_statistics_do_not_depend_on_order_or_chunking(tiny_run, monkeypatch):
    cfg, rd = tiny_run
    spec, layer_ids = _spec(rd)
    d = rd.output("02", "dataset")
    whole = hs_inspect.scan(d, spec, layer_ids, progress=False).stats
    first = hs_inspect.scan(d, spec, layer_ids, indices=list(range(8)), progress=False).stats
    second = hs_inspect.scan(d, spec, layer_ids, indices=list(range(8, 16)), progress=False).stats
    _same(first.merge(second), whole)
    _same(second.merge(first), whole)
    reverse = hs_inspect.SlotStats(spec.n_slots, spec.hidden_size)
    for i in reversed(range(16)):
        reverse.update(_load(rd, i)["hidden_states"])
    _same(reverse, whole)
    from eagle3lib.inspect_tensors import stats as inspect_stats

    monkeypatch.setattr(inspect_stats, "CHUNK_TOKENS", 7)  # every shard split into uneven token chunks
    monkeypatch.setattr(hs_inspect, "CHUNK_TOKENS", 7)  # (and the slot checks too)
    _same(hs_inspect.scan(d, spec, layer_ids, progress=False).stats, whole)
    # and the saved accumulators read back to the same numbers
    _same(hs_inspect.SlotStats.from_tensors(whole.tensors()), whole)


def test_moments_merge_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 3, generator=g, dtype=torch.float64) * 5 + 2
    parts = [x[:1], x[1:300], x[300:301], x[301:]]
    m = hs_inspect.Moments.zeros(3)
    for p in parts:
        m = m.merge(hs_inspect.Moments.of(p))
    torch.testing.assert_close(m.mean, x.mean(0))
    torch.testing.assert_close(m.std, x.std(0, unbiased=False))
    assert hs_inspect.position_bucket(torch.tensor([0, 1, 2, 3, 4, 7, 8])).tolist() == [0, 1, 2, 2, 3, 3, 4]


def test_sampled_mode_says_so_and_still_validates_every_shard(tiny_run):
    cfg, rd = tiny_run
    spec, layer_ids = _spec(rd)
    d = rd.output("02", "dataset")
    a = hs_inspect.scan(d, spec, layer_ids, sample_shards=5, seed=3, progress=False)
    b = hs_inspect.scan(d, spec, layer_ids, sample_shards=5, seed=3, progress=False)
    assert a.stats_indices == b.stats_indices and len(a.stats_indices) == 5
    _same(a.stats, b.stats)
    assert a.stats.shards == 5 and a.validation.checked == 16
    report = a.report()
    assert report["statistics"]["sampled"] and report["statistics"]["mode"].startswith("sampled: 5 of 16 shards")
    outside = next(i for i in range(16) if i not in a.stats_indices)
    shards.shard_path(d, outside).write_bytes(b"")
    again = hs_inspect.scan(d, spec, layer_ids, sample_shards=5, seed=3, progress=False)
    assert list(again.validation.invalid) == [outside]


def test_a_dataset_saved_in_torch_format_reads_the_same(tiny_run, tmp_path):
    """Stage 02 may save its table with set_format("torch"); the pass must not care."""
    import shutil

    from datasets import load_from_disk

    cfg, rd = tiny_run
    spec, layer_ids = _spec(rd)
    d = rd.output("02", "dataset")
    torch_dir = tmp_path / "torch-format"
    load_from_disk(str(d)).with_format("torch").save_to_disk(str(torch_dir))
    shutil.copytree(shards.shard_dir(d), shards.shard_dir(torch_dir))
    assert load_from_disk(str(torch_dir)).format["type"] == "torch"
    _same(hs_inspect.scan(torch_dir, spec, layer_ids).stats, hs_inspect.scan(d, spec, layer_ids, progress=False).stats)


def test_notebook_runs_headless_on_the_tiny_run(tiny_run, tmp_path, capfd):
    """Stage 03's notebook under papermill, its kernel on IPC sockets: no TCP warning from the kernel."""
    import nbformat

    from eagle3lib.runner import run_stages

    cfg, rd = tiny_run
    config = tmp_path / "tiny.yaml"
    config.write_text(cfg.to_yaml())
    run_stages(config, stages="03", overrides=["inspect.example_index=3"], log_output=False)
    assert "running over TCP" not in capfd.readouterr().err
    manifest = json.loads(rd.manifest_path(get_stage("03")).read_text())  # made with the override: read it as is
    assert manifest["metrics"]["shards"] == 16 and manifest["metrics"]["invalid"] == 0
    assert rd.figure_path("03", "example_heatmap").is_file()
    executed = nbformat.read(rd.path("notebooks/03_inspect_tensors.ipynb"), as_version=4)
    assert any("inspection OK" in str(o) for c in executed.cells for o in c.get("outputs", []))
    assert sum(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in executed.cells for o in c.get("outputs", [])) == 5
