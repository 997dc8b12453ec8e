"""Stage 05's online hidden states (`train.hidden_states: online`): each batch's states come from the target itself,
on the training device, instead of from stage 02's shards (docs/capture.md#online-hidden-states).

Why online: offline shards cost (aux+1) x hidden x 2 bytes per token on disk (57 KB/token for a Kimi-sized target),
so the disk caps the data; online needs only the tokenized dataset on disk, and pays one target forward per batch
in every epoch, and the target's memory beside the draft's.

How, with one capture implementation and speculators' own data path:
- `OnlineTransfer` is a speculators `HiddenStatesTransfer` (what `ArrowDataset` asks for a row's states, through
  `get_cached(file_idx)`) that owns stage 02's `TransformersBackend` (same hooks, same layer convention: aux slots
  in id order, then the final PRE-norm state; the same compute and storage dtypes), built lazily on the training
  device (under torchrun: each rank on its own, cuda:LOCAL_RANK);
- `OnlineArrowDataset.__getitems__` (what torch's DataLoader fetcher calls with the whole batch the packing sampler
  chose) finds the batch's states in the transfer, or first captures the rows of this batch and of the next
  train.online_batches_ahead - 1 (`OnlineBatchSampler` tells it the pass's batches in order) in one length-sorted
  capture, validated on the device with `shards.problems` (the rule stage 02's writer applies); speculators'
  `_get_raw_data` then builds every item from them, and the batch's states are released. Why several batches: one
  packed batch's rows padded to its longest made the target run on ~3 padded tokens per real token
  (benchmarks/online_padding.py).
The states stay on the device: speculators' CollateFn allocates each key's buffer on that key's device, and the
workbook's loader prefetch copies only what is still on the host. The target lives in the training process, so the
loader runs without worker processes (`train.settings` resolves num_workers to 0 and refuses more).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from hs_connectors.transfer import HiddenStatesTransfer
from speculators.train.data import ArrowDataset
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

from eagle3lib.common import device as devices
from eagle3lib.common import shards
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract.backends.transformers_backend import FIT_SHARE, TransformersBackend, target_bytes
from eagle3lib.train.inputs import TrainInputs
from eagle3lib.train.settings import Resolved


def training_device(res: Resolved) -> str:
    """This process's training device: the CPU, or under torchrun the GPU of its LOCAL_RANK."""
    return "cpu" if res.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"


def capture_device(cfg: WorkbookConfig, inp: TrainInputs, res: Resolved) -> str | None:
    """Where the target runs: the training device when its weights (at target.dtype) take at most FIT_SHARE of the
    memory free there; None (the backend's device_map path over extract.devices) when it does not, but one process
    trains and extract.devices names several GPUs that together hold it. Else one error, before anything is loaded
    or written: the check stage 02 makes for its own load (`needs_device_map`), against free memory, not total."""
    dev = training_device(res)
    need = target_bytes(inp.model_dir, devices.torch_dtype(cfg.target.dtype, dev))
    free = devices.free_bytes(dev)
    if need <= FIT_SHARE * free:
        return dev
    spread = devices.resolve_devices(cfg.extract.devices) if dev.startswith("cuda") else []
    one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
    if one_process and len(spread) > 1 and need <= FIT_SHARE * sum(devices.free_bytes(d) for d in spread):
        return None
    raise WorkbookError(
        f"train.hidden_states: online loads the target ({inp.model_dir.name}, {need / 1e9:.2f} GB at "
        f"{devices.dtype_name(cfg.target.dtype, dev)}) on the training device {dev}, which has "
        f"{free / 1e9:.2f} GB free: it needs at most {FIT_SHARE:.0%} of the free memory (the rest is the draft's and "
        "the activations')",
        "use train.hidden_states: offline (stage 02 extracts once, with device_map over several GPUs or vLLM tensor "
        "parallel), train on a device with more free memory, or (one training process) set extract.devices to "
        "several GPUs that together hold it")


