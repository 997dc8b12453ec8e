"""The capture probe's judgement (eagle3lib.extract.probe runs the rows; this module judges what came back): what
is measured, the tolerances, the checks, and the one error a failure raises.

- Final state, at any scale. The captured final slot (the last layer's output before the final norm), through the
  target's final norm and lm_head read from the checkpoint without loading the model (eagle3lib.common.head; the tensors from
  eagle3lib.common.checkpoint_head), must reproduce the engine's own next-token distribution on the same tokens: vLLM's logprobs
  from the same engine and the same forwards (prompt logprobs for the first, longest row, compared at up to 256
  evenly spaced positions; the sampled token's logprobs for the others, because a request asking for prompt
  logprobs never reads the prefix cache and the others must run as the extraction will), transformers' logits of
  the same loaded model. Measured: top-1 agreement (a different argmax counts as agreeing only at a tie of the
  engine's own distribution) and the mean |logprob error| of the engine's top-k tokens. The engine computing a wrong
  function (the rotary op) is self-consistent: only a second path sees it.
- Layers, where a second, independent path runs: transformers' own `output_hidden_states` of that forward (the
  transformers backend); the capture worker's hooks on the native engine, beside its connector, in the same forwards;
  a transformers load of the target on the CPU (vLLM backends; auto when the checkpoint is at most 4 GB, or
  `extract.probe: always`). The second path captures each configured id and its neighbours, so a slot is checked to
  hold ITS layer (mean cosine within tolerance, and closer to it than to any neighbour or other id): that names an
  off-by-one or a swapped slot instead of only saying "different". Where none runs, the report says so.
- Structure: every row comes back with as many states as tokens and the slots configured (the engine's logprobs too);
  a states file holds the row's token ids; every state is finite and no slot is all zero; no slot duplicates another;
  the slot of id 0 is the checkpoint's embedding of the row's tokens (cosine, so a scaled embedding passes); the final
  slot is not post-norm. Why that last test and not "norms grow with depth": residual-stream norms do not grow
  monotonically in every model (late layers can shrink them, massive activations sit in a few tokens), so an ordering
  rule would fail correct captures. A post-norm state y = w * x / rms(x) instead has an exact signature: y / w has
  RMS 1 on every token (the post-norm magnitude is about sqrt(H) * rms(w)), which a pre-norm state matches only by
  accident on every token at once. That also catches a post-norm final state where the final-state check cannot:
  with the norm weight all ones (random test models) the norm applied twice equals the norm applied once.

A failure is one WorkbookError (`failure`) naming the check, the slot and layer id, the row, the measured numbers
against the tolerance and the likely causes (`CAUSES`). Tolerances depend on the coarser of the engine's compute dtype
and the storage dtype (`TOLERANCES`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3lib.common.errors import WorkbookError

TOP_K = 5  # engine logprobs asked for per position (vLLM's max_logprobs default is 20)
POSITIONS_PER_ROW = 64  # positions per row whose next-token distribution is compared (evenly spaced, last included)
FIRST_ROW_POSITIONS = 256  # ... of the row the engine gives prompt logprobs for (every position: `compared`)


@dataclass(frozen=True)
class Tolerance:
    """Where a correct capture passes with room and a wrong one fails by far. Measured on the CPU (tests/unit): a
    correct fp32 capture reproduces vLLM's logprobs to 7e-6 nats mean (transformers': 0) with top-1 1.000 and every
    slot at cos >= 0.999999 to its layer; bf16 storage (fp32 compute) gives 0.0085 nats, cos 0.999997. The planted
    faults gave top-1 0.00-0.15 and errors of 4-28 nats, or cosines of -0.05 to 0.80 to the configured layer. Not
    measured here: bf16 COMPUTE (a GPU) against an fp32 CPU reference, which the 16-bit cosine limits leave room for.
    Neighbouring layers can be as close as cos 0.98 (SmolLM2), so an off-by-one is caught by the "closer to another
    layer" rule, not by these limits."""

    top1: float  # share of compared positions whose argmax agrees with the engine's (or ties in it)
    tie: float  # nats: the engine's own logprobs of its argmax and of ours this close = a tie, not a disagreement
    logprob: float  # mean |our logprob - the engine's| over its top-k tokens, nats
    cos_mean: float  # a slot against its layer in a second path: mean cosine over tokens
    cos_min: float  # ... and the lowest token
    embed_cos: float  # the slot of id 0 against the checkpoint's embedding: lowest token
    post_norm: float  # the final slot is post-norm when median |rms(y / w) - 1| over tokens is below this
    head_16_bit: bool  # the head may be applied in its own 16-bit dtype (as a 16-bit engine does) on an AMX CPU


