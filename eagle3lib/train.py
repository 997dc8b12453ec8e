"""Stage 05: train the EAGLE-3 draft with speculators 0.9's own model, losses, data pipeline and Trainer.

What this module adds around speculators (and nothing else: no second EAGLE-3 implementation):
  * reads the run directory: stage 02's dataset + hidden-state shards (train rows first, then validation rows: the
    train ratio is derived so speculators' `int(n * ratio)` split lands exactly on stage 02's boundary), layer ids and
    target folder; stage 04's verifier folder (embed/lm_head/norm + config.json) and t2d/d2t maps;
  * builds `Eagle3DraftModel.from_training_args` through speculators' own `build_draft_model` (so every default —
    norm_before_fc, norm_output, sliding window, rope — is speculators'), with every knob from `cfg.train`;
  * resolves 'auto': sdpa attention + eager loss + fp32 on CPU; flex attention + bf16 autocast on GPU, and the fused
    (Triton) loss only when a quick behavioural probe passes (on torch 2.11 it fails inside dynamo; we then log why
    and use the eager loss);
  * drives `Trainer.train_epoch` / `val_epoch` / `maybe_save_checkpoint` itself (instead of `run_training`) so it can
    validate the UNTRAINED draft first, draw one tqdm bar with tokens/s, and record per step and per epoch: loss per
    TTT step, full_acc_s, cond_acc_s and the expected acceptance length 1 + Σ_s full_acc_s (train and validation);
  * checkpoints are speculators' own (`draft/checkpoints/<epoch>/`), resumed from the last one on rerun; the final
    one's config.json names the TARGET folder as verifier (absolute, outside the run dir) so it still loads after the
    run directory moves, and `workbook.json` beside it records the verifier folder relative to the checkpoint.

Run it:
  one process (CPU or one GPU):   eagle3 run --config configs/demo.yaml --run demo --stages 05
  several GPUs (DDP):             torchrun --nproc-per-node 4 -m eagle3lib.train --config CONFIG --run-name NAME
                                  (or set train.nproc_per_node=4: notebook 05 then launches exactly that command)
  tiny CPU check:                 pytest tests/test_train.py
Writes (under the run directory): draft/checkpoints/<epoch>/ (speculators format, vLLM eagle3-loadable),
draft/curves.json, draft/result.json, figures/05_curves.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3lib import atomic
from eagle3lib.config import TrainSection, WorkbookConfig
from eagle3lib.errors import WorkbookError
from eagle3lib.rundir import RunDir

log = logging.getLogger("eagle3lib.train")

LOSS_NAMES = {"kl": "kl_div", "ce": "ce"}
ATTN_NAMES = {"sdpa": "sdpa", "flex_attention": "simple_flex_attention"}
SCHEDULERS = {"constant": "none", "linear": "linear", "cosine": "cosine"}


# ---------------------------------------------------------------------------------------------------------------------
# Resolving 'auto'
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Resolved:
    """The concrete settings a run uses, with the reason for each automatic choice (shown in the notebook)."""

    device: str  # "cpu" | "cuda"
    attn_impl: str  # speculators' name: sdpa | simple_flex_attention
    loss_implementation: str  # eager | fused
    hidden_states_dtype: str  # float32 | bfloat16 (dataloader dtype and autocast dtype)
    num_workers: int = 0  # data loader worker processes
    reasons: list[str] = field(default_factory=list)


def probe_fused_loss(device: str = "cuda") -> tuple[bool, str]:
    """Does speculators' fused (Triton) loss work HERE, inside a compiled region as the draft's forward uses it?

    Behavioural: compile a function that calls speculators' `compute_metrics` with the fused KL loss on a small random
    batch, run forward and backward, and compare loss and gradient with the eager loss. Returns (ok, reason).
    """
    if device != "cuda" or not torch.cuda.is_available():
        return False, "no CUDA device (the fused loss is a Triton kernel)"
    try:
        import triton  # noqa: F401
        from speculators.losses import resolve_loss_config
        from speculators.models.eagle3.metrics import compute_metrics
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return False, f"import failed: {e.__class__.__name__}: {str(e)[:120]}"
    g = torch.Generator(device="cuda").manual_seed(0)
    logits0 = torch.randn(1, 64, 1000, device="cuda", generator=g)
    targets = torch.randn(1, 64, 1000, device="cuda", generator=g)
    mask = torch.ones(1, 64, device="cuda", dtype=torch.bool)

    def run(impl: str, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits0.clone().requires_grad_(True)
        cfg = resolve_loss_config("kl_div", impl)

        def f(lg: torch.Tensor) -> torch.Tensor:
            loss, _ = compute_metrics(lg, targets, mask, mask.clone(), 1, 1.0, loss_config=cfg)
            return loss

        fn = torch.compile(f) if compiled else f
        loss = fn(logits)
        loss.backward()
        return loss.detach(), logits.grad.detach()

    try:
        ref_loss, ref_grad = run("eager", compiled=False)
        loss, grad = run("fused", compiled=True)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the point of the probe
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return False, f"fused loss failed under torch.compile: {e.__class__.__name__}: {msg[:160]}"
    if not torch.allclose(loss, ref_loss, rtol=1e-3, atol=1e-4) or not torch.allclose(grad, ref_grad, rtol=1e-2,
                                                                                        atol=1e-5):
        return False, f"fused loss disagrees with eager ({loss.item():.6f} vs {ref_loss.item():.6f})"
    return True, "fused loss matches the eager loss under torch.compile"


def resolve_settings(tcfg: TrainSection, device: str | None = None) -> Resolved:
    """Turn the config's 'auto' values into concrete ones for this machine."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    reasons: list[str] = []
    if tcfg.draft_attn_impl == "auto":
        attn = "simple_flex_attention" if device == "cuda" else "sdpa"
        reasons.append(f"attention {attn}: " + ("speculators' fast default on GPU" if device == "cuda"
                                                 else "flex attention has no CPU backward"))
    else:
        attn = ATTN_NAMES[tcfg.draft_attn_impl]
        if attn == "simple_flex_attention" and device != "cuda":
            raise WorkbookError("train.draft_attn_impl=flex_attention needs a GPU (no CPU backward)",
                                "set train.draft_attn_impl to sdpa or auto")
    if tcfg.loss_implementation == "auto":
        if device == "cuda":
            ok, why = probe_fused_loss(device)
            loss_impl = "fused" if ok else "eager"
            reasons.append(f"loss {loss_impl}: {why}")
        else:
            loss_impl = "eager"
            reasons.append("loss eager: the fused loss is a Triton kernel (GPU only)")
    else:
        loss_impl = tcfg.loss_implementation
        if loss_impl == "fused" and device != "cuda":
            raise WorkbookError("train.loss_implementation=fused needs a GPU (Triton kernel)",
                                "set train.loss_implementation to eager or auto")
    if tcfg.dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
        reasons.append(f"dtype {dtype}: " + ("bf16 autocast on GPU" if device == "cuda"
                                             else "bf16 is slower than fp32 on CPUs without AMX"))
    else:
        dtype = tcfg.dtype
    if tcfg.num_workers == "auto":
        workers = 0 if device == "cpu" else min(8, max(1, (os.cpu_count() or 2) // 2))
        reasons.append(f"{workers} data loader workers: " + ("the CPU trains, no spare cores" if device == "cpu"
                                                              else "shards are read and packed in parallel"))
    else:
        workers = int(tcfg.num_workers)
    for r in reasons:
        log.info("auto: %s", r)
    return Resolved(device, attn, loss_impl, dtype, num_workers=workers, reasons=reasons)


# ---------------------------------------------------------------------------------------------------------------------
# Inputs from the run directory
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class TrainInputs:
    dataset_dir: Path
    train_rows: int
    val_rows: int
    aux_layer_ids: list[int]  # ids of the aux slots (the final layer's slot is not an aux id)
    hidden_size: int
    model_dir: Path  # the target checkpoint (what vLLM and the final config.json call the verifier)
    verifier_dir: Path  # stage 04: the tensors speculators loads while training (embed, lm_head, norm + config.json)
    t2d: torch.Tensor | None
    d2t: torch.Tensor | None
    draft_vocab_size: int

    @property
    def train_ratio(self) -> float:
        """speculators splits at int(n * ratio): the +0.5 makes that land exactly on stage 02's boundary."""
        return (self.train_rows + 0.5) / (self.train_rows + self.val_rows)


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
    model_dir = Path(m02["outputs"]["model_dir"])
    verifier_dir = rd.output("04", "verifier_dir")
    if not (verifier_dir / "config.json").is_file():
        raise WorkbookError(f"stage 04's verifier folder {verifier_dir} has no config.json", "rerun stage 04")
    return TrainInputs(
        dataset_dir=rd.output("02", "dataset"), train_rows=train_rows, val_rows=val_rows,
        aux_layer_ids=list(metrics["layer_ids"][:-1]), hidden_size=int(metrics["hidden_size"]),
        model_dir=model_dir, verifier_dir=verifier_dir, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab)


def check_shards(inp: TrainInputs, dtype: str, threads: int = 8) -> None:
    """Every shard's header and token ids, before the Trainer starts (`shards.check_shard_header`, no states read).

    Why: speculators meets a bad shard mid-epoch with a raw error (truncated or empty file: a SafetensorError from its
    loader thread; missing: "Failed to load hidden states for sample i" with a split-relative i), or silently drops the
    row (token ids that differ: only a warning). Here it is one line naming the shards and the fix."""
    from concurrent.futures import ThreadPoolExecutor

    from datasets import load_from_disk

    from eagle3lib import shards

    rows = load_from_disk(str(inp.dataset_dir)).with_format(None)["input_ids"]
    spec = shards.ShardSpec(len(inp.aux_layer_ids) + 1, inp.hidden_size, shards.DTYPES[dtype])
    with ThreadPoolExecutor(threads) as pool:
        found = list(pool.map(lambda i: shards.check_shard_header(shards.shard_path(inp.dataset_dir, i), rows[i], spec),
                              range(len(rows))))
    bad = {i: p for i, p in enumerate(found) if p}
    if bad:
        first = "; ".join(f"hs_{i}: {', '.join(p)}" for i, p in list(bad.items())[:3])
        raise WorkbookError(
            f"{len(bad)} of {len(rows)} hidden-state shards in {shards.shard_dir(inp.dataset_dir)} are invalid "
            f"(rows {sorted(bad)[:20]}{' ...' if len(bad) > 20 else ''}): {first}",
            "rerun stage 02 (it keeps the valid shards and regenerates these), then stage 03 and 05")


# ---------------------------------------------------------------------------------------------------------------------
# speculators objects: config, model, loaders, trainer
# ---------------------------------------------------------------------------------------------------------------------


def speculators_train_config(inp: TrainInputs, tcfg: TrainSection, res: Resolved, save_path: Path, seed: int):
    """speculators' own typed TrainConfig (its defaults fill every field we do not set)."""
    from speculators.train.config import TrainConfig

    flat: dict[str, Any] = {
        "speculator_type": "eagle3", "seed": seed,
        "verifier_name_or_path": str(inp.verifier_dir), "target_layer_ids": inp.aux_layer_ids,
        "num_layers": tcfg.num_layers, "draft_vocab_size": inp.draft_vocab_size, "draft_attn_impl": res.attn_impl,
        "mask_token_id": 0,  # unused by eagle3; set so no tokenizer is needed beside the verifier tensors
        "data_path": str(inp.dataset_dir), "total_seq_len": tcfg.packing_length,
        "train_data_ratio": inp.train_ratio, "hidden_states_dtype": res.hidden_states_dtype,
        "num_workers": res.num_workers, "prefetch_factor": tcfg.prefetch_factor,
        "loss_implementation": res.loss_implementation, "loss_fn": LOSS_NAMES[tcfg.loss],
        "ttt_steps": tcfg.ttt_steps, "ttt_step_loss_decay": tcfg.step_loss_decay,
        "optimizer": tcfg.optimizer, "lr": tcfg.lr, "weight_decay": tcfg.weight_decay,
        "scheduler_type": SCHEDULERS[tcfg.scheduler], "scheduler_warmup_steps": tcfg.warmup_steps,
        "epochs": tcfg.epochs, "max_steps": tcfg.max_steps, "save_path": str(save_path), "checkpoint_freq": 1,
    }
    return TrainConfig.from_flat(flat)


def build_draft(inp: TrainInputs, tcfg: TrainSection, res: Resolved, save_path: Path, seed: int = 0):
    """`Eagle3DraftModel.from_training_args` via speculators' `build_draft_model` (verifier config, layer config,
    vocab maps, verifier weights — all speculators' code). Returns (model, train_kwargs, val_kwargs, args)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import build_draft_model

    spec_cfg = speculators_train_config(inp, tcfg, res, save_path, seed)
    args = argparse.Namespace(**spec_cfg.flatten())
    model = build_draft_model(args, Eagle3DraftModel, inp.t2d, inp.d2t, inp.draft_vocab_size)
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    return model, train_kwargs, val_kwargs, spec_cfg


def _counting_loader_class():
    from torch.utils.data import DataLoader

    class CountingLoader(DataLoader):
        """speculators' data path in a DataLoader that (1) remembers the real (non-padding) tokens of the batch it
        last yielded, for tokens/s, and (2) on a GPU copies batch i+1 to the device on a side stream while the
        trainer computes on batch i (the Trainer's own `.to(device)` is then a no-op): at ~270 MB per packed 8k batch
        of an 8B target, a copy on the compute stream would cost ~10% of the step."""

        last_tokens = 0
        prefetch_device: torch.device | None = None

        def _count(self, batch: dict[str, Any]) -> int:
            return int((batch["document_ids"] != -1).sum())

        def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
            device = self.prefetch_device
            if device is None or device.type != "cuda":
                for batch in super().__iter__():
                    self.last_tokens = self._count(batch)
                    yield batch
                return
            stream = torch.cuda.Stream(device)

            def stage(batch: dict[str, Any]) -> tuple[dict[str, Any], Any, int]:
                tokens = self._count(batch)  # on the host copy: no device sync
                with torch.cuda.stream(stream):
                    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                           for k, v in batch.items()}
                    event = torch.cuda.Event()
                    event.record(stream)
                return out, event, tokens

            def finish(staged: tuple[dict[str, Any], Any, int]) -> dict[str, Any]:
                out, event, tokens = staged
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                for v in out.values():
                    if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                        v.record_stream(current)
                self.last_tokens = tokens
                return out

            pending = None
            for batch in super().__iter__():
                staged = stage(batch)
                if pending is not None:
                    yield finish(pending)
                pending = staged
            if pending is not None:
                yield finish(pending)

    return CountingLoader


def make_loaders(inp: TrainInputs, tcfg: TrainSection, res: Resolved, seed: int = 0):
    """speculators' ArrowDataset + packing sampler + collate (its data path), in our DataLoader (token counting;
    pinned memory only where there is a GPU to copy to)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.dataloader import _worker_init_fn
    from speculators.train.distributed import get_dp_rank, get_dp_size
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    dtype = getattr(torch, res.hidden_states_dtype)
    loader_cls = _counting_loader_class()
    loaders = []
    for split in ("train", "val"):
        ds = ArrowDataset(max_len=tcfg.packing_length, datapath=str(inp.dataset_dir), on_missing="raise",
                          train_ratio=inp.train_ratio, split=split, hidden_states_dtype=dtype,
                          model=str(inp.verifier_dir))
        if ds.data.format.get("type") != "torch":  # speculators compares rows with torch.equal: needs tensors
            ds.data = ds.data.with_format("torch")
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=tcfg.packing_length, lengths=ds.approx_lengths,
                                                     num_replicas=get_dp_size(), rank=get_dp_rank(), seed=seed)
        if len(sampler) == 0:  # else a later, vaguer failure (or a rank waiting forever for the others)
            raise WorkbookError(
                f"the {split} split (rows: {len(ds)}) gives this process (rank {get_dp_rank()} of {get_dp_size()}) no "
                f"batch of up to {tcfg.packing_length} tokens",
                "raise data.val_fraction or add data (every process needs rows of its own), or train on fewer processes")
        workers = res.num_workers
        loaders.append(loader_cls(
            ds, batch_sampler=sampler, num_workers=workers,
            prefetch_factor=tcfg.prefetch_factor if workers > 0 else None,
            pin_memory=res.device == "cuda",
            collate_fn=CollateFn(tcfg.packing_length, inp.hidden_size, num_target_layers=len(inp.aux_layer_ids),
                                 dtype=dtype, preprocess=shift_batch),
            persistent_workers=workers > 0, multiprocessing_context="spawn" if workers > 0 else None,
            worker_init_fn=_worker_init_fn if workers > 0 else None))
        if res.device == "cuda" and tcfg.device_prefetch:
            from speculators.train.distributed import get_local_rank

            loaders[-1].prefetch_device = torch.device("cuda", get_local_rank())
    return loaders[0], loaders[1]


def expected_acceptance_length(metrics: dict[str, float], ttt_steps: int, suffix: str = "") -> float:
    """1 + Σ_s full_acc_s: the mean number of tokens per verifier step if the draft proposes ttt_steps tokens."""
    return 1.0 + sum(float(metrics.get(f"full_acc_{s}{suffix}", 0.0)) for s in range(ttt_steps))


def _summary(metrics: dict[str, float], ttt_steps: int, suffix: str = "") -> dict[str, Any]:
    """The numbers a curve needs, in one flat shape for train steps, train epochs and validation."""
    out: dict[str, Any] = {"loss": float(metrics.get(f"loss{suffix}", float("nan")))}
    for s in range(ttt_steps):
        for key in ("loss", "full_acc", "cond_acc"):
            out[f"{key}_{s}"] = float(metrics.get(f"{key}_{s}{suffix}", float("nan")))
    out["eal"] = expected_acceptance_length(metrics, ttt_steps, suffix)
    return out


class _MetricCapture(logging.Handler):
    """Receives what speculators' Trainer logs on 'speculators.metrics' (a dict per step / per validation)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.records.append(record.msg)


@contextmanager
def _quiet_speculators_bars_and_capture() -> Iterator[_MetricCapture]:
    """Route speculators' per-step metric dicts to us, and replace its rich per-epoch bars with a passthrough (our
    tqdm bar shows the run instead)."""
    import speculators.train.trainer as trainer_mod

    capture = _MetricCapture()
    mlog = logging.getLogger("speculators.metrics")
    old = (mlog.level, mlog.propagate, trainer_mod.tqdm)
    mlog.setLevel(logging.INFO)
    mlog.propagate = False
    mlog.addHandler(capture)
    trainer_mod.tqdm = lambda it, *a, **k: it  # type: ignore[assignment]
    try:
        yield capture
    finally:
        mlog.removeHandler(capture)
        mlog.setLevel(old[0])
        mlog.propagate = old[1]
        trainer_mod.tqdm = old[2]


# ---------------------------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------------------------


@contextmanager
def fused_adamw(device: str) -> Iterator[None]:
    """On a GPU, speculators' AdamW runs as torch's fused kernel (one launch for every parameter instead of a
    foreach loop; FACTS' 70.1k tok/s on the H200 were measured with it). speculators builds a plain AdamW inside
    `Trainer.__init__`; the flags are flipped on that fresh optimizer, before the Trainer loads a checkpoint's
    optimizer state, so resumed step counters land on the GPU as the fused kernel needs."""
    if device != "cuda":
        yield
        return
    import speculators.train.trainer as trainer_module

    original = trainer_module.build_optimizers

    def build(model: Any, config: Any) -> list[torch.optim.Optimizer]:
        optimizers = original(model, config)
        for opt in optimizers:
            if type(opt) is torch.optim.AdamW:
                opt.defaults.update(fused=True, foreach=False)
                for group in opt.param_groups:
                    group.update(fused=True, foreach=False)
                opt._step_supports_amp_scaling = True  # what AdamW(fused=True) sets
        return optimizers

    trainer_module.build_optimizers = build
    try:
        yield
    finally:
        trainer_module.build_optimizers = original


def draft_dir(rd: RunDir) -> Path:
    return rd.path("draft")


def checkpoints_dir(rd: RunDir) -> Path:
    return rd.path("draft", "checkpoints")


def _ensure_cpu_patch(device: str) -> bool:
    """Apply the speculators-Trainer-on-CPU patch from the compat registry when this machine needs it."""
    if device != "cpu":
        return False
    from eagle3lib.compat import apply_patch
    from eagle3lib.compat.speculators_trainer_cpu import NAME

    return apply_patch(NAME)


# Settings that may change between a run and its resumption (how long, how often, how the data is fed); any other
# change would silently continue training a different recipe from the old checkpoint.
RESUMABLE_CHANGES = frozenset({"epochs", "max_steps", "val_every", "save_every", "num_workers", "prefetch_factor",
                               "nproc_per_node", "device_prefetch", "loss_implementation", "draft_attn_impl", "dtype"})


def prepare_checkpoint_dir(save_path: Path, tcfg: TrainSection, draft_vocab_size: int) -> list[str]:
    """Before the Trainer looks for a checkpoint to resume: drop epoch folders a killed run left half-written
    (speculators writes `training_state.json` last), and refuse to resume checkpoints trained with another recipe.
    Returns the folders removed."""
    import shutil

    removed = []
    if save_path.is_dir():
        for d in save_path.iterdir():
            if d.is_dir() and not d.is_symlink() and d.name.isdigit() and not (d / "training_state.json").is_file():
                removed.append(d.name)
                if _is_rank0():
                    shutil.rmtree(d)
    recipe = {k: v for k, v in tcfg.model_dump(mode="json").items() if k not in RESUMABLE_CHANGES}
    recipe["draft_vocab_size"] = draft_vocab_size
    recipe_path = save_path / "workbook_recipe.json"
    has_ckpt = save_path.is_dir() and any(d.name.isdigit() for d in save_path.iterdir() if d.is_dir())
    if has_ckpt and recipe_path.is_file():
        old = json.loads(recipe_path.read_text())
        changed = sorted(k for k in set(old) | set(recipe) if old.get(k) != recipe.get(k))
        if changed:
            raise WorkbookError(
                f"{save_path} holds checkpoints trained with other settings ({', '.join(changed)} changed)",
                f"delete {save_path} to start over, or use another run name (-p run.name=...)")
    if _is_rank0():
        atomic.write_json(recipe_path, recipe)
    return removed


def _load_curves(path: Path) -> dict[str, Any] | None:
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
    return None


def _is_rank0() -> bool:
    from speculators.train.distributed import get_rank

    return get_rank() == 0


def train(rd: RunDir, *, device: str | None = None, progress: bool = True,
          resolved: Resolved | None = None) -> dict[str, Any]:
    """Train (or resume training) the draft for this run; returns the result dict (also written to draft/result.json).

    Works in one process and under `torchrun` (speculators' DDP: `maybe_setup_distributed` reads LOCAL_RANK);
    only rank 0 writes curves, figures and the result.
    """
    from speculators.train import distributed
    from speculators.train.cli import set_seed
    from speculators.train.distributed import is_distributed
    from speculators.train.trainer import Trainer, TrainerConfig
    from tqdm.auto import tqdm

    cfg: WorkbookConfig = rd.cfg
    tcfg = cfg.train
    res = resolved or resolve_settings(tcfg, device)
    if res.device == "cpu" and res.hidden_states_dtype == "float32":  # the Trainer's autocast is a no-op then
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    patched = _ensure_cpu_patch(res.device)
    set_seed(cfg.run.seed)
    distributed.maybe_setup_distributed()  # looked up after the CPU patch, which sets it up on gloo
    inp = inputs_from_run(rd)
    check_shards(inp, rd.read_manifest("02")["metrics"].get("dtype", "bfloat16"))
    save_path = checkpoints_dir(rd)
    save_path.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(save_path)
    for name in prepare_checkpoint_dir(save_path, tcfg, inp.draft_vocab_size):
        log.warning("removed the half-written checkpoint %s/%s of an interrupted run", save_path, name)
    if is_distributed():
        torch.distributed.barrier()  # rank 0 cleaned up before any rank looks for a checkpoint

    model, train_kwargs, val_kwargs, spec_cfg = build_draft(inp, tcfg, res, save_path, cfg.run.seed)
    if _is_rank0():
        spec_cfg.save(str(save_path))  # speculators' run.yaml + train_command.txt beside the checkpoints
    train_loader, val_loader = make_loaders(inp, tcfg, res, cfg.run.seed)
    tconf = TrainerConfig(
        lr=tcfg.lr, num_epochs=tcfg.epochs, save_path=str(save_path), resume_from_checkpoint=True,
        train_call_kwargs=train_kwargs, val_call_kwargs=val_kwargs, optimizer=tcfg.optimizer,
        weight_decay=tcfg.weight_decay, scheduler_type=SCHEDULERS[tcfg.scheduler],  # type: ignore[arg-type]
        scheduler_warmup_steps=tcfg.warmup_steps, checkpoint_freq=1,
        hidden_states_dtype=getattr(torch, res.hidden_states_dtype), log_freq=1, max_steps=tcfg.max_steps)

    curves_path = draft_dir(rd) / "curves.json"
    with _quiet_speculators_bars_and_capture() as capture:
        with fused_adamw(res.device):
            trainer = Trainer(model, tconf, train_loader, val_loader)
        start_epoch = trainer.current_epoch
        old = _load_curves(curves_path) if start_epoch > 0 or trainer.global_step > 0 else None
        curves: dict[str, Any] = {
            "ttt_steps": tcfg.ttt_steps, "resolved": asdict(res),
            "steps": [s for s in (old or {}).get("steps", []) if s["step"] <= trainer.global_step],
            "train_epochs": [e for e in (old or {}).get("train_epochs", []) if e["epoch"] < start_epoch],
            "val": [v for v in (old or {}).get("val", []) if v["epoch"] < start_epoch],
        }
        resumed = start_epoch > 0 or trainer.global_step > 0
        if not resumed:
            # the untrained draft's validation: the baseline every later epoch must beat. (Sampler epoch 0: the
            # packing sampler's empty cache is keyed -1, and validation batches do not depend on the epoch anyway.)
            untrained = trainer.val_epoch(0)
            if not untrained:
                raise WorkbookError("validating the untrained draft produced no batches",
                                    "check that stage 02's validation rows have hidden-state shards")
            curves["val"].append({"epoch": -1, "step": 0, **_summary(untrained, tcfg.ttt_steps, "_epoch")})
        steps_per_epoch = len(train_loader)
        total = steps_per_epoch * tcfg.epochs if tcfg.max_steps is None else min(tcfg.max_steps,
                                                                                  steps_per_epoch * tcfg.epochs)
        bar = tqdm(total=total, initial=min(trainer.global_step, total), desc="train draft", unit="step",
                   disable=not (progress and _is_rank0()), dynamic_ncols=True)
        clock = {"t": time.perf_counter(), "tokens": 0, "t0": time.perf_counter()}

        def on_step() -> None:
            now = time.perf_counter()
            n_tok = train_loader.last_tokens
            dt = now - clock["t"]
            clock["t"] = now
            clock["tokens"] += n_tok
            rec = capture.records[-1] if capture.records and "train" in capture.records[-1] else None
            if rec is not None and _is_rank0():
                summ = _summary(rec["train"], tcfg.ttt_steps)
                curves["steps"].append({"step": trainer.global_step, "epoch": rec["epoch"], "lr": rec["lr"],
                                        "tokens": n_tok, "tokens_per_s": n_tok / dt if dt > 0 else None, **summ})
                bar.set_postfix(loss=f"{summ['loss']:.3f}", eal=f"{summ['eal']:.2f}",
                                tok_s=f"{clock['tokens'] / max(now - clock['t0'], 1e-9):,.0f}")
            bar.update(1)

        last_saved: int | None = trainer.checkpointer.previous_epoch if resumed else None
        for epoch in range(start_epoch, tcfg.epochs):
            if tcfg.max_steps is not None and trainer.global_step >= tcfg.max_steps:
                break
            first_step = len(curves["steps"])
            clock["t"] = time.perf_counter()  # validation and saving are not training time
            trainer.train_epoch(epoch, step_callback=on_step)
            stopping = (epoch == tcfg.epochs - 1) or (tcfg.max_steps is not None
                                                      and trainer.global_step >= tcfg.max_steps)
            if is_distributed():
                torch.distributed.barrier()
            if (epoch + 1) % tcfg.save_every == 0 or stopping:
                trainer.maybe_save_checkpoint(epoch)
                last_saved = epoch
            if is_distributed():
                torch.distributed.barrier()
            val = None
            if (epoch + 1) % tcfg.val_every == 0 or stopping:
                val = trainer.val_epoch(epoch)
            if is_distributed():
                torch.distributed.barrier()
            if last_saved == epoch:
                trainer.maybe_update_best(epoch, val)
            if _is_rank0():
                ep_steps = curves["steps"][first_step:]
                if ep_steps:
                    keys = [k for k in ep_steps[0] if k not in ("step", "epoch", "lr", "tokens", "tokens_per_s")]
                    mean = {k: sum(s[k] for s in ep_steps) / len(ep_steps) for k in keys}
                    tokens = sum(s["tokens"] for s in ep_steps)
                    curves["train_epochs"].append({"epoch": epoch, "step": trainer.global_step, **mean,
                                                   "tokens": tokens})
                if val is not None:
                    curves["val"].append({"epoch": epoch, "step": trainer.global_step,
                                          **_summary(val, tcfg.ttt_steps, "_epoch")})
                atomic.write_json(curves_path, curves)
            if stopping:
                break
        bar.close()
        elapsed = time.perf_counter() - clock["t0"]

    if last_saved is None:
        last_saved = trainer.checkpointer.previous_epoch
    final = save_path / str(last_saved)
    result: dict[str, Any] = {}
    if _is_rank0():
        finalize_checkpoint(final, inp)
        atomic.write_json(curves_path, curves)
        val_first = curves["val"][0] if curves["val"] else {}
        val_last = curves["val"][-1] if curves["val"] else {}
        trained_tokens = clock["tokens"]
        result = {
            "checkpoint": str(final), "curves": str(curves_path), "resolved": asdict(res), "cpu_patch": patched,
            "epochs_done": last_saved + 1, "global_step": trainer.global_step,
            "val_eal_untrained": val_first.get("eal") if val_first.get("epoch") == -1 else None,
            "val_eal": val_last.get("eal"), "val_loss": val_last.get("loss"),
            "val_full_acc": [val_last.get(f"full_acc_{s}") for s in range(tcfg.ttt_steps)],
            "train_eal": curves["train_epochs"][-1]["eal"] if curves["train_epochs"] else None,
            "tokens_per_s": trained_tokens / elapsed if elapsed > 0 and trained_tokens else None,
            "train_seconds": round(elapsed, 2),
        }
        atomic.write_json(draft_dir(rd) / "result.json", result)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The checkpoint: verifier path, vLLM's view of it, reloading
# ---------------------------------------------------------------------------------------------------------------------


def finalize_checkpoint(ckpt: Path, inp: TrainInputs) -> None:
    """Make the checkpoint independent of where the run directory lives.

    config.json's verifier.name_or_path becomes the TARGET folder (what vLLM's eagle3 method treats as the verifier,
    and a full checkpoint speculators can load embed/lm_head/norm from) instead of the run-local stage-04 folder that
    training read. workbook.json records the stage-04 folder relative to the checkpoint for `load_draft`'s fallback.
    """
    from eagle3lib.verifier import point_checkpoint_at_target

    point_checkpoint_at_target(ckpt, inp.model_dir)
    pin_aux_layer_count(ckpt)
    atomic.write_json(ckpt / "workbook.json", {
        "verifier_dir_relative": os.path.relpath(Path(inp.verifier_dir).resolve(), ckpt.resolve()),
        "target_dir": str(Path(inp.model_dir).resolve()),
        "aux_layer_ids": inp.aux_layer_ids, "draft_vocab_size": inp.draft_vocab_size,
    })


def vllm_fc_aux_count(hf: dict[str, Any]) -> int:
    """How many aux layers vLLM's Eagle3 llama draft sizes its fc for (llama_eagle3.py, 0.26 to 0.32): the config's
    num_aux_hidden_states, else eagle_config's layer ids, else 3. The top-level eagle_aux_hidden_state_layer_ids that
    vLLM's own speculators parser writes is NOT read there, so a draft on 1, 2 or 4+ layers fails to load without
    num_aux_hidden_states ("Tried to load weights of size [576, 576] to a parameter of size [576, 1728]")."""
    if hf.get("num_aux_hidden_states"):
        return int(hf["num_aux_hidden_states"])
    return len((hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []) or 3


def pin_aux_layer_count(ckpt: str | Path) -> None:
    """Write num_aux_hidden_states into the checkpoint's transformer_layer_config (which vLLM's parser passes
    through to the draft's config) so vLLM sizes the fc for the layers the draft was trained on."""
    path = Path(ckpt) / "config.json"
    cfg = json.loads(path.read_text())
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        cfg.setdefault("transformer_layer_config", {})["num_aux_hidden_states"] = len(aux)
        atomic.write_json(path, cfg)


def resolve_verifier(ckpt: Path, verifier: str | Path | None = None) -> str:
    """The verifier folder to load a checkpoint with: an explicit one, else config.json's if it exists, else the
    stage-04 folder recorded relative to the checkpoint (the run directory moved and the target with it)."""
    if verifier is not None:
        return str(verifier)
    ckpt = Path(ckpt)
    name = json.loads((ckpt / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    if name and Path(name).is_dir():
        return name
    meta = ckpt / "workbook.json"
    if meta.is_file():
        rel = (ckpt / json.loads(meta.read_text())["verifier_dir_relative"]).resolve()
        if rel.is_dir():
            return str(rel)
    raise WorkbookError(f"the verifier {name!r} named by {ckpt}/config.json does not exist here",
                        "pass verifier=<target folder> to load_draft")


def load_draft(ckpt: str | Path, verifier: str | Path | None = None, attn_impl: str = "sdpa"):
    """Reload a saved draft with speculators (weights, vocab maps, verifier norm/lm_head)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    ckpt = Path(ckpt)
    config = Eagle3SpeculatorConfig.from_pretrained(str(ckpt))
    config.speculators_config.verifier.name_or_path = resolve_verifier(ckpt, verifier)
    config.transformer_layer_config._attn_implementation = attn_impl  # noqa: SLF001 - not serialized by HF
    return Eagle3DraftModel.from_pretrained(str(ckpt), config=config)


def vllm_view(ckpt: str | Path) -> dict[str, Any]:
    """What vLLM's eagle3 loader makes of a checkpoint's config.json, using vLLM's own speculators config parser."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config_dict = json.loads((Path(ckpt) / "config.json").read_text())
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config_dict)))
    spec = SpeculatorsConfig.extract_vllm_speculative_config(config_dict)
    return {"hf": hf, "speculative": spec, "verifier": config_dict["speculators_config"]["verifier"]["name_or_path"]}


