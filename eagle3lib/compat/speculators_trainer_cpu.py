"""Patch: let speculators 0.9's `Trainer` run on a machine without an accelerator (the CPU demo, CI).

Why: speculators' Trainer assumes a GPU in four places, and on a CPU-only install each fails or silently misbehaves:
  1. `Trainer.setup_model` moves the model to `get_local_rank()` (the int 0), i.e. to an accelerator device:
     "Cannot access accelerator device when none is available". Patched: the trainer's local rank is "cpu".
  2. `Trainer.__init__` sets `device_type = acc.type if acc else "cuda"`: `torch.autocast("cuda")` on CPU tensors is
     silently OFF, so bf16 hidden states meet fp32 weights and the matmul fails. Patched: a class-level property that
     always answers "cpu" (a data descriptor wins over the instance assignment in __init__).
  3. `_StepTimer` calls `torch.accelerator.synchronize()` on every logged step: RuntimeError without an accelerator.
     Patched: a no-op while no accelerator exists.
  4. Resume: `SingleGPUCheckpointer.load_*` map tensors to `get_current_device()`, which answers "cuda:0" without an
     accelerator. Patched: "cpu".
  5. Under torchrun, `maybe_setup_distributed` raises "No accelerator found" (it picks the backend from the
     accelerator). Patched: the same topology on the gloo backend, so speculators' DDP path runs on CPU processes
     (what the multi-GPU command is tested with in CI).

Detected by behaviour: needed exactly when torch reports no current accelerator (then (2) would pick "cuda" and (3)
would raise) and speculators is installed. Apply is idempotent; revert restores every original object.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from eagle3lib.compat import Patch, register

NAME = "speculators_trainer_cpu"
_ORIGINALS: dict[str, Any] = {}


def _speculators_installed() -> bool:
    return importlib.util.find_spec("speculators") is not None


def detect() -> bool:
    """True when speculators is installed and this machine has no accelerator (the Trainer would pick 'cuda')."""
    if not _speculators_installed():
        return False
    import torch

    if torch.accelerator.current_accelerator() is not None:
        return False
    try:  # behaviour, not a version number: does synchronize fail here?
        torch.accelerator.synchronize()
    except RuntimeError:
        return True
    return True  # no accelerator: device_type would still resolve to "cuda"


def _cpu_device_type(self: Any) -> str:
    return "cpu"


def _ignore_set(self: Any, value: Any) -> None:  # Trainer.__init__ assigns device_type; keep "cpu"
    return None


def _sync_noop(*args: Any, **kwargs: Any) -> None:
    return None


def _setup_distributed_gloo(sp_size: int = 1) -> None:
    """speculators' maybe_setup_distributed with the gloo backend: the same module state and process groups."""
    import os

    import speculators.train.distributed as d
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        return _ORIGINALS["distributed.maybe_setup_distributed"](sp_size)
    d._local_rank = int(os.environ["LOCAL_RANK"])  # noqa: SLF001 - speculators' own module state, set as it does
    d._is_distributed = True  # noqa: SLF001
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    d._rank, d._world_size = dist.get_rank(), dist.get_world_size()  # noqa: SLF001
    d._init_sp_process_groups(d._rank, d._world_size, sp_size)  # noqa: SLF001
    return None




def apply() -> None:
    """Install the four CPU replacements (idempotent: a second call changes nothing)."""
    if _ORIGINALS:
        return
    import speculators.train.checkpointer as ckpt
    import speculators.train.distributed as distributed
    import speculators.train.trainer as trainer
    import torch

    _ORIGINALS["distributed.maybe_setup_distributed"] = distributed.maybe_setup_distributed
    distributed.maybe_setup_distributed = _setup_distributed_gloo
    _ORIGINALS["trainer.get_local_rank"] = trainer.get_local_rank
    _ORIGINALS["torch.accelerator.synchronize"] = torch.accelerator.synchronize
    _ORIGINALS["checkpointer.get_current_device"] = ckpt.get_current_device
    _ORIGINALS["Trainer.device_type"] = trainer.Trainer.__dict__.get("device_type", _MISSING)
    trainer.get_local_rank = lambda: "cpu"
    trainer.Trainer.device_type = property(_cpu_device_type, _ignore_set)  # type: ignore[attr-defined]
    torch.accelerator.synchronize = _sync_noop
    ckpt.get_current_device = lambda: "cpu"


def revert() -> None:
    """Put every original back (no-op when not applied)."""
    if not _ORIGINALS:
        return
    import speculators.train.checkpointer as ckpt
    import speculators.train.distributed as distributed
    import speculators.train.trainer as trainer
    import torch

    distributed.maybe_setup_distributed = _ORIGINALS.pop("distributed.maybe_setup_distributed")
    trainer.get_local_rank = _ORIGINALS.pop("trainer.get_local_rank")
    torch.accelerator.synchronize = _ORIGINALS.pop("torch.accelerator.synchronize")
    ckpt.get_current_device = _ORIGINALS.pop("checkpointer.get_current_device")
    original = _ORIGINALS.pop("Trainer.device_type")
    if original is _MISSING:
        if "device_type" in trainer.Trainer.__dict__:
            delattr(trainer.Trainer, "device_type")
    else:
        trainer.Trainer.device_type = original  # type: ignore[attr-defined]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()

PATCH = register(Patch(
    name=NAME,
    why="speculators' Trainer assumes an accelerator: device moves, autocast('cuda'), synchronize, resume and "
        "torchrun's process group all fail or silently misbehave on a CPU-only machine.",
    repairs="speculators.train.Trainer runs on CPU",
    detect=detect,
    apply=apply,
    revert=revert,
    stages=("05",),
))
