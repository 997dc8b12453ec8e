"""Capture backends: who runs the target forward and hands back the hidden states of each row.

Why a protocol: `eagle3lib.extract.capture` owns everything backend-neutral (resume, shard validation, token_freq, dataset
save, manifest metrics, progress), and a backend only turns token ids into states. The transformers backend is the
embedded default; the vLLM strategies (`vllm_native`, `vllm_worker`, over the shared `vllm_engine`) are imported lazily so this package stays importable
where vLLM is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from eagle3lib.common.config import WorkbookConfig


class CaptureBackend(Protocol):
    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor | Path]]:
        """rows: (row_index, token_ids). Yields (row_index, hidden_states [T, n_slots, H]) on the CPU, in the storage
        dtype, in any order. n_slots = len(layer_ids) incl. the final id N (pre-norm final output). A backend whose
        engine already wrote a file in the shard layout (vLLM's connector) yields its Path instead: the shard writer
        validates it and renames it into the dataset."""
        ...

    def close(self) -> None: ...


def make_vllm_backend(cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], **engine_overrides: Any) -> Any:
    """The vLLM strategy `cfg.extract.strategy` names (native | worker), engine started and ready. `engine_overrides`
    go straight to `vllm.LLM` (e.g. load_format="dummy" for a benchmark on random weights)."""
    from eagle3lib.extract.backends.vllm_engine import require_vllm

    require_vllm("extract.backend: vllm", "use extract.backend: transformers")
    t0 = time.perf_counter()
    if cfg.extract.strategy == "worker":
        from eagle3lib.extract.backends.vllm_worker import VllmWorkerBackend

        backend: Any = VllmWorkerBackend(cfg, model_dir, layer_ids, **engine_overrides)
    elif cfg.extract.vllm_endpoint:
        from eagle3lib.extract.backends.vllm_native import VllmEndpointBackend

        backend = VllmEndpointBackend(cfg, model_dir, layer_ids)
    else:
        from eagle3lib.extract.backends.vllm_native import VllmNativeBackend

        backend = VllmNativeBackend(cfg, model_dir, layer_ids, **engine_overrides)
    backend.engine_start_s = time.perf_counter() - t0
    return backend


def make_backend(cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int]) -> CaptureBackend:
    """The backend `cfg.extract.backend` names, loaded with the target at `model_dir`, capturing `layer_ids`."""
    if cfg.extract.backend == "transformers":
        from eagle3lib.extract.backends.transformers_backend import TransformersBackend

        return TransformersBackend(cfg, Path(model_dir), list(layer_ids))
    if cfg.extract.backend == "vllm":
        return make_vllm_backend(cfg, Path(model_dir), list(layer_ids))
    from eagle3lib.common.errors import WorkbookError

    raise WorkbookError(f"unknown extract.backend {cfg.extract.backend!r}", "set extract.backend to transformers or vllm")
