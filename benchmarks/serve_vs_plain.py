"""Benchmark (not a test): a finished stage 06's serve figure at concurrency 1 against one plain `vllm serve`.

    python benchmarks/serve_vs_plain.py --run-dir outputs/RUN --out serve_vs_plain_<target>_<machine>.json \
        [--drafter eagle3] [--max-tokens 256] --note "date, commit, machine, command"

Why: a report card's speedup and a user's own server can disagree. On the 4x 1.5B recipe the card said x1.22 at
concurrency 1 and one plain server x1.57 on other prompts at 256 tokens (docs/serving.md#the-card-and-a-plain-server).
This measures, on one machine and with the card's own prompts, two plain servers one after another, each alone: the
target with and without the drafter's speculative config. They take no flags but --dtype, the scheduler room a
one-forward drafter needs (drafters.server_flags) and --enforce-eager on a CPU. A plain client drives them: one
streamed request after another, greedy, no `vllm bench serve`. It runs at the card's max tokens and at each of
--max-tokens, and writes the card's own figures beside them, so what differs (the setup and client, the tokens a
request) is one row apart. Per request it records TTFT, TPOT and tokens; the figure is output tokens/s over the
whole sequence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def card_figures(results: dict[str, Any], drafter: str) -> dict[str, Any]:
    """The card's concurrency-1 row for the drafter's first setting: tokens/s, TTFT, TPOT and tokens with and without
    the draft, their ratios, and what its plain servers need to serve the same (target, dtype, speculative config)."""
    serve = results["serve"]
    label = (serve.get("firsts") or {}).get(drafter) or next(
        n for n, st in serve["settings"].items() if st.get("algorithm", "eagle3") == drafter)
    st = serve["settings"][label]
    level = st["by_level"][str(min(serve["concurrency"]))]
    spec_row = level["draft"] if "draft" in level else level["eagle3"]  # cards from EAGLE-3-only versions

    def side(x: dict[str, Any]) -> dict[str, Any]:
        return {"output_tok_s": x["output_throughput"], "ttft_ms": x["ttft_ms"]["mean"], "tpot_ms": x["tpot_ms"]["mean"],
                "tokens_per_request": x["total_output_tokens"] / x["completed"]}

    argv = st["command"]["argv"]
    return {"setting": label, "concurrency": min(serve["concurrency"]), "max_tokens": serve["max_tokens"],
            "speedup": level["output_tok_s_ratio"], "tpot_ratio": level["tpot_ratio"], "tau": level["tau"],
            "draft": side(spec_row), "baseline": side(level["baseline"]),
            "target": argv[argv.index("serve") + 1], "dtype": argv[argv.index("--dtype") + 1],
            "speculative_config": st["speculative_config"], "side_by_side": serve.get("side_by_side")}


def plain_args(target: str, dtype: str, spec: dict[str, Any] | None, cpu: bool) -> list[str]:
    """`vllm serve` as a user starts it: vLLM's defaults but the dtype, a draft's speculative config and the room
    a one-forward drafter needs to start, and eager mode on a CPU (compiling there adds minutes a start)."""
    from eagle3lib.common import drafters

    args = [target, "--dtype", dtype, *(["--enforce-eager"] if cpu else [])]
    return args if spec is None else [*args, "--speculative-config", json.dumps(spec), *drafters.server_flags(spec)]


def streamed(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One greedy streamed completion: seconds to the first token and in all, and the tokens it wrote."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "add_special_tokens": False}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t0, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or []):
                first = time.perf_counter()
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "e2e_s": end - t0, "tokens": tokens}


def drive(server: Any, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """The prompts one after another (concurrency 1) at max_tokens: output tokens/s over the whole sequence, and the
    mean TTFT and TPOT of its requests."""
    t0 = time.perf_counter()
    runs = [streamed(server.url, server.model, p, max_tokens) for p in prompts]
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in runs)
    tpots = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in runs if r["tokens"] > 1]
    return {"output_tok_s": tokens / wall, "ttft_ms": 1000 * sum(r["ttft_s"] for r in runs) / len(runs),
            "tpot_ms": 1000 * sum(tpots) / max(len(tpots), 1), "tokens_per_request": tokens / len(runs),
            "requests": len(runs), "seconds": wall}


def measure(card: dict[str, Any], prompts: list[str], lengths: list[int], workdir: Path) -> dict[str, Any]:
    """Each plain server alone (the target alone's first), warmed by one request, then driven at each length."""
    from eagle3lib.common.device import on_cpu
    from eagle3lib.evaluate.server import VllmServer

    out: dict[str, Any] = {}
    for name, spec in (("baseline", None), ("draft", card["speculative_config"])):
        args = plain_args(card["target"], card["dtype"], spec, on_cpu())
        with VllmServer(args, name=f"plain_{name}", workdir=workdir, cache_dir=workdir / "cache") as server:
            streamed(server.url, server.model, prompts[0], 8)
            out[name] = {"argv": args, "start_s": server.start_s,
                         **{str(n): drive(server, prompts, n) for n in lengths}}
    return out


def compare(card: dict[str, Any], plain: dict[str, Any], lengths: list[int]) -> dict[str, Any]:
    """Per length, the plain servers' speedup and TPOT ratio beside the card's."""
    rows = {"card": {"max_tokens": card["max_tokens"], "speedup": card["speedup"], "tpot_ratio": card["tpot_ratio"]}}
    for n in lengths:
        d, b = plain["draft"][str(n)], plain["baseline"][str(n)]
        rows[f"plain_{n}"] = {"max_tokens": n, "speedup": round(d["output_tok_s"] / b["output_tok_s"], 4),
                              "tpot_ratio": round(b["tpot_ms"] / d["tpot_ms"], 4) if d["tpot_ms"] else None}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="a run whose stage 06 ran the serve method")
    ap.add_argument("--drafter", default="eagle3", help="which of the run's drafters (its first setting)")
    ap.add_argument("--max-tokens", type=int, nargs="*", default=[256], help="lengths beside the card's own")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    from eagle3lib.common import atomic

    card = card_figures(json.loads((a.run_dir / "eval" / "results.json").read_text()), a.drafter)
    prompts = [json.loads(line)["prompt"] for line in (a.run_dir / "eval" / "serve" / "prompts.jsonl").open()]
    lengths = list(dict.fromkeys([card["max_tokens"], *a.max_tokens]))
    plain = measure(card, prompts, lengths, a.run_dir / "eval" / "serve_vs_plain")
    out = {"note": a.note, "run": a.run_dir.name, "card": card, "plain": plain, "compare": compare(card, plain, lengths)}
    atomic.write_json(a.out, out)
    print(json.dumps(out["compare"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
