"""Live acceptance in vLLM: serve the target with (or without) the EAGLE-3 draft and read vLLM's own counters.

Run as a subprocess so a notebook kernel never holds an engine (and its threads, sockets, memory):

    python -m eagle3lib.evaluate.vllm_child --job job.json --out result.json

job.json: {"target": DIR, "draft": DIR or null, "k": 3, "prompt_token_ids": [[...], ...], "max_new_tokens": 48,
           "dtype": "float32", "max_model_len": 1024, "gpu_memory_utilization": 0.85}
result.json: {"outputs": [[token ids], ...], "seconds": generate wall time, "generated_tokens": n,
              "tokens_per_s": n / seconds, "engine_start_s": ..., "acceptance": {drafts, draft_tokens, accepted,
              per_pos} or null}

The counters (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, the vector
_num_accepted_tokens_per_pos) accumulate over the engine's life, so we subtract a snapshot taken right before the
timed generate. One warm-up request runs first so the timing does not include first-call costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SPEC_PREFIX = "vllm:spec_decode_"
# where the child runs: `python -m` puts its cwd first on sys.path, and from inside eagle3lib/ its evaluate/, train/,
# config.py would shadow the packages of those names that vLLM's dependencies import
REPO_ROOT = Path(__file__).resolve().parents[2]


def _counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(SPEC_PREFIX):
            continue
        key = metric.name[len(SPEC_PREFIX):]
        if hasattr(metric, "values"):
            out[key] = [int(v) for v in metric.values]
        elif hasattr(metric, "value"):
            out[key] = out.get(key, 0) + int(metric.value)
    return out


NGRAM_MAX, NGRAM_MIN = 4, 2  # n-gram lookup window: vLLM's documented example values


def ngram_config(k: int) -> dict[str, Any]:
    """vLLM's speculative_config for n-gram prompt lookup with k tokens: no draft model, the baseline a trained draft
    must beat (the in-process child and the serve step's n-gram server both use it)."""
    return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": NGRAM_MAX,
            "prompt_lookup_min": NGRAM_MIN}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": job["target"], "tokenizer": job.get("tokenizer") or job["target"], "dtype": job.get("dtype", "auto"),
        "enforce_eager": True, "max_model_len": int(job.get("max_model_len", 1024)), "disable_log_stats": False,
        "seed": int(job.get("seed", 0)),
    }
    if job.get("gpu_memory_utilization") is not None:
        kwargs["gpu_memory_utilization"] = float(job["gpu_memory_utilization"])
    kwargs.update(job.get("engine_args") or {})  # the target family's (adapters.target_engine_kwargs)
    method = job.get("method") or ("eagle3" if job.get("draft") else None)
    if method == "eagle3":
        kwargs["speculative_config"] = {"method": "eagle3", "model": job["draft"],
                                        "num_speculative_tokens": int(job["k"])}
    elif method == "ngram":
        kwargs["speculative_config"] = ngram_config(job["k"])
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_new_tokens"]))
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompt_token_ids"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    before = _counters(llm) if method else {}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(o) for o in outputs)
    acceptance = None
    if method:
        after = _counters(llm)
        k = int(job["k"])
        per_pos = [a - b for a, b in zip(after.get("num_accepted_tokens_per_pos", [0] * k),
                                         before.get("num_accepted_tokens_per_pos", [0] * k), strict=False)]
        acceptance = {"k": k,
                      "drafts": after.get("num_drafts", 0) - before.get("num_drafts", 0),
                      "draft_tokens": after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0),
                      "accepted": after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0),
                      "per_pos": (per_pos + [0] * k)[:k]}
    return {"outputs": outputs, "seconds": seconds, "generated_tokens": n, "tokens_per_s": n / seconds if seconds else 0,
            "engine_start_s": start_s, "acceptance": acceptance, "k": job.get("k"), "draft": job.get("draft"),
            "method": method}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    job = json.loads(args.job.read_text())
    result = run_job(job)
    from eagle3lib.common import atomic

    atomic.write_json(args.out, result)
    return 0


def subprocess_env(cache_root: Path) -> dict[str, str]:
    """The environment a vLLM child gets: caches inside the run, no hub, small CPU KV cache, in-process engine."""
    env = dict(os.environ)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / "tmp"
    tmp.mkdir(exist_ok=True)
    env.update({
        "VLLM_CACHE_ROOT": str(cache_root / "vllm"), "HF_HOME": str(cache_root / "hf"), "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(tmp), "TOKENIZERS_PARALLELISM": "false",
    })
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def run_in_subprocess(job: dict[str, Any], workdir: Path, name: str, cache_dir: Path, timeout_s: int = 900
                      ) -> dict[str, Any]:
    """Run one job in a child Python (the notebook kernel never imports vLLM), with the run's vLLM cache
    (`rundir.cache_root`). Raises with the child's last lines."""
    import subprocess

    from eagle3lib.common import atomic
    from eagle3lib.common.errors import WorkbookError

    workdir.mkdir(parents=True, exist_ok=True)
    job_path = atomic.write_json(workdir / f"{name}.job.json", job)
    out_path = workdir / f"{name}.result.json"
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "eagle3lib.evaluate.vllm_child", "--job", str(job_path), "--out",
                               str(out_path)], env=subprocess_env(cache_dir), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout_s, cwd=str(REPO_ROOT))
    if proc.returncode != 0 or not out_path.is_file():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-8:])
        raise WorkbookError(f"the vLLM run '{name}' failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}",
                            "read the log; or leave 'vllm' out of evaluate.methods on machines without a working vLLM")
    return json.loads(out_path.read_text())


if __name__ == "__main__":
    sys.exit(main())
