"""The transformers capture backend: the embedded default and the reference every other backend is checked against.

Layer convention: id k < N is the residual stream entering decoder layer k (= transformers `hidden_states[k]`),
taken with a forward PRE-hook on layer k; id N is the last decoder layer's output BEFORE the final norm, taken with a
forward hook on layer N-1 (transformers' last `hidden_states` entry is post-norm). We run the base model
(`model.model`), never the lm_head (it would halve the speed), without `output_hidden_states` (which would keep every
layer's state alive).

Speed on CUDA (see benchmarks/extract.py): rows are length-sorted into batches under `extract.batch_tokens`; the
hooks write each slot straight into one [B, T, n_slots, H] GPU buffer in the storage dtype; that buffer is copied to
pinned host memory on a separate CUDA stream while the next batch's forward runs; rows are yielded as views of the
pinned buffer (the caching host allocator recycles it once the writer threads have dropped them).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.device import resolve_devices, torch_dtype
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.shards import DTYPES
from eagle3lib.common.target import checkpoint_bytes


def plan_batches(rows: list[tuple[int, list[int]]], batch_tokens: int) -> list[list[tuple[int, list[int]]]]:
    """Length-sorted batches (longest first, so an out-of-memory shows at once) with B * max_len <= batch_tokens.

    A row longer than the budget gets a batch of its own.
    """
    order = sorted(rows, key=lambda r: len(r[1]), reverse=True)
    batches: list[list[tuple[int, list[int]]]] = []
    cur: list[tuple[int, list[int]]] = []
    cur_max = 0
    for row in order:
        n = len(row[1])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(row)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(base model, its decoder layers) for CausalLM models and multimodal wrappers (language_model inside)."""
    base = getattr(model, "model", model)
    for cand in (base, getattr(base, "language_model", None), getattr(model, "language_model", None)):
        if cand is not None and isinstance(getattr(cand, "layers", None), torch.nn.ModuleList):
            return cand, cand.layers
    raise WorkbookError(f"cannot find the decoder layers of {type(model).__name__}",
                        "use a decoder-only causal LM (Llama, Qwen, Mistral, DeepSeek ...) or the vllm backend")


FIT_SHARE = 0.8  # a target fits a device when its weights take at most this share of it (the rest: activations)


