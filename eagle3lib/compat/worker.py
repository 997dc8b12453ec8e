"""A vLLM worker extension whose only job is to bring the compat patches into every worker process.

Why: vLLM builds the model inside worker processes, which (with spawn) inherit no monkeypatch from the parent.
vLLM imports the module named by `worker_extension_cls` in each worker before the model is built, so calling
`worker_setup()` at module level here applies the worker-scope patches (rotary op, model registry, connector
registry) in time. Use it when you have no extension of your own:

    LLM(..., worker_extension_cls="eagle3lib.compat.worker.CompatWorkerExtension")
    llm.collective_rpc("eagle3_compat_status")          # → one list of active patch names per worker
"""

from __future__ import annotations

from eagle3lib.compat import PATCHES, worker_setup

ACTIVE_AT_IMPORT = worker_setup()


class CompatWorkerExtension:
    """Mixed into vLLM's worker class; adds one RPC for checking which patches are active in the worker."""

    def eagle3_compat_status(self) -> list[str]:
        return [p.name for p in PATCHES.values() if p.applied]
