"""The run's report card: `report.md` at the run root, the page a person reads first.

Why a separate module: it reads every manifest the run wrote (tolerating the optional ones that are missing, e.g.
a run that skipped stage 03) and stage 06's results, and it must not fail a run because one number is absent.
It reports what each stage recorded, never recomputes it: target, data, layer ids, extraction throughput, the
training curves' summary, tau by method, the serve step's verdict and serving speedup (opening the card when the
serve step ran: see serve_report), versions and the wall time of every stage.
"""

from __future__ import annotations

import json
import math
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3lib.common import atomic
from eagle3lib.common.rundir import RunDir, manifest_file
from eagle3lib.common.stages import ALL_STAGES, EXECUTED_NOTEBOOKS_ENV
from eagle3lib.evaluate import serve_report
from eagle3lib.evaluate.keys import (
    BENCH_ALL,
    BENCH_PATH,
    EMBEDDED,
    HELD_OUT,
    HELDOUT_ALL,
    HELDOUT_PATH,
    LIVE,
    NGRAM,
    NGRAM_SERVE,
    OFFLINE_ROWS,
    VLLM,
    serve_row,
)

if TYPE_CHECKING:
    from eagle3lib.common.config import TrainSection


def per_position(acceptance: dict[str, Any]) -> str | None:
    """Per-position acceptance rates as the report's tables write them ("0.61 / 0.39 / 0.27"); None without any."""
    rates = acceptance.get("per_pos_rate")
    return " / ".join(f"{r:.2f}" for r in rates) if rates else None


def read_manifests(rd: RunDir | Path) -> dict[str, dict[str, Any]]:
    """Every manifest present, by stage id, read as-is (no config-hash check: the report shows what is there)."""
    root = rd.root if isinstance(rd, RunDir) else Path(rd)
    out: dict[str, dict[str, Any]] = {}
    for stage in ALL_STAGES:
        path = manifest_file(root, stage)
        if path.is_file():
            try:
                out[stage.id] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
    return out


def stage_seconds(rd: RunDir | Path) -> dict[str, float | None]:
    """Each present manifest's stage seconds, by stage key ("02_extract_hidden_states"): the benchmarks' stage times
    (benchmarks/data_curve.py, benchmarks/hidden_state_modes.py)."""
    return {m["stage"]: m.get("seconds") for m in read_manifests(rd).values()}


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        return f"{v:,.{digits}f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _divergence_lines(results: dict[str, Any]) -> list[str]:
    """Why the embedded decoder's outputs differ from the target alone, where they do: each first difference was
    checked against the target's logits (decoder.first_divergence)."""
    emb = results.get(EMBEDDED) or {}
    differ = (emb.get("prompts") or 0) - (emb.get("identical") or 0)
    if not emb or differ <= 0:
        return []
    dtype = str(results.get("dtype")).removeprefix("torch.")
    ties, otherwise = emb.get("differ_at_a_tie"), emb.get("differ_otherwise")
    exact = dtype == "float32"
    line = "" if exact else (f"In {dtype}, greedy decoding depends on the kernels: verifying k+1 tokens in one "
                             "forward rounds differently from one token at a time, and a near-tie can then flip. ")
    if ties is not None:
        line += (f"Of the {differ} embedded outputs that differ from the target alone, **{ties} first differ at a "
                 "rounding tie** (both tokens within rounding of the target's top logit there)")
        line += "." if not otherwise else (f"; **{otherwise} do not: there the target does not rank the decoder's "
                                           "token near the top, which is a decoder bug, not rounding** (see "
                                           "`embedded.divergences` in eval/results.json).")
    other = (results.get(VLLM) or {}).get("identical_to_embedded")
    if other is not None:
        line += f" vLLM's plain greedy and the embedded decoder agree on {other}/{emb.get('prompts')} prompts."
    return [line + ("" if exact else " The decoder is exact in float32 (tests/unit/test_evaluate.py)."), ""]


