"""Capture backends: who runs the target forward and hands back the hidden states of each row.

Why a protocol: `eagle3lib.capture` owns everything backend-neutral (resume, shard validation, token_freq, dataset
save, manifest metrics, progress), and a backend only turns token ids into states. The transformers backend is the
embedded default; the vLLM backends (`eagle3lib.backends.vllm_*`) are imported lazily so this package stays importable
where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from eagle3lib.config import WorkbookConfig


class CaptureBackend(Protocol):
    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor | Path]]:
        """rows: (row_index, token_ids). Yields (row_index, hidden_states [T, n_slots, H]) on the CPU, in the storage
        dtype, in any order. n_slots = len(layer_ids) incl. the final id N (pre-norm final output). A backend whose
        engine already wrote a file in the shard layout (vLLM's connector) yields its Path instead: the shard writer
        validates it and renames it into the dataset."""
        ...

    def close(self) -> None: ...


def make_backend(cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int]) -> CaptureBackend:
    """The backend `cfg.extract.backend` names, loaded with the target at `model_dir`, capturing `layer_ids`."""
    if cfg.extract.backend == "transformers":
        from eagle3lib.backends.transformers_backend import TransformersBackend

        return TransformersBackend(cfg, Path(model_dir), list(layer_ids))
    if cfg.extract.backend == "vllm":
        from eagle3lib.backends.vllm_backend import make_vllm_backend

        return make_vllm_backend(cfg, Path(model_dir), list(layer_ids))
    from eagle3lib.errors import WorkbookError

    raise WorkbookError(f"unknown extract.backend {cfg.extract.backend!r}", "set extract.backend to transformers or vllm")