TOLERANCES = {
    "float32": Tolerance(top1=0.99, tie=1e-3, logprob=0.01, cos_mean=0.9999, cos_min=0.999, embed_cos=0.9999,
                         post_norm=0.01, head_16_bit=False),
    # bf16/fp16: the states are rounded to 8 (11) mantissa bits, the engine's logits computed from bf16 activations
    "16-bit": Tolerance(top1=0.9, tie=0.1, logprob=0.1, cos_mean=0.99, cos_min=0.9, embed_cos=0.99, post_norm=0.01,
                        head_16_bit=True),
}

# Likely causes, by check (named in the one error message).
CAUSES = {
    "lengths": "prefix caching on (a cached prefix is never computed, so it has no state: vllm#44485), chunked "
               "prefill or a preempted request splitting a prompt, a wrapper that drops or pads tokens",
    "token ids": "requests and captures out of step (rows reordered, a stale spool file), prefix caching",
    "finite": "a hook that did not fire (a compiled model: capture engines run eager), fp16 overflow",
    "duplicate": "a layer id listed twice, one hook writing two slots, a wrapper that repeats a slot",
    "post-norm": "the final state taken AFTER the final norm (transformers' last hidden_states entry, a hook on the "
                 "norm's output): the final slot must be the last decoder layer's output before it",
    "embedding": "layer ids off by one or slots in the wrong order (id 0 is the token embedding), states not "
                 "aligned with the row's tokens",
    "final state": "the final slot is not the last layer's pre-norm output: layer ids off by one (vllm#43671), the "
                   "final-layer state dropped (vllm#46973), taken after the norm, the residual left out (out[0] "
                   "instead of out[0] + out[1]), slots in the wrong order, chunked prefill (vllm#52909) or prefix "
                   "caching (vllm#44485); or the target's head is not RMSNorm then lm_head (Gemma's 1 + weight, "
                   "soft-capping), which the probe and speculators both assume",
    "layer": "slots in the wrong order or layer ids off by one (when the slot matches another layer), the residual "
             "left out (out[0] alone: cos -0.28), vLLM's CPU rotary op on MLA (cos 0.5-0.7: "
             "docs/cpu.md#the-cpu-rotary-bug), a multimodal wrapper whose hooked layers are not the language "
             "model's, chunked prefill (vllm#52909)",
}
# The first failing check in this order is the one the message names: the most specific first (a slot matching
# another layer explains a failing embedding or final-state check, not the other way round).
ORDER = ["lengths", "token ids", "finite", "duplicate", "layer identity", "post-norm", "embedding", "final state",
         "layer"]


def positions(length: int, n: int = POSITIONS_PER_ROW) -> list[int]:
    """Up to n positions of a row, evenly spaced, the first and the last included."""
    if length <= n:
        return list(range(length))
    return sorted({round(j * (length - 1) / (n - 1)) for j in range(n)})


def tolerance_class(compute: str, storage: str) -> str:
    return "float32" if compute == "float32" and storage == "float32" else "16-bit"


