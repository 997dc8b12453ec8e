"""Benchmark (not a test): what a step with each drafter costs a `vllm serve` of the config's target, each server
alone, with untrained drafts: the τ each drafter needs before it pays.

Why untrained: a draft's forward costs the same whatever its weights, so a random EAGLE-3, P-EAGLE and DFlash draft
of the target (speculators' own model classes, the layers, sizes and draft vocabulary stage 05 would build) measure
what one step of speculation costs against a plain step, per drafter and k, in minutes and with no training. A
random draft accepts (almost) nothing: every step yields one token, so the step cost is the time per output token
with the draft ÷ without it, and that is the τ the drafter needs to break even at that load (docs/serving.md#when-a-
draft-pays). It also shows that the installed vLLM loads and serves each drafter's checkpoint.

What runs is stage 06's own serve step (one server per drafter and setting of `--grid` and the target alone, one
after another, each alone, at each `--levels` concurrency) on a run folder made here (benchmarks/serve_graphs.py's
`make_run`): the config's target, the drafts, the bundled prompts as held-out prompts.

    python benchmarks/drafter_steps.py --config configs/qwen-coder-1.5b-h200.yaml --out RESULT.json \\
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# k = 3 for both chain drafters (the same tokens per step: one forward against three), DFlash's whole default block
GRID = [{"algorithm": "eagle3", "num_speculative_tokens": 3}, {"algorithm": "peagle", "num_speculative_tokens": 3},
        {"algorithm": "dflash", "num_speculative_tokens": 15}]


def with_head_dim(target_dir: Path, out: Path) -> Path:
    """A folder holding the target's config.json with `head_dim` written out (hidden_size / attention heads) where
    the target's own leaves it implicit (Qwen2): speculators builds the draft layer's config with the verifier's
    head_dim, and transformers 5.17's Qwen3Config refuses None ("Field 'head_dim' expected int")."""
    import json

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    folder = Path(str(out) + "-verifier-config")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def random_draft(algorithm: str, target_dir: Path, layer_ids: list[int], draft_vocab: int, out: Path,
                 seed: int = 0) -> Path:
    """An untrained draft of the target built as stage 05 builds one (speculators' `create_transformer_layer_config`
    and the drafter's `from_training_args` with speculators' defaults for it: DFlash 5 layers and a block of 16,
    P-EAGLE 8 depths), on the aux layers `layer_ids[:-1]`, the first `draft_vocab` token ids as its vocabulary,
    saved where vLLM loads it."""
    import torch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.utils import resolve_mask_token_id
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from eagle3lib.common.drafters import model_class

    layers = 5 if algorithm == "dflash" else 1
    tl = create_transformer_layer_config(verifier_name_or_path=str(with_head_dim(target_dir, out)), num_layers=layers,
                                         draft_arch="llama" if algorithm == "eagle3" else "qwen3", hidden_act="silu",
                                         sliding_window=2048, full_attention_indices=[])
    d2t, t2d = build_vocab_mappings_from_distribution({i: 1 for i in range(draft_vocab)}, draft_vocab, tl.vocab_size)
    extra: dict[str, Any] = {"ttt_steps": 3} if algorithm == "eagle3" else {
        "mask_token_id": resolve_mask_token_id(str(target_dir), tl.vocab_size, None)}
    extra |= {"num_depths": 8} if algorithm == "peagle" else {"block_size": 16} if algorithm == "dflash" else {}
    torch.manual_seed(seed)
    draft = model_class(algorithm).from_training_args(
        tl, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target_dir), draft_vocab_size=draft_vocab,
        norm_before_residual=True, target_layer_ids=layer_ids[:-1], draft_attn_impl="sdpa", **extra)
    draft.save_pretrained(str(out))
    return out


def make_drafts(config: Path, root: Path, algorithms: list[str]) -> dict[str, Path]:
    from transformers import AutoConfig

    from eagle3lib.common.config import load_config
    from eagle3lib.common.target import resolve_layer_ids, resolve_model_path

    cfg = load_config(config)
    target_dir = resolve_model_path(cfg.target)
    hf = AutoConfig.from_pretrained(target_dir)
    layer_ids = resolve_layer_ids(cfg.target.layer_ids, hf.num_hidden_layers)
    vocab = min(cfg.verifier.draft_vocab_size, hf.vocab_size)  # stage 04's size rule
    return {a: random_draft(a, target_dir, layer_ids, vocab, root.resolve() / f"random-{a}") for a in algorithms}


