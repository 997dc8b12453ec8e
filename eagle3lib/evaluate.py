"""Stage 06: how many tokens the target accepts per step with the trained draft, and what that does to speed.

Three measures, reported the way vLLM reports them (see `speculative.Acceptance`): mean acceptance length
tau = 1 + accepted / drafts, per-position rate = accepted at p / drafts, draft acceptance rate = accepted / drafted.
Live methods also get tokens_per_step = generated / target forwards: tau counts only the steps that drafted, which
for n-gram lookup (no match, no draft) is a minority, so only tokens_per_step compares it with a draft.

- offline: the draft run teacher-forced over stored hidden states (no generation): over the validation rows of the
  stage 02 dataset (the quick number), and over the target's own greedy continuations of the held-out prompts (which
  makes it comparable with the two live measures: same prompts, same tokens).
- embedded: `speculative.speculative_generate`, an exact greedy chain speculative decoder with the transformers
  target; checked token for token against the target's plain greedy output on every prompt.
- vllm: vLLM serving the target with the draft (method eagle3), its spec-decode counters, tokens/s against the same
  prompts without the draft, and greedy outputs compared between the two (run in a child process).
- ngram: vLLM's n-gram prompt lookup with the same k, no draft at all: the baseline the trained draft must beat.

Held-out prompts only (stage 02's eval_prompts); k = evaluate.num_draft_tokens, and tau vs k for evaluate.sweep_k.
Writes eval/results.json, figures/06_*.png and the run's report card report.md (eagle3lib.report).

Headless: eagle3 run --config configs/demo.yaml --stages 06
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lib import atomic, plots
from eagle3lib.errors import WorkbookError
from eagle3lib.rundir import StageRun
from eagle3lib.speculative import Acceptance
from eagle3lib.vllm_spec import NGRAM

log = logging.getLogger("eagle3lib.evaluate")

# ------------------------------------------------------------------------------------------------------ inputs


@dataclass
class EvalInputs:
    """What stage 06 reads, all from earlier manifests."""

    model_dir: Path
    checkpoint: Path
    dataset_dir: Path
    eval_prompts: Path
    layer_ids: list[int]  # incl. the final id N
    train_rows: int
    val_rows: int
    train_metrics: dict[str, Any]


def inputs_from_run(stage: StageRun) -> EvalInputs:
    rd = stage.rd
    m02 = rd.read_manifest("02")
    m05 = rd.read_manifest("05")
    if "checkpoint" not in m05["outputs"]:
        raise WorkbookError("stage 05 recorded no 'checkpoint'", "rerun stage 05 (it writes the final checkpoint)")
    ckpt = Path(m05["outputs"]["checkpoint"])
    ckpt = ckpt if ckpt.is_absolute() else rd.root / ckpt
    model_dir = Path(m02["outputs"]["model_dir"])
    return EvalInputs(model_dir=model_dir if model_dir.is_absolute() else rd.root / model_dir, checkpoint=ckpt,
                      dataset_dir=rd.output("02", "dataset"), eval_prompts=rd.output("02", "eval_prompts"),
                      layer_ids=list(m02["metrics"]["layer_ids"]), train_rows=int(m02["metrics"]["train_rows"]),
                      val_rows=int(m02["metrics"]["val_rows"]), train_metrics=m05.get("metrics", {}))


def pick_device(setting: str) -> str:
    if setting != "auto":
        return setting
    return "cuda" if torch.cuda.is_available() else "cpu"


def target_dtype(setting: str, device: str) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[setting]


def load_tokenizer(model_dir: Path, tokenizer: str | None = None) -> Any | None:
    """The target's tokenizer with a chat template, or None (tiny test targets ship none)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser() if tokenizer else model_dir))
    except (OSError, ValueError, TypeError):
        return None
    return tok if getattr(tok, "chat_template", None) else None


def held_out_categories(inp: EvalInputs, limit: int | None) -> list[str] | None:
    """The category of each held-out prompt (the bundled set has 8), in prompt order; None where there are none."""
    if not inp.eval_prompts.is_file():
        return None
    cats = [json.loads(line).get("category") for line in inp.eval_prompts.read_text().splitlines() if line.strip()]
    cats = cats[:limit] if limit else cats
    return [str(c) for c in cats] if cats and all(cats) else None


