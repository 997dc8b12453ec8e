"""Patch: the hidden-states KV connector on a machine without CUDA.

Why: vLLM's native capture (`speculative_config={"method": "extract_hidden_states", ...}`) hands each request's
hidden states to `ExampleHiddenStatesConnector`, whose `_submit_async_write` copies them on a CUDA stream into pinned
host memory and waits on a CUDA event. On CPU that fails (`pin_memory=True requires a CUDA or other accelerator
backend`). `CPUHiddenStatesConnector` overrides only that method: it extracts the slots from the cache and saves
the file synchronously, then releases the per-file lock exactly like upstream, and records an already-complete
"event" so `get_finished` reports the request as sent (else its blocks would never be freed).

How it reaches the engine: vLLM builds connectors in the engine-core and worker processes from the config, so the
reliable route is the config itself — `kv_connector_module_path` names this module. Use:

    from eagle3lib.compat.cpu_hidden_states_connector import hidden_states_kv_transfer_config
    LLM(..., kv_transfer_config=hidden_states_kv_transfer_config(storage_dir))

which returns the upstream connector where it works (CUDA) and this one where it does not. The registered patch
additionally points vLLM's connector registry entry 'ExampleHiddenStatesConnector' at this class, for code that
names the upstream connector in a process where the patch was applied (in-process engines, or via worker_setup).
"""

from __future__ import annotations

import fcntl
import functools
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from eagle3lib.compat import Patch, register

NAME = "cpu_hidden_states_connector"
UPSTREAM = "ExampleHiddenStatesConnector"
_state: dict[str, Any] = {}


