"""Benchmark (not a test): how close does stage 02's extraction come to the bare forward of the target?

In ONE run, on the available device (CUDA if present, else CPU), over the same rows and the same batches:
  bare   = the transformers backend's forward with the aux states gathered into the GPU buffer, nothing copied out;
  e2e    = `eagle3lib.capture.extract` end to end: forward, copies to pinned host memory overlapped with the next
           forward, every shard validated and written to disk on background threads, the dataset table saved.
It prints both in tokens/s and their ratio (goal on an H200 with the Llama-3.1-8B shape: >= 0.90) and writes JSON.

The target is a random-weight Llama of the given shape (default: Llama-3.1-8B, bf16) built in memory: no download.

    python benchmarks/extract.py --out benchmarks/results/extract_h200.json          # on the GPU
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3lib import capture, shards  # noqa: E402
from eagle3lib.backends.transformers_backend import TransformersBackend, plan_batches  # noqa: E402
from eagle3lib.config import load_config  # noqa: E402

LLAMA_31_8B = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
TINY = dict(layers=4, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=1024)


def build_target(shape: dict, dtype: torch.dtype, device: str):
    """A random-weight LlamaForCausalLM of `shape`, built directly on `device` in `dtype` (no fp32 copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny shape for a CPU smoke test")
    ap.add_argument("--prompts", type=int, default=None, help="rows (default 128; 24 with --tiny)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 2048; 128 with --tiny)")
    ap.add_argument("--vary", action="store_true", help="row lengths uniform in [seq_len/4, seq_len] instead of fixed")
    ap.add_argument("--batch-tokens", type=int, default=16384, help="extract.batch_tokens")
    ap.add_argument("--writer-threads", type=int, default=4, help="extract.writer_threads")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    ap.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--workdir", default=None, help="where shards go (default: a temp folder, removed after)")
    ap.add_argument("--out", required=True, help="JSON result path")
    args = ap.parse_args()

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    shape = dict(TINY if args.tiny else LLAMA_31_8B)
    if args.layers:
        shape["layers"] = args.layers
    n_rows = args.prompts or (24 if args.tiny else 128)
    seq_len = args.seq_len or (128 if args.tiny else 2048)
    dtype = getattr(torch, args.dtype)
    n = shape["layers"]
    layer_ids = [2, n // 2, n - 3, n] if n >= 6 else [1, 2, 3, n][-min(n, 4):]

    t = time.time()
    model = build_target(shape, dtype, device)
    sync(device)
    build_s = time.time() - t
    g = torch.Generator().manual_seed(0)
    lens = (torch.randint(seq_len // 4, seq_len + 1, (n_rows,), generator=g).tolist() if args.vary
            else [seq_len] * n_rows)
    input_ids = [torch.randint(0, shape["vocab"], (L,), generator=g).tolist() for L in lens]
    loss_mask = [[0] * (L // 2) + [1] * (L - L // 2) for L in lens]
    rows = list(enumerate(input_ids))
    tokens = sum(lens)

    cfg = load_config(None, [f"target.dtype={args.dtype}", f"target.layer_ids={layer_ids[:-1]}",
                             f"extract.dtype={args.store_dtype}", f"extract.batch_tokens={args.batch_tokens}",
                             f"extract.writer_threads={args.writer_threads}", f"extract.devices={device}"])
    backend = TransformersBackend(cfg, Path("."), layer_ids, device=device, model=model)
    batches = plan_batches(rows, args.batch_tokens)

    # warm-up: one batch through both paths (kernels, allocator, pinned host cache)
    with torch.inference_mode():
        backend._forward(batches[0])
    for _ in backend.capture(batches[0]):
        pass
    sync(device)

    # 1. bare forward with the aux states gathered on the device
    t = time.time()
    with torch.inference_mode():
        for b in batches:
            backend._forward(b)
    sync(device)
    bare_s = time.time() - t

    # 2. end to end through the capture path: shards validated and on disk
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    ddir = work / "dataset"
    shutil.rmtree(ddir, ignore_errors=True)
    try:
        t = time.time()
        ext = capture.extract(cfg, ddir, Path("."), layer_ids, shape["hidden"], input_ids, loss_mask,
                              progress=False, backend=backend)
        e2e_s = time.time() - t  # incl. the resume scan and the table save
        written = sorted(shards.shard_dir(ddir).glob("hs_*.safetensors"))
        spec = capture.shard_spec(cfg, layer_ids, shape["hidden"])
        assert len(written) == n_rows, f"{len(written)} shards for {n_rows} rows"
        for i in (0, n_rows // 2, n_rows - 1):  # spot-check on disk
            assert not shards.check_shard_file(shards.shard_path(ddir, i), input_ids[i], spec)
        disk_bytes = sum(p.stat().st_size for p in written)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    backend.close()

    bare = tokens / bare_s
    e2e_capture = ext["tokens_per_s"]
    e2e_total = tokens / e2e_s
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


if __name__ == "__main__":
    main()
