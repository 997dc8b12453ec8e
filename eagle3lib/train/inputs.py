"""What stage 05 reads from the run directory, and the check that it is all there before the Trainer starts.

Stage 02's dataset + hidden-state shards (train rows first, then validation rows: the train ratio is derived so
speculators' `int(n * ratio)` split lands exactly on stage 02's boundary), layer ids and target folder; stage 04's
verifier folder (embed/lm_head/norm + config.json) and t2d/d2t maps. In online and spool modes
(`train.hidden_states`) stage 02 wrote shards for its sample rows only (`shards.shard_rows`) and stage 05 gets every
batch's states elsewhere (eagle3lib.train.online, eagle3lib.train.spool).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3lib.common import shards
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import RunDir
from eagle3lib.common.target import tokenizer_dir


@dataclass
class TrainInputs:
    dataset_dir: Path
    train_rows: int
    val_rows: int
    layer_ids: list[int]  # every captured id as stage 02 recorded it: the aux ids, then the final id N
    hidden_size: int
    model_dir: Path  # the target checkpoint (what vLLM and the final config.json call the verifier)
    verifier_dir: Path  # stage 04: the tensors speculators loads while training (embed, lm_head, norm + config.json)
    t2d: torch.Tensor | None
    d2t: torch.Tensor | None
    draft_vocab_size: int
    shard_rows: list[int] | None = None  # rows with a shard (None = every row)
    tokenizer_dir: Path | None = None  # the target's tokenizer (None: model_dir): P-EAGLE's and DFlash's mask token

    @property
    def aux_layer_ids(self) -> list[int]:
        """The aux slots' ids (the final layer's slot is not an aux id)."""
        return self.layer_ids[:-1]

    @property
    def train_ratio(self) -> float:
        """The ratio speculators splits the dataset at, landing on stage 02's train/val boundary (shards.train_ratio)."""
        return shards.train_ratio(self.train_rows, self.val_rows)


def load_vocab_map(path: Path, key: str) -> torch.Tensor:
    """t2d/d2t from .npy (speculators' own cache format) or .safetensors (key `key`, or the only tensor)."""
    path = Path(path)
    if path.suffix == ".npy":
        import numpy as np

        return torch.from_numpy(np.load(path, allow_pickle=False))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        data = load_file(str(path))
        if key in data:
            return data[key]
        if len(data) == 1:
            return next(iter(data.values()))
        raise WorkbookError(f"{path} holds {sorted(data)} but no {key!r}", "rerun stage 04")
    raise WorkbookError(f"{path}: unknown vocab-map format {path.suffix!r}", "stage 04 must write .npy or .safetensors")


def inputs_from_run(rd: RunDir) -> TrainInputs:
    """Everything stage 05 needs, read from the manifests of stages 02 and 04 (checked against the config)."""
    m02 = rd.read_manifest("02")
    m04 = rd.read_manifest("04")
    metrics = m02["metrics"]
    train_rows, val_rows = int(metrics["train_rows"]), int(metrics["val_rows"])
    if val_rows < 1:
        raise WorkbookError("stage 02 recorded no validation rows", "rerun stage 02 with data.val_fraction > 0")
    t2d = d2t = None
    if m04["outputs"].get("t2d") and m04["outputs"].get("d2t"):
        t2d = load_vocab_map(rd.output("04", "t2d"), "t2d").to(torch.bool)
        d2t = load_vocab_map(rd.output("04", "d2t"), "d2t").to(torch.long)
    draft_vocab = int(m04["metrics"].get("draft_vocab_size") or (d2t.shape[0] if d2t is not None else 0))
    sampled = shards.sampled(metrics)  # (an offline stage 05 on an online stage 02: its manifest's hash refuses it)
    model_dir = Path(m02["outputs"]["model_dir"])
    verifier_dir = rd.output("04", "verifier_dir")
    if not (verifier_dir / "config.json").is_file():
        raise WorkbookError(f"stage 04's verifier folder {verifier_dir} has no config.json", "rerun stage 04")
    return TrainInputs(
        dataset_dir=rd.output("02", "dataset"), train_rows=train_rows, val_rows=val_rows,
        layer_ids=[int(i) for i in metrics["layer_ids"]], hidden_size=int(metrics["hidden_size"]),
        model_dir=model_dir, verifier_dir=verifier_dir, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab,
        shard_rows=shards.shard_rows(metrics, train_rows + val_rows) if sampled else None,
        tokenizer_dir=tokenizer_dir(rd.cfg.target, model_dir))


def check_shards(inp: TrainInputs, spec: shards.ShardSpec, threads: int = 8) -> None:
    """Every shard's header and token ids, before the Trainer starts (`shards.check_shard_header`, no states read).

    Why: speculators meets a bad shard mid-epoch with a raw error (truncated or empty file: a SafetensorError from its
    loader thread; missing: "Failed to load hidden states for sample i" with a split-relative i), or silently drops the
    row (token ids that differ: only a warning). Here it is one line naming the shards and the fix. In online and
    spool modes only the sample rows stage 02 wrote are checked (the rest have no shard: stage 05 gets their states
    elsewhere)."""
    from concurrent.futures import ThreadPoolExecutor

    from datasets import load_from_disk

    rows = load_from_disk(str(inp.dataset_dir)).with_format(None)["input_ids"]
    todo = list(range(len(rows))) if inp.shard_rows is None else inp.shard_rows
    with ThreadPoolExecutor(threads) as pool:
        found = list(pool.map(lambda i: shards.check_shard_header(shards.shard_path(inp.dataset_dir, i), rows[i], spec),
                              todo))
    bad = {i: p for i, p in zip(todo, found, strict=True) if p}
    if bad:
        first = "; ".join(f"hs_{i}: {', '.join(p)}" for i, p in list(bad.items())[:3])
        raise WorkbookError(
            f"{len(bad)} of {len(todo)} hidden-state shards in {shards.shard_dir(inp.dataset_dir)} are invalid "
            f"(rows {sorted(bad)[:20]}{' ...' if len(bad) > 20 else ''}): {first}",
            "rerun stage 02 (it keeps the valid shards and regenerates these), then stage 03 and 05")
