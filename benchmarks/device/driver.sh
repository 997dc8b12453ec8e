#!/usr/bin/env bash
# The driver for a GPU host without network access: it runs a plan of workbook steps there in the background, so
# that the plan outlives the short calls that start and watch it. What it installs (vLLM, speculators, a config's
# packages, papermill) comes from make_bundle.sh in chunks; install.sh unpacks it. One or two GPUs: a step with work
# for GPU 1 runs it beside GPU 0's when there is a second GPU (`recipe`: on one GPU, the recipe alone).
# The host this was built for and what each step took there: docs/gpu-host.md.
#
# One phase per call, run from the repository root on the host:
#   copy     keep this call's chunk (.carry/bundle/cK) in /tmp/bundle: one call per chunk, all but the last
#   install  the call that carries the last chunk: assemble and install the bundle (install.sh), then `launch`
#   launch   keep the settings in /tmp/results/plan.env (every later call reads them back), start `plan` in the
#            background (setsid) and return
#   poll     wait up to WAIT s (default 540) for the plan, copying into $OUT every minute what it has so far (the
#            results' JSON, the runs' small files as runs.tgz, the logs as logs.tgz), so a call cut short keeps it;
#            exits 3 at once on a host without a plan (a new host since `launch`: copy and install again)
#   plan     (launch starts it) the config's target converted once, then each step of STEPS in order; then DONE
# Settings: CONFIG (default configs/smollm2-h200.yaml), RUN (its run name, default smollm2-h200), STEPS (default
# recipe_ab), and each step's own below (PEER_ARMS, PEER_GEN_ENGINES, PEER_SERVE_ARGS: the peers step's). LIMIT:
# seconds a stage run may take (default 1800). Every run of a config starts from its target's committed replies cache
# (benchmarks/device/caches/<target>.tar.xz, unpack_replies) and generates only what it lacks.
#
# STEPS and what each runs: benchmarks/device/steps.sh (`run_step`).
set -uo pipefail
phase=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the settings `launch` was given outlive its call: later calls (poll, the plan itself) read them back (a poll that
# fell back to the defaults would pack another run's folder, and nothing of this run would come back)
if [ "$phase" != launch ] && [ "$phase" != install ] && [ -f /tmp/results/plan.env ]; then source /tmp/results/plan.env; fi
CONFIG=${CONFIG:-configs/smollm2-h200.yaml}
RUN=${RUN:-smollm2-h200}
STEPS=${STEPS:-recipe_ab}
# the A/B arm: stages 05-06 again on the same states (measured: lr 1e-3 beat 5e-4; 2 draft layers +0.05 tau)
AB_PARAMS=${AB_PARAMS:--p train.lr=0.002}
SRUN=$RUN-small  # the small run: stage 02 in minutes instead of ~10, for the scaling step and the A/B arms
SMALL=(-p "data.sources=[{kind: bundled, replies: 8}, {kind: self_instruct, limit: 4000}]")
RES=/tmp/results  # what the plan measured; `poll` copies it into $OUT
# the peers step's stage 06 servers, up to four at once on one GPU: each asks for 15% of it at start (vLLM refuses to
# start when less is free) and takes an 8 GiB KV cache instead of profiling for one (a profile would count the other
# servers' memory as its own)
PEER_SERVE_GPU="[--gpu-memory-utilization, '0.15', --kv-cache-memory-bytes, '8589934592']"

# the runs' small files: reports, manifests, curves, figures, eval results (no tensors, no checkpoints)
pack_runs() { tar czf "$1" --exclude='dataset' --exclude='verifier' --exclude='*.safetensors' --exclude='*.pt' \
  --exclude='cache' --exclude='.cache' --exclude='checkpoints' --exclude='*.npy' --exclude='*.jsonl' \
  --exclude='spool' outputs/$RUN outputs/$RUN-eagle1 outputs/$RUN-b outputs/$SRUN-a outputs/$SRUN-b outputs/$RUN-f* outputs/$RUN-x* \
  outputs/$RUN-offline outputs/$RUN-online outputs/$RUN-spool outputs/$SRUN outputs/$SRUN-offline outputs/$SRUN-online \
  outputs/$SRUN-spool outputs/$RUN-speculators-cli* outputs/$RUN-workbook-* outputs/$RUN-graphs-* outputs/$RUN-eagle3 \
  outputs/$RUN-peagle outputs/$RUN-dflash outputs/$RUN-drafters outputs/$RUN-steps outputs/$RUN-mp outputs/*-sbs 2>/dev/null; }
# a stage killed by `timeout` can leave its spawned vLLM engine process behind, holding most of a GPU (seen: 120 GiB)
free_gpus() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p"; done; sleep 2; }
step() { echo "$(date +%T) $*"; }
second_gpu() { [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && echo 1 || echo 0; }
# eagle3 run on one GPU: $1 = GPU, $2 = log name, the rest = arguments; the log ends with the exit code and seconds
# (LIMIT: its seconds, default 1800)
run_on() { local gpu=$1 name=$2 t; shift 2; t=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpu timeout "${LIMIT:-1800}" python3 -m eagle3lib.cli run --config "$CONFIG" "$@" \
    > "$RES/$name.log" 2>&1
  echo "$name exit $? after $(( $(date +%s) - t )) s" >> "$RES/$name.log"; }

# the recipe's generator setting (graphs up to 2048 sequences: x1.32 over vLLM's H200 defaults, docs/results.md) as
# 1, 2 and 4 engines side by side on one GPU: does a small target's generation scale with engines (CPU-bound steps)?
# 420 s a variant: four engines started one after another did not finish in 240 s
# (docs/gpu-host.md#what-each-step-takes)
GEN_RECIPE='{"max_num_seqs": 2048, "compilation_config": {"max_cudagraph_capture_size": 2048}}'
# the algorithms step's servers when ALG_GRID names none (a variable: a '}' inside ${VAR:-...} ends the expansion)
ALG_GRID_DEFAULT='[{algorithm: eagle3, num_speculative_tokens: 3}, {algorithm: peagle, num_speculative_tokens: 5}, {algorithm: dflash}]'
# shellcheck disable=SC2086 - ENGINES is a list of engine counts
bench_generate() { CUDA_VISIBLE_DEVICES=$1 timeout 1300 python3 benchmarks/generate.py --config "$CONFIG" \
  --prompts 8192 --max-new-tokens 192 --temperatures 0.7 --variants "$GEN_RECIPE" --engines ${ENGINES:-1 2 4} \
  --timeout 420 --out "$RES/generate_engines_h200.json" > "$RES/bench_generate.log" 2>&1; }
# random weights (a 16 GB checkpoint written once, loaded by each mode): the capture probe runs and is timed
# (VLLM_MODES: which modes, default all three; prefill and one capture mode fit in ~6 minutes)
bench_vllm() { CUDA_VISIBLE_DEVICES=$1 timeout 900 python3 benchmarks/extract.py --backend vllm-all \
  --modes "${VLLM_MODES:-vllm-prefill,vllm-native,vllm-worker}" --multiprocess --timeout 240 --weights random \
  --out "$RES/extract_vllm_h200.json" > "$RES/bench_vllm.log" 2>&1; }
# $CONFIG's own data sources with $1 times every limit and every replies count above 1 (a source answered once stays
# so), as one -p value: read from the config, not copied here (the replies caches are keyed by the sources' settings,
# so a copy that drifted would generate everything again)
scaled_sources() { echo "data.sources=$(python3 -c "import json, sys; from eagle3lib.common.config import load_config
x = int(sys.argv[2])
print(json.dumps([{**s.model_dump(mode='json', exclude_none=True), **({'limit': s.limit * x} if s.limit else {}),
                   'replies': s.replies * x if s.replies > 1 else 1} for s in load_config(sys.argv[1]).data.sources]))" "$CONFIG" "$1")"; }
# a run's fork (eagle3lib.common.rundir.fork_run: hard links, no bytes copied): $1 = the run, $2 = the fork's name
fork() { python3 -c "import sys; from eagle3lib.common.rundir import fork_run; fork_run(*sys.argv[1:])" "outputs/$1" "outputs/$2"; }
# the config loads with these -p KEY=VALUE overrides: a step checks a later run's before the stages ahead of it
config_ok() { python3 -c "import sys; from eagle3lib.common.config import load_config
load_config(sys.argv[1], [a for a in sys.argv[2:] if a != '-p'])" "$CONFIG" "$@"; }
has_states() { ls outputs/"$1"/manifests/04_*.json >/dev/null 2>&1; }
# the run gen_data and curve_online work on: $RUN at GEN_SCALE 1 (a config whose sources are already the data
# wanted), else $RUN-x$GEN_SCALE
gen_run() { if [ "${GEN_SCALE:-4}" = 1 ]; then echo "$RUN"; else echo "$RUN-x${GEN_SCALE:-4}"; fi; }
# $CONFIG's target.model as written; target_name: it as a file name (embedded:qwen2.5-coder-1.5b ->
# qwen2.5-coder-1.5b, /models/My-8B -> My-8B)
target_model() { python3 -c "import sys; from eagle3lib.common.config import load_config
print(load_config(sys.argv[1]).target.model)" "$CONFIG"; }
target_name() { python3 -c "import sys; from pathlib import Path; print(Path(sys.argv[1].removeprefix('embedded:')).name)" \
  "$(target_model)"; }
# the target's committed replies cache (benchmarks/device/caches/<target>.tar.xz: every config's and run's replies
# for that target, as gen_data or peers brought them back; the keys hold the prompt, the generation settings and the
# model, never the run), put into outputs/$1/data unless that folder exists: stage 02 then generates only what the
# cache lacks
unpack_replies() { local dest=$1 c f
  [ -d "outputs/$dest/data" ] && return 0
  c="benchmarks/device/caches/$(target_name).tar.xz"; [ -f "$c" ] || return 0
  step "replies from $c"; rm -rf /tmp/replies && mkdir -p /tmp/replies "outputs/$dest/data"
  xz -dc "$c" | tar x -C /tmp/replies
  for f in /tmp/replies/outputs/*/data/*_cache.jsonl; do cat "$f" >> "outputs/$dest/data/${f##*/}"; done
  rm -rf /tmp/replies; }
