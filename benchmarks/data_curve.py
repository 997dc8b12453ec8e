"""Benchmark (not a test): the data-volume curve of one extraction. What is the next doubling of
training data worth?

`benchmarks/device/driver.sh STEPS=curve` (or by hand: `rundir.fork_run` + `eagle3 run --stages 05 -p
train.train_fraction=F`) trains stage 05 again on forks of one run, each on the first share F of stage 02's shuffled
training rows, with the same validation rows and the same epochs (so fewer optimizer steps on less data: the curve
is what a user gets from F of the data with this recipe, not data at a fixed step count). This script reads each
fork's draft/<drafter>/result.json (`--drafter`, default eagle3: train_rows, train_tokens, val_eal, per-position
acceptance; the JSON names the drafter, and the report card's verdict adds its gain only to that drafter's
settings) and writes one JSON and one figure: validation EAL (and each position's acceptance) against training
tokens per epoch, log2 axis. A fork that ran stage 06 adds its held-out tau (by method, and by benchmark where
evaluate.benchmarks asked for them); every fork adds its stages' seconds (its manifests: a fork's copied stages 00-04
are the base run's).

`driver.sh STEPS=curve_online` trains its forks online from one stage 02 of 4x the recipe's data; `--reference
FILE:ARM` adds an arm of a benchmarks/hidden_state_modes.py result (e.g. the 1x recipe's one online epoch,
benchmarks/results/hidden_state_modes_smollm2_h200_2026-12-02.json:online) as a point marked `reference`; a
per_doubling step from or to it says `across_validation_sets`: its validation rows are its own run's, not the forks'.
`--extend CURVE` adds the points of an earlier curve of this script (the 1.5B recipe's forks beside its run on 4x
the data, whose validation and held-out rows are its own: those steps say `across_validation_sets` too; the
benchmarks' questions are the same in both). A step's held-out tau gain is given only between points that asked
the same held-out prompts (one curve's forks, or stage 06's `held_out_digest` equal); its benchmark gains always.

    python benchmarks/data_curve.py outputs/RUN-f0.25 outputs/RUN-f0.5 outputs/RUN \
        --out benchmarks/results/data_curve_qwen15_h200_$(date +%F).json --note "what ran, where, at which commit"
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3lib.common.drafters import ALGORITHMS, title  # noqa: E402 - the repository root first


def point(run_dir: Path, drafter: str = "eagle3") -> dict:
    """One fork's figures from its draft's result (draft/<drafter>/result.json) and its config's train_fraction."""
    import yaml

    from eagle3lib.evaluate.report import stage_seconds
    from eagle3lib.train.result import read_results

    res = read_results(run_dir)[drafter]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    epochs = res.get("epochs_done") or 1
    return {"run": run_dir.name, "train_fraction": (cfg.get("train") or {}).get("train_fraction", 1.0),
            "train_rows": res["train_rows"], "tokens_per_epoch": round(res["train_tokens"] / epochs),
            "tokens_seen": res["train_tokens"], "epochs": epochs, "optimizer_steps": res["global_step"],
            "val_eal": round(res["val_eal"], 4), "val_full_acc": [round(a, 4) for a in res["val_full_acc"]],
            "train_eal": round(res["train_eal"], 4), "train_seconds": res.get("train_seconds"),
            "phase_seconds": res.get("phase_seconds"), **held_out(run_dir, drafter),
            "stage_seconds": stage_seconds(run_dir)}


def held_out(run_dir: Path, drafter: str = "eagle3") -> dict:
    """Stage 06's tau on the held-out prompts (eval/results.json), by method and by benchmark, of the methods that
    measured this drafter (`of_drafter`); nothing if it did not run."""
    path = run_dir / "eval" / "results.json"
    if not path.is_file():
        return {}
    res = json.loads(path.read_text())
    out = {"eval_k": res.get("k"), "held_out_digest": res.get("held_out_digest"),
           "tau_heldout": {m: a["tau"] for m, a in res.get("by_method", {}).items() if of_drafter(m, drafter)}}
    if res.get("tau_by_benchmark"):
        out["tau_by_benchmark"] = {b: {m: a["tau"] for m, a in r["by_method"].items() if of_drafter(m, drafter)}
                                   for b, r in res["tau_by_benchmark"].items()}
    return out


