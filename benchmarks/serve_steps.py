"""Benchmark (not a test): how long one `vllm serve` step takes at each number of requests in flight, from what stage
06's sweep already saved. Why: a server's output tokens/s at a concurrency level hides the steps it is made of; a
step that is twice as slow at 4 requests as at 3 and 6 is a batch size without its CUDA graph, not a slow draft.

Stage 06 runs `vllm bench serve --save-detailed`, whose result files (`<run>/eval/serve/<server>_c<level>.json`)
hold every request's start time, time to first token and inter-token latencies. Replayed on one time axis, each
inter-token interval is counted at the number of requests in flight at its midpoint (started, last token not yet
out); the median interval per count is the step time at that batch size (a draft's step puts out 1 + accepted
tokens per request in one streamed chunk, so its intervals are steps too). Per server, all its levels' files
together:

    python benchmarks/serve_steps.py outputs/RUN --out benchmarks/results/serve_steps_RUN.json --png ...png \
        --note "what ran, where, at which commit"
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

LEVEL_FILE = re.compile(r"^(?P<server>.+)_c(?P<level>\d+)\.json$")


def intervals_by_in_flight(bench: dict) -> dict[int, list[float]]:
    """Every inter-token interval (ms) of one `vllm bench serve --save-detailed` result, by requests in flight at
    its midpoint."""
    spans, marks = [], []
    for start, ttft, itls in zip(bench["start_times"], bench["ttfts"], bench["itls"], strict=True):
        t = [start + ttft]
        for gap in itls:
            t.append(t[-1] + gap)
        spans.append((start, t[-1]))
        marks.append(t)
    out: dict[int, list[float]] = defaultdict(list)
    for t in marks:
        for a, b in zip(t, t[1:], strict=False):
            mid = (a + b) / 2
            out[sum(s <= mid <= e for s, e in spans)].append((b - a) * 1000)
    return out


def server_steps(serve_dir: Path) -> dict[str, dict[str, dict[str, float]]]:
    """{server: {in flight: {"median_ms", "p90_ms", "intervals"}}} over every level file of each server."""
    pooled: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(serve_dir.glob("*_c*.json")):
        m = LEVEL_FILE.match(f.name)
        bench = json.loads(f.read_text()) if m else {}
        if not m or "itls" not in bench:
            continue  # not a level's result, or one saved without --save-detailed
        for n, gaps in intervals_by_in_flight(bench).items():
            pooled[m["server"]][n] += gaps
    return {server: {str(n): {"median_ms": round(statistics.median(g), 2),
                              "p90_ms": round(statistics.quantiles(g, n=10)[-1], 2) if len(g) > 1 else g[0],
                              "intervals": len(g)}
                     for n, g in sorted(by.items()) if n > 0}
            for server, by in sorted(pooled.items())}


def plot(steps: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for server, by in steps.items():
        ns = [int(n) for n in by if by[n]["intervals"] >= 5]  # a count seen a few times only is noise
        ax.plot(ns, [by[str(n)]["median_ms"] for n in ns], marker="o", label=server)
    ax.xaxis.get_major_locator().set_params(integer=True)  # requests are whole
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("median time per step (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110, bbox_inches="tight")  # a legend of long labels stays whole
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run's folder (outputs/RUN) or its eval/serve folder")
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--png", type=Path, help="the figure: median step time against requests in flight, per server")
    ap.add_argument("--note", default="", help="date, commit, machine and command of the run the files come from")
    args = ap.parse_args()
    serve_dir = args.run / "eval" / "serve" if (args.run / "eval" / "serve").is_dir() else args.run
    steps = server_steps(serve_dir)
    if not steps:
        raise SystemExit(f"no `vllm bench serve --save-detailed` results (*_c<level>.json) in {serve_dir}")
    args.out.write_text(json.dumps({"benchmark": "serve_steps", "source": str(serve_dir), "note": args.note,
                                    "steps_by_server": steps}, indent=1) + "\n")
    if args.png:
        plot(steps, args.png, f"time per step by batch size: {args.run.name}")
    for server, by in steps.items():
        print(server, " ".join(f"{n}:{v['median_ms']}" for n, v in by.items() if v["intervals"] >= 5))


if __name__ == "__main__":
    main()
