"""Stage 05's spool mode (`train.hidden_states: spool`): a producer process (eagle3lib.train.spool_producer)
computes each batch's hidden states ahead of the trainer into <run>/spool/, and the loader reads and deletes them.
At no time do the shards there take more than train.spool_bytes (docs/capture.md#spool-producer-mode).

Why: a target only vLLM can hold (tensor parallel) cannot run in the training process as online mode's target
does, and its offline shards may not fit the disk (57 KB per token for a Kimi-sized target).

Why the budget holds by construction, with no measuring: the trainer decides what is produced, and the producer
writes nothing else. `SpoolBatchSampler` is speculators' packing sampler (a subclass, so that the Trainer's
set_epoch, len and its mid-epoch fast-skip, which reaches into the sampler's batch cache, work unchanged): it knows
every batch of the pass, and before it yields batch i, `Spool.request_ahead` asks for batch i and then for as many
following batches as fit: the shard bytes (`ShardSpec.file_bytes`) of rows asked for and not yet deleted never
exceed the budget. `SpoolArrowDataset.__getitems__` (torch's fetcher calls it with the whole batch) waits for each
row's shard, lets speculators build the items through the same FP8-aware reader offline mode uses, and deletes the
shards and the request. With no loader workers (train.settings) batch i-1 was built, and its items freed, before
the sampler is asked for batch i, so everything deleted is really gone from the disk when more is asked for.
A batch larger than the budget is refused before the producer starts (`check_budget`).

Validation passes go through the same path. A pass left early (train.max_steps) leaves requests behind: the next
pass first waits for them and deletes them. The cost of the mode: every epoch captures its rows again, in a
process that needs the target's devices beside the draft's.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from speculators.train.data import ArrowDataset
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

from eagle3lib.common import atomic, shards
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.train.inputs import TrainInputs
from eagle3lib.train.spool_producer import POLL_S, ProducerProcess, read_status, request_path

STALL_S = 1800.0  # the longest the trainer waits for one batch's states from a producer that is up (engine started)
STATUS_WAIT_S = 10.0  # the longest `Spool.summary` waits for the producer's status to count the last request


class Spool:
    """The trainer's side of the spool folder: what was asked for and not yet deleted (the ledger the budget is
    kept on), the waiting for shards, the deleting, and the producer it waits on."""

    def __init__(self, root: Path, budget: int, row_tokens: Sequence[int], spec: shards.ShardSpec):
        self.root, self.budget, self.row_tokens, self.spec = Path(root), int(budget), row_tokens, spec
        self.shard_dir = shards.shard_dir(self.root)
        self.producer: ProducerProcess | None = None
        self.pending: deque[tuple[int, list[int], int]] = deque()  # (seq, rows, bytes) asked for, not yet deleted
        self.pending_bytes = 0
        self.next_seq = 0
        self.batches: list[list[int]] = []  # this pass's batches, as dataset rows
        self.next_batch = 0  # the first of them not asked for yet
        self.wait_s = 0.0
        self.held_back = 0  # batches at which the budget kept the producer from working further ahead

    # ----------------------------------------------------------------------------------------------- lifecycle
    def batch_bytes(self, rows: Sequence[int]) -> int:
        return sum(self.spec.file_bytes(int(self.row_tokens[r])) for r in rows)

    def check_budget(self, samplers: dict[str, SpoolBatchSampler], epochs: int) -> None:
        """One error, before the producer starts, when a batch of any pass this run can make (train and validation,
        epochs 0..epochs-1) holds more states than the budget: it could never be asked for."""
        need, where = 0, ""
        for name, sampler in samplers.items():
            for epoch in range(epochs):
                for i, rows in enumerate(sampler.batch_rows(epoch)):
                    b = self.batch_bytes(rows)
                    if b > need:
                        tokens = sum(int(self.row_tokens[r]) for r in rows)
                        need, where = b, f"{name} batch {i} of epoch {epoch} ({len(rows)} rows, {tokens:,} tokens)"
        if need > self.budget:
            raise WorkbookError(
                f"train.spool_bytes = {self.budget:,} is smaller than one batch's hidden states: the largest, {where}, "
                f"needs {need:,} bytes ({self.spec.bytes_per_token():,} per token + {shards.HEADER_BYTES:,} per "
                "shard); nothing was started or written",
                f"set train.spool_bytes to at least {need:,} (a few times that lets the producer work ahead of the "
                "trainer), or lower train.packing_length (the most tokens of one batch)")

    def start(self, cfg: WorkbookConfig, inp: TrainInputs, samplers: dict[str, SpoolBatchSampler], epochs: int,
              log_path: Path) -> None:
        """Check the budget, empty the folder (a resumed run asks again for what it needs), start the producer on
        stage 02's target, layer ids and dataset, with the run's config (its extract section)."""
        self.check_budget(samplers, epochs)
        self.clear()
        (self.root / "requests").mkdir(parents=True)
        self.shard_dir.mkdir(parents=True)
        job = {"cfg": cfg.model_dump_json(), "model_dir": str(inp.model_dir), "layer_ids": inp.layer_ids,
               "hidden_size": inp.hidden_size, "dataset": str(inp.dataset_dir), "spool": str(self.root)}
        self.producer = ProducerProcess.start(job, self.root, log_path)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        """Stop the producer and everything under it, then remove the folder (on success, error and Ctrl-C)."""
        if self.producer is not None:
            self.producer.stop()
        self.clear()

    def summary(self) -> dict[str, Any]:
        """What result.json records: the budget and the peak the producer saw, its time and tokens, the trainer's
        wait. The producer writes its status just after a request's last shard, which the trainer may already have
        read and deleted: the figures are read once the status counts every request the trainer finished (a few
        milliseconds; at most STATUS_WAIT_S, and not at all once the producer is gone)."""
        finished = self.next_seq - len(self.pending)
        st = read_status(self.root)
        deadline = time.monotonic() + STATUS_WAIT_S
        while (st.get("requests") or 0) < finished and time.monotonic() < deadline and self.producer is not None \
                and self.producer.proc.poll() is None:
            time.sleep(POLL_S)
            st = read_status(self.root)
        capture_s = st.get("capture_s") or 0.0
        return {"budget_bytes": self.budget, "peak_bytes": st.get("peak_bytes"), "requests": self.next_seq,
                "held_back_by_budget": self.held_back, "trainer_wait_s": round(self.wait_s, 2),
                "producer": {"backend_start_s": st.get("engine_start_s"), "capture_s": round(capture_s, 2),
                             "idle_s": st.get("idle_s"), "rows": st.get("rows"), "tokens": st.get("tokens"),
                             "tokens_per_s": round(st["tokens"] / capture_s, 1) if capture_s else None}}

    # ---------------------------------------------------------------------------------------------- one pass
    def begin_pass(self, batches: list[list[int]]) -> None:
        """A new pass over one split: what an earlier pass asked for and left (train.max_steps stopped it) is
        waited for and deleted first, so the ledger holds this pass only."""
        while self.pending:
            rows = self.pending[0][1]
            self.wait_for(rows)
            self.release(rows)
        self.batches, self.next_batch = batches, 0

    def request_ahead(self, i: int) -> None:
        """Before batch i is fetched: ask for it, and for the batches after it while their states fit the budget."""
        while self.next_batch < len(self.batches):
            rows = self.batches[self.next_batch]
            need = self.batch_bytes(rows)
            if self.pending_bytes + need > self.budget:
                if self.next_batch <= i:  # check_budget made this impossible: batch i-1 is deleted by now
                    raise WorkbookError(f"spool batch {i} ({need:,} bytes) does not fit the budget beside "
                                        f"{self.pending_bytes:,} bytes still asked for", "this is a bug; report it")
                self.held_back += 1
                return
            atomic.write_json(request_path(self.root, self.next_seq), {"rows": rows})
            self.pending.append((self.next_seq, rows, need))
            self.pending_bytes += need
            self.next_seq += 1
            self.next_batch += 1

    def wait_for(self, rows: Sequence[int]) -> None:
        """Until every row's shard is in the folder (the producer writes it under a temporary name and renames it,
        so a name that exists is a whole file). The producer exiting raises at once; a ready producer (its engine
        started: loading a large target may take longer than STALL_S) that leaves the batch unwritten for STALL_S
        raises too."""
        assert self.producer is not None, "the spool's producer was never started"
        t0 = since = time.perf_counter()
        for r in rows:
            path = shards.shard_path(self.root, r)
            while not path.is_file():
                self.producer.check()
                if not self.producer.ready():
                    since = time.perf_counter()
                elif time.perf_counter() - since > STALL_S:
                    raise WorkbookError(
                        f"the spool producer is alive but wrote no shard of row {r} in {STALL_S:.0f} s; its log: "
                        f"{self.producer.log_path}", "read its log (a hung engine?); rerun to resume")
                time.sleep(POLL_S)
        self.wait_s += time.perf_counter() - t0

    def release(self, rows: list[int]) -> None:
        """The batch of `rows` is built: its shards and its request go, and its bytes leave the ledger."""
        seq, asked, need = self.pending[0]
        if asked != rows:
            raise WorkbookError(f"the loader built rows {rows[:8]} but the spool's oldest request ({seq}) is rows "
                                f"{asked[:8]}", "this is a bug (batches fetched out of order?); report it")
        for r in rows:
            shards.shard_path(self.root, r).unlink()
        request_path(self.root, seq).unlink()
        self.pending.popleft()
        self.pending_bytes -= need


class SpoolBatchSampler(MultipackDistributedBatchSamplerV2):
    """speculators' packing sampler that asks the spool for each batch's rows before it hands the batch out (and for
    the batches after it that fit the budget). `first_row`: the dataset row of split index 0."""

    def __init__(self, spool: Spool, first_row: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.spool, self.first_row = spool, int(first_row)

    def batch_rows(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch`, as dataset rows."""
        return [[self.first_row + int(i) for i in b] for b in self._generate_batches(epoch)]

    def __iter__(self):
        batches = list(super().__iter__())  # this epoch's (or what the Trainer's fast-skip left of them)
        self.spool.begin_pass([[self.first_row + int(i) for i in b] for b in batches])
        for i, batch in enumerate(batches):
            self.spool.request_ahead(i)
            yield batch


class SpoolArrowDataset(ArrowDataset):
    """speculators' ArrowDataset whose batch fetch waits for the batch's shards in the spool, and deletes them once
    speculators has built the items (through `transfer`, the same FP8-aware reader offline mode uses)."""

    def __init__(self, *args: Any, spool: Spool, **kwargs: Any):
        self.spool = spool
        super().__init__(*args, **kwargs)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        indices = list(indices)
        rows = [int(self._map_to_file_idx(i)) for i in indices]
        self.spool.wait_for(rows)
        items = [self[i] for i in indices]
        self.spool.release(rows)
        return items


def make_spool(root: Path, budget: int, dataset_dir: Path, spec: shards.ShardSpec) -> Spool:
    """The spool of this run (nothing started, nothing written): the budget is kept on each row's token count. One
    training process only: each torchrun rank would start a producer of its own on the same folder."""
    from datasets import load_from_disk

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise WorkbookError(f"train.hidden_states: spool trains in one process, this is one of {world} (torchrun)",
                            "run stage 05 in one process, or use train.hidden_states: offline for DDP")
    return Spool(root, budget, load_from_disk(str(dataset_dir)).with_format(None)["seq_len"], spec)