# --------------------------------------------------------------------------------------------- what is measured
@dataclass
class EngineDist:
    """The engine's next-token distribution after some positions of one row: top-k ids and logprobs, best first."""

    positions: list[int]
    ids: torch.Tensor  # [P, k] int64
    logprobs: torch.Tensor  # [P, k] float32


@dataclass
class SecondPath:
    name: str
    layer_ids: list[int]
    states: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [T', len(layer_ids), H]
    note: str = ""


@dataclass
class Observed:
    """Everything the probe read from the backend and the checkpoint, before any judgement."""

    rows: list[tuple[int, list[int]]]
    states: dict[int, torch.Tensor]  # row -> [T, n_slots, H] (storage dtype), through the backend's real capture path
    file_ids: dict[int, list[int]]  # row -> token ids a states file held (backends that hand files on)
    engine: dict[int, EngineDist]
    engine_name: str
    paths: list[SecondPath]
    head: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None  # embed, norm, lm_head, eps
    notes: list[str]
    seconds: dict[str, float] = field(default_factory=dict)  # where the probe's time went, by phase
    head_reading: Future | None = None  # the head being read on a thread (`complete` waits for it)
    cpu_reference_ids: list[int] | None = None  # ids a transformers load on the CPU still captures (`complete`)
    # what the backend handed back, read by `complete` off the extraction's path: row -> states file or tensor (a
    # kept row's file is read, not deleted), row -> vLLM request output (its logprobs)
    captured: dict[int, Any] = field(default_factory=dict)
    kept_rows: frozenset[int] = frozenset()
    outputs: dict[int, Any] = field(default_factory=dict)


@dataclass
class Check:
    check: str
    ok: bool
    detail: str
    slot: int | None = None
    layer_id: int | None = None
    row: int | None = None
    measured: dict[str, Any] = field(default_factory=dict)
    tolerance: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------- judging
def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12)