def by_category(categories: list[str], acceptances: list[dict[str, Any]], k: int) -> dict[str, dict[str, Any]]:
    """Per-prompt acceptances merged by category: where a draft falls short (a data mix to fix, a language)."""
    out: dict[str, Acceptance] = {}
    for cat, a in zip(categories, acceptances, strict=True):
        out.setdefault(cat, Acceptance(k)).merge(Acceptance.from_dict(a))
    return {cat: {**a.to_dict(), "prompts": categories.count(cat)} for cat, a in sorted(out.items())}


def held_out_prompt_ids(inp: EvalInputs, tok: Any | None, limit: int | None) -> tuple[list[list[int]], str]:
    """Token ids of the held-out prompts, rendered with the chat template and its generation prompt.

    Without a tokenizer (tiny random test targets) the prompts are the prefixes (up to the first loss-masked token)
    of the dataset's validation rows: also never trained on. Returns (prompt ids, where they came from).
    """
    if tok is not None:
        prompts = []
        for line in inp.eval_prompts.read_text().splitlines():
            if line.strip():
                prompts.append(json.loads(line)["messages"])
        if not prompts:
            raise WorkbookError(f"{inp.eval_prompts} holds no held-out prompts", "set data.eval_samples > 0, rerun 02")
        prompts = prompts[:limit] if limit else prompts
        ids = [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
               for p in prompts]
        return ids, f"{len(ids)} held-out prompts ({inp.eval_prompts.name}), chat template"
    from datasets import load_from_disk

    ds = load_from_disk(str(inp.dataset_dir))
    out = []
    for i in range(inp.train_rows, inp.train_rows + inp.val_rows):
        ids = [int(t) for t in ds[i]["input_ids"]]  # plain ints whether or not the dataset has a torch format
        mask = [int(v) for v in ds[i]["loss_mask"]]
        first = next((j for j, v in enumerate(mask) if v), len(ids))
        out.append(ids[: max(first, 1)])
    out = out[:limit] if limit else out
    if not out:
        raise WorkbookError("no tokenizer and no validation rows to take prompts from",
                            "give the target a tokenizer with a chat template, or keep validation rows in stage 02")
    return out, f"{len(out)} validation-row prefixes (the target has no tokenizer)"


def eos_ids(target: Any, tok: Any | None) -> list[int]:
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None and tok is not None:
        eos = tok.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]


