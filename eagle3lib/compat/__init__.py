"""Compatibility between the installed vLLM, speculators and transformers: a contract audit and a patch registry.

Why: every incompatibility between these packages used to be found one at a time, each after a long model load,
and one silently corrupted data. `audit()` checks every contract the workbook relies on at once (contracts.py; the
contracts are declared in contracts_vllm.py and contracts_training.py, their vocabulary in contract_checks.py); the
patch registry fixes the breaks we know how to fix. Notebook 01 shows both tables.

Each patch has a name, the reason, the contract it repairs, a detector (is it needed on THIS install? a behaviour
check where one is cheap), an idempotent apply and a revert. Patch modules live beside this file and register
themselves with `register(Patch(...))` when imported; `PATCH_MODULES` lists them and `load_patch_modules()` imports
them, reporting (never raising) a module that fails or does not exist yet.

Public API
    audit() -> list[AuditResult]           every contract, all at once (ok / mismatch / repaired / not installed)
    apply_all() -> list[dict]              apply what is needed; one row per patch; applying twice changes nothing
    revert_all()                           restore every patched object (the originals, `is`-identical)
    worker_setup() -> list[str]            apply the worker-scope patches inside a vLLM worker process
    required_tags(cfg) / check_required(results, tags)   which contracts a config needs; WorkbookError if broken
    hidden_states_kv_transfer_config(dir)  (cpu_hidden_states_connector) the kv_transfer_config for this install

Scopes: 'process' patches matter where apply_all() runs (the notebook/trainer process); 'worker' patches must also
be active inside vLLM's worker processes (model code, rotary op, connector registry); 'cli' patches only in a
process that runs vLLM's CLI (`python -m eagle3lib.compat.vllm_cli serve ...`), so apply_all() leaves them alone.

Getting worker patches into vLLM workers (workers are separate processes; with spawn they inherit nothing):
  * apply_all() records the worker-scope patches it applied in the environment variable EAGLE3_COMPAT_PATCHES,
    which vLLM's worker processes inherit (set it before creating the LLM).
  * In the worker, `worker_setup()` applies exactly those (or, if the variable is unset, whatever the detectors
    say is needed). Call it at MODULE LEVEL of your worker-extension module — vLLM imports that module in every
    worker before the model is built (extension __init__ is not reliably called: the class is mixed into the
    worker's bases):
        # eagle3lib/extract/backends/vllm_capture_worker.py
        from eagle3lib.compat import worker_setup
        worker_setup()
        class CaptureWorkerExtension: ...
  * With no extension of your own, pass `worker_extension_cls="eagle3lib.compat.worker.CompatWorkerExtension"`;
    `llm.collective_rpc("eagle3_compat_status")` then returns, per worker, the patches active there.
  * The hidden-states connector reaches every process through the config: use
    `hidden_states_kv_transfer_config(dir)` (kv_connector_module_path), independent of worker_setup.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3lib.common.config import WorkbookConfig

ENV_VAR = "EAGLE3_COMPAT_PATCHES"

# Patch modules, imported by load_patch_modules(). A module that does not exist yet (another engineer's, still to
# come) or fails to import is reported in the patch table, never fatal.
PATCH_MODULES: tuple[str, ...] = (
    "eagle3lib.compat.rotary_cpu",
    "eagle3lib.compat.cpu_hidden_states_connector",
    "eagle3lib.compat.eagle3_interface",
    "eagle3lib.compat.vllm_cli",
    "eagle3lib.compat.speculators_trainer_cpu",
)


@dataclass
class Patch:
    name: str
    why: str  # one sentence
    repairs: str  # name of the contract it repairs (eagle3lib.compat.contracts.CONTRACTS)
    detect: Callable[[], bool]  # True when the patch is needed here (and applicable: its package is installed)
    apply: Callable[[], None]  # idempotent
    revert: Callable[[], None]
    stages: tuple[str, ...] = field(default_factory=tuple)  # stage ids that need it
    applied: bool = False
    scope: str = "process"  # 'process' | 'worker' (also inside vLLM workers) | 'cli' (only vLLM's CLI process)


PATCHES: dict[str, Patch] = {}
MODULE_ERRORS: dict[str, str] = {}  # patch module → why it could not be imported (last attempt)


def register(patch: Patch) -> Patch:
    """Add a patch to the registry. Re-registering a name keeps the applied state of the earlier entry."""
    old = PATCHES.get(patch.name)
    if old is not None and old.applied:
        patch.applied = True
    PATCHES[patch.name] = patch
    return patch


def apply_patch(name: str) -> bool:
    """Apply one patch if its detector says it is needed; returns whether it is active afterwards."""
    patch = PATCHES[name]
    if not patch.applied and patch.detect():
        patch.apply()
        patch.applied = True
    return patch.applied


def revert_patch(name: str) -> None:
    patch = PATCHES[name]
    if patch.applied:
        patch.revert()
        patch.applied = False


def load_patch_modules(modules: Iterable[str] = PATCH_MODULES) -> dict[str, str]:
    """Import every patch module (each registers its patches). Returns {module: problem} for those that could not
    be imported; a module that failed before is retried (its file may have appeared since)."""
    for mod in modules:
        try:
            if importlib.util.find_spec(mod) is None:
                MODULE_ERRORS[mod] = "module does not exist (yet)"
                continue
            importlib.import_module(mod)
            MODULE_ERRORS.pop(mod, None)
        except Exception as e:  # noqa: BLE001 - one broken patch module must not hide the others
            MODULE_ERRORS[mod] = f"{type(e).__name__}: {e}"[:300]
    return {m: MODULE_ERRORS[m] for m in modules if m in MODULE_ERRORS}


def _verify(patch: Patch) -> bool:
    """After apply: the contract the patch repairs must now pass its check (a behaviour probe where there is one).
    Patches that name no declared contract fall back to their detector no longer seeing the problem."""
    from eagle3lib.compat.contracts import OK, check_contract

    checked = check_contract(patch.repairs)
    if checked is not None:
        return checked[0] == OK
    return not patch.detect()


def _row(patch: Patch, needed: bool | None, error: str | None = None) -> dict[str, Any]:
    verified: bool | None = None
    if patch.applied and error is None:
        try:
            verified = _verify(patch)
        except Exception as e:  # noqa: BLE001
            error = f"verification after apply: {type(e).__name__}: {e}"[:300]
    if error:
        status = "error"
    elif patch.applied:
        status = "applied" if verified else "applied, NOT verified"
    elif needed is None:
        status = "not checked"
    elif needed:
        status = "needed, not applied" + (" (scope cli: use python -m eagle3lib.compat.vllm_cli)"
                                          if patch.scope == "cli" else "")
    else:
        status = "not needed"
    return {"name": patch.name, "status": status, "needed": needed, "applied": patch.applied, "verified": verified,
            "repairs": patch.repairs, "scope": patch.scope, "stages": list(patch.stages), "why": patch.why,
            "error": error}


def apply_all(scopes: Iterable[str] = ("process", "worker"), names: Iterable[str] | None = None,
              set_env: bool = True) -> list[dict[str, Any]]:
    """Apply every registered patch (of the given scopes, or exactly `names`) whose detector says it is needed.

    Returns one row per patch (and per patch module that failed to import): name, status, needed, applied,
    verified (the check of the contract it repairs passes after apply: a behaviour probe where there is one),
    repairs, scope, why, error.
    Idempotent: a second call applies nothing new and returns the same rows. With `set_env`, the applied
    worker-scope patches are recorded in $EAGLE3_COMPAT_PATCHES for vLLM worker processes (see worker_setup)."""
    module_errors = load_patch_modules()
    scopes = tuple(scopes)
    wanted = None if names is None else set(names)
    rows: list[dict[str, Any]] = []
    for patch in list(PATCHES.values()):
        if (wanted is not None and patch.name not in wanted) or (wanted is None and patch.scope not in scopes):
            rows.append(_row(patch, None if not patch.applied else True))
            if not patch.applied and wanted is None:  # report whether it would be needed (e.g. scope cli)
                try:
                    rows[-1]["needed"] = bool(patch.detect())
                    rows[-1]["status"] = _row(patch, rows[-1]["needed"])["status"]
                except Exception as e:  # noqa: BLE001
                    rows[-1].update(status="error", error=f"{type(e).__name__}: {e}"[:300])
            continue
        try:
            needed = True if patch.applied else bool(patch.detect())
            if needed and not patch.applied:
                patch.apply()
                patch.applied = True
            rows.append(_row(patch, needed))
        except Exception as e:  # noqa: BLE001 - report, go on with the other patches
            rows.append(_row(patch, None, f"{type(e).__name__}: {e}"[:300]))
    for mod, problem in module_errors.items():
        rows.append({"name": mod.rsplit(".", 1)[-1], "status": "module not loaded", "needed": None, "applied": False,
                     "verified": None, "repairs": "", "scope": "", "stages": [], "why": "", "error": problem})
    if set_env:
        active = [p.name for p in PATCHES.values() if p.applied and p.scope == "worker"]
        os.environ[ENV_VAR] = ",".join(active)
    return rows


def revert_all() -> list[str]:
    """Revert every applied patch (in reverse order of registration); returns the names reverted."""
    reverted = []
    for patch in reversed(list(PATCHES.values())):
        if patch.applied:
            patch.revert()
            patch.applied = False
            reverted.append(patch.name)
    if ENV_VAR in os.environ:
        os.environ[ENV_VAR] = ""
    return reverted




def worker_setup() -> list[str]:
    """Inside a vLLM worker process: apply the worker-scope patches the parent applied ($EAGLE3_COMPAT_PATCHES),
    or, when the variable is unset, every worker-scope patch whose detector says it is needed. Safe to call more
    than once (idempotent); returns the names active afterwards. Never raises: a worker must not die over this."""
    listed = os.environ.get(ENV_VAR)
    try:
        if listed is None:
            apply_all(scopes=("worker",), set_env=False)
        else:
            names = [n for n in listed.split(",") if n]
            if names:
                apply_all(names=names, set_env=False)
    except Exception:  # noqa: BLE001
        pass
    return [p.name for p in PATCHES.values() if p.applied]




def hidden_states_kv_transfer_config(storage_path: Any, **extra_config: Any) -> dict[str, Any]:
    """See eagle3lib.compat.cpu_hidden_states_connector.hidden_states_kv_transfer_config."""
    from eagle3lib.compat.cpu_hidden_states_connector import hidden_states_kv_transfer_config as make

    return make(storage_path, **extra_config)


def audit(contracts: Any = None) -> list[Any]:
    """Check every declared contract (eagle3lib.compat.contracts.CONTRACTS); returns all results at once."""
    from eagle3lib.compat.contracts import audit as run_audit

    load_patch_modules()
    return run_audit(contracts)


# Configuration tags (contracts declare which they serve) ----------------------------------------------------------

def required_tags(cfg: WorkbookConfig, on_cpu: bool | None = None) -> set[str]:
    """The contract tags a workbook config relies on (see Contract.needs), on this machine (`on_cpu` None) or on a
    CPU-only / GPU machine. CPU-only tags (`speculators-cpu`, `vllm-on-cpu`) cover code that only runs without an
    accelerator: the H200 once failed stage 01 on the CPU rotary kernel its CUDA build of vLLM does not have."""
    if on_cpu is None:
        try:
            import torch

            on_cpu = torch.accelerator.current_accelerator() is None
        except Exception:  # noqa: BLE001
            on_cpu = False
    tags = {"speculators"}
    if cfg.train.hidden_states == "spool":  # its sampler reads speculators' batches ahead (train.spool)
        tags.add("speculators-spool")
    extract = cfg.extract
    if extract.backend == "vllm":
        tags |= {"vllm", "vllm-native" if extract.strategy == "native" else "vllm-worker"}
    else:
        tags.add("transformers")
    methods = set(getattr(cfg.evaluate, "methods", []) or [])
    if methods & {"vllm", "serve"}:  # serve: vLLM loads the draft in a server; its CLI goes through vllm_cli
        tags |= {"vllm", "evaluate-vllm"}
    model = str(getattr(cfg.target, "model", ""))
    config = _checkpoint_config(model)
    if model.startswith("embedded:"):
        from eagle3lib.common import embedded

        tags.add("transformers-gguf")
        tags.add(f"gguf:{embedded.lookup(model).architecture}")
    elif "vllm" in tags and ("vision_config" in config or "text_config" in config):
        tags.add("vllm-vlm")  # a multimodal wrapper (Qwen2-VL, Llava, Kimi-K2.5 ...): the wrapper contracts apply
    # per-architecture tags (e.g. 'evaluate-vllm:qwen2'): a family's contracts bind only runs on that family
    model_type = _model_type(model, config)
    if model_type:
        tags |= {f"{t}:{model_type}" for t in ("vllm-native", "vllm-worker", "evaluate-vllm") if t in tags}
    if on_cpu:
        tags.add("speculators-cpu")
        if "vllm" in tags:
            tags.add("vllm-on-cpu")
    return tags


def _checkpoint_config(model: str) -> dict[str, Any]:
    """A local checkpoint's config.json ({} for an embedded name or a folder without a readable one)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_type(model: str, config: dict[str, Any]) -> str | None:
    """The target's (language model's) HF model_type: an embedded target's GGUF architecture (the same word for
    llama and qwen2), else config.json's, under text_config for a multimodal wrapper."""
    if model.startswith("embedded:"):
        from eagle3lib.common import embedded

        return embedded.lookup(model).architecture
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("model_type") or config.get("model_type")


def check_required(results: list[Any], tags: set[str]) -> list[Any]:
    """The results that block this configuration: a needed contract that is broken (mismatch/error/not installed)
    and not repaired. Raises WorkbookError naming ALL of them; returns [] when none."""
    from eagle3lib.common.errors import WorkbookError

    broken = [r for r in results if set(r.needs) & tags and r.status in ("mismatch", "error", "not installed")]
    if broken:
        names = "; ".join(f"{r.name} ({r.status}: {r.detail})" for r in broken)
        raise WorkbookError(
            f"{len(broken)} contract(s) this configuration needs are broken and no patch repairs them: {names}",
            "install the package versions in pyproject.toml, or change extract.backend / evaluate.methods, "
            "or add a patch in eagle3lib/compat for the contract named",
        )
    return []
