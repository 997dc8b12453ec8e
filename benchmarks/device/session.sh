#!/usr/bin/env bash
# One H200 device session, phase by phase (each phase = one device call, back to back: a machine stays warm only
# ~30 s after a call). Chunks come from benchmarks/device/make_bundle.sh; results land in $OUT.
#   copy            calls 1..N-1, each carrying .carry/bundle/cK: keep the chunk in /tmp/bundle
#   install         the call carrying the last chunk: assemble and install (benchmarks/device/install.sh)
#   bench           GPU 1: vLLM extraction benchmark (issue 5); GPU 0 meanwhile: the GPU recipe's stages 00-04
#                   (issue 12) through `eagle3 run`
#   bench-train     GPU 1: the training benchmark (issue 7)
#   recipe          GPU 0: the recipe's stages 05-06; GPU 1: the same stages on a copy of the run with a second
#                   training setting (RECIPE_B overrides)
#   scaling         both GPUs: 1 vs 2 GPUs for extraction and for draft training (issue 10)
#   launch          start `all` in the background (it outlives the call; the machine stays warm while polls follow)
#   poll            wait up to WAIT s (default 540) for `all`, refreshing $OUT every minute (a call cut short keeps
#                   what it had): results JSON, the runs' small files (runs.tgz) and the logs
#   all             the whole plan for a 2-GPU machine, GPU time never idle between calls:
#                     GPU 0 the recipe, stages 00-06 (issue 12) | GPU 1 the same data on the final layer only
#                     (EAGLE-1 style: target.layer_ids=[29], the comparison row of issue 12)
#                     then both GPUs: draft training 1 vs 2 GPUs, extraction 1 vs 2 GPUs (issue 10)
#                     then GPU 0 the training benchmark (issue 7) | GPU 1 vLLM extraction, one generate call (issue 5)
set -uo pipefail
phase=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CONFIG=${CONFIG:-configs/smollm2-h200.yaml}
RUN=${RUN:-smollm2-h200}
RECIPE_B=${RECIPE_B:-"-p train.lr=1e-3"}
LIMIT=${LIMIT:-560}

# at most 8 files come back from $OUT: logs travel in one archive
keep_logs() { tar czf "$OUT/logs-$phase.tgz" --ignore-failed-read "$@" 2>/dev/null; }
# the first of stages 02..06 without a manifest in run $1 (so a phase resumes what an earlier call left unfinished)
first_missing() { for s in 02 03 04 05 06; do ls outputs/$1/manifests/${s}_*.json >/dev/null 2>&1 || { echo $s; return; }; done; echo done; }
# a copy of run $1 named $2 that shares stages 02-04's files (hard links) and has no draft yet
fork_run() { python3 -c "import sys; from eagle3lib.rundir import fork_run; fork_run(*('outputs/' + a for a in sys.argv[1:]))" "$1" "$2"; }

# a stage killed by `timeout` can leave its spawned vLLM engine process behind, holding most of a GPU (seen: 120 GiB):
# every GPU phase starts by ending whatever still runs on the GPUs
free_gpus() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p"; done; sleep 2; }
case "$phase" in bench|bench-train|recipe|scaling|launch) free_gpus ;; esac
RES=/tmp/results  # what `all` measured; `poll` copies it into $OUT
# the runs' small files: reports, manifests, curves, figures, eval results (no tensors, no checkpoints)
pack_runs() { tar czf "$1" --exclude='dataset' --exclude='verifier' --exclude='*.safetensors' --exclude='*.pt' \
  --exclude='cache' --exclude='.cache' --exclude='checkpoints' --exclude='*.npy' --exclude='*.jsonl' \
  outputs/$RUN outputs/$RUN-eagle1 2>/dev/null; }

case "$phase" in
copy)
  mkdir -p /tmp/bundle && cp .carry/bundle/c*/part.* /tmp/bundle/ && ls -la /tmp/bundle && nvidia-smi -L
  ;;
install)
  bash benchmarks/device/install.sh
  ;;
bench)
  source /tmp/eagle3-env.sh
  ( CUDA_VISIBLE_DEVICES=0 timeout $LIMIT python3 -m eagle3lib.cli run --config "$CONFIG" --run "$RUN" \
      --stages 00-04 > /tmp/recipe_00_04.log 2>&1; echo "recipe 00-04 exit $?" >> /tmp/recipe_00_04.log ) &
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/extract.py --backend vllm-all --multiprocess \
      --timeout 200 --out "$OUT/extract_vllm_h200.json" > /tmp/bench_vllm.log 2>&1 &
  wait  # the training benchmark (~4 min alone: flex-attention compile ~100 s) has its own call: bench-train
  keep_logs /tmp/recipe_00_04.log /tmp/bench_vllm.log outputs/$RUN/manifests
  tail -n 5 /tmp/recipe_00_04.log /tmp/bench_vllm.log
  ;;
bench-train)
  source /tmp/eagle3-env.sh
  CUDA_VISIBLE_DEVICES=1 timeout $LIMIT python3 benchmarks/train.py --out "$OUT/train_h200.json" > /tmp/bench_train.log 2>&1
  keep_logs /tmp/bench_train.log
  tail -n 5 /tmp/bench_train.log
  ;;
