"""What every config section shares: the base class that refuses unknown keys, and the names of the prompt sources and
benchmarks that more than one section checks."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

EMBEDDED_TARGET = "embedded:smollm2"  # the default target; every embedded name is in eagle3lib.common.embedded.TARGETS
# prompt sets inside PyPI packages (eagle3lib.common.sources.PACKAGE_FILES says where): training sources, and
# evaluation benchmarks (MT-Bench and the math and code sets peers report, GSM8K, MATH-500 and HumanEval, are
# benchmarks only: they are never trained on)
PACKAGE_SOURCES = ("sharegpt", "alpaca_eval", "arena_hard", "writingbench")
BENCHMARK_KINDS = ("mt_bench", "alpaca_eval", "arena_hard", "writingbench", "gsm8k", "math500", "humaneval")
# sources whose user requests the target writes in stage 02 (eagle3lib.extract.synth): training only, generated after
# the held-out split, `limit` required, nothing to read before then
GENERATED_KINDS = ("self_instruct", "magpie")


def benchmark_name(spec: str) -> str:
    """An `evaluate.benchmarks` entry's name (results.json keys, data/bench_<name>.jsonl): a known benchmark's own,
    else the file's stem."""
    if spec in BENCHMARK_KINDS:
        return spec
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(spec).stem) or "benchmark"


class Section(BaseModel):
    """A config section: unknown keys are errors (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
