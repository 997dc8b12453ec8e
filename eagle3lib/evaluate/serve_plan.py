"""The serve step's servers and their command lines: which servers a sweep starts (every drafter's settings, n-gram
lookup's, the target alone's), what follows `vllm serve` for each, what `vllm bench serve` is given at a level, and
the order servers side by side are measured in.

Why apart from serve.py: these are pure functions of the config and the drafts (no server runs here), which the
sweep, the tests and benchmarks/serve_graphs.py read alike; serve.py runs them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3lib.common import atomic, drafters
from eagle3lib.common.errors import WorkbookError

if TYPE_CHECKING:
    from eagle3lib.common.config import EvaluateSection

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
    algorithm: str | None = None  # the drafter (eagle3lib.common.drafters); None for the others

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


def drafter_settings(ecfg: EvaluateSection, algorithm: str, checkpoint: Path) -> list[dict[str, Any]]:
    """The settings a drafter is served with (evaluate.serve_grid's entries for it, `EvaluateSection.serve_settings`,
    k defaulting to drafters.default_k), refused where k passes what the drafter was trained for: P-EAGLE fills at
    most its trained depths, DFlash at most its block's slots after the anchor (EAGLE-3 may chain past its TTT
    steps)."""
    trained = drafters.trained_tokens(checkpoint)
    settings = ecfg.serve_settings(algorithm, drafters.default_k(algorithm, checkpoint, ecfg.num_draft_tokens))
    for setting in settings:
        if algorithm != "eagle3" and setting["num_speculative_tokens"] > trained:
            knob = drafters.DRAFTERS[algorithm].tokens_knob
            raise WorkbookError(
                f"evaluate.serve_grid serves {drafters.title(algorithm)} with k = {setting['num_speculative_tokens']}, "
                f"but it was trained for {trained} draft tokens per step ({knob})",
                f"give that entry num_speculative_tokens <= {trained}, or raise {knob.split(' ')[0]} and rerun "
                "stage 05")
    return settings


def plan_servers(ecfg: EvaluateSection, drafts: dict[str, Path]) -> list[ServerPlan]:
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
    on 16, whose full graph sits at 18; such steps took about twice as long as those at the batch sizes around them.
    Sizes that are multiples of 1 + k already give every size both graphs: in one run a random k = 2 draft's step at
    4-13 requests took 2.5x as long with vLLM's default sizes as with these
    (docs/serving.md#cuda-graph-sizes-with-a-draft). (vLLM's V1 runner rounds the sizes itself,
    `adjust_cudagraph_sizes_for_spec_decode`; V2 skips that: vllm/config/compilation.py.)"""
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
    if cpu:  # torch.compile on the CPU adds 70-80 s to a start (docs/cpu.md#vllm-on-the-cpu); a GPU keeps graphs
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
    (docs/serving.md#vllm-bench-serve)."""
    return ["--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions", "--model", server.model,
            "--dataset-name", "custom", "--dataset-path", str(prompts_file), "--skip-chat-template",
            "--disable-shuffle", "--custom-output-len", str(max_tokens), "--num-prompts", str(requests),
            "--max-concurrency", str(level), "--request-rate", "inf", "--temperature", "0",
            "--extra-body", json.dumps({"add_special_tokens": False}), "--seed", str(seed),
            "--percentile-metrics", ",".join(LATENCIES), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", result_name, "--disable-tqdm"]


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
