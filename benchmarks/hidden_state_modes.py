"""Benchmark (not a test): offline vs online vs spool hidden states on ONE run's data.

`benchmarks/device/driver.sh STEPS=modes` makes the runs this reads, on one machine, one after the other:
  <run>           stages 00-04 offline (stage 02 extracts every row's states to disk once),
  <run>-offline   a fork of it: stage 05, one epoch, reading those shards,
  <run>-online    a fork: stages 02/04/05 with train.hidden_states=online (stage 02 reuses the cached replies and writes
                  shards only for its sample rows; stage 05 runs the target beside the draft, every batch), one epoch,
  <run>-spool     a fork: the same with train.hidden_states=spool and a vLLM producer (extract.backend=vllm), one epoch.
The forks share the base run's files by hard links (eagle3lib.common.rundir.fork_run): no bytes copied.

Figures (per token, so the 5% validation rows stage 02 also extracts do not skew them):
  offline combined tok/s = 1 / (1 / stage 02's capture tok/s + 1 / one epoch's training tok/s): extracting once and
                           training once;
  online_ratio           = the online epoch's tok/s / offline combined (goal >= 0.9, with <= 2 GB of states on disk);
  spool_ratio            = the same for the spool epoch;
  spool_vs_online        = the spool epoch's tok/s / the online epoch's (also without an offline arm: ARMS="online
                           spool" in driver.sh).
Each arm also gets `first_step_s` and `steady_tokens_per_s` (the steps after the first, from draft/curves.json): the
first step holds one-off costs (flex attention's compile, the loader's start; 6-41 s on one H200), which dominate an
epoch of small data (the small run's epoch: 38-93 s in all).

    python benchmarks/hidden_state_modes.py --runs outputs/smollm2-h200 \
        --out benchmarks/results/hidden_state_modes_smollm2_h200_$(date +%F).json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3lib.evaluate.report import stage_seconds  # noqa: E402 - after the repository is on sys.path

GOAL_RATIO = 0.9
GOAL_STATE_BYTES = 2e9


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def arm(run: Path) -> dict[str, Any]:
    """One fork's stage 05 figures (its EAGLE-3 draft's result) and the states its stage 02 left on disk for it."""
    from eagle3lib.train.result import read_results

    res = read_results(run).get("eagle3", {})
    m02 = _json(run / "manifests" / "02_extract_hidden_states.json").get("metrics", {})
    out = {k: res.get(k) for k in ("hidden_states", "epochs_done", "train_tokens", "train_seconds", "tokens_per_s",
                                   "val_eal", "val_eal_untrained", "phase_seconds", "online_target", "spool")
           if k in res}
    out["state_disk_bytes"] = m02.get("bytes")  # online / spool: the sample rows' shards only
    out.update(step_speeds(run))
    out["stage_seconds"] = stage_seconds(run)
    return out


def step_speeds(run: Path) -> dict[str, Any]:
    """The first step's seconds and the tokens/s of the steps after it (each step's wall time, as curves.json has it:
    tokens / tokens_per_s, the data fetch included)."""
    steps = [s for s in _json(run / "draft" / "eagle3" / "curves.json").get("steps", []) if s.get("tokens_per_s")]
    if len(steps) < 2:
        return {}
    secs = [s["tokens"] / s["tokens_per_s"] for s in steps]
    return {"first_step_s": round(secs[0], 2),
            "steady_tokens_per_s": round(sum(s["tokens"] for s in steps[1:]) / sum(secs[1:]), 1)}


def summarize(base: Path) -> dict[str, Any]:
    m02 = _json(base / "manifests" / "02_extract_hidden_states.json").get("metrics", {})
    ext = m02.get("extract", {})
    arms = {name: arm(base.with_name(f"{base.name}-{name}")) for name in ("offline", "online", "spool")}
    arms = {k: v for k, v in arms.items() if v.get("tokens_per_s")}
    result: dict[str, Any] = {
        "run": base.name,
        "offline": {"extract_tokens": ext.get("computed_tokens"), "extract_seconds": ext.get("capture_seconds"),
                    "extract_tokens_per_s": ext.get("tokens_per_s"), "state_disk_bytes": m02.get("bytes"),
                    "base_stage_seconds": stage_seconds(base)},
        "arms": arms,
    }
    train = arms.get("offline", {}).get("tokens_per_s")
    capture = ext.get("tokens_per_s")
    if train and capture:
        combined = 1 / (1 / capture + 1 / train)
        result["offline"]["train_tokens_per_s"] = round(train, 1)
        result["offline"]["combined_tokens_per_s"] = round(combined, 1)
        for name, key in (("online", "online_ratio"), ("spool", "spool_ratio")):
            if name in arms:
                result[key] = round(arms[name]["tokens_per_s"] / combined, 3)
    if "online" in arms and "spool" in arms:  # the producer against the target beside the trainer, per token
        result["spool_vs_online"] = round(arms["spool"]["tokens_per_s"] / arms["online"]["tokens_per_s"], 3)
        if arms["spool"].get("steady_tokens_per_s") and arms["online"].get("steady_tokens_per_s"):
            result["spool_vs_online_steady"] = round(arms["spool"]["steady_tokens_per_s"]
                                                     / arms["online"]["steady_tokens_per_s"], 3)
    if "online_ratio" in result:
        disk = arms["online"].get("state_disk_bytes") or 0
        met = result["online_ratio"] >= GOAL_RATIO and disk <= GOAL_STATE_BYTES
        result["goal"] = (f"online_ratio >= {GOAL_RATIO} with <= {GOAL_STATE_BYTES / 1e9:.0f} GB of states on disk: "
                          f"{'met' if met else 'not met'} ({result['online_ratio']}; {disk / 1e9:.2f} GB)")
    return result


def draw(base: Path, result: dict[str, Any], path: Path) -> None:
    """Two panels: each arm's training loss per step (same seed, same batches: the curves should coincide), and
    the throughputs the ratio is made of."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name in result["arms"]:
        steps = _json(base.with_name(f"{base.name}-{name}") / "draft" / "eagle3" / "curves.json").get("steps", [])
        if steps:
            ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], lw=0.8, alpha=0.8,
                    label=f"{name} (validation EAL {result['arms'][name]['val_eal']:.3f})")
    ax.set(xlabel="training step", ylabel="loss (sum over TTT steps)", yscale="log", title="one epoch, same seed")
    ax.legend()
    off = result["offline"]
    bars = {"offline: capture": off.get("extract_tokens_per_s"), "offline: train": off.get("train_tokens_per_s"),
            "offline: both": off.get("combined_tokens_per_s")}
    bars.update({f"{name}: train": arm["tokens_per_s"] for name, arm in result["arms"].items() if name != "offline"})
    bars = {k: v for k, v in bars.items() if v}
    bx.barh(list(bars), [v / 1e3 for v in bars.values()], color=["#999", "#999", "#555", "#2a7", "#27a"][:len(bars)])
    for i, v in enumerate(bars.values()):
        bx.text(v / 1e3, i, f" {v / 1e3:,.1f}k", va="center")
    ratio = ", ".join(f"{k} {result[k]}" for k in ("online_ratio", "spool_ratio") if k in result)
    bx.set(xlabel="thousand tokens / s (per token: 'both' = 1 / (1/capture + 1/train))", title=ratio)
    bx.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="the base run folder (its forks sit beside it: <run>-offline, ...)")
    ap.add_argument("--note", default="", help="what ran, on which machine, at which commit")
    ap.add_argument("--out", required=True, help="JSON result path (and its figure: the same name, .png)")
    args = ap.parse_args()
    result = {"note": args.note, **summarize(Path(args.runs))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if result["arms"]:
        draw(Path(args.runs), result, out.with_suffix(".png"))
    keys = ("online_ratio", "spool_ratio", "spool_vs_online", "spool_vs_online_steady", "goal")
    print(json.dumps({k: result.get(k) for k in keys}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