def check_structure(obs: Observed, layer_ids: list[int], hidden: int, tol: Tolerance) -> list[Check]:
    """Lengths, token ids, finite and non-zero slots, no duplicated slot, the post-norm signature of the final slot,
    id 0 = the embedding (see the module docstring for why these and not an ordering of norms)."""
    out: list[Check] = []
    n_slots = len(layer_ids)
    bad = []
    for r, t in obs.rows:
        s = obs.states.get(r)
        if s is None:
            bad.append(f"row {r}: no states came back")
        elif s.dim() != 3 or list(s.shape) != [len(t), n_slots, hidden]:
            bad.append(f"row {r}: states {list(s.shape)} for {len(t)} tokens (expected [{len(t)}, {n_slots}, "
                       f"{hidden}])")
        dist = obs.engine.get(r)
        if obs.rows[0][0] == r and dist is not None and obs.engine_name.startswith("vLLM") \
                and len(dist.positions) != len(t):
            bad.append(f"row {r}: the engine's logprobs cover {len(dist.positions)} of {len(t)} positions")
    out.append(Check("lengths", not bad, "; ".join(bad) or f"{len(obs.rows)} rows, states for every token",
                     measured={"rows": len(obs.rows), "mismatched": len(bad)}))
    if bad:
        return out  # nothing else can be measured on states of the wrong shape
    token_ids = dict(obs.rows)
    wrong = [r for r, ids in obs.file_ids.items() if ids != token_ids[r]]
    out.append(Check("token ids", not wrong,
                     f"states files of rows {wrong} hold other token ids than the rows" if wrong else
                     (f"{len(obs.file_ids)} states files hold their rows' token ids" if obs.file_ids else
                      "the backend hands tensors (no token ids to compare); vLLM checks each output's prompt ids")))
    # one reduction per row: a slot's largest |value| is NaN or inf when any of its values is (amax propagates
    # NaN), 0 when all are; the exact count only for a slot that fails (slot by slot, two passes each took 0.95 s of
    # a 4 x 2048-token probe of an 8B shape on 2 cores, this 0.13 s)
    peaks = {r: obs.states[r].abs().amax(dim=(0, 2)).float() for r, _ in obs.rows}
    for j, k in enumerate(layer_ids):
        bad_rows = [r for r, _ in obs.rows if not torch.isfinite(peaks[r][j])]
        nonfinite = sum(int((~torch.isfinite(obs.states[r][:, j])).sum()) for r in bad_rows)
        zero = [r for r, _ in obs.rows if peaks[r][j] == 0]  # (a NaN peak is not "all zero")
        if nonfinite or zero:
            out.append(Check("finite", False, f"slot {j} (layer id {k}): {nonfinite} non-finite values, all zero "
                             f"in rows {zero}", slot=j, layer_id=k, measured={"non_finite": nonfinite,
                                                                            "zero_rows": zero}))
    if not any(c.check == "finite" for c in out):
        out.append(Check("finite", True, "every state finite, no slot all zero"))
    dups = []
    for i in range(n_slots):
        for j in range(i + 1, n_slots):
            if all(torch.equal(obs.states[r][:, i], obs.states[r][:, j]) for r, _ in obs.rows):
                dups.append((i, j))
    out.append(Check("duplicate", not dups, "; ".join(f"slot {j} (layer id {layer_ids[j]}) equals slot {i} (layer "
                                                       f"id {layer_ids[i]})" for i, j in dups) or
                     "no slot equals another", slot=dups[0][1] if dups else None,
                     layer_id=layer_ids[dups[0][1]] if dups else None))
    if obs.head is None:
        return out
    embed, norm_w, _, _ = obs.head
    w = norm_w.float()
    use = w.abs() >= 1e-3 * w.abs().mean()
    final = torch.cat([obs.states[r][:, -1] for r, _ in obs.rows]).float()
    rms = (final[:, use] / w[use]).pow(2).mean(-1).sqrt()
    dev = float((rms - 1).abs().median())
    post_mag = float(w.pow(2).mean().sqrt() * hidden ** 0.5)
    out.append(Check("post-norm", dev >= tol.post_norm,
                     f"the final slot (layer id {layer_ids[-1]}) {'looks post-norm' if dev < tol.post_norm else 'is not post-norm'}: "
                     f"median |rms(state / norm weight) - 1| = {dev:.4g} over {len(rms)} tokens (post-norm: < "
                     f"{tol.post_norm}); median state norm {float(final.norm(dim=-1).median()):.4g}, post-norm "
                     f"magnitude sqrt(H) * rms(w) = {post_mag:.4g}", slot=n_slots - 1, layer_id=layer_ids[-1],
                     measured={"median_rms_deviation": round(dev, 6)}, tolerance={"post_norm_below": tol.post_norm}))
    if 0 in layer_ids:
        j = layer_ids.index(0)
        worst, worst_row = 1.0, None
        for r, t in obs.rows:
            c = float(_cos(obs.states[r][:, j], embed[torch.as_tensor(t)]).min())
            if c < worst:
                worst, worst_row = c, r
        out.append(Check("embedding", worst >= tol.embed_cos,
                         f"slot {j} (layer id 0) against the checkpoint's embedding of the row's tokens: min cos "
                         f"{worst:.6f} (tolerance >= {tol.embed_cos})", slot=j, layer_id=0, row=worst_row,
                         measured={"min_cos": round(worst, 6)}, tolerance={"min_cos": tol.embed_cos}))
    return out


def compared(dist: EngineDist, length: int) -> list[int]:
    """Indices into `dist` of the positions the final-state check compares: at most FIRST_ROW_POSITIONS evenly
    spaced ones of a row the engine gave every position of (prompt logprobs), else all it gave. Every ~8th token of a
    2048-token row still lands in every prefill chunk (a wrong chunk is wrong at all its positions), and the head is
    applied to ~260 positions instead of ~2,050 (a 2,050 x 128k float32 matmul on the CPU took seconds)."""
    if len(dist.positions) <= FIRST_ROW_POSITIONS:
        return list(range(len(dist.positions)))
    wanted = set(positions(length, FIRST_ROW_POSITIONS))
    return [i for i, q in enumerate(dist.positions) if q in wanted]


