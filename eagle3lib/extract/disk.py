"""Stage 02 and the disk: the space check before the first shard, and the one-line error when the disk fills anyway
(every shard under its final name is complete, so the rerun keeps them)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from eagle3lib.common import shards
from eagle3lib.common.errors import WorkbookError


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT however it arrives: an OSError from Python, or safetensors' own error, which carries no errno
    (measured on a full tmpfs: `SafetensorError: Error while serializing: I/O error: No space left on device (os
    error 28)`), or the text a data-parallel capture process sent back."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def disk_full_error(dataset_dir: Path, input_ids: list[list[int]], spec: shards.ShardSpec,
                    rows: list[int] | None = None) -> WorkbookError:
    """One line: how far the run got, how much more the rest needs, what is free. Every shard under its final name is
    complete (atomic writes), so the rerun keeps them. `rows`: the rows that get a shard (None = all)."""
    done = {int(p.stem.removeprefix("hs_")) for p in shards.shard_dir(dataset_dir).glob("hs_*.safetensors")
            if p.stem.removeprefix("hs_").isdigit()}
    rows = list(range(len(input_ids))) if rows is None else rows
    done &= set(rows)
    rest = [i for i in rows if i not in done]
    need = sum(len(input_ids[i]) for i in rest) * spec.bytes_per_token() + 1_000_000  # + the table, token_freq
    free = shutil.disk_usage(dataset_dir).free if dataset_dir.exists() else 0
    return WorkbookError(
        f"the disk is full: writing to {dataset_dir} failed with {len(done)} of "
        f"{len(rows)} shards written; the remaining {len(rest)} shards need about {need / 1e9:.3f} GB "
        f"({need:,} bytes), {free / 1e9:.3f} GB is free",
        f"free at least {need / 1e9:.3f} GB on that disk (or set run.output_root to a bigger one) and rerun: the shards "
        "already written are kept")


def require_disk(dataset_dir: Path, input_ids: list[list[int]], todo: list[int], spec: shards.ShardSpec) -> None:
    """Before the first shard: the rows still to extract must fit the free space (their real token count × bytes per
    token, plus the table), else one error saying how many of them fit. Nothing is written before it, and the
    replies stage 02 generated are cached, so the rerun after freeing space starts where this one stopped."""
    per_token = spec.bytes_per_token()
    margin = 1_000_000 + 16 * sum(len(r) for r in input_ids)  # the table (int64 input_ids + loss_mask), token_freq
    need = sum(len(input_ids[i]) for i in todo) * per_token + margin
    free = shutil.disk_usage(dataset_dir).free
    if need <= free:
        return
    room, fit = free - margin, 0
    for i in todo:
        room -= len(input_ids[i]) * per_token
        if room < 0:
            break
        fit += 1
    kept = len(input_ids) - len(todo)
    raise WorkbookError(
        f"the hidden states of the {len(todo)} rows still to extract need {_size(need)} and {_size(free)} is free at "
        f"{dataset_dir}: {fit} of them fit",
        f"free at least {_size(need - free)}, set run.output_root to a bigger disk, or lower data.num_samples to "
        f"about {kept + fit}; rerun (the generated replies are cached)")


def _size(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
