"""Strategy `native`: vLLM's own `extract_hidden_states` speculative method plus a hidden-states KV connector.

vLLM computes the residual stream at `eagle_aux_hidden_state_layer_ids` (our ids, final N included: id N is the
last layer's pre-norm output, FACTS), stores it in a cache-only attention layer, and the connector writes one
safetensors file per finished request (`hidden_states [T, n_ids, H]`, `token_ids`) whose path comes back in
`RequestOutput.kv_transfer_params["hidden_states_path"]`. We read it, convert to the storage dtype, delete it.

Three things this file handles that upstream leaves to the caller (FACTS):
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
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle3lib.backends.adapters import check_cpu_support, select_adapter
from eagle3lib.backends.vllm_backend import (
    cache_root,
    compat_engine_kwargs,
    engine_kwargs,
    generate,
    on_cpu,
    pipelined,
    prepare_environment,
    request_batches,
    start_engine,
    stop_engine,
)
from eagle3lib.config import WorkbookConfig
from eagle3lib.errors import WorkbookError
from eagle3lib.shards import DTYPES
from eagle3lib.target import read_hf_config


def connector_config(out_dir: Path) -> dict[str, Any]:
    """kv_transfer_config for the hidden-states connector: upstream's where it works (CUDA), the compat registry's
    synchronous CPU subclass where it does not (loaded by module path, so every vLLM process finds it)."""
    from eagle3lib.compat import hidden_states_kv_transfer_config

    return hidden_states_kv_transfer_config(out_dir)


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def read_states_file(path: str, pump: Any = None, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
    """Load one connector file once its writer released the `.lock` (polled, never a blocking wait: with an
    in-process engine the writer is this process, and `pump` runs the engine step that writes it); then delete the
    file and its lock."""
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
    data = load_file(path, device="cpu")
    for p in (path, lock):
        if os.path.exists(p):
            os.remove(p)
    return data


class VllmNativeBackend:
    """Strategy `native`: one engine with the extract_hidden_states method; a file per prompt, read and removed."""

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], **engine_overrides: Any):
        self.cfg, self.model_dir, self.layer_ids = cfg, Path(model_dir), list(layer_ids)
        self.hf_config = read_hf_config(self.model_dir)
        self.adapter = select_adapter(self.hf_config)
        if on_cpu():
            check_cpu_support(self.adapter, self.hf_config)
        self.adapter.check_native_ids(self.layer_ids)
        self.dtype = DTYPES[cfg.extract.dtype]
        self.out_dir = Path(cfg.extract.vllm_hidden_states_dir or cache_root(cfg) / "vllm_hidden_states")
        if self.out_dir.exists() and cfg.extract.vllm_hidden_states_dir is None:
            shutil.rmtree(self.out_dir)  # leftovers of a killed run are never read: each file is keyed by request id
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prepare_environment(cfg)
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        kwargs = engine_kwargs(cfg, self.model_dir, self.adapter)
        kwargs["speculative_config"] = speculative_config(self.layer_ids)
        kwargs["kv_transfer_config"] = connector_config(self.out_dir)
        kwargs.update(compat_engine_kwargs())
        kwargs.update(engine_overrides)
        self.llm = start_engine(kwargs)

    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor]]:
        n_slots = len(self.layer_ids)
        for batch, outs, busy in pipelined(request_batches(rows, self.cfg.extract.vllm_request_tokens),
                                           lambda b: generate(self.llm, b)):
            # in-process: while the next batch runs, its steps write these files; after the last one we step
            pump = self.llm.llm_engine.step if self.in_process and not busy else None
            for (row, token_ids), out in zip(batch, outs, strict=True):
                params = out.kv_transfer_params or {}
                if "hidden_states_path" not in params:
                    raise WorkbookError(f"row {row}: vLLM returned no hidden_states_path (kv_transfer_params="
                                        f"{params!r})", "is the hidden-states connector configured?")
                path = params["hidden_states_path"]
                data = read_states_file(path, pump)
                hs, tok = data.get("hidden_states"), data.get("token_ids")
                if hs is None or tok is None:
                    raise WorkbookError(f"row {row}: {path} holds {sorted(data)}, expected hidden_states and token_ids",
                                        "this vLLM version changed the connector's file format")
                t = len(token_ids)
                if hs.dim() != 3 or list(hs.shape[:2]) != [t, n_slots]:
                    raise WorkbookError(f"row {row}: vLLM wrote hidden_states {list(hs.shape)}, expected "
                                        f"[{t}, {n_slots}, H]", "this vLLM version changed the connector's layout")
                if tok.tolist() != list(token_ids):
                    raise WorkbookError(f"row {row}: vLLM's file holds different token ids than the row",
                                        "report this as a bug: files and requests are out of step")
                yield row, hs.to(self.dtype)

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            stop_engine(self.llm)
            self.llm = None


def _lock_free(lock: str) -> bool:
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
    except (BlockingIOError, FileNotFoundError):
        return False
