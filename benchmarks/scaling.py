"""Benchmark (not a test): does the workbook scale over the GPUs of one machine? 1 GPU vs N GPUs in one run.

    extract: stage 02's data-parallel capture (transformers backend, one process per GPU, the code path
             `extract.devices: auto` takes) on a random-weight Llama-3.1-8B-shaped target written to disk once.
             The SAME code path runs with 1 process and with N, over the same rows; tokens/s is counted from each
             run's first written shard to its last (steady state: the per-process model load is reported apart).
             Afterwards every shard the N processes wrote is checked: one valid dataset.
    train:   stage 05 under `torchrun --nproc-per-node 1` and `--nproc-per-node N` (speculators' DDP) on a run that
             already has stages 02 and 04, each in a hard-linked copy of it, for one epoch capped at --steps
             optimizer steps (an epoch shorter than that is N times fewer steps on N GPUs: the same data).
             tokens/s = rank 0's tokens/s x N (the packing sampler balances tokens over ranks), from step 20 on;
             the loss and acceptance curves of both runs are written side by side, every 10 steps.

    python benchmarks/scaling.py extract --gpus 2 --out benchmarks/results/scaling_extract_h200x2_$(date +%F).json
    python benchmarks/scaling.py train --config configs/smollm2-h200.yaml --run smollm2-h200 --gpus 2 \
        --steps 300 --out benchmarks/results/scaling_train_h200x2_$(date +%F).json
Goal: N GPUs >= 0.9 x N x 1 GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3lib.common import shards  # noqa: E402
from eagle3lib.common.config import load_config  # noqa: E402
from eagle3lib.extract import capture, data_parallel  # noqa: E402

LLAMA_31_8B = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
TINY = dict(layers=4, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=1024)


def log(msg: str) -> None:
    print(f"[scaling] {msg}", flush=True)


def write_random_target(path: Path, shape: dict[str, int]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model


def extract_once(work: Path, model_dir: Path, layer_ids: list[int], input_ids: list[list[int]],
                 devices: list[str], hidden: int, batch_tokens: int) -> dict[str, Any]:
    cfg = load_config(None, [f"target.model={model_dir}", "target.dtype=bfloat16", f"target.layer_ids={layer_ids[:-1]}",
                             f"extract.batch_tokens={batch_tokens}", f"extract.devices={','.join(devices)}"])
    ddir = work / f"dataset-{len(devices)}"
    shutil.rmtree(ddir, ignore_errors=True)
    spec = capture.shard_spec(cfg, layer_ids, hidden)
    stamps: list[tuple[float, int]] = []
    ready: list[float] = []
    t0 = time.perf_counter()
    data_parallel.capture_data_parallel(cfg, model_dir, layer_ids, ddir, input_ids, list(range(len(input_ids))),
                                        devices, spec, lambda rows, tokens: stamps.append((time.perf_counter(), tokens)),
                                        on_ready=lambda dev: ready.append(time.perf_counter()))
    wall = time.perf_counter() - t0
    all_ready = max(ready)  # every process has its model: from here on all of them compute
    steady_tokens = sum(t for ts, t in stamps if ts > all_ready)
    steady_s = stamps[-1][0] - all_ready
    written = sorted(shards.shard_dir(ddir).glob("hs_*.safetensors"))
    bad = [i for i in range(len(input_ids)) if shards.check_shard_file(shards.shard_path(ddir, i), input_ids[i], spec)]
    out = {"gpus": len(devices), "rows": len(input_ids), "tokens": sum(map(len, input_ids)),
           "wall_s": round(wall, 2), "until_all_loaded_s": round(all_ready - t0, 2),
           "steady_tokens_per_s": round(steady_tokens / steady_s, 1) if steady_s > 0 else None,
           "wall_tokens_per_s": round(sum(map(len, input_ids)) / wall, 1),
           "shards_written": len(written), "invalid_shards": bad[:10], "n_invalid": len(bad)}
    shutil.rmtree(ddir, ignore_errors=True)
    return out


def cmd_extract(args: argparse.Namespace) -> dict[str, Any]:
    shape = dict(TINY if args.tiny else LLAMA_31_8B)
    n = shape["layers"]
    layer_ids = [2, n // 2, n - 3, n] if n >= 6 else [1, 2, 3, n]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eagle3-scaling-"))
    try:
        model_dir = work / "target"
        t = time.perf_counter()
        write_random_target(model_dir, shape)
        log(f"target written in {time.perf_counter() - t:.1f} s")
        g = torch.Generator().manual_seed(0)
        n_rows = args.rows or (16 if args.tiny else 384)
        seq = args.seq_len or (64 if args.tiny else 2048)
        input_ids = [torch.randint(0, shape["vocab"], (seq,), generator=g).tolist() for _ in range(n_rows)]
        gpus = args.gpus
        devs = [f"cuda:{i}" for i in range(gpus)] if torch.cuda.is_available() else ["cpu"] * gpus
        runs = {}
        for k in (1, gpus):
            log(f"extracting on {k} device(s)")
            runs[str(k)] = extract_once(work, model_dir, layer_ids, input_ids, devs[:k], shape["hidden"],
                                        args.batch_tokens)
            log(json.dumps(runs[str(k)]))
        one, many = runs["1"]["steady_tokens_per_s"], runs[str(gpus)]["steady_tokens_per_s"]
        return {"what": "extract", "shape": shape, "layer_ids": layer_ids, "runs": runs,
                "scaling_efficiency": round(many / (gpus * one), 3) if one and many else None,
                "goal": ">= 0.9"}
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from eagle3lib.common.config import load_config as load
    from eagle3lib.common.rundir import fork_run, run_root
    from eagle3lib.train import launch_command

    cfg = load(args.config, [f"run.name={args.run}", *args.param])
    src = run_root(cfg)
    if not (src / "manifests").is_dir():
        raise SystemExit(f"{src} has no manifests: run stages 02-04 first")
    runs: dict[str, Any] = {}
    for k in (1, args.gpus):
        name = f"{args.run}-scale{k}"
        dst = fork_run(src, src.parent / name)
        cmd = launch_command(args.config, name, ["train.epochs=1", f"train.max_steps={args.steps}", "train.val_every=1",
                                                 *args.param], k) + ["--no-manifest"]
        log(" ".join(cmd))
        t = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=REPO)
        wall = time.perf_counter() - t
        result = json.loads((dst / "draft" / "eagle3" / "result.json").read_text())
        curves = json.loads((dst / "draft" / "eagle3" / "curves.json").read_text())
        steps = curves["steps"]
        skip = min(20, len(steps) // 5)  # compile/warm-up steps
        tok = sum(s["tokens"] for s in steps[skip:])
        secs = sum(s["tokens"] / s["tokens_per_s"] for s in steps[skip:] if s["tokens_per_s"])
        runs[str(k)] = {"gpus": k, "wall_s": round(wall, 1), "steps": len(steps),
                        "rank0_tokens_per_s": round(tok / secs, 1) if secs else None,
                        "tokens_per_s": round(k * tok / secs, 1) if secs else None,
                        "val_eal": result["val_eal"], "val_loss": result["val_loss"],
                        "loss_every_10_steps": [round(s["loss"], 4) for s in steps[::10]],
                        "eal_every_10_steps": [round(s["eal"], 4) for s in steps[::10]]}
        log(json.dumps({k2: v for k2, v in runs[str(k)].items() if "every" not in k2}))
    one, many = runs["1"]["tokens_per_s"], runs[str(args.gpus)]["tokens_per_s"]
    return {"what": "train", "config": args.config, "run": args.run, "steps": args.steps, "runs": runs,
            "scaling_efficiency": round(many / (args.gpus * one), 3) if one and many else None, "goal": ">= 0.9"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("extract")
    e.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke test: N processes on the CPU)")
    e.add_argument("--rows", type=int, default=None)
    e.add_argument("--seq-len", type=int, default=None)
    e.add_argument("--batch-tokens", type=int, default=16384)
    e.add_argument("--workdir", default=None)
    t = sub.add_parser("train")
    t.add_argument("--config", required=True)
    t.add_argument("--run", required=True, help="a run that has stages 02 and 04")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="the config overrides the run was made with (its stage 02/04 lineage must match)")
    for p in (e, t):
        p.add_argument("--gpus", type=int, default=max(2, torch.cuda.device_count()))
        p.add_argument("--out", required=True)
    args = ap.parse_args()
    result = cmd_extract(args) if args.what == "extract" else cmd_train(args)
    result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    result["versions"] = {"torch": torch.__version__, "python": platform.python_version()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"scaling efficiency {result['scaling_efficiency']} -> {out}")


if __name__ == "__main__":
    main()
