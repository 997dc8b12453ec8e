"""Benchmark (not a test): speculators' bare EAGLE-3 training step vs the workbook's stage 05 end to end.

In ONE process, for a draft sized for a Llama-3.1-8B target (hidden 4096, target vocab 128256, draft vocab 32000,
1 draft layer, TTT 3, packed sequences of 8192 tokens = 4 documents of 2048):
  (a) bare:  speculators' `Trainer.train_epoch` over synthetic batches already in device memory (built with speculators'
             own CollateFn + shift_batch, so shapes and dtypes are exactly the training ones): the ceiling;
  (b) stage: `eagle3lib.train.train(run_dir)` end to end — stage 02/04 outputs generated here on disk (random hidden
             states [T, 4, 4096] bf16 in hs_{i}.safetensors through eagle3lib.common.shards, a random verifier
             embed/lm_head/norm read by eagle3lib.verifier), read back through the workbook's data path (speculators'
             ArrowDataset, packing sampler, collate, DataLoader workers, pinned memory, side-stream device prefetch).
Both use the same resolved settings (`eagle3lib.train.resolve_settings`: flex attention, bf16 autocast, fused loss
only if its probe passes, else eager) and count only steps after the warm-up (torch.compile). The shards' page cache is
dropped after writing (posix_fadvise DONTNEED; --warm-cache keeps it), so (b) reads from the disk.

    python benchmarks/train.py --out benchmarks/results/train_h200_$(date +%F).json   # on the GPU (≈ 11 GB of shards)
    python benchmarks/train.py --tiny --out /tmp/train_tiny.json                 # CPU smoke test, a minute
    python benchmarks/train.py --loss fused --only a --out /tmp/fused.json      # is the fused loss faster here?

Prints (b)/(a) and writes everything to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FULL = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, draft_vocab=32000,
            aux=[2, 16, 29], packed=8192, docs=4, ttt=3, warmup=10, steps=30, workers=8, prefetch=4)
TINY = dict(hidden=64, intermediate=128, layers=6, heads=4, kv_heads=2, vocab=512, draft_vocab=256,
            aux=[1, 2, 3], packed=512, docs=4, ttt=3, warmup=2, steps=4, workers=0, prefetch=2)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def drop_page_cache(path: Path) -> None:
    """Evict a file we just wrote from the page cache, so reading it later hits the disk (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_target(out: Path, sz: dict[str, Any], gen_device: str) -> Path:
    """A 'target' folder with the Llama config and only the three tensors the draft reuses (random, bf16)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=sz["vocab"], hidden_size=sz["hidden"], intermediate_size=sz["intermediate"],
                num_hidden_layers=sz["layers"], num_attention_heads=sz["heads"], num_key_value_heads=sz["kv_heads"],
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(out)
    g = torch.Generator(device=gen_device).manual_seed(0)
    shape = (sz["vocab"], sz["hidden"])
    tensors = {
        "model.embed_tokens.weight": (torch.randn(shape, generator=g, device=gen_device) * 0.02).bfloat16().cpu(),
        "lm_head.weight": (torch.randn(shape, generator=g, device=gen_device) * 0.02).bfloat16().cpu(),
        "model.norm.weight": torch.ones(sz["hidden"], dtype=torch.bfloat16),
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_run(work: Path, sz: dict[str, Any], args: argparse.Namespace, gen_device: str):
    """Stage 02 and 04 outputs on disk, written by the workbook's own writers; returns (cfg, run_dir)."""
    from datasets import Dataset

    from eagle3lib import verifier
    from eagle3lib.common import shards
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import RunDir, StageResult, StageRun
    from eagle3lib.common.stages import get_stage

    target = write_target(work / "target", sz, gen_device)
    doc_len = sz["packed"] // sz["docs"]
    n_train = (sz["warmup"] + sz["steps"] + 1) * sz["docs"]
    n_val = sz["docs"]
    n = n_train + n_val
    layer_ids = [*sz["aux"], sz["layers"]]
    cfg = load_config(None, [
        f"run.output_root={work / 'outputs'}", "run.name=bench", f"target.model={target}",
        f"target.layer_ids={sz['aux']}", f"verifier.draft_vocab_size={sz['draft_vocab']}",
        "verifier.check_with_transformers=never", f"train.packing_length={sz['packed']}",
        f"train.ttt_steps={sz['ttt']}", "train.epochs=1", f"train.max_steps={sz['warmup'] + sz['steps']}",
        f"train.num_workers={args.workers}", f"train.prefetch_factor={args.prefetch}", "train.lr=1e-4",
        f"train.device_prefetch={not args.no_device_prefetch}", f"train.loss_implementation={args.loss}",
        f"train.draft_attn_impl={args.attn}",
    ])
    rd = RunDir.create(cfg)
    dataset_dir = rd.path("dataset")
    spec = shards.ShardSpec(len(layer_ids), sz["hidden"], torch.bfloat16)
    g = torch.Generator(device=gen_device).manual_seed(1)
    rows = torch.randint(0, sz["vocab"], (n, doc_len), generator=torch.Generator().manual_seed(2))
    t0 = time.perf_counter()
    for i in range(n):
        hs = torch.randn(doc_len, len(layer_ids), sz["hidden"], generator=g, device=gen_device).bfloat16().cpu()
        path = shards.write_shard(dataset_dir, i, rows[i], hs, rows[i], spec)
        if not args.warm_cache:
            drop_page_cache(path)
    gen_s = time.perf_counter() - t0
    loss_mask = torch.ones(n, doc_len, dtype=torch.int64)
    Dataset.from_dict({"input_ids": rows.tolist(), "loss_mask": loss_mask.tolist(), "seq_len": [doc_len] * n}
                      ).save_to_disk(str(dataset_dir))
    freq: dict[int, int] = {}
    for tok in rows[:n_train].flatten().tolist():
        freq[tok] = freq.get(tok, 0) + 1
    torch.save(freq, rd.path("token_freq.pt"))
    bytes_ = n * doc_len * len(layer_ids) * sz["hidden"] * 2
    rd.write_manifest(get_stage("02"), started=time.time(), outputs={
        "dataset": dataset_dir, "token_freq": rd.path("token_freq.pt"), "model_dir": str(target)},
        metrics={"samples": n, "train_rows": n_train, "val_rows": n_val, "tokens": n * doc_len, "bytes": bytes_,
                 "layer_ids": layer_ids, "hidden_size": sz["hidden"], "num_layers": sz["layers"],
                 "vocab_size": sz["vocab"], "dtype": "bfloat16", "tokens_per_s": None})
    # stage 04 with the workbook's own functions (not verifier.run: no coverage plot, so no matplotlib needed here)
    vt, _ = verifier.extract_verifier(target, rd.path("verifier"))
    dv = verifier.make_draft_vocab(freq, sz["draft_vocab"], sz["vocab"])
    paths = verifier.write_draft_vocab(dv, rd.path("draft_vocab"))
    StageRun(get_stage("04"), cfg, rd).finish(StageResult(
        outputs={"verifier_dir": rd.path("verifier"), "t2d": paths["t2d"], "d2t": paths["d2t"]},
        metrics={"draft_vocab_size": dv.k, "coverage": None, "tied": vt.tied, "target_vocab_size": sz["vocab"]}))
    log(f"wrote {n} shards ({bytes_ / 1e9:.2f} GB) in {gen_s:.1f} s; page cache "
        f"{'kept' if args.warm_cache else 'dropped'}")
    return cfg, rd, {"shards": n, "shard_bytes": bytes_, "write_s": round(gen_s, 2)}


def synthetic_batches(sz: dict[str, Any], n: int, device: str, dtype: torch.dtype) -> InMemoryLoader:
    """n packed batches built by speculators' own CollateFn (+ shift_batch) from random documents, on the device."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    doc_len = sz["packed"] // sz["docs"]
    n_aux, h = len(sz["aux"]), sz["hidden"]
    collate = CollateFn(sz["packed"], h, num_target_layers=n_aux, dtype=dtype, preprocess=shift_batch)
    distinct = []
    for b in range(min(n, 4)):
        g = torch.Generator().manual_seed(100 + b)
        docs = []
        for _ in range(sz["docs"]):
            docs.append({
                "hidden_states": torch.randn(doc_len, n_aux * h, generator=g).to(dtype),
                "input_ids": torch.randint(0, sz["vocab"], (doc_len,), generator=g),
                "verifier_last_hidden_states": torch.randn(doc_len, h, generator=g).to(dtype),
                "loss_mask": torch.ones(doc_len, dtype=torch.int64),
                "lengths": torch.tensor([doc_len]), "position_ids": torch.arange(doc_len),
            })
        batch = collate(docs)
        distinct.append({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    return InMemoryLoader(distinct[i % len(distinct)] for i in range(n))


class InMemoryLoader(list):
    """A list of ready batches that the Trainer can iterate like its DataLoader (len, iteration, batch_sampler)."""

    batch_sampler = None


def bench_bare(rd, cfg, sz: dict[str, Any], res, device: str) -> dict[str, Any]:
    """(a): speculators' Trainer.train_epoch over in-memory device batches, same model and settings as (b)."""
    from speculators.train.trainer import Trainer, TrainerConfig

    from eagle3lib import train
    from eagle3lib.train import speculators_glue

    speculators_glue.ensure_cpu_patch(res.device)
    if res.device == "cpu":
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    torch.manual_seed(0)
    inp = train.inputs_from_run(rd)
    save = Path(tempfile.mkdtemp(prefix="bare-", dir=rd.root))
    model, staged, _ = train.build_draft(inp, cfg.train, res, save)
    dtype = getattr(torch, res.hidden_states_dtype)
    n = sz["warmup"] + sz["steps"]
    batches = synthetic_batches(sz, n, device, dtype)
    tconf = TrainerConfig(lr=1e-4, num_epochs=1, save_path=str(save), train_call_kwargs=staged.train_call_kwargs,
                          val_call_kwargs=staged.val_call_kwargs, scheduler_type="none", hidden_states_dtype=dtype,
                          log_freq=1, max_steps=n)
    stamps: list[float] = []

    def on_step() -> None:
        sync(device)
        stamps.append(time.perf_counter())

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with speculators_glue.quiet_bars_and_capture():
        with speculators_glue.fused_adamw(res.device):  # as the stage does
            trainer = Trainer(model, tconf, batches, None)  # type: ignore[arg-type]
        fused = [g.get("fused") for opt in trainer.optimizers for g in opt.param_groups]
        sync(device)
        t0 = time.perf_counter()
        trainer.train_epoch(0, step_callback=on_step)
    tokens = [int((b["document_ids"] != -1).sum()) for b in batches]
    w = sz["warmup"]
    measured = sum(tokens[w:len(stamps)])
    secs = stamps[-1] - stamps[w - 1] if w > 0 else stamps[-1] - t0
    out = {"steps": len(stamps) - w, "warmup_steps": w, "tokens_per_step": tokens[0], "seconds": round(secs, 3),
           "tokens_per_s": round(measured / secs, 1), "step_ms": round(1000 * secs / (len(stamps) - w), 2),
           "warmup_s": round(stamps[w - 1] - t0, 2) if w > 0 else 0.0, "fused_adamw": all(fused)}
    if device == "cuda":
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    del trainer, model, batches
    shutil.rmtree(save, ignore_errors=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_stage(rd, sz: dict[str, Any], res) -> dict[str, Any]:
    """(b): the workbook's stage 05 end to end; throughput from its own per-step clock, after the warm-up."""
    from eagle3lib import train

    if res.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train.train(rd, resolved=res, progress=True)
    wall = time.perf_counter() - t0
    steps = json.loads(Path(result["curves"]).read_text())["steps"]
    after = steps[sz["warmup"]:]
    tokens = sum(s["tokens"] for s in after)
    secs = sum(s["tokens"] / s["tokens_per_s"] for s in after if s["tokens_per_s"])
    out = {"steps": len(after), "warmup_steps": sz["warmup"], "tokens_per_step": after[0]["tokens"] if after else None,
           "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 1) if secs else None,
           "step_ms": round(1000 * secs / len(after), 2) if after else None, "stage_wall_s": round(wall, 2),
           "val_eal": result["val_eal"]}
    if res.device == "cuda":
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return out


def bench_loader(rd, sz: dict[str, Any], res) -> dict[str, Any]:
    """(c): stage 05's data path alone (read shards, pack, collate, pin, copy to the device), no training: the most
    tokens/s the data path can feed. (b) well below min((a), (c)) means the two do not overlap."""
    from eagle3lib import train

    inp = train.inputs_from_run(rd)
    loader, _ = train.make_loaders(inp, rd.cfg.train, res)
    n, w = sz["warmup"] + sz["steps"], sz["warmup"]
    stamps, tokens = [], []
    t0 = time.perf_counter()
    while len(stamps) < n:
        for batch in loader:
            if res.device == "cuda":
                batch["hidden_states"].sum().item()  # the copy has landed
            tokens.append(loader.last_tokens)
            stamps.append(time.perf_counter())
            if len(stamps) >= n:
                break
    secs = stamps[-1] - stamps[w - 1] if w > 0 else stamps[-1] - t0
    return {"steps": n - w, "tokens_per_s": round(sum(tokens[w:]) / secs, 1), "batch_ms": round(1000 * secs / (n - w), 2),
            "workers": res.num_workers, "first_batch_s": round(stamps[0] - t0, 2)}


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "speculators", "triton", "datasets"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    out["cpus"] = os.cpu_count()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU smoke test")
    p.add_argument("--workdir", default=None, help="where shards go (default: a temp dir, removed afterwards)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--workers", type=int, default=None, help="data loader workers for (b)")
    p.add_argument("--prefetch", type=int, default=None, help="data loader prefetch factor for (b)")
    p.add_argument("--warm-cache", action="store_true", help="keep the shards in the page cache")
    p.add_argument("--no-device-prefetch", action="store_true", help="(b) without the side-stream device copy")
    p.add_argument("--only", choices=["a", "b", "c"], default=None)
    p.add_argument("--loss", choices=["auto", "eager", "fused"], default="auto",
                   help="train.loss_implementation (auto: fused only if its probe passes here); run twice to compare")
    p.add_argument("--attn", choices=["auto", "sdpa", "flex_attention"], default="auto", help="train.draft_attn_impl")
    args = p.parse_args()
    sz = dict(TINY if args.tiny else FULL)
    for key in ("steps", "warmup", "workers", "prefetch"):
        if getattr(args, key) is not None:
            sz[key] = getattr(args, key)
    args.workers, args.prefetch = sz["workers"], sz["prefetch"]
    from eagle3lib.common.device import auto_device

    device = auto_device()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from eagle3lib import train

    work = Path(args.workdir or tempfile.mkdtemp(prefix="eagle3-train-bench-"))
    report: dict[str, Any] = {"benchmark": "train", "device": device, "sizes": sz, "versions": versions(),
                              "argv": sys.argv[1:]}
    try:
        cfg, rd, data = write_run(work, sz, args, device)
        report["data"] = data
        res = train.resolve_settings(cfg.train, device)
        report["resolved"] = {"attn_impl": res.attn_impl, "loss_implementation": res.loss_implementation,
                              "hidden_states_dtype": res.hidden_states_dtype, "num_workers": res.num_workers,
                              "reasons": res.reasons}
        log(f"settings: {res.attn_impl}, {res.loss_implementation} loss, {res.hidden_states_dtype}")
        parts = [("a_bare", "(a) bare speculators step", lambda: bench_bare(rd, cfg, sz, res, device)),
                 ("b_stage", "(b) workbook stage 05 from disk", lambda: bench_stage(rd, sz, res)),
                 ("c_loader", "(c) stage 05 data path alone", lambda: bench_loader(rd, sz, res))]
        for key, label, fn in parts:
            if args.only not in (None, key[0]):
                continue
            try:
                report[key] = fn()
                log(f"{label}: {report[key]['tokens_per_s']:,.0f} tok/s")
            except Exception as e:  # noqa: BLE001 - record it (e.g. a forced fused loss failing) and go on
                report[key] = {"error": f"{e.__class__.__name__}: {str(e)[-400:]}"}
                log(f"{label} FAILED: {report[key]['error']}")
            write_report(args.out, report)  # after each part: a run cut short keeps what it measured
        if "tokens_per_s" in report.get("a_bare", {}) and "tokens_per_s" in report.get("b_stage", {}):
            report["ratio_b_over_a"] = round(report["b_stage"]["tokens_per_s"] / report["a_bare"]["tokens_per_s"], 4)
            log(f"ratio (b)/(a) = {report['ratio_b_over_a']:.3f}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    write_report(args.out, report)
    log(f"wrote {args.out}")
    return 0


def write_report(path: str, report: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
