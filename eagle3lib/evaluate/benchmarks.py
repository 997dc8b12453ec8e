"""Stage 06 on the evaluation benchmarks (`evaluate.benchmarks`): the prompts asked, and τ per benchmark, per
category and per turn.

Why beside the held-out split: the held-out prompts are drawn from the training sources, so they look like what the
draft was trained on; a benchmark (MT-Bench, AlpacaEval, Arena-Hard, WritingBench, or a user's own JSONL) says how
the draft does on prompts it has not seen the like of, and per category where it falls short. Stage 02 wrote each
benchmark's items (data/bench_<name>.jsonl) and dropped every training conversation that overlaps one of them.

Turns: an item's first prompt is turn 1. Each later user turn (MT-Bench's second turns) is asked after the target's
OWN greedy answer to the turns before it (`ask_in_turn`: generated here with `evaluate.max_new_tokens`, batched),
never after a reference answer written by another model: that context is what the draft meets when it serves the
target. The conversations asked, with each prompt's acceptance, go to eval/benchmarks/<name>.jsonl.

The methods themselves (the embedded decoder and the offline continuation) are `methods.py`'s, run over these
prompts; this module selects, asks and groups: results["tau_by_benchmark"][name] = {source, questions, prompts,
dedup_dropped, by_method, by_category, by_turn}, each a `decoder.Acceptance` dict per method row.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common import atomic, jsonl
from eagle3lib.common.errors import WorkbookError
from eagle3lib.evaluate.decoder import Acceptance
from eagle3lib.evaluate.inputs import EvalInputs

ANSWER_BATCH = 16  # first answers generated per padded batch


def benchmark_files(inp: EvalInputs, names: list[str]) -> dict[str, Path]:
    """The configured benchmarks' files, as stage 02 recorded them (one clear error for one it did not write)."""
    missing = [n for n in names if n not in inp.benchmarks or not inp.benchmarks[n].is_file()]
    if missing:
        raise WorkbookError(f"stage 02 wrote no prompts for benchmark(s) {', '.join(missing)}",
                            "rerun stage 02 with these evaluate.benchmarks (it drops the training conversations that "
                            "overlap them), then stages 05-06")
    return {n: inp.benchmarks[n] for n in names}


def fingerprint(files: dict[str, Path], limit: int | None) -> dict[str, Any]:
    """What a finished benchmark measurement depends on beyond the held-out run's settings: its items, the limit."""
    return {"limit": limit, "items": {n: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for n, p in files.items()}}


def read_items(path: Path) -> list[dict[str, Any]]:
    return jsonl.read(path)


def select_items(items: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` items taken in turn over the categories (in the order they first appear), so a few
    questions of MT-Bench (sorted by category) still cover several categories; all when `limit` is None."""
    if limit is None or limit >= len(items):
        return list(items)
    by_cat: dict[str, list[dict[str, Any]]] = {}
    for it in items:
        by_cat.setdefault(str(it.get("category")), []).append(it)
    queues = [list(reversed(v)) for v in by_cat.values()]
    out: list[dict[str, Any]] = []
    while len(out) < limit:
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop())
    return out


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation rendered with the chat template and its generation prompt, as token ids."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@torch.inference_mode()
def greedy_answers(target: Any, tok: Any, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
                   batch_size: int = ANSWER_BATCH, desc: str = "answers", progress: bool = True) -> list[str]:
    """The target's greedy answers to rendered prompts (left-padded batches), decoded without special tokens."""
    from tqdm.auto import tqdm

    dev = next(target.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    out: list[str] = []
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", disable=not progress):
        chunk = prompts[i:i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=dev)
        gen = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                              max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad,
                              temperature=None, top_p=None, top_k=None, repetition_penalty=None)
        out += [answer_text(tok, row, {pad, *eos}) for row in gen[:, width:].tolist()]
    return out


def answer_text(tok: Any, ids: list[int], stop: set[int]) -> str:
    """A generated answer as the next turn's assistant message: trailing stop/pad ids cut, special tokens skipped."""
    n = len(ids)
    while n and ids[n - 1] in stop:
        n -= 1
    return tok.decode(ids[:n], skip_special_tokens=True).strip()


def next_turn(open_convs: list[tuple[dict[str, Any], list[dict[str, str]]]], answers: list[str], turn: int
              ) -> list[tuple[dict[str, Any], list[dict[str, str]]]]:
    """The conversations that go on after turn `turn`: each one's answer to it, then its next user turn (`answers`
    holds one answer per conversation in `open_convs`)."""
    return [(it, [*msgs, {"role": "assistant", "content": a}, {"role": "user", "content": it["followups"][turn - 1]}])
            for (it, msgs), a in zip(open_convs, answers, strict=True) if len(it.get("followups") or []) >= turn]


def ask_in_turn(target: Any, tok: Any, items: list[dict[str, Any]], max_new_tokens: int, eos: list[int],
                progress: bool = True) -> list[dict[str, Any]]:
    """Every prompt of the items, turn by turn: {"messages", "category", "turn"}. Turn n + 1 of an item is its
    conversation so far, the target's own greedy answer to turn n, then its next user turn."""
    asked: list[dict[str, Any]] = []
    open_convs = [(it, [dict(m) for m in it["messages"]]) for it in items]
    turn = 1
    while open_convs:
        asked += [{"messages": msgs, "category": it.get("category"), "turn": turn} for it, msgs in open_convs]
        going_on = [(it, msgs) for it, msgs in open_convs if len(it.get("followups") or []) >= turn]
        answers = greedy_answers(target, tok, [chat_ids(tok, msgs) for _, msgs in going_on], max_new_tokens, eos,
                                 desc=f"the target's answers to turn {turn}", progress=progress) if going_on else []
        open_convs = next_turn(going_on, answers, turn)
        turn += 1
    return asked


def group(asked: list[dict[str, Any]], per_prompt: dict[str, list[dict[str, Any]]], k: int) -> dict[str, Any]:
    """Per-prompt acceptances (by method row) merged over the whole benchmark, by category and by turn."""
    def merged(idx: list[int]) -> dict[str, Any]:
        out = {}
        for name, accs in per_prompt.items():
            acc = Acceptance(k)
            for i in idx:
                acc.merge(Acceptance.from_dict(accs[i]))
            out[name] = acc.to_dict()
        return out

    def by(key: str) -> dict[str, Any]:
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(asked):
            groups.setdefault(str(a[key]), []).append(i)
        return {g: {"prompts": len(idx), "by_method": merged(idx)} for g, idx in groups.items()}

    return {"prompts": len(asked), "by_method": merged(list(range(len(asked)))), "by_category": by("category"),
            "by_turn": by("turn")}


def write_asked(path: Path, asked: list[dict[str, Any]], per_prompt: dict[str, list[dict[str, Any]]]) -> Path:
    """eval/benchmarks/<name>.jsonl: each conversation asked (the target's own earlier answers included) with its
    τ per method, to read which prompts a draft does badly on."""
    rows = [{**a, "tau": {name: accs[i]["tau"] for name, accs in per_prompt.items()}} for i, a in enumerate(asked)]
    return atomic.write_text(path, jsonl.dumps(rows))