def of_drafter(method: str, drafter: str) -> bool:
    """Whether a row of stage 06 measured this drafter: another drafter's server row ("vllm serve dflash") is not
    EAGLE-3's, and only its own server row is a P-EAGLE or DFlash draft's (the decoders follow EAGLE-3 only)."""
    from eagle3lib.evaluate.keys import serve_row

    if drafter != "eagle3":
        return method == serve_row(drafter)
    return method not in {serve_row(a) for a in ALGORITHMS if a != "eagle3"}


def reference_point(spec: str) -> dict:
    """FILE:ARM of a benchmarks/hidden_state_modes.py result: its run, tokens per epoch and validation EAL."""
    path, _, name = spec.rpartition(":")
    res = json.loads(Path(path).read_text())
    arm = res["arms"][name]
    epochs = arm.get("epochs_done") or 1
    return {"run": f"{res['run']}-{name}", "reference": spec, "tokens_per_epoch": round(arm["train_tokens"] / epochs),
            "tokens_seen": arm["train_tokens"], "epochs": epochs, "val_eal": round(arm["val_eal"], 4),
            "train_seconds": arm.get("train_seconds"), "stage_seconds": arm.get("stage_seconds")}


def curve_points(path: Path, drafter: str) -> list[dict]:
    """The points of an earlier curve (this script's JSON) of the same drafter, each marked with the file it comes
    from."""
    curve = json.loads(Path(path).read_text())
    theirs = curve.get("drafter", "eagle3")  # a curve written before --drafter measured EAGLE-3 drafts
    if theirs != drafter:
        raise SystemExit(f"{path} measured {title(theirs)} drafts, not {title(drafter)} ones: extend a curve with "
                         f"points of its own drafter (--drafter {theirs})")
    return [{**p, "from_curve": str(path)} for p in curve["points"]]


def source(p: dict) -> str:
    """Where a point's validation rows come from: this call's forks share one run's, a reference or an earlier
    curve's points their own."""
    return p.get("reference") or p.get("from_curve") or "forks"


def held_out_set(p: dict) -> str:
    """Which held-out prompts a point's tau is on: stage 06's digest where recorded, else where its run comes from."""
    return p["held_out_digest"][:8] if p.get("held_out_digest") else Path(source(p).split(":")[0]).name


def heldout_taus(p: dict) -> dict[str, float]:
    """A point's held-out tau by method, and by "benchmark/method" (empty where stage 06 did not run)."""
    taus = dict(p.get("tau_heldout") or {})
    for bench, by_method in (p.get("tau_by_benchmark") or {}).items():
        taus.update({f"{bench}/{m}": t for m, t in by_method.items()})
    return taus


def per_doubling(points: list[dict]) -> list[dict]:
    """Validation EAL (and held-out tau, where both points measured it) gained per doubling of the training
    tokens, between neighbouring points."""
    out = []
    for a, b in zip(points, points[1:], strict=False):
        doublings = math.log2(b["tokens_per_epoch"] / a["tokens_per_epoch"])
        if doublings < 0.1:  # about the same data twice (another run of one recipe): no gain per doubling to give
            continue
        ta, tb, same = heldout_taus(a), heldout_taus(b), one_split(a, b)
        tau_gain = {key: round((tb[key] - ta[key]) / doublings, 4) for key in ta if key in tb
                    and ("/" in key or same)}  # held-out tau only over the same held-out prompts
        out.append({"from": a["run"], "to": b["run"], "doublings": round(doublings, 3),
                    "val_eal_gain_per_doubling": round((b["val_eal"] - a["val_eal"]) / doublings, 4),
                    **({"tau_gain_per_doubling": tau_gain} if tau_gain else {}),
                    **({} if same else {"across_validation_sets": True})})
    return out


