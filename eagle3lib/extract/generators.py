"""Stage 02, text generation with the target: one swappable generator (transformers | vLLM) behind a cached loop.

Why a seam here: self-distillation and self-instruct both need "the target continues these texts", thousands of
times on a GPU run. transformers `generate` (the default; no extra install, the reference) and one offline vLLM
engine (`data.generator: vllm`, ~10-50x faster on a GPU: continuous batching, paged KV cache; `data.gen_engines`
of them side by side, eagle3lib.extract.engine_pool) are interchangeable:
`generate(texts, temperature, max_new_tokens, seeds) -> [Reply]`, and the same work as a non-blocking pair,
`submit(...) -> ticket` and `wait_any() -> (ticket, [Reply])`, with up to `slots` chunks of up to `chunk_size` texts
in flight (the engine pool: one per engine; one engine in this process: one, done at submit). Everything around it —
the resume cache, the progress bar and the tokens/s stats — is written once: `generate_cached` for a list of texts
(synchronous chunks, self-instruct), `generate_continuous` for requests whose replies ask for more (self-distillation:
a conversation's next turn is queued as soon as its previous reply exists, and every engine takes the next chunk as
soon as it is free, with no barrier across engines or turns).

Texts are fully rendered prompts (chat template already applied, generation prompt or an open user turn included),
so the generator never decides how a conversation is rendered. Each text carries a seed derived from its cache key;
transformers seeds each batch with its first. vLLM ignores them and samples from the engine's seed (`run.seed`):
per-request seeds put vLLM's sampler on a one-request-at-a-time loop (vllm/v1/sample/ops/topk_topp_sampler.py
`random_sample`): self-instruct on the H200 ran at 5.5k tok/s with them, 9.6k without. A rerun of the same config
reproduces the batches, and the cache keeps what a killed run generated.
"""

from __future__ import annotations

import gc
import hashlib
import heapq
import itertools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eagle3lib import jsonl
from eagle3lib.config import WorkbookConfig
from eagle3lib.device import on_cpu, resolve_devices, torch_dtype
from eagle3lib.errors import WorkbookError


@dataclass
class Reply:
    """One continuation: its text (special tokens dropped), new tokens generated, and whether it ended by itself
    (end-of-turn token) rather than by the token limit — a cut-off user request is not a usable prompt."""

    text: str
    tokens: int
    finished: bool