def check_final(obs: Observed, layer_ids: list[int], tol: Tolerance) -> list[Check]:
    """The final slot through the checkpoint's norm and lm_head against the engine's own logprobs, at the positions
    `compared` picks (the head applied once to all rows' positions: one pass over it, however many rows)."""
    from eagle3lib.common.device import cpu_has_amx
    from eagle3lib.common.head import final_logits

    if obs.head is None or not obs.engine:
        return []
    _, norm_w, lm_head, eps = obs.head
    picked: list[tuple[int, EngineDist, list[int]]] = []
    for r, t in obs.rows:
        dist = obs.engine.get(r)
        if dist is not None and dist.positions:
            idx = compared(dist, len(t))
            picked.append((r, dist, idx))
    if not picked:
        return []
    finals = torch.cat([obs.states[r][[dist.positions[i] for i in idx], -1] for r, dist, idx in picked])
    # bf16 on an AMX CPU: no float32 copy of the head (on the H200's host: 1.0 s of checks in float32)
    in_bf16 = tol.head_16_bit and lm_head.dtype == torch.bfloat16 and cpu_has_amx()
    all_ours = torch.log_softmax(final_logits(finals, (norm_w, lm_head, eps), in_head_dtype=in_bf16), dim=-1).split(
        [len(idx) for _, _, idx in picked])
    agree = total = 0
    errs: list[float] = []
    per_row: dict[int, tuple[float, float]] = {}
    for (r, dist, idx), ours in zip(picked, all_ours, strict=True):
        ids, logprobs = dist.ids[idx], dist.logprobs[idx]
        valid = ~torch.isnan(logprobs)
        top = ours.argmax(-1)
        same = top == ids[:, 0]
        # a different argmax is a tie when the engine itself ranks ours within `tie` nats of its own top
        in_top = ids == top[:, None]
        engine_lp_of_ours = torch.where(in_top & valid, logprobs, torch.full_like(logprobs, -1e9)).amax(-1)
        tie = (logprobs[:, 0] - engine_lp_of_ours) <= tol.tie
        ok = same | tie
        err = (ours.gather(1, ids) - logprobs).abs()[valid]
        agree += int(ok.sum())
        total += len(ok)
        errs.extend(err.tolist())
        per_row[r] = (float(ok.float().mean()), float(err.mean()) if err.numel() else 0.0)
    if not total:
        return []
    top1 = agree / total
    mean_err = sum(errs) / len(errs)
    worst = min(per_row, key=lambda r: (per_row[r][0], -per_row[r][1]))
    ok = top1 >= tol.top1 and mean_err <= tol.logprob
    return [Check("final state", ok,
                  f"slot {len(layer_ids) - 1} (layer id {layer_ids[-1]}) through the checkpoint's final norm and "
                  f"lm_head against {obs.engine_name}: top-1 agreement {top1:.3f} (tolerance >= {tol.top1}), mean "
                  f"|logprob error| of the engine's top-{TOP_K} {mean_err:.4g} nats (tolerance <= {tol.logprob}) "
                  f"over {total} positions; worst row {worst}: {per_row[worst][0]:.3f}, {per_row[worst][1]:.4g}",
                  slot=len(layer_ids) - 1, layer_id=layer_ids[-1], row=worst,
                  measured={"top1_agreement": round(top1, 4), "mean_logprob_error": round(mean_err, 6),
                            "max_logprob_error": round(max(errs), 6), "positions": total},
                  tolerance={"top1_agreement": tol.top1, "mean_logprob_error": tol.logprob, "tie": tol.tie})]


