#!/usr/bin/env bash
# Here (a machine with network): pack what a GPU host without network access needs for a full workbook run into
# chunks that fit a 64 MiB transfer each, beside the working tree: vLLM 0.26 + speculators for CUDA 13 / torch 2.11
# (../shared/tools/vllm-h200's payload, built into .vllm-parts first), the packages the configs in CONFIGS need (their
# embedded target's GGUF parts, their prompt sources' and benchmarks' packages: benchmarks/device/bundle_pins.py reads
# them from the workbook's own tables) and papermill + ipykernel + ipywidgets for `eagle3 run`. On the host, driver.sh's `copy`
# and `install` phases put it together (install.sh); docs/gpu-host.md says how it goes. ipywidgets (a dependency of
# the workbook, pyproject.toml) too: without it tqdm.auto falls back to text bars, and every update of every bar is
# kept in the executed notebook (on the 1.5B: 17,044 stderr lines in notebook 02, 1.8 MB). Checked on the GPU image
# (2026-12-05, these wheels, papermill running one cell with a 3,000-step tqdm.auto bar): 691 stderr lines without
# ipywidgets, none with it (one widget output).
# Usage: [CONFIGS="configs/a.yaml configs/b.yaml"] bash benchmarks/device/make_bundle.sh
#   (default CONFIGS: the SmolLM2 recipe; writes .carry/bundle/c1..cN; carry one chunk per call, in order)
# Sizes: configs/qwen-coder-1.5b-h200.yaml (its GGUF alone is 1.1 GB), with the 1.5B replies cache (19 MB) in a
# 29 MiB working tree: 39 chunks of 33 MiB, c1..c39 (docs/gpu-host.md). Build it again whenever a config asks for a
# package the bundle lacks: install.sh names each one that is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.carry/bundle
rm -rf "$out" .carry/stage && mkdir -p "$out" .carry/stage/wheels
[ -d .vllm-parts/p3 ] || ../shared/tools/vllm-h200/build-payload.sh .vllm-parts
cat .vllm-parts/p*/part.* > .carry/stage/payload.tar
CONFIGS=${CONFIGS:-configs/smollm2-h200.yaml}
# shellcheck disable=SC2086 - CONFIGS is a list of paths
mapfile -t pins < <(.venv/bin/python benchmarks/device/bundle_pins.py $CONFIGS)
echo "packages for $CONFIGS: ${#pins[@]}"
pip download -q --no-deps "${pins[@]}" -d .carry/stage/wheels
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  papermill ipykernel nbclient ipywidgets -d .carry/stage/nbw
# the H200 image or the vLLM payload already has these
(cd .carry/stage/nbw && rm -f attrs-* certifi-* charset_normalizer-* click-* idna-* jsonschema* referencing-* rpds_py-* \
  packaging-* psutil-* python_dateutil-* pyyaml-* pyzmq-* requests-* tqdm-* typing_extensions-* tzdata-* urllib3-* pygments-*)
mv .carry/stage/nbw/*.whl .carry/stage/wheels/
tar cf .carry/stage/bundle.tar -C .carry/stage payload.tar wheels
# a call carries one chunk AND the working tree (tracked and untracked files; ~4 MiB of code, plus
# benchmarks/device/caches' 19 MB) within its 64 MiB: the chunks get what the tree leaves, with 4 MiB to spare
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
chunk=$(( 60 - tree / 1048576 ))
echo "working tree $(( tree / 1048576 )) MiB: chunks of $chunk MiB"
split -b "${chunk}M" -d -a 2 .carry/stage/bundle.tar "$out/part."
for f in "$out"/part.*; do n=${f##*.}; mkdir -p "$out/c$((10#$n + 1))"; mv "$f" "$out/c$((10#$n + 1))/"; done
rm -rf .carry/stage
ls -la "$out"/*
