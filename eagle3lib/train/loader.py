"""The data path of stage 05: speculators' dataset, packing sampler and collate, in the workbook's DataLoader.

speculators' ArrowDataset + MultipackDistributedBatchSamplerV2 + CollateFn (with the drafter's preprocessing:
`shift_batch` for EAGLE-3 and P-EAGLE, none for DFlash) are its own data pipeline;
the DataLoader around them (`_counting_loader_class`) adds two things the stage needs: the real tokens of each batch
(tokens/s on the bar and in the curves) and, on a GPU, the copy of the next batch to the device on a side stream.
In online mode (`train.hidden_states: online`) the dataset and the sampler are eagle3lib.train.online's, which get
the states of several batches at a time from the target instead of from shards; in spool mode they are
eagle3lib.train.spool's, which ask a producer for each batch's shards ahead and delete them once read. The rest of the
path is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from eagle3lib.common.config import TrainSection
from eagle3lib.common.errors import WorkbookError
from eagle3lib.train.inputs import TrainInputs
from eagle3lib.train.settings import Resolved


def _counting_loader_class():
    """The loader class, built on first use by `make_loaders` (a function, so that a test can wrap the class:
    tests/e2e/test_reliability.py stalls a training child at a fixed step through it)."""
    from torch.utils.data import DataLoader

    class CountingLoader(DataLoader):
        """speculators' data path in a DataLoader that (1) remembers the real (non-padding) tokens of the batch it
        last yielded, for tokens/s, and (2) on a GPU copies batch i+1 to the device on a side stream while the
        trainer computes on batch i (the Trainer's own `.to(device)` is then a no-op): at ~270 MB per packed 8k batch
        of an 8B target, a copy on the compute stream would cost ~10% of the step."""

        last_tokens = 0
        prefetch_device: torch.device | None = None

        def _count(self, batch: dict[str, Any]) -> int:
            return int((batch["document_ids"] != -1).sum())

        def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
            device = self.prefetch_device
            if device is None or device.type != "cuda":
                for batch in super().__iter__():
                    self.last_tokens = self._count(batch)
                    yield batch
                return
            stream = torch.cuda.Stream(device)

            def stage(batch: dict[str, Any]) -> tuple[dict[str, Any], Any, int]:
                tokens = self._count(batch)  # on the host copy: no device sync
                with torch.cuda.stream(stream):
                    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                           for k, v in batch.items()}
                    event = torch.cuda.Event()
                    event.record(stream)
                return out, event, tokens

            def finish(staged: tuple[dict[str, Any], Any, int]) -> dict[str, Any]:
                out, event, tokens = staged
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                for v in out.values():
                    if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                        v.record_stream(current)
                self.last_tokens = tokens
                return out

            pending = None
            for batch in super().__iter__():
                staged = stage(batch)
                if pending is not None:
                    yield finish(pending)
                pending = staged
            if pending is not None:
                yield finish(pending)

    return CountingLoader


def fp8_aware_transfer(hidden_states_dir, dtype: torch.dtype):
    """speculators' FP8Transfer: its FileTransfer (what ArrowDataset reads shards with by default) that dequantizes
    an FP8 shard (extract.fp8_shards) into `dtype` and returns any other shard as stored, so one data path reads
    both formats (docs/capture.md#fp8-hidden-state-shards)."""
    from pathlib import Path

    from hs_connectors.transfer import FP8Transfer

    return FP8Transfer(Path(hidden_states_dir), dequantize_dtype=dtype)


def keep_first(ds: Any, n: int) -> None:
    """A speculators ArrowDataset cut to its first n rows (`train.train_fraction`): the rows, and the lengths its
    packing sampler reads, which its constructor computed from all of them. Row i still maps to file i
    (`_map_to_file_idx` adds the split's start, 0 for the training split)."""
    ds.data = ds.data.select(range(n))
    ds.approx_lengths = ds._compute_approx_lengths()


def make_loaders(inp: TrainInputs, tcfg: TrainSection, res: Resolved, seed: int = 0, transfer: Any = None,
                 spool: Any = None, algorithm: str = "eagle3"):
    """speculators' ArrowDataset + packing sampler + collate (its data path), in our DataLoader (token counting;
    pinned memory only where there is a GPU to copy to). `transfer`: an `online.OnlineTransfer` (online mode: the
    batches' states come from the target, already on the device, so nothing is pinned); `spool`: a `spool.Spool`
    (spool mode: shards read from, and deleted in, the spool folder); neither = stage 02's shards. `algorithm`: the
    drafter whose preprocessing the collate applies (eagle3lib.common.drafters.preprocess)."""
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.dataloader import _worker_init_fn
    from speculators.train.distributed import get_dp_rank, get_dp_size
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from eagle3lib.common.drafters import preprocess
    from eagle3lib.common.shards import shard_dir

    dtype = getattr(torch, res.hidden_states_dtype)
    online = transfer is not None
    dataset_cls: Any = ArrowDataset
    sampler_cls: Any = MultipackDistributedBatchSamplerV2
    extra: dict[str, Any] = {}
    if online:
        from eagle3lib.train.online import OnlineArrowDataset, OnlineBatchSampler

        dataset_cls, sampler_cls = OnlineArrowDataset, OnlineBatchSampler
    elif spool is not None:
        from eagle3lib.train.spool import SpoolArrowDataset, SpoolBatchSampler

        dataset_cls, sampler_cls, extra = SpoolArrowDataset, SpoolBatchSampler, {"spool": spool}
        transfer = fp8_aware_transfer(spool.shard_dir, dtype)
    else:
        transfer = fp8_aware_transfer(shard_dir(inp.dataset_dir), dtype)
    loader_cls = _counting_loader_class()
    loaders = []
    for split in ("train", "val"):
        ds = dataset_cls(max_len=tcfg.packing_length, datapath=str(inp.dataset_dir), on_missing="raise",
                          train_ratio=inp.train_ratio, split=split, hidden_states_dtype=dtype,
                          model=str(inp.verifier_dir), transfer=transfer, **extra)
        if ds.data.format.get("type") != "torch":  # speculators compares rows with torch.equal: needs tensors
            ds.data = ds.data.with_format("torch")
        if split == "train" and tcfg.train_fraction < 1.0:
            keep_first(ds, math.ceil(tcfg.train_fraction * len(ds)))
        tells: dict[str, Any] = {}  # whom the sampler tells each pass's batches
        if spool is not None:  # asks the producer for the rows
            tells = {"spool": spool, "first_row": ds.start_file_idx}
        elif online:  # the dataset captures several batches' rows at once
            ds.ahead, tells = tcfg.online_batches_ahead, {"dataset": ds}
        sampler = sampler_cls(batch_max_length=tcfg.packing_length, lengths=ds.approx_lengths,
                              num_replicas=get_dp_size(), rank=get_dp_rank(), seed=seed, **tells)
        if len(sampler) == 0:  # else a later, vaguer failure (or a rank waiting forever for the others)
            raise WorkbookError(
                f"the {split} split (rows: {len(ds)}) gives this process (rank {get_dp_rank()} of {get_dp_size()}) no "
                f"batch of up to {tcfg.packing_length} tokens",
                "raise data.val_fraction or add data (every process needs rows of its own), or train on fewer processes")
        workers = res.num_workers
        loaders.append(loader_cls(
            ds, batch_sampler=sampler, num_workers=workers,
            prefetch_factor=tcfg.prefetch_factor if workers > 0 else None,
            pin_memory=res.device == "cuda" and not online,  # torch's pin thread refuses CUDA tensors
            collate_fn=CollateFn(tcfg.packing_length, inp.hidden_size, num_target_layers=len(inp.aux_layer_ids),
                                 dtype=dtype, preprocess=preprocess(algorithm)),
            persistent_workers=workers > 0, multiprocessing_context="spawn" if workers > 0 else None,
            worker_init_fn=_worker_init_fn if workers > 0 else None))
        if res.device == "cuda" and tcfg.device_prefetch:
            from speculators.train.distributed import get_local_rank

            loaders[-1].prefetch_device = torch.device("cuda", get_local_rank())
    return loaders[0], loaders[1]
