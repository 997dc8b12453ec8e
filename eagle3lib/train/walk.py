"""Validation τ by walking the replies as a decoder would: what served τ the validation rows predict.

Why: validation EAL (1 + Σ_s full_acc_s, speculators' metric) averages the accepted chain over EVERY position of the
replies, but speculative decoding only starts a draft at the position after the last one it verified: a stretch the
draft knows is crossed in few steps, a stretch it does not know takes a step a token. τ = tokens / steps therefore
weighs the hard stretches more than the uniform mean does. With half the tokens in chains of 4 and half in chains of
1 the uniform mean is 2.5, a decode takes N/8 + N/2 steps: τ 1.6. On the 1.5B recipe validation EAL read 2.006
where `vllm serve` measured τ 1.514 on held-out prompts and its position-0 rate 0.32 against validation's 0.54
(docs/stages.md#05-training-the-draft-05_train_draft-eagle3libtrain).

How: `WalkRecorder` wraps the draft's forward during a validation pass (the outer call: speculators compiles the
forward itself on a GPU, and a wrapper outside it changes nothing inside it). For each batch it recomputes the
verifier's targets as speculators' forward does (its frozen norm and draft-vocabulary lm_head on the batch's final
states, under the same autocast), takes the draft's own argmax per TTT step (`draft_tokens`), and rebuilds
speculators' chain of correctness per anchor exactly as `speculators.models.eagle3.metrics` aligns it (step s at
anchor p predicts the target at p + s; the chain starts from the loss mask). Then `walk` steps through each reply
(a run of loss-mask positions): from anchor p it moves 1 + (steps correct from p) positions, at most to the reply's
end. τ_walk = tokens / steps. The uniform mean of 1 + chain over the same anchors is validation EAL again (a check
that the chains are speculators' own: tests/unit/test_train.py compares both with speculators' full_acc). Stage
06's offline method walks the same way on held-out continuations (`eagle3lib.evaluate.decoder`: its 'path' against
its 'all' counts; on validation rows it counts every start) over the workbook's own replay of the draft; this one
reads the trained forward itself, at every validation of stage 05.
One process only: under torchrun (several ranks, sharded weights) nothing is recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3lib.common.decode_walk import decode_path


def walk(chain: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(tokens, steps) of decoding every reply in `mask` (1-D bool: the loss positions; a reply is a run of them)
    where a draft started at anchor p is accepted for chain[p] tokens (1-D ints, 0..k): each step moves
    1 + chain[p] positions, never past the reply's end (the decoder's own walk: `common.decode_walk.decode_path`)."""
    m = mask.to(torch.int8).tolist()
    c = chain.tolist()
    tokens = steps = 0
    n = len(m)
    p = 0
    while p < n:
        if not m[p]:
            p += 1
            continue
        end = p
        while end < n and m[end]:
            end += 1
        tokens += end - p
        steps += len(decode_path({q: min(int(c[q]), end - q - 1) for q in range(p, end)}, p, end + 1))
        p = end
    return tokens, steps


def chains(draft_tokens: list[torch.Tensor], targets: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per anchor p (1-D over the packed row): how many of the TTT steps 0.. were right in a row, as speculators
    counts them (`compute_accuracy_single_step` after `align_for_step`): step s's argmax at p against the targets'
    argmax at p + s, the chain starting True on the loss mask."""
    target_ids = targets.argmax(dim=-1)[0]
    prev = loss_mask[0].to(torch.bool).clone()
    total = torch.zeros_like(prev, dtype=torch.int64)
    n = prev.shape[0]
    for s, pred in enumerate(draft_tokens):
        p = pred[0]
        ok = torch.zeros_like(prev)
        ok[: n - s] = p[: n - s] == target_ids[s:]
        if s:
            ok[n - s:] = prev[n - s:]  # no target there: speculators leaves these anchors as they were
        prev &= ok
        total += prev.to(torch.int64)
    return total


class WalkRecorder:
    """`with WalkRecorder(model) as rec: trainer.val_epoch(...)`, then `rec.metrics()`: τ_walk and the uniform mean
    over the same anchors, from every validation batch the model saw inside the block."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.tokens = self.steps = self.anchors = self.chain_sum = 0
        self._patched = False
        self._own_forward = None  # a forward the instance itself held before (restored on exit)

    def __enter__(self) -> WalkRecorder:
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            return self  # several ranks, weights possibly sharded: not recorded (module docstring)
        self._own_forward = vars(self.model).get("forward")
        original = self.model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self._record(kwargs, out)
            return out

        self.model.forward = forward
        self._patched = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._patched:
            return
        if self._own_forward is not None:
            self.model.forward = self._own_forward
        else:
            del self.model.forward
        self._patched = False

    @torch.no_grad()
    def _record(self, batch: dict[str, Any], out: Any) -> None:
        last = batch.get("verifier_last_hidden_states")
        mask = batch.get("loss_mask")
        if last is None or mask is None or not isinstance(out, tuple) or not out or not out[0]:
            return
        model = self.model
        targets = model.verifier_lm_head(model.verifier_norm(last))
        chain = chains(out[0], targets, mask).cpu()
        m = mask[0].to(torch.bool).cpu()
        tokens, steps = walk(chain, m)
        self.tokens += tokens
        self.steps += steps
        self.anchors += int(m.sum())
        self.chain_sum += int(chain[m].sum())

    def metrics(self) -> dict[str, float]:
        """{"tau_walk", "eal_uniform", "walk_tokens", "walk_steps"}; {} where no batch was recorded."""
        if not self.steps:
            return {}
        return {"tau_walk": self.tokens / self.steps, "eal_uniform": 1 + self.chain_sum / max(self.anchors, 1),
                "walk_tokens": self.tokens, "walk_steps": self.steps}
