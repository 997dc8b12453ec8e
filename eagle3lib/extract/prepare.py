"""Stage 02, part 1: the training conversations — loaded, split, self-distilled and tokenized with a loss mask.

Pipeline (`prepare`), in this order on purpose:
1. load every source (bundled prompt set, ShareGPT / OpenAI-messages JSONL, `datasets` folders or hub sets),
   check each record (roles, empty turns) and report the file line or row of a malformed one;
2. split the held-out evaluation prompts off FIRST (stratified over categories, seeded), before anything can train
   on them, and drop every training conversation that shares a user turn with them;
3. self-distillation: the target regenerates every assistant turn (batched transformers `generate`, left padding),
   because a draft learns best the distribution it will have to predict — the target's own replies. Replies are
   cached in `data/distill_cache.jsonl` so a killed run does not generate them twice;
4. tokenize with the target's chat template; `loss_mask` = 1 exactly on the characters of assistant turns (found by
   rendering prefixes of the conversation and mapping character offsets to tokens), truncate to `max_length`;
5. the last `val_fraction` of the rows are validation rows (speculators splits a dataset by a trailing ratio).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3lib import atomic
from eagle3lib.config import DataSource, WorkbookConfig
from eagle3lib.errors import WorkbookError
from eagle3lib.extract.generators import (
    Generator,
    cache_key,
    finish_stats,
    generate_cached,
    make_generator,
    new_stats,
    read_cache,
)
from eagle3lib.target import load_tokenizer

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
}
BUNDLED = "prompts.jsonl"


# --------------------------------------------------------------------------------------------------------- sources
def bundled_prompts_path() -> Path:
    return Path(str(resources.files("eagle3lib") / "assets" / BUNDLED))


def normalize_record(obj: Any, where: str) -> dict[str, Any]:
    """One conversation in OpenAI-messages form, from an OpenAI-messages or ShareGPT record (or a bare prompt).

    Why strict: a silently skipped or mis-read record changes what the draft learns; the user gets the location.
    """
    if not isinstance(obj, dict):
        raise WorkbookError(f"{where}: expected a JSON object, got {type(obj).__name__}",
                            'write one object per line: {"messages": [{"role": "user", "content": "..."}]}')
    if "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    elif isinstance(obj.get("prompt"), str):
        turns, role_key, text_key = [{"role": "user", "content": obj["prompt"]}], "role", "content"
    else:
        raise WorkbookError(f"{where}: no 'messages' (OpenAI) or 'conversations' (ShareGPT) field (keys: {sorted(obj)})",
                            "give each record a messages list of {role, content} turns")
    if not isinstance(turns, list) or not turns:
        raise WorkbookError(f"{where}: the conversation is empty or not a list", "give at least one user turn")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise WorkbookError(f"{where}, turn {j}: expected an object with role and content", "fix the record")
        raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise WorkbookError(f"{where}, turn {j}: unknown role {raw_role!r}",
                                f"use one of system, user, assistant (ShareGPT: human, gpt); known: {sorted(ROLE_ALIASES)}")
        content = turn.get(text_key, turn.get("content", turn.get("value")))
        if not isinstance(content, str) or not content.strip():
            raise WorkbookError(f"{where}, turn {j} ({role}): empty turn", "remove the turn or give it text content")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise WorkbookError(f"{where}: no user turn", "every conversation needs at least one user turn")
    return {"messages": messages, "category": obj.get("category")}


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of a JSONL file; a malformed line stops with its line number. Blank lines are skipped."""
    if not path.is_file():
        raise WorkbookError(f"data source {path} does not exist", "point data.sources[].path at a JSONL file")
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkbookError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})",
                                    "fix or remove that line (one JSON object per line)") from None
            rec = normalize_record(obj, f"{path}:{lineno}")
            rec["source"] = path.name
            out.append(rec)
    return out


def _records_from_hf(ds: Iterable[dict[str, Any]], name: str, limit: int | None) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(ds):
        if limit is not None and len(out) >= limit:
            break
        rec = normalize_record(dict(row), f"{name} row {i}")
        rec["source"] = name
        out.append(rec)
    return out