def load_target(model_dir: Path, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


# ---------------------------------------------------------------------------------------------------- methods


def embedded_one(target: Any, draft: Any, prompt: list[int], k: int, max_new_tokens: int,
                 eos: list[int]) -> dict[str, Any]:
    """One held-out prompt: the target's plain greedy output (reference and baseline speed), then the speculative
    decoder's, batch 1 both; where they differ, whether they first differ at a rounding tie (`first_divergence`)."""
    from eagle3lib.speculative import first_divergence, greedy_generate, speculative_generate

    ref, base_s = greedy_generate(target, prompt, max_new_tokens, eos_token_id=eos or None)
    r = speculative_generate(target, draft, prompt, k, max_new_tokens, eos_token_id=eos or None)
    return {"prompt_len": len(prompt), "ref": ref, "base_s": base_s, "output_ids": r.output_ids,
            "verified_ids": r.verified_ids, "spec_s": r.seconds, "forwards": r.target_forwards,
            "acceptance": r.acceptance.to_dict(), "divergence": first_divergence(target, prompt, ref, r.output_ids)}


_WORKER: dict[str, Any] = {}


def _embedded_worker_init(model_dir: str, checkpoint: str, device: str, dtype: str, args: tuple) -> None:
    from eagle3lib.speculative import load_draft

    torch.set_num_threads(1)  # the GPU computes; more host threads only contend between the workers
    dt = getattr(torch, dtype)
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
    from eagle3lib.speculative import simulate_continuation, target_aux_for

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
    """Offline acceptance over the validation rows of the stage 02 dataset (stored states; the quick number)."""
    from datasets import load_from_disk
    from tqdm.auto import tqdm

    from eagle3lib import shards
    from eagle3lib.speculative import load_target_head, simulate_rows

    ds = load_from_disk(str(inp.dataset_dir))
    rows_idx = list(range(inp.train_rows, min(len(ds), inp.train_rows + inp.val_rows)))
    if max_rows is not None:
        rows_idx = rows_idx[:max_rows]
    norm_w, lm_head, eps = load_target_head(inp.model_dir)
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


def with_tokens_per_step(acceptance: dict[str, Any], outputs: list[list[int]]) -> dict[str, Any]:
    """The acceptance dict plus tokens_per_step = generated tokens / target forwards, where forwards = generated -
    accepted (every forward yields one token of its own plus the accepted drafts; the prefill counts as one)."""
    generated = sum(len(o) for o in outputs)
    return {**acceptance, "tokens_per_step": round(generated / max(1, generated - acceptance["accepted"]), 4)}


def count_identical(outputs: list[list[int]], others: list[list[int]]) -> int:
    """How many prompts got the same tokens from two runs over the same prompts."""
    return sum(int(a == b) for a, b in zip(outputs, others, strict=True))


def vllm_job(inp: EvalInputs, prompts: list[list[int]], max_new_tokens: int, dtype: str) -> dict[str, Any]:
    """What every vLLM run of the evaluation shares: target, prompts, length, dtype."""
    longest = max(len(p) for p in prompts) + max_new_tokens + 8
    return {"target": str(inp.model_dir), "prompt_token_ids": prompts, "max_new_tokens": max_new_tokens,
            "dtype": dtype, "max_model_len": max(256, longest)}


def run_ngram(inp: EvalInputs, prompts: list[list[int]], k: int, max_new_tokens: int, workdir: Path,
              dtype: str) -> dict[str, Any]:
    """vLLM's n-gram prompt lookup with the same k on the same prompts: the draft-free baseline, so the report
    shows what the trained draft adds over copying from the context."""
    from eagle3lib.vllm_spec import run_in_subprocess

    r = run_in_subprocess({**vllm_job(inp, prompts, max_new_tokens, dtype), "method": "ngram", "k": k}, workdir,
                          f"ngram_k{k}")
    return {"acceptance": with_tokens_per_step(Acceptance.from_dict(r["acceptance"]).to_dict(), r["outputs"]),
            "tokens_per_s": r["tokens_per_s"],
            "engine_start_s": r["engine_start_s"], "outputs": r["outputs"]}


def run_vllm(inp: EvalInputs, prompts: list[list[int]], k: int, max_new_tokens: int, workdir: Path,
             dtype: str, sweep: list[int] | None = None) -> dict[str, Any]:
    """vLLM with and without the draft on the same prompts (child processes); counters, speed, identical outputs."""
    from eagle3lib.vllm_spec import run_in_subprocess

    base_job = vllm_job(inp, prompts, max_new_tokens, dtype)
    base = run_in_subprocess({**base_job, "draft": None, "k": 0}, workdir, "baseline")
    runs: dict[int, dict[str, Any]] = {}
    for kk in sorted(set([k] + list(sweep or []))):
        runs[kk] = run_in_subprocess({**base_job, "draft": str(inp.checkpoint), "k": kk}, workdir, f"eagle3_k{kk}")
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


# ---------------------------------------------------------------------------------------------------- figures


def _label_and_save(fig: Any, ax: Any, path: Path, title: str, xlabel: str | None, ylabel: str) -> Any:
    """What every stage-06 figure ends with: labels, title, legend, the PNG."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    plots.save(fig, path)
    return fig


def _bars_by_method(ax: Any, results: dict[str, Any], values: Any, first_x: int, label: Any) -> None:
    """One group of bars per x position, one bar per method in the group: `values(acceptance)` gives the heights,
    the first at x = `first_x`."""
    methods = [m for m in results["by_method"] if results["by_method"][m]]
    width = 0.8 / max(len(methods), 1)
    for j, name in enumerate(methods):
        a = results["by_method"][name]
        ys = values(a)
        xs = [first_x + i + (j - (len(methods) - 1) / 2) * width for i in range(len(ys))]
        ax.bar(xs, ys, width=width, label=label(name, a))


def plot_per_position(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    _bars_by_method(ax, results, lambda a: a["per_pos_rate"], first_x=1,
                    label=lambda name, a: f"{name} (tau {a['tau']:.2f})")
    ax.set_ylim(0, 1)
    return _label_and_save(fig, ax, path, "per-position acceptance rate", "draft position",
                           "accepted at position / drafts")


def plot_length_histogram(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    _bars_by_method(ax, results, lambda a: [h / max(sum(a["length_histogram"]), 1) for h in a["length_histogram"]],
                    first_x=0, label=lambda name, a: name)
    return _label_and_save(fig, ax, path, "accepted lengths", "accepted draft tokens in a step", "share of steps")


def plot_tau_vs_k(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    for name, sweep in results["sweep"].items():
        ks = sorted(int(k) for k in sweep)
        ax.plot(ks, [sweep[str(k)]["tau"] if str(k) in sweep else sweep[k]["tau"] for k in ks], marker="o",
                label=name)
    ks_all = sorted({int(k) for s in results["sweep"].values() for k in s})
    if ks_all:
        ax.plot(ks_all, [k + 1 for k in ks_all], ls=":", color="grey", label="ideal (all accepted)")
    return _label_and_save(fig, ax, path, "mean acceptance length vs k", "k (draft tokens per step)",
                           "tau (tokens per target forward)")


def plot_speedup(results: dict[str, Any], path: Path):
    fig, ax = plots.figure(figsize=(6, 3.5))
    names, base, spec = [], [], []
    for name in ("embedded", "vllm"):
        r = results.get(name)
        if r and r.get("baseline_tokens_per_s"):
            names.append(name)
            base.append(r["baseline_tokens_per_s"])
            spec.append(r["spec_tokens_per_s"])
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], base, width=0.4, label="target alone")
    ax.bar([x + 0.2 for x in xs], spec, width=0.4, label="with the draft")
    for x, b, s in zip(xs, base, spec, strict=True):
        ax.text(x + 0.2, s, f"x{s / b:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), names)
    return _label_and_save(fig, ax, path, "speed with and without the draft (greedy, same prompts)", None,
                           "generated tokens / s")


# ------------------------------------------------------------------------------------------------------ stage


def _file_stamp(path: Path) -> list[int]:
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


def evaluate(stage: StageRun, progress: bool = True) -> dict[str, Any]:
    """Run every configured method; write eval/results.json. Returns the results (figures and report separately)."""
    from eagle3lib.speculative import load_draft

    cfg = stage.cfg.evaluate
    inp = inputs_from_run(stage)
    device = pick_device(cfg.device)
    dtype = target_dtype(stage.cfg.target.dtype, device)
    k = cfg.num_draft_tokens
    ks = sorted(set(cfg.sweep_k) | {k})
    dtype_name = str(dtype).removeprefix("torch.")
    t_all = time.perf_counter()
    draft = load_draft(inp.checkpoint, device=device, dtype=dtype)
    if list(draft.layer_ids) != list(inp.layer_ids[:-1]):
        raise WorkbookError(f"the draft reads aux layers {draft.layer_ids}, stage 02 captured {inp.layer_ids[:-1]}",
                            "evaluate the draft trained on this run (or rerun stage 05)")
    tok = load_tokenizer(inp.model_dir, stage.cfg.target.tokenizer)
    prompts, prompt_source = held_out_prompt_ids(inp, tok, cfg.num_prompts)
    results: dict[str, Any] = {"k": k, "sweep_k": ks, "prompt_source": prompt_source, "prompts": len(prompts),
                               "max_new_tokens": cfg.max_new_tokens, "device": device, "dtype": str(dtype),
                               "checkpoint": str(inp.checkpoint), "target": str(inp.model_dir), "by_method": {},
                               "sweep": {}, "seconds": {}}
    done = FinishedMethods(stage.rd.path("eval", "partial.json"), {
        **{key: results[key] for key in ("k", "sweep_k", "max_new_tokens", "device", "dtype", "checkpoint")},
        "weights": _file_stamp(Path(inp.checkpoint) / "model.safetensors"), "offline_max_rows": cfg.offline_max_rows,
        "vllm_sweep": cfg.vllm_sweep, "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()})
    target = None
    if ("embedded" in cfg.methods and not done.has("embedded")) or "offline" in cfg.methods:
        target = load_target(inp.model_dir, device, dtype)
    eos = eos_ids(target, tok) if target is not None else []
    if "offline" in cfg.methods and inp.val_rows > 0:
        def offline_rows() -> dict[str, Any]:
            rows_acc, n_rows = run_offline_rows(draft, inp, ks, cfg.offline_max_rows, progress=progress)
            return {"rows": n_rows, "acceptance": rows_acc[k].to_dict(),
                    "sweep": {str(kk): a.to_dict() for kk, a in rows_acc.items()}}

        rows = done.run("offline_rows", offline_rows, results)
        results["offline_rows"] = rows
        results["by_method"]["offline (validation rows)"] = rows["acceptance"]
        results["sweep"]["offline (validation rows)"] = rows["sweep"]
    continuations: list[list[int]] | None = None
    if "embedded" in cfg.methods:
        def embedded() -> dict[str, Any]:
            workers = embedded_workers(target, device, len(prompts))
            emb = run_embedded(target, draft, prompts, k, cfg.max_new_tokens, eos, progress=progress,
                               workers=workers, load=(inp.model_dir, inp.checkpoint, device, dtype_name))
            return {**{key: v for key, v in emb.items() if key != "per_prompt"},
                    "outputs": [r["output_ids"] for r in emb["per_prompt"]],
                    "verified": [r["verified_ids"] for r in emb["per_prompt"]],
                    "acceptances": [r["acceptance"] for r in emb["per_prompt"]]}

        emb = done.run("embedded", embedded, results)
        results["embedded"] = {key: v for key, v in emb.items() if key not in ("outputs", "verified", "acceptances")}
        results["by_method"]["embedded"] = emb["acceptance"]
        categories = held_out_categories(inp, cfg.num_prompts) if tok is not None else None
        if categories and len(categories) == len(emb.get("acceptances") or []):
            results["embedded_by_category"] = by_category(categories, emb["acceptances"], k)
        continuations = emb["verified"]
        results["embedded_outputs"] = emb["outputs"]
    if "offline" in cfg.methods:
        def offline_heldout() -> dict[str, Any]:
            conts = continuations
            if conts is None:  # no decoder run: the target's plain greedy continuations
                from eagle3lib.speculative import greedy_generate

                conts = [greedy_generate(target, p, cfg.max_new_tokens, eos or None)[0] for p in prompts]
            sim = run_offline_continuations(target, draft, prompts, conts, ks)
            return {str(kk): {n: a.to_dict() for n, a in parts.items()} for kk, parts in sim.items()}

        held = done.run("offline_heldout", offline_heldout, results)
        results["offline_heldout"] = held
        results["by_method"]["offline (held-out, all starts)"] = held[str(k)]["all"]
        results["by_method"]["offline (held-out, decoder path)"] = held[str(k)]["path"]
        results["sweep"]["offline (held-out, decoder path)"] = {str(kk): held[str(kk)]["path"] for kk in ks}
        results["sweep"]["offline (held-out, all starts)"] = {str(kk): held[str(kk)]["all"] for kk in ks}
    target = None  # free it before vLLM starts
    if "vllm" in cfg.methods:
        live = done.run("vllm", lambda: run_vllm(inp, prompts, k, cfg.max_new_tokens, stage.rd.path("eval", "vllm"),
                                                 dtype_name, sweep=ks if cfg.vllm_sweep else None), results)
        results["vllm"] = {key: v for key, v in live.items() if key not in ("outputs", "baseline_outputs", "sweep")}
        results["by_method"]["vllm"] = live["acceptance"]
        if cfg.vllm_sweep:
            results["sweep"]["vllm"] = {str(kk): a for kk, a in live["sweep"].items()}
        if "embedded_outputs" in results:
            results["vllm"]["identical_to_embedded"] = count_identical(live["baseline_outputs"],
                                                                       results["embedded_outputs"])
    if "ngram" in cfg.methods:
        ng = done.run("ngram", lambda: run_ngram(inp, prompts, k, cfg.max_new_tokens, stage.rd.path("eval", "vllm"),
                                                 dtype_name), results)
        results["ngram"] = {key: v for key, v in ng.items() if key != "outputs"}
        results["by_method"][NGRAM] = ng["acceptance"]
        if "embedded_outputs" in results:
            results["ngram"]["identical_to_embedded"] = count_identical(ng["outputs"], results["embedded_outputs"])
    results["seconds"]["total"] = round(time.perf_counter() - t_all, 2)
    atomic.write_json(stage.rd.path("eval", "results.json"), results)
    done.clear()
    return results


def figures(stage: StageRun, results: dict[str, Any]) -> dict[str, Any]:
    """The four figures (PNG in the run's figures/); returns {name: (path, fig)}."""
    out = {}
    for name, fn in (("per_position", plot_per_position), ("accepted_lengths", plot_length_histogram),
                     ("tau_vs_k", plot_tau_vs_k), ("speedup", plot_speedup)):
        path = stage.rd.figure_path("06", name)
        out[name] = (path, fn(results, path))
    return out


def summary_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: tau, draft acceptance rate, per-position rates, drafts (what the notebook shows)."""
    rows = []
    for name, a in results["by_method"].items():
        rows.append({"method": name, "tau": a["tau"], "draft_acceptance_rate": a["draft_acceptance_rate"],
                     "per_pos_rate": a["per_pos_rate"], "drafts": a["drafts"]})
    return rows


def metrics_for_manifest(results: dict[str, Any]) -> dict[str, Any]:
    m: dict[str, Any] = {"k": results["k"], "prompts": results["prompts"],
                         "tau": {name: a["tau"] for name, a in results["by_method"].items()}}
    for name in ("embedded", "vllm"):
        if name in results:
            m[f"{name}_speedup"] = results[name].get("speedup")
            m[f"{name}_identical"] = f"{results[name]['identical']}/{results[name]['prompts']}"
    return m
