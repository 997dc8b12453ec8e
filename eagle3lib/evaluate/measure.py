"""Stage 06's measuring step (`measure`): every configured method on the held-out prompts and the benchmarks, into
eval/results.json, each finished method kept for a rerun (`FinishedMethods`).

Why apart from the methods: methods.py holds what each method does; this holds which run, in which order, with
what they share (the draft, the transformers target, the prompts), so that a method is added in one place.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3lib.common import atomic
from eagle3lib.common.config import benchmark_name
from eagle3lib.common.device import auto_device, dtype_name, torch_dtype
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import StageRun
from eagle3lib.common.target import load_tokenizer
from eagle3lib.evaluate import benchmarks
from eagle3lib.evaluate.inputs import (
    EvalInputs,
    eos_ids,
    held_out_digest,
    held_out_groups,
    held_out_prompt_ids,
    inputs_from_run,
)
from eagle3lib.evaluate.keys import EMBEDDED, HELDOUT_ALL, HELDOUT_PATH, NGRAM, OFFLINE_ROWS, VLLM
from eagle3lib.evaluate.methods import (
    FinishedMethods,
    add_held_out_groups,
    by_group,
    count_identical,
    embedded_workers,
    file_stamp,
    load_target,
    measure_benchmark,
    run_embedded,
    run_ngram,
    run_offline_continuations,
    run_offline_rows,
    run_vllm,
)

if TYPE_CHECKING:
    from eagle3lib.common.config import EvaluateSection


def methods_for(configured: list[str], algorithms: list[str]) -> tuple[list[str], dict[str, list[str]],
                                                                      dict[str, str]]:
    """Which of evaluate.methods run, and which drafter each measures: the offline, embedded and vllm methods
    follow the EAGLE-3 draft only (drafters.EAGLE3_ONLY_METHODS), serve measures every drafter, ngram none.
    Returns (the methods that run, {algorithm: the methods that measure it}, {method: why it does not run})."""
    from eagle3lib.common.drafters import EAGLE3_ONLY_METHODS

    skipped = {m: f"follows the EAGLE-3 draft only, and stage 05 trained {', '.join(algorithms)}"
               for m in configured if m in EAGLE3_ONLY_METHODS and "eagle3" not in algorithms}
    run = [m for m in configured if m not in skipped]
    applied = {a: [m for m in run if m == "serve" or (a == "eagle3" and m in EAGLE3_ONLY_METHODS)]
               for a in algorithms}
    return run, applied, skipped


@dataclass
class Measuring:
    """What the methods of one stage 06 share: settings, inputs, prompts, the draft and the transformers target
    (loaded once, for the methods that need them), the results so far and what a failed attempt finished."""

    stage: StageRun
    inp: EvalInputs
    methods: list[str]
    device: str
    dtype: Any
    dname: str  # the dtype's name, what the embedded workers and the vLLM jobs are told
    prompts: list[list[int]]
    tok: Any
    draft: Any
    results: dict[str, Any]
    done: FinishedMethods
    progress: bool = True
    target: Any = None
    eos: list[int] = field(default_factory=list)

    @property
    def cfg(self) -> Any:
        return self.stage.cfg.evaluate

    @property
    def k(self) -> int:
        return self.cfg.num_draft_tokens

    @property
    def ks(self) -> list[int]:
        return self.results["sweep_k"]


def measure(stage: StageRun, progress: bool = True) -> dict[str, Any]:
    """Run every configured method; write eval/results.json. Returns the results (figures and report separately)."""
    t_all = time.perf_counter()
    m = start(stage, progress)
    bench_files = _benchmark_files(m)
    if ("embedded" in m.methods and not m.done.has("embedded")) or "offline" in m.methods or any(
            not m.done.has(f"benchmark {n}") for n in bench_files):
        m.target = load_target(m.inp.model_dir, m.device, m.dtype, m.stage.cfg.target.trust_remote_code)
        m.eos = eos_ids(m.target, m.tok)
    if "offline" in m.methods and m.inp.val_rows > 0:
        _offline_rows(m)
    continuations = _embedded(m) if "embedded" in m.methods else None
    if "offline" in m.methods:
        _offline_heldout(m, continuations)
    if bench_files:
        m.results["tau_by_benchmark"] = {name: m.done.run(f"benchmark {name}", lambda name=name, path=path: (
            measure_benchmark(name, path, m.inp, m.target, m.draft, m.tok, m.k, m.eos, m.methods,
                              m.cfg.benchmark_prompts, m.cfg.max_new_tokens, stage.rd.path("eval", "benchmarks"),
                              m.device, m.dname, progress)), m.results) for name, path in bench_files.items()}
    m.target = None  # free it before vLLM starts
    if "vllm" in m.methods:
        _vllm(m)
    if "ngram" in m.methods and "serve" not in m.methods:  # with serve, a third server measures it (serve.py)
        _ngram(m)
    m.results["seconds"]["total"] = round(time.perf_counter() - t_all, 2)
    atomic.write_json(stage.rd.path("eval", "results.json"), m.results)
    m.done.clear()
    return m.results


def start(stage: StageRun, progress: bool) -> Measuring:
    """The inputs, the methods that run (`methods_for`), the EAGLE-3 draft where a method replays it, the held-out
    prompts, the results' head and the methods an earlier attempt finished (same fingerprint)."""
    from eagle3lib.evaluate.decoder import load_draft

    cfg = stage.cfg.evaluate
    inp = inputs_from_run(stage)
    methods, applied, skipped = methods_for(cfg.methods, list(inp.drafts))
    device = auto_device(cfg.device)
    dtype = torch_dtype(stage.cfg.target.dtype, device)
    draft = load_draft(inp.checkpoint, device=device, dtype=dtype) if {"embedded", "offline"} & set(methods) else None
    if draft is not None and list(draft.layer_ids) != list(inp.layer_ids[:-1]):
        raise WorkbookError(f"the draft reads aux layers {draft.layer_ids}, stage 02 captured {inp.layer_ids[:-1]}",
                            "evaluate the draft trained on this run (or rerun stage 05)")
    tok = load_tokenizer(stage.cfg.target, inp.model_dir, chat=False)
    prompts, prompt_source = held_out_prompt_ids(inp, tok, cfg.num_prompts)
    ks = sorted(set(cfg.sweep_k) | {cfg.num_draft_tokens})
    results: dict[str, Any] = {"k": cfg.num_draft_tokens, "sweep_k": ks, "prompt_source": prompt_source,
                               "prompts": len(prompts), "held_out_digest": held_out_digest(inp, tok, prompts),
                               "max_new_tokens": cfg.max_new_tokens, "device": device, "dtype": str(dtype),
                               "checkpoint": str(inp.checkpoint), "target": str(inp.model_dir), "by_method": {},
                               "drafts": {a: str(c) for a, c in inp.drafts.items()}, "methods_applied": applied,
                               "methods_skipped": skipped, "sweep": {}, "seconds": {}}
    done = FinishedMethods(stage.rd.path("eval", "partial.json"), {
        **{key: results[key] for key in ("k", "sweep_k", "max_new_tokens", "device", "dtype", "checkpoint")},
        "weights": file_stamp(Path(inp.checkpoint) / "model.safetensors") if inp.checkpoint else None,
        "offline_max_rows": cfg.offline_max_rows, "vllm_sweep": cfg.vllm_sweep,
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "benchmarks": benchmarks.fingerprint(_benchmark_paths(inp, cfg, methods), cfg.benchmark_prompts)})
    return Measuring(stage, inp, methods, device, dtype, dtype_name(stage.cfg.target.dtype, device), prompts, tok,
                     draft, results, done, progress)


