"""An exact greedy chain speculative decoder in PyTorch, and the offline (teacher-forced) acceptance simulation.

Why here and not only in vLLM: it runs anywhere the transformers target runs (no vLLM needed), it is small enough to
read, and it is the reference the other two measures are checked against. Three pieces share one draft computation
(`draft_chain`), so they agree by construction up to floating-point ties:

- `speculative_generate`: the target (transformers, KV cache) verifies k draft tokens per step with ONE forward, the
  longest prefix matching the target's own argmax is accepted plus one bonus token. The output is exactly the
  target's greedy output (tested against `model.generate`); the draft only changes how many target forwards it takes.
- `simulate_acceptance`: the draft run teacher-forced over a sequence whose target hidden states are known (a held-out
  continuation, or validation rows of the stage 02 dataset): every start position at once, no generation.
- `decode_path`: walks the simulated acceptance lengths the way the decoder would (start, accept a, jump a + 1). On
  the target's own greedy continuation it reproduces the decoder's counts: how the tests tie method 2 to method 3.

How speculators' Eagle3DraftModel is driven (read from speculators/models/eagle3/core.py and data.py, 0.9):
- inputs at position i: the target's aux states of token i (ids in `eagle_aux_hidden_state_layer_ids`, each the
  residual stream entering that decoder layer = transformers `hidden_states[id]`), fused [3H] -> fc -> [H], and the
  embedding of the NEXT token x_{i+1}; position id i + 1. Its argmax (draft vocab, mapped with d2t: target id =
  draft id + d2t[draft id]) predicts x_{i+2}. The final (pre-norm) slot of a shard is only the training target.
- step s >= 1 (test-time training chain): input = embedding of the previous step's token and the previous step's
  decoder output (pre-norm, or post-norm with norm_output); it attends to the step-0 keys of positions <= i and to its
  own earlier steps at i (the diagonal blocks of speculators' TTT mask), position id i + 1 + s.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common.decode_walk import decode_path
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.head import greedy_from_final  # the one home of "final norm + lm_head" (stage 02 uses it too)

# --------------------------------------------------------------------------------------------- acceptance counts


@dataclass
class Acceptance:
    """Counters in vLLM's terms: one "draft" = one verification of k proposed tokens for one sequence.

    tau = 1 + accepted / drafts (mean tokens per target forward), per-position rate p = accepted at p / drafts,
    draft acceptance rate = accepted / draft_tokens. Accepted tokens are always a prefix, so the histogram of accepted
    lengths follows from the per-position counts (used for vLLM, which reports only those).
    """

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.per_pos:
            self.per_pos = [0] * self.k

    def add(self, accepted: int, drafted: int | None = None) -> None:
        drafted = self.k if drafted is None else drafted
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        for p in range(accepted):
            self.per_pos[p] += 1

    def merge(self, other: Acceptance) -> None:
        if other.k != self.k:
            raise ValueError(f"cannot merge acceptance counts of k={other.k} into k={self.k}")
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.per_pos = [a + b for a, b in zip(self.per_pos, other.per_pos, strict=True)]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def per_pos_rate(self) -> list[float]:
        return [c / self.drafts if self.drafts else float("nan") for c in self.per_pos]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else float("nan")

    @property
    def length_histogram(self) -> list[int]:
        """How many drafts had 0, 1, ..., k tokens accepted."""
        reach = [self.drafts] + list(self.per_pos) + [0]
        return [reach[j] - reach[j + 1] for j in range(self.k + 1)]

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "per_pos": list(self.per_pos), "tau": round(self.tau, 4),
                "per_pos_rate": [round(r, 4) for r in self.per_pos_rate],
                "draft_acceptance_rate": round(self.draft_acceptance_rate, 4),
                "length_histogram": self.length_histogram}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Acceptance:
        return cls(k=int(d["k"]), drafts=int(d["drafts"]), draft_tokens=int(d["draft_tokens"]),
                   accepted=int(d["accepted"]), per_pos=[int(x) for x in d["per_pos"]])


# ------------------------------------------------------------------------------------------------------ the draft


@dataclass
class Draft:
    """A speculators Eagle3DraftModel ready for inference, with what the decoder needs to know about it."""

    model: Any  # speculators.models.eagle3.Eagle3DraftModel
    layer_ids: list[int]  # aux ids of the target it reads (without the final id N)
    checkpoint: Path

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.fc.weight.dtype

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        d2t = self.model.d2t
        if d2t is None:
            return draft_ids
        return draft_ids + d2t[draft_ids]


def load_draft(checkpoint: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Draft:
    """Load a speculators EAGLE-3 checkpoint for inference with the plain SDPA attention path.

    Why set the attention implementation: checkpoints load with speculators' flex-attention default, which needs
    block masks (and has no CPU backward); inference here passes dense boolean masks, which SDPA takes anywhere.
    """
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise WorkbookError(f"draft checkpoint {checkpoint} has no config.json",
                            "point at the folder stage 05 recorded as 'checkpoint' (a speculators save_pretrained dir)")
    cfg = json.loads((checkpoint / "config.json").read_text())
    if cfg.get("speculators_model_type") != "eagle3":
        raise WorkbookError(f"{checkpoint} is not a speculators EAGLE-3 checkpoint "
                            f"(speculators_model_type={cfg.get('speculators_model_type')!r})",
                            "train one with stage 05, or point at a speculators eagle3 checkpoint")
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(str(checkpoint))
    if model.embed_tokens.weight.isnan().any():  # embeddings not saved: take them from the verifier
        model.load_verifier_weights()
    for module in model.modules():
        conf = getattr(module, "config", None)
        if conf is not None and hasattr(conf, "_attn_implementation"):
            conf._attn_implementation = "sdpa"
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    model = model.to(device=device, dtype=dtype).eval()
    ids = list(model.config.eagle_aux_hidden_state_layer_ids or [])
    return Draft(model=model, layer_ids=ids, checkpoint=checkpoint)


def _run_layers(model: Any, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
    """One pass of the draft's decoder layers over x [1, q, 2H] (first layer) with a dense bool mask [1, 1, q, kv]."""
    pe = model.rotary_emb(x, positions.unsqueeze(0))
    h = x
    for layer in model.layers:
        h = layer(h, attention_mask=mask, position_ids=positions.unsqueeze(0), past_key_values=cache,
                  use_cache=True, position_embeddings=pe)
    return h


