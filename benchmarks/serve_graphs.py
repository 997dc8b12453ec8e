"""Benchmark (not a test): a speculating `vllm serve`'s time per step by requests in flight, with the CUDA graph sizes
stage 06 gives a draft's server on a GPU (`eagle3lib.evaluate.serve_plan.graph_sizes`) and with vLLM's default sizes, in
one run.

Why: vLLM 0.26's V2 model runner captures a draft server's full decode graphs at its default sizes rounded up to
1 + k, and a step whose tokens land on a size without its full graph runs piecewise (k = 2 at 4 requests: 7.7-9.9 ms
a step against 3.4-4.3 around it, benchmarks/results/serve_steps_qwen15_x4_h200_2026-12-05.json;
docs/serving.md#cuda-graph-sizes-with-a-draft). The sizes change a step's time, not what a draft accepts, so a random
draft measures them in minutes and with no training: every step still verifies 1 + k tokens per request.

What runs is stage 06's own serve step (the config's `evaluate.serve_grid` servers and the target alone, side by
side when the config says so, a level at a time) on a run folder made here: the config's target, a random EAGLE-3
draft of it (speculators' `Eagle3DraftModel`, the layers and draft vocabulary size stage 05 would use), the bundled
prompts as held-out prompts. Arm `graph_sizes` is stage 06 as it is; arm `vllm_default` adds
`--compilation-config` with vLLM's default sizes through `evaluate.serve_args`, which comes after the stage's own
sizes and wins. Then benchmarks/serve_steps.py's replay of each arm's `vllm bench serve --save-detailed` files.

    python benchmarks/serve_graphs.py --config configs/qwen-coder-1.5b-x4-h200.yaml --out RESULT.json --png R.png \\
        --note "date, machine, commit, command"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from serve_steps import plot, server_steps

ARMS = ("graph_sizes", "vllm_default")


def random_draft(target_dir: Path, target_config: Any, layer_ids: list[int], draft_vocab: int, out: Path,
                 seed: int = 0) -> Path:
    """An untrained EAGLE-3 draft of the target, saved where vLLM loads it: one Llama decoder layer with the
    target's sizes (`target_config`, its transformers config; speculators' EAGLE-3 builds its layer from a table of
    model types, which in the speculators the GPU host runs has no qwen2: "KeyError: 'qwen2'" on the 1.5B; the
    target's per-layer `layer_types`, 28 entries, would not fit one layer), on the aux layers `layer_ids[:-1]`, the
    first `draft_vocab` token ids as its vocabulary."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import LlamaConfig

    shape = target_config.to_dict()
    vc = LlamaConfig(**{k: v for k, v in shape.items() if k not in ("model_type", "architectures", "layer_types")})
    vc.num_hidden_layers = 1
    d2t, t2d = build_vocab_mappings_from_distribution({i: 1 for i in range(draft_vocab)}, draft_vocab, vc.vocab_size)
    torch.manual_seed(seed)
    draft = Eagle3DraftModel.from_training_args(vc, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target_dir),
                                                draft_vocab_size=draft_vocab, norm_before_residual=True, ttt_steps=3,
                                                target_layer_ids=layer_ids[:-1], draft_attn_impl="sdpa")
    draft.save_pretrained(str(out))
    return out


def make_run(config: Path, root: Path, name: str, overrides: list[str],
             draft: Path | dict[str, Path] | None) -> tuple[Path, Any]:
    """A run folder whose stage 06 serve step measures a random draft of `config`'s target on the bundled prompts:
    the manifests of stages 02, 04 and 05 hold what that step reads and nothing else. Returns (its config file, the
    draft: `draft` when given, a checkpoint or {algorithm: checkpoint}, else an EAGLE-3 one made here)."""
    from transformers import AutoConfig

    from eagle3lib.common import atomic, jsonl
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import RunDir
    from eagle3lib.common.sources import bundled_prompts_path
    from eagle3lib.common.stages import get_stage
    from eagle3lib.common.target import resolve_layer_ids, resolve_model_path

    cfg = load_config(config, [f"run.output_root={root}", f"run.name={name}", "evaluate.methods=[serve]",
                               "evaluate.benchmarks=[]", *overrides])
    target_dir = resolve_model_path(cfg.target)
    hf = AutoConfig.from_pretrained(target_dir)
    layer_ids = resolve_layer_ids(cfg.target.layer_ids, hf.num_hidden_layers)
    rd = RunDir.create(cfg)
    if draft is None:  # stage 04's size rule: at most the target's vocabulary (eagle3lib/verifier/draft_vocab.py)
        draft = random_draft(target_dir, hf, layer_ids, min(cfg.verifier.draft_vocab_size, hf.vocab_size),
                             rd.path("draft"))
    prompts = jsonl.read(bundled_prompts_path())[: cfg.evaluate.num_prompts or None]
    atomic.write_text(rd.path("data", "eval.jsonl"), "".join(json.dumps(p) + "\n" for p in prompts))
    rd.write_manifest(get_stage("02"), started=time.time(), outputs={
        "dataset": rd.path("dataset"), "eval_prompts": rd.path("data", "eval.jsonl"), "model_dir": str(target_dir)},
        metrics={"layer_ids": layer_ids, "train_rows": 0, "val_rows": 0, "benchmarks": {}})
    rd.write_manifest(get_stage("04"), started=time.time(), outputs={"verifier_dir": rd.path("verifier")}, metrics={})
    drafts = draft if isinstance(draft, dict) else {"eagle3": draft}  # {algorithm: checkpoint}
    rd.write_manifest(get_stage("05"), started=time.time(),
                      outputs={f"checkpoint_{a}": str(c) for a, c in drafts.items()}, metrics={"algorithms": list(drafts)})
    path = root / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path, draft


