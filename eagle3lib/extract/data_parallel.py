"""Stage 02 on several GPUs (transformers backend): one spawned process per GPU, each capturing a token-balanced share
of the rows with its own model and writer threads, progress and failures reported to the parent through a queue.
A model too big for one GPU is spread over them by one process instead (`devices_for` returns None then)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common import shards
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.extract.shard_writer import ProgressFn, capture_rows


def devices_for(cfg: WorkbookConfig, model_dir: Path, backend: Any | None) -> list[str] | None:
    """The GPUs to run one process each on, or None for a single in-process backend."""
    if backend is not None or cfg.extract.backend != "transformers":
        return None
    from eagle3lib.common.device import resolve_devices, torch_dtype
    from eagle3lib.extract.backends.transformers_backend import needs_device_map

    devices = resolve_devices(cfg.extract.devices)
    if len(devices) < 2 or not all(d.startswith("cuda") for d in devices):
        return None
    if needs_device_map(model_dir, devices, torch_dtype(cfg.target.dtype, devices[0])):
        return None  # one process spreads the model over the GPUs
    return devices


def _worker(cfg_json: str, model_dir: str, layer_ids: list[int], dataset_dir: str,
            rows: list[tuple[int, list[int]]], device: str, spec: shards.ShardSpec, queue: Any) -> None:
    """One data-parallel process: its own GPU, its own backend and writer threads, progress to the parent."""
    from eagle3lib.extract.backends.transformers_backend import TransformersBackend

    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        cfg = WorkbookConfig.model_validate_json(cfg_json)
        backend = TransformersBackend(cfg, Path(model_dir), layer_ids, device=device)
        queue.put(("ready", device, None))
        try:
            capture_rows(backend, rows, Path(dataset_dir), spec, cfg.extract.writer_threads, cfg.extract.write_queue,
                         on_written=lambda r, t: queue.put(("progress", r, t)))
        finally:
            backend.close()
        queue.put(("done", device, None))
    except BaseException as e:  # reported to the parent, which stops the run with it
        queue.put(("error", device, f"{e.__class__.__name__}: {e}"))


def split_balanced(rows: list[int], input_ids: list[list[int]], n: int) -> list[list[int]]:
    """n shares with about equal tokens (longest first, each to the lightest share)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for r in sorted(rows, key=lambda r: len(input_ids[r]), reverse=True):
        k = load.index(min(load))
        shares[k].append(r)
        load[k] += len(input_ids[r])
    return shares


def capture_data_parallel(cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], dataset_dir: Path,
                          input_ids: list[list[int]], todo: list[int], devices: list[str], spec: shards.ShardSpec,
                          on_written: ProgressFn, on_ready: Callable[[str], None] | None = None) -> None:
    """One spawned process per device over balanced shares of `todo`; `on_ready(device)` once a process has its
    model loaded (benchmarks time the steady state from there)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for dev, share in zip(devices, split_balanced(todo, input_ids, len(devices)), strict=True):
        if not share:
            continue
        p = ctx.Process(target=_worker, args=(cfg.model_dump_json(), str(model_dir), layer_ids, str(dataset_dir),
                                                 [(i, input_ids[i]) for i in share], dev,
                                                 spec, queue),
                        daemon=True)
        p.start()
        procs.append(p)
    running = len(procs)
    try:
        while running:
            try:
                kind, a, b = queue.get(timeout=5)
            except Exception:  # queue.Empty: check that nobody died without a word
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkbookError(f"a data-parallel capture process died (exit code {dead[0].exitcode})",
                                        "rerun to resume; lower extract.batch_tokens if it ran out of memory") from None
                continue
            if kind == "progress":
                on_written(a, b)
            elif kind == "ready":
                if on_ready is not None:
                    on_ready(a)
            elif kind == "done":
                running -= 1
            else:
                raise WorkbookError(f"capture on {a} failed: {b}", "fix the cause and rerun: valid shards are kept")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
