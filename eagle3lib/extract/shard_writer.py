"""Stage 02's shard writing: every row a backend returns becomes a checked shard, on background threads.

What must be the same whichever backend ran (eagle3lib.extract.backends only turns token ids into states):
- every shard is validated as it is written (`shards.write_shard`): a wrong shape, dtype or token id stops the run
  with the row index and what was expected; nothing invalid reaches the disk;
- writing happens on background threads behind a bounded queue, so the forward never waits for the disk;
- resume: shards already on disk are checked (`shards.check_shard_file`) and kept when valid (`valid_shards`).
Stage 05's spool producer runs `capture_rows` too, into the spool folder (docs/capture.md#spool-producer-mode).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common import shards
from eagle3lib.common.errors import WorkbookError

ProgressFn = Callable[[int, int], None]  # (rows done, tokens done) since the last call


def valid_shards(dataset_dir: Path, input_ids: list[list[int]], spec: shards.ShardSpec, threads: int = 4,
                 rows: list[int] | None = None) -> set[int]:
    """Rows (of `rows`, default all) whose shard on disk is complete and right for this dataset (resume keeps them
    untouched)."""
    sdir = shards.shard_dir(dataset_dir)
    if not sdir.is_dir():
        return set()
    rows = range(len(input_ids)) if rows is None else rows
    present = {i for i in rows if shards.shard_path(dataset_dir, i).is_file()}

    def ok(i: int) -> bool:
        return not shards.check_shard_file(shards.shard_path(dataset_dir, i), input_ids[i], spec)

    with ThreadPoolExecutor(threads) as pool:
        return {i for i, good in zip(sorted(present), pool.map(ok, sorted(present)), strict=True) if good}


class ShardWriter:
    """Validates and writes shards on background threads; at most `depth` waiting. The first failure stops the run.
    `values_checked`: the backend's files were checked finite where they were made (see shards.adopt_shard).
    `gate`: no shard is written before this future (the capture probe's verdict) is done; its exception is the
    run's failure, and nothing waiting is written then. `gate_wait_s`: what the capture loop waited for it."""

    def __init__(self, dataset_dir: Path, input_ids: Mapping[int, list[int]], spec: shards.ShardSpec, threads: int,
                 depth: int, on_written: ProgressFn | None = None, values_checked: bool = False,
                 gate: Future | None = None):
        self.dataset_dir, self.input_ids, self.spec = dataset_dir, input_ids, spec
        self.values_checked = values_checked
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-writer")
        self.slots = threading.BoundedSemaphore(depth)
        self.on_written = on_written
        self.gate = gate
        self.gate_wait_s = 0.0
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def _write(self, row: int, states: torch.Tensor | Path) -> None:
        try:
            if self.gate is not None:
                self.gate.result()  # raises the probe's failure: this write (and every other) is dropped
            ids = torch.as_tensor(self.input_ids[row], dtype=torch.int64)
            if isinstance(states, Path):  # a finished shard file from the backend: checked, then renamed
                shards.adopt_shard(self.dataset_dir, row, states, ids, self.spec, self.values_checked)
            else:
                shards.write_shard(self.dataset_dir, row, ids, states, ids, self.spec)
            if self.on_written:
                with self.lock:
                    self.on_written(1, len(ids))
        finally:
            self.slots.release()

    def submit(self, row: int, states: torch.Tensor | Path) -> None:
        self.raise_if_failed()
        if row not in self.input_ids:
            raise WorkbookError(f"the capture backend returned row {row}, which it was not asked for",
                                "this is a backend bug")
        gated = self.gate is not None and not self.gate.done()
        t0 = time.perf_counter()
        self.slots.acquire()
        if gated:
            self.gate_wait_s += time.perf_counter() - t0
        self.raise_if_failed()  # a failure seen while waiting for a slot: stop before submitting more
        fut = self.pool.submit(self._write, row, states)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is not None and self.error is None:
            self.error = fut.exception()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, failed: bool = False) -> None:
        """Waits for the writes already running (so no temp file is still being written when an error reaches the
        user); after a failure, the ones still queued are dropped instead of written."""
        self.pool.shutdown(wait=True, cancel_futures=failed)
        if not failed:
            self.raise_if_failed()


def capture_rows(backend: Any, rows: list[tuple[int, list[int]]], dataset_dir: Path, spec: shards.ShardSpec,
                 threads: int, depth: int, on_written: ProgressFn | None = None,
                 captured: Mapping[int, torch.Tensor | Path] | None = None, gate: Future | None = None,
                 timing: dict[str, float] | None = None) -> int:
    """Run `rows` through `backend`, writing every shard; returns the number written. Every row must come back.
    `captured`: states of some of `rows` already captured (the capture probe's rows), written as they are instead of
    run again; `gate`: see ShardWriter (the capture probe's verdict); `timing` gets `gate_wait_s`."""
    captured = dict(captured or {})
    writer = ShardWriter(dataset_dir, dict(rows), spec, threads, depth, on_written,
                         values_checked=getattr(backend, "values_checked", False), gate=gate)
    seen: set[int] = set()
    ok = False
    try:
        for row, states in captured.items():
            seen.add(row)
            writer.submit(row, states)
        rest = [(r, t) for r, t in rows if r not in captured]
        if rest:
            for row, states in backend.capture(rest):
                seen.add(row)
                writer.submit(row, states)
        ok = True
    finally:
        writer.close(failed=not ok)
        if timing is not None:
            timing["gate_wait_s"] = writer.gate_wait_s
    missing = {r for r, _ in rows} - seen
    if missing:
        raise WorkbookError(f"the capture backend returned no states for {len(missing)} rows (e.g. {sorted(missing)[:5]})",
                            "this is a backend bug; rerun to resume once it is fixed")
    return len(seen)