def _fuse(model: Any, aux: torch.Tensor) -> torch.Tensor:
    """Fused aux states [m, n_aux*H] -> [m, H], with the optional input norms speculators applies before fc."""
    if model.input_norm is not None:
        aux = model.input_norm(aux)
    if model.fc_norm is not None:
        chunks = aux.chunk(len(model.fc_norm), dim=-1)
        aux = torch.cat([norm(c) for norm, c in zip(model.fc_norm, chunks, strict=True)], dim=-1)
    return model.fc(aux)


def _logits(model: Any, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the state carried to the next chain step), as speculators' forward does with and without norm_output."""
    if model.config.norm_output:
        h = model.norm(h)
        return model.lm_head(h), h
    return model.lm_head(model.norm(h)), h


@torch.inference_mode()
def draft_chain(draft: Draft, aux: torch.Tensor, next_tokens: torch.Tensor, k: int,
                starts: torch.Tensor | None = None, teacher: torch.Tensor | None = None) -> torch.Tensor:
    """k greedy draft tokens (target ids) from each start position, all starts in one batched pass per step.

    aux [m, n_aux*H]: the target's aux states of tokens x_0..x_{m-1}; next_tokens [m]: x_1..x_m (target ids).
    starts [q]: positions i whose chain is wanted (default: the last, m - 1): the draft then proposes x_{i+2}, ...
    teacher [>= m + k]: the sequence's own tokens, fed into chain step s at i (token x_{i+1+s}) instead of the draft's
    previous guess (teacher forcing, like speculators' training). Acceptance needs every earlier step right, so on
    the target's greedy continuation both give the same accepted lengths. Returns [q, k] target token ids.
    """
    from transformers import DynamicCache

    model = draft.model
    dev, dt = draft.device, draft.dtype
    m = aux.shape[0]
    starts = torch.tensor([m - 1], device=dev) if starts is None else starts.to(dev)
    q = starts.shape[0]
    cache = DynamicCache()
    h = _fuse(model, aux.to(device=dev, dtype=dt)).unsqueeze(0)  # [1, m, H]
    emb = model.embed_tokens(next_tokens.to(dev).unsqueeze(0)).to(dt)
    positions = torch.arange(1, m + 1, device=dev)
    causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril().view(1, 1, m, m)
    out = _run_layers(model, torch.cat([emb, h], dim=-1), positions, causal, cache)[:, starts]
    logits, carry = _logits(model, out)
    preds = [draft.to_target_ids(logits.argmax(-1)[0])]
    block0 = torch.arange(m, device=dev).view(1, m) <= starts.view(q, 1)  # [q, m]
    eye = torch.eye(q, dtype=torch.bool, device=dev)
    for s in range(1, k):
        if teacher is not None:
            idx = (starts + 1 + s).clamp(max=teacher.shape[0] - 1)
            tok = teacher.to(dev)[idx]
        else:
            tok = preds[-1]
        x = torch.cat([model.embed_tokens(tok.unsqueeze(0)).to(dt), carry], dim=-1)
        mask = torch.cat([block0] + [eye] * s, dim=1).view(1, 1, q, m + s * q)
        out = _run_layers(model, x, starts + 1 + s, mask, cache)
        logits, carry = _logits(model, out)
        preds.append(draft.to_target_ids(logits.argmax(-1)[0]))
    return torch.stack(preds, dim=1)


