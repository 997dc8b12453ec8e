"""Strategy `worker` of the vLLM backend (`extract.strategy: worker`): the workbook's capture worker
(eagle3lib.extract.backends.capture_worker, running inside vLLM's worker processes) hooks the decoder layers of a
plain vLLM engine; for targets the native path cannot serve (multimodal wrappers, DeepseekV2 calling conventions,
older vLLM).

Why a worker's reply is checked for its shape: collective_rpc returns one reply per worker in some paths and a single
value in others (`unique_reply_rank`, `single_value`); a wrong guess once wrote a "valid" dataset of wrong tensors.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.device import on_cpu
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import cache_root
from eagle3lib.common.shards import DTYPES
from eagle3lib.common.target import read_hf_config
from eagle3lib.extract.backends import vllm_engine as engine
from eagle3lib.extract.backends.adapters import check_cpu_support, select_adapter

WORKER_EXTENSION = engine.WORKER_EXTENSION


def expect_replies(replies: Any, n_workers: int, what: str) -> list[dict[str, Any]]:
    """The replies of a collective_rpc, checked: a list of one dict per worker, none carrying an error. Anything else
    stops the run with the worker's own message (never a silent guess about the reply shape)."""
    if not isinstance(replies, list):
        raise WorkbookError(f"{what}: collective_rpc returned {type(replies).__name__}, expected a list of one reply "
                            f"per worker", "this vLLM version changed collective_rpc; update eagle3lib.extract.backends")
    if len(replies) != n_workers:
        raise WorkbookError(f"{what}: {len(replies)} worker replies, expected {n_workers} (TP x PP)",
                            "this vLLM version changed collective_rpc; update eagle3lib.extract.backends")
    for r in replies:
        if not isinstance(r, dict):
            raise WorkbookError(f"{what}: a worker replied {type(r).__name__} {str(r)[:200]!r}, expected a dict",
                                "is worker_extension_cls the workbook's CaptureWorker?")
        if r.get("error"):
            raise WorkbookError(f"{what} failed in vLLM worker rank {r.get('rank')}: {r['error'].strip()}",
                                "read the worker's traceback above (it is the real error)")
    return replies


