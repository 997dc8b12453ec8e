"""Stage 06's methods: how many tokens the target accepts per step with the trained draft, and at what speed.

Five methods, reported the way vLLM reports them (see `decoder.Acceptance`): mean acceptance length
tau = 1 + accepted / drafts, per-position rate = accepted at p / drafts, draft acceptance rate = accepted / drafted.
Live methods also get tokens_per_step = generated / target forwards: tau counts only the steps that drafted, which
for n-gram lookup (no match, no draft) is a minority, so only tokens_per_step compares it with a draft.

- offline: the draft run teacher-forced over stored hidden states (no generation): over the validation rows of the
  stage 02 dataset (the quick number; the target's argmax from stage 04's final norm and lm_head), and over the
  target's own greedy continuations of the held-out prompts (which makes it comparable with the two live measures:
  same prompts, same tokens).
- embedded: `decoder.speculative_generate`, an exact greedy chain speculative decoder with the transformers
  target; checked token for token against the target's plain greedy output on every prompt.
- vllm: vLLM in-process with the draft (method eagle3; every prompt in one `generate` batch, eager), its spec-decode
  counters, the batch throughput ratio against the same prompts without the draft (not a serving speedup: that is
  `serve`), and greedy outputs compared between the two (run in a child process, `vllm_child`).
- ngram: vLLM's n-gram prompt lookup with the same k, no draft at all: the baseline the trained draft must beat;
  in-process here, or, with `serve` configured too, as a third server in the serve step's sweep (its speedup at
  the same loads), and then not here.
- serve: the real `vllm serve` with and without the draft under `vllm bench serve` at each concurrency level, the
  speedup a deployment sees; its own step after `measure` (`serve.sweep`), since it keeps finished levels itself.

`measure` runs the configured ones and writes eval/results.json, keeping each finished method in eval/partial.json
until all are done (`FinishedMethods`); its rows are named in `keys`. The `evaluate.benchmarks` are measured the same
way by the embedded and offline methods (`measure_benchmark`; prompts and grouping in `benchmarks`), and by the
serve step's server (`serve_asks.ask_on_server`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common import atomic
from eagle3lib.common.device import torch_dtype
from eagle3lib.common.errors import WorkbookError
from eagle3lib.evaluate import benchmarks
from eagle3lib.evaluate.decoder import Acceptance
from eagle3lib.evaluate.inputs import (
    EvalInputs,
)
from eagle3lib.evaluate.keys import (
    BENCH_ALL,
    BENCH_PATH,
    EMBEDDED,
)

log = logging.getLogger("eagle3lib.evaluate")


def by_group(labels: list[str], acceptances: list[dict[str, Any]], k: int) -> dict[str, dict[str, Any]]:
    """Per-prompt acceptances merged by label (`inputs.held_out_groups`): where a draft falls short (a source or
    category to add data for, a language)."""
    out: dict[str, Acceptance] = {}
    for label, a in zip(labels, acceptances, strict=True):
        out.setdefault(label, Acceptance(k)).merge(Acceptance.from_dict(a))
    return {label: {**a.to_dict(), "prompts": labels.count(label)} for label, a in sorted(out.items())}


def add_held_out_groups(results: dict[str, Any], by: str, method: str, groups: dict[str, dict[str, Any]]) -> None:
    """One method's acceptance per held-out group (`by_group`'s shape) into results["held_out_groups"]: {"by":
    "source" | "category", "groups": {label: {"prompts", "by_method": {method: acceptance}}}}, beside the other
    methods' rows for the same prompts."""
    into = results.setdefault("held_out_groups", {"by": by, "groups": {}})["groups"]
    for label, acc in groups.items():
        into.setdefault(label, {"prompts": acc["prompts"], "by_method": {}})["by_method"][method] = acc


def load_target(model_dir: Path, device: str, dtype: torch.dtype, trust_remote_code: bool = False) -> Any:
    """The target in transformers on one device (the embedded decoder, the offline replay, the tie check): what
    `common.causal_lm.causal_lm_refusal` says it can load, which stage 00 checks."""
    from eagle3lib.common.causal_lm import load_causal_lm

    return load_causal_lm(model_dir, trust_remote_code, dtype=dtype).to(device).eval()


# ---------------------------------------------------------------------------------------------------- methods


