"""Benchmark (not a test): the same hidden states stored in bf16 and in FP8 (extract.fp8_shards), the same seed:
does the draft learn the same?

Arm A is a finished run (stages 00-06, bf16 shards). Arm B is a fork of it (`rundir.fork_run`: stages 00-04 through
hard links) whose stage 02 runs again with `-p extract.fp8_shards=true`: the generated replies come from the cache,
the target's forward is recomputed (deterministic on the CPU; on a GPU the same kernels on the same batches), and each
shard is written in speculators' FP8 format; then stages 03-06 run as in A. Reported: the shards' bytes, stage 05's
validation EAL (before and after training), stage 06's τ per method, and the wall time per stage, for both arms.

    eagle3 run --config configs/demo.yaml --run fp8-a                 # arm A, if it does not exist yet
    python benchmarks/fp8_ab.py --config configs/demo.yaml --run fp8-a --out benchmarks/results/fp8_ab_demo_cpu_$(date +%F).json

Extra `-p KEY=VALUE` overrides go to both arms (arm A's must match how it was run).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def arm_summary(run_dir: Path) -> dict:
    def manifest(stage: str) -> dict:
        files = sorted(run_dir.glob(f"manifests/{stage}_*.json"))
        return json.loads(files[0].read_text()) if files else {}

    m02, m05, m06 = manifest("02"), manifest("05"), manifest("06")
    return {"run": str(run_dir), "fp8_shards": m02.get("metrics", {}).get("fp8_shards", False),
            "shard_bytes": m02.get("metrics", {}).get("bytes"), "tokens": m02.get("metrics", {}).get("tokens"),
            "val_eal": m05.get("metrics", {}).get("val_eal"),
            "val_eal_untrained": m05.get("metrics", {}).get("val_eal_untrained"),
            "tau": m06.get("metrics", {}).get("tau"),
            "seconds": {s: json.loads(p.read_text()).get("seconds") for s in ("02", "03", "05", "06")
                        for p in sorted(run_dir.glob(f"manifests/{s}_*.json"))}}


def embedded_by_group(results: dict) -> dict:
    """{group: the embedded decoder's acceptance} from stage 06's results."""
    groups = (results.get("held_out_groups") or {}).get("groups") or {}
    return {g: row["by_method"]["embedded"] for g, row in groups.items() if "embedded" in row["by_method"]}


def embedded_pairing(a: Path, b: Path) -> dict:
    """The embedded τ of both arms compared group by group (stage 06's `held_out_groups`: the same held-out prompts
    by source or category), the mean difference's standard error across groups, and the outputs both arms share."""
    ra, rb = (json.loads((r / "eval" / "results.json").read_text()) for r in (a, b))
    ca, cb = (embedded_by_group(r) for r in (ra, rb))
    delta = {c: round(cb[c]["tau"] - ca[c]["tau"], 4) for c in ca if c in cb}
    if len(delta) < 2:
        return {}
    d = list(delta.values())
    mean = sum(d) / len(d)
    se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
    outs = list(zip(ra.get("embedded_outputs") or [], rb.get("embedded_outputs") or [], strict=False))
    return {"tau_delta_by_category": delta, "tau_delta_mean": round(mean, 4), "tau_delta_se": round(se, 4),
            "same_outputs": f"{sum(x == y for x, y in outs)}/{len(outs)}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run", required=True, help="arm A: a finished bf16 run")
    ap.add_argument("-p", dest="overrides", action="append", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", default="", help="what ran, where (kept in the JSON)")
    args = ap.parse_args()

    from eagle3lib.common.config import load_run_config
    from eagle3lib.common.rundir import fork_run, run_root

    cfg = load_run_config(args.config, args.run, args.overrides)
    a = run_root(cfg)
    if not sorted(a.glob("manifests/06_*.json")):
        raise SystemExit(f"arm A ({a}) has no stage 06 manifest: run `eagle3 run --config {args.config} --run "
                         f"{args.run}` first")
    b = fork_run(a, a.with_name(a.name + "-fp8"))
    cmd = [sys.executable, "-m", "eagle3lib.cli", "run", "--config", args.config, "--run", b.name, "--stages", "02-06",
           "-p", "extract.fp8_shards=true", *[x for o in args.overrides for x in ("-p", o)]]
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    arms = {"bf16": arm_summary(a), "fp8": arm_summary(b)}
    va, vb = arms["bf16"]["val_eal"], arms["fp8"]["val_eal"]
    out = {"note": args.note, "config": args.config, "overrides": args.overrides, "arms": arms,
           "bytes_ratio": (arms["fp8"]["shard_bytes"] / arms["bf16"]["shard_bytes"]
                           if arms["bf16"]["shard_bytes"] else None),
           "val_eal_delta": round(vb - va, 4) if va is not None and vb is not None else None,
           "tau_delta": {m: round(arms["fp8"]["tau"][m] - t, 4) for m, t in (arms["bf16"]["tau"] or {}).items()
                         if (arms["fp8"]["tau"] or {}).get(m) is not None},
           "embedded_paired": embedded_pairing(a, b),
           "arm_b_seconds": round(time.time() - t0, 1), "host": platform.node(),
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("bytes_ratio", "val_eal_delta", "tau_delta", "embedded_paired")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
