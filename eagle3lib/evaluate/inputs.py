"""What stage 06 reads: earlier stages' outputs (`inputs_from_run`), the held-out prompts, the target's eos ids.

Why apart from the methods: every method (offline, embedded, vLLM, n-gram) runs on the same prompts; the prompts
are rendered once, here, from stage 02's eval split, never from anything trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.common import jsonl, shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import StageRun, cache_root


@dataclass
class EvalInputs:
    """What stage 06 reads, all from earlier manifests."""

    model_dir: Path
    # every drafter stage 05 trained, in train.algorithms' order: {algorithm: its final checkpoint}
    drafts: dict[str, Path]
    dataset_dir: Path
    eval_prompts: Path
    verifier_dir: Path  # stage 04's verifier/ folder: the target's final norm and lm_head under fixed names
    layer_ids: list[int]  # incl. the final id N
    train_rows: int
    val_rows: int
    # every vLLM process of the run shares one cache (rundir.cache_root: model-info inspections, torch.compile
    # artifacts): the servers find what stage 02's engine already inspected (each miss costs tens of seconds on an
    # H200: docs/cpu.md#caches-and-environment)
    cache_dir: Path
    # evaluate.benchmarks as stage 02 wrote them: {name: data/bench_<name>.jsonl}, and {name: its counts}
    benchmarks: dict[str, Path] = field(default_factory=dict)
    benchmark_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    shard_rows: list[int] | None = None  # train.hidden_states online or spool: the only rows with a shard (None = all)

    @property
    def checkpoint(self) -> Path | None:
        """The EAGLE-3 draft, the one the workbook's own decoder and its in-process vLLM job follow (None: stage 05
        trained no EAGLE-3 draft; eagle3lib.common.drafters.EAGLE3_ONLY_METHODS)."""
        return self.drafts.get("eagle3")


def inputs_from_run(stage: StageRun) -> EvalInputs:
    rd = stage.rd
    m02 = rd.read_manifest("02")
    m05 = rd.read_manifest("05")
    algorithms = m05.get("metrics", {}).get("algorithms") or []
    missing = [a for a in algorithms if f"checkpoint_{a}" not in m05["outputs"]]
    if not algorithms or missing:
        raise WorkbookError(f"stage 05 recorded no checkpoint for {', '.join(missing) or 'any drafter'}",
                            "rerun stage 05 (it writes each drafter's final checkpoint)")
    drafts = {a: rd.root / m05["outputs"][f"checkpoint_{a}"] for a in algorithms}  # absolute stays absolute
    model_dir = Path(m02["outputs"]["model_dir"])
    return EvalInputs(model_dir=model_dir if model_dir.is_absolute() else rd.root / model_dir, drafts=drafts,
                      dataset_dir=rd.output("02", "dataset"), eval_prompts=rd.output("02", "eval_prompts"),
                      verifier_dir=rd.output("04", "verifier_dir"),
                      layer_ids=list(m02["metrics"]["layer_ids"]), train_rows=int(m02["metrics"]["train_rows"]),
                      val_rows=int(m02["metrics"]["val_rows"]),
                      benchmarks={key.removeprefix("benchmark_"): rd.root / path
                                  for key, path in m02["outputs"].items() if key.startswith("benchmark_")},
                      benchmark_info=m02["metrics"].get("benchmarks") or {},
                      shard_rows=shards.shard_rows(m02["metrics"], 0) if shards.sampled(m02["metrics"]) else None,
                      cache_dir=cache_root(stage.cfg))


def held_out_groups(inp: EvalInputs, limit: int | None) -> tuple[str, list[str]] | None:
    """("source" or "category", each held-out prompt's label in prompt order): their data sources where they come
    from more than one (a mix: which source a draft falls short on says which data to add), else their categories
    (the bundled set alone has 8); None where the prompts carry neither (a run's eval.jsonl before sources were
    recorded keeps its categories)."""
    if not inp.eval_prompts.is_file():
        return None
    records = jsonl.read(inp.eval_prompts)
    records = records[:limit] if limit else records
    for by in ("source", "category"):
        labels = [r.get(by) for r in records]
        if labels and all(labels) and (by == "category" or len(set(labels)) > 1):
            return by, [str(x) for x in labels]
    return None


def held_out_digest(inp: EvalInputs, tok: Any | None, prompts: list[list[int]]) -> str:
    """Which held-out prompts stage 06 asked, as 16 hex digits of a sha256: of their messages where the target has a
    tokenizer (the same texts give the same digest whatever the target), else of their token ids. `eagle3 compare`
    and benchmarks/data_curve.py compare two runs' held-out τ only where the digests match."""
    import hashlib

    what: Any = prompts
    if tok is not None:
        what = [r["messages"] for r in jsonl.read(inp.eval_prompts)][: len(prompts)]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def held_out_prompt_ids(inp: EvalInputs, tok: Any | None, limit: int | None) -> tuple[list[list[int]], str]:
    """Token ids of the held-out prompts, rendered with the chat template and its generation prompt.

    Without a tokenizer (tiny random test targets) the prompts are the prefixes (up to the first loss-masked token)
    of the dataset's validation rows: also never trained on. Returns (prompt ids, where they came from).
    """
    if tok is not None:
        prompts = [r["messages"] for r in jsonl.read(inp.eval_prompts)]
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
    """The ids that end a generation: the target's generation config, else the tokenizer's eos; [] without either."""
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None and tok is not None:
        eos = tok.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
