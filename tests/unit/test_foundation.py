"""The spine: config validation, manifests, the GGUF conversion, the runner, bad input, clean notebooks."""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest

from eagle3lib.common.config import WorkbookConfig, load_config
from eagle3lib.common.errors import WorkbookError
from eagle3lib.common.rundir import REPO_ROOT, RunDir, open_stage
from eagle3lib.common.stages import available_stages, get_stage, parse_selection
from eagle3lib.common.target import describe_target, resolve_layer_ids

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path):
    cfg = load_config(path)
    again = WorkbookConfig.model_validate(__import__("yaml").safe_load(cfg.to_yaml()))
    assert again == cfg
    assert again.section_hash(["target", "data"]) == cfg.section_hash(["data", "target"])


def test_where_a_run_lives_is_not_part_of_its_lineage_but_its_seed_is():
    """A run copied under another name (a second draft on the same hidden states) keeps valid manifests."""
    a = load_config(None, ["run.name=a"]).section_hash(["run", "data"])
    assert load_config(None, ["run.name=b", "run.output_root=/elsewhere"]).section_hash(["run", "data"]) == a
    assert load_config(None, ["run.name=a", "run.seed=1"]).section_hash(["run", "data"]) != a


def test_a_forked_run_shares_stages_00_04_by_hard_links_and_leaves_the_draft_behind(tmp_path):
    from eagle3lib.common.rundir import fork_run

    src = tmp_path / "a"
    for rel in ("dataset/hidden_states/hs_0.safetensors", "manifests/02_extract_hidden_states.json",
                "manifests/05_train_draft.json", "figures/06_tau_vs_k.png", "draft/eagle3/curves.json", "report.md",
                "eval/partial.json", "data/eval.jsonl"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    dst = fork_run(src, tmp_path / "b")
    shard = "dataset/hidden_states/hs_0.safetensors"
    assert (dst / shard).stat().st_ino == (src / shard).stat().st_ino  # a link, not a copy
    assert (dst / "manifests/02_extract_hidden_states.json").is_file() and (dst / "data/eval.jsonl").is_file()
    assert not any((dst / rel).exists() for rel in ("manifests/05_train_draft.json", "figures/06_tau_vs_k.png",
                                                     "draft", "report.md", "eval"))


def test_overrides_are_typed_and_dotted():
    cfg = load_config(REPO_ROOT / "configs/demo.yaml", ["train.lr=3e-4", "target.layer_ids=[1, 2, 3]", "run.name=x"])
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.target.layer_ids == [1, 2, 3] and cfg.run.name == "x"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.bogus=1"], "unknown key 'train.bogus' — fix: remove it"),
        (["trian.lr=1"], "unknown key 'trian' — fix: write 'train', the nearest key"),
        (["train.epochz=2"], "unknown key 'train.epochz' — fix: write 'train.epochs', the nearest key"),
        (["train.lr=fast"], "'train.lr'"),
        (["target.layer_ids=[5, 3]"], "strictly increasing"),
        (["extract.backend=onnx"], "'extract.backend'"),
        (["extract.tensor_parallel_size=2"], "need extract.backend: vllm"),
        (["novalue"], "has no '='"),
    ],
)
def test_bad_config_gives_one_clear_line(overrides, expected):
    with pytest.raises(WorkbookError) as err:
        load_config(REPO_ROOT / "configs/demo.yaml", overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(WorkbookError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(WorkbookError, match="not valid YAML"):
        load_config(bad)


def test_layer_ids_default_explicit_and_invalid():
    assert resolve_layer_ids(None, 30) == [2, 15, 27, 30]
    assert resolve_layer_ids([0, 1, 2], 4) == [0, 1, 2, 4]
    with pytest.raises(WorkbookError, match="out of range"):
        resolve_layer_ids([2, 40], 30)
    with pytest.raises(WorkbookError, match="too few for the default") as err:
        resolve_layer_ids(None, 4)
    assert "target.layer_ids" in str(err.value)


def test_manifest_written_read_and_config_drift_detected(out_root):
    cfg = load_config(REPO_ROOT / "configs/demo.yaml", [f"run.output_root={out_root}"])
    rd = RunDir.create(cfg)
    stage02 = get_stage("02")
    dataset = rd.path("dataset")
    dataset.mkdir()
    rd.write_manifest(stage02, started=0.0, outputs={"dataset": dataset}, metrics={"samples": 3})
    manifest = rd.read_manifest("02")
    assert manifest["outputs"]["dataset"] == "dataset" and manifest["metrics"]["samples"] == 3
    assert rd.output("02", "dataset") == dataset
    assert manifest["versions"]["torch"]
    # a section stage 02 read changes: the manifest no longer matches
    drifted = RunDir(rd.root, load_config(REPO_ROOT / "configs/demo.yaml",
                                          [f"run.output_root={out_root}", "data.max_length=99"]))
    with pytest.raises(WorkbookError, match="different config"):
        drifted.read_manifest("02")
    # a section it did not read changes: still fine
    RunDir(rd.root, load_config(REPO_ROOT / "configs/demo.yaml", [f"run.output_root={out_root}", "train.lr=1"])
           ).read_manifest("02")
    with pytest.raises(WorkbookError, match="has not run"):
        rd.read_manifest("04")


def test_open_stage_requires_earlier_manifests(out_root):
    with pytest.raises(WorkbookError, match="stage 02_extract_hidden_states has not run"):
        open_stage("03", "configs/demo.yaml", "r1", [f"run.output_root={out_root}"])


def test_stage_selection():
    ids = [s.id for s in available_stages()]
    assert ids[0] == "00" and ids == sorted(ids)
    assert [s.id for s in parse_selection("00")] == ["00"]
    with pytest.raises(WorkbookError, match="unknown stage"):
        parse_selection("42")


def test_gguf_conversion_gives_a_working_hf_model(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = describe_target(smollm2_dir)
    assert (info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == ("llama", 30, 576, 49152)
    assert list(smollm2_dir.glob("*.safetensors")) and (smollm2_dir / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_notebooks_are_committed_clean_with_a_parameters_cell():
    for path in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), f"{path.name} has outputs"
        params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
        assert nb.cells.index(params[0]) == next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        for line in params[0].source.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                assert line.count("=") == 1 and "#" in line, f"{path.name}: '{line}' (literal, one '=', a comment)"


def _eagle3(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3lib.cli", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=600)


@pytest.mark.slow
def test_runner_executes_stage_00_headless(out_root, smollm2_dir):
    proc = _eagle3("run", "--config", "configs/demo.yaml", "--run", "t00", "--stages", "00", "-q",
                   "-p", f"run.output_root={out_root}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = out_root / "t00"
    executed = nbformat.read(run / "notebooks/00_environment.ipynb", as_version=4)
    assert any("environment OK" in str(o) for c in executed.cells for o in c.get("outputs", []))
    env = json.loads((run / "environment.json").read_text())
    assert env["target"]["num_layers"] == 30 and env["layer_ids"] == [2, 15, 27, 30]
    metrics = json.loads((run / "manifests/00_environment.json").read_text())["metrics"]
    assert metrics["fails"] == 0 and metrics["box_tokens_per_s"] == env["box"]["tokens_per_s"] > 0
    assert any(c["name"] == "box speed" and c["status"] == "pass" for c in env["checks"])


@pytest.mark.parametrize(
    "params, expected",
    [
        (["target.model=/does/not/exist"], "target.model /does/not/exist does not exist"),
        (["target.layer_ids=[2, 15, 40]"], "out of range"),
        (["run.output_root=/proc/forbidden"], "is not writable"),
    ],
)
def test_runner_bad_input_one_line(params, expected, out_root):
    args = ["run", "--config", "configs/demo.yaml", "--stages", "00", "-q"]
    for p in params:
        args += ["-p", p]
    proc = _eagle3(*args)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0] and "fix:" in lines[0], proc.stderr


@pytest.mark.slow
def test_stage_00_fails_the_run_when_disk_estimate_exceeds_free_space(out_root, smollm2_dir):
    proc = _eagle3("run", "--config", "configs/demo.yaml", "--run", "huge", "--stages", "00", "-q",
                   "-p", f"run.output_root={out_root}", "-p", "data.num_samples=null",
                   "-p", "data.sources=[{kind: bundled}, {kind: self_instruct, limit: 100000000}]")
    assert proc.returncode == 1
    assert "stage 00_environment stopped" in proc.stderr and "disk for hidden states" in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if "fix:" in ln]) == 1  # one fix: the notebook's own
    assert not (out_root / "huge/manifests/00_environment.json").exists()


def test_disk_estimate_counts_known_lengths_and_warns_only_on_the_upper_bound(out_root, smollm2_dir):
    """The estimate follows the data (the bundled prompts tokenized, each reply at most gen_max_new_tokens, the
    held-out prompts left out, replies multiplying rows); a max_length whose upper bound exceeds the free space
    warns, it does not fail."""
    import shutil

    from eagle3lib.common.sources import bundled_prompts_path, read_jsonl
    from eagle3lib.environment import check_environment
    from eagle3lib.environment.estimate import estimate_data

    cfg = load_config(REPO_ROOT / "configs/demo.yaml", [f"run.output_root={out_root}", "data.num_samples=null"])
    est = estimate_data(cfg, smollm2_dir)
    rows = len(read_jsonl(bundled_prompts_path())) - cfg.data.eval_samples
    assert est.rows == rows and est.upper_bound_tokens == rows * cfg.data.max_length
    assert rows * cfg.data.gen_max_new_tokens < est.tokens < rows * (cfg.data.gen_max_new_tokens + 200)
    capped = estimate_data(load_config(REPO_ROOT / "configs/demo.yaml", ["data.num_samples=10"]), smollm2_dir)
    assert capped.rows == 10
    tripled = estimate_data(load_config(REPO_ROOT / "configs/demo.yaml", [
        "data.num_samples=null", "data.sources=[{kind: bundled, replies: 3}]", "data.gen_temperatures=[0.0, 0.7]"]),
        smollm2_dir)
    assert tripled.rows == 3 * rows and tripled.tokens == 3 * est.tokens

    free = shutil.disk_usage(out_root).free
    max_length = int(2 * free / (rows * 4 * 576 * 2)) + 1  # rows x max_length x 4.6 KB/token = twice the free space
    cfg = load_config(REPO_ROOT / "configs/demo.yaml", [f"run.output_root={out_root}", "data.num_samples=null",
                                                         f"data.max_length={max_length}"])
    checks, facts = check_environment(cfg, out_root / "warn")
    disk = next(c for c in checks if c.name == "disk for hidden states")
    assert disk.status == "warn" and "stage 02 checks the real size" in disk.detail, disk
    assert facts["disk"]["upper_bound_bytes"] > free > facts["disk"]["estimated_bytes"]


def test_a_childs_log_tail_shows_the_cause_logged_above_its_shutdown_lines(tmp_path):
    """A vLLM engine core logs its exception, then its frontend's EngineDeadError and a dozen shutdown lines (lines as
    a generation engine logged them on an H100): the error quotes the cause, above the unchanged tail, and not a
    warning that only names an exception (as vLLM's API server logs one)."""
    from eagle3lib.common.processes import LOG_TAIL_LINES, log_tail

    cause = ("(EngineCore pid=4123) ERROR 12-05 23:52:31 [core.py:1332] torch.OutOfMemoryError: CUDA out of memory. "
             "Tried to allocate 1.09 GiB.")
    dead = ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for "
            "the root cause.")
    shutdown = [f"INFO 12-05 23:52:32 [core_client.py:66{i}] [shutdown] MPClient: step {i}" for i in range(20)]
    warning = ("(APIServer pid=8826) WARNING 12-06 23:57:58 [system_utils.py:299] Found ulimit of 20000 and failed to "
               "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors "
               "like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n")
    lines = ["INFO loading", warning, "Traceback (most recent call last):", cause, cause,
             "Traceback (most recent call last):", dead, *shutdown]
    log = tmp_path / "gen_engine_2.log"
    log.write_text("\n".join(lines) + "\n")
    text = log_tail(log)
    head, tail = text.split("...\n")
    assert head.splitlines() == ["errors above the last lines:", cause, dead]  # each once, in the log's order
    assert tail.splitlines() == shutdown[-LOG_TAIL_LINES:]

    log.write_text("\n".join(shutdown) + "\n")  # nothing failed above: the tail alone
    assert log_tail(log).splitlines() == shutdown[-LOG_TAIL_LINES:]
    assert log_tail(tmp_path / "missing.log") == "(no log)\n"