class _DoneEvent:
    """Stands in for the CUDA event upstream records: the copy is already complete when it is created."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _connector_class() -> type:
    """Define the subclass lazily: importing vLLM's connector module costs seconds and needs vLLM installed."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as upstream

    cached = _state.get("cls")
    if cached is not None:
        return cached

    import torch
    from safetensors.torch import save_file

    class CPUHiddenStatesConnector(upstream.ExampleHiddenStatesConnector):
        """ExampleHiddenStatesConnector that writes synchronously: no CUDA stream, event or pinned memory."""

        def _submit_async_write(self, pending: Any) -> None:
            if not self._is_tp_rank_zero:
                return
            assert self._kv_cache is not None
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
            num_tokens = pending.token_ids.shape[0]
            states = upstream.extract_from_kv_cache(self._kv_cache, slot_mapping.to(self._kv_cache.device),
                                                    num_tokens)
            tensors = {"hidden_states": states.to("cpu").contiguous().clone(),
                       "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                save_file(tensors, pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases LOCK_EX: readers blocked in load_hidden_states wake up
            self._req_copy_events[pending.req_id] = _DoneEvent()

    CPUHiddenStatesConnector.__module__ = __name__
    CPUHiddenStatesConnector.__qualname__ = "CPUHiddenStatesConnector"
    _state["cls"] = CPUHiddenStatesConnector
    return CPUHiddenStatesConnector


def __getattr__(name: str) -> Any:
    # vLLM resolves getattr(import_module(kv_connector_module_path), kv_connector): serve the class lazily.
    if name == "CPUHiddenStatesConnector":
        return _connector_class()
    raise AttributeError(name)


def connector_write_probe(cls: type | None = None) -> tuple[bool, str]:
    """Run a connector's real `_submit_async_write` on a tiny CPU cache (no engine) and check the written file.

    `cls` None = the class vLLM's registry currently resolves for 'ExampleHiddenStatesConnector'."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import load_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        PendingSave,
        extract_from_kv_cache,
    )

    if cls is None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory._registry[UPSTREAM]()
    # n_ids == block_size: vLLM 0.26 lays the cache out [blocks, block_size, ids, H], 0.32 [blocks, ids, block_size,
    # H]; with both sizes equal each version's own `extract_from_kv_cache` indexes in range. (A cache built for one
    # layout made the probe fail on the other, and the H200 silently wrote every file synchronously: 0.33 x prefill.)
    block_size = n_ids = 4
    hidden = 8
    kv_cache = torch.randn(3, n_ids, block_size, hidden)
    conn = cls.__new__(cls)
    conn._is_tp_rank_zero, conn._kv_cache, conn._block_size = True, kv_cache, block_size
    conn._copy_stream, conn._req_futures, conn._req_copy_events, conn._lock_fds = None, {}, {}, {}
    conn.use_lock = True
    conn._executor = ThreadPoolExecutor(max_workers=1)
    with tempfile.TemporaryDirectory(prefix="eagle3-connector-probe-") as tmp:
        path = os.path.join(tmp, "req.safetensors")
        token_ids = torch.arange(6)
        try:
            conn._submit_async_write(PendingSave("req", path, token_ids, [2, 0]))
            for fut in list(conn._req_futures.values()):
                fut.result(timeout=10)
        except Exception as e:  # noqa: BLE001 - the failure IS the finding
            return False, f"{cls.__name__}._submit_async_write fails here: {type(e).__name__}: {str(e)[:160]}"
        finally:
            conn._executor.shutdown(wait=True)
        slots = (torch.arange(block_size)[None, :] + torch.tensor([2, 0])[:, None] * block_size).flatten()
        expected = extract_from_kv_cache(kv_cache, slots, 6)
        data = load_file(path)
        if not torch.equal(data["hidden_states"], expected) or not torch.equal(data["token_ids"], token_ids):
            return False, f"{cls.__name__} wrote wrong slots"
        with open(path + ".lock") as lf:  # the lock must be released, or readers hang
            try:
                fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False, f"{cls.__name__} left the file lock held"
        event = conn._req_copy_events.get("req")
        if event is not None and not event.query():
            return False, f"{cls.__name__} never reports the request as sent"
    return True, f"{cls.__name__} wrote [6, {n_ids}, {hidden}] correctly"


@functools.lru_cache(maxsize=1)
def upstream_works() -> bool:
    """Does vLLM's own ExampleHiddenStatesConnector write files on this machine? (probed once per process; on a GPU
    a failure is a warning with the probe's reason: the synchronous fallback costs ~3x in extraction speed)"""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    ok, detail = connector_write_probe(ExampleHiddenStatesConnector)
    if not ok:
        import torch

        if torch.cuda.is_available():
            warnings.warn(f"vLLM's hidden-states connector failed the write probe on a GPU machine ({detail}); "
                          "extraction falls back to the synchronous CPUHiddenStatesConnector (slow)", stacklevel=2)
    return ok


def hidden_states_kv_transfer_config(storage_path: str | Path, **extra_config: Any) -> dict[str, Any]:
    """The kv_transfer_config dict for native hidden-state capture on THIS install: upstream connector where it
    works, `CPUHiddenStatesConnector` (loaded by module path, so every vLLM process finds it) where it does not.
    `extra_config` goes into kv_connector_extra_config (e.g. use_synchronization_lock=False)."""
    config: dict[str, Any] = {
        "kv_connector": UPSTREAM,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_path), **extra_config},
    }
    if not upstream_works():
        config["kv_connector"] = "CPUHiddenStatesConnector"
        config["kv_connector_module_path"] = __name__
    return config


def _detect() -> bool:
    """Needed on a machine without CUDA only. On a GPU the registry keeps upstream's asynchronous connector even if
    the probe fails there (stage 01 on the H200 once reported such a failure while stage 02's own probe passed): a
    patched registry would silently make every vLLM worker write synchronously (~3x slower);
    `hidden_states_kv_transfer_config` still falls back, with a warning, where the upstream class cannot write."""
    import torch

    if torch.cuda.is_available():
        return False
    try:
        import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
    except ImportError:
        return False
    return not connector_write_probe()[0]


def _apply() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "loader" in _state:
        return
    cls = _connector_class()
    _state["loader"] = KVConnectorFactory._registry[UPSTREAM]

    def loader() -> type:
        return cls

    KVConnectorFactory._registry[UPSTREAM] = loader


def _revert() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    loader = _state.pop("loader", None)
    if loader is not None:
        KVConnectorFactory._registry[UPSTREAM] = loader


register(Patch(
    name=NAME,
    why="vLLM's hidden-states connector needs CUDA streams, events and pinned memory; on CPU it must save "
        "synchronously.",
    repairs="vllm.hidden_states_connector.works_here",
    detect=_detect,
    apply=_apply,
    revert=_revert,
    stages=("02",),
    scope="worker",
))
