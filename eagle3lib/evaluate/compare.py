"""`eagle3 compare`: runs and their drafters side by side, from what each run recorded.

Why apart from the report card: the card reads one run; this reads several (drafts trained on different layers,
data, targets, settings or drafters), one row per drafter of each run, and never recomputes a number. Its first line
names the fastest server per concurrency level over every row, with the command that serves it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3lib.evaluate.keys import EMBEDDED, NGRAM, NGRAM_SERVE, SERVE, VLLM, serve_row
from eagle3lib.evaluate.report import _table, per_position, read_manifests
from eagle3lib.evaluate.serve_report import draft_cell

COMPARE_LIVE = (SERVE, EMBEDDED, VLLM)  # the row a benchmark's τ across runs is read from, the first a run has
NGRAM_ROW = "vLLM n-gram lookup (no draft)"


def _read_results(root: Path) -> dict[str, Any]:
    """A run's eval/results.json, or {} where stage 06 has not run (or left no readable file): `eagle3 compare`
    shows such a run's stage 06 columns as — rather than failing on it."""
    try:
        return json.loads((root / "eval" / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _live_tau(by_method: dict[str, Any], algorithm: str = "eagle3") -> tuple[str | None, float | None]:
    """The row and τ a benchmark or category is compared by across runs. For EAGLE-3 the first of COMPARE_LIVE:
    the server's (the number a deployment sees, and a serve-only run has no other), then the exact embedded decoder,
    then vLLM in-process; for another drafter its server's row, the only one that measures it. One τ per row keeps
    the table one column per benchmark."""
    order = COMPARE_LIVE if algorithm == "eagle3" else (serve_row(algorithm),)
    name = next((m for m in order if by_method.get(m)), None)
    return name, (by_method[name].get("tau") if name else None)


def _rows_used(results: dict[str, Any]) -> list[str]:
    """The rows _live_tau reads for a run's EAGLE-3 benchmarks and their categories, in COMPARE_LIVE order: the
    note names them per run, since a run compared by the server's counters and one by the embedded decoder differ
    in kind."""
    groups = [g for b in (results.get("tau_by_benchmark") or {}).values()
              for g in (b, *(b.get("by_category") or {}).values())]
    used = {_live_tau(g.get("by_method") or {})[0] for g in groups}
    return [m for m in COMPARE_LIVE if m in used]


def drafters_of(results: dict[str, Any], m05: dict[str, Any]) -> list[str]:
    """The drafters a run trained, in its order (a run from before train.algorithms trained EAGLE-3 alone)."""
    return list(results.get("drafts") or {}) or list(m05.get("algorithms") or []) or ["eagle3"]


def best_by_level(serve: dict[str, Any], algorithm: str | None = None) -> dict[str, dict[str, Any]]:
    """Per concurrency level the setting with the most output tokens/s (of one drafter, or of all): {level:
    {"setting", "speedup", "output_throughput", "step_cost"}} from the sweep's settings (`step_cost`:
    serve.step_cost, what a step with the draft costs in plain steps at that load)."""
    settings = {n: st for n, st in (serve.get("settings") or {}).items()
                if algorithm is None or (st.get("algorithm") or "eagle3") == algorithm}
    out = {}
    for c in serve.get("by_level") or {}:
        cells = {n: (lv, draft_cell(lv))
                 for n, st in settings.items() if (lv := st.get("by_level", {}).get(c))}
        if cells:
            name = max(cells, key=lambda n: cells[n][1].get("output_throughput") or 0)
            out[c] = {"setting": name, "speedup": cells[name][0].get("output_tok_s_ratio"),
                      "output_throughput": cells[name][1].get("output_throughput"),
                      "step_cost": cells[name][0].get("step_cost")}
    return out


def _levels(runs: list[dict[str, Any]]) -> list[int]:
    """Every concurrency level any run's serve sweep measured, ascending: the ×c=N columns (a run's levels are
    `evaluate.serve_concurrency`, which runs may set differently)."""
    return sorted({int(c) for r in runs for c in (r.get("serve") or {}).get("speedup_by_concurrency") or {}})


def _category_lines(roots: list[Path], runs: list[dict[str, Any]]) -> list[str]:
    """τ per (benchmark, category) with one column per run, the same row preference as the benchmark columns
    (_live_tau): where the runs differ by MT-Bench category (coding vs writing) is what one τ per benchmark hides.
    Empty where no run grouped a benchmark by category."""
    cells: dict[tuple[str, str], dict[int, float | None]] = {}
    ngram = next((r for r in runs if _ngram_on_server(r)), None)  # the first run whose sweep had n-gram's server
    for i, r in enumerate(runs + ([ngram] if ngram else [])):
        for name, b in (r.get("tau_by_benchmark") or {}).items():
            for cat, g in (b.get("by_category") or {}).items():
                by = g.get("by_method") or {}
                cells.setdefault((name, cat), {})[i] = (by.get(NGRAM_SERVE) or {}).get("tau") if i == len(runs) \
                    else _live_tau(by)[1]
    if not cells:
        return []
    columns = [r.name for r in roots] + ([NGRAM_ROW] if ngram else [])
    rows = [[name, cat] + [taus.get(i) for i in range(len(columns))] for (name, cat), taus in cells.items()]
    return ["τ by benchmark category (one column per run; rows read as for the benchmark columns):", "",
            _table(["benchmark", "category", *columns], rows)]


def _ngram_on_server(results: dict[str, Any]) -> bool:
    return bool((results.get("by_method") or {}).get(NGRAM_SERVE))


def _ngram_row(results: dict[str, Any], benches: list[str], levels: list[int]) -> list[Any]:
    """vLLM's n-gram lookup as a row of its own, from a run that measured it: as a server of the serve sweep (τ
    serve, τ per benchmark, the speedup at each level) or in-process (τ vLLM only)."""
    by = results["by_method"]
    on_server = _ngram_on_server(results)
    ng = by[NGRAM_SERVE] if on_server else by[NGRAM]
    taus = {b: ((g.get("by_method") or {}).get(NGRAM_SERVE) or {}).get("tau")
            for b, g in (results.get("tau_by_benchmark") or {}).items()}
    speedup = ((results.get("serve") or {}).get("ngram") or {}).get("speedup_by_concurrency") or {}
    return [NGRAM_ROW, None, None, None, None if on_server else ng["tau"], ng["tau"] if on_server else None,
            *(taus.get(b) for b in benches), ng.get("tokens_per_step"), per_position(ng),
            *(speedup.get(str(c)) for c in levels), None, None]


def _drafter_row(root: Path, man: dict[str, Any], results: dict[str, Any], algorithm: str, label: str,
                 benches: list[str], levels: list[int]) -> list[Any]:
    """One drafter of one run: its validation EAL, τ by method and benchmark, tokens per step, per-position rates,
    its best setting's speedup per level, its training seconds."""
    by = results.get("by_method", {})
    m05 = man.get("05", {}).get("metrics", {})
    own05 = m05.get(algorithm) if isinstance(m05.get(algorithm), dict) else m05  # a run from before drafters
    row = serve_row(algorithm)
    eagle3 = algorithm == "eagle3"
    live = (by.get(VLLM) or by.get(EMBEDDED) or by.get(SERVE) or {}) if eagle3 else by.get(row) or {}
    taus = {b: _live_tau(g.get("by_method") or {}, algorithm)[1]
            for b, g in (results.get("tau_by_benchmark") or {}).items()}
    serve = results.get("serve") or {}
    speedup = {c: b["speedup"] for c, b in best_by_level(serve, algorithm).items()}
    if not speedup and eagle3:  # a sweep recorded without its settings: its own best per level
        speedup = serve.get("speedup_by_concurrency") or {}
    return [label, (man.get("02", {}).get("metrics", {}).get("layer_ids") or [None])[:-1] or None,
            own05.get("val_eal"), by.get(EMBEDDED, {}).get("tau") if eagle3 else None,
            by.get(VLLM, {}).get("tau") if eagle3 else None, by.get(row, {}).get("tau"),
            *(taus.get(b) for b in benches), live.get("tokens_per_step"), per_position(live),
            *(speedup.get(str(c)) for c in levels),
            _whole(own05.get("train_seconds") if own05 is not m05 else man.get("05", {}).get("seconds")),
            _whole(sum(m.get("seconds") or 0 for m in man.values())) if man else None]


def _whole(seconds: float | None) -> int | None:
    """Seconds as a whole number: the table's 3 decimals are for rates, not for minutes of training."""
    return None if seconds is None else round(seconds)


def pick_line(roots: list[Path], runs: list[dict[str, Any]]) -> str | None:
    """The first line: per concurrency level the fastest draft server over every run and drafter (output tokens/s
    with ÷ without, each against its own run's target alone), or none where nothing beats the target alone."""
    best: dict[str, tuple[float, str]] = {}
    for root, results in zip(roots, runs, strict=True):
        for c, cell in best_by_level(results.get("serve") or {}).items():
            if cell["speedup"] and cell["speedup"] > best.get(c, (0.0, ""))[0]:
                best[c] = (cell["speedup"], f"{root.name}: `{cell['setting']}`")
    if not best:
        return None
    parts = [f"{c}: {name} ×{x:.2f}" if x > 1 else f"{c}: no draft (best {name} ×{x:.2f})"
             for c, (x, name) in sorted(best.items(), key=lambda kv: int(kv[0]))]
    return "**Fastest server per concurrency level** — " + "; ".join(parts) + "."


def compare_runs(roots: list[Path]) -> str:
    """One table across runs, one row per drafter of each run (drafts trained on different layers, data, targets,
    settings or drafters; same held-out prompts when they share stage 02's eval split), plus vLLM's n-gram lookup
    from the first run that measured it, then τ by benchmark category: what `eagle3 compare` prints, under the
    fastest server per level (`pick_line`). Columns: τ per method, τ per benchmark any run measured, the serving
    speedup at each concurrency level any run's serve sweep measured (the drafter's best setting there). Only
    recorded numbers; what a run lacks shows as —."""
    runs = [_read_results(root) for root in roots]
    benches = list(dict.fromkeys(b for r in runs for b in r.get("tau_by_benchmark") or {}))
    levels = _levels(runs)
    rows, ngram, used = [], None, []
    for root, results in zip(roots, runs, strict=True):
        man = read_manifests(root)
        algorithms = drafters_of(results, man.get("05", {}).get("metrics", {}))
        for algorithm in algorithms:
            label = root.name if len(algorithms) == 1 else f"{root.name} ({algorithm})"
            rows.append(_drafter_row(root, man, results, algorithm, label, benches, levels))
        if read := _rows_used(results):
            used.append(f"{root.name}: {' + '.join(read)}")
        if ngram is None and (_ngram_on_server(results) or results.get("by_method", {}).get(NGRAM)):
            ngram = _ngram_row(results, benches, levels)
    header = ["draft", "aux layers", "val EAL (05)", "τ embedded", "τ vLLM", "τ serve", *(f"τ {b}" for b in benches),
              "tokens per step", "per position", *(f"×c={c}" for c in levels), "train s", "stages s"]
    note = ("τ = 1 + accepted / drafts (over the steps that drafted); τ serve = the real `vllm serve` with the draft, "
            "its /metrics counters over every concurrency level; tokens per step = generated / target forwards, "
            "from vLLM in-process where it ran, else the embedded decoder, else the server; per position = accepted "
            "at p / drafts. A drafter other than EAGLE-3 is measured by its server alone.")
    if benches:
        note += (f" τ <benchmark> and τ by category: EAGLE-3's `{COMPARE_LIVE[0]}` row where it has one, else "
                 f"{', else '.join(f'`{m}`' for m in COMPARE_LIVE[1:])} (rows read: {'; '.join(used)}); another "
                 "drafter's server row.")
    if levels:
        note += (" ×c=N = output tokens/s with the draft ÷ without it, `vllm serve` at concurrency N "
                 "(the serve step's sweep; at that level's best setting of the drafter).")
    out = [pick, ""] if (pick := pick_line(roots, runs)) else []
    out += [_table(header, rows + ([ngram] if ngram else [])), "", note]
    for extra in (held_out_note(roots, runs), servers_note(roots, runs)):
        if extra:
            out += ["", extra]
    cats = _category_lines(roots, runs)
    return "\n".join(out + ([""] + cats if cats else []))


def held_out_note(roots: list[Path], runs: list[dict[str, Any]]) -> str | None:
    """A warning where the runs asked different held-out prompts (stage 06's `held_out_digest`), or where some runs
    recorded theirs and some predate it (not known to match): their held-out τ columns do not compare, the
    benchmarks' do. Runs that all predate it say nothing, as before."""
    digests = {root.name: r.get("held_out_digest") for root, r in zip(roots, runs, strict=True) if r}
    known = {d for d in digests.values() if d}
    if not (len(known) > 1 or known and None in digests.values()):
        return None
    groups: dict[str | None, list[str]] = {}
    for name, d in digests.items():
        groups.setdefault(d, []).append(name)
    sets = "; ".join(f"{', '.join(names)}: {d or 'not recorded'}" for d, names in groups.items())
    return (f"**The held-out prompts differ or are not known to match** (stage 06's held_out_digest: {sets}): the "
            "τ embedded / vLLM / serve columns of those runs do not compare; the benchmark columns do (the same "
            "questions).")


def servers_note(roots: list[Path], runs: list[dict[str, Any]]) -> str | None:
    """A warning where the runs' serve sweeps measured their servers differently, some side by side on one GPU and
    some each alone (results["serve"]["side_by_side"]): their ×c=N columns do not compare, and only alone is what a
    deployment gets (docs/serving.md#the-card-and-a-plain-server)."""
    groups: dict[bool, list[str]] = {}
    for root, r in zip(roots, runs, strict=True):
        if (r.get("serve") or {}).get("speedup_by_concurrency"):
            groups.setdefault(bool(r["serve"].get("side_by_side")), []).append(root.name)
    if len(groups) < 2:
        return None
    return (f"**The servers were measured differently**: side by side on one GPU in {', '.join(groups[True])}; each "
            f"alone in {', '.join(groups[False])}. Their ×c=N columns do not compare; each alone is what a deployment "
            "gets.")
