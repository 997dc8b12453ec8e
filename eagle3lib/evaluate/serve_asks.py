"""What the serve step asks its servers beyond the load levels, and what their replies show: the held-out prompts'
greedy outputs a group at a time (τ per held-out source or category from the server's counters), each benchmark's
items turn by turn (τ per benchmark, category and turn) as results.json rows, and where a speculating server's
outputs differ from the target alone's, whether at a rounding tie (`tie_check`).

Why apart from serve.py: every speculating server is asked the same way, and these read only a server's replies and
counters; serve.py decides which server asks what.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from eagle3lib.evaluate.decoder import Acceptance
from eagle3lib.evaluate.methods import tokens_per_step

if TYPE_CHECKING:
    from eagle3lib.common.config import WorkbookConfig
    from eagle3lib.evaluate.inputs import EvalInputs

log = logging.getLogger("eagle3lib.evaluate")


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


def tie_check(cfg: WorkbookConfig, inp: EvalInputs, prompts: list[list[int]], base_out: list[list[int]],
              spec_outs: dict[str, list[list[int]]], device: str) -> dict[str, dict[str, Any]]:
    """Per speculating server, each output that differs from the baseline's, checked where it first differs (a
    rounding tie, or a token the target ranks low: `decoder.first_divergence`), with the transformers target
    loaded once for that only (not at all when nothing differs, nor where transformers cannot load it onto one
    device: a Kimi-K2.5 on 8 GPUs; then each row says why, `not_checked`)."""
    differ = {v: [i for i, (a, b) in enumerate(zip(base_out, out, strict=True)) if a != b]
              for v, out in spec_outs.items()}
    if not any(differ.values()):
        return {v: {"differ_at_a_tie": 0, "differ_otherwise": 0, "divergences": []} for v in spec_outs}
    import torch

    from eagle3lib.common.causal_lm import causal_lm_refusal
    from eagle3lib.common.device import free_bytes, torch_dtype
    from eagle3lib.evaluate.decoder import first_divergence
    from eagle3lib.evaluate.methods import load_target

    refusal = causal_lm_refusal(inp.model_dir, cfg.target.trust_remote_code, free_bytes(device))
    if refusal:
        log.info("serve: outputs that differ not checked for rounding ties: %s", refusal)
        return {v: {"differ_at_a_tie": None, "differ_otherwise": None, "divergences": [], "not_checked": refusal}
                for v in spec_outs}
    t0 = time.perf_counter()
    target = load_target(inp.model_dir, device, torch_dtype(cfg.target.dtype, device), cfg.target.trust_remote_code)
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
