"""What stage 06's serving sweep recommends, and the report card's verdict.

The sweep (eagle3lib.evaluate.serve) measures every `evaluate.serve_grid` setting against the target alone at each
concurrency level; `recommend` picks per level the setting with the most output tokens/s, or no draft where none
beats the target alone, and `verdict` turns that into the report card's first line: serve the draft up to
concurrency N with these settings, or do not serve it, with the τ this target needs to break even and what one more
doubling of the training data gives by the data curve (`read_data_curve`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3lib.evaluate.keys import serve_row

if TYPE_CHECKING:
    from eagle3lib.common.config import WorkbookConfig

DATA_CURVE = "data_curve.json"  # a run's own data-volume curve (benchmarks/data_curve.py's JSON), when it has one


def recommend(settings: dict[str, dict[str, Any]], levels: list[int], primary: str) -> dict[str, Any]:
    """The serve section's overview of the grid (`settings`: each setting's `aggregate`, by label): per level the
    setting with the most output tokens/s (the first in grid order on a tie) and whether it beats the target alone
    (`recommended_settings[c]["setting"]`: that setting, or None = no draft); `by_level` and the speedup, TPOT and
    step-cost curves at each level's best setting (below ×1 where no draft is recommended); the command of the
    setting the verdict names (recommended at the lowest level, else the best there); and the `primary` setting's
    acceptance and greedy-output check (the 'vllm serve' row, comparable with the other methods at its k)."""
    by_level: dict[str, Any] = {}
    recommended: dict[str, Any] = {}
    for c in map(str, levels):
        best = max(settings, key=lambda s: settings[s]["by_level"][c]["draft"].get("output_throughput") or 0)
        lv = settings[best]["by_level"][c]
        pays = (lv["draft"].get("output_throughput") or 0) > (lv["baseline"].get("output_throughput") or 0)
        by_level[c] = {**lv, "setting": best, "recommended": pays}
        recommended[c] = {"setting": best if pays else None, "best_setting": best,
                          "speculative_config": settings[best]["speculative_config"] if pays else None,
                          "serve_flags": settings[best]["serve_flags"] if pays else [],
                          "speedup": lv["output_tok_s_ratio"], "output_throughput": lv["draft"]["output_throughput"],
                          "baseline_output_throughput": lv["baseline"]["output_throughput"]}
    speedup = {c: lv["output_tok_s_ratio"] for c, lv in by_level.items()}
    low = str(levels[0])
    named = settings[recommended[low]["setting"] or recommended[low]["best_setting"]]
    first = settings[primary]
    return {"by_level": by_level, "recommended_settings": recommended, "speedup_by_concurrency": speedup,
            "tpot_speedup_by_concurrency": {c: lv["tpot_ratio"] for c, lv in by_level.items()},
            "step_cost_by_concurrency": {c: lv["step_cost"] for c, lv in by_level.items()},
            "speedup_at_lowest": speedup[low], "lowest_concurrency": levels[0],
            "falls_below_1_at": next((int(c) for c, x in speedup.items() if x is not None and x < 1.0), None),
            "command": named["command"], "baseline_command": first["baseline_command"],
            **{key: first.get(key) for key in ("acceptance", "identical", "differ_at_a_tie", "differ_otherwise",
                                               "divergences")}}


def data_curve_paths(cfg: WorkbookConfig, run_root: Path) -> list[Path]:
    """Where the verdict looks for the run's data-volume curves: evaluate.data_curve (one path or one per drafter,
    relative to the repo root), else DATA_CURVE in the run folder."""
    from eagle3lib.common.config import REPO_ROOT

    named = cfg.evaluate.data_curve
    if not named:
        return [Path(run_root) / DATA_CURVE]
    paths = [Path(p).expanduser() for p in ([named] if isinstance(named, str) else named)]
    return [p if p.is_absolute() else REPO_ROOT / p for p in paths]


def read_data_curve(path: Path) -> dict[str, Any]:
    """The last step of a data-volume curve (benchmarks/data_curve.py's `per_doubling`): τ gained per doubling of the
    training tokens by the server's counters where both of its points ran the serve step, else the validation EAL
    gained (stage 05's own measure, which runs above the server's τ: the verdict names which one it added).
    {"found": False} where there is no readable curve: the verdict then says so instead of estimating."""
    try:
        curve = json.loads(Path(path).read_text())
        steps, drafter = curve.get("per_doubling") or [], curve.get("drafter") or "eagle3"
    except (OSError, json.JSONDecodeError, AttributeError):
        steps, drafter = [], "eagle3"
    if not steps:
        return {"path": str(path), "found": False}
    last = steps[-1]
    row = serve_row(drafter)  # the server's row of the drafter the curve measured ("vllm serve dflash")
    tau_gain = (last.get("tau_gain_per_doubling") or {}).get(row)
    gain, of = (tau_gain, f"τ {row}") if tau_gain is not None else (last.get("val_eal_gain_per_doubling"),
                                                                     "validation EAL")
    return {"path": str(path), "found": gain is not None, "gain_per_doubling": gain, "of": of,
            "from": last.get("from"), "to": last.get("to"), "drafter": drafter}


def verdict(serve: dict[str, Any], *curves: dict[str, Any]) -> dict[str, Any]:
    """The report card's first line, from the sweep's own numbers: serve a draft up to the highest level N such that
    a setting (of any drafter) beats the target alone at every level up to N, with those levels' recommended
    drafters and settings; or, where none does at the lowest level, serve none. Either way the step cost at the
    lowest level's best setting, from its τ (server counters) and speedup (output tokens/s): with τ tokens per step
    and a step costing Y plain steps the speedup is τ / Y, so Y = τ / speedup, and Y is the τ this target needs to
    break even (1.2 Y for ×1.2); and what one more doubling of the training data gives by the data curve
    (`read_data_curve`): τ + its last gain per doubling, where that setting's drafter is the one the curve measured
    (its `drafter`, benchmarks/data_curve.py --drafter: how EAGLE-3 drafts grow with data says nothing of DFlash's);
    of several curves (`read_data_curve`'s, one per drafter), that drafter's."""
    from eagle3lib.evaluate.serve_report import verdict_line

    levels = [int(c) for c in serve["by_level"]]
    rec = serve["recommended_settings"]
    up_to = None
    for c in levels:
        if rec[str(c)]["setting"] is None:
            break
        up_to = c
    low = serve["by_level"][str(levels[0])]
    speedup, tau = low.get("output_tok_s_ratio"), low.get("tau")
    cost = round(tau / speedup, 4) if tau and speedup else None
    drafter = {label: st.get("algorithm") or "eagle3" for label, st in (serve.get("settings") or {}).items()}
    best = drafter.get(low["setting"], "eagle3")
    # this drafter's curve; else another drafter's (the line says it measured other drafts), else one not found
    found = [c for c in curves if c.get("found")]
    curve = next((c for c in found if c["drafter"] == best), (found or [*curves, {}])[0])
    measured = curve.get("drafter") or "eagle3"
    applies = curve.get("found") and best == measured
    gain = curve.get("gain_per_doubling") if applies else None
    out = {"serve": up_to is not None, "up_to_concurrency": up_to, "highest_concurrency": levels[-1],
           "algorithms": list(dict.fromkeys(drafter.values())),
           "settings": {str(c): rec[str(c)]["setting"] for c in levels if up_to is not None and c <= up_to},
           "recommended_at": [c for c in levels if rec[str(c)]["setting"] is not None],
           "lowest_concurrency": levels[0], "setting_at_lowest": low["setting"], "speedup_at_lowest": speedup,
           "tau": tau, "step_cost": cost, "break_even_tau": cost,
           "tau_for_x1_2": round(1.2 * cost, 4) if cost else None,
           "data_curve": curve, "tau_after_doubling": round(tau + gain, 4) if tau and gain is not None else None,
           "drafter_at_lowest": best, "data_curve_drafter": measured}
    out["algorithms_recommended"] = list(dict.fromkeys(drafter.get(s, "eagle3") for s in out["settings"].values()))
    out["line"] = verdict_line(out)
    return out