def one_split(a: dict, b: dict) -> bool:
    """Whether two points share one stage 02's validation rows and held-out prompts: by stage 06's held_out_digest
    where both ran it (two separate runs differ there, even of one recipe), else by where they come from (one
    curve's forks share their base run's split; a reference point has its own)."""
    if a.get("held_out_digest") and b.get("held_out_digest"):
        return a["held_out_digest"] == b["held_out_digest"]
    return source(a) == source(b) and "reference" not in a and "reference" not in b


def plot(points: list[dict], path: Path, title: str) -> None:
    from eagle3lib.common.plots import figure, save_show

    fig, axes = figure(1, 2, figsize=(11, 5))
    xs = [p["tokens_per_epoch"] / 1e6 for p in points]
    axes[0].plot(xs, [p["val_eal"] for p in points], "o-", color="C3", label="validation EAL")
    own = [(x, p) for x, p in zip(xs, points, strict=True) if "train_eal" in p]  # a reference point has no more
    axes[0].plot([x for x, _ in own], [p["train_eal"] for _, p in own], "s--", color="C0", alpha=0.6,
                 label="train EAL (last epoch)")
    for p, x in zip(points, xs, strict=True):
        axes[0].annotate(f"{p['val_eal']:.2f}", (x, p["val_eal"]), textcoords="offset points", xytext=(0, 6),
                         ha="center", fontsize=8)
    sets = {held_out_set(p) for p in points}
    taus = [(x, {k if "/" in k or len(sets) == 1 else f"{k}, held-out set {held_out_set(p)}": v for k, v in t.items()})
            for x, p, t in zip(xs, points, map(heldout_taus, points), strict=True) if t]  # a line per prompt set
    for i, key in enumerate(sorted({k for _, t in taus for k in t})):
        axes[0].plot([x for x, t in taus if key in t], [t[key] for _, t in taus if key in t], "^:", alpha=0.8,
                     color=f"C{4 + i}", label=f"held-out tau ({key})")
    axes[0].set_title("acceptance length vs training data", fontsize=10)
    for s in range(len(own[0][1]["val_full_acc"])):
        axes[1].plot([x for x, _ in own], [p["val_full_acc"][s] for _, p in own], "o-", color=f"C{s}",
                     label=f"position {s + 1}")
    axes[1].set_title("validation acceptance per draft position", fontsize=10)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training tokens per epoch (millions, log2)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: no point hidden
    fig.suptitle(title, fontsize=10)
    save_show(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders with draft/result.json (any order)")
    ap.add_argument("--out", type=Path, required=True, help="JSON to write; the figure goes beside it (.png)")
    ap.add_argument("--note", default="", help="what ran, on which machine, at which commit")
    ap.add_argument("--reference", action="append", default=[], metavar="FILE:ARM",
                    help="an arm of a benchmarks/hidden_state_modes.py JSON, as a point measured elsewhere")
    ap.add_argument("--extend", action="append", default=[], type=Path, metavar="CURVE",
                    help="an earlier curve of this script: its points join these (e.g. the 1x recipe's forks beside "
                         "a run on 4x the data; the step between them crosses validation sets)")
    ap.add_argument("--drafter", default="eagle3", choices=ALGORITHMS,
                    help="whose drafts the curve measures (each run's draft/<drafter>/result.json and its server's "
                         "rows); the verdict adds a curve's gain only to that drafter's settings")
    args = ap.parse_args()
    forks = [point(r, args.drafter) for r in args.runs]
    refs = [reference_point(r) for r in args.reference]
    earlier = [q for c in args.extend for q in curve_points(c, args.drafter)]
    points = sorted(forks + refs + earlier, key=lambda p: p["tokens_per_epoch"])
    out = {"note": args.note, "drafter": args.drafter, "points": points, "per_doubling": per_doubling(points)}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    plot(points, args.out.with_suffix(".png"),
         f"data-volume curve of {title(args.drafter)} drafts: {', '.join(p['run'] for p in points)}")
    print(json.dumps(out["per_doubling"], indent=1))


if __name__ == "__main__":
    main()