def wait_for_worker_file(row: int, path: str, timeout_s: float = 600.0) -> None:
    """Return once the capture worker's writer renamed `path` into place; its `.error` file (the writer's traceback)
    stops the run with the real message."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if os.path.exists(path + ".error"):
            with open(path + ".error") as f:
                text = f.read().strip()
            raise WorkbookError(f"row {row}: the capture worker failed to write its states: {text}",
                                "read the worker's traceback above (it is the real error)")
        if time.monotonic() > deadline:
            raise WorkbookError(f"row {row}: the capture worker did not write {path} within {timeout_s:.0f} s",
                                "check the engine log above for a worker error")
        time.sleep(0.002)


class VllmWorkerBackend(engine.LogsOutputs):
    """Strategy `worker`: the workbook's capture worker hooks the decoder layers of a plain vLLM engine and writes one
    shard-shaped file per request into a spool folder of the run (eagle3lib.extract.backends.capture_worker). The worker refuses
    NaN/inf states itself (checked on the device), so the shard writer reads only each file's header and token ids
    (`values_checked`) instead of the ~64 MB of states per 2k-token row of an 8B target."""

    values_checked = True

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], llm: Any = None,
                 **engine_overrides: Any):
        self.cfg, self.model_dir, self.layer_ids = cfg, Path(model_dir), list(layer_ids)
        self.hf_config = read_hf_config(self.model_dir)
        self.adapter = select_adapter(self.hf_config)
        if on_cpu():
            check_cpu_support(self.adapter, self.hf_config)
        self.dtype = DTYPES[cfg.extract.dtype]
        self.n_workers = cfg.extract.tensor_parallel_size * cfg.extract.pipeline_parallel_size
        # on the dataset's filesystem: a file becomes a shard by a rename. Leftovers of a killed run are never read
        self.spool = cache_root(cfg) / "vllm_worker_states"
        shutil.rmtree(self.spool, ignore_errors=True)
        self.stats: dict[str, Any] = {"generate_s": 0.0, "pop_s": 0.0, "wait_s": 0.0, "adopted": 0, "converted": 0,
                                      "merged": 0}
        engine.prepare_environment(cfg)
        self.llm = llm
        if self.llm is None:
            kwargs = engine.engine_kwargs(cfg, self.model_dir, self.adapter)
            kwargs["worker_extension_cls"] = WORKER_EXTENSION
            kwargs.update(engine_overrides)
            self.llm = engine.start_engine(kwargs)
        self.install(self.layer_ids)

    def install(self, layer_ids: list[int]) -> list[dict[str, Any]]:
        fields = {"family": self.adapter.family.name, "wrapper": self.adapter.wrapper,
                  "model_type": self.adapter.model_type, "text_model_type": self.adapter.text_model_type}
        args = (list(layer_ids), fields, self.cfg.extract.dtype, str(self.spool), self.cfg.extract.writer_threads)
        replies = expect_replies(self.llm.collective_rpc("eagle3_install", args=args), self.n_workers,
                                 "installing the capture hooks")
        covered = sorted({k for r in replies if r.get("writes") for k in r["layers"]})
        if covered != sorted(layer_ids):
            raise WorkbookError(f"capture hooks cover layer ids {covered}, expected {sorted(layer_ids)}",
                                "a pipeline stage did not report its layers: check pipeline_parallel_size")
        self.layer_ids = list(layer_ids)
        return replies

    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor | Path]]:
        """A request's file in the storage dtype is handed on as a Path (renamed into the dataset by the shard
        writer); another dtype, or one file per pipeline stage, is read and converted or merged here."""
        batches = engine.request_batches(rows, self.cfg.extract.vllm_request_tokens)
        for batch, (ids, replies), _ in engine.pipelined(batches, self._run):
            yield from self._assemble(batch, ids, replies)

    def _run(self, batch: list[tuple[int, list[int]]]) -> tuple[list[str], list[dict[str, Any]]]:
        """One generate call and the paths of its captures (both on the engine thread)."""
        t0 = time.perf_counter()
        ids = [o.request_id for o in engine.generate(self.llm, batch, self.log)]
        t1 = time.perf_counter()
        replies = expect_replies(self.llm.collective_rpc("eagle3_pop", args=(ids,)), self.n_workers,
                                 "collecting captured states")
        self.stats["generate_s"] += t1 - t0
        self.stats["pop_s"] += time.perf_counter() - t1
        return ids, replies

    def _assemble(self, batch: list[tuple[int, list[int]]], ids: list[str],
                  replies: list[dict[str, Any]]) -> Iterator[tuple[int, torch.Tensor | Path]]:
        from eagle3lib.extract.backends.capture_worker import external_id, file_layer_ids

        files: dict[str, list[str]] = {}
        for reply in replies:
            for internal, path in reply.get("files", {}).items():
                external = external_id(internal, ids)
                if external is None:
                    raise WorkbookError(f"capture worker returned states for unknown request {internal!r}",
                                        "report this as a bug: requests and captures are out of step")
                files.setdefault(external, []).append(path)
        for (row, token_ids), rid in zip(batch, ids, strict=True):
            paths = files.get(rid, [])
            t0 = time.perf_counter()
            for p in paths:
                wait_for_worker_file(row, p)
            self.stats["wait_s"] += time.perf_counter() - t0
            found = {p: file_layer_ids(p) for p in paths}
            have = sorted(k for ks in found.values() for k in ks)
            if have != sorted(self.layer_ids):
                raise WorkbookError(f"row {row}: captured layer ids {have}, expected {self.layer_ids}",
                                    "a capture went missing between the engine and the workbook (report this)")
            if len(paths) == 1 and found[paths[0]] == self.layer_ids:
                yield row, engine.hand_on(row, token_ids, paths[0], self.dtype, len(self.layer_ids), self.stats)
                continue
            yield row, self._merge(row, token_ids, found)

    def _merge(self, row: int, token_ids: list[int], found: dict[str, list[int]]) -> torch.Tensor:
        """One file per pipeline stage (each holds its own layers): read, put in layer order, delete."""
        slots: dict[int, torch.Tensor] = {}
        for path, ks in found.items():
            data = load_file(path, device="cpu")
            os.remove(path)
            if data["token_ids"].tolist() != list(token_ids):
                raise WorkbookError(f"row {row}: the engine ran different token ids than the row holds",
                                    "report this as a bug: requests and captures are out of step")
            hs = data["hidden_states"]
            if hs.dim() != 3 or list(hs.shape[:2]) != [len(token_ids), len(ks)]:
                raise WorkbookError(f"row {row}: {path} holds hidden_states {list(hs.shape)}, expected "
                                    f"[{len(token_ids)}, {len(ks)}, H]", "report this as a bug")
            slots.update({k: hs[:, j] for j, k in enumerate(ks)})
        self.stats["merged"] += 1
        return torch.stack([slots[k] for k in self.layer_ids], dim=1).to(self.dtype)

    def collect(self, rows: list[tuple[int, list[int]]], request_ids: list[str]) -> dict[int, torch.Tensor | Path]:
        """The hooks' states of requests another driver ran on this engine (the native strategy's, for the capture
        probe's second path): `rows` and the request ids their outputs carried, in the same order."""
        replies = expect_replies(self.llm.collective_rpc("eagle3_pop", args=(list(request_ids),)), self.n_workers,
                                 "collecting captured states")
        return dict(self._assemble(rows, list(request_ids), replies))

    def detach(self) -> None:
        """Remove the hooks and the spool but leave the engine running (it belongs to another backend)."""
        if self.llm is not None:
            try:
                self.llm.collective_rpc("eagle3_remove")
            finally:
                self.llm = None
                shutil.rmtree(self.spool, ignore_errors=True)

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.collective_rpc("eagle3_remove")
            except Exception:  # noqa: BLE001 - engine may already be gone
                pass
            engine.stop_engine(self.llm)
            self.llm = None
        shutil.rmtree(self.spool, ignore_errors=True)