def summary_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: tau, tokens per step (live methods), draft acceptance rate, per-position rates, drafts:
    the report card's acceptance table, and what notebook 06 shows."""
    return [{"method": name, "tau": a["tau"], "tokens_per_step": a.get("tokens_per_step"),
             "draft_acceptance_rate": a["draft_acceptance_rate"], "per_pos_rate": a["per_pos_rate"],
             "drafts": a["drafts"]} for name, a in results.get("by_method", {}).items()]


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def method_rows(have: Any) -> list[str]:
    """The τ rows in `have` (a set or a by-method dict) that the benchmark and held-out tables show, in order: the
    drafts' rows first (EAGLE-3's embedded decoder and server, then each other drafter's server row, `serve_row`:
    "vllm serve dflash", so that a run without an EAGLE-3 draft still gets its columns), then n-gram lookup's server
    and the offline replays."""
    from eagle3lib.common.drafters import DRAFTERS

    order = (EMBEDDED, *(serve_row(a) for a in DRAFTERS), NGRAM_SERVE, BENCH_PATH, BENCH_ALL)  # EAGLE-3's: SERVE
    return [m for m in order if m in have]


def benchmark_table(results: dict[str, Any], dedup: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """τ by prompt set: the held-out split first (for comparison), then each of `evaluate.benchmarks`, with its
    questions, prompts (MT-Bench: 2 per question), the training conversations stage 02 dropped as overlapping it
    (`dedup`: stage 02's counts; benchmarks carry their own) and τ of the embedded decoder and the offline replays:
    the report card's table and what notebook 06 shows."""
    benches = results.get("tau_by_benchmark") or {}
    if not benches:
        return []
    by = results.get("by_method", {})
    held = {**{m: by.get(m) for m in method_rows(by)},  # the same rows as the benchmarks, read from the held-out
            BENCH_PATH: by.get(HELDOUT_PATH), BENCH_ALL: by.get(HELDOUT_ALL)}  # prompts' own (the offline ones renamed)
    sets = [(HELD_OUT, results.get("prompts"), results.get("prompts"), (dedup or {}).get("held_out"), held)]
    sets += [(name, b.get("questions"), b.get("prompts"), b.get("dedup_dropped"), b["by_method"])
             for name, b in benches.items()]
    methods = bench_methods(benches)
    live = next((m for m in methods if m not in (NGRAM_SERVE, BENCH_PATH, BENCH_ALL)), None)  # a draft that decoded
    return [{"prompt set": name, "questions": q, "prompts": n, "dropped from training": d,
             **{f"τ {m}": (accs.get(m) or {}).get("tau") for m in methods},
             **({f"per position ({live})": per_position(accs.get(live) or {})} if live else {})}
            for name, q, n, d, accs in sets]


def held_out_group_table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out prompts' τ per source (or category: `inputs.held_out_groups`), one column per method that
    measured them (the embedded decoder; the draft's and n-gram lookup's servers, from the outputs pass), and the
    per-position rates of the first; [] without groups."""
    groups = (results.get("held_out_groups") or {}).get("groups") or {}
    methods = method_rows({m for g in groups.values() for m in g["by_method"]})
    by = (results.get("held_out_groups") or {}).get("by")
    return [{by: label, "prompts": g["prompts"],
             **{f"τ {m}": (g["by_method"].get(m) or {}).get("tau") for m in methods},
             f"per position ({methods[0]})": per_position(g["by_method"].get(methods[0]) or {})}
            for label, g in groups.items()] if methods else []


def bench_methods(benches: dict[str, Any]) -> list[str]:
    """The method rows the benchmarks were measured with (`method_rows`)."""
    return method_rows({m for b in benches.values() for m in b.get("by_method", {})})


def benchmark_lines(results: dict[str, Any], m02: dict[str, Any]) -> list[str]:
    """The report card's benchmark section: τ by benchmark, then by category and by turn."""
    rows = benchmark_table(results, (m02.get("data") or {}).get("dedup"))
    if not rows:
        return []
    benches = results["tau_by_benchmark"]
    out = [f"τ by benchmark (k = {results.get('k')}; each benchmark's later turns asked after the target's own "
           "greedy answers; *dropped from training* = training conversations stage 02 removed as overlapping its "
           "prompts):", "", _table(list(rows[0]), [list(r.values()) for r in rows]), ""]
    methods = [m for m in bench_methods(benches) if m != BENCH_ALL]
    taus = [f"τ {m}" for m in methods]
    rows = [[name, cat, g["prompts"]] + [g["by_method"].get(m, {}).get("tau") for m in methods]
            for name, b in benches.items() for cat, g in b.get("by_category", {}).items()]
    out += ["τ by benchmark category:", "", _table(["benchmark", "category", "prompts", *taus], rows), ""]
    rows = [[name, f"turn {t}", g["prompts"]] + [g["by_method"].get(m, {}).get("tau") for m in methods]
            for name, b in benches.items() if len(b.get("by_turn", {})) > 1 for t, g in b["by_turn"].items()]
    if rows:
        out += ["τ by turn (turn 2 follows the target's own answer to turn 1):", "",
                _table(["benchmark", "turn", "prompts", *taus], rows), ""]
    return out


def curves_summary(path: Path) -> list[str]:
    """A few lines from stage 05's curves.json: first and last validation acceptance length and loss, step count."""
    try:
        curves = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, TypeError):
        return []
    lines = []
    val = curves.get("val") or []
    steps = curves.get("steps") or []
    if steps:
        lines.append(f"- optimizer steps: {_fmt(steps[-1].get('step'))}; train loss "
                     f"{_fmt(steps[0].get('loss'))} → {_fmt(steps[-1].get('loss'))}")
    if val:
        first, last = val[0], val[-1]
        lines.append(f"- validation expected acceptance length: {_fmt(first.get('eal'))} "
                     f"(epoch {first.get('epoch')}) → {_fmt(last.get('eal'))} (epoch {last.get('epoch')}); "
                     f"loss {_fmt(first.get('loss'))} → {_fmt(last.get('loss'))}")
    return lines