class OnlineTransfer(HiddenStatesTransfer):
    """speculators' hidden-states transfer whose states come from the target, several batches at a time.

    `capture(rows)` runs the backend over rows and keeps their states (on the device) until `release(rows)`;
    `get_cached(file_idx)` hands one row of them to speculators' `ArrowDataset._get_raw_data`, which builds the item
    exactly as it does from a shard. `seconds`/`tokens`: the target's time and tokens so far, `padded_tokens` and
    `forwards` what it ran to make them (result.json)."""

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], device: str | None,
                 spec: shards.ShardSpec):
        self.cfg, self.model_dir, self.layer_ids, self.device, self.spec = cfg, Path(model_dir), layer_ids, device, spec
        self.backend: TransformersBackend | None = None
        self._rows: dict[int, dict[str, torch.Tensor]] = {}
        self.seconds = 0.0
        self.tokens = self.padded_tokens = self.forwards = 0

    def setup(self) -> None:
        """Load the target (first batch). Under `fork_rng`: whatever the load draws from torch's generators, the
        training's random stream stays where the seed put it, so online and offline runs see the same numbers."""
        if self.backend is not None:
            return
        cuda = [] if self.device == "cpu" or not torch.cuda.is_available() else list(range(torch.cuda.device_count()))
        with torch.random.fork_rng(devices=cuda):
            self.backend = TransformersBackend(self.cfg, self.model_dir, self.layer_ids, device=self.device)

    def holds(self, file_idx: int) -> bool:
        return file_idx in self._rows

    def capture(self, rows: dict[int, torch.Tensor]) -> None:
        """States for `rows` ({file_idx: token ids, int64 [T] on the host}), kept beside those not yet released."""
        self.setup()
        assert self.backend is not None
        t0 = time.perf_counter()
        ran = self.backend.forwards, self.backend.padded_tokens
        states = self.backend.capture_on_device([(i, ids.tolist()) for i, ids in rows.items()])
        self.forwards += self.backend.forwards - ran[0]
        self.padded_tokens += self.backend.padded_tokens - ran[1]
        bad = {}
        for i, ids in rows.items():
            if i not in states:
                bad[i] = ["no states came back"]
                continue
            found = shards.problems(ids, states[i], ids, self.spec)  # stage 02's rule; finite check on the device
            if found:
                bad[i] = found
        if bad:
            first = "; ".join(f"row {i}: {', '.join(p)}" for i, p in list(bad.items())[:3])
            raise WorkbookError(
                f"online hidden states of {len(bad)} of {len(rows)} rows captured together are invalid: {first}",
                "NaN or inf: compute the target in a wider dtype (target.dtype: bfloat16 or float32); a shape or "
                "dtype: a capture bug. Nothing was trained on them; checkpoints so far are kept")
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(ids) for ids in rows.values())
        self._rows.update({i: {"token_ids": ids, "hidden_states": states[i]} for i, ids in rows.items()})

    def release(self, rows: list[int]) -> None:
        """Forget these rows' states (their items are built)."""
        for i in rows:
            self._rows.pop(i, None)

    def clear(self) -> None:
        self._rows = {}

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        return self._rows.get(file_idx)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return None  # nothing is generated through a vLLM endpoint here

    def close(self) -> None:
        self._rows = {}
        if self.backend is not None:
            self.backend.close()
            self.backend = None


class OnlineArrowDataset(ArrowDataset):
    """speculators' ArrowDataset whose batch fetch first makes sure the transfer holds the batch's states.

    torch's DataLoader fetcher calls `__getitems__(indices)` with the batch sampler's whole batch (when the dataset
    defines it); the items are then speculators' own (`self[i]` → `_get_raw_data` → `transfer.get_cached(file_idx)`).
    A batch the transfer does not hold is captured with the `ahead - 1` batches after it in the pass
    (`begin_pass`, from `OnlineBatchSampler`); a batch outside any pass, alone."""

    transfer: OnlineTransfer
    ahead = 1  # batches captured together (train.online_batches_ahead, set by make_loaders)
    _pass: tuple[list[int], ...] = ()  # the pass's batches (begin_pass), and the position of the next one
    _next = 0

    def begin_pass(self, batches: list[list[int]]) -> None:
        """The batches the loader will fetch next, in order (split indices): one epoch, or what a resume left of it."""
        self._pass, self._next = tuple(list(map(int, b)) for b in batches), 0
        self.transfer.clear()  # what an unfinished pass left (train.max_steps)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        indices = list(map(int, indices))
        rows = [self._map_to_file_idx(i) for i in indices]
        in_pass = self._next < len(self._pass) and self._pass[self._next] == indices  # the batch the pass expects
        if not all(self.transfer.holds(r) for r in rows):
            group = list(self._pass[self._next:self._next + self.ahead]) if in_pass else [indices]
            self.transfer.capture({self._map_to_file_idx(i): self.data[i]["input_ids"] for b in group for i in b})
        if in_pass:
            self._next += 1
        items = [self[i] for i in indices]
        self.transfer.release(rows)
        return items


class OnlineBatchSampler(MultipackDistributedBatchSamplerV2):
    """speculators' packing sampler that tells the online dataset the batches of each pass before it hands out the
    first, so that the dataset can capture several of them at once."""

    def __init__(self, dataset: OnlineArrowDataset, **kwargs: Any):
        super().__init__(**kwargs)
        self.dataset = dataset

    def __iter__(self):
        batches = list(super().__iter__())  # this epoch's (or what the Trainer's fast-skip left of them)
        self.dataset.begin_pass(batches)
        yield from batches


def make_transfer(cfg: WorkbookConfig, inp: TrainInputs, res: Resolved) -> OnlineTransfer:
    """The transfer of this process, checked to fit before anything is loaded (the target loads on the first batch).
    States are kept in extract.dtype as stage 02 stores them (never FP8: they never reach a disk)."""
    device = capture_device(cfg, inp, res)
    spec = shards.ShardSpec(len(inp.layer_ids), inp.hidden_size, shards.DTYPES[cfg.extract.dtype])
    return OnlineTransfer(cfg, inp.model_dir, inp.layer_ids, device, spec)