# ----------------------------------------------------------------------------------------------------- the target


def aux_states(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """transformers `hidden_states` tuple -> fused aux states [B, T, n_aux*H] (id k = hidden_states[k])."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


@dataclass
class GenerationResult:
    """One prompt's speculative generation: the output tokens and the counts of that run."""

    prompt_ids: list[int]
    output_ids: list[int]  # truncated to max_new_tokens (what model.generate would return after the prompt)
    verified_ids: list[int]  # every token the target verified, also past max_new_tokens (for the offline replay)
    acceptance: Acceptance
    target_forwards: int
    seconds: float


@torch.inference_mode()
def speculative_generate(target: Any, draft: Draft, prompt_ids: Sequence[int], k: int, max_new_tokens: int,
                         eos_token_id: int | Sequence[int] | None = None) -> GenerationResult:
    """Greedy chain speculative decoding of one prompt: exactly the target's greedy output, fewer target forwards.

    The target keeps a KV cache; each round it verifies [last token, d_1..d_k] in one forward, keeps the longest
    prefix of d equal to its own argmax, adds its argmax after that prefix (the bonus token) and crops the cache to
    what it accepted. The draft recomputes its step 0 over the whole context each round (it is one layer; no cache
    bookkeeping to get wrong). Accepted tokens at or after an EOS are not counted: generation ends there.
    """
    from transformers import DynamicCache

    t0 = time.perf_counter()
    dev = next(target.parameters()).device
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    ids = list(prompt_ids)
    n = len(ids)
    cache = DynamicCache()
    out = target(input_ids=torch.tensor([ids], device=dev), past_key_values=cache, use_cache=True,
                 output_hidden_states=True)
    aux = aux_states(out.hidden_states, draft.layer_ids)[0]  # states of tokens 0..n-1
    ids.append(int(out.logits[0, -1].argmax()))
    forwards = 1
    acc = Acceptance(k)
    while len(ids) - n < max_new_tokens and ids[-1] not in eos:
        tokens = torch.tensor(ids, device=dev)
        proposal = draft_chain(draft, aux, tokens[1:], k)[0].tolist()
        verify = torch.tensor([[ids[-1], *proposal]], device=dev)
        out = target(input_ids=verify, past_key_values=cache, use_cache=True, output_hidden_states=True)
        forwards += 1
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[j] = the target's token after verify[j]
        a = 0
        while a < k and proposal[a] == greedy[a]:
            a += 1
        new = proposal[:a] + [greedy[a]]
        for j, tok in enumerate(new):  # generation ends at the first EOS: nothing after it is kept or counted
            if tok in eos:
                new = new[: j + 1]
                a = min(a, j + 1)
                break
        acc.add(a)
        new_aux = aux_states(out.hidden_states, draft.layer_ids)[0]
        aux = torch.cat([aux, new_aux[: a + 1]], dim=0)  # states of the last token and the accepted drafts
        ids.extend(new)
        if k > a:
            cache.crop(-(k - a))  # drop the rejected drafts' keys/values
    gen = ids[n:]
    return GenerationResult(prompt_ids=list(prompt_ids), output_ids=gen[:max_new_tokens], verified_ids=gen,
                            acceptance=acc, target_forwards=forwards, seconds=time.perf_counter() - t0)


@torch.inference_mode()
def greedy_generate(target: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | None = None) -> tuple[list[int], float]:
    """The target alone, greedy, batch 1 (the baseline the decoder's speed and output are compared with)."""
    dev = next(target.parameters()).device
    t0 = time.perf_counter()
    pad = eos_token_id if isinstance(eos_token_id, int) else None
    out = target.generate(torch.tensor([list(prompt_ids)], device=dev), do_sample=False, num_beams=1,
                          max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad,
                          temperature=None, top_p=None, top_k=None, repetition_penalty=None)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


@torch.inference_mode()
def first_divergence(target: Any, prompt_ids: Sequence[int], reference: Sequence[int],
                     other: Sequence[int]) -> dict[str, Any] | None:
    """Where two greedy outputs of the same prompt first differ, and whether the target's logits there are a rounding
    tie: None when they are equal.

    Why: in bf16 the decoder's verify forward (k+1 tokens) rounds differently from generate()'s one-token forward, so
    a near-tie between the two best tokens can flip, and from there the outputs go their own ways (measured on
    SmolLM2 in bf16 on the CPU: 6 of 8 outputs differed, each first at a logit gap of 0 or 1 bf16 step between the
    two best tokens). A decoder bug instead shows as a token the target does not rank near the top. One target forward
    over the shared prefix tells the two apart: `tie` is true when both tokens are within `tolerance` of the top logit:
    8 rounding steps of the weights' dtype at that magnitude (bf16: 1.0 at 16-32; the two forwards round differently
    in every layer, not only the last: seen up to 2 steps), or 1% of the logit in float32, whose steps are tiny.
    """
    d = next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b), None)
    if d is None:
        if len(reference) == len(other):
            return None
        d = min(len(reference), len(other))  # one ended (EOS) where the other went on
    weight = next(target.parameters())
    logits = target(input_ids=torch.tensor([[*prompt_ids, *reference[:d]]], device=weight.device)).logits[0, -1].float()
    top = float(logits.max())
    step = torch.finfo(weight.dtype).eps * 2.0 ** math.floor(math.log2(abs(top) or 1.0))
    tolerance = max(8 * step, 1e-2 * abs(top))
    tokens = [reference[d] if d < len(reference) else None, other[d] if d < len(other) else None]
    gaps = [top - float(logits[t]) if t is not None else None for t in tokens]
    return {"position": d, "tokens": tokens, "gaps_to_top": [round(g, 5) if g is not None else None for g in gaps],
            "tolerance": tolerance, "tie": all(g is not None and g <= tolerance for g in gaps)}


