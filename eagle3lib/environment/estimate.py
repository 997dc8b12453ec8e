"""How many rows and tokens stage 02 will write, estimated before anything is generated (stage 00's disk check).

Why an estimate and not `samples × data.max_length`: that upper bound is what a run can never exceed, not what it
writes. The SmolLM2 GPU recipe's bound was 95.8 GB for 20,312 conversations × 1,024 tokens on a 64 GB disk while
the run wrote 32.7 GB (7.44M tokens): stage 00 refused a run that fit. So the estimate uses the lengths that can be
known before generation, the same way `prepare.prepare` builds the rows:
- the records of every readable source (bundled, jsonl, hf_disk, and the package sets: sharegpt, alpaca_eval,
  arena_hard, writingbench, streamed and capped by `limit`), de-duplicated, minus the held-out prompts (the few
  conversations that overlap an `evaluate.benchmarks` prompt are not subtracted: the estimate errs high);
  `self_instruct` and `magpie` sources (the target writes their prompts) count `limit` prompts of at most their
  `max_new_tokens` tokens; `data.num_samples` caps the pool before `replies` multiplies it;
- per row: the chat template's own tokens + the prompt's tokens + the reply: `data.gen_max_new_tokens` per user turn
  when the target writes the replies (a reply may stop sooner: this part is an upper bound), the reply's own tokens
  otherwise; a `followup_prob` share of generated rows gets a second request and reply; capped at
  `data.max_length`.
A source that cannot be read before stage 02 (a hub dataset) counts `limit` (else 10,000) rows at `data.max_length`.
Tokens are counted with the target's tokenizer for the first EXACT_TEXTS texts and from their characters per token
after that: tokenizing all 22 MB of ShareGPT's user turns took 40 s on the 2-core box, reading them 1 s.
Stage 02 checks again with the real token count before its first shard (`extract.disk.require_disk`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.common.config import GENERATED_KINDS, WorkbookConfig
from eagle3lib.common.sources import load_source, prompt_key
from eagle3lib.common.target import load_tokenizer

UNKNOWN_ROWS = 10_000  # rows assumed for a source whose size cannot be known before stage 02 (stated as such)
EXACT_TEXTS = 2_000  # texts tokenized exactly; later ones count at the characters per token measured on these


@dataclass
class DataEstimate:
    """Rows and tokens stage 02 will write: `tokens` is the estimate, `upper_bound_tokens` = rows × max_length."""

    rows: int
    tokens: int
    upper_bound_tokens: int
    per_source: list[dict[str, Any]] = field(default_factory=list)


def _counter(tok: Any):
    """Tokens of a text: the target's tokenizer (the first EXACT_TEXTS texts; then their characters per token),
    else ~4 characters a token."""
    if tok is None:
        return lambda text: len(text) // 4 + 1
    seen = {"texts": 0, "chars": 0, "tokens": 0}

    def count(text: str) -> int:
        if seen["texts"] >= EXACT_TEXTS:
            return round(len(text) * seen["tokens"] / max(seen["chars"], 1))
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        seen["texts"] += 1
        seen["chars"] += len(text)
        seen["tokens"] += n
        return n

    return count


def template_tokens(tok: Any) -> int:
    """Tokens the chat template adds around one user turn and one reply (role headers, a default system prompt)."""
    if tok is None:
        return 16
    text = tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}],
                                   tokenize=False)
    return max(0, len(tok(text, add_special_tokens=False)["input_ids"]) - 2)


def estimate_data(cfg: WorkbookConfig, model_dir: Path | None) -> DataEstimate:
    """The estimate for `cfg` (see the module docstring); `model_dir` None = count without the target's tokenizer."""
    d = cfg.data
    tok = load_tokenizer(cfg.target, model_dir, chat=False) if model_dir is not None else None
    count, overhead = _counter(tok), template_tokens(tok)

    def row_tokens(messages: list[dict[str, str]]) -> int:
        users = [m for m in messages if m["role"] != "assistant"]
        prompt = sum(count(m["content"]) for m in users)
        if d.self_distill:
            reply = d.gen_max_new_tokens * sum(m["role"] == "user" for m in messages)
        else:
            reply = sum(count(m["content"]) for m in messages if m["role"] == "assistant")
        turns = max(1, sum(m["role"] == "user" for m in messages))
        return min(d.max_length, overhead * turns + prompt + reply)

    pool: list[tuple[int, int]] = []  # (tokens of one row, rows it becomes: replies)
    per_source: list[dict[str, Any]] = []
    seen: set[str] = set()
    held_out = d.eval_samples
    for src in d.sources:
        before = len(pool)
        if src.kind in GENERATED_KINDS:
            reply = d.gen_max_new_tokens if d.self_distill else 0
            one = min(d.max_length, overhead + src.max_new_tokens + reply)
            two = min(d.max_length, 2 * (overhead + src.max_new_tokens + reply))
            per_row = round((1 - src.followup_prob) * one + src.followup_prob * two)
            pool += [(per_row, src.replies)] * (src.limit or 0)
            known = True
        elif src.kind == "hf_hub":
            pool += [(d.max_length, src.replies)] * (src.limit or UNKNOWN_ROWS)
            known = False
        else:
            for rec in load_source(src):
                key = prompt_key(rec["messages"])
                if key in seen:
                    continue
                seen.add(key)
                if held_out > 0:  # the held-out prompts come from these sources and are never extracted
                    held_out -= 1
                    continue
                pool.append((row_tokens(rec["messages"]), src.replies))
            known = True
        per_source.append({"kind": src.kind, "prompts": len(pool) - before, "known": known})
    if d.num_samples is not None:
        pool = pool[: d.num_samples]
    rows = sum(n for _, n in pool)
    tokens = sum(t * n for t, n in pool)
    return DataEstimate(rows, tokens, rows * d.max_length, per_source)
