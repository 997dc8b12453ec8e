"""Benchmark (not a test): what the target runs in stage 05's online mode, per real token, on a run's rows: the packed
training batches of speculators' own sampler, captured `ahead` batches at a time (train.online_batches_ahead) in
length-sorted forwards of at most `budget` padded tokens (extract.batch_tokens; `plan_batches`, stage 02's own
batching). A forward's cost grows with rows x longest row (its linear layers) and rows x longest row squared (its
attention); this counts both against the rows' own tokens and squares, and the forwards. No model runs: the figures
follow from the lengths alone.

    python benchmarks/online_padding.py --run-dir outputs/qwen15-x4-replay \
        --out benchmarks/results/online_padding_qwen15_x4_cpu_$(date +%F).json

--run-dir: a run whose stage 02 wrote its dataset, or at least data/train.jsonl (then its conversations are tokenized
here with the run's target's tokenizer, as stage 02 does, and cut at data.max_length).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def row_lengths(run: Path) -> tuple[list[int], str]:
    """Token counts of the run's rows, and where they came from."""
    from eagle3lib.common.config import load_run_config

    cfg = load_run_config(run / "config.yaml", run.name)
    dataset = run / "dataset"
    if (dataset / "dataset_info.json").is_file():
        from datasets import load_from_disk

        return [len(ids) for ids in load_from_disk(str(dataset))["input_ids"]], "its stage 02 dataset"
    from eagle3lib.common.target import load_tokenizer, resolve_model_path
    from eagle3lib.extract.rows import tokenize_conversations

    tok = load_tokenizer(cfg.target, resolve_model_path(cfg.target))
    convs = [json.loads(line)["messages"] for line in (run / "data" / "train.jsonl").open()]
    lengths = [min(len(ids), cfg.data.max_length) for ids, _ in tokenize_conversations(tok, convs)]
    return lengths, "data/train.jsonl tokenized here"


def cost(lengths: list[int], batches: list[list[int]], ahead: int, budget: int) -> dict[str, float]:
    """Padded tokens and attention (rows x longest^2) per real token and per real square, and forwards."""
    from eagle3lib.extract.backends.transformers_backend import plan_batches

    padded = square = forwards = 0
    for g in range(0, len(batches), ahead):
        rows = [(i, range(lengths[i])) for b in batches[g:g + ahead] for i in b]
        for sub in plan_batches(rows, budget):
            longest = max(len(r) for _, r in sub)
            padded += len(sub) * longest
            square += len(sub) * longest * longest
            forwards += 1
    real = sum(lengths[i] for b in batches for i in b)
    real_square = sum(lengths[i] ** 2 for b in batches for i in b)
    return {"padded_per_token": round(padded / real, 4), "attention_per_square": round(square / real_square, 4),
            "forwards": forwards}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--packing-length", type=int, default=8192, help="train.packing_length")
    ap.add_argument("--ahead", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--budget", type=int, nargs="+", default=[16384, 32768, 65536], help="extract.batch_tokens")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    run = args.run_dir.resolve()
    lengths, source = row_lengths(run)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=args.packing_length, lengths=lengths,
                                                 num_replicas=1, rank=0, seed=0)
    sampler.set_epoch(0)
    batches = [[int(i) for i in b] for b in sampler]
    table = {str(b): {str(a): cost(lengths, batches, a, b) for a in args.ahead} for b in args.budget}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"note": f"{time.strftime('%Y-%m-%d')}: benchmarks/online_padding.py --run-dir {args.run_dir} "
                      f"--packing-length {args.packing_length} (the rows' lengths: {source}; every row, training "
                      "and validation)", "commit": commit, "run": run.name, "rows": len(lengths),
              "tokens": sum(lengths), "batches": len(batches), "packing_length": args.packing_length,
              "rows_per_batch": round(len(lengths) / len(batches), 1),
              "by_budget_then_batches_ahead": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
