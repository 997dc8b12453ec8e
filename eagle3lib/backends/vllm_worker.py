"""The workbook's own vLLM capture worker: a worker extension that hooks the decoder layers and keeps, per request,
the residual stream at the configured layer ids.

Loaded by vLLM into every worker process with `worker_extension_cls="eagle3lib.backends.vllm_worker.CaptureWorker"`
and driven through `LLM.collective_rpc`. It exists for targets vLLM's native extract_hidden_states cannot serve
(multimodal wrappers, DeepseekV2 calling conventions, older vLLM); the adapters (eagle3lib.backends.adapters) say
where the layers are and what they return.

How a step is split: vLLM flattens the scheduled tokens of every running request into one batch, in the order of
`model_runner.input_batch.req_ids`, each request contributing `scheduler_output.num_scheduled_tokens[req_id]` tokens
(a long prompt may be chunked over several steps: the chunks are appended). The runner's `execute_model` is wrapped
to see the scheduler output; the hooks only record the step's states, the split happens once after the forward.

Why errors are returned, never raised: an exception inside a hook kills the engine, and the distributed layer once
turned it into an empty message. Every RPC here catches, and replies `{"error": "<traceback>"}`; a hook that fails
records its traceback and the next `eagle3_pop` reports it, so the real text reaches the user.

Why bytes: tensors crossing collective_rpc arrive as undecoded lists unless insecure serialization is switched on
(never). Each request's states travel as one safetensors blob.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

try:  # bring eagle3lib.compat's worker-scope patches into this (worker) process before vLLM builds the model
    from eagle3lib.compat import worker_setup

    COMPAT_PATCHES = worker_setup()
except ImportError:  # pragma: no cover - compat without worker_setup
    COMPAT_PATCHES = []

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def encode(token_ids: list[int], states: dict[int, torch.Tensor]) -> bytes:
    """One request's capture as a safetensors blob: token_ids int64 [T] and L{id} [T, H] per layer id."""
    tensors = {"token_ids": torch.tensor(token_ids, dtype=torch.int64)}
    tensors.update({f"L{k}": v.contiguous() for k, v in states.items()})
    return st_save(tensors)


def decode(blob: bytes) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    data = st_load(blob)
    token_ids = data.pop("token_ids")
    return token_ids, {int(k[1:]): v for k, v in data.items()}