def training_lines(rd: RunDir, m05: dict[str, Any]) -> list[str]:
    """Stage 05 on the card: per drafter its curves' first and last validation point, the optimizer, and one table
    of every drafter's headline numbers (a column each)."""
    if not m05:
        return ["(stage 05 has not run)", ""]
    from eagle3lib.common.drafters import title

    metrics, outputs = m05.get("metrics", {}), m05.get("outputs", {})
    algorithms = metrics.get("algorithms") or []
    out = []
    for algorithm in algorithms:
        curves = outputs.get(f"curves_{algorithm}")
        lines = curves_summary(rd.root / curves if curves and not Path(curves).is_absolute() else Path(curves or ""))
        out += [f"- **{title(algorithm)}**:", *(f"  {line}" for line in lines)] if len(algorithms) > 1 else lines
    out += optimizer_summary(metrics.get("resolved") or {}, rd.cfg.train)
    out += [f"- {title(a)} over those (train.drafter_settings): " + ", ".join(f"{k} {v}" for k, v in own.items())
            for a, own in rd.cfg.train.drafter_settings.items() if a in algorithms and own]
    names = list(dict.fromkeys(k for a in algorithms for k in metrics.get(a) or {}))
    if names:
        out += ["", _table(["metric", *(title(a) for a in algorithms)],
                           [[k, *((metrics.get(a) or {}).get(k) for a in algorithms)] for k in names])]
    return [*out, ""]


def optimizer_summary(resolved: dict[str, Any], tcfg: TrainSection) -> list[str]:
    """One line: the optimizer stage 05 resolved (with why, where `train.optimizer` was auto) and its schedule; none
    for a draft trained elsewhere (benchmarks/peers.py's CLI arm) or before the optimizer was resolved."""
    name = resolved.get("optimizer")
    if not name:
        return []
    why = next((r.split(": ", 1)[1] for r in resolved.get("reasons") or [] if r.startswith(f"optimizer {name}: ")), "")
    warmup = (f"{tcfg.warmup_steps} warm-up steps" if tcfg.warmup_steps is not None
              else f"warm-up {tcfg.warmup_ratio:g} of the steps" if tcfg.warmup_ratio is not None
              else "speculators' 1% warm-up")
    return [f"- optimizer: {name}" + (f" (auto: {why})" if tcfg.optimizer == "auto" and why else "") +
            f"; lr {tcfg.lr:g}, weight decay {tcfg.weight_decay:g}, {tcfg.scheduler} schedule, {warmup}"]


