"""Benchmark (not a test): EAGLE-3, P-EAGLE and DFlash drafts trained from the same hidden states, each drafter's
server measured alone, in one JSON.

    python benchmarks/algorithms.py join --base outputs/RUN --drafters eagle3 peagle dflash
    python benchmarks/algorithms.py report --run-dir outputs/RUN-drafters --out algorithms_<target>_<machine>.json \
        --note "date, commit, machine, command"

The GPU plan (benchmarks/device/driver.sh STEPS=algorithms) runs stages 00-04 of RUN, trains each drafter on a fork
of its own (RUN-<drafter>, `train.algorithms: [<drafter>]`), side by side on one GPU, then `join` makes RUN-drafters:
a fork of RUN holding every drafter's finished checkpoints (hard links), whose stage 05 with
`train.algorithms: [eagle3, peagle, dflash]` resumes each of them (nothing left to train) and whose stage 06 measures
every drafter's server and the target alone, one after another (`evaluate.serve_side_by_side_kv_gib: null`), as a
user runs one server. `report` writes per drafter (`arms`): τ on the held-out prompts and each benchmark from its
server's counters (`tau_by_benchmark`), tokens per target step, per-position acceptance, the speedup (output tokens/s
with ÷ without) and what a step costs in plain steps (`step_cost_by_concurrency`, stage 06's TPOT-based figure) at
each concurrency level at the drafter's best setting, every setting's speedup at each level (`settings`), its
training tokens, seconds and parameters, its validation EAL; and the report card's verdict, which picks among them.
`held_out_digest` names the held-out prompts (stage 06's digest): two JSONs' held-out τ compare only where it is the
same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def join(base: Path, drafters: list[str]) -> tuple[Path, list[str]]:
    """RUN-drafters: a fork of `base` (stages 00-04, hard links) holding each RUN-<drafter> fork's draft/<drafter>
    folder, also hard-linked: its stage 05 then resumes every drafter from its finished checkpoint. A drafter whose
    fork holds no finished draft is left out (its fork's stage 05 log says why). Returns (the fork, the drafters
    joined)."""
    import shutil

    from eagle3lib.common.rundir import fork_run

    dst = fork_run(base, base.with_name(f"{base.name}-drafters"))
    joined = []
    for algorithm in drafters:
        src = base.with_name(f"{base.name}-{algorithm}") / "draft" / algorithm
        if not (src / "result.json").is_file():
            print(f"{src} holds no finished draft: {algorithm} left out", file=sys.stderr)
            continue
        shutil.copytree(src, dst / "draft" / algorithm, copy_function=os.link)
        joined.append(algorithm)
    if not joined:
        raise SystemExit(f"no drafter of {drafters} finished training beside {base}")
    return dst, joined


def arm(algorithm: str, results: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """One drafter's figures (module docstring) from the joined run's eval/results.json and its stage 05 result."""
    from eagle3lib.evaluate.compare import best_by_level
    from eagle3lib.evaluate.keys import serve_row

    row = serve_row(algorithm)
    serve = results.get("serve") or {}
    acc = (results.get("by_method") or {}).get(row) or {}
    taus = {"heldout": acc.get("tau")}
    taus |= {name: ((b.get("by_method") or {}).get(row) or {}).get("tau")
             for name, b in (results.get("tau_by_benchmark") or {}).items()}
    best = best_by_level(serve, algorithm)
    first = (serve.get("settings") or {}).get((serve.get("firsts") or {}).get(algorithm)) or {}
    drafts = max(acc.get("drafts") or 0, 1)
    return {"tau_by_benchmark": taus, "tokens_per_step": acc.get("tokens_per_step"),
            "per_position": [round(n / drafts, 4) for n in acc.get("per_pos") or []],
            "speedup_by_concurrency": {c: b["speedup"] for c, b in best.items()},
            "step_cost_by_concurrency": {c: b["step_cost"] for c, b in best.items()},
            "best_setting_by_concurrency": {c: b["setting"] for c, b in best.items()},
            "settings": {n: {c: lv.get("output_tok_s_ratio") for c, lv in (st.get("by_level") or {}).items()}
                         for n, st in (serve.get("settings") or {}).items() if st.get("algorithm") == algorithm},
            "identical": f"{first.get('identical')}/{serve.get('prompts')}" if first else None,
            **training_figures(trained)}


def training_figures(trained: dict[str, Any]) -> dict[str, Any]:
    """A drafter's stage 05 figures (its draft/result.json entry) under the names the report gives them."""
    return {"train_seconds": trained.get("train_seconds"), "train_tokens": trained.get("train_tokens"),
            "train_tokens_per_s": trained.get("tokens_per_s"), "draft_params": trained.get("draft_params"),
            "trainable_params": trained.get("trainable_params"), "positions": trained.get("positions"),
            "val_eal": trained.get("val_eal"), "val_eal_untrained": trained.get("val_eal_untrained"),
            "val_seconds": trained.get("val_seconds"),  # each validation's, the untrained draft's first
            "epochs": trained.get("epochs_done"), "drafter_settings": trained.get("drafter_settings")}