small_run() { has_states "$SRUN" || run_on "$1" small --run "$SRUN" --stages 00-04 "${SMALL[@]}"; }
# stages 05-06 of the small run in a fork: $1 = GPU, $2 = arm name (a | b), the rest = overrides
small_arm() { local gpu=$1 arm=$2; shift 2; has_states "$SRUN" || return 0
  fork "$SRUN" "$SRUN-$arm"
  run_on "$gpu" "arm_$arm" --run "$SRUN-$arm" --stages 05-06 "${SMALL[@]}" -p "evaluate.methods=[embedded]" "$@"; }

case "$phase" in
copy)
  mkdir -p /tmp/bundle && cp .carry/bundle/c*/part.* /tmp/bundle/ && ls -la /tmp/bundle && nvidia-smi -L
  # a host replaced between two calls (given back after ~30 s idle, or taken back) holds only this call's chunks:
  # say so now, not at `install` after every other copy went to it (exit 3: copy again from chunk 1)
  last=$(find /tmp/bundle -name 'part.*' | sed 's/.*part\.//' | sort -n | tail -n 1)
  [ -n "$last" ] || { echo "no chunk on this host: carry one, .carry/bundle/cK" >&2; exit 3; }
  for n in $(seq 0 $(( 10#$last - 1 ))); do
    [ -f "/tmp/bundle/part.$(printf %02d "$n")" ] || { echo "chunk c$(( n + 1 )) is not on this host (a new host since that copy): copy again from c1" >&2; exit 3; }
  done
  ;;
install)
  bash benchmarks/device/install.sh && exec bash benchmarks/device/driver.sh launch
  ;;
launch)
  free_gpus
  rm -rf "$RES" && mkdir -p "$RES"
  printf 'CONFIG=%q RUN=%q STEPS=%q AB_PARAMS=%q EAGLE1_LAYER=%q CURVE=%q ARMS=%q MODES_SMALL=%q ENGINES=%q GEN_SCALE=%q GEN_ENGINES=%q VLLM_MODES=%q PEER_ARMS=%q PEER_GEN_ENGINES=%q PEER_SERVE_ARGS=%q GRAPH_GRID=%q DRAFTERS=%q ALG_EPOCHS=%q ALG_TRAIN_FRACTION=%q ALG_GRID=%q ALG_BENCH_PROMPTS=%q ALG_PARAMS=%q STEP_GRID=%q SVP_RUN=%q\n' \
    "$CONFIG" "$RUN" "$STEPS" "$AB_PARAMS" "${EAGLE1_LAYER:-29}" "${CURVE:-}" "${ARMS:-offline online spool}" \
    "${MODES_SMALL:-0}" "${ENGINES:-1 2 4}" "${GEN_SCALE:-4}" "${GEN_ENGINES:-4}" \
    "${VLLM_MODES:-vllm-prefill,vllm-native,vllm-worker}" "${PEER_ARMS:-speculators_cli}" \
    "${PEER_GEN_ENGINES:-2}" "${PEER_SERVE_ARGS:-$PEER_SERVE_GPU}" "${GRAPH_GRID:-2}" "${DRAFTERS:-eagle3 peagle dflash}" \
    "${ALG_EPOCHS:-1}" "${ALG_TRAIN_FRACTION:-1}" "${ALG_GRID:-}" "${ALG_BENCH_PROMPTS:-40}" "${ALG_PARAMS:-}" "${STEP_GRID:-}" "${SVP_RUN:-}" > "$RES/plan.env"
  # the plan runs from a copy: bash reads a script as it goes, and each device call syncs the working tree again (an
  # edited driver.sh under a running plan ends it with a syntax error)
  cp benchmarks/device/driver.sh benchmarks/device/steps.sh "$RES"/
  setsid nohup bash "$RES/driver.sh" plan > "$RES/plan.log" 2>&1 < /dev/null &
  sleep 20; cat "$RES/plan.log"
  ;;
poll)
  # no plan here = the machine was given back since `launch` (30 s idle, e.g. a gap between calls) and this is a new,
  # bare one: say so at once instead of waiting WAIT seconds for nothing
  [ -f "$RES/plan.env" ] || { echo "no plan on this machine (it is not the one launch ran on): copy and install again" >&2; exit 3; }
  end=$(( $(date +%s) + ${WAIT:-540} ))
  while :; do
    cp "$RES"/*.json "$OUT"/ 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$RES" --exclude='*.json' . 2>/dev/null
    pack_runs "$OUT/runs.tgz"  # every minute: a call cut short (its timeout, the budget) keeps what the runs wrote
    [ -f "$RES/DONE" ] || [ "$(date +%s)" -ge "$end" ] && break
    for _ in 1 2 3 4 5 6; do [ -f "$RES/DONE" ] && break; sleep 10; done
  done
  df -h /tmp | tail -n 1
  # gen_data's replies caches (only once the plan is done or this is the last poll: FINAL=1; xz on every core)
  caches=""; [[ " $STEPS " == *" gen_data "* ]] && caches=$(ls outputs/"$(gen_run)"/data/*_cache.jsonl 2>/dev/null)
  [[ " $STEPS " == *" peers "* ]] && caches=$(ls outputs/"$RUN"/data/*_cache.jsonl 2>/dev/null)
  if [ -n "$caches" ] && { [ -f "$RES/DONE" ] || [ "${FINAL:-0}" = 1 ]; }; then
    rm -f "$OUT"/caches.txz.*
    # shellcheck disable=SC2086 - one path per word
    tar cf - $caches | xz -6 -T0 | split -b 15M - "$OUT/caches.txz."; ls -la "$OUT"/caches.txz.*
  fi
  # what the plan wrote, packed last: a stage that ended while the caches were compressed is in it, manifest and all
  cp "$RES"/*.json "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$RES" --exclude='*.json' . 2>/dev/null
  pack_runs "$OUT/runs.tgz"
  cat "$RES/plan.log"; grep -h "done in\|exit\|rror" "$RES"/*.log | tail -n 12
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
  # the compile caches a later session could carry instead of compiling again (the draft's torch.compile, vLLM's
  # graphs and Triton kernels): their sizes, once the plan is done
  [ -f "$RES/DONE" ] && du -sh /tmp/torchinductor_* ~/.triton outputs/*/cache/vllm 2>/dev/null
  ;;
plan)
  source /tmp/eagle3-env.sh
  source "$RES/steps.sh"
  lscpu > "$RES/lscpu.txt" 2>&1  # the host's CPU: the probe's head check and vLLM's scheduling run on it
  # the config's target, converted once (an embedded GGUF), before two runs race: its seconds in convert.log
  if [ "$STEPS" != vllm_extract ] && [ "$STEPS" != kimi_shaped ]; then  # both write their own random checkpoint
    step "target of $CONFIG"; t=$(date +%s)
    python3 -c "import sys; from eagle3lib.common.config import load_config; from eagle3lib.common.target import resolve_model_path
print(resolve_model_path(load_config(sys.argv[1]).target))" "$CONFIG" > "$RES/convert.log" 2>&1
    echo "target ready after $(( $(date +%s) - t )) s" >> "$RES/convert.log"; tail -n 1 "$RES/convert.log"
  fi
  g1=$(second_gpu)
  for s in $STEPS; do
    run_step "$s"
  done
  step done; touch "$RES/DONE"
  ;;
*)
  echo "unknown phase $phase" >&2; exit 2
  ;;
esac