def embedded_one(target: Any, draft: Any, prompt: list[int], k: int, max_new_tokens: int,
                 eos: list[int]) -> dict[str, Any]:
    """One held-out prompt: the target's plain greedy output (reference and baseline speed), then the speculative
    decoder's, batch 1 both; where they differ, whether they first differ at a rounding tie (`first_divergence`)."""
    from eagle3lib.evaluate.decoder import first_divergence, greedy_generate, speculative_generate

    ref, base_s = greedy_generate(target, prompt, max_new_tokens, eos_token_id=eos or None)
    r = speculative_generate(target, draft, prompt, k, max_new_tokens, eos_token_id=eos or None)
    return {"prompt_len": len(prompt), "ref": ref, "base_s": base_s, "output_ids": r.output_ids,
            "verified_ids": r.verified_ids, "spec_s": r.seconds, "forwards": r.target_forwards,
            "acceptance": r.acceptance.to_dict(), "divergence": first_divergence(target, prompt, ref, r.output_ids)}


_WORKER: dict[str, Any] = {}


def _embedded_worker_init(model_dir: str, checkpoint: str, device: str, dtype: str, args: tuple) -> None:
    from eagle3lib.evaluate.decoder import load_draft

    torch.set_num_threads(1)  # the GPU computes; more host threads only contend between the workers
    dt = torch_dtype(dtype)
    _WORKER.update(target=load_target(Path(model_dir), device, dt), draft=load_draft(checkpoint, device=device,
                                                                                     dtype=dt), args=args)


def _embedded_worker(prompt: list[int]) -> dict[str, Any]:
    return embedded_one(_WORKER["target"], _WORKER["draft"], prompt, *_WORKER["args"])


