"""Stage 02 capture: the transformers backend against the hand computation, shard validation catching the seed's bug,
resume (including a SIGKILL mid-run), and speculators' own loader reading every row of a real SmolLM2 run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import reference_states

from eagle3lib import extract
from eagle3lib.common import shards
from eagle3lib.common.config import load_config
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import REPO_ROOT, open_stage
from eagle3lib.extract import capture, data_parallel, disk
from eagle3lib.extract.backends import make_backend
from eagle3lib.extract.backends.transformers_backend import plan_batches

LAYER_IDS = [1, 3, 5, 6]  # tiny Llama: 6 layers, so id 6 = the last layer's pre-norm output


def random_rows(n: int, vocab: int = 512, seed: int = 0) -> list[tuple[int, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g)
    return [(i, torch.randint(0, vocab, (int(t),), generator=g).tolist()) for i, t in enumerate(lens)]


def tiny_cfg(model_dir: Path, *extra: str):
    return load_config(None, [f"target.model={model_dir}", f"target.layer_ids={LAYER_IDS[:-1]}",
                              "extract.dtype=float32", *extra])


def test_plan_batches_covers_every_row_under_the_budget():
    rows = random_rows(50)
    batches = plan_batches(rows, 96)
    assert sorted(r for b in batches for r, _ in b) == list(range(50))
    for b in batches:
        assert len(b) == 1 or len(b) * max(len(t) for _, t in b) <= 96
    lens = [len(t) for b in batches for _, t in b]
    assert lens == sorted(lens, reverse=True)


@pytest.mark.parametrize("batch_tokens", [40, 4096])
def test_transformers_backend_matches_the_hand_computation(tiny_llama_dir, tiny_model, batch_tokens):
    rows = random_rows(9)
    backend = make_backend(tiny_cfg(tiny_llama_dir, f"extract.batch_tokens={batch_tokens}"), tiny_llama_dir, LAYER_IDS)
    try:
        got = dict(backend.capture(rows))
    finally:
        backend.close()
    assert sorted(got) == list(range(9))
    for i, toks in rows:
        ids = torch.tensor([toks])
        ref = reference_states(tiny_model, ids, LAYER_IDS)[0]
        assert got[i].shape == (len(toks), 4, 64) and got[i].dtype == torch.float32
        torch.testing.assert_close(got[i], ref, rtol=1e-4, atol=1e-5)
        # the test has teeth: an off-by-one layer or the post-norm final state would not pass it
        with torch.inference_mode():
            hs = tiny_model.model(input_ids=ids, output_hidden_states=True).hidden_states
        assert not torch.allclose(got[i][:, 0], hs[LAYER_IDS[0] + 1][0], atol=1e-3)
        assert not torch.allclose(got[i][:, -1], hs[-1][0], atol=1e-3)


class SlicedWrongly:
    """The seed's bug planted in front of the real backend: the aux layers flattened, one layer kept."""

    def __init__(self, inner):
        self.inner = inner

    def capture(self, rows):
        for row, hs in self.inner.capture(rows):
            yield row, hs.flatten(1)[:, : hs.shape[-1]].unsqueeze(1) if row == 5 else hs

    def close(self):
        self.inner.close()


def test_seed_bug_is_caught_before_it_reaches_the_disk(tmp_path, tiny_llama_dir):
    cfg = tiny_cfg(tiny_llama_dir, "extract.batch_tokens=64", "extract.dtype=bfloat16")
    rows = random_rows(12)
    ids = [t for _, t in rows]
    backend = SlicedWrongly(make_backend(cfg, tiny_llama_dir, LAYER_IDS))
    with pytest.raises(WorkbookError, match=r"sample 5: refusing to write an invalid shard: hidden_states shape "
                                            r"\[\d+, 1, 64\], expected \[T, n_aux\+1, H\] = \[\d+, 4, 64\]"):
        capture.extract(cfg, tmp_path / "dataset", tiny_llama_dir, LAYER_IDS, 64, ids, [[1] * len(t) for t in ids],
                        progress=False, backend=backend)
    backend.close()
    assert not shards.shard_path(tmp_path / "dataset", 5).exists()
    assert not (tmp_path / "dataset" / "state.json").exists()  # no table for a failed run
    spec = shards.ShardSpec(4, 64, torch.bfloat16)
    for p in shards.shard_dir(tmp_path / "dataset").glob("*"):  # whatever was written is valid and final-named
        i = int(p.stem.removeprefix("hs_"))
        assert shards.check_shard_file(p, ids[i], spec) == []