class Generator(Protocol):
    """`generate`: one chunk of up to `batch_size` texts, synchronously. `submit`/`wait_any`: up to `slots` chunks of
    up to `chunk_size` texts in flight, each chunk's replies back as soon as they exist (in any order, by ticket);
    `cancel` drops the chunks in flight (a caller that stops midway); `close` frees the engines (a later call starts
    them again)."""

    name: str
    batch_size: int
    slots: int
    chunk_size: int

    def generate(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> list[Reply]:
        ...

    def submit(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> int:
        ...

    def wait_any(self) -> tuple[int, list[Reply]]:
        ...

    def cancel(self) -> None:
        ...

    def close(self) -> None:
        ...


class OneAtATime:
    """`submit`/`wait_any` for a generator in this process: one slot, the chunk generated at submit (there is nothing
    to overlap it with), handed back by the next `wait_any`."""

    slots = 1
    batch_size: int
    _held: tuple[int, list[Reply]] | None = None
    _tickets = 0

    @property
    def chunk_size(self) -> int:
        return self.batch_size

    def generate(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> list[Reply]:
        raise NotImplementedError

    def submit(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> int:
        if self._held is not None:
            raise RuntimeError("one chunk at a time: wait_any before the next submit")
        self._tickets += 1
        self._held = (self._tickets, self.generate(texts, temperature, max_new_tokens, seeds))
        return self._tickets

    def wait_any(self) -> tuple[int, list[Reply]]:
        held, self._held = self._held, None
        if held is None:
            raise RuntimeError("nothing submitted")
        return held

    def cancel(self) -> None:
        self._held = None


class TransformersGenerator(OneAtATime):
    """Batched `model.generate` with left padding; the model loads on the first call (a fully cached rerun never
    loads it). One call = one padded batch: the caller chunks by `batch_size`."""

    name = "transformers"

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, tok: Any):
        self.cfg, self.model_dir, self.tok = cfg, Path(model_dir), tok
        self.batch_size = cfg.data.gen_batch_size
        self.model: Any = None

    def _load(self) -> Any:
        if self.model is None:
            from transformers import AutoModelForCausalLM

            device = resolve_devices(self.cfg.extract.devices)[0]
            self.model = AutoModelForCausalLM.from_pretrained(
                str(self.model_dir), dtype=torch_dtype(self.cfg.target.dtype, device),
                trust_remote_code=self.cfg.target.trust_remote_code).to(device).eval()
        return self.model

    def generate(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> list[Reply]:
        import torch

        model, tok = self._load(), self.tok
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": tok.pad_token_id}
        if temperature > 0:
            torch.manual_seed(seeds[0] if seeds else self.cfg.run.seed)  # one generator per batch in transformers
            kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1]:]
        eos = {tok.eos_token_id, tok.pad_token_id} - {None}
        replies = []
        for row in new.tolist():
            n = len(row)
            while n and row[n - 1] == tok.pad_token_id:
                n -= 1  # right padding of rows that finished early (pad is often eos: then eos is dropped too)
            finished = n < len(row) or (n > 0 and row[n - 1] in eos)
            replies.append(Reply(tok.decode(row[:n], skip_special_tokens=True).strip(), n, finished))
        return replies

    def close(self) -> None:
        self.model = None
        gc.collect()


def vllm_batch_size(cfg: WorkbookConfig) -> int:
    """Prompts per LLM.generate call of one engine: the engine batches inside a call, the cache is written after
    each."""
    return max(cfg.data.gen_batch_size, 256)


class VllmGenerator(OneAtATime):
    """One offline `vllm.LLM` engine, built like the capture backends' (eagle3lib.extract.backends.vllm_engine: in-process
    on the CPU, a spawned engine process on a GPU, parallel sizes, memory share and seed from `extract.*`), started on
    the first call. Prompts go in as token ids (no tokenizer in the engine); replies are decoded here."""

    name = "vllm"

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, tok: Any):
        self.cfg, self.model_dir, self.tok = cfg, Path(model_dir), tok
        self.batch_size = vllm_batch_size(cfg)
        self.llm: Any = None
        self.max_model_len = 0
        self.start_s = 0.0

    def start(self) -> Any:
        """The engine, started on the first call (`generate` calls it; an engine pool's child calls it before it
        says it is ready)."""
        if self.llm is None:
            from eagle3lib.extract.backends.vllm_engine import require_vllm

            require_vllm("data.generator: vllm", "set data.generator: transformers")
            from eagle3lib.extract.backends.adapters import check_cpu_support, select_adapter
            from eagle3lib.extract.backends.vllm_engine import engine_kwargs, prepare_environment, start_engine
            from eagle3lib.target import read_hf_config

            t0 = time.perf_counter()
            hf_config = read_hf_config(self.model_dir)
            adapter = select_adapter(hf_config)
            if on_cpu():
                check_cpu_support(adapter, hf_config)
            prepare_environment(self.cfg)
            kwargs = engine_kwargs(self.cfg, self.model_dir, adapter)
            # generation, not capture: no hooks, so CUDA graphs (decode of a small target is launch-bound) and
            # prefix caching (shared system prompts, multi-turn histories) may run on a GPU
            kwargs["enforce_eager"] = on_cpu()
            kwargs["enable_prefix_caching"] = not on_cpu()
            kwargs.update(self.cfg.data.gen_vllm_args)
            self.max_model_len = int(kwargs["max_model_len"])
            self.llm = start_engine(kwargs)
            self.start_s = round(time.perf_counter() - t0, 2)
        return self.llm

    def generate(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> list[Reply]:
        from vllm import SamplingParams

        llm, tok = self.start(), self.tok
        stop = sorted({tok.eos_token_id} - {None})
        prompts, params, slots = [], [], []
        replies: list[Reply] = [Reply("", 0, False) for _ in texts]
        del seeds  # see the module docstring: per-request seeds make vLLM sample one request at a time
        for i, text in enumerate(texts):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            room = min(max_new_tokens, self.max_model_len - len(ids))
            if room <= 0:
                continue  # the history alone fills max_model_len: nothing to generate (an empty, unfinished reply)
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(temperature=temperature, top_p=1.0, max_tokens=room, stop_token_ids=stop,
                                         detokenize=False))
            slots.append(i)
        if prompts:
            outs = llm.generate(prompts, params, use_tqdm=False)
            if len(outs) != len(prompts):
                raise WorkbookError(f"vLLM returned {len(outs)} outputs for {len(prompts)} prompts",
                                    "report this as a bug")
            for i, out in zip(slots, outs, strict=True):
                c = out.outputs[0]
                ids = list(c.token_ids)
                replies[i] = Reply(tok.decode(ids, skip_special_tokens=True).strip(), len(ids),
                                   c.finish_reason == "stop")
        return replies

    def close(self) -> None:
        """Free the engine (and its GPU memory) before extraction loads the target again."""
        if self.llm is not None:
            from eagle3lib.extract.backends.vllm_engine import stop_engine

            llm, self.llm = self.llm, None
            stop_engine(llm)
        gc.collect()


# ------------------------------------------------------------------------------------------------------ the cache
def cache_key(payload: Any, settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([payload, settings], sort_keys=True).encode()).hexdigest()[:24]


def key_seed(key: str, seed: int) -> int:
    """A request's sampling seed: its cache key mixed with the run seed (independent of batch and order)."""
    return (int(key[:8], 16) + seed * 1_000_003) % (2**31 - 1)


def read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """Replies generated by earlier (possibly killed) runs, by key; a torn last line is ignored."""
    out: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in jsonl.lines(path):  # not splitlines(): a reply may hold U+2028 (eagle3lib/jsonl.py)
            try:
                obj = json.loads(line)
                if isinstance(obj["reply"], str):
                    out[obj["key"]] = obj
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return out


def new_stats() -> dict[str, Any]:
    return {"generated": 0, "cached": 0, "new_tokens": 0, "seconds": 0.0}


def finish_stats(stats: dict[str, Any], t0: float) -> dict[str, Any]:
    stats["seconds"] = round(stats["seconds"] + time.time() - t0, 2)
    stats["tokens_per_s"] = (round(stats["new_tokens"] / stats["seconds"], 1)
                             if stats["seconds"] and stats["new_tokens"] else None)
    return stats


def cached_reply(entry: dict[str, Any]) -> Reply:
    """A reply as the cache file holds it (read_cache's values)."""
    return Reply(entry["reply"], int(entry.get("tokens", 0)), bool(entry.get("finished", True)))


def record_chunk(keys: list[str], replies: list[Reply], cache: dict[str, dict[str, Any]], cf: Any,
                 stats: dict[str, Any], bar: Any, tokens0: int, t0: float) -> None:
    """A generated chunk's replies into `cache` and appended to the open cache file `cf` (flushed: a killed run keeps
    them), counted in `stats`, shown on `bar` with the tok/s since `t0` (new tokens past `tokens0`)."""
    for key, r in zip(keys, replies, strict=True):
        cache[key] = {"key": key, "reply": r.text, "tokens": r.tokens, "finished": r.finished}
        cf.write(jsonl.dumps([cache[key]]))
        stats["generated"] += 1
        stats["new_tokens"] += r.tokens
    cf.flush()
    if bar is not None:
        bar.update(len(keys))
        bar.set_postfix_str(f"{(stats['new_tokens'] - tokens0) / max(time.time() - t0, 1e-9):.0f} tok/s")


def generate_cached(gen: Generator, items: list[tuple[str, str, float]], max_new_tokens: int, seed: int,
                    cache: dict[str, dict[str, Any]], cache_path: Path, stats: dict[str, Any],
                    bar: Any = None) -> dict[str, Reply]:
    """Replies for (key, text, temperature) items: from `cache` where present, else generated — grouped by
    temperature, sorted by length (little padding), in chunks of `gen.batch_size`, each chunk appended to
    `cache_path` as soon as it is done (a killed run loses at most one chunk). Updates `stats` and `bar`."""
    out: dict[str, Reply] = {}
    todo = []
    queued: set[str] = set()
    for key, text, temp in items:
        if key in cache:
            out[key] = cached_reply(cache[key])
            stats["cached"] += 1
            if bar is not None:
                bar.update(1)
        elif key not in queued:  # the same history twice (a repeated prompt): generated once
            queued.add(key)
            todo.append((key, text, temp))
    if not todo:
        return out
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    todo.sort(key=lambda x: (x[2], len(x[1])))
    t0 = time.time()
    tokens0 = stats["new_tokens"]
    with cache_path.open("a", encoding="utf-8") as cf:
        start = 0
        while start < len(todo):
            temp = todo[start][2]
            end = start
            while end < len(todo) and end - start < gen.batch_size and todo[end][2] == temp:
                end += 1
            chunk = todo[start:end]
            replies = gen.generate([t for _, t, _ in chunk], temp, max_new_tokens,
                                   [key_seed(k, seed) for k, _, _ in chunk])
            keys = [k for k, _, _ in chunk]
            out.update(zip(keys, replies, strict=True))
            record_chunk(keys, replies, cache, cf, stats, bar, tokens0, t0)
            start = end
    return out


def fair_share(queues: dict[float, list[Any]], in_flight: dict[int, list[Any]], gen: Generator) -> int:
    """How many requests the next chunk takes: `gen.chunk_size`, but never more than one slot's share of everything
    outstanding (waiting or in flight), so that once the queue runs short every engine holds a part of it instead of
    one engine holding all of it while the others wait. Why: on the 1.5B's 4x data (2026-12-05, 4 engines, chunks of
    4,096 whatever the queue held) self-distillation wrote its first ~6.5M tokens at ~70k tok/s and its last ~2.4M
    at ~14k (stage 02's progress log, benchmarks/results/gen_data_qwen15_x4_h200_2026-12-05.json's run): in the
    tail, whole chunks left engines idle and made each next turn of a long conversation wait for a full chunk (not
    yet measured with this rule). One slot: the whole chunk, as before."""
    outstanding = sum(map(len, queues.values())) + sum(map(len, in_flight.values()))
    return max(1, min(gen.chunk_size, -(-outstanding // gen.slots)))


@dataclass
class Request:
    """One reply to generate: its cache key, its rendered text ("" when the key is cached: never rendered), its
    temperature, and its priority (lower first): self-distillation puts the conversations with the most turns still
    to come first, so the longest chains of replies, each waiting for the one before, start early."""

    key: str
    text: str
    temperature: float
    priority: int = 0


def generate_continuous(gen: Generator, requests: Iterable[Request],
                        on_reply: Callable[[str, Reply], Iterable[Request]], max_new_tokens: int, seed: int,
                        cache: dict[str, dict[str, Any]], cache_path: Path, stats: dict[str, Any],
                        bar: Any = None) -> None:
    """Every request's reply, handed to `on_reply(key, reply)`, which may ask for more (a conversation's next turn).
    A cached key is answered at once; the rest wait in one queue per temperature, ordered by (priority, length).
    Whenever one of the generator's `slots` is free, the queue whose head comes first gives it a chunk of up to
    `chunk_size` requests, at most a slot's fair share of all that is outstanding (`fair_share`); one temperature per
    chunk, shortest texts together within a priority (little padding for transformers); each chunk's replies are
    appended to `cache_path` as soon as they come back (a killed run loses at most the chunks in flight), then handed
    on. No barrier: an engine never waits for another, nor a turn for a whole round. The caller asks for each key
    once (it waits for the reply of a key already asked). Updates `stats` and `bar` like `generate_cached`."""
    queues: dict[float, list[tuple[int, int, int, Request]]] = {}
    order = itertools.count()

    def take(reqs: Iterable[Request]) -> None:
        stack = list(reqs)
        while stack:
            r = stack.pop()
            if r.key in cache:
                stats["cached"] += 1
                if bar is not None:
                    bar.update(1)
                stack.extend(on_reply(r.key, cached_reply(cache[r.key])))
            else:
                heapq.heappush(queues.setdefault(r.temperature, []), (r.priority, len(r.text), next(order), r))

    take(requests)
    if not queues:
        return
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tokens0 = stats["new_tokens"]
    in_flight: dict[int, list[Request]] = {}
    with cache_path.open("a", encoding="utf-8") as cf:
        try:
            while queues or in_flight:
                while queues and len(in_flight) < gen.slots:
                    temp = min(queues, key=lambda t: queues[t][0][:3])
                    q = queues[temp]
                    chunk = [heapq.heappop(q)[3] for _ in range(min(fair_share(queues, in_flight, gen), len(q)))]
                    if not q:
                        del queues[temp]
                    ticket = gen.submit([r.text for r in chunk], temp, max_new_tokens,
                                        [key_seed(r.key, seed) for r in chunk])
                    in_flight[ticket] = chunk
                ticket, replies = gen.wait_any()
                chunk = in_flight.pop(ticket)
                if len(replies) != len(chunk):
                    raise WorkbookError(f"the generator returned {len(replies)} replies for {len(chunk)} texts",
                                        "report this as a bug")
                record_chunk([r.key for r in chunk], replies, cache, cf, stats, bar, tokens0, t0)
                for r, reply in zip(chunk, replies, strict=True):
                    take(on_reply(r.key, reply))
        except BaseException:
            if in_flight:
                gen.cancel()  # their replies are lost; the engines must not answer them into a later call
            raise
