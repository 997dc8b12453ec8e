"""Stage 02's capture probe on the transformers backend of a tiny Llama: it passes a correct capture and names each
planted fault (a post-norm final state, wrong slices, a non-finite or all-zero slot, one wrong prefill chunk of a
long row), a failing probe stops stage 02 before its first shard, and the probe's rows become shards only after its
verdict. The capture itself: test_capture.py."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import reference_states
from test_capture import LAYER_IDS, random_rows, tiny_cfg

from eagle3lib.common import shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract import capture
from eagle3lib.extract.backends import make_backend
from eagle3lib.extract.backends.transformers_backend import TransformersBackend


class PostNormFinal(TransformersBackend):
    """A planted fault through the backend's real hooks: the final slot taken from the model's own final norm."""

    def _post_hook(self, slot):
        def hook(_module, _args, out):
            self._store(slot, self.base.norm(out[0] if isinstance(out, tuple) else out))
        return hook


def probe_on(cfg, backend, model_dir, layer_ids, rows, root):
    from eagle3lib.extract import probe

    try:
        return probe.run(cfg, backend, model_dir, layer_ids, 64, [t for _, t in rows], root,
                         probe.compute_dtype(cfg, backend), progress=False), None
    except WorkbookError as e:
        return json.loads((root / probe.FAILED_FILE).read_text()), str(e)
    finally:
        backend.close()


def test_probe_passes_the_transformers_backend_and_names_each_planted_fault(tmp_path, tiny_llama_dir):
    """The transformers backend's probe: the model's own logits and output_hidden_states of the same loaded model
    are the reference. Hooks on swapped or shifted layers, and a post-norm final state, each stop it with one message
    naming the slot and the cause; on the random tiny Llama (norm weight all ones, so norm(norm(x)) = norm(x)) only
    the post-norm structure check can see the last one."""
    cfg = tiny_cfg(tiny_llama_dir)
    rows = random_rows(7, seed=5)
    report, err = probe_on(cfg, make_backend(cfg, tiny_llama_dir, LAYER_IDS), tiny_llama_dir, LAYER_IDS, rows,
                           tmp_path / "ok")
    assert err is None and report["passed"] and (tmp_path / "ok" / "capture_probe.json").is_file()
    assert report["rows"][0] == max(range(7), key=lambda i: len(rows[i][1])) and len(report["rows"]) == 4
    assert report["second_paths"][0]["ran"] and report["dtype"]["tolerances"] == "float32"
    final = next(c for c in report["checks"] if c["check"] == "final state")["measured"]
    assert final["top1_agreement"] == 1.0 and final["mean_logprob_error"] < 1e-4, final
    phases = report["phase_seconds"]  # where the seconds went: every phase timed, together within the total
    assert set(phases) == {"capture", "engine_distribution", "read_captures", "transformers_reference", "checkpoint_head",
                           "checks"}
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= report["seconds"] + 0.01, phases
    faults = {"swapped": (TransformersBackend(cfg, tiny_llama_dir, [3, 1, 5, 6]),
                          ["layer identity", "slot 0 holds layer id 3, not 1", "slots in the wrong order"]),
              "off_by_one": (TransformersBackend(cfg, tiny_llama_dir, [0, 2, 4, 6]),
                             ["slot 0 holds layer id 0, not 1", "layer ids off by one"]),
              "post_norm": (PostNormFinal(cfg, tiny_llama_dir, LAYER_IDS),
                            ["post-norm", "layer id 6", "AFTER the final norm"])}
    for name, (backend, needles) in faults.items():
        report, err = probe_on(cfg, backend, tiny_llama_dir, LAYER_IDS, rows, tmp_path / name)
        assert err is not None and not report["passed"], name
        assert "\n" not in err and err.startswith("the capture probe failed before the first shard"), err
        for needle in needles:
            assert needle in err, f"{name}: {needle!r} not in {err}"
        assert not (tmp_path / name / "capture_probe.json").exists()


def test_the_final_state_check_samples_a_long_row_and_still_sees_one_wrong_prefill_chunk():
    """A 2048-token row with the engine's logprobs at every position (prompt logprobs) is compared at 256 evenly
    spaced positions, in one application of the head: a correct capture passes; one wrong 256-token chunk (what
    chunked prefill gone wrong looks like: vllm#52909) fails under both tolerance classes."""
    from eagle3lib.common.head import final_logits
    from eagle3lib.extract import probe

    g = torch.Generator().manual_seed(0)
    hidden, vocab, length = 64, 1000, 2048
    norm_w, lm_head = torch.rand(hidden, generator=g) + 0.5, 0.5 * torch.randn(vocab, hidden, generator=g)  # logits ~4
    states = torch.randn(length, 1, hidden, generator=g)
    engine = probe._dist_from_logits(final_logits(states[:, 0], (norm_w, lm_head, 1e-6)), list(range(length)))
    ids = torch.randint(0, vocab, (length,), generator=g).tolist()

    def final_check(st, tol):
        obs = probe.Observed([(0, ids)], {0: st}, {}, {0: engine}, "vLLM logprobs", [],
                             (torch.zeros(vocab, hidden), norm_w, lm_head, 1e-6), [])
        return probe.check_final(obs, [30], probe.TOLERANCES[tol])[0]

    ok = final_check(states, "float32")
    assert ok.ok and ok.measured["positions"] == probe.FIRST_ROW_POSITIONS == 256, ok
    wrong = states.clone()
    wrong[1536:1792] = torch.randn(256, 1, hidden, generator=g)
    for tol in ("float32", "16-bit"):
        bad = final_check(wrong, tol)
        assert not bad.ok and bad.measured["top1_agreement"] < 0.9, (tol, bad.measured)
    # a bf16 head and bf16 states under the 16-bit tolerances: applied in bf16 on an AMX CPU, converted elsewhere;
    # either way within half the tolerance (0.1 nats) of the engine's float32 logprobs of the same bf16 tensors
    lm_head = lm_head.bfloat16()
    engine = probe._dist_from_logits(final_logits(states.bfloat16()[:, 0], (norm_w, lm_head, 1e-6)),
                                     list(range(length)))
    ok = final_check(states.bfloat16(), "16-bit")
    assert ok.ok and ok.measured["mean_logprob_error"] < 0.05, ok.measured
    assert not final_check(wrong.bfloat16(), "16-bit").ok


def test_the_structure_check_names_a_non_finite_slot_and_an_all_zero_one():
    """One reduction per row finds the slot: 2 NaN and 1 inf in slot 1 of one row (counted exactly), slot 2 all zero
    in another; a clean capture passes."""
    from eagle3lib.extract import probe

    g = torch.Generator().manual_seed(1)
    rows = [(r, list(range(16))) for r in range(3)]
    states = {r: torch.randn(16, 3, 8, generator=g).bfloat16() for r, _ in rows}
    obs = probe.Observed(rows, states, {}, {}, "", [], None, [])
    tol = probe.TOLERANCES["16-bit"]
    assert next(c for c in probe.check_structure(obs, [1, 2, 3], 8, tol) if c.check == "finite").ok
    states[1][4, 1, 2] = states[1][9, 1, 0] = float("nan")
    states[1][11, 1, 5] = float("inf")
    states[2][:, 2] = 0
    bad = [c for c in probe.check_structure(obs, [1, 2, 3], 8, tol) if c.check == "finite"]
    assert [(c.ok, c.slot, c.measured) for c in bad] == [
        (False, 1, {"non_finite": 3, "zero_rows": []}), (False, 2, {"non_finite": 0, "zero_rows": [2]})], bad


def test_a_failing_probe_stops_stage_02_before_its_first_shard(tmp_path, tiny_llama_dir):
    """Through the capture loop itself (what extract.run does): the probe runs on the backend before any shard, and
    its failure leaves no shard and no table; with the fault gone the same call probes, passes and extracts."""
    cfg = tiny_cfg(tiny_llama_dir, "extract.batch_tokens=64")
    rows = random_rows(6, seed=2)
    ids = [t for _, t in rows]
    ddir, run_root = tmp_path / "dataset", tmp_path
    with pytest.raises(WorkbookError, match="capture probe failed before the first shard: layer identity"):
        capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, [[1] * len(t) for t in ids], progress=False,
                        backend=TransformersBackend(cfg, tiny_llama_dir, [1, 5, 3, 6]), probe_dir=run_root)
    assert not list(shards.shard_dir(ddir).glob("*")) and not (ddir / "state.json").exists()
    assert (run_root / "capture_probe.failed.json").is_file() and not (run_root / "capture_probe.json").exists()
    ext = capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, [[1] * len(t) for t in ids], progress=False,
                          probe_dir=run_root)
    assert ext["probe"]["passed"] and ext["computed_shards"] == 6
    assert (run_root / "capture_probe.json").is_file() and not (run_root / "capture_probe.failed.json").exists()