def load_source(src: DataSource) -> list[dict[str, Any]]:
    """The records of one configured source (self_instruct sources are generated in `prepare`, after the split)."""
    if src.kind == "self_instruct":
        return []
    if src.kind == "bundled":
        recs = read_jsonl(bundled_prompts_path(), src.limit)
        for r in recs:
            r["source"] = "bundled"
        return recs
    if src.path is None:
        raise WorkbookError(f"data source of kind {src.kind!r} has no path", "set data.sources[].path")
    if src.kind == "jsonl":
        return read_jsonl(Path(src.path).expanduser(), src.limit)
    import datasets

    if src.kind == "hf_disk":
        path = Path(src.path).expanduser()
        if not path.exists():
            raise WorkbookError(f"data source {path} does not exist", "point data.sources[].path at a save_to_disk folder")
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if src.split not in ds:
                raise WorkbookError(f"{path} has no split {src.split!r} (has {list(ds)})", "set data.sources[].split")
            ds = ds[src.split]
        return _records_from_hf(ds, path.name, src.limit)
    try:
        ds = datasets.load_dataset(src.path, split=src.split)
    except Exception as e:  # the hub or its cache: many exception types, one user-facing message
        raise WorkbookError(f"cannot load dataset {src.path!r} split {src.split!r} ({e.__class__.__name__}: {str(e)[:120]})",
                            "check the name and network, or download it once and use kind: hf_disk") from None
    return _records_from_hf(ds, src.path, src.limit)


def load_records(cfg: WorkbookConfig) -> list[dict[str, Any]]:
    """All sources, in order, de-duplicated on the conversation's user turns (a repeated prompt would leak)."""
    seen: set[str] = set()
    out = []
    for src in cfg.data.sources:
        for rec in load_source(src):
            key = prompt_key(rec["messages"])
            if key not in seen:
                seen.add(key)
                out.append({**rec, "replies": src.replies} if src.replies > 1 else rec)
    return out


def prompt_key(messages: list[dict[str, str]]) -> str:
    return "\x1f".join(m["content"].strip() for m in messages if m["role"] == "user")


# ----------------------------------------------------------------------------------------------------- eval split
def eval_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A held-out prompt: the conversation up to and including its first user turn (system turns kept)."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            break
    return out


