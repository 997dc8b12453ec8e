"""The names of stage 06's rows in eval/results.json, which the figures, the report card and `eagle3 compare` read.

Why one module: each name is a key (`results["by_method"][name]`, `results["sweep"][name]`) and display text at
once (the report card's method column, the figures' legends). The writer (`measure.measure`) and every reader
take them from here, so a renamed row cannot leave a reader looking for the old name.
"""

from __future__ import annotations

OFFLINE_ROWS = "offline (validation rows)"  # teacher-forced over stage 02's validation rows
HELDOUT_ALL = "offline (held-out, all starts)"  # teacher-forced over the held-out continuations, every start
HELDOUT_PATH = "offline (held-out, decoder path)"  # the same, only the starts the decoder visits
EMBEDDED = "embedded"  # the exact speculative decoder; also results["embedded"] (speed, identical outputs)
VLLM = "vllm"  # EAGLE-3 in vLLM; also results["vllm"]
NGRAM = "vllm n-gram (no draft)"  # vLLM's n-gram prompt lookup: the draft-free baseline
SERVE = "vllm serve"  # the real server with the draft, its /metrics counters over every level; also results["serve"]
# the real server with n-gram lookup instead of the draft (evaluate.methods: serve + ngram); also
# results["serve"]["ngram"]
NGRAM_SERVE = "vllm serve n-gram (no draft)"
LIVE = (EMBEDDED, VLLM)  # the methods with a speed section: target alone vs with the draft
# results["tau_by_benchmark"][name]["by_method"]: the offline rows over a benchmark's own prompts (the embedded
# decoder's row is EMBEDDED)
BENCH_PATH = "offline (decoder path)"
BENCH_ALL = "offline (all starts)"
HELD_OUT = "held-out split"  # the report's row for stage 02's held-out prompts beside the benchmarks
# results["serve"]["recommended_settings"]: a concurrency level where no serving setting beats the target alone
NO_DRAFT = "no draft"


def serve_row(algorithm: str) -> str:
    """The serve method's row of a drafter (its first setting's server): SERVE for EAGLE-3, SERVE and the drafter's
    name for the others ("vllm serve dflash")."""
    return SERVE if algorithm == "eagle3" else f"{SERVE} {algorithm}"