class CountingBackend(TransformersBackend):
    """The real transformers backend, recording which rows it was asked to capture."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    def capture(self, rows):
        self.asked += [r for r, _ in rows]
        yield from super().capture(rows)


def test_the_probe_rows_become_shards_and_no_shard_is_written_before_the_verdict(tmp_path, tiny_llama_dir,
                                                                                 tiny_model, monkeypatch):
    """The probe's rows are captured once (their captures kept as their shards, not captured again), its judging runs
    beside the extraction, and the shard writer holds every shard until the verdict: with the verdict held back, the
    backend has captured every row and still nothing is on disk; released, every shard is written and right."""
    import threading

    from eagle3lib.extract import probe

    cfg = tiny_cfg(tiny_llama_dir, "extract.batch_tokens=64")
    rows = random_rows(10, seed=4)
    ids = [t for _, t in rows]
    release, judging = threading.Event(), threading.Event()
    conclude = probe.conclude

    def held_back(*args, **kwargs):
        judging.set()
        assert release.wait(120)
        return conclude(*args, **kwargs)

    monkeypatch.setattr(probe, "conclude", held_back)
    backend = CountingBackend(cfg, tiny_llama_dir, LAYER_IDS)
    ddir, out = tmp_path / "dataset", {}

    def extract_rows():
        try:
            out["ext"] = capture.extract(cfg, ddir, tiny_llama_dir, LAYER_IDS, 64, ids, [[1] * len(t) for t in ids],
                                         progress=False, backend=backend, probe_dir=tmp_path)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e

    worker = threading.Thread(target=extract_rows)
    worker.start()
    deadline = time.time() + 120
    while sorted(backend.asked) != list(range(10)) and time.time() < deadline and worker.is_alive():
        time.sleep(0.02)
    assert judging.is_set() and sorted(backend.asked) == list(range(10)), (backend.asked, out)
    time.sleep(0.5)  # the writer's threads had time to write, were they not held
    assert not list(shards.shard_dir(ddir).glob("hs_*")) and not (tmp_path / "capture_probe.json").exists()
    release.set()
    worker.join(120)
    assert "error" not in out, out
    ext = out["ext"]
    assert ext["probe"]["passed"] and ext["probe"]["kept_rows"] == 4 and ext["computed_shards"] == 10
    assert 0 < ext["probe"]["blocking_seconds"] <= ext["probe"]["seconds"], ext["probe"]
    assert len(backend.asked) == 10, f"rows captured more than once: {backend.asked}"
    for i in range(10):
        got = shards.read_shard(shards.shard_path(ddir, i))
        ref = reference_states(tiny_model, torch.tensor([ids[i]]), LAYER_IDS)[0]
        torch.testing.assert_close(got["hidden_states"], ref, rtol=1e-4, atol=1e-5)