def _benchmark_paths(inp: EvalInputs, cfg: EvaluateSection, methods: list[str]) -> dict[str, Path]:
    """The benchmarks measured here: by the embedded decoder and the offline replay; with only 'serve' (and vLLM's
    in-process rows) they are the serve step's (`serve_asks.ask_on_server`): no transformers target loads for them."""
    if not {"embedded", "offline"} & set(methods):
        return {}
    return benchmarks.benchmark_files(inp, [benchmark_name(b) for b in cfg.benchmarks])


def _benchmark_files(m: Measuring) -> dict[str, Path]:
    files = _benchmark_paths(m.inp, m.cfg, m.methods)
    if files and m.tok is None:
        raise WorkbookError("evaluate.benchmarks need the target's tokenizer and chat template (this target has none)",
                            "remove evaluate.benchmarks, or set target.tokenizer")
    return files


def _offline_rows(m: Measuring) -> None:
    def offline_rows() -> dict[str, Any]:
        rows_acc, n_rows = run_offline_rows(m.draft, m.inp, m.ks, m.cfg.offline_max_rows, progress=m.progress)
        return {"rows": n_rows, "acceptance": rows_acc[m.k].to_dict(),
                "sweep": {str(kk): a.to_dict() for kk, a in rows_acc.items()}}

    rows = m.done.run("offline_rows", offline_rows, m.results)
    m.results["offline_rows"] = rows
    m.results["by_method"][OFFLINE_ROWS] = rows["acceptance"]
    m.results["sweep"][OFFLINE_ROWS] = rows["sweep"]