recipe)
  source /tmp/eagle3-env.sh
  start=$(first_missing "$RUN")
  if [ "$start" != 05 ] && [ "$start" != 06 ]; then  # stages 02-04 did not finish in the bench phase: finish them
    CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m eagle3lib.cli run --config "$CONFIG" --run "$RUN" \
      --stages "$start-04" > /tmp/recipe_finish_02_04.log 2>&1
  fi
  fork_run "$RUN" "$RUN-b"
  ( CUDA_VISIBLE_DEVICES=0 timeout $LIMIT python3 -m eagle3lib.cli run --config "$CONFIG" --run "$RUN" \
      --stages 05-06 > /tmp/recipe_05_06.log 2>&1; echo "recipe 05-06 exit $?" >> /tmp/recipe_05_06.log ) &
  ( CUDA_VISIBLE_DEVICES=1 timeout $LIMIT python3 -m eagle3lib.cli run --config "$CONFIG" --run "$RUN-b" \
      --stages 05-06 $RECIPE_B > /tmp/recipe_b_05_06.log 2>&1; echo "recipe b 05-06 exit $?" >> /tmp/recipe_b_05_06.log ) &
  wait
  tar czf "$OUT/runs.tgz" --exclude='dataset' --exclude='verifier' --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='cache' --exclude='checkpoints' --exclude='*.npy' outputs/$RUN outputs/$RUN-b 2>/dev/null
  keep_logs /tmp/recipe_*.log
  tail -n 5 /tmp/recipe_*.log
  ;;
scaling)
  source /tmp/eagle3-env.sh
  timeout 240 python3 benchmarks/scaling.py extract --gpus 2 --rows 256 --out "$OUT/scaling_extract_h200x2.json" \
    > /tmp/scaling_extract.log 2>&1
  timeout $((LIMIT - 250)) python3 benchmarks/scaling.py train --config "$CONFIG" --run "$RUN" --gpus 2 --steps 200 \
    --out "$OUT/scaling_train_h200x2.json" > /tmp/scaling_train.log 2>&1
  keep_logs /tmp/scaling_extract.log /tmp/scaling_train.log
  tail -n 5 /tmp/scaling_extract.log /tmp/scaling_train.log
  ;;
launch)
  rm -rf "$RES" && mkdir -p "$RES"
  setsid nohup bash benchmarks/device/session.sh all > "$RES/all.log" 2>&1 < /dev/null &
  sleep 20; cat "$RES/all.log"; nvidia-smi --query-gpu=index,memory.used --format=csv
  ;;
poll)
  end=$(( $(date +%s) + ${WAIT:-540} ))
  while :; do
    cp "$RES"/*.json "$OUT"/ 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$RES" --exclude='*.json' --exclude='*.tgz' . 2>/dev/null
    [ -f "$RES/DONE" ] || [ "$(date +%s)" -ge "$end" ] && break
    for _ in 1 2 3 4 5 6; do [ -f "$RES/DONE" ] && break; sleep 10; done
  done
  pack_runs "$OUT/runs.tgz"
  tail -n 4 "$RES"/*.log; ls "$RES"; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
  ;;
all)
  source /tmp/eagle3-env.sh
  step() { echo "$(date +%T) $*"; }
  python3 -c "from eagle3lib.target import ensure_embedded_target as e; e()"  # convert once, before two runs race
  step "recipe (GPU 0) | EAGLE-1 style (GPU 1)"
  ( t=$(date +%s); CUDA_VISIBLE_DEVICES=0 timeout 1800 python3 -m eagle3lib.cli run --config "$CONFIG" --run "$RUN" \
      > "$RES/recipe.log" 2>&1; echo "recipe exit $? after $(( $(date +%s) - t )) s" >> "$RES/recipe.log" ) &
  ( t=$(date +%s); CUDA_VISIBLE_DEVICES=1 timeout 1800 python3 -m eagle3lib.cli run --config "$CONFIG" \
      --run "$RUN-eagle1" -p "target.layer_ids=[29]" -p "evaluate.methods=[offline, embedded, vllm]" \
      > "$RES/eagle1.log" 2>&1; echo "eagle1 exit $? after $(( $(date +%s) - t )) s" >> "$RES/eagle1.log" ) &
  wait
  pack_runs "$RES/runs.tgz"
  step "draft training, 1 vs 2 GPUs"
  timeout 480 python3 benchmarks/scaling.py train --config "$CONFIG" --run "$RUN" --gpus 2 --steps 200 \
    --out "$RES/scaling_train_h200x2.json" > "$RES/scaling_train.log" 2>&1
  step "extraction, 1 vs 2 GPUs"
  timeout 300 python3 benchmarks/scaling.py extract --gpus 2 --rows 1024 --out "$RES/scaling_extract_h200x2.json" \
    > "$RES/scaling_extract.log" 2>&1
  step "training benchmark (GPU 0) | vLLM native extraction in one generate call (GPU 1)"
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/train.py --out "$RES/train_h200.json" \
    > "$RES/bench_train.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/extract.py --backend vllm-all \
    --modes vllm-prefill,vllm-native --multiprocess --request-tokens 524288 --timeout 200 \
    --out "$RES/extract_vllm_h200.json" > "$RES/bench_vllm.log" 2>&1 &
  wait
  step done; touch "$RES/DONE"
  ;;
*)
  echo "unknown phase $phase" >&2; exit 2
  ;;
esac