def test_resume_keeps_valid_shards_and_redoes_broken_ones(tmp_path, tiny_llama_dir, tiny_model):
    cfg = tiny_cfg(tiny_llama_dir, "extract.batch_tokens=64")
    rows = random_rows(10)
    ids = [t for _, t in rows]
    masks = [[0] * (len(t) // 2) + [1] * (len(t) - len(t) // 2) for t in ids]
    ddir = tmp_path / "dataset"
    first = capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, masks, progress=False)
    assert first["computed_shards"] == 10
    paths = [shards.shard_path(ddir, i) for i in range(10)]
    old = {i: p.stat().st_mtime_ns for i, p in enumerate(paths)}
    paths[2].write_bytes(paths[2].read_bytes()[:100])  # torn file
    data = shards.read_shard(paths[7])
    from safetensors.torch import save_file

    save_file({"token_ids": data["token_ids"], "hidden_states": data["hidden_states"][:, :3].contiguous()},
              str(paths[7]))  # wrong slot count
    (shards.shard_dir(ddir) / ".hs_4.safetensors.abc.tmp.safetensors").write_bytes(b"junk")  # a killed write
    shards.shard_path(ddir, 25).write_bytes(b"from a larger earlier run")
    time.sleep(0.01)
    again = capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, masks, progress=False)
    assert (again["resumed_shards"], again["computed_shards"]) == (8, 2)
    assert sorted(p.name for p in shards.shard_dir(ddir).iterdir()) == sorted(p.name for p in paths)
    for i, p in enumerate(paths):
        assert (p.stat().st_mtime_ns == old[i]) == (i not in (2, 7))
        ref = reference_states(tiny_model, torch.tensor([ids[i]]), LAYER_IDS)[0]
        torch.testing.assert_close(shards.read_shard(p)["hidden_states"], ref, rtol=1e-4, atol=1e-5)


def test_rows_that_do_not_fit_the_free_disk_stop_before_the_first_shard(tmp_path, tiny_llama_dir, monkeypatch):
    """Stage 02's second disk check, with the real token count: a free space that holds 4 of 10 rows' shards stops
    the extraction before anything is written, saying how many fit; with the space back, the same call runs."""
    from collections import namedtuple

    cfg = tiny_cfg(tiny_llama_dir)
    rows = random_rows(10)
    ids = [t for _, t in rows]
    masks = [[1] * len(t) for t in ids]
    ddir = tmp_path / "dataset"
    per_token = capture.shard_spec(cfg, LAYER_IDS, 64).bytes_per_token()
    margin = 1_000_000 + 16 * sum(len(t) for t in ids)
    free = margin + per_token * sum(len(t) for t in ids[:4]) + per_token // 2  # rows 0-3 fit, row 4 does not
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage(10 * free, 9 * free, free))
    with pytest.raises(WorkbookError) as err:
        capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, masks, progress=False)
    msg = str(err.value)
    assert "the 10 rows still to extract need" in msg and "4 of them fit" in msg and "data.num_samples" in msg
    assert "\n" not in msg and not list(shards.shard_dir(ddir).glob("*"))
    monkeypatch.undo()
    assert capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, masks, progress=False)["computed_shards"] == 10


