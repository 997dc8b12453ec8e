"""Benchmark (not a test): a finished run's figures as one result JSON — what a recipe run is judged by.

    python benchmarks/recipe.py --run-dir outputs/qwen-coder-1.5b-h200 \
        --out benchmarks/results/recipe_qwen15_h200_<date>.json --note "date, commit, machine, command"

From the run folder alone (manifests, draft/eagle3/result.json, eval/results.json), so it reads a run brought back from the
GPU host as well as one made here:
  train_tokens, train_rows, optimizer_steps, epochs, optimizers, val_eal, val_tau_walk, train_seconds   (stage 05)
  tau_by_benchmark      {"heldout": ..., "mt_bench": ..., ...}: the draft's tau on the held-out prompts and on each
                        evaluate.benchmarks set, from the server's counters where the serve step ran (else the
                        embedded decoder, else vLLM in-process: `eagle3lib.evaluate.compare.COMPARE_LIVE`), and which
                        row it is (`tau_row`); `tau_heldout_by` the same row's tau per held-out source (or
                        category: stage 06's `held_out_groups`)
  speedup_by_concurrency  output tokens/s with the draft / without it at each level, at that level's best setting of
                        evaluate.serve_grid; `recommended_settings` beside it (the setting per level, or None = serve
                        no draft there) and the report card's `verdict`
  stage_seconds, gpu_seconds (stages 02, 05 and 06: the ones that hold a GPU), disk_bytes (stage 02's states)
  where the time went: stage 05's `train_phase_seconds` and, online, `online_target` (the target's seconds, tokens,
                        forwards and padded tokens); stage 06's `serve_start_s` (each server's start) and
                        `serve_side_by_side` (whether they started at once)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GPU_STAGES = ("02", "05", "06")


def run_summary(run_dir: Path) -> dict[str, Any]:
    """The figures above for the run folder `run_dir` (a stage that did not run leaves its figures None)."""
    from eagle3lib.evaluate.compare import COMPARE_LIVE
    from eagle3lib.evaluate.report import read_manifests

    run_dir = Path(run_dir)
    ms = read_manifests(run_dir)
    m02, m05 = (ms.get(s, {}).get("metrics", {}) for s in ("02", "05"))
    from eagle3lib.train.result import read_results

    draft = read_results(run_dir).get("eagle3", {})
    results = _read_json(run_dir / "eval" / "results.json")
    row = next((m for m in COMPARE_LIVE if (results.get("by_method") or {}).get(m)), None)
    taus: dict[str, float | None] = {"heldout": ((results.get("by_method") or {}).get(row) or {}).get("tau")}
    for name, bench in (results.get("tau_by_benchmark") or {}).items():
        taus[name] = ((bench.get("by_method") or {}).get(row) or {}).get("tau")
    held_out = results.get("held_out_groups") or {}
    by_group = {g: (r["by_method"].get(row) or {}).get("tau") for g, r in (held_out.get("groups") or {}).items()}
    serve = results.get("serve") or {}
    return {"run": run_dir.name, "target": (ms.get("02", {}).get("outputs") or {}).get("model_dir"),
            "train_tokens": draft.get("train_tokens"), "train_rows": draft.get("train_rows"),
            "optimizer_steps": draft.get("global_step"), "epochs": draft.get("epochs_done"),
            "optimizers": draft.get("optimizers"), "val_eal": draft.get("val_eal") or (m05.get("eagle3") or m05).get("val_eal"),
            "val_tau_walk": draft.get("val_tau_walk"),
            "train_seconds": draft.get("train_seconds"),
            "tau_by_benchmark": taus if row else {}, "tau_row": row,
            "tau_heldout_by": {"by": held_out.get("by"), "tau": by_group} if row and by_group else None,
            "speedup_by_concurrency": serve.get("speedup_by_concurrency"),
            "recommended_settings": serve.get("recommended_settings"),
            "verdict": (serve.get("verdict") or {}).get("line"),
            "stage_seconds": {m["stage"]: m.get("seconds") for m in ms.values()},
            "gpu_seconds": round(sum(m.get("seconds") or 0 for m in ms.values() if m["stage"][:2] in GPU_STAGES), 1),
            "disk_bytes": m02.get("bytes"),
            "train_phase_seconds": draft.get("phase_seconds"), "online_target": draft.get("online_target"),
            "serve_side_by_side": serve.get("side_by_side"), "serve_start_s": serve_starts(serve)}


def serve_starts(serve: dict[str, Any]) -> dict[str, float | None]:
    """Each server's start, in seconds, by its setting ('baseline', 'ngram' for the draft-free ones; a run from
    before evaluate.serve_grid has one draft server, 'draft')."""
    settings = serve.get("settings") or ({"draft": serve} if serve.get("command") else {})
    out = {label: (st.get("command") or {}).get("start_s") for label, st in settings.items()}
    if serve.get("ngram"):
        out["ngram"] = (serve["ngram"].get("command") or {}).get("start_s")
    base = next((st.get("baseline_command") for st in settings.values()), None)
    if base:
        out["baseline"] = base.get("start_s")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, type=Path, help="a run folder (outputs/<run>)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--note", default="", help="date, commit, machine, command (kept in the JSON)")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"note": args.note, "commit": commit, "host": platform.node(), **run_summary(args.run_dir)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("train_tokens", "tau_by_benchmark", "speedup_by_concurrency",
                                             "verdict")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