def embedded_workers(target: Any, device: str, prompts: int) -> int:
    """How many processes share the device for the embedded decoder. Batch-1 decoding of a small target is bound by
    Python and kernel launches, not by the GPU (SmolLM2 on an H200: 36 tokens/s, the GPU mostly idle), so on a GPU
    the prompts go to up to 8 processes (half the CPU cores, each holding a copy of the target within half the free
    GPU memory); on a CPU one process, whose threads already use every core."""
    if not device.startswith("cuda") or prompts < 2:
        return 1
    weights = sum(t.numel() * t.element_size() for t in target.parameters())
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return max(1, min(8, (os.cpu_count() or 2) // 2, prompts, int(free * 0.5 // max(weights, 1))))


def run_embedded(target: Any, draft: Any, prompts: list[list[int]], k: int, max_new_tokens: int, eos: list[int],
                 progress: bool = True, workers: int = 1, load: tuple[Path, Path, str, str] | None = None
                 ) -> dict[str, Any]:
    """Speculative decoding of every prompt, and the target's plain greedy output of the same prompts for both the
    losslessness check and the baseline speed (batch 1 both: the decoder is batch 1). With workers > 1 the prompts
    go to that many processes, each loading `load` = (model dir, checkpoint, device, dtype name); speeds are then
    per process (each shares the device with the others, for the baseline and the draft alike)."""
    from tqdm.auto import tqdm

    acc = Acceptance(k)
    spec_s = base_s = 0.0
    spec_tok = base_tok = forwards = identical = 0
    per_prompt: list[dict[str, Any] | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc=f"embedded k={k}" + (f" ({workers} processes)" if workers > 1 else ""),
               disable=not progress, unit="prompt")

    def add(i: int, r: dict[str, Any]) -> None:
        nonlocal spec_s, base_s, spec_tok, base_tok, forwards, identical
        base_s += r["base_s"]
        base_tok += len(r["ref"])
        spec_s += r["spec_s"]
        spec_tok += len(r["output_ids"])
        forwards += r["forwards"]
        acc.merge(Acceptance.from_dict(r["acceptance"]))
        identical += int(r["output_ids"] == r["ref"])
        per_prompt[i] = {"prompt_len": r["prompt_len"], "output_ids": r["output_ids"],
                         "verified_ids": r["verified_ids"], "identical": r["output_ids"] == r["ref"],
                         "divergence": r["divergence"], "acceptance": r["acceptance"]}
        bar.update(1)
        bar.set_postfix(tau=f"{acc.tau:.2f}", spec_tok_s=f"{spec_tok / max(spec_s, 1e-9):.0f}",
                        base_tok_s=f"{base_tok / max(base_s, 1e-9):.0f}")

    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        if load is None:
            raise ValueError("workers > 1 needs load = (model dir, checkpoint, device, dtype)")
        model_dir, ckpt, device, dtype = load
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_embedded_worker_init,
                                 initargs=(str(model_dir), str(ckpt), device, dtype, (k, max_new_tokens, eos))) as ex:
            futures = {ex.submit(_embedded_worker, p): i for i, p in enumerate(prompts)}
            for f in as_completed(futures):
                add(futures[f], f.result())
    else:
        for i, p in enumerate(prompts):
            add(i, embedded_one(target, draft, p, k, max_new_tokens, eos))
    bar.close()
    outputs = [r["output_ids"] for r in per_prompt]  # type: ignore[index]
    divergences = [{"prompt": i, **r["divergence"]}  # type: ignore[index]
                   for i, r in enumerate(per_prompt) if r["divergence"]]  # type: ignore[index]
    ties = sum(d["tie"] for d in divergences)
    return {"acceptance": with_tokens_per_step(acc.to_dict(), outputs), "identical": identical, "prompts": len(prompts),
            "differ_at_a_tie": ties, "differ_otherwise": len(divergences) - ties, "divergences": divergences,
            "spec_tokens_per_s": spec_tok / spec_s if spec_s else None,
            "baseline_tokens_per_s": base_tok / base_s if base_s else None,
            "speedup": (spec_tok / spec_s) / (base_tok / base_s) if spec_s and base_s and base_tok else None,
            "target_forwards": forwards, "generated_tokens": spec_tok, "workers": workers, "per_prompt": per_prompt}


def run_offline_continuations(target: Any, draft: Any, prompts: list[list[int]], continuations: list[list[int]],
                              ks: list[int]) -> dict[int, dict[str, Acceptance]]:
    """Offline acceptance on the target's greedy continuations of the held-out prompts, for every k.

    One target forward per prompt gives the aux states of prompt + continuation; the draft then runs
    teacher-forced from every start position (no generation)."""
    from eagle3lib.evaluate.decoder import simulate_continuation, target_aux_for

    total: dict[int, dict[str, Acceptance]] = {k: {"all": Acceptance(k), "path": Acceptance(k)} for k in ks}
    for p, cont in zip(prompts, continuations, strict=True):
        seq = list(p) + list(cont)
        aux = target_aux_for(target, seq, draft.layer_ids)
        for k, parts in simulate_continuation(draft, aux, seq, len(p), ks).items():
            for name, a in parts.items():
                total[k][name].merge(a)
    return total


def run_offline_rows(draft: Any, inp: EvalInputs, ks: list[int], max_rows: int | None,
                     progress: bool = True) -> tuple[dict[int, Acceptance], int]:
    """Offline acceptance over the validation rows of the stage 02 dataset (stored states; the quick number; in
    online and spool modes over the validation rows among stage 02's sample shards, extract.online_sample_rows). The
    target's argmax after each position is computed from the stored final slot with stage 04's norm and lm_head."""
    from datasets import load_from_disk
    from tqdm.auto import tqdm

    from eagle3lib.common import shards
    from eagle3lib.evaluate.decoder import simulate_rows
    from eagle3lib.verifier import read_head

    ds = load_from_disk(str(inp.dataset_dir))
    rows_idx = list(range(inp.train_rows, min(len(ds), inp.train_rows + inp.val_rows)))
    if inp.shard_rows is not None:  # online, spool: the validation rows among stage 02's sample shards
        rows_idx = [i for i in rows_idx if i in set(inp.shard_rows)]
    if max_rows is not None:
        rows_idx = rows_idx[:max_rows]
    norm_w, lm_head, eps = read_head(inp.verifier_dir)  # the tensors stage 04 resolved, under fixed names
    head = (norm_w.to(draft.device), lm_head.to(draft.device), eps)  # the argmax over the vocab runs where the draft does
    n_aux = len(draft.layer_ids)

    def rows():
        for i in rows_idx:
            data = shards.read_shard(shards.shard_path(inp.dataset_dir, i))
            hs = data["hidden_states"].to(draft.device, torch.float32)
            if hs.shape[1] != n_aux + 1:
                raise WorkbookError(f"shard {i} holds {hs.shape[1]} slots, the draft reads {n_aux} aux layers + final",
                                    "evaluate with the draft trained on this run's stage 02 states")
            yield (torch.as_tensor(ds[i]["input_ids"]), torch.as_tensor(ds[i]["loss_mask"]), hs)

    bar = tqdm(total=len(rows_idx), desc="offline (validation rows)", disable=not progress, unit="row")
    t0 = time.perf_counter()
    seen = [0]

    def tick(n_tokens: int) -> None:
        seen[0] += n_tokens
        bar.update(1)
        bar.set_postfix(tok_s=f"{seen[0] / max(time.perf_counter() - t0, 1e-9):.0f}")

    res = simulate_rows(draft, rows(), head, ks, progress=tick)
    bar.close()
    return res, len(rows_idx)


def tokens_per_step(generated: int, accepted: int) -> float:
    """Generated tokens / target forwards, where forwards = generated - accepted (every forward yields one token of
    its own plus the accepted drafts; the prefill counts as one)."""
    return round(generated / max(1, generated - accepted), 4)


def with_tokens_per_step(acceptance: dict[str, Any], outputs: list[list[int]]) -> dict[str, Any]:
    """The acceptance dict plus tokens_per_step (`tokens_per_step`) over `outputs`."""
    return {**acceptance, "tokens_per_step": tokens_per_step(sum(len(o) for o in outputs), acceptance["accepted"])}


def count_identical(outputs: list[list[int]], others: list[list[int]]) -> int:
    """How many prompts got the same tokens from two runs over the same prompts."""
    return sum(int(a == b) for a, b in zip(outputs, others, strict=True))


def vllm_job(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, dtype: str,
             parallel: dict[str, int] | None = None) -> dict[str, Any]:
    """What every vLLM run of the evaluation shares: target, prompts, length, dtype, and the engine settings the
    target's family needs and its split over GPUs (`engine_args`, only when there are any:
    adapters.target_engine_kwargs, vllm_engine.parallel_layout)."""
    from eagle3lib.extract.backends.adapters import target_engine_kwargs

    longest = max(len(p) for p in prompts) + max_new_tokens + 8
    extra = {**target_engine_kwargs(model_dir, dtype), **(parallel or {})}
    return {"target": str(model_dir), "prompt_token_ids": prompts, "max_new_tokens": max_new_tokens,
            "dtype": dtype, "max_model_len": max(256, longest), **({"engine_args": extra} if extra else {})}


def run_ngram(inp: EvalInputs, prompts: list[list[int]], k: int, max_new_tokens: int, workdir: Path,
              dtype: str, parallel: dict[str, int] | None = None) -> dict[str, Any]:
    """vLLM's n-gram prompt lookup with the same k on the same prompts: the draft-free baseline, so the report
    shows what the trained draft adds over copying from the context."""
    from eagle3lib.evaluate.vllm_child import run_in_subprocess

    job = {**vllm_job(inp.model_dir, prompts, max_new_tokens, dtype, parallel), "method": "ngram", "k": k}
    r = run_in_subprocess(job, workdir, f"ngram_k{k}", inp.cache_dir)
    return {"acceptance": with_tokens_per_step(Acceptance.from_dict(r["acceptance"]).to_dict(), r["outputs"]),
            "tokens_per_s": r["tokens_per_s"],
            "engine_start_s": r["engine_start_s"], "outputs": r["outputs"]}


def run_vllm(inp: EvalInputs, prompts: list[list[int]], k: int, max_new_tokens: int, workdir: Path,
             dtype: str, sweep: list[int] | None = None, parallel: dict[str, int] | None = None) -> dict[str, Any]:
    """vLLM with and without the draft on the same prompts (child processes); counters, speed, identical outputs."""
    from eagle3lib.evaluate.vllm_child import run_in_subprocess

    base_job = vllm_job(inp.model_dir, prompts, max_new_tokens, dtype, parallel)
    base = run_in_subprocess({**base_job, "draft": None, "k": 0}, workdir, "baseline", inp.cache_dir)
    runs: dict[int, dict[str, Any]] = {}
    for kk in sorted(set([k] + list(sweep or []))):
        runs[kk] = run_in_subprocess({**base_job, "draft": str(inp.checkpoint), "k": kk}, workdir, f"eagle3_k{kk}",
                                     inp.cache_dir)
    main = runs[k]
    identical = count_identical(main["outputs"], base["outputs"])
    return {
        "acceptance": with_tokens_per_step(Acceptance.from_dict(main["acceptance"]).to_dict(), main["outputs"]),
        "sweep": {kk: Acceptance.from_dict(r["acceptance"]).to_dict() for kk, r in runs.items()},
        "identical": identical, "prompts": len(prompts),
        "spec_tokens_per_s": main["tokens_per_s"], "baseline_tokens_per_s": base["tokens_per_s"],
        "speedup": main["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None,
        "engine_start_s": {"baseline": base["engine_start_s"], "eagle3": main["engine_start_s"]},
        "outputs": main["outputs"], "baseline_outputs": base["outputs"],
    }


def measure_benchmark(name: str, path: Path, inp: EvalInputs, target: Any, draft: Any, tok: Any, k: int,
                      eos: list[int], methods: list[str], limit: int | None, max_new_tokens: int, out_dir: Path,
                      device: str, dtype: str, progress: bool = True) -> dict[str, Any]:
    """One benchmark: its selected items asked turn by turn (later turns after the target's own answers), the
    embedded decoder and the offline continuation over every prompt, grouped by category and turn."""
    from tqdm.auto import tqdm

    items = benchmarks.select_items(benchmarks.read_items(path), limit)
    asked = benchmarks.ask_in_turn(target, tok, items, max_new_tokens, eos, progress=progress)
    prompts = [benchmarks.chat_ids(tok, a["messages"]) for a in asked]
    per_prompt: dict[str, list[dict[str, Any]]] = {}
    continuations, checked = None, {}
    if "embedded" in methods:
        emb = run_embedded(target, draft, prompts, k, max_new_tokens, eos, progress=progress,
                           workers=embedded_workers(target, device, len(prompts)),
                           load=(inp.model_dir, inp.checkpoint, device, dtype))
        per_prompt[EMBEDDED] = [r["acceptance"] for r in emb["per_prompt"]]
        continuations = [r["verified_ids"] for r in emb["per_prompt"]]
        checked = {key: emb[key] for key in ("identical", "differ_at_a_tie", "differ_otherwise")}
    if "offline" in methods:
        if continuations is None:
            from eagle3lib.evaluate.decoder import greedy_generate

            continuations = [greedy_generate(target, p, max_new_tokens, eos or None)[0] for p in prompts]
        sims = [run_offline_continuations(target, draft, [p], [c], [k])[k] for p, c in
                tqdm(list(zip(prompts, continuations, strict=True)), desc=f"offline ({name})", unit="prompt",
                     disable=not progress)]
        per_prompt[BENCH_PATH] = [s["path"].to_dict() for s in sims]
        per_prompt[BENCH_ALL] = [s["all"].to_dict() for s in sims]
    benchmarks.write_asked(out_dir / f"{name}.jsonl", asked, per_prompt)
    info = inp.benchmark_info.get(name, {})
    return {"source": info.get("source"), "questions": len(items), "dedup_dropped": info.get("dedup_dropped"),
            **checked, **benchmarks.group(asked, per_prompt, k)}


# ------------------------------------------------------------------------------------------------------ stage


def file_stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


class FinishedMethods:
    """The methods a failed or interrupted stage 06 finished, kept in eval/partial.json after each one and reused
    by a rerun that evaluates the same weights on the same prompts with the same settings (`fingerprint`): a vLLM
    failure after a 7-minute embedded run on a GPU must not cost those 7 minutes again. Removed on success."""

    def __init__(self, path: Path, fingerprint: dict[str, Any]):
        self.path, self.fingerprint = path, fingerprint
        try:
            data = json.loads(path.read_text())
            self.methods: dict[str, Any] = data["methods"] if data.get("fingerprint") == fingerprint else {}
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            self.methods = {}

    def has(self, name: str) -> bool:
        return name in self.methods

    def run(self, name: str, fn: Any, results: dict[str, Any]) -> Any:
        """`fn()`'s value for method `name`: kept from an earlier attempt, or computed now and kept (with its
        seconds in results["seconds"][name])."""
        if name in self.methods:
            log.info("stage 06: %s reused from %s (same weights, prompts and settings)", name, self.path.name)
            results["seconds"][name] = self.methods[name]["seconds"]
            results.setdefault("reused", []).append(name)
            return self.methods[name]["value"]
        t0 = time.perf_counter()
        value = fn()
        self.methods[name] = {"value": value, "seconds": round(time.perf_counter() - t0, 2)}
        results["seconds"][name] = self.methods[name]["seconds"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(self.path, {"fingerprint": self.fingerprint, "methods": self.methods})
        return value

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
