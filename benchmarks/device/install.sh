#!/usr/bin/env bash
# On the GPU host (no network), in the call that carries the LAST chunk of make_bundle.sh's bundle (driver.sh's
# `install` phase runs it). Every call before copies its chunk into /tmp/bundle (driver.sh's `copy` phase):
#   mkdir -p /tmp/bundle && cp .carry/bundle/c*/part.* /tmp/bundle/
# Then this assembles the bundle and installs vLLM, speculators, papermill, ipykernel and ipywidgets into
# /tmp/vsite (the packages of $CONFIG too); `source /tmp/eagle3-env.sh` afterwards sets PYTHONPATH and the offline switches.
set -euo pipefail
mkdir -p /tmp/bundle && cp .carry/bundle/c*/part.* /tmp/bundle/ 2>/dev/null || true
# every part from 00 on, none missing: a host replaced between two copy calls holds only the later parts (tar would
# say only "This does not look like a tar archive")
n=$(ls /tmp/bundle/part.* 2>/dev/null | wc -l)
for i in $(seq 0 $(( n - 1 ))); do
  [ -f "$(printf /tmp/bundle/part.%02d "$i")" ] || { echo "bundle part $(printf %02d "$i") missing on this machine (it changed between copy calls): copy every chunk again" >&2; exit 3; }
done
[ "$n" -gt 0 ] || { echo "no bundle parts on this machine: copy every chunk first" >&2; exit 3; }
cat /tmp/bundle/part.* | tar xf - -C /tmp
mkdir -p /tmp/payload-x /tmp/vsite
tar xf /tmp/payload.tar -C /tmp/payload-x && rm -f /tmp/payload.tar
(cd /tmp/payload-x/payload && sha256sum -c --quiet SHA256SUMS)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite \
  /tmp/payload-x/payload/deps/*.whl /tmp/wheels/*.whl
tar xJf /tmp/payload-x/payload/vllm_tree.tar.xz -C /tmp/vsite
rm -rf /tmp/payload-x /tmp/bundle /tmp/wheels
cat > /tmp/eagle3-env.sh <<ENV
export PYTHONPATH=/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PATH=/tmp/vsite/bin:\$PATH
export EAGLE3_CACHE=/tmp/eagle3-cache
ENV
source /tmp/eagle3-env.sh
# every package the config needs (benchmarks/device/bundle_pins.py), at its pinned version
python3 - "${CONFIG:-configs/smollm2-h200.yaml}" <<'PY'
import importlib.metadata as md, subprocess, sys
import vllm, speculators, papermill, ipywidgets, eagle3lib  # noqa: F401 - ipywidgets: tqdm.auto's notebook bars
pins = subprocess.run([sys.executable, "benchmarks/device/bundle_pins.py", sys.argv[1]], check=True,
                      capture_output=True, text=True).stdout.split()
def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
# every one that is missing or at another version, in one message: a bundle built before the config asked for a
# package lacks it, and a plan started anyway fails at the first stage that reads it
wrong = [f"{p} (installed: {installed(p.split('==')[0]) or 'none'})" for p in pins
         if installed(p.split("==")[0]) != p.split("==")[1]]
if wrong:
    sys.exit(f"the bundle lacks what {sys.argv[1]} needs: {', '.join(wrong)} -- fix: build the bundle again with "
             f"CONFIGS={sys.argv[1]} bash benchmarks/device/make_bundle.sh, copy its chunks, install again")
print("vllm", vllm.__version__, f"| speculators, papermill and the {len(pins)} packages of {sys.argv[1]} ok")
PY
# A box that sets PYTHONDONTWRITEBYTECODE compiles every module from source in every process (our CPU boxes: import
# vllm 18 s -> 6 s once byte-compiled, scripts/install.sh). On an H200 host that sets it (2026-12-01) each vLLM
# process took ~25 s before its first log line (the server, its two model inspections, its engine core): compile
# once, where nothing else ever would. Its cost is logged.
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  t=$(date +%s); PYTHONDONTWRITEBYTECODE= python3 -m compileall -q -j 0 /tmp/vsite >/dev/null 2>&1 || true
  echo "byte-compiled /tmp/vsite in $(( $(date +%s) - t )) s"
fi
