"""Hidden-state shards in the layout speculators 0.9 trains on, written atomically and validated on write and read.

One shard per dataset row i: `<dataset>/hidden_states/hs_{i}.safetensors` holding
    token_ids      int64 [T]            must equal the row's input_ids (speculators silently drops the row otherwise)
    hidden_states  [T, n_aux + 1, H]    aux slots in layer-id order, then the final layer's PRE-norm output

Why one validator for every backend: the seed's worst bug wrote a "successful" dataset with one layer of four kept
and the rest flattened. Every writer (transformers, vLLM native, vLLM worker) goes through `write_shard`, which
refuses such a tensor before it reaches the disk, and stage 03 re-runs the same checks over what is on disk.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle3lib.atomic import atomic_path
from eagle3lib.errors import WorkbookError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}  # names in a file's header


def train_ratio(train_rows: int, val_rows: int) -> float:
    """The `train_ratio` speculators' dataset takes so that its split lands on our train/val boundary.

    speculators splits a dataset at int(rows * train_ratio) (the trailing rows are validation rows): n_train / rows
    can land one row short in floating point (e.g. 15/22); half a row more always lands on n_train exactly.
    """
    return (train_rows + 0.5) / (train_rows + val_rows) if val_rows else 1.0


def shard_dir(dataset_dir: Path) -> Path:
    return Path(dataset_dir) / "hidden_states"


def shard_path(dataset_dir: Path, index: int) -> Path:
    return shard_dir(dataset_dir) / f"hs_{index}.safetensors"


@dataclass(frozen=True)
class ShardSpec:
    """What every shard of one dataset must look like."""

    n_slots: int  # aux layers + 1 final
    hidden_size: int
    dtype: torch.dtype


def problems(token_ids: torch.Tensor, hidden_states: torch.Tensor, expected_ids: torch.Tensor | list[int] | None,
             spec: ShardSpec) -> list[str]:
    """Every way a (token_ids, hidden_states) pair is wrong for `spec`; empty when it is right."""
    out: list[str] = []
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        out.append(f"token_ids must be int64 [T], got {token_ids.dtype} {list(token_ids.shape)}")
    t = token_ids.shape[0] if token_ids.dim() >= 1 else -1
    want_shape = [t, spec.n_slots, spec.hidden_size]
    if list(hidden_states.shape) != want_shape:
        out.append(f"hidden_states shape {list(hidden_states.shape)}, expected [T, n_aux+1, H] = {want_shape}")
    if hidden_states.dtype != spec.dtype:
        out.append(f"hidden_states dtype {hidden_states.dtype}, expected {spec.dtype}")
    if expected_ids is not None:
        expected = torch.as_tensor(expected_ids, dtype=torch.int64)
        if expected.shape != token_ids.shape or not torch.equal(expected, token_ids.to(torch.int64)):
            out.append(f"token_ids differ from the dataset row (len {token_ids.shape[0]} vs {expected.shape[0]})")
    if not out:
        if not torch.isfinite(hidden_states).all():
            out.append("hidden_states hold NaN or inf")
    return out


def write_shard(dataset_dir: Path, index: int, token_ids: torch.Tensor, hidden_states: torch.Tensor,
                expected_ids: torch.Tensor | list[int] | None, spec: ShardSpec) -> Path:
    """Validate, then write atomically. A wrong tensor stops the run with the sample index and what was expected."""
    token_ids = token_ids.to(torch.int64).contiguous()
    found = problems(token_ids, hidden_states, expected_ids, spec)
    if found:
        raise WorkbookError(f"sample {index}: refusing to write an invalid shard: " + "; ".join(found),
                            "this is a capture bug (wrong layer slicing or token alignment); nothing invalid was written")
    path = shard_path(dataset_dir, index)
    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file({"token_ids": token_ids, "hidden_states": hidden_states.contiguous()}, str(tmp))
    return path


def adopt_shard(dataset_dir: Path, index: int, src: Path, expected_ids: torch.Tensor | list[int] | None,
                spec: ShardSpec, values_checked: bool = False) -> Path:
    """Validate a shard file another writer produced (vLLM's hidden-states connector writes the same two keys) and
    move it under its final name: the states reach the disk once instead of being read back and written again.
    `values_checked`: the writer already refused NaN/inf (the capture worker checks on the GPU), so only the header
    and the token ids are read here, not every state.

    `src` must be on the dataset's filesystem (a rename); an invalid file is deleted and stops the run like
    `write_shard` does, so nothing invalid ever carries a shard's name."""
    found = (check_shard_header if values_checked else check_shard_file)(Path(src), expected_ids, spec)
    if found:
        Path(src).unlink(missing_ok=True)
        raise WorkbookError(f"sample {index}: refusing to adopt an invalid shard from {src}: " + "; ".join(found),
                            "this is a capture bug (wrong layer slicing or token alignment); nothing invalid was kept")
    path = shard_path(dataset_dir, index)
    try:
        os.replace(src, path)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        with atomic_path(path, suffix=".safetensors") as tmp:  # another filesystem: copy, then rename there
            shutil.copyfile(src, tmp)
        Path(src).unlink()
    return path


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def check_shard_file(path: Path, expected_ids: torch.Tensor | list[int] | None, spec: ShardSpec) -> list[str]:
    """The problems of a shard on disk (unreadable, missing keys, or any of `problems`). Used to resume and by 03."""
    if not path.is_file():
        return ["missing"]
    try:
        data = read_shard(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return [f"unreadable ({e.__class__.__name__}: {str(e)[:80]})"]
    missing = {"token_ids", "hidden_states"} - set(data)
    if missing:
        return [f"missing keys {sorted(missing)} (found {sorted(data)})"]
    return problems(data["token_ids"], data["hidden_states"], expected_ids, spec)


def check_shard_header(path: Path, expected_ids: torch.Tensor | list[int] | None, spec: ShardSpec) -> list[str]:
    """The cheap check stage 05 runs over every shard before training: the header (keys, shape, dtype; safetensors
    refuses a file its header does not exactly cover, so truncated and empty files fail here) and the token ids,
    without reading the states. What it cannot see (NaN, a flipped bit inside the states) is stage 03's full check."""
    if not path.is_file():
        return ["missing"]
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if {"token_ids", "hidden_states"} - keys:
                return [f"missing keys {sorted({'token_ids', 'hidden_states'} - keys)} (found {sorted(keys)})"]
            hs = f.get_slice("hidden_states")
            shape, dtype = list(hs.get_shape()), SAFETENSORS_DTYPES.get(hs.get_dtype(), hs.get_dtype())
            token_ids = f.get_tensor("token_ids")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return [f"unreadable ({e.__class__.__name__}: {str(e)[:80]})"]
    out: list[str] = []
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        out.append(f"token_ids must be int64 [T], got {token_ids.dtype} {list(token_ids.shape)}")
    want = [token_ids.shape[0] if token_ids.dim() >= 1 else -1, spec.n_slots, spec.hidden_size]
    if shape != want:
        out.append(f"hidden_states shape {shape}, expected [T, n_aux+1, H] = {want}")
    if dtype != spec.dtype:
        out.append(f"hidden_states dtype {dtype}, expected {spec.dtype}")
    if expected_ids is not None:
        expected = torch.as_tensor(expected_ids, dtype=torch.int64)
        if expected.shape != token_ids.shape or not torch.equal(expected, token_ids.to(torch.int64)):
            out.append(f"token_ids differ from the dataset row (len {token_ids.shape[0]} vs {expected.shape[0]})")
    return out
