"""Hidden-state shards in the layout speculators 0.9 trains on, written atomically and validated on write and read.

One shard per dataset row i: `<dataset>/hidden_states/hs_{i}.safetensors` holding
    token_ids      int64 [T]            must equal the row's input_ids (speculators silently drops the row otherwise)
    hidden_states  [T, n_aux + 1, H]    aux slots in layer-id order, then the final layer's PRE-norm output
and, for FP8 shards (`extract.fp8_shards`), speculators' own FP8 format (hs_connectors.fp8_utils): hidden_states in
float8_e4m3fn plus
    hidden_states_scales  float32 [T, 1, 1]   one scale per token (amax over its slots and dims / 448)
which speculators' `FP8Transfer` (and `read_shard` here) turns back into the dtype the run computes in. Half the
bytes of bf16 per token, + 4 for the scale (docs/capture.md#fp8-hidden-state-shards).

Why one validator for every backend: the seed's worst bug wrote a "successful" dataset with one layer of four kept
and the rest flattened. Every writer (transformers, vLLM native, vLLM worker) goes through `write_shard`, which
refuses such a tensor before it reaches the disk, and stage 03 re-runs the same checks over what is on disk.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle3lib.common.atomic import atomic_path
from eagle3lib.common.errors import WorkbookError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,  # names in a file's header
                      "F8_E4M3": getattr(torch, "float8_e4m3fn", None)}
SCALES_KEY = "hidden_states_scales"  # = hs_connectors.fp8_utils.SCALES_KEY (require_fp8_reader checks it)
HEADER_BYTES = 1024  # the most a shard's safetensors header takes (8 bytes of length + a JSON of its keys, padded)


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
    dtype: torch.dtype  # what a reader gets back (and what the capture computed in)
    fp8: bool = False  # stored as float8_e4m3fn with a per-token scale (speculators' FP8 format)

    @property
    def stored_dtype(self) -> torch.dtype:
        return fp8_dtype() if self.fp8 else self.dtype

    def bytes_per_token(self) -> int:
        """What one token costs on disk: its states, the FP8 scale, its int64 token id."""
        per_value = 1 if self.fp8 else torch.tensor([], dtype=self.dtype).element_size()
        return self.n_slots * self.hidden_size * per_value + (4 if self.fp8 else 0) + 8

    def file_bytes(self, tokens: int) -> int:
        """At most what the shard of a `tokens`-token row takes on disk: its tokens plus the safetensors header
        (measured 144-264 bytes for these keys; HEADER_BYTES leaves room for a writer's metadata). What the spool's
        budget counts (eagle3lib.train.spool)."""
        return tokens * self.bytes_per_token() + HEADER_BYTES


def spec_from_metrics(metrics: dict) -> ShardSpec:
    """The spec stage 02 recorded in its manifest's metrics (layer_ids, hidden_size, dtype, fp8_shards): how stages
    03, 05 and 06 know what to expect. Raises KeyError/TypeError/ValueError on a manifest without them."""
    return ShardSpec(len(list(metrics["layer_ids"])), int(metrics["hidden_size"]),
                     DTYPES[str(metrics["dtype"]).removeprefix("torch.")], bool(metrics.get("fp8_shards", False)))


def sample_shards_only(hidden_states: str) -> bool:
    """Does train.hidden_states `hidden_states` leave stage 02 writing shards for its sample rows only
    (extract.online_sample_rows)? online and spool: stage 05 gets every batch's states elsewhere (the target in the
    training process, a producer process), so full shards would be disk spent for nothing
    (docs/capture.md#online-hidden-states, #spool-producer-mode). The one rule stages 00, 02, 03, 05 and 06 follow."""
    return hidden_states in ("online", "spool")


def sampled(metrics: dict) -> bool:
    """Stage 02 wrote shards for its sample rows only (its manifest's hidden_states is online or spool)."""
    return sample_shards_only(metrics.get("hidden_states", "offline"))


def shard_rows(metrics: dict, rows: int) -> list[int]:
    """The dataset rows that have a shard, as stage 02 recorded them: every row of an offline run, the sample rows
    (`metrics["shard_rows"]`, sorted) of an online or spool one. Stages 03, 05 and 06 read this, never guess from the
    disk."""
    if sampled(metrics):
        return sorted(int(i) for i in metrics["shard_rows"])
    return list(range(rows))


def fp8_dtype() -> torch.dtype:
    """torch.float8_e4m3fn, or one clear error on a torch without it (nothing has been written yet)."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise WorkbookError(f"extract.fp8_shards needs torch.float8_e4m3fn, which torch {torch.__version__} lacks",
                            "set extract.fp8_shards: false, or install torch >= 2.1")
    return dtype


def require_fp8_reader() -> None:
    """FP8 shards are only worth writing if the trainer can read them: speculators' hs_connectors (FP8Transfer) and
    a torch with float8_e4m3fn. Stage 02 calls this before the first shard, stage 05 before the first batch."""
    fp8_dtype()
    try:
        from hs_connectors.fp8_utils import SCALES_KEY as upstream
        from hs_connectors.transfer import FP8Transfer  # noqa: F401
    except ImportError as e:
        raise WorkbookError(f"extract.fp8_shards needs speculators' hs_connectors (FP8Transfer), which does not "
                            f"import here ({e})", "pip install -e . (speculators 0.9 brings hs-connectors), or set "
                            "extract.fp8_shards: false") from None
    if upstream != SCALES_KEY:
        raise WorkbookError(f"hs_connectors names the FP8 scales {upstream!r}, the workbook writes {SCALES_KEY!r}",
                            "set extract.fp8_shards: false until the workbook follows this hs_connectors version")


def quantize(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' own FP8 quantization (hs_connectors.fp8_utils: one float32 scale per token, amax / 448)."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    return quantize_tensor_to_fp8(hidden_states)


def dequantize(data: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A shard's tensors as a reader wants them: FP8 states through speculators' own dequantize (into `dtype`,
    default bf16, as its FP8Transfer does), the scales dropped; a shard without scales as stored."""
    if SCALES_KEY not in data:
        return data
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    out = {k: v for k, v in data.items() if k != SCALES_KEY}
    out["hidden_states"] = dequantize_fp8_tensor(data["hidden_states"], data[SCALES_KEY], dtype=dtype or torch.bfloat16)
    return out


def problems(token_ids: torch.Tensor, hidden_states: torch.Tensor, expected_ids: torch.Tensor | list[int] | None,
             spec: ShardSpec, values: bool = True) -> list[str]:
    """Every way a (token_ids, hidden_states) pair is wrong for `spec`; empty when it is right. `values=False`
    leaves out the finite check (an FP8 shard as stored: `fp8_value_problems` checks its bytes instead)."""
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
    if not out and values:
        if not torch.isfinite(hidden_states).all():
            out.append("hidden_states hold NaN or inf")
    return out


def fp8_value_problems(data: dict[str, torch.Tensor]) -> list[str]:
    """`problems`' finite check on an FP8 shard as stored, without dequantizing it (stage 03 reads every shard; on
    a CPU dequantizing took 40 of the 79 ms a 1.5B target's shard cost): e4m3fn has no infinity and its NaNs are the
    bytes 0x7F and 0xFF, and each token's scale must be finite. The dequantized states are finite exactly when both
    hold (|value| <= 448 x scale = the token's own amax)."""
    if has_fp8_nan(data["hidden_states"]) or not bool(torch.isfinite(data[SCALES_KEY]).all()):
        return ["hidden_states hold NaN or inf"]
    return []


_LOW7, _ONES, _HIGH = 0x7F7F7F7F7F7F7F7F, 0x0101010101010101, -0x7F7F7F7F7F7F7F80  # bytes 7F.., 01.., 80.. (int64)


def has_fp8_nan(x: torch.Tensor) -> bool:
    """Does an e4m3fn tensor hold a NaN (a byte whose low 7 bits are all set)? Eight bytes at a time where the size
    allows: z = (w & 0x7F..) ^ 0x7F.. has a zero byte exactly where a NaN is, and (z - 0x01..) & ~z & 0x80.. is
    nonzero exactly when z has one (every byte of z is below 0x80). Twice the speed of the byte-wise test on a CPU."""
    raw = x.contiguous().view(torch.uint8).reshape(-1)
    if raw.numel() % 8:
        return bool(((raw & 0x7F) == 0x7F).any())
    z = (raw.view(torch.int64) & _LOW7) ^ _LOW7
    return bool(((z - _ONES) & ~z & _HIGH).ne(0).any())


def write_shard(dataset_dir: Path, index: int, token_ids: torch.Tensor, hidden_states: torch.Tensor,
                expected_ids: torch.Tensor | list[int] | None, spec: ShardSpec) -> Path:
    """Validate, then write atomically. A wrong tensor stops the run with the sample index and what was expected."""
    token_ids = token_ids.to(torch.int64).contiguous()
    found = problems(token_ids, hidden_states, expected_ids, spec)
    if found:
        raise WorkbookError(f"sample {index}: refusing to write an invalid shard: " + "; ".join(found),
                            "this is a capture bug (wrong layer slicing or token alignment); nothing invalid was written")
    tensors = {"token_ids": token_ids, "hidden_states": hidden_states.contiguous()}
    if spec.fp8:
        tensors["hidden_states"], tensors[SCALES_KEY] = quantize(hidden_states)
    path = shard_path(dataset_dir, index)
    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file(tensors, str(tmp))
    return path


def adopt_shard(dataset_dir: Path, index: int, src: Path, expected_ids: torch.Tensor | list[int] | None,
                spec: ShardSpec, values_checked: bool = False) -> Path:
    """Validate a shard file another writer produced (vLLM's hidden-states connector writes the same two keys) and
    move it under its final name: the states reach the disk once instead of being read back and written again.
    `values_checked`: the writer already refused NaN/inf (the capture worker checks on the GPU), so only the header
    and the token ids are read here, not every state.

    `src` must be on the dataset's filesystem (a rename); an invalid file is deleted and stops the run like
    `write_shard` does, so nothing invalid ever carries a shard's name. For FP8 shards the file (in the capture
    dtype) is read, validated and written quantized by `write_shard`, and `src` is deleted."""
    as_written = replace(spec, fp8=False)  # what a backend writes: the capture dtype
    if values_checked:
        data, found = None, check_shard_header(Path(src), expected_ids, as_written)
    else:
        data, found = read_checked(Path(src), expected_ids, as_written)  # the FP8 rewrite below reuses `data`
    if not found and spec.fp8:
        data = data if data is not None else load_file(str(src))
        try:
            return write_shard(dataset_dir, index, data["token_ids"], data["hidden_states"], expected_ids, spec)
        finally:
            Path(src).unlink(missing_ok=True)
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


def read_shard(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """token_ids and hidden_states of one shard, FP8 states dequantized (into `dtype`, default bf16)."""
    return dequantize(load_file(str(path)), dtype)


def format_problems(data: dict[str, torch.Tensor], spec: ShardSpec) -> list[str]:
    """How a file's tensors as stored differ from the spec's storage (its keys, FP8 or not, the scales' shape);
    what the values hold is `problems`' job, after `dequantize`."""
    missing = {"token_ids", "hidden_states"} - set(data)
    if missing:
        return [f"missing keys {sorted(missing)} (found {sorted(data)})"]
    return _storage_problems(data["hidden_states"].dtype, list(data["hidden_states"].shape),
                             None if SCALES_KEY not in data else (data[SCALES_KEY].dtype, list(data[SCALES_KEY].shape)),
                             spec)


def _storage_problems(dtype: torch.dtype | str, shape: list[int], scales: tuple[Any, list[int]] | None,
                      spec: ShardSpec) -> list[str]:
    if dtype != spec.stored_dtype:
        how = "FP8 (extract.fp8_shards: true)" if spec.fp8 else f"{spec.dtype} (extract.fp8_shards: false)"
        return [f"hidden_states stored as {dtype}, this run stores {how}"]
    if spec.fp8:
        want = [shape[0] if shape else -1, 1, 1]
        if scales is None:
            return [f"FP8 hidden_states without {SCALES_KEY}"]
        if scales[0] not in (torch.float32, "F32") or scales[1] != want:
            return [f"{SCALES_KEY} is {scales[0]} {scales[1]}, expected float32 {want}"]
    return []


def check_shard_file(path: Path, expected_ids: torch.Tensor | list[int] | None, spec: ShardSpec) -> list[str]:
    """The problems of a shard on disk (unreadable, missing keys, or any of `problems`). Used to resume and by 03."""
    return read_checked(path, expected_ids, spec)[1]


def read_checked(path: Path, expected_ids: torch.Tensor | list[int] | None, spec: ShardSpec
                 ) -> tuple[dict[str, torch.Tensor] | None, list[str]]:
    """(the shard's tensors, FP8 dequantized, or None when it could not be read; its problems): `check_shard_file`
    for a caller that uses the tensors next, so the file is read once."""
    if not path.is_file():
        return None, ["missing"]
    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return None, [f"unreadable ({e.__class__.__name__}: {str(e)[:80]})"]
    found = format_problems(data, spec)
    if found:
        return None, found
    data = dequantize(data, spec.dtype)
    return data, problems(data["token_ids"], data["hidden_states"], expected_ids, spec)


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
            scales = None
            if SCALES_KEY in keys:
                sc = f.get_slice(SCALES_KEY)
                scales = (SAFETENSORS_DTYPES.get(sc.get_dtype(), sc.get_dtype()), list(sc.get_shape()))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return [f"unreadable ({e.__class__.__name__}: {str(e)[:80]})"]
    out: list[str] = []
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        out.append(f"token_ids must be int64 [T], got {token_ids.dtype} {list(token_ids.shape)}")
    want = [token_ids.shape[0] if token_ids.dim() >= 1 else -1, spec.n_slots, spec.hidden_size]
    if shape != want:
        out.append(f"hidden_states shape {shape}, expected [T, n_aux+1, H] = {want}")
    out += _storage_problems(dtype, shape, scales, spec)
    if expected_ids is not None:
        expected = torch.as_tensor(expected_ids, dtype=torch.int64)
        if expected.shape != token_ids.shape or not torch.equal(expected, token_ids.to(torch.int64)):
            out.append(f"token_ids differ from the dataset row (len {token_ids.shape[0]} vs {expected.shape[0]})")
    return out