def _embedded(m: Measuring) -> list[list[int]]:
    """The exact decoder on every held-out prompt (by held-out group too); returns its verified continuations."""
    def embedded() -> dict[str, Any]:
        workers = embedded_workers(m.target, m.device, len(m.prompts))
        emb = run_embedded(m.target, m.draft, m.prompts, m.k, m.cfg.max_new_tokens, m.eos, progress=m.progress,
                           workers=workers, load=(m.inp.model_dir, m.inp.checkpoint, m.device, m.dname))
        return {**{key: v for key, v in emb.items() if key != "per_prompt"},
                "outputs": [r["output_ids"] for r in emb["per_prompt"]],
                "verified": [r["verified_ids"] for r in emb["per_prompt"]],
                "acceptances": [r["acceptance"] for r in emb["per_prompt"]]}

    emb = m.done.run("embedded", embedded, m.results)
    m.results[EMBEDDED] = {key: v for key, v in emb.items() if key not in ("outputs", "verified", "acceptances")}
    m.results["by_method"][EMBEDDED] = emb["acceptance"]
    groups = held_out_groups(m.inp, m.cfg.num_prompts) if m.tok is not None else None
    if groups and len(groups[1]) == len(emb.get("acceptances") or []):
        add_held_out_groups(m.results, groups[0], EMBEDDED, by_group(groups[1], emb["acceptances"], m.k))
    m.results["embedded_outputs"] = emb["outputs"]
    return emb["verified"]


def _offline_heldout(m: Measuring, continuations: list[list[int]] | None) -> None:
    def offline_heldout() -> dict[str, Any]:
        conts = continuations
        if conts is None:  # no decoder run: the target's plain greedy continuations
            from eagle3lib.evaluate.decoder import greedy_generate

            conts = [greedy_generate(m.target, p, m.cfg.max_new_tokens, m.eos or None)[0] for p in m.prompts]
        sim = run_offline_continuations(m.target, m.draft, m.prompts, conts, m.ks)
        return {str(kk): {n: a.to_dict() for n, a in parts.items()} for kk, parts in sim.items()}

    held = m.done.run("offline_heldout", offline_heldout, m.results)
    m.results["offline_heldout"] = held
    m.results["by_method"][HELDOUT_ALL] = held[str(m.k)]["all"]
    m.results["by_method"][HELDOUT_PATH] = held[str(m.k)]["path"]
    m.results["sweep"][HELDOUT_PATH] = {str(kk): held[str(kk)]["path"] for kk in m.ks}
    m.results["sweep"][HELDOUT_ALL] = {str(kk): held[str(kk)]["all"] for kk in m.ks}


def _vllm(m: Measuring) -> None:
    from eagle3lib.extract.backends.vllm_engine import parallel_layout

    live = m.done.run("vllm", lambda: run_vllm(m.inp, m.prompts, m.k, m.cfg.max_new_tokens,
                                               m.stage.rd.path("eval", "vllm"), m.dname,
                                               sweep=m.ks if m.cfg.vllm_sweep else None,
                                               parallel=parallel_layout(m.stage.cfg)), m.results)
    m.results[VLLM] = {key: v for key, v in live.items() if key not in ("outputs", "baseline_outputs", "sweep")}
    m.results["by_method"][VLLM] = live["acceptance"]
    if m.cfg.vllm_sweep:
        m.results["sweep"][VLLM] = {str(kk): a for kk, a in live["sweep"].items()}
    if "embedded_outputs" in m.results:
        m.results[VLLM]["identical_to_embedded"] = count_identical(live["baseline_outputs"],
                                                                     m.results["embedded_outputs"])


def _ngram(m: Measuring) -> None:
    from eagle3lib.extract.backends.vllm_engine import parallel_layout

    ng = m.done.run("ngram", lambda: run_ngram(m.inp, m.prompts, m.k, m.cfg.max_new_tokens,
                                               m.stage.rd.path("eval", "vllm"), m.dname,
                                               parallel_layout(m.stage.cfg)), m.results)
    m.results["ngram"] = {key: v for key, v in ng.items() if key != "outputs"}
    m.results["by_method"][NGRAM] = ng["acceptance"]
    if "embedded_outputs" in m.results:
        m.results["ngram"]["identical_to_embedded"] = count_identical(ng["outputs"], m.results["embedded_outputs"])
