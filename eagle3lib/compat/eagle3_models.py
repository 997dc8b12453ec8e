"""vLLM model classes that add `SupportsEagle3` to upstream classes that lack it (see eagle3_interface.py).

Imported only by vLLM, lazily, when it loads such a model ('module:Class' registration): importing this module
imports the upstream model module (Qwen2-VL needs torchvision).
"""

from __future__ import annotations

from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration


class Qwen2VLForConditionalGenerationEagle3(Qwen2VLForConditionalGeneration, SupportsEagle3):
    """Qwen2-VL with the EAGLE-3 interface: the interface's defaults find the decoder at .language_model.model."""