def _shard_format(m02: dict[str, Any]) -> str:
    """How stage 02 stored the states: FP8 shards hold e4m3 values and a scale per token whatever the target's
    dtype (docs/capture.md#fp8-hidden-state-shards); bf16 shards hold the target's dtype."""
    if m02.get("fp8_shards"):
        return f"FP8 e4m3 + a float32 scale per token, from {m02.get('dtype')}"
    return str(m02.get("dtype"))


def _probe_line(rd: RunDir) -> str:
    """Stage 02's capture probe in one line (eagle3lib.extract.probe: capture_probe.json at the run root)."""
    from eagle3lib.extract.probe import read_report, summary_line

    return summary_line(read_report(rd.root))


def _demo_scale_note(man: dict[str, dict[str, Any]]) -> list[str]:
    """What a draft trained on the CPU is and is not (every CPU run is demo scale: tens to hundreds of rows in minutes),
    with where the GPU recipes' figures are. The serve step's own note (serve_report.headline) says it for speeds."""
    m05 = man.get("05", {}).get("metrics", {})
    if (m05.get("resolved") or {}).get("device") != "cpu":
        return []
    m02 = man.get("02", {}).get("metrics", {})
    return [f"> **Demo-scale draft**: trained on the CPU on {_fmt(m02.get('samples'))} conversations "
            f"({_fmt(m02.get('tokens'))} tokens). It shows that every stage runs and checks itself end to end, not "
            "what a draft can do: expect τ near 1 and no speedup at this scale (acceptance grows with the data; the "
            "GPU recipes train on ~7M tokens and reach τ 1.5-2.4 in vLLM). The GPU recipes' report cards are "
            f"committed under `{serve_report.GPU_CARDS}` (`recipe_*_report.md`; every result by date: "
            "docs/results.md).",
            ""]


def build_report(rd: RunDir, results: dict[str, Any] | None = None, stage06_seconds: float | None = None) -> str:
    man = read_manifests(rd)
    latest = max(man.values(), key=lambda m: m.get("finished_at", "")) if man else {}
    out: list[str] = [f"# Report card: run `{rd.cfg.run.name}`", ""]
    out += serve_report.headline((results or {}).get("serve"))  # first: the verdict, serve this draft or not
    out += _demo_scale_note(man)
    out.append(f"Written {datetime.now(UTC).isoformat(timespec='seconds')} · git {latest.get('git_sha') or '—'} · "
               f"host {latest.get('host') or '—'} · folder `{rd.root}`")
    out.append("")
    out += _headline(results) if results else []
    out += ["## Target and data", "", _target_and_data(rd, man), ""]
    out += ["## Training (stage 05)", "", *training_lines(rd, man.get("05", {}))]
    out += ["## Acceptance (stage 06)", ""]
    out += _acceptance(rd, results, man.get("02", {}).get("metrics", {})) if results else ["(stage 06 has not run)", ""]
    out += _wall_time_and_versions(rd, man, latest, stage06_seconds)
    return "\n".join(out)


