"""Benchmark (not a test): stage 02's tokenizing of a run's conversations, one conversation at a time
(`rows.tokenize_conversation` in a loop) against `rows.tokenize_conversations` (the encoder on several threads),
in one run, on the same conversations; checks that both give the same ids and loss masks.

    python benchmarks/tokenizing.py --run-dir outputs/qwen15-x4-replay --rows 6000 \
        --out benchmarks/results/tokenize_qwen15_x4_cpu_$(date +%F).json

--run-dir: a run whose stage 02 wrote data/train.jsonl (the tokenizer is its config's target's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--rows", type=int, default=6000, help="conversations, a seeded random draw of train.jsonl")
    ap.add_argument("--threads", type=int, default=None, help="tokenize_conversations' threads (default: its own)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()

    from eagle3lib.common.config import load_run_config
    from eagle3lib.common.target import load_tokenizer, resolve_model_path
    from eagle3lib.extract.rows import tokenize_conversation, tokenize_conversations

    run = args.run_dir.resolve()
    cfg = load_run_config(run / "config.yaml", run.name)
    tok = load_tokenizer(cfg.target, resolve_model_path(cfg.target))
    rows = [json.loads(line)["messages"] for line in (run / "data" / "train.jsonl").open()]
    random.Random(0).shuffle(rows)
    convs = rows[: args.rows]

    t = time.perf_counter()
    one = [tokenize_conversation(tok, c, 10**9) for c in convs]
    one_s = time.perf_counter() - t
    t = time.perf_counter()
    batched = tokenize_conversations(tok, convs, threads=args.threads)
    batched_s = time.perf_counter() - t
    same = all(list(a[0]) == list(b[0]) and a[1] == b[1] for a, b in zip(one, batched, strict=True))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"note": f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores: "
                      f"benchmarks/tokenizing.py --run-dir {args.run_dir} --rows {args.rows}", "commit": commit,
              "host": platform.node(), "cpus": os.cpu_count(), "run": run.name, "conversations": len(convs),
              "tokens": sum(len(ids) for ids, _ in one), "one_at_a_time_s": round(one_s, 2),
              "batched_s": round(batched_s, 2), "speedup": round(one_s / batched_s, 2), "same_ids_and_masks": same}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