# ------------------------------------------------------------------------------------- offline (teacher-forced)


@torch.inference_mode()
def target_aux_for(target: Any, token_ids: Sequence[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """Fused aux states [T, n_aux*H] of a whole sequence from one target forward (for replaying a continuation)."""
    dev = next(target.parameters()).device
    out = target(input_ids=torch.tensor([list(token_ids)], device=dev), output_hidden_states=True)
    return aux_states(out.hidden_states, layer_ids)[0]


def accepted_lengths(draft: Draft, aux: torch.Tensor, tokens: torch.Tensor, greedy_next: torch.Tensor, k: int,
                     starts: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Accepted length (0..k) of a draft started at each position in `starts`, teacher-forced, no generation.

    tokens [L]: the sequence; aux [L, n_aux*H] its target aux states; greedy_next [L]: the target's argmax after
    position j (-1 where unknown, which counts as a rejection). A draft from start i proposes tokens for positions
    i+2 .. i+1+k; step s is right when it equals greedy_next[i+1+s], and counts only when every earlier step was.
    """
    L = tokens.shape[0]
    teacher = torch.cat([tokens, tokens.new_zeros(k + 1)])
    target_at = torch.cat([greedy_next, greedy_next.new_full((k + 1,), -1)])
    out = []
    for c in range(0, starts.shape[0], chunk):
        st = starts[c: c + chunk]
        preds = draft_chain(draft, aux[: L - 1], tokens[1:], k, starts=st, teacher=teacher).cpu()
        want = target_at[(st.cpu().view(-1, 1) + 1 + torch.arange(k).view(1, -1))]
        ok = (preds == want) & (want >= 0)
        out.append(ok.long().cumprod(dim=1).sum(dim=1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def simulate_continuation(draft: Draft, aux: torch.Tensor, tokens: Sequence[int], prompt_len: int,
                          ks: Sequence[int]) -> dict[int, dict[str, Acceptance]]:
    """Offline acceptance on a target-greedy continuation (prompt + verified tokens), for each k.

    'all': every start position in the continuation (more samples, but biased upwards: acceptance comes in runs and
    the decoder skips the starts inside an accepted run, so it visits hard positions more often); 'path': only the
    starts the decoder visits (equal to the embedded decoder's counts up to float ties). The continuation is greedy, so the
    target's argmax after position j is simply token j+1; beyond the end it is unknown.
    """
    t = torch.tensor(list(tokens), dtype=torch.long)
    L = t.shape[0]
    greedy_next = torch.full((L,), -1, dtype=torch.long)
    greedy_next[prompt_len - 1: L - 1] = t[prompt_len:]
    starts = torch.arange(prompt_len - 1, L - 1)
    res: dict[int, dict[str, Acceptance]] = {}
    kmax = max(ks)
    lengths = accepted_lengths(draft, aux, t, greedy_next, kmax, starts) if starts.numel() else torch.zeros(0)
    # accepted length with k' <= kmax is min(length with kmax, k'): one chain of kmax steps serves every k
    for k in ks:
        by_start = {int(s): min(int(a), k) for s, a in zip(starts.tolist(), lengths.tolist(), strict=True)}
        everywhere, path = Acceptance(k), Acceptance(k)
        for s, a in by_start.items():
            if s + 1 + k <= L - 1:  # every step of this draft lies inside the continuation
                everywhere.add(a)
        for _, a in decode_path(by_start, prompt_len - 1, L - 1):
            path.add(a)
        res[k] = {"all": everywhere, "path": path}
    return res


def simulate_rows(draft: Draft, rows: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  head: tuple[torch.Tensor, torch.Tensor, float], ks: Sequence[int],
                  progress: Callable[[int], None] | None = None) -> dict[int, Acceptance]:
    """Offline acceptance over stored rows (input_ids [T], loss_mask [T], hidden_states [T, n_aux+1, H]).

    Every start i whose first proposed token x_{i+2}... is a loss-masked (assistant) token is counted, teacher-forced
    on the row's tokens, compared with the target's argmax computed from the row's final slot.
    """
    kmax = max(ks)
    out = {k: Acceptance(k) for k in ks}
    for ids, mask, hs in rows:
        L = ids.shape[0]
        aux = hs[:, :-1].flatten(1)
        greedy_next = greedy_from_final(hs[:, -1], head).cpu()
        starts = torch.nonzero(mask[1:].bool()).flatten()  # x_{i+1} is an assistant token -> start i
        starts = starts[starts + 1 < L - 1]
        if starts.numel():
            lengths = accepted_lengths(draft, aux, ids, greedy_next, kmax, starts)
            for k in ks:
                for s, a in zip(starts.tolist(), lengths.tolist(), strict=True):
                    if s + 1 + k <= L - 1:
                        out[k].add(min(int(a), k))
        if progress:
            progress(L)
    return out
