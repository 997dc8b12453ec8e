"""Benchmark (not a test): the workbook beside its peers on one run's conversations, every draft measured by the
workbook's own stage 06 (same prompts, same flags, k from the config).

Arms (`ARMS`; the workbook as configured is always one):
  workbook          the run itself, stages 00-06 as configured (`eagle3 run`).
  speculators_cli   speculators' own `speculators train` (its CLI, its defaults: muon, lr 1e-3, linear schedule,
                    kl_div, weight decay 0.01, seed 42, its own draft vocabulary built from the run's token
                    frequencies) on a fork of the run (`rundir.fork_run`: the same conversations, rows, validation rows
                    and hidden-state shards, through hard links), for the workbook's epochs (its own default, 20, is
                    ten times the 1.5B recipe's training: not an arm). What the run's machine decides is the workbook
                    arm's: attention kernel, loss kernel (speculators' fused loss fails under torch 2.11's dynamo,
                    docs/gpu.md#fused-loss-on-the-h200), states dtype, loader workers; and what the data decides: the
                    training/validation boundary (its 0.9 default would move it) and the tokens per packed step
                    (train.packing_length; its default is 8192, the GPU recipes' value), so both arms take the same
                    optimizer steps per epoch. Its draft is then registered as the fork's stage 05 (`register_draft`)
                    and stage 06 runs on the fork. Not run by this harness: speculators' own data preparation and
                    `generate-offline-data` (vLLM + hs-connectors), which would write a second copy of the same states.
  workbook_adamw    the workbook's stage 05 on a fork with AdamW, the optimizer it had before it took speculators'
                    CLI defaults (`WORKBOOK_VARIANTS`; in peers_qwen15_h200_2026-12-05.json, made while AdamW was
                    the default, the arm with the CLI's settings is `workbook_muon`).
  workbook_epochs_x2  the workbook's stage 05 on a fork with twice train.epochs: do more optimizer steps pay?
  specforge         SpecForge 0.2.0 is recorded as skipped with the reason (`SPECFORGE_SKIPPED`; docs/peers.md#peers):
                    its own capture needs SGLang 0.5.14 (sglang-kernel 0.4.4 alone is a 615 MB wheel), too much to
                    carry beside the workbook's bundle in one GPU session; its trainer imports without SGLang but
                    trains from per-sample files of bf16 states (78.6 GB for the 1.5B recipe's tokens: more than the
                    GPU host's 64 GB disk) and only on a GPU (its EAGLE-3 loss is a Triton kernel).

Per arm: tau on the held-out prompts and on every evaluate.benchmarks set (stage 06, serve method: the draft's
`vllm serve` counters), validation EAL (speculators' own validation metrics on the same validation rows), training
tokens, stage seconds, GPU seconds (stages 02, 05, 06: the ones that hold the GPU), the hidden states' bytes on disk;
and beside the workbook arm, the noise of a tau difference: the mean difference over the benchmarks' categories
(paired: the same questions) with its standard error (`paired_difference`).

    eagle3 run --config C --run R                                  # the workbook arm: stages 00-06
    python benchmarks/peers.py train --run-dir outputs/R --arm speculators_cli   # on a fork: R-speculators-cli
    python benchmarks/peers.py evaluate --run-dir outputs/R --arm speculators_cli
    python benchmarks/peers.py report --run-dir outputs/R --arms speculators_cli workbook_adamw \
        --out benchmarks/results/peers_qwen15_h200.json --note "date, commit, machine, command"

A fork runs with the workbook arm's own resolved config (its run folder's config.yaml: whatever overrides its
stages ran with), so the fork's stages 00-04 are valid as they are; `-p KEY=VALUE` overrides go to each fork's stage
06 (give the workbook arm's stage 06 the same). Arms can train side by side with the workbook arm's stage 05 (on one
GPU each arm's training seconds are then under that sharing; the JSON's note says so).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # recipe.run_summary

CLI_ARM = "speculators_cli"
# the workbook's stage 05 again on a fork, with these train.* overrides (a function of the run's train section)
WORKBOOK_VARIANTS: dict[str, Any] = {
    # the workbook's optimizer before it took speculators' CLI defaults: AdamW at the recipes' lr 1e-3, cosine decay
    # after 100 warm-up steps, no weight decay (0.64 tau below muon on the 1.5B: peers_qwen15_h200_2026-12-05)
    "workbook_adamw": lambda t: ["train.optimizer=adamw", "train.lr=0.001", "train.weight_decay=0.0",
                                 "train.scheduler=cosine", "train.warmup_steps=100"],
    "workbook_epochs_x2": lambda t: [f"train.epochs={2 * t.epochs}"],
}
ARMS = (CLI_ARM, *WORKBOOK_VARIANTS)
SPECFORGE_SKIPPED = (
    "not run: SpecForge 0.2.0 (PyPI) captures hidden states through SGLang 0.5.14 (sglang-kernel 0.4.4 alone is a "
    "615 MB wheel, with flashinfer, flash-attn-4, tilelang, torchao, transformers 5.8.1 beside it), which the GPU "
    "host lacks and which does not fit beside the workbook's bundle in one session; its trainer alone trains "
    "offline from per-sample .ckpt files of bf16 states (the three aux layers and the post-norm final state: "
    "12,288 bytes per token of the 1.5B, 78.6 GB for the recipe's 6.40M tokens, more than the host's 64 GB disk; "
    "its loader passes them to the draft as stored, so no FP8) and its EAGLE-3 loss is a Triton kernel (GPU only, "
    "untestable on the CPU): not built (docs/peers.md#peers)")


def fork_name(run: str, arm: str) -> str:
    return f"{run}-{arm.replace('_', '-')}"


def cli_arguments(inp: Any, res: Any, token_freq: Path, save_path: Path, log_dir: Path, epochs: int,
                  fp8: bool, packing_length: int) -> list[str]:
    """`speculators train` flags for the run's data: where things are, plus what the machine decides (as for the
    workbook arm). Everything else is speculators' default."""
    has_tokenizer = any((Path(inp.model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    args = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(inp.model_dir),
            "--data-path", str(inp.dataset_dir), "--hidden-states-backend", "fp8" if fp8 else "file",
            "--target-layer-ids", *[str(i) for i in inp.aux_layer_ids],
            "--draft-vocab-size", str(inp.draft_vocab_size), "--token-freq-path", str(token_freq),
            "--train-data-ratio", repr(inp.train_ratio), "--total-seq-len", str(packing_length),
            "--epochs", str(epochs), "--save-path", str(save_path),
            "--log-dir", str(log_dir),
            "--draft-attn-impl", res.attn_impl, "--loss-implementation", res.loss_implementation,
            "--hidden-states-dtype", res.hidden_states_dtype, "--num-workers", str(res.num_workers)]
    if not has_tokenizer:  # a tiny test target: no tokenizer to read the mask token from (eagle3 does not use it)
        args += ["--mask-token-id", "0"]
    return args


def speculators_train(argv: list[str]) -> None:
    """`speculators train ARGS` in this process, its per-step and validation metric dicts written to RECORDS
    (`--records RECORDS` first). On a machine without an accelerator the workbook's speculators-Trainer-on-CPU patch
    goes first (docs/cpu.md#speculators-trainer-on-the-cpu): speculators' Trainer moves to an accelerator."""
    import torch
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    from eagle3lib.common import atomic
    from eagle3lib.train.speculators_glue import ensure_cpu_patch

    records_path = Path(argv[argv.index("--records") + 1])
    del argv[argv.index("--records"):argv.index("--records") + 2]
    ensure_cpu_patch("cuda" if torch.cuda.is_available() else "cpu")
    records: list[dict[str, Any]] = []

    class Capture(logging.Handler):  # on the root logger: speculators' dictConfig replaces its own handlers
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "speculators.metrics" and isinstance(record.msg, dict) and (
                    "train" in record.msg or "val" in record.msg):
                records.append({k: v for k, v in record.msg.items() if k != "profile"})

    logging.getLogger().addHandler(Capture(logging.INFO))
    t0 = time.perf_counter()
    try:
        main(TrainConfig.resolve(argv))
    finally:
        atomic.write_json(records_path, {"seconds": round(time.perf_counter() - t0, 2), "records": records})


def register_draft(rd: Any, inp: Any, save_path: Path, records: dict[str, Any], command: list[str],
                   started: float, epochs: int) -> Path:
    """The peer's last checkpoint as the fork's stage 05 output (what stage 06 reads), packaged as the workbook
    packages its own (`finalize_checkpoint`: the verifier named by the target's folder, the aux-layer count pinned
    for vLLM), with draft/eagle3/result.json and the stage's manifest. The manifest's metrics are the peer's own."""
    from eagle3lib.common import atomic
    from eagle3lib.common.stages import get_stage
    from eagle3lib.train.checkpoint import finalize_checkpoint
    from eagle3lib.train.curves import curve_point

    epoch_dirs = sorted((d for d in save_path.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
    if not epoch_dirs:
        raise SystemExit(f"speculators train left no checkpoint in {save_path}")
    final = epoch_dirs[-1]
    finalize_checkpoint(final, inp)
    ttt = rd.cfg.train.ttt_steps
    vals = [r["val"] for r in records["records"] if "val" in r]
    steps = [r for r in records["records"] if "train" in r]
    val = curve_point(vals[-1], "eagle3", ttt, "_epoch") if vals else {}
    from datasets import load_from_disk

    lengths = list(load_from_disk(str(inp.dataset_dir)).with_format(None)["seq_len"])
    result = {"checkpoint": str(final), "trained_by": "speculators train", "command": command,
              "epochs_done": len(epoch_dirs), "global_step": len(steps), "val_eal": val.get("eal"),
              "val_loss": val.get("loss"), "val_full_acc": [val.get(f"full_acc_{s}") for s in range(ttt)],
              "val_eal_untrained": None, "train_eal": None, "train_seconds": records["seconds"],
              # each training row once per epoch, less the token the shift to next-token targets drops (what the
              # workbook's loader counts)
              "train_tokens": epochs * sum(n - 1 for n in lengths[:inp.train_rows]), "train_rows": inp.train_rows}
    result["tokens_per_s"] = result["train_tokens"] / records["seconds"] if records["seconds"] else None
    atomic.write_json(rd.path("draft", "eagle3", "result.json"), result)
    atomic.write_json(rd.path("draft", "result.json"), {"eagle3": result})
    return rd.write_manifest(get_stage("05"), started=started, outputs={"checkpoint_eagle3": final},
                             metrics={"algorithms": ["eagle3"], "eagle3": {k: v for k, v in result.items()
                                                                            if k not in ("checkpoint", "command")}})


def fork_config(fork: Path) -> Path:
    """The config a fork runs with: the one its base run's stages ran with (copied by fork_run)."""
    return fork / "config.yaml"


def train_arm(base: Path, arm: str) -> Path:
    """Fork the run folder `base` and train arm `arm` (one of `ARMS`) on it; returns the fork's folder."""
    from eagle3lib.common.config import load_run_config
    from eagle3lib.common.rundir import fork_run

    if arm not in ARMS:
        raise SystemExit(f"unknown arm {arm!r}: one of {', '.join(ARMS)}")
    base = Path(base).resolve()
    dst = fork_run(base, base.parent / fork_name(base.name, arm))
    if arm == CLI_ARM:
        return train_cli_arm(dst)
    cfg = load_run_config(fork_config(dst), dst.name)
    run_stage(dst, "05", WORKBOOK_VARIANTS[arm](cfg.train))
    return dst


def train_cli_arm(dst: Path) -> Path:
    """speculators' CLI arm on the fork `dst`, registered as its stage 05."""
    from eagle3lib.common import shards
    from eagle3lib.common.config import load_run_config
    from eagle3lib.common.rundir import RunDir
    from eagle3lib.train import inputs_from_run, resolve_settings

    cfg = load_run_config(fork_config(dst), dst.name)
    rd = RunDir(dst, cfg)
    inp = inputs_from_run(rd)
    res = resolve_settings(cfg.train)
    fp8 = bool(shards.spec_from_metrics(rd.read_manifest("02")["metrics"]).fp8)
    save_path = rd.path("draft", "eagle3", "checkpoints")
    save_path.mkdir(parents=True, exist_ok=True)
    args = cli_arguments(inp, res, rd.output("02", "token_freq"), save_path, rd.path("draft", "eagle3", "logs"),
                         cfg.train.epochs, fp8, cfg.train.packing_length)
    records = rd.path("draft", "eagle3", "speculators_records.json")
    started = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(Path(__file__).resolve()), "speculators-train", "--records", str(records), *args]
    with open(rd.path("draft", "eagle3", "speculators_train.log"), "w") as log:
        subprocess.run(command, cwd=REPO, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    register_draft(rd, inp, save_path, json.loads(records.read_text()), ["speculators", "train", *args], started,
                   cfg.train.epochs)
    return dst


def run_stage(fork: Path, stages: str, overrides: list[str]) -> None:
    """`eagle3 run` of `stages` on a fork, with its own config.yaml and `overrides` (-p KEY=VALUE)."""
    cmd = [sys.executable, "-m", "eagle3lib.cli", "run", "--config", str(fork_config(fork)), "--run", fork.name,
           "--stages", stages, *[x for o in overrides for x in ("-p", o)]]
    subprocess.run(cmd, cwd=REPO, check=True)


def arm_summary(run_dir: Path) -> dict[str, Any]:
    """One arm's figures (`recipe.run_summary`'s, the held-out and MT-Bench tau also as tau_heldout and
    tau_mt_bench, who trained it, its tau per category); a fork without a draft says where its log is."""
    from recipe import run_summary

    from eagle3lib.evaluate.report import read_manifests

    if "05" not in read_manifests(run_dir):
        log = run_dir / "draft" / "eagle3" / "speculators_train.log"
        last = log.read_text().strip().splitlines()[-1][:300] if log.is_file() and log.read_text().strip() else None
        return {"run": run_dir.name, "failed": "no draft: stage 05 did not finish" + (
            f" (last line of {log.name}: {last})" if last else "")}
    summary = run_summary(run_dir)
    from eagle3lib.train.result import read_results

    result = read_results(run_dir)["eagle3"]
    taus = summary["tau_by_benchmark"]
    return {"run": run_dir.name, "trained_by": result.get("trained_by", "eagle3lib (speculators' Trainer)"),
            "tau_heldout": taus.get("heldout"), "tau_mt_bench": taus.get("mt_bench"),
            **{k: v for k, v in summary.items() if k != "run"},
            "tau_by_category": category_taus(run_dir), "val_full_acc": result.get("val_full_acc"),
            "command": result.get("command")}


def category_taus(run_dir: Path) -> dict[str, float]:
    """The draft server's tau per benchmark category ("mt_bench/writing", "gsm8k/gsm8k", ...) from stage 06's
    results: the cells two arms are paired on (the same questions asked of both)."""
    from eagle3lib.evaluate.keys import SERVE

    path = run_dir / "eval" / "results.json"
    if not path.is_file():
        return {}
    out = {}
    for bench, rows in (json.loads(path.read_text()).get("tau_by_benchmark") or {}).items():
        for cat, row in (rows.get("by_category") or {}).items():
            tau = (row.get("by_method") or {}).get(SERVE, {}).get("tau")
            if tau is not None:
                out[f"{bench}/{cat}"] = tau
    return out


def paired_difference(arm: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any] | None:
    """Arm minus reference tau over the benchmark categories both answered: mean, its standard error (the spread
    of the per-category differences / sqrt(n)) and n. A difference within about two standard errors is noise."""
    a, b = arm.get("tau_by_category") or {}, reference.get("tau_by_category") or {}
    diffs = [a[c] - b[c] for c in a if c in b]
    if len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return {"mean": round(mean, 4), "standard_error": round((var / len(diffs)) ** 0.5, 4), "categories": len(diffs)}


def report(base: Path, arms: list[str], out: Path, note: str) -> dict[str, Any]:
    base = Path(base).resolve()
    result_arms: dict[str, Any] = {"workbook": arm_summary(base)}
    for arm in arms:
        fork = base.parent / fork_name(base.name, arm)
        if fork.is_dir():
            result_arms[arm] = arm_summary(fork)
            diff = paired_difference(result_arms[arm], result_arms["workbook"])
            if diff is not None:
                result_arms[arm]["tau_vs_workbook_by_category"] = diff
    result_arms["specforge"] = {"skipped": SPECFORGE_SKIPPED}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"note": note, "commit": commit, "host": platform.node(), "run": base.name, "arms": result_arms}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown_table(result) + "\n")
    trained = [a for a in arms if a in result_arms and "failed" not in result_arms[a]]
    plot_training(base, trained, out.with_suffix(".png"))
    return result


def training_curve(run_dir: Path) -> dict[str, list[float]] | None:
    """An arm's training curve: per optimizer step, the expected acceptance length of the batch (1 + the sum of its
    full acceptance per TTT step) and the learning rate (the AdamW group's); from the workbook's
    draft/eagle3/curves.json or from the records speculators' CLI logged (draft/eagle3/speculators_records.json)."""
    own = run_dir / "draft" / "eagle3"
    curves, records = own / "curves.json", own / "speculators_records.json"
    if curves.is_file():
        steps = json.loads(curves.read_text())["steps"]
        rows = [(s["step"], s["eal"], s["lr"]) for s in steps]
    elif records.is_file():
        recs = [r for r in json.loads(records.read_text())["records"] if "train" in r]
        rows = [(r["global_step"] + 1, 1 + sum(v for k, v in r["train"].items() if k.startswith("full_acc_")),
                 r["lr"]) for r in recs]
    else:
        return None
    lr = [x.get("AdamW", next(iter(x.values()))) if isinstance(x, dict) else x for _, _, x in rows]
    return {"step": [r[0] for r in rows], "eal": [r[1] for r in rows], "lr": lr}


def plot_training(base: Path, arms: list[str], path: Path, window: int = 50) -> Path | None:
    """The arms' training side by side: batch EAL (a rolling mean over `window` steps) and the learning rate, by
    optimizer step. Arms without a curve are left out; None when none has one."""
    from eagle3lib.common.plots import figure, save_show

    runs = {"workbook": base, **{a: base.parent / fork_name(base.name, a) for a in arms}}
    curves = {name: c for name, d in runs.items() if (c := training_curve(d)) is not None}
    if not curves:
        return None
    fig, (ax_eal, ax_lr) = figure(1, 2, figsize=(13, 4))
    for i, (name, c) in enumerate(curves.items()):
        eal = c["eal"]
        smooth = [sum(eal[max(0, j - window + 1):j + 1]) / (j + 1 - max(0, j - window + 1)) for j in range(len(eal))]
        ax_eal.plot(c["step"], smooth, color=f"C{i}", label=name)
        ax_lr.plot(c["step"], c["lr"], color=f"C{i}", label=name)
    ax_eal.set_title(f"training batches' expected acceptance length (mean of {window} steps)", fontsize=10)
    ax_lr.set_title("learning rate (AdamW group)", fontsize=10)
    for ax in (ax_eal, ax_lr):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_show(fig, path)


def markdown_table(result: dict[str, Any]) -> str:
    """The arms as one table: tau held-out and per benchmark, the paired difference to the workbook arm, then
    validation EAL and what the arm cost."""
    benches = list(dict.fromkeys(b for arm in result["arms"].values() for b in arm.get("tau_by_benchmark") or {}))
    cols = [*(f"tau_{b}" for b in benches), "tau_vs_workbook", "val_eal", "val_tau_walk", "train_tokens",
            "optimizer_steps", "train_seconds", "gpu_seconds", "disk_bytes"]

    def cell(arm: dict[str, Any], c: str) -> str:
        if c == "tau_vs_workbook":
            d = arm.get("tau_vs_workbook_by_category")
            return f"{d['mean']:+.3f} ± {d['standard_error']:.3f} ({d['categories']})" if d else "—"
        v = (arm.get("tau_by_benchmark") or {}).get(c[4:]) if c[4:] in benches else arm.get(c)
        return ("—" if v is None else f"{v:,.3f}" if isinstance(v, float) and v < 100 else f"{v:,.0f}"
                if isinstance(v, (int, float)) else str(v))

    lines = ["| arm | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, arm in result["arms"].items():
        if "skipped" in arm or "failed" in arm:
            cells = ["skipped" if "skipped" in arm else "failed"] + [""] * (len(cols) - 1)
        else:
            cells = [cell(arm, c) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "speculators-train":
        speculators_train(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("train", "evaluate", "report"))
    ap.add_argument("--run-dir", required=True, type=Path,
                    help="the workbook arm's run folder: stages 00-04 done (00-06 for report)")
    ap.add_argument("--arm", choices=ARMS, default=CLI_ARM, help="train, evaluate: the arm (its fork: RUN-ARM)")
    ap.add_argument("--arms", nargs="*", choices=ARMS, default=[CLI_ARM], help="report: the arms beside the workbook")
    ap.add_argument("-p", dest="overrides", action="append", default=[], help="evaluate: stage 06 overrides")
    ap.add_argument("--out", default="benchmarks/results/peers.json")
    ap.add_argument("--note", default="", help="date, commit, machine, command (kept in the JSON)")
    args = ap.parse_args()
    base = args.run_dir.resolve()
    if args.step == "train":
        print(args.arm, "trained in", train_arm(base, args.arm))
    elif args.step == "evaluate":
        run_stage(base.parent / fork_name(base.name, args.arm), "06", args.overrides)
    else:
        print(markdown_table(report(base, args.arms, Path(args.out), args.note)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