def served_so_far(run_dir: Path, algorithm: str, trained: dict[str, Any]) -> dict[str, Any]:
    """A drafter's figures where stage 06 stopped before its results (a later server failed to start): what its
    first setting's server measured, from eval/serve/partial.json (the cells stage 06 keeps for its resume), and a
    speedup only at the levels where the target alone's server finished too."""
    from eagle3lib.evaluate.keys import serve_row
    from eagle3lib.evaluate.serve import AGAIN
    from eagle3lib.evaluate.serve_asks import benchmark_rows

    path = run_dir / "eval" / "serve" / "partial.json"
    cells = {n: v["value"] for n, v in (json.loads(path.read_text())["methods"] if path.is_file() else {}).items()}
    firsts = [n.removesuffix(" outputs") for n in cells if n.startswith(f"{algorithm} ") and n.endswith(" outputs")]
    if not firsts:  # its server never finished a level: the first exception its log names
        from eagle3lib.common.processes import error_lines

        logs = sorted(path.parent.glob(f"{algorithm}_*.server.log"))
        error = next(iter(error_lines(logs[0].read_text(errors="replace").splitlines()) if logs else []), None)
        return {"setting": None, "tau_by_benchmark": {}, "tokens_per_step": None, "speedup_by_concurrency": {},
                "server_error": error, **training_figures(trained)}
    first, row = firsts[0], serve_row(algorithm)

    def by(prefix: str) -> dict[str, Any]:
        return {n.removeprefix(prefix): v for n, v in cells.items() if n.startswith(prefix) and not n.endswith(AGAIN)}

    levels, base = by(f"{first} c="), by("baseline c=")
    acc = (levels.get("1") or next(iter(levels.values()), {})).get("acceptance") or {}
    taus = {"heldout": acc.get("tau")}
    for name, asked in by(f"{first} benchmark ").items():
        taus[name] = benchmark_rows(asked, acc.get("k") or 1, {}, 0, row)["by_method"][row].get("tau")
    return {"setting": first, "tau_by_benchmark": taus, "tokens_per_step": acc.get("tau"),
            "per_position": acc.get("per_pos_rate") or [],
            "output_tok_s_by_concurrency": {c: float(v["output_throughput"]) for c, v in levels.items()},
            "speedup_by_concurrency": {c: round(float(v["output_throughput"]) / float(base[c]["output_throughput"]), 4)
                                       for c, v in levels.items() if c in base},
            **training_figures(trained)}


def report(run_dir: Path, note: str) -> dict[str, Any]:
    """The JSON above, for the joined run `run_dir`. Training figures come from each drafter's own fork (where it
    trained; the joined run only resumed it) when that fork is beside it. Where stage 06 stopped before its
    results, each arm holds what its server measured before that (`served_so_far`)."""
    from eagle3lib.evaluate.report import read_manifests
    from eagle3lib.train.result import read_results

    results = json.loads((run_dir / "eval" / "results.json").read_text())
    joined = read_results(run_dir)
    serve = results.get("serve") or {}
    arms = {}
    for algorithm in results.get("drafts") or {}:
        fork = run_dir.with_name(run_dir.name.removesuffix("-drafters") + f"-{algorithm}")
        trained = read_results(fork).get(algorithm) or joined.get(algorithm) or {}
        arms[algorithm] = arm(algorithm, results, trained) if serve else served_so_far(run_dir, algorithm, trained)
    stages = {m["stage"]: m.get("seconds") for m in read_manifests(run_dir).values()}
    if serve:
        alone = not serve.get("side_by_side")
    else:  # the run's config.yaml: the resolved config of its latest stage, here the stage 06 that stopped
        from eagle3lib.common.config import load_config

        alone = load_config(run_dir / "config.yaml").evaluate.serve_side_by_side_kv_gib is None
    return {"note": note, "run": run_dir.name, "servers_alone": alone, "stage_06_finished": bool(serve),
            "concurrency": serve.get("concurrency"), "requests": serve.get("requests"),
            "max_tokens": serve.get("max_tokens"), "prompts": serve.get("prompts"),
            "held_out_digest": results.get("held_out_digest"), "arms": arms,
            "verdict": (serve.get("verdict") or {}).get("line"),
            "recommended_settings": {c: r.get("setting") for c, r in (serve.get("recommended_settings") or {}).items()},
            "baseline_output_tok_s": {c: lv["baseline"].get("output_throughput")
                                      for c, lv in (serve.get("by_level") or {}).items()},
            "serve_start_s": {label: (st.get("command") or {}).get("start_s")
                              for label, st in (serve.get("settings") or {}).items()},
            "stage_seconds": stages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    j = sub.add_parser("join", help="RUN-drafters from RUN and its RUN-<drafter> forks")
    j.add_argument("--base", type=Path, required=True)
    j.add_argument("--drafters", nargs="+", required=True)
    r = sub.add_parser("report", help="the JSON of a joined run whose stage 06 finished")
    r.add_argument("--run-dir", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--note", default="")
    a = ap.parse_args(argv)
    if a.command == "join":  # prints the drafters joined, as a train.algorithms value
        print(f"[{', '.join(join(a.base, a.drafters)[1])}]")
        return 0
    from eagle3lib.common import atomic

    out = report(a.run_dir, a.note)
    atomic.write_json(a.out, out)
    print(json.dumps({k: out[k] for k in ("verdict", "recommended_settings")}, indent=1, ensure_ascii=False))
    for name, x in out["arms"].items():
        print(name, json.dumps({k: x[k] for k in ("tau_by_benchmark", "tokens_per_step", "speedup_by_concurrency")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