def split_eval(records: list[dict[str, Any]], n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(eval, train): eval drawn round-robin over categories (seeded) so it covers the mix; train excludes any
    conversation sharing a user turn with an eval prompt."""
    if n_eval <= 0:
        return [], list(records)
    if n_eval >= len(records):
        raise WorkbookError(f"data.eval_samples={n_eval} leaves no training data ({len(records)} conversations)",
                            f"lower data.eval_samples below {len(records)} or add data sources")
    rng = random.Random(seed)
    by_cat: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_cat.setdefault(str(r.get("category")), []).append(i)
    for idx in by_cat.values():
        rng.shuffle(idx)
    cats = sorted(by_cat)
    rng.shuffle(cats)
    chosen: list[int] = []
    while len(chosen) < n_eval:
        for c in cats:
            if by_cat[c] and len(chosen) < n_eval:
                chosen.append(by_cat[c].pop())
    chosen_set = set(chosen)
    evals = [records[i] for i in chosen]
    held = {m["content"].strip() for r in evals for m in r["messages"] if m["role"] == "user"}
    train = [r for i, r in enumerate(records) if i not in chosen_set
             and not any(m["role"] == "user" and m["content"].strip() in held for m in r["messages"])]
    return evals, train


# ------------------------------------------------------------------------------------------------ tokenization
def _render(tok, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_conversation(tok, messages: list[dict[str, str]], max_length: int) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation; loss_mask = 1 on tokens inside assistant turns only.

    Why prefixes + offsets: chat templates differ in how they wrap turns, but every template we know renders a
    conversation's prefix as a prefix of its full rendering. The assistant turn i then spans the characters between
    render(messages[:i], generation prompt) and render(messages[:i+1]) — its text and end-of-turn marker, not the
    role header — and the tokenizer's offsets map those characters to tokens.
    """
    text = _render(tok, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start_text = _render(tok, messages[:i], add_generation_prompt=True)
        end_text = _render(tok, messages[: i + 1])
        if not (text.startswith(start_text) and text.startswith(end_text) and len(start_text) <= len(end_text)):
            raise WorkbookError("the chat template does not render conversation prefixes as prefixes of the whole",
                                "use a tokenizer whose chat template is prefix-stable, or pre-tokenize the data")
        spans.append((len(start_text), len(end_text)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    for t, (a, b) in enumerate(offsets):
        if b > a and any(s <= a and b <= e for s, e in spans):
            mask[t] = 1
        elif b > a and any(a < e and s < b for s, e in spans):
            mask[t] = 1  # a token straddling a turn boundary: count it if it overlaps the assistant text
    return ids[:max_length], mask[:max_length]


# --------------------------------------------------------------------------------------------- self-distillation
def self_distill(cfg: WorkbookConfig, model_dir: Path, tok, convs: list[list[dict[str, str]]], cache_path: Path,
                 progress: bool = True, generator: Generator | None = None, variants: list[int] | None = None,
                 ) -> tuple[list[list[dict[str, str]]], dict[str, Any]]:
    """Regenerate every assistant turn with the target, turn by turn (a reply sees the replies generated before it).

    The generator (`data.generator`: transformers | vllm, eagle3lib.extract.generators) only continues rendered texts; the
    turn logic, the cache and the stats live here and in `generate_cached`, shared by both. Conversation i is
    answered at `gen_temperatures[i % len]` (or `gen_temperature`), part of its cache key. `variants[i]` > 0 marks an
    extra reply to a prompt that is already in `convs` (`data.sources[].replies`): sampled at the highest
    temperature, the variant in its cache key.
    """
    import time

    from tqdm.auto import tqdm

    d = cfg.data
    temps = d.gen_temperatures or [d.gen_temperature]
    cache = read_cache(cache_path)
    # conversations as their system/user turns only; assistant turns are rebuilt
    skeletons = [[m for m in c if m["role"] != "assistant"] for c in convs]
    done: list[list[dict[str, str]]] = [[] for _ in convs]
    gen = generator or make_generator(cfg, model_dir, tok)
    stats = new_stats()
    n_user_max = max(sum(m["role"] == "user" for m in s) for s in skeletons) if skeletons else 0
    pos = [0] * len(skeletons)  # next index into each skeleton
    bar = tqdm(total=sum(sum(m["role"] == "user" for m in s) for s in skeletons), desc="self-distill", unit="reply",
               disable=not progress)
    t0 = time.time()
    try:
        for _turn in range(n_user_max):
            pending: list[tuple[int, str, str, float]] = []
            for ci, sk in enumerate(skeletons):
                # copy turns up to and including the next user turn
                while pos[ci] < len(sk):
                    m = sk[pos[ci]]
                    pos[ci] += 1
                    done[ci].append(m)
                    if m["role"] == "user":
                        variant = variants[ci] if variants else 0
                        temp = max(temps) if variant else temps[ci % len(temps)]
                        settings = {"model": str(model_dir), "max_new_tokens": d.gen_max_new_tokens,
                                    "temperature": temp, "seed": cfg.run.seed, "dtype": cfg.target.dtype,
                                    **({"variant": variant} if variant else {})}
                        key = cache_key(done[ci], settings)
                        text = "" if key in cache else _render(tok, done[ci], add_generation_prompt=True)
                        pending.append((ci, key, text, temp))
                        break
            replies = generate_cached(gen, [(k, t, tp) for _, k, t, tp in pending], d.gen_max_new_tokens,
                                      cfg.run.seed, cache, cache_path, stats, bar)
            for ci, key, _, _ in pending:
                done[ci].append({"role": "assistant", "content": replies[key].text or "(no answer)"})
    finally:
        bar.close()
        if generator is None:
            gen.close()
    return done, finish_stats(stats, t0)


# ------------------------------------------------------------------------------------------------------ prepare
@dataclass
class Prepared:
    """The tokenized rows in dataset order (train rows first, then validation rows) and what made them."""

    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    conversations: list[list[dict[str, str]]]
    categories: list[str | None]
    n_train: int
    n_val: int
    eval_prompts: list[dict[str, Any]]
    stats: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.input_ids)

    def rows(self) -> Iterator[tuple[int, list[int]]]:
        return iter(enumerate(self.input_ids))


def prepare(cfg: WorkbookConfig, model_dir: Path, data_dir: Path, progress: bool = True) -> Prepared:
    """Sources → eval split → (self-instruct prompts) → (self-distillation, follow-up turns) → tokenized rows;
    writes data/eval.jsonl and data/train.jsonl. One generator serves every generation step and is freed before
    returning (extraction loads the target again)."""
    d = cfg.data
    records = load_records(cfg)
    synth_sources = [s for s in d.sources if s.kind == "self_instruct"]
    if not records and (d.eval_samples > 0 or not synth_sources):
        raise WorkbookError("the data sources hold no conversations" + (
            " (held-out prompts never come from self_instruct)" if synth_sources else ""),
            "add records or another source in data.sources (e.g. {kind: bundled})")
    evals, pool = split_eval(records, d.eval_samples, cfg.run.seed) if records else ([], [])
    tok = load_tokenizer(cfg.target, model_dir)
    stats: dict[str, Any] = {"records": len(records), "eval_prompts": len(evals)}
    gen = make_generator(cfg, model_dir, tok)
    try:
        return _prepare(cfg, model_dir, data_dir, progress, tok, gen, evals, pool, stats)
    finally:
        stats["generator"] = {"name": gen.name, "engine_start_s": getattr(gen, "start_s", None)}
        gen.close()


def _prepare(cfg: WorkbookConfig, model_dir: Path, data_dir: Path, progress: bool, tok, gen: Generator,
             evals: list[dict[str, Any]], pool: list[dict[str, Any]], stats: dict[str, Any]) -> Prepared:
    d = cfg.data
    eval_texts = [m["content"] for r in evals for m in r["messages"] if m["role"] == "user"]
    synth_sources = [s for s in d.sources if s.kind == "self_instruct"]
    if synth_sources:
        from eagle3lib.extract import synth

        train_texts = [m["content"] for r in pool for m in r["messages"] if m["role"] == "user"]
        for j, src in enumerate(synth_sources):
            recs, st = synth.self_instruct(cfg, src, j, gen, tok, eval_texts, train_texts,
                                           data_dir / "self_instruct_cache.jsonl", progress)
            pool = pool + recs
            train_texts += [r["messages"][0]["content"] for r in recs]
            stats.setdefault("self_instruct", []).append(st)
    rng = random.Random(cfg.run.seed + 1)
    rng.shuffle(pool)
    if d.num_samples is not None:
        pool = pool[: d.num_samples]
    if not pool:
        raise WorkbookError("no training conversations left after the eval split", "add data or lower data.eval_samples")
    # data.sources[].replies: a prompt's extra replies sit right after it, so the trailing validation rows cut at most
    # one prompt's group
    pool = [dict(r, variant=v) if v else r for r in pool for v in range(r.get("replies", 1))]
    eval_prompts = [{"messages": eval_prompt(r["messages"]), "category": r.get("category")} for r in evals]
    atomic.write_text(data_dir / "eval.jsonl", "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in eval_prompts))

    convs = [r["messages"] for r in pool]
    if d.self_distill:
        cache = data_dir / "distill_cache.jsonl"
        variants = [r.get("variant", 0) for r in pool]
        convs, stats["self_distill"] = self_distill(cfg, model_dir, tok, convs, cache, progress, gen, variants)
        # multi-turn: a seeded share of each self_instruct source's conversations gets a second user turn,
        # written by the target after its distilled reply; then distilled again (turn 1 comes from the cache)
        chosen = [ci for ci, r in enumerate(pool) if "synth_source" in r and random.Random(
            f"{cfg.run.seed}:followup:{prompt_key(r['messages'])}").random()
            < synth_sources[r["synth_source"]].followup_prob]
        if chosen:
            from eagle3lib.extract import synth

            src = next(s for s in synth_sources if s.followup_prob > 0)
            convs, stats["followups"] = synth.add_followups(
                cfg, gen, tok, convs, chosen, eval_texts, data_dir / "self_instruct_cache.jsonl", src.temperature,
                src.max_new_tokens)
            convs, stats["self_distill_turn2"] = self_distill(cfg, model_dir, tok, convs, cache, progress, gen,
                                                              variants)
    else:
        missing = sum(not any(m["role"] == "assistant" for m in c) for c in convs)
        if missing:
            raise WorkbookError(f"{missing} of {len(convs)} training conversations have no assistant reply",
                                "set data.self_distill=true (the target writes the replies) or use data with replies")
    ids, masks, kept, cats = [], [], [], []
    dropped = truncated = 0
    for rec, conv in zip(pool, convs, strict=True):
        full_len = None
        i, m = tokenize_conversation(tok, conv, 10**9)
        full_len = len(i)
        i, m = i[: d.max_length], m[: d.max_length]
        if sum(m) == 0:
            dropped += 1  # the prompt alone fills max_length: nothing left to learn from
            continue
        truncated += full_len > d.max_length
        ids.append(i)
        masks.append(m)
        kept.append(conv)
        cats.append(rec.get("category"))
    n = len(ids)
    if n == 0:
        raise WorkbookError(f"every conversation lost its assistant tokens to data.max_length={d.max_length}",
                            "raise data.max_length")
    n_val = min(n - 1, math.ceil(n * d.val_fraction)) if d.val_fraction > 0 and n >= 2 else 0
    stats.update(dropped_rows=dropped, truncated_rows=truncated)
    split = ["train"] * (n - n_val) + ["val"] * n_val
    atomic.write_text(data_dir / "train.jsonl", "".join(
        json.dumps({"messages": c, "category": cat, "split": s}, ensure_ascii=False) + "\n"
        for c, cat, s in zip(kept, cats, split, strict=True)))
    return Prepared(ids, masks, kept, cats, n - n_val, n_val, eval_prompts, stats)


def mask_html(tok, input_ids: list[int], loss_mask: list[int], limit: int = 400) -> str:
    """One row as HTML: trained-on tokens (loss_mask = 1) highlighted — the quickest check that the mask is right."""
    import html

    parts = []
    for t, m in zip(input_ids[:limit], loss_mask[:limit], strict=True):
        piece = html.escape(tok.decode([t])).replace("\n", "↵<br>")
        style = "background:#c8f7c5" if m else "color:#777"
        parts.append(f'<span style="{style}">{piece}</span>')
    more = f" … (+{len(input_ids) - limit} tokens)" if len(input_ids) > limit else ""
    return ('<div style="font-family:monospace;font-size:12px;line-height:1.6">' + "".join(parts) + more + "</div>")
