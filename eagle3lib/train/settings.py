"""What 'auto' means for stage 05 on this machine: attention, loss, dtype, optimizer, data loader workers, with the
reasons.

sdpa attention + eager loss + fp32 on the CPU; on a GPU flex attention + bf16 autocast, and the fused (Triton) loss
only when a quick behavioural probe passes (on torch 2.11 it fails inside dynamo, docs/gpu.md#fused-loss-on-the-h200;
we then log why and use the eager loss). The device and the bf16/fp32 rule are eagle3lib.common.device's, shared with
stages 02 and 06.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from eagle3lib.common.config import TrainSection
from eagle3lib.common.device import auto_device, dtype_name
from eagle3lib.common.errors import WorkbookError

log = logging.getLogger("eagle3lib.train")

ATTN_NAMES = {"sdpa": "sdpa", "flex_attention": "simple_flex_attention"}


@dataclass
class Resolved:
    """The concrete settings a run uses, with the reason for each automatic choice (shown in the notebook)."""

    device: str  # "cpu" | "cuda"
    attn_impl: str  # speculators' name: sdpa | simple_flex_attention
    loss_implementation: str  # eager | fused
    hidden_states_dtype: str  # float32 | bfloat16 (dataloader dtype and autocast dtype)
    num_workers: int = 0  # data loader worker processes
    optimizer: str = "adamw"  # speculators' name: adamw | muon
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
        # torch.compile's messages open with the cause ("backend='inductor' raised:" then it), then "from user
        # code:" and advice lines ("Set TORCHDYNAMO_VERBOSE=1 ..."): keep the opening (a reason line made of the
        # advice alone says nothing of the cause)
        head = str(e).strip().split("\nfrom user code:")[0].split("\nSet TORCHDYNAMO")[0]
        lines = [ln.strip() for ln in head.splitlines() if ln.strip()]
        msg = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
        return False, f"fused loss failed under torch.compile: {e.__class__.__name__}: {msg[:200]}"
    if not torch.allclose(loss, ref_loss, rtol=1e-3, atol=1e-4) or not torch.allclose(grad, ref_grad, rtol=1e-2,
                                                                                        atol=1e-5):
        return False, f"fused loss disagrees with eager ({loss.item():.6f} vs {ref_loss.item():.6f})"
    return True, "fused loss matches the eager loss under torch.compile"


def resolve_settings(tcfg: TrainSection, device: str | None = None) -> Resolved:
    """Turn the config's 'auto' values into concrete ones for this machine (`device` None: eagle3lib.common.device's)."""
    device = auto_device(device or "auto")
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
    dtype = dtype_name(tcfg.dtype, device)
    if tcfg.dtype == "auto":
        reasons.append(f"dtype {dtype}: " + ("bf16 autocast on GPU" if device == "cuda"
                                             else "bf16 is slower than fp32 on CPUs without AMX"))
    optimizer = tcfg.optimizer
    if optimizer == "auto":
        optimizer = "muon" if device == "cuda" else "adamw"
        reasons.append(f"optimizer {optimizer}: " + ("speculators' CLI default" if device == "cuda" else
                                                     "torch's Muon orthogonalizes in bf16, ~13x slower steps on a CPU"))
    # why each mode that gets its states in stage 05 reads them in the training process
    in_process = {"online": ("the target computes each batch's states in the training process, on the training "
                             "device, and a worker process would need a copy of the target of its own"),
                  "spool": ("the training process keeps the spool's ledger: it asks the producer for each batch's rows "
                            "and deletes their states once the batch is built, which a worker process would do out "
                            "of its sight")}.get(tcfg.hidden_states)
    if tcfg.num_workers == "auto":
        workers = 0 if device == "cpu" or in_process else min(8, max(1, (os.cpu_count() or 2) // 2))
        reasons.append(f"{workers} data loader workers: " + (
            f"{tcfg.hidden_states} hidden states: {in_process}" if in_process
            else "the CPU trains, no spare cores" if device == "cpu" else "shards are read and packed in parallel"))
    else:
        workers = int(tcfg.num_workers)
        if in_process and workers > 0:
            raise WorkbookError(
                f"train.hidden_states: {tcfg.hidden_states} needs train.num_workers 0, got {workers}: {in_process}",
                "set train.num_workers: auto (or 0), or train.hidden_states: offline")
    for r in reasons:
        log.info("auto: %s", r)
    return Resolved(device, attn, loss_impl, dtype, num_workers=workers, optimizer=optimizer, reasons=reasons)