def _cos_table(states: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Cosines [T, slots, ref layers] of every slot against every reference layer, token by token: each state is
    normalised once (176 pairwise cosine calls over 2048-token rows took 6 s on the H200's host)."""
    a = torch.nn.functional.normalize(states[: ref.shape[0]].float(), dim=-1, eps=1e-12)
    b = torch.nn.functional.normalize(ref.float(), dim=-1, eps=1e-12)
    return torch.einsum("tsh,tlh->tsl", a, b)


def check_layers(obs: Observed, layer_ids: list[int], tol: Tolerance) -> list[Check]:
    """Every slot against every second path that ran: the mean cosine to its own layer within tolerance, and no
    other captured layer closer."""
    out: list[Check] = []
    for path in obs.paths:
        if not path.states:
            continue
        tables = {r: _cos_table(obs.states[r], path.states[r]) for r, _ in obs.rows if r in path.states}
        for j, k in enumerate(layer_ids):
            if k not in path.layer_ids:
                continue
            mean_cos: dict[int, float] = {}
            min_cos = 1.0
            worst_row = None
            for i, kk in enumerate(path.layer_ids):
                cs = []
                for r, table in tables.items():
                    c = table[:, j, i]
                    cs.append(c)
                    if kk == k and float(c.min()) < min_cos:
                        min_cos, worst_row = float(c.min()), r
                if cs:
                    mean_cos[kk] = float(torch.cat(cs).mean())
            if k not in mean_cos:
                continue
            best = max(mean_cos, key=lambda x: mean_cos[x])
            own = mean_cos[k]
            nums = {"mean_cos": round(own, 6), "min_cos": round(min_cos, 6),
                    "best_layer": best, "best_mean_cos": round(mean_cos[best], 6)}
            tols = {"mean_cos": tol.cos_mean, "min_cos": tol.cos_min}
            if best != k and mean_cos[best] >= tol.cos_mean:
                what = ("a neighbour: layer ids off by one" if abs(best - k) == 1 else
                        "another configured layer: slots in the wrong order" if best in layer_ids else "another layer")
                out.append(Check("layer identity", False,
                                 f"slot {j} holds layer id {best}, not {k} ({what}): against {path.name}, mean cos "
                                 f"{mean_cos[best]:.6f} to layer {best} and {own:.6f} to layer {k}", slot=j,
                                 layer_id=k, row=worst_row, measured=nums, tolerance=tols))
                continue
            ok = own >= tol.cos_mean and min_cos >= tol.cos_min and best == k
            out.append(Check("layer", ok,
                             f"slot {j} (layer id {k}) against {path.name}: mean cos {own:.6f} (tolerance >= "
                             f"{tol.cos_mean}), min {min_cos:.6f} (>= {tol.cos_min})"
                             + ("" if best == k else f"; closer to layer {best} ({mean_cos[best]:.6f})"),
                             slot=j, layer_id=k, row=worst_row, measured=nums, tolerance=tols))
    return out


def judge(obs: Observed, layer_ids: list[int], hidden: int, tol_class: str) -> list[Check]:
    tol = TOLERANCES[tol_class]
    checks = check_structure(obs, layer_ids, hidden, tol)
    if all(c.ok for c in checks if c.check == "lengths"):
        checks += check_final(obs, layer_ids, tol) + check_layers(obs, layer_ids, tol)
    return checks


def failure(checks: list[Check], report_path: Path) -> WorkbookError:
    """One message: the first failing check in ORDER (structure before distributions), its numbers and causes."""
    bad = sorted((c for c in checks if not c.ok), key=lambda c: ORDER.index(c.check))
    first = bad[0]
    more = f" (and {len(bad) - 1} more failing checks)" if len(bad) > 1 else ""
    where = f", row {first.row}" if first.row is not None else ""
    cause = CAUSES["layer" if first.check == "layer identity" else first.check]
    return WorkbookError(
        f"the capture probe failed before the first shard: {first.check}{where}: {first.detail}{more}",
        f"likely causes: {cause}. No shard was written; the full probe report is {report_path}. Fix the capture "
        "and rerun (extract.probe: never skips the probe, only for a target whose head the probe cannot judge)")