def _headline(results: dict[str, Any]) -> list[str]:
    """τ by method (each drafter's server first), n-gram lookup's tokens per step, the live methods' speed ratios,
    and the methods this run could not measure."""
    out: list[str] = []
    by = results.get("by_method", {})
    decoders = (VLLM, EMBEDDED, HELDOUT_PATH, OFFLINE_ROWS)  # the methods that draft evaluate.k tokens
    # a run whose servers alone measured (a DFlash draft serves its block, k = 15) names no k: each setting has its own
    head = [f"**k = {results.get('k')}**"] if any(name in by for name in decoders) else []
    serve_rows = [serve_row(a) for a in results.get("drafts") or {"eagle3": None}]
    for name in (*serve_rows, *decoders):
        if name in by:
            head.append(f"τ {name}: **{by[name]['tau']:.2f}**")
    ngram = by.get(NGRAM_SERVE) or by.get(NGRAM) or {}
    if ngram.get("tokens_per_step"):  # its tau counts only the steps where a match was found
        head.append(f"n-gram lookup (no draft): **{ngram['tokens_per_step']:.2f}** tokens per target step")
    for name, what in ((VLLM, "batch throughput ratio (every prompt in one batch, eager)"),
                       (EMBEDDED, "tokens/s ratio (batch 1)")):
        r = results.get(name)
        if r and r.get("speedup"):  # not a serving speedup: that is the serve step's (above)
            head.append(f"{name} {what}: **×{r['speedup']:.2f}** ({r['identical']}/{r['prompts']} outputs "
                        "identical to the target alone)")
    out += [" · ".join(head), ""]
    if results.get("methods_skipped"):  # a method that could not follow any drafter this run trained
        out += ["Not measured: " + "; ".join(f"`{m}` ({why})" for m, why in results["methods_skipped"].items())
                + ". Every drafter is measured by `serve`.", ""]
    return out


def _target_and_data(rd: RunDir, man: dict[str, dict[str, Any]]) -> str:
    """The target and what stage 02 captured, one table."""
    m02 = man.get("02", {}).get("metrics", {})
    o02 = man.get("02", {}).get("outputs", {})
    rows = [["target", o02.get("model_dir") or rd.cfg.target.model],
            ["decoder layers / hidden / vocab", f"{_fmt(m02.get('num_layers'))} / {_fmt(m02.get('hidden_size'))} / "
                                                f"{_fmt(m02.get('vocab_size'))}"],
            ["layer ids (aux + final)", m02.get("layer_ids")],
            ["conversations (train rows / validation rows)",
             f"{_fmt(m02.get('samples'))} ({_fmt(m02.get('train_rows'))} / {_fmt(m02.get('val_rows'))})"],
            ["tokens captured", m02.get("tokens")],
            ["hidden states on disk", f"{m02['bytes'] / 2**20:,.1f} MiB ({_shard_format(m02)})"
                if isinstance(m02.get("bytes"), int | float) else None],
            ["extraction throughput (tokens/s)", m02.get("tokens_per_s")],
            ["capture probe (stage 02, before the first shard)", _probe_line(rd)]]
    for name, b in (m02.get("benchmarks") or {}).items():
        rows.append([f"benchmark {name} ({b.get('source')})",
                     f"{_fmt(b.get('questions'))} questions, {_fmt(b.get('prompts'))} prompts; "
                     f"{_fmt(b.get('dedup_dropped'))} training conversations dropped as overlapping it"])
    dedup = (m02.get("data") or {}).get("dedup")
    if dedup:
        rows.append(["training conversations dropped as overlapping an evaluation prompt",
                     f"{_fmt(dedup.get('total'))} (held-out split: {_fmt(dedup.get('held_out'))})"])
    m04 = man.get("04", {}).get("metrics", {})
    if m04:
        rows.append(["draft vocabulary (coverage of train tokens)",
                     f"{_fmt(m04.get('draft_vocab_size'))} ({_fmt(m04.get('coverage'))})"])
    return _table(["", ""], rows)