def target_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The target's weights in memory at the compute dtype: the checkpoint's bytes scaled from its stored dtype."""
    on_disk = checkpoint_bytes(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    stored = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), 2)
    return int(on_disk * torch.tensor([], dtype=dtype).element_size() / stored)


def needs_device_map(model_dir: Path, devices: list[str], dtype: torch.dtype) -> bool:
    """True when the target (at the compute dtype) does not fit one GPU with room for activations."""
    if not devices[0].startswith("cuda"):
        return False
    free = min(torch.cuda.get_device_properties(torch.device(d)).total_memory for d in devices)
    return target_bytes(model_dir, dtype) > FIT_SHARE * free


class TransformersBackend:
    """CaptureBackend over a transformers model on one device (or spread with device_map over several GPUs)."""

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], device: str | None = None,
                 model: torch.nn.Module | None = None):
        self.layer_ids = list(layer_ids)
        self.store_dtype = DTYPES[cfg.extract.dtype]
        self.batch_tokens = cfg.extract.batch_tokens
        devices = [device] if device else resolve_devices(cfg.extract.devices)
        self.device = torch.device(devices[0])
        self.compute_dtype = torch_dtype(cfg.target.dtype, devices[0])
        if model is None:
            from eagle3lib.common.causal_lm import load_causal_lm

            trust = cfg.target.trust_remote_code
            if len(devices) > 1 or (device is None and needs_device_map(model_dir, devices, self.compute_dtype)):
                # one process over several GPUs: layers spread with device_map (targets larger than one GPU)
                memory = {torch.device(d).index: torch.cuda.get_device_properties(torch.device(d)).total_memory
                          for d in devices}
                model = load_causal_lm(model_dir, trust, dtype=self.compute_dtype, device_map="auto", max_memory=memory)
            else:
                model = load_causal_lm(model_dir, trust, dtype=self.compute_dtype).to(self.device)
        self.model = model.eval()
        self.base, self.layers = decoder_layers(self.model)
        n = len(self.layers)
        if self.layer_ids[-1] != n or any(not 0 <= k < n for k in self.layer_ids[:-1]):
            raise WorkbookError(f"layer ids {self.layer_ids} do not fit a target with {n} decoder layers",
                                f"aux ids in 0..{n - 1}, then the final id {n}")
        self.input_device = next(self.base.parameters()).device
        self.cuda = self.device.type == "cuda"
        self._buf: torch.Tensor | None = None
        self._handles = []
        for slot, k in enumerate(self.layer_ids):
            if k < n:
                self._handles.append(self.layers[k].register_forward_pre_hook(self._pre_hook(slot), with_kwargs=True))
            else:
                self._handles.append(self.layers[n - 1].register_forward_hook(self._post_hook(slot)))
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.depth = 2  # batches in flight before the oldest is handed out
        self.forwards = self.padded_tokens = 0  # what the target ran: forwards, and rows x longest row of each

    # hooks write each slot into the batch buffer: no list of every layer's state is kept alive
    def _store(self, slot: int, h: torch.Tensor) -> None:
        buf = self._buf
        if buf is None:
            return
        buf[:, :, slot].copy_(h, non_blocking=True)

    def _pre_hook(self, slot: int):
        def hook(_module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self._store(slot, h)
        return hook

    def _post_hook(self, slot: int):
        def hook(_module, _args, out):
            self._store(slot, out[0] if isinstance(out, tuple) else out)
        return hook

    def _forward(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one batch; returns the [B, T, n_slots, H] buffer (on the output device, storage dtype)."""
        lens = [len(t) for _, t in batch]
        tmax = max(lens)
        self.forwards += 1
        self.padded_tokens += len(batch) * tmax
        ids = torch.zeros(len(batch), tmax, dtype=torch.long)
        mask = torch.zeros(len(batch), tmax, dtype=torch.long)
        for i, (_, toks) in enumerate(batch):
            ids[i, : len(toks)] = torch.as_tensor(toks, dtype=torch.long)
            mask[i, : len(toks)] = 1
        if self.cuda:
            ids, mask = ids.pin_memory(), mask.pin_memory()
        ids = ids.to(self.input_device, non_blocking=True)
        mask = mask.to(self.input_device, non_blocking=True)
        hidden = self.model.config.get_text_config().hidden_size
        self._buf = torch.empty(len(batch), tmax, len(self.layer_ids), hidden, dtype=self.store_dtype,
                                device=self.device)
        try:
            # right padding: the padded tail never influences earlier positions under a causal mask; a batch
            # without padding passes no mask at all (the fastest attention path).
            self.base(input_ids=ids, attention_mask=None if min(lens) == tmax else mask, use_cache=False)
        finally:
            buf, self._buf = self._buf, None
        return buf

    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor]]:
        pending: deque[tuple[Any, torch.Tensor, list[tuple[int, list[int]]]]] = deque()
        with torch.inference_mode():
            for batch in plan_batches(rows, self.batch_tokens):
                buf = self._forward(batch)
                if self.cuda:
                    assert self.copy_stream is not None
                    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
                    self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(self.copy_stream):
                        host.copy_(buf, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(self.copy_stream)
                    buf.record_stream(self.copy_stream)  # the allocator may not reuse buf before the copy ends
                    pending.append((done, host, batch))
                    while len(pending) >= self.depth:
                        yield from self._hand_out(*pending.popleft())
                else:
                    yield from self._hand_out(None, buf, batch)
            while pending:
                yield from self._hand_out(*pending.popleft())

    def capture_on_device(self, rows: list[tuple[int, list[int]]]) -> dict[int, torch.Tensor]:
        """{row: hidden_states [T, n_slots, H]} left where the forward wrote them (the output device, storage dtype):
        stage 05's online mode (eagle3lib.train.online, docs/capture.md#online-hidden-states). The same batches
        (`plan_batches` under extract.batch_tokens), hooks and buffer as `capture`, without the copy to the host.

        Under `torch.no_grad`, not `inference_mode` as `capture`: the same numbers, but the rows are ordinary tensors,
        which the training step may use next to tensors that autograd records (inference tensors may not be)."""
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for batch in plan_batches(rows, self.batch_tokens):
                buf = self._forward(batch)
                for i, (row, toks) in enumerate(batch):
                    out[row] = buf[i, : len(toks)]
        return out

    def reference_forward(self, token_ids: list[int], positions: list[int], hidden_ids: list[int]
                          ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The capture probe's reference from this same loaded model: one full forward of one row (lm_head
        included, batch 1, no padding) → (float32 logits at `positions` [P, V], {k: transformers' own
        `hidden_states[k]` [T, H] for k in `hidden_ids`, k < N}), on the CPU. The capture hooks stay installed but
        record nothing outside `capture`. hidden_states[N] is post-norm, so the final slot is judged by the logits."""
        ids = torch.as_tensor([token_ids], dtype=torch.long, device=self.input_device)
        keep = torch.as_tensor(positions, dtype=torch.long, device=self.input_device)
        n = len(self.layers)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=keep)
        hidden = {k: out.hidden_states[k][0].float().cpu() for k in hidden_ids if k < n}
        return out.logits[0].float().cpu(), hidden

    @staticmethod
    def _hand_out(done, host: torch.Tensor, batch) -> Iterator[tuple[int, torch.Tensor]]:
        if done is not None:
            done.synchronize()
        for i, (row, toks) in enumerate(batch):
            yield row, host[i, : len(toks)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model = None  # type: ignore[assignment]
        if self.cuda:
            torch.cuda.empty_cache()
