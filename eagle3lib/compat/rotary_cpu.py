"""Patch: vLLM's CPU rotary-embedding op is silently wrong for a 3-D [tokens, heads, dim] query/key.

Why: MLA attention (DeepseekV2/V3, Kimi) passes its rotary part as a 3-D tensor; the CPU kernel
(`ops.rotary_embedding`, called by `RotaryEmbedding.forward_cpu`) handles only the 2-D [tokens, heads*dim] layout
that Llama/Qwen use. No error is raised: greedy output differs from the first token and hidden states have cosine
≈ 0.5 against transformers. The detector runs the op on a small 3-D tensor against a reference computation in
plain torch; the fix routes 3-D inputs through vLLM's own PyTorch implementation (`forward_native`) and writes the
result back in place, so callers that rely on in-place update (like the kernel) and callers that use the returned
tensors both get the right values. 2-D inputs keep the fast kernel.

Alternative without a patch (engine config, so it reaches worker processes by itself):
`compilation_config={"custom_ops": ["all", "-rotary_embedding"]}`.
"""

from __future__ import annotations

from typing import Any

from eagle3lib.compat import Patch, register

NAME = "rotary_cpu_3d"
_state: dict[str, Any] = {}


def _reference(positions, x, cos_sin_cache, rotary_dim: int, neox: bool):  # type: ignore[no-untyped-def]
    """Rotary embedding written out in plain torch (GPT-J interleaved or NeoX half-split), [T, H, D] in and out."""
    import torch

    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


def _probe_module(cls: Any, head: int, rot: int, neox: bool) -> Any:
    """A RotaryEmbedding without vLLM's config machinery (CustomOp.__init__ needs a current VllmConfig): only the
    attributes forward_cpu / forward_native read are set; the cos/sin cache is vLLM's own computation."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    r = cls.__new__(cls)
    torch.nn.Module.__init__(r)
    r.head_size, r.rotary_dim, r.max_position_embeddings = head, rot, 32
    r.base, r.is_neox_style, r.dtype = 10000.0, neox, torch.float32
    r.use_flashinfer, r.use_aiter, r.cos_sin_cache_bf16 = False, False, None
    r.register_buffer("cos_sin_cache", RotaryEmbeddingBase._compute_cos_sin_cache(r), persistent=False)
    return r


def rotary_3d_error() -> float:
    """Max |forward_cpu - reference| over 3-D query/key inputs in both rotary styles (a few milliseconds)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 7, 1, 12])
    worst = 0.0
    for neox in (False, True):
        rope = _probe_module(RotaryEmbedding, head=16, rot=16, neox=neox)
        q = torch.randn(5, 3, 16, generator=g)
        k = torch.randn(5, 1, 16, generator=g)  # MLA: one shared rope key head
        q_out, k_out = rope.forward_cpu(positions, q.clone(), k.clone())
        for got, x in ((q_out, q), (k_out, k)):
            ref = _reference(positions, x, rope.cos_sin_cache, 16, neox)
            worst = max(worst, (got.reshape(ref.shape) - ref).abs().max().item())
    return worst


def _detect() -> bool:
    try:
        import vllm.model_executor.layers.rotary_embedding.base  # noqa: F401
    except ImportError:
        return False
    try:
        return rotary_3d_error() > 1e-4
    except Exception:  # the CPU kernel may be absent from a CUDA build: then forward_cpu is never used
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())


def _apply() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if "forward_cpu" in _state:
        return
    original = RotaryEmbedding.__dict__["forward_cpu"]

    def forward_cpu(self, positions, query, key=None):  # type: ignore[no-untyped-def]
        if query.dim() == 3 or (key is not None and key.dim() == 3):
            q_new, k_new = self.forward_native(positions, query, key)
            query.copy_(q_new.reshape(query.shape))
            if key is not None and k_new is not None:
                key.copy_(k_new.reshape(key.shape))
            return query, key
        return original(self, positions, query, key)

    forward_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    forward_cpu.__doc__ = "eagle3lib.compat.rotary_cpu: 3-D query/key go through forward_native (CPU kernel bug)."
    _state["forward_cpu"] = original
    RotaryEmbedding.forward_cpu = forward_cpu  # type: ignore[method-assign]


def _revert() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = _state.pop("forward_cpu", None)
    if original is not None:
        RotaryEmbedding.forward_cpu = original  # type: ignore[method-assign]




register(Patch(
    name=NAME,
    why="vLLM's CPU rotary kernel silently gives wrong results for the 3-D query/key of MLA attention.",
    repairs="vllm.rotary_embedding.cpu_3d",
    detect=_detect,
    apply=_apply,
    revert=_revert,
    stages=("02", "06"),
    scope="worker",
))
