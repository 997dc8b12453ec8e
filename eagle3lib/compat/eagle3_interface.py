"""Patch: declare vLLM's `SupportsEagle3` interface for targets whose vLLM class lacks it (Qwen2-VL).

Why: vLLM refuses both EAGLE-3 decoding and native `extract_hidden_states` for a model class that does not implement
`SupportsEagle3` ("Model does not support EAGLE3 interface"), although the interface's default methods work for any
wrapper whose decoder sits at `.language_model` and mixes in `EagleModelMixin` (Qwen2-VL's does). The patch
registers, under the same architecture name, a subclass that only adds the interface
(`eagle3lib.compat.eagle3_models:Qwen2VLForConditionalGenerationEagle3`). Registration is by a lazy
'module:Class' string, so nothing heavy (or torchvision, which Qwen2-VL needs) is imported until vLLM loads that
model. vLLM resolves the class in the engine and worker processes: run `worker_setup()` there (see the package
docstring) so the registration exists in every process.
"""

from __future__ import annotations

import ast
import importlib.util
from typing import Any

from eagle3lib.compat import Patch, register

NAME = "qwen2vl_supports_eagle3"
# architecture name → (upstream module, class, our subclass as 'module:Class')
TARGETS: dict[str, tuple[str, str, str]] = {
    "Qwen2VLForConditionalGeneration": (
        "vllm.model_executor.models.qwen2_vl", "Qwen2VLForConditionalGeneration",
        "eagle3lib.compat.eagle3_models:Qwen2VLForConditionalGenerationEagle3"),
}
_state: dict[str, Any] = {}


def _source_declares_eagle3(module: str, cls_name: str) -> bool | None:
    """Does the class list SupportsEagle3 among its bases? Parsed from source: importing may need torchvision."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return any((b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")) == "SupportsEagle3"
                       for b in node.bases)
    return None


def _entry_supports(arch: str) -> tuple[bool, str]:
    """Whether the class vLLM's registry resolves for `arch` implements SupportsEagle3 (imported when possible)."""
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel

    module, cls_name, ours = TARGETS[arch]
    entry = ModelRegistry.models.get(arch)
    if entry is None:
        return True, f"{arch} is not registered in this vLLM"
    if isinstance(entry, _LazyRegisteredModel):
        if f"{entry.module_name}:{entry.class_name}" == ours:
            return True, f"{arch} → {ours}"
        module, cls_name = entry.module_name, entry.class_name
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError:
        declared = _source_declares_eagle3(module, cls_name)
        if declared is None:
            return True, f"{module}:{cls_name} not found"
        return declared, f"{cls_name} {'declares' if declared else 'lacks'} SupportsEagle3 (source; not importable)"
    from vllm.model_executor.models.interfaces import supports_eagle3

    ok = supports_eagle3(cls)
    return ok, f"{cls_name} {'implements' if ok else 'lacks'} SupportsEagle3"


def qwen2vl_supports_eagle3() -> tuple[bool, str]:
    return _entry_supports("Qwen2VLForConditionalGeneration")


def _detect() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    return any(not _entry_supports(arch)[0] for arch in TARGETS)


def _apply() -> None:
    from vllm.model_executor.models.registry import ModelRegistry

    for arch, (_, _, ours) in TARGETS.items():
        if arch in _state or _entry_supports(arch)[0]:
            continue
        _state[arch] = ModelRegistry.models.get(arch)
        ModelRegistry.register_model(arch, ours)


def _revert() -> None:
    from vllm.model_executor.models.registry import ModelRegistry

    for arch in list(_state):
        original = _state.pop(arch)
        if original is None:
            ModelRegistry.models.pop(arch, None)
        else:
            ModelRegistry.models[arch] = original


register(Patch(
    name=NAME,
    why="vLLM's Qwen2-VL class does not declare SupportsEagle3, so extract_hidden_states and EAGLE-3 decoding "
        "refuse it.",
    repairs="vllm.qwen2_vl.SupportsEagle3",
    detect=_detect,
    apply=_apply,
    revert=_revert,
    stages=("02", "06"),
    scope="worker",
))