class _Capture:
    """Per-worker capture state: hooks, the current step's scheduler output, and per-request buffers."""

    def __init__(self, layer_ids: list[int], dtype: torch.dtype, num_layers: int):
        self.layer_ids = layer_ids
        self.dtype = dtype
        self.num_layers = num_layers
        self.sched: Any = None  # scheduler output of the step in flight (None outside execute_model)
        self.order: list[tuple[str, int]] | None = None  # (req_id, n_tokens) of the step in flight
        self.step: dict[int, torch.Tensor] = {}  # layer id -> [step_tokens, H] for the step in flight
        self.buffers: dict[str, dict[int, list[torch.Tensor]]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.errors: list[str] = []
        self.handles: list[Any] = []


class CaptureWorker:
    """Mixed into vLLM's Worker class (so `self.model_runner`, `self.rank` exist). Methods are prefixed eagle3_ to
    stay clear of the Worker's own names (vLLM refuses an extension that shadows one)."""

    # ---- RPCs --------------------------------------------------------------------------------------------------
    def eagle3_install(self, layer_ids: list[int], adapter_fields: dict[str, Any], dtype: str) -> dict[str, Any]:
        """Install hooks for `layer_ids` (aux ids + final N). Returns {"rank", "layers": ids on this rank} or
        {"error": traceback}."""
        try:
            return self._eagle3_install(list(layer_ids), adapter_fields, dtype)
        except BaseException:  # noqa: BLE001 - reported to the driver with the real text
            return {"rank": self._eagle3_rank(), "error": traceback.format_exc()}

    def eagle3_pop(self, req_ids: list[str] | None = None) -> dict[str, Any]:
        """Finished captures as {"rank", "tp_rank", "states": {req_id: safetensors bytes}} and any hook errors."""
        try:
            cap: _Capture | None = getattr(self, "_eagle3_cap", None)
            if cap is None:
                return {"rank": self._eagle3_rank(), "error": "eagle3_pop before eagle3_install: no capture installed"}
            errors, cap.errors = cap.errors, []
            if errors:
                return {"rank": self._eagle3_rank(), "error": "\n".join(errors)}
            wanted = list(cap.buffers) if req_ids is None else [r for r in cap.buffers if _matches(r, req_ids)]
            states: dict[str, bytes] = {}
            for rid in wanted:
                bufs = cap.buffers.pop(rid)
                prompt = cap.prompts.pop(rid, [])
                if self._eagle3_tp_rank() != 0:
                    continue  # every TP rank holds the same full states: rank 0 answers
                states[rid] = encode(prompt, {k: torch.cat(v, dim=0) for k, v in bufs.items()})
            return {"rank": self._eagle3_rank(), "tp_rank": self._eagle3_tp_rank(), "states": states}
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

    def _eagle3_install(self, layer_ids: list[int], adapter_fields: dict[str, Any], dtype: str) -> dict[str, Any]:
        from eagle3lib.backends.adapters import DEEPSEEK, LLAMA, Adapter

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
        cap = _Capture(layer_ids, DTYPES[dtype], n)

        def present(i: int) -> bool:  # pipeline parallel: layers of other ranks are PPMissingLayer placeholders
            return type(layers[i]).__name__ != "PPMissingLayer"

        local: list[int] = []
        for k in layer_ids:
            if k < n and present(k):
                cap.handles.append(layers[k].register_forward_pre_hook(
                    self._eagle3_pre_hook(cap, k, family), with_kwargs=True))
                local.append(k)
            elif k == n and present(n - 1):
                cap.handles.append(layers[n - 1].register_forward_hook(self._eagle3_post_hook(cap, k, family)))
                local.append(k)

        inner = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            cap.sched, cap.order, cap.step = scheduler_output, None, {}
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
                cap.sched, cap.order, cap.step = None, None, {}

        runner.execute_model = execute_model
        self._eagle3_cap = cap
        return {"rank": self._eagle3_rank(), "layers": local, "num_layers": n, "adapter": adapter.name,
                "pid": os.getpid()}

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
        if cap.sched is None:
            return  # dummy / profiling runs outside a scheduled step
        try:
            total = sum(n for _, n in self._eagle3_order(cap))
            if stream.dim() != 2 or stream.shape[0] < total:
                raise RuntimeError(f"capture worker: layer id {k} state has shape {list(stream.shape)}, expected "
                                   f"[>= {total} tokens, hidden] for this step")
            kept = stream[:total].to(cap.dtype)
            if kept.data_ptr() == stream.data_ptr():
                kept = kept.clone()  # never keep a view: later layers' fused add-norms update their inputs in place
            cap.step[k] = kept
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
        """Split the step's states by request and append them to the per-request buffers (one device→CPU copy)."""
        if not cap.step:
            return
        order = self._eagle3_order(cap)
        keys = sorted(cap.step)
        stacked = torch.stack([cap.step[k] for k in keys], dim=1).to("cpu")  # [tokens, n_local, H]
        start = 0
        for rid, n in order:
            chunk = stacked[start:start + n]
            start += n
            bufs = cap.buffers.setdefault(rid, {k: [] for k in keys})
            for j, k in enumerate(keys):
                bufs.setdefault(k, []).append(chunk[:, j])


def _matches(internal_id: str, external_ids: list[str]) -> bool:
    """vLLM 0.32 runs request '7' as '7-<8 hex>' internally; older versions keep the id as given."""
    return any(internal_id == e or internal_id.startswith(e + "-") for e in external_ids)
