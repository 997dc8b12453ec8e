"""Benchmark (not a test): a Kimi-K2.5-shaped run through stages 00-06 on GPU kernels, in one JSON.

    python scripts/kimi_shaped.py --out /tmp/kimi-shaped
    eagle3 run --config configs/kimi-k2.5-shaped-1gpu.yaml 2>&1 | tee run.log
    python benchmarks/kimi_shaped.py --run-dir outputs/kimi-k2.5-shaped-1gpu --log run.log \
        --out kimi_shaped_<machine>.json --note "date, commit, machine, command" [--mp-run-dir FORK]

What it proves is the path, not a draft (the target's weights are random): every stage's seconds, the capture
probe's figures on vLLM's MLA and fused-MoE kernels (`passed`), the attention backend and MoE kernel vLLM chose (read
from its own log lines in the run's output), the capture strategy, and the served draft's τ and tokens/s. With
--mp-run-dir (a fork whose stage 02 ran with `extract.vllm_args={distributed_executor_backend: mp}`): that capture's
seconds and probe, the path tensor parallel 8 takes, at 1 (docs/capture.md#one-gpu-through-the-multi-gpu-path).
benchmarks/device/driver.sh STEPS=kimi_shaped runs all three commands on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# vLLM's own log lines naming what it chose (vllm/v1/attention/backends, vllm/model_executor/layers/fused_moe)
ATTENTION = re.compile(r"Using (\w+) (?:attention )?backend")
MOE = re.compile(r"(?i)[^\n]*\bmoe\b[^\n]*(?:backend|kernel|config)[^\n]*")
PREFIX = re.compile(r"^.*?\] ")  # "(EngineCore pid=…) INFO 12-07 08:05:44 [unquantized.py:302] ": who and when


def vllm_choices(log: str) -> dict[str, Any]:
    """The attention backends and MoE kernel lines vLLM logged, each once, in order."""
    attention = list(dict.fromkeys(ATTENTION.findall(log)))
    # each line once, whichever engine (capture, evaluation, servers) logged it
    moe = list(dict.fromkeys(PREFIX.sub("", m.strip())[-200:] for m in MOE.findall(log)))
    return {"attention_backend": attention[0] if attention else None, "attention_backends_seen": attention,
            "moe_kernel_lines": moe[:6]}


def report(run_dir: Path, log: str, note: str) -> dict[str, Any]:
    """The JSON (module docstring) from a finished run folder and its output."""
    from eagle3lib.common.config import load_config
    from eagle3lib.evaluate.keys import SERVE, VLLM
    from eagle3lib.evaluate.report import read_manifests

    cfg = load_config(run_dir / "config.yaml")
    probe = json.loads((run_dir / "capture_probe.json").read_text())
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    serve = results.get("serve") or {}
    served = {c: {"tau": lv.get("tau"), "output_tok_s": (lv.get("draft") or {}).get("output_throughput"),
                  "baseline_output_tok_s": lv["baseline"].get("output_throughput"),
                  "speedup": lv.get("output_tok_s_ratio")} for c, lv in (serve.get("by_level") or {}).items()}
    return {"note": note, "run": run_dir.name, "target": cfg.target.model,
            "stage_seconds": {m["stage"]: m.get("seconds") for m in read_manifests(run_dir).values()},
            "probe": {k: probe.get(k) for k in ("passed", "backend", "seconds", "tolerance", "engine_distribution",
                                                "second_paths", "checks")},
            "capture_strategy": f"{cfg.extract.backend}:{cfg.extract.strategy}", "fp8_shards": cfg.extract.fp8_shards,
            **vllm_choices(log), "tau_vllm_engine": (results["by_method"].get(VLLM) or {}).get("tau"),
            "tau_served": (results["by_method"].get(SERVE) or {}).get("tau"),
            "served": served, "verdict": (serve.get("verdict") or {}).get("line")}


def multiprocess_capture(fork: Path, parent: Path) -> dict[str, Any]:
    """Stage 02 of the fork through vLLM's multiprocess executor: the executor its config asked for, the rows it
    captured (all of them: the driver removes the fork's shards first), its seconds and whether its probe passed. A
    file still hard-linked to the parent's (fork_run) was not written by the fork: its stage 02 did not finish."""
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import manifest_file
    from eagle3lib.common.stages import get_stage

    def own(name: Path) -> dict[str, Any]:
        mine, theirs = fork / name, parent / name
        if not mine.is_file() or (theirs.is_file() and mine.samefile(theirs)):
            return {}
        return json.loads(mine.read_text())

    stage = own(manifest_file(fork, get_stage("02")).relative_to(fork))
    extract = (stage.get("metrics") or {}).get("extract") or {}
    return {"executor": load_config(fork / "config.yaml").extract.vllm_args.get("distributed_executor_backend"),
            "finished": bool(stage), "computed_shards": extract.get("computed_shards"),
            "capture_seconds": extract.get("capture_seconds"), "stage_02_seconds": stage.get("seconds"),
            "probe_passed": own(Path("capture_probe.json")).get("passed")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--log", type=Path, required=True, help="the run's output (stdout and stderr)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--note", default="")
    ap.add_argument("--mp-run-dir", type=Path, help="a fork whose stage 02 ran through the multiprocess executor")
    a = ap.parse_args(argv)
    from eagle3lib.common import atomic

    logs = [a.log, *sorted(a.run_dir.rglob("*.log"))]  # the run's output, then its servers' and children's logs
    out = report(a.run_dir, "\n".join(f.read_text(errors="replace") for f in logs), a.note)
    if a.mp_run_dir:
        out["tp1_multiprocess_capture"] = multiprocess_capture(a.mp_run_dir, a.run_dir)
    atomic.write_json(a.out, out)
    print(json.dumps({k: out[k] for k in ("stage_seconds", "capture_strategy", "attention_backend", "served")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