def check_vllm_config(ckpt: str | Path, *, hidden_size: int, aux_layer_ids: list[int], draft_vocab_size: int,
                      ttt_steps: int, target_vocab_size: int) -> list[str]:
    """Problems vLLM's eagle3 loader would hit with this checkpoint (empty = loadable as far as config and tensor
    names go): architecture, sizes, aux layer ids, speculative tokens, the verifier path, and the weight names."""
    from safetensors import safe_open

    problems: list[str] = []
    view = vllm_view(ckpt)
    hf, spec = view["hf"], view["speculative"]
    want = {"architectures": ["Eagle3LlamaForCausalLM"], "draft_vocab_size": draft_vocab_size,
            "hidden_size": hidden_size, "eagle_aux_hidden_state_layer_ids": aux_layer_ids,
            "vocab_size": target_vocab_size}
    for key, value in want.items():
        if hf.get(key) != value:
            problems.append(f"{key}: vLLM reads {hf.get(key)!r}, expected {value!r}")
    if vllm_fc_aux_count(hf) != len(aux_layer_ids):
        problems.append(f"vLLM sizes the draft's fc for {vllm_fc_aux_count(hf)} aux layers, the draft has "
                        f"{len(aux_layer_ids)} (num_aux_hidden_states missing: see pin_aux_layer_count)")
    if hf.get("target_hidden_size", hidden_size) != hidden_size:
        problems.append(f"target_hidden_size {hf.get('target_hidden_size')} != {hidden_size}")
    if spec.get("method") != "eagle3" or spec.get("num_speculative_tokens") != ttt_steps:
        problems.append(f"speculative config {spec}, expected eagle3 with {ttt_steps} tokens")
    if not view["verifier"] or not Path(view["verifier"]).is_dir():
        problems.append(f"verifier path {view['verifier']!r} is not a folder here")
    with safe_open(str(Path(ckpt) / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    n_aux = len(aux_layer_ids)
    need = {"fc.weight": (hidden_size, n_aux * hidden_size), "lm_head.weight": (draft_vocab_size, hidden_size),
            "norm.weight": (hidden_size,)}
    if draft_vocab_size != target_vocab_size:
        need |= {"d2t": (draft_vocab_size,), "t2d": (target_vocab_size,)}
    for key, shape in need.items():
        if shapes.get(key) != shape:
            problems.append(f"tensor {key}: {shapes.get(key)} in the checkpoint, vLLM needs {shape}")
    if not any(k.startswith("layers.0.") for k in keys):
        problems.append("no layers.0.* tensors (the draft decoder layer)")
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# Curves
# ---------------------------------------------------------------------------------------------------------------------


def plot_curves(curves: dict[str, Any], path: str | Path | None = None):
    """Three panels: loss per TTT step, full acceptance per TTT step, expected acceptance length (train steps, train
    epoch means, validation incl. the untrained draft at step 0). Saved as PNG when `path` is given."""
    from eagle3lib.plots import figure, save_show

    k = curves["ttt_steps"]
    fig, axes = figure(1, 3, figsize=(15, 4))
    steps, val = curves["steps"], curves["val"]
    xs = [s["step"] for s in steps]
    vx = [v["step"] for v in val]
    for s in range(k):
        color = f"C{s}"
        axes[0].plot(xs, [p[f"loss_{s}"] for p in steps], color=color, alpha=0.35, lw=1)
        axes[0].plot(vx, [v[f"loss_{s}"] for v in val], "o-", color=color, label=f"step {s} (val)")
        axes[1].plot(xs, [p[f"full_acc_{s}"] for p in steps], color=color, alpha=0.35, lw=1)
        axes[1].plot(vx, [v[f"full_acc_{s}"] for v in val], "o-", color=color, label=f"full_acc_{s} (val)")
    axes[2].plot(xs, [p["eal"] for p in steps], color="C7", alpha=0.4, lw=1, label="train (step)")
    ep = curves["train_epochs"]
    axes[2].plot([e["step"] for e in ep], [e["eal"] for e in ep], "s-", color="C0", label="train (epoch mean)")
    axes[2].plot(vx, [v["eal"] for v in val], "o-", color="C3", label="validation")
    titles = ["loss per TTT step (lines: train, dots: val)", "full acceptance per TTT step",
              f"expected acceptance length 1 + Σ full_acc (max {k + 1})"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if path is not None:
        save_show(fig, path)
    return fig


def curves_table(curves: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per validation point: epoch, step, loss, full_acc_s, cond_acc_s, expected acceptance length."""
    k = curves["ttt_steps"]
    rows = []
    for v in curves["val"]:
        row = {"epoch": v["epoch"], "step": v["step"], "loss": round(v["loss"], 4)}
        row |= {f"full_acc_{s}": round(v[f"full_acc_{s}"], 4) for s in range(k)}
        row |= {f"cond_acc_{s}": round(v[f"cond_acc_{s}"], 4) for s in range(k)}
        row["eal"] = round(v["eal"], 4)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Entry point for torchrun / a plain process
# ---------------------------------------------------------------------------------------------------------------------


def stage_outputs(rd: RunDir, result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(outputs, metrics) for stage 05's manifest."""
    outputs = {"checkpoint": Path(result["checkpoint"]), "curves": Path(result["curves"]),
               "figure": rd.figure_path("05", "curves")}
    metrics = {k: result[k] for k in ("val_eal", "val_eal_untrained", "val_loss", "val_full_acc", "train_eal",
                                      "global_step", "epochs_done", "tokens_per_s", "train_seconds")}
    metrics["resolved"] = result["resolved"]
    return outputs, metrics


def launch_command(config: str, run: str | None, overrides: list[str], nproc: int) -> list[str]:
    """The torchrun command notebook 05 runs when train.nproc_per_node > 1."""
    cmd = ["torchrun", f"--nproc-per-node={nproc}", "-m", "eagle3lib.train", "--config", str(config)]
    if run:
        cmd += ["--run-name", run]  # not --run: torchrun reads it as an ambiguous prefix of its --run-path
    for o in overrides:
        cmd += ["-p", o]
    return cmd


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3lib.train` / `torchrun ... -m eagle3lib.train`: stage 05 without the notebook."""
    from eagle3lib.rundir import open_stage

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--run-name", dest="run", default=None,
                   help="run name (not --run: under torchrun that is an ambiguous prefix of torchrun's --run-path)")
    p.add_argument("-p", dest="overrides", action="append", default=[])
    p.add_argument("--no-manifest", action="store_true", help="do not write manifests/05 (the notebook writes it)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if int(os.environ.get("RANK", "0")) == 0:
        stage = open_stage("05", a.config, a.run, a.overrides)
        rd = stage.rd
    else:  # other torchrun ranks: same config, but no racing on open_stage's write probe in the run directory
        from eagle3lib.config import load_config
        from eagle3lib.rundir import REPO_ROOT, run_root

        config = Path(a.config)
        if not config.is_absolute() and not config.exists():
            config = REPO_ROOT / config
        cfg = load_config(config, list(a.overrides) + ([f"run.name={a.run}"] if a.run else []))
        rd = RunDir(run_root(cfg), cfg)
    result = train(rd)
    from speculators.train.distributed import maybe_destroy_distributed

    if result and not a.no_manifest:
        plot_curves(json.loads(Path(result["curves"]).read_text()), rd.figure_path("05", "curves"))
        outputs, metrics = stage_outputs(rd, result)
        stage.finish(outputs=outputs, metrics=metrics)
    maybe_destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Resolved", "TrainInputs", "build_draft", "check_vllm_config", "expected_acceptance_length",
           "inputs_from_run", "load_draft", "make_loaders", "plot_curves", "probe_fused_loss", "resolve_settings",
           "train", "vllm_view"]
