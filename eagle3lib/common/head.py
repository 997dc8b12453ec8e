"""The target's head applied to a stored pre-norm final state: final RMSNorm, then lm_head.

Why one module below the stages: stage 02's capture probe (eagle3lib.extract.probe) checks the captured final slot
against the engine's own next-token distribution through this head, and stage 06's offline acceptance
(eagle3lib.evaluate.decoder) takes the target's argmax from it. Both must apply the same rule, and stage 02 must not
import stage 06 to get it. The tensors come from `eagle3lib.verifier.read_head` (stage 04's verifier folder) or
`eagle3lib.common.checkpoint_head.read_checkpoint_head` (straight from the checkpoint).

The rule is RMSNorm (x * rsqrt(mean(x^2) + eps) * weight) then lm_head, in float32: what Llama, Qwen, Mistral and
DeepSeek do, and what speculators applies to `verifier_last_hidden_states`. A target whose head differs (Gemma's
(1 + weight) norm, logit soft-capping or scaling) is not computed right by it, here or in speculators.
"""

from __future__ import annotations

import torch

Head = tuple[torch.Tensor, torch.Tensor, float]  # (final norm weight [H], lm_head weight [V, H], rms eps)


def final_norm(final: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of pre-norm final states [..., H] in float32."""
    x = final.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()


def final_logits(final: torch.Tensor, head: Head, chunk: int = 32768, in_head_dtype: bool = False) -> torch.Tensor:
    """float32 logits [..., V] of pre-norm final states [..., H]. The lm_head is converted to float32 a chunk of
    `chunk` vocabulary rows at a time, so a bf16 head of a large vocabulary is never copied whole. `in_head_dtype`:
    the normed states are rounded to a 16-bit head's own dtype and multiplied in it (float32 accumulation), as a
    16-bit engine computes its logits: no conversion of the head at all (what the capture probe does on AMX CPUs)."""
    norm_w, lm_head, eps = head
    x = final_norm(final, norm_w, eps)
    if lm_head.dtype == torch.float32:
        return x @ lm_head.T
    if in_head_dtype:
        return (x.to(lm_head.dtype) @ lm_head.T).float()
    return torch.cat([x @ lm_head[i:i + chunk].float().T for i in range(0, lm_head.shape[0], chunk)], dim=-1)


def greedy_from_final(final: torch.Tensor, head: Head) -> torch.Tensor:
    """The target's argmax after each position from its pre-norm final states [T, H] (RMSNorm, then lm_head).

    `head` = (final norm weight, lm_head weight, rms eps): `eagle3lib.verifier.read_head` of stage 04's folder. The
    final slot of a shard is the pre-norm output, so argmax(lm_head(rmsnorm(final))) is the target's own argmax.
    """
    return final_logits(final, head).argmax(-1)
