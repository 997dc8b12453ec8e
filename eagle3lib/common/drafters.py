"""The drafters the workbook trains and serves, by speculators' names: what each one is, how speculators trains it
and how vLLM serves it.

Why one table: stage 05 builds each drafter with speculators' own model class and data path, stage 06 starts each
one's server with vLLM's own method for it, and the report card says which of stage 06's methods could follow it;
a fact about a drafter lives here once, beside its reason.

- eagle3: EAGLE-3. One draft layer run k times one after another, each forward on the draft's own previous token
  and state (speculators `models/eagle3`; vLLM `method: eagle3`).
- peagle: P-EAGLE (parallel drafting). EAGLE-3's layer trained to fill k positions at once: the real token and
  state at the anchor, a mask token and a learnt mask state at the positions after it (speculators `models/peagle`,
  COD sampling over `num_depths` positions); vLLM serves it as `method: eagle3` with `parallel_drafting: true`,
  which is also what vLLM's own speculators parser makes of a `peagle` config
  (vllm/transformers_utils/configs/speculators/base.py).
- dflash: DFlash (block drafting). A few Qwen3-style layers that take the target's states through cross-attention
  and denoise a block of mask tokens after the anchor in one forward (speculators `models/dflash`; vLLM
  `method: dflash`, `model_executor/models/qwen3_dflash.py`). Its block has `block_size` slots, the first the
  anchor: `block_size - 1` draft tokens.
The two one-forward drafters cost one draft forward per step whatever k is, where EAGLE-3 costs k
(docs/drafts.md#drafters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Algorithm = Literal["eagle3", "peagle", "dflash"]
ALGORITHMS: tuple[str, ...] = ("eagle3", "peagle", "dflash")


@dataclass(frozen=True)
class Drafter:
    name: str  # speculators' speculator_type, the checkpoint's speculators_model_type
    title: str  # how the report card and the notebooks name it
    shifted: bool  # speculators' data path shifts its batches (`shift_batch`: the state at t beside token t + 1)
    # the cfg.train field that sets the draft tokens it trains per step (TTT steps, depths, block slots), and whether
    # the first of them is the anchor (DFlash's block) rather than a draft token
    tokens_field: str
    anchor_slot: bool
    # cfg.train fields only this drafter reads (other drafters' checkpoints ignore a change to them)
    own_fields: tuple[str, ...] = ()

    @property
    def tokens_knob(self) -> str:
        """How the config sets its draft tokens per step, as a user writes it ("train.block_size - 1")."""
        return f"train.{self.tokens_field}" + (" - 1" if self.anchor_slot else "")

    def trained_positions(self, train_settings: dict[str, Any]) -> int:
        """Its draft tokens per step from its training settings as speculators resolved them."""
        return int(train_settings[self.tokens_field]) - int(self.anchor_slot)


DRAFTERS: dict[str, Drafter] = {
    "eagle3": Drafter("eagle3", "EAGLE-3", True, "ttt_steps", False, ("ttt_steps", "ttt_step_loss_decay")),
    "peagle": Drafter("peagle", "P-EAGLE", True, "num_depths", False, ("num_depths",)),
    "dflash": Drafter("dflash", "DFlash", False, "block_size", True, ("block_size",)),
}
# cfg.train fields more than one drafter reads but not every one
SHARED_FIELDS = {"max_anchors": ("peagle", "dflash")}
# stage 06's methods that run the workbook's own EAGLE-3 decoder (evaluate.decoder) or its in-process vLLM EAGLE-3
# job: they follow the EAGLE-3 draft only; every drafter is measured by the serve method
EAGLE3_ONLY_METHODS = ("offline", "embedded", "vllm")


def foreign_fields(algorithm: str) -> set[str]:
    """cfg.train fields that do not shape this drafter (another drafter's own): left out of what its checkpoints
    are checked against on resume."""
    foreign = {f for name, d in DRAFTERS.items() if name != algorithm for f in d.own_fields}
    return foreign | {f for f, users in SHARED_FIELDS.items() if algorithm not in users}


def model_class(algorithm: str) -> Any:
    """speculators' model class for the drafter (its registry: the class `speculators train` builds)."""
    import speculators.models  # noqa: F401 - registers every model class
    from speculators.model import SpeculatorModel

    return SpeculatorModel.registry[algorithm]


def preprocess(algorithm: str) -> Any:
    """The collate preprocessing speculators' train CLI gives this drafter (speculators/train/cli.py `main`):
    EAGLE-3 and P-EAGLE read shifted batches, DFlash the rows as they are."""
    if not DRAFTERS[algorithm].shifted:
        return None
    from speculators.models.eagle3.data import shift_batch

    return shift_batch


def checkpoint_config(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def algorithm_of(checkpoint: str | Path) -> str:
    """The drafter a speculators checkpoint holds (its config's speculators_model_type)."""
    return str(checkpoint_config(checkpoint).get("speculators_model_type") or "eagle3")


def trained_tokens(checkpoint: str | Path) -> int:
    """The draft tokens per step the checkpoint was trained for (its greedy proposal's speculative_tokens: TTT steps
    for EAGLE-3, depths for P-EAGLE, block_size - 1 for DFlash)."""
    methods = checkpoint_config(checkpoint)["speculators_config"]["proposal_methods"]
    return int(methods[0]["speculative_tokens"])


def serves_its_block(algorithm: str) -> bool:
    """Whether a drafter's default k is every draft token it was trained for, which only its checkpoint knows:
    DFlash (one forward proposes every slot of its block); the chain drafters take evaluate.num_draft_tokens (EAGLE-3
    and P-EAGLE predict position by position, and deeper positions are accepted less)."""
    return algorithm == "dflash"


def default_k(algorithm: str, checkpoint: str | Path, k: int) -> int:
    """The k a drafter is served with when evaluate.serve_grid names none (`serves_its_block`)."""
    return trained_tokens(checkpoint) if serves_its_block(algorithm) else k


def speculative_config(algorithm: str, checkpoint: str | Path, k: int) -> dict[str, Any]:
    """vLLM's `--speculative-config` for the drafter at k draft tokens (vLLM 0.26 and 0.32 both take these)."""
    method = "dflash" if algorithm == "dflash" else "eagle3"
    spec: dict[str, Any] = {"method": method, "model": str(checkpoint), "num_speculative_tokens": int(k)}
    if algorithm == "peagle":
        spec["parallel_drafting"] = True
    return spec


# vLLM's scheduler defaults on a GPU of >= 70 GiB (vllm/engine/arg_utils.py, the OpenAI server's usage context):
# the tokens one step may schedule, and the requests it may hold
VLLM_BATCHED_TOKENS, VLLM_MAX_SEQS = 8192, 1024
# The most rows of logits a drafter's server warms its rejection sampler on, max_num_seqs x (k + 1): what EAGLE-3 at
# k = 3 runs with vLLM's defaults (1,024 x 4), which starts on one H100. vLLM's memory profile runs the plain sampler
# only ("the sampler may skip top_k, top_p, and logprobs", vllm/v1/worker/gpu/model_runner.py `_dummy_sampler_run`),
# so the KV cache takes what the warmup's larger clone then needs (docs/drafts.md#drafters)
SAMPLER_ROWS = 4096


def server_flags(spec: dict[str, Any]) -> list[str]:
    """`vllm serve` flags a drafter's server needs beside its speculative config: for the drafters that propose in
    one forward, a batch that fits their k draft slots. Why: vLLM takes max_num_seqs x the drafter's extra slots
    (P-EAGLE k - 1, DFlash k: `max_num_new_slots_for_drafting`, vllm/config/speculative.py) from
    max_num_batched_tokens and refuses to start where that is not positive (DFlash at k = 15: "max_num_scheduled_tokens
    is set to -6144"), and its warmup's sampler holds max_num_seqs x (k + 1) rows of logits beyond vLLM's memory
    profile (DFlash at k = 15 with 1,024 requests: 4.64 GiB, out of memory on one H100). So the server holds at most
    SAMPLER_ROWS // (k + 1) requests, and vLLM's 8,192 tokens plus k slots for each (docs/drafts.md#drafters)."""
    if spec.get("method") != "dflash" and not spec.get("parallel_drafting"):
        return []
    k = int(spec["num_speculative_tokens"])
    seqs = min(VLLM_MAX_SEQS, SAMPLER_ROWS // (k + 1))
    return ["--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(VLLM_BATCHED_TOKENS + seqs * k)]


def title(algorithm: str) -> str:
    return DRAFTERS[algorithm].title if algorithm in DRAFTERS else algorithm