def _acceptance(rd: RunDir, results: dict[str, Any], m02: dict[str, Any]) -> list[str]:
    """Stage 06's tables: τ by method, by held-out group and benchmark, τ vs k, speed, the serving table, figures."""
    out: list[str] = []
    out.append(f"Prompts: {results.get('prompt_source')}; up to {results.get('max_new_tokens')} new tokens each, "
               f"greedy. τ = 1 + accepted / drafts; per-position rate = accepted at p / drafts; tokens per "
               f"step = generated / target forwards (live methods; the fair figure for n-gram lookup, whose τ "
               f"counts only the steps where it found a match and drafted).")
    out.append("")
    rows = [[r["method"], r["tau"], r["tokens_per_step"], r["draft_acceptance_rate"], per_position(r),
             r["drafts"]] for r in summary_table(results)]
    out += [_table(["method", "τ", "tokens per step", "draft acceptance", "per position", "drafts"], rows), ""]
    rows = held_out_group_table(results)
    if rows:
        by = results["held_out_groups"]["by"]
        kinds = {"source": "sources", "category": "categories"}.get(by, by)
        out += [f"τ on the held-out prompts by {by} (the {kinds} a draft falls short on: the data to add; a few "
                "prompts each, so a rough guide):", "", _table(list(rows[0]), [list(r.values()) for r in rows]), ""]
    out += benchmark_lines(results, m02)
    sweep = results.get("sweep", {})
    if sweep:
        ks = sorted({int(k) for s in sweep.values() for k in s})
        out += ["τ vs k:", "", _table(["method"] + [f"k={k}" for k in ks],
                                      [[n] + [s.get(str(k), {}).get("tau") for k in ks] for n, s in sweep.items()]),
                ""]
    rows = []
    for name in LIVE:
        r = results.get(name)
        if r:
            rows.append([name, r.get("baseline_tokens_per_s"), r.get("spec_tokens_per_s"), r.get("speedup"),
                         f"{r.get('identical')}/{r.get('prompts')}"])
    if rows:
        out += ["Speed (generated tokens/s, greedy, same prompts; embedded is batch 1, vLLM in-process batches "
                "them all, eager: a batch throughput ratio, not the speedup a server sees, which is the serving "
                "table's):", "", _table(["engine", "target alone", "with draft", "with ÷ without",
                                          "identical outputs"], rows), ""]
        out += _divergence_lines(results)
    out += serve_report.section(results.get("serve"))
    figs = sorted(rd.path("figures").glob("06_*.png"))
    out += [f"![{f.stem}](figures/{f.name})" for f in figs]
    out.append("")
    return out


def _wall_time_and_versions(rd: RunDir, man: dict[str, dict[str, Any]], latest: dict[str, Any],
                            stage06_seconds: float | None) -> list[str]:
    """The wall time of each stage (stage 06's own before its manifest), the package versions, the notebooks."""
    out: list[str] = ["## Wall time of each stage", ""]
    rows = []
    for stage in ALL_STAGES:
        m = man.get(stage.id)
        if m:
            rows.append([stage.key, m.get("seconds"), m.get("finished_at")])
        elif stage.id == "06" and stage06_seconds is not None:
            rows.append([stage.key, round(stage06_seconds, 2), "(this run, before its manifest)"])
    total = sum(r[1] for r in rows if isinstance(r[1], int | float))
    rows.append(["total", round(total, 2), ""])
    out += [_table(["stage", "seconds", "finished"], rows), "", "## Versions", ""]
    vers = latest.get("versions", {})
    out += [_table(["package", "version"], [["python", latest.get("python")]] + [[k, v] for k, v in vers.items()]), ""]
    nbs = sorted(rd.path("notebooks").glob("*.ipynb"))
    if nbs:
        out += ["Executed notebooks: " + ", ".join(f"[{p.stem}](notebooks/{p.name})" for p in nbs), ""]
    return out


def report_for_notebook(report: Path) -> str:
    """report.md as notebook 06 shows it: its links to the run's figures and notebooks (relative to the run folder)
    made relative to where the notebook is read, so its images show: the run's notebooks/ folder for an executed
    copy (a headless run, whose runner names it in stages.EXECUTED_NOTEBOOKS_ENV), else the kernel's folder (JupyterLab starts a
    kernel in its notebook's folder)."""
    base = Path(os.environ.get(EXECUTED_NOTEBOOKS_ENV) or Path.cwd())
    rel = Path(os.path.relpath(Path(report).parent.resolve(), base.resolve())).as_posix()
    return re.sub(r"\]\((figures|notebooks)/", lambda m: f"]({rel}/{m.group(1)}/", Path(report).read_text())


def write_report(rd: RunDir, results: dict[str, Any] | None = None, stage06_seconds: float | None = None) -> Path:
    return atomic.write_text(rd.path("report.md"), build_report(rd, results, stage06_seconds))