def default_sizes_flag() -> list[str]:
    """`evaluate.serve_args` that put a server's CUDA graphs back at vLLM's default sizes."""
    from eagle3lib.evaluate.serve_plan import vllm_graph_sizes

    return ["--compilation-config", json.dumps({"cudagraph_capture_sizes": vllm_graph_sizes()})]


def run_arm(args: argparse.Namespace, arm: str, draft: Path | None) -> tuple[dict[str, Any], Path]:
    """One arm: its run folder, stage 06 in a subprocess (its log beside the run's config), the steps replayed."""
    overrides = [f"evaluate.serve_concurrency={json.dumps(args.levels)}", f"evaluate.serve_requests={args.requests}",
                 f"evaluate.max_new_tokens={args.max_new_tokens}", *args.override]
    if args.grid:
        overrides.append("evaluate.serve_grid=" + json.dumps([{"num_speculative_tokens": k} for k in args.grid]))
    if arm == "vllm_default":
        overrides.append("evaluate.serve_args=" + json.dumps(default_sizes_flag()))
    name = f"{args.run}-{arm.replace('_', '-')}"
    config, draft = make_run(args.config, args.root, name, overrides, draft)
    log = args.root / f"{name}.log"
    t = time.time()
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "run", "--config", str(config), "--stages", "06"],
                            stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    run_dir = args.root / name
    steps = server_steps(run_dir / "eval" / "serve") if (run_dir / "eval" / "serve").is_dir() else {}
    results = run_dir / "eval" / "results.json"
    serve = json.loads(results.read_text()).get("serve", {}) if results.is_file() else {}
    return {"stage06_exit": rc, "stage06_s": round(time.time() - t, 1), "log": str(log), "run": str(run_dir),
            "baseline_drift": serve.get("baseline_drift"), "steps_by_server": steps}, draft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="its target, grid and side-by-side settings are used")
    ap.add_argument("--root", type=Path, default=Path("outputs"), help="where the arms' run folders go")
    ap.add_argument("--run", default="serve-graphs", help="the arms' run folders are RUN-graph-sizes, RUN-vllm-default")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--grid", nargs="*", type=int, default=[], help="draft tokens per server (default: the config's)")
    ap.add_argument("--levels", nargs="+", type=int, default=[1, 2, 4, 5, 8, 9, 12, 13, 16],
                    help="concurrency levels: a level's tail also measures every count below it")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-p", "--override", action="append", default=[], help="more config overrides, key=value")
    ap.add_argument("--timeout", type=int, default=900, help="seconds each arm's stage 06 may take")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"benchmark": "serve_graphs", "config": str(args.config), "levels": args.levels,
                           "requests": args.requests, "max_new_tokens": args.max_new_tokens, "note": args.note,
                           "arms": {}}
    draft = None
    for arm in args.arms:  # one draft for both arms: the second reuses the first's checkpoint
        out["arms"][arm], draft = run_arm(args, arm, draft)
        args.out.write_text(json.dumps(out, indent=1) + "\n")  # an arm cut short keeps the one before it
        for server, by in out["arms"][arm]["steps_by_server"].items():
            print(arm, server, " ".join(f"{n}:{v['median_ms']}" for n, v in by.items() if v["intervals"] >= 5))
    if args.png and any(a["steps_by_server"] for a in out["arms"].values()):  # one line per server and arm
        plot({f"{server} ({arm})": by for arm, a in out["arms"].items() for server, by in a["steps_by_server"].items()},
             args.png, "time per step by requests in flight: a random draft's servers")
    return 0 if all(a["stage06_exit"] == 0 for a in out["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