def summary(serve: dict[str, Any]) -> dict[str, Any]:
    """Per drafter setting and level: the time per output token with ÷ without (= the step cost with a draft that
    accepts nothing), output tokens/s with ÷ without, τ (1 + the little it accepted), and each server's start."""
    out = {}
    for label, st in (serve.get("settings") or {}).items():
        levels = {}
        for c, lv in st["by_level"].items():
            tpot = (lv["draft"].get("tpot_ms") or {}).get("mean"), (lv["baseline"].get("tpot_ms") or {}).get("mean")
            levels[c] = {"step_cost": round(tpot[0] / tpot[1], 4) if all(tpot) else None,
                         "step_cost_tps": lv.get("step_cost"), "output_tok_s_ratio": lv.get("output_tok_s_ratio"),
                         "tau": lv.get("tau"), "tpot_ms": tpot[0], "baseline_tpot_ms": tpot[1]}
        out[label] = {"algorithm": st.get("algorithm"), "k": st.get("k"), "by_level": levels,
                      "start_s": (st.get("command") or {}).get("start_s")}
    return out


def from_partial(workdir: Path) -> dict[str, Any]:
    """What a stage 06 that did not finish measured (eval/serve/partial.json: every finished server and level), per
    server: its level cells' TPOT, output tokens/s and τ, and its start; with the target alone's where it ran."""
    try:
        cells = json.loads((workdir / "partial.json").read_text())["methods"]
    except (OSError, ValueError, KeyError):
        return {}
    out: dict[str, Any] = {}
    for name, cell in cells.items():
        server, _, what = name.rpartition(" ")
        value = cell["value"]
        if what.startswith("c="):
            out.setdefault(server, {"by_level": {}})["by_level"][what[2:]] = {
                "tpot_ms": (value.get("tpot_ms") or {}).get("mean"), "output_tok_s": value.get("output_throughput"),
                "tau": (value.get("acceptance") or {}).get("tau")}
        elif what == "command":
            out.setdefault(server, {"by_level": {}})["start_s"] = value.get("start_s")
    return out


def failures(workdir: Path) -> dict[str, str]:
    """Each server whose log ends in an error, with vLLM's own message (the line after its last ValidationError or
    Error)."""
    out = {}
    for log in sorted(workdir.glob("*.server.log")):
        lines = [ln.split(") ", 1)[-1].strip() for ln in log.read_text(errors="replace").splitlines()]
        errors = [ln for ln in lines if "Value error" in ln or ln.startswith(("ValueError", "RuntimeError"))]
        if errors:
            out[log.name.removesuffix(".server.log")] = errors[-1][:400]
    return out


def main() -> int:
    from serve_graphs import make_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="its target and draft vocabulary size are used")
    ap.add_argument("--root", type=Path, default=Path("outputs"))
    ap.add_argument("--run", default="drafter-steps")
    ap.add_argument("--grid", default=json.dumps(GRID), help="evaluate.serve_grid (JSON): the servers")
    ap.add_argument("--levels", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=int, default=1500, help="seconds stage 06 may take")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    grid = json.loads(args.grid)
    algorithms = list(dict.fromkeys(e["algorithm"] for e in grid))
    drafts = make_drafts(args.config, args.root, algorithms)
    overrides = [f"evaluate.serve_concurrency={json.dumps(args.levels)}", f"evaluate.serve_requests={args.requests}",
                 f"evaluate.max_new_tokens={args.max_new_tokens}", f"evaluate.serve_grid={json.dumps(grid)}",
                 "evaluate.serve_side_by_side_kv_gib=null", f"train.algorithms={json.dumps(algorithms)}"]
    config, _ = make_run(args.config, args.root, args.run, overrides, drafts)
    log = args.root / f"{args.run}.log"
    t = time.time()
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "run", "--config", str(config), "--stages", "06"],
                            stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, cwd=REPO).returncode
    results = args.root / args.run / "eval" / "results.json"
    serve = json.loads(results.read_text()).get("serve", {}) if results.is_file() else {}
    out = {"benchmark": "drafter_steps", "note": args.note, "config": str(args.config), "levels": args.levels,
           "requests": args.requests, "max_new_tokens": args.max_new_tokens, "stage06_exit": rc,
           "stage06_s": round(time.time() - t, 1), "servers_alone": not serve.get("side_by_side"),
           "baseline_start_s": (serve.get("baseline_command") or {}).get("start_s"),
           "baseline_output_tok_s": {c: lv["baseline"].get("output_throughput")
                                     for c, lv in (serve.get("by_level") or {}).items()},
           "settings": summary(serve), "log": str(log)}
    if rc != 0:  # what finished before the failure, and the servers' own errors
        workdir = args.root / args.run / "eval" / "serve"
        out.update(finished=from_partial(workdir), server_errors=failures(workdir))
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for label, s in out["settings"].items():
        print(label, {c: v["step_cost"] for c, v in s["by_level"].items()})
    return rc


if __name__ == "__main__":
    sys.exit(main())