# ------------------------------------------------------------------------------------- real SmolLM2 stage runs
def conversations_jsonl(path: Path, n: int) -> Path:
    topics = ["rivers", "stars", "bread", "trains", "music", "chess", "rain", "bees"]
    lines = []
    for i in range(n):
        t = topics[i % len(topics)]
        lines.append(json.dumps({"category": t, "messages": [
            {"role": "user", "content": f"Tell me fact number {i} about {t}."},
            {"role": "assistant", "content": f"Fact {i}: {t} are " + "really quite interesting " * (1 + i % 5)
             + f"and that is fact {i} about {t}."}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def stage_overrides(out_root: Path, src: Path, *extra: str) -> list[str]:
    return [f"run.output_root={out_root}", f"data.sources=[{{kind: jsonl, path: {src}}}]", "data.self_distill=false",
            "data.eval_samples=4", "data.max_length=128", "extract.batch_tokens=256", *extra]


def test_stage_output_is_read_by_speculators_without_dropping_a_row(tmp_path, smollm2_dir):
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    src = conversations_jsonl(tmp_path / "conv.jsonl", 24)
    stage = open_stage("02", REPO_ROOT / "configs/demo.yaml", "spec", stage_overrides(tmp_path / "out", src))
    result = extract.run(stage, progress=False)
    stage.finish(result)
    m = stage.rd.read_manifest("02")["metrics"]
    assert (m["samples"], m["train_rows"], m["val_rows"], m["layer_ids"]) == (20, 18, 2, [2, 15, 27, 30])
    probe = json.loads(stage.rd.output("02", "capture_probe").read_text())  # the probe ran before the first shard
    assert probe["passed"] and m["extract"]["probe"]["passed"] and len(probe["rows"]) == 4
    assert probe["dtype"] == {"compute": "float32", "storage": "bfloat16", "tolerances": "16-bit"}
    assert m["tokens"] > 20 * 30 and m["bytes"] > m["tokens"] * 4 * 576 * 2 and m["tokens_per_s"] > 0
    ds_dir = stage.rd.output("02", "dataset")
    ratio = m["train_ratio"]
    assert int(m["samples"] * ratio) == m["train_rows"]
    for split in ("train", "val"):
        ds = ArrowDataset(max_len=128, datapath=ds_dir, on_missing="raise", train_ratio=ratio, split=split)
        assert len(ds) == (18 if split == "train" else 2)
        for i in range(len(ds)):
            item = ds[i]
            assert not isinstance(item, SampleUnavailable)
            assert item["hidden_states"].shape == (len(item["input_ids"]), 3 * 576)
            assert item["verifier_last_hidden_states"].shape == (len(item["input_ids"]), 576)
            assert item["loss_mask"].sum() > 0
    freq = torch.load(stage.rd.output("02", "token_freq"), weights_only=True)
    from datasets import load_from_disk

    table = load_from_disk(str(ds_dir)).with_format(None)
    expect: dict[int, int] = {}
    for row in table.select(range(18)):
        for t, k in zip(row["input_ids"], row["loss_mask"], strict=True):
            expect[t] = expect.get(t, 0) + k
    assert freq == {t: c for t, c in expect.items() if c}
    evals = stage.rd.output("02", "eval_prompts").read_text().splitlines()
    held = {json.loads(e)["messages"][0]["content"] for e in evals}
    trained = {json.loads(t)["messages"][0]["content"]
               for t in stage.rd.output("02", "train_conversations").read_text().splitlines()}
    assert len(held) == 4 and not held & trained


KILL_SCRIPT = """
import sys
from eagle3lib import extract
from eagle3lib.common.rundir import open_stage
stage = open_stage("02", sys.argv[1], sys.argv[2], sys.argv[3:])
stage.finish(extract.run(stage, progress=False))
"""


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_keeps_shards_and_matches_an_uninterrupted_run(tmp_path, smollm2_dir):
    from datasets import load_from_disk

    src = conversations_jsonl(tmp_path / "conv.jsonl", 40)
    over = stage_overrides(tmp_path / "out", src, "extract.writer_threads=1")
    config = str(REPO_ROOT / "configs/demo.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, config, "killed", *over], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sdir = tmp_path / "out" / "killed" / "dataset" / "hidden_states"
    deadline = time.time() + 150
    try:
        while time.time() < deadline and proc.poll() is None:
            if sdir.is_dir() and len(list(sdir.glob("hs_*.safetensors"))) >= 4:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    before = {p.name: p.stat().st_mtime_ns for p in sdir.glob("hs_*.safetensors")}
    assert 4 <= len(before) < 36
    assert not (tmp_path / "out" / "killed" / "manifests" / "02_extract_hidden_states.json").exists()

    stage = open_stage("02", config, "killed", over)
    result = extract.run(stage, progress=False)
    stage.finish(result)
    ext = result.metrics["extract"]
    n = result.metrics["samples"]
    assert ext["resumed_shards"] >= len(before) and ext["resumed_shards"] + ext["computed_shards"] == n
    after = {p.name: p.stat().st_mtime_ns for p in sdir.glob("hs_*.safetensors")}
    assert len(after) == n and all(after[k] == v for k, v in before.items())

    ref_stage = open_stage("02", config, "straight", over)
    ref_stage.finish(extract.run(ref_stage, progress=False))
    a = load_from_disk(str(stage.rd.output("02", "dataset"))).with_format(None)
    b = load_from_disk(str(ref_stage.rd.output("02", "dataset"))).with_format(None)
    assert a.to_dict() == b.to_dict()
    assert (stage.rd.path("data/eval.jsonl").read_text() == ref_stage.rd.path("data/eval.jsonl").read_text())
    for i in range(n):
        x = shards.read_shard(shards.shard_path(stage.rd.output("02", "dataset"), i))
        y = shards.read_shard(shards.shard_path(ref_stage.rd.output("02", "dataset"), i))
        assert torch.equal(x["token_ids"], y["token_ids"])
        # batches differ between the two runs (padding, blocking): equal up to bf16 rounding
        torch.testing.assert_close(x["hidden_states"].float(), y["hidden_states"].float(), rtol=2e-2, atol=2e-2)
    assert torch.load(stage.rd.output("02", "token_freq"), weights_only=True) == torch.load(
        ref_stage.rd.output("02", "token_freq"), weights_only=True)


def test_data_parallel_shares_are_token_balanced_and_complete():
    ids = [[0] * n for n in (500, 20, 300, 300, 40, 260, 90, 10)]
    shares = data_parallel.split_balanced(list(range(8)), ids, 3)
    assert sorted(r for s in shares for r in s) == list(range(8))
    loads = [sum(len(ids[r]) for r in s) for s in shares]
    assert max(loads) - min(loads) <= 500  # no share is more than one longest row heavier


def test_data_parallel_processes_write_every_shard(tmp_path, tiny_llama_dir, tiny_model, monkeypatch):
    """The one-process-per-GPU path, run here with two CPU processes (as if two GPUs were visible), the capture probe
    first on a backend of its own in this process: same shards as the hand computation."""
    cfg = tiny_cfg(tiny_llama_dir, "extract.batch_tokens=64", "extract.writer_threads=2")
    rows = random_rows(10, seed=3)
    ids = [t for _, t in rows]
    monkeypatch.setattr(data_parallel, "devices_for", lambda cfg, model_dir, backend: ["cpu", "cpu"])
    ddir = tmp_path / "dataset"
    ext = capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, [[1] * len(t) for t in ids], progress=False,
                          probe_dir=tmp_path)
    assert ext["computed_shards"] == 10 and ext["probe"]["passed"] and (tmp_path / "capture_probe.json").is_file()
    for i in range(10):
        got = shards.read_shard(shards.shard_path(ddir, i))
        assert got["token_ids"].tolist() == ids[i]
        ref = reference_states(tiny_model, torch.tensor([ids[i]]), LAYER_IDS)[0]
        torch.testing.assert_close(got["hidden_states"], ref, rtol=1e-4, atol=1e-5)


def test_adopting_a_shard_file_checks_what_its_writer_did_not(tmp_path):
    """A backend's finished file becomes a shard by a rename. A file whose writer already refused NaN/inf (the vLLM
    capture worker checks on the device) is checked by header and token ids only; any other file is read in full.
    Either way a wrong file is deleted and stops the run, and nothing invalid carries a shard's name."""
    from safetensors.torch import save_file

    spec = shards.ShardSpec(2, 4, torch.bfloat16)
    ids = [3, 1, 4]
    shards.shard_dir(tmp_path / "ds").mkdir(parents=True)

    def spool(name: str, hs: torch.Tensor, toks: list[int] = ids) -> Path:
        path = tmp_path / name
        save_file({"hidden_states": hs, "token_ids": torch.tensor(toks)}, str(path))
        return path

    nan = torch.ones(3, 2, 4, dtype=torch.bfloat16)
    nan[1, 0, 2] = float("nan")
    with pytest.raises(WorkbookError, match="sample 0: refusing to adopt.*NaN or inf"):
        shards.adopt_shard(tmp_path / "ds", 0, spool("a", nan), ids, spec)
    assert not (tmp_path / "a").exists() and not shards.shard_path(tmp_path / "ds", 0).exists()
    for values_checked in (False, True):
        with pytest.raises(WorkbookError, match="token_ids differ"):
            shards.adopt_shard(tmp_path / "ds", 1, spool("b", torch.ones(3, 2, 4, dtype=torch.bfloat16), [3, 1, 5]),
                               ids, spec, values_checked)
        with pytest.raises(WorkbookError, match=r"hidden_states (shape|stored as torch.float32)"):
            shards.adopt_shard(tmp_path / "ds", 1, spool("c", torch.ones(3, 2, 4)), ids, spec, values_checked)
        assert not shards.shard_path(tmp_path / "ds", 1).exists()
        good = shards.adopt_shard(tmp_path / "ds", 2, spool("d", torch.ones(3, 2, 4, dtype=torch.bfloat16)), ids,
                                  spec, values_checked)
        assert shards.check_shard_file(good, ids, spec) == [] and not (tmp_path / "d").exists()
    # an FP8 run (extract.fp8_shards) adopts a backend's bf16 file by reading, checking and writing it quantized
    fp8 = shards.ShardSpec(2, 4, torch.bfloat16, fp8=True)
    with pytest.raises(WorkbookError, match="sample 3: refusing to adopt.*NaN or inf"):
        shards.adopt_shard(tmp_path / "ds", 3, spool("e", nan), ids, fp8)
    assert not (tmp_path / "e").exists() and not shards.shard_path(tmp_path / "ds", 3).exists()
    good = shards.adopt_shard(tmp_path / "ds", 4, spool("f", torch.ones(3, 2, 4, dtype=torch.bfloat16)), ids, fp8)
    assert not (tmp_path / "f").exists() and shards.check_shard_file(good, ids, fp8) == []
    assert "fp8_shards: true" in shards.check_shard_file(shards.shard_path(tmp_path / "ds", 2), ids, fp8)[0]
