#!/usr/bin/env bash
# One device session on a GPU machine (2 GPUs: nvidia-h200-x2; one GPU works too, the GPU-1 halves then share GPU 0).
# Chunks come from benchmarks/device/make_bundle.sh. Calls follow each other within ~30 s (a machine stays warm only
# that long), so the GPU work runs in the background and outlives the calls that watch it:
#   copy     calls 1..N-1, each carrying .carry/bundle/cK: keep the chunk in /tmp/bundle
#   install  the call carrying the last chunk: assemble and install (benchmarks/device/install.sh), then `launch`
#   launch   start the plan (STEPS, below) in the background and return
#   poll     wait up to WAIT s (default 540) for the plan, refreshing $OUT every minute so a call cut short keeps
#            what it had: the results' JSON, the runs' small files (runs.tgz) and the logs (logs.tgz)
# STEPS (for launch; default "recipe_ab"), in order:
#   recipe      GPU 0: $CONFIG (default configs/smollm2-h200.yaml; RUN = its run name), stages 00-06 | GPU 1: the same data with the draft on
#               one near-final layer only (EAGLE-1 style: target.layer_ids=[$EAGLE1_LAYER], default 29 = SmolLM2's N-1, 27 for
#               the 1.5B Qwen; the comparison row of issues 12 and 26); on one
#               GPU the recipe alone
#   eagle1      GPU 0: the EAGLE-1-style run alone ($CONFIG with target.layer_ids=[$EAGLE1_LAYER], run $RUN-eagle1,
#               evaluated by the serve sweep with n-gram lookup's server as well: evaluate.methods=[serve, ngram]):
#               on one GPU, the comparison rows `recipe` has no room for (the 1.5B's recipe takes ~1,040 s of a
#               session's ~1,460 after the copies)
#   recipe_ab   GPU 0: the recipe | GPU 1: the generator benchmark (benchmarks/generate.py), then the recipe's
#               stages 02-04 (forked once they exist) trained with AB_PARAMS and evaluated offline + embedded (A/B)
#   benchmarks  GPU 0: the small run's stages 00-04 (bundled x8 + 4,000 self-instruct prompts, ~5 min), the
#               generator benchmark, then the small run trained as configured | GPU 1: vLLM prefill vs the
#               workbook's native and worker strategies (issue 5), then the small run trained with AB_PARAMS; both
#               arms evaluated embedded (A/B, issue 12)
#   curve       GPU 0: $CONFIG's stages 00-04 (unless there), then stage 05 on forks of that run (hard links: no bytes
#               copied) at train.train_fraction = each of CURVE (default "0.25 0.5 1"): validation EAL vs training
#               rows and tokens from one extraction (each fork's draft/result.json: train_rows, train_tokens, val_eal;
#               the data-volume curve of issues 21 and 26). The 1.5B: ~600 s of stages 00-04, then ~175/220/315 s
#   modes       GPU 0: $CONFIG's stages 00, 01, 02, 04 offline (unless there), then one epoch of stage 05 on three
#               forks of that run: reading its shards (offline), with the target beside the draft (online: stages 02/04 again,
#               cached replies, sample shards only), and from a vLLM producer's bounded spool (spool); then
#               benchmarks/hidden_state_modes.py writes $RES/online_<run>.json (online_ratio: issue 21). ARMS picks
#               the forks (default "offline online spool"; without offline the base runs stage 02 online: no full
#               capture); MODES_SMALL=1 uses the small run's data (bundled x8 + 4,000 self-instruct) instead
#   generate    GPU 0: the generator benchmark alone (1, 2 and 4 vLLM engines side by side: does stage 02's
#               generation, ~80% of it on the recipe (394 of 505 s), scale with engines on one GPU?)
#   vllm_extract  GPU 0: vLLM prefill alone vs the workbook's native and worker capture on a random Llama-3.1-8B-shaped
#               checkpoint (256 x 2048 tokens), the capture probe's seconds included (issue 24)
#   scaling     both GPUs: draft training 1 vs 2 GPUs (torchrun) on the recipe run (else the small run, made first
#               when missing), then extraction 1 vs 2 GPUs on disk and in /dev/shm (issue 10)
# Measured 2026-11-29 on x2: copy + install ~3 min; `recipe_ab` ~24 min (recipe v2: 1,354 s on GPU 0);
# `benchmarks` 15 min; `scaling` on the small run: training 5 min, extraction in /dev/shm 2.5 min, the disk run
# after them was cut off by the budget. A 30-minute budget fits `recipe_ab` OR `benchmarks scaling`, not both.
# Measured 2026-12-01 on one H200, the 1.5B recipe (CONFIG=configs/qwen-coder-1.5b-h200.yaml, RUN=its run name):
# a warm call carrying a 60 MB chunk costs ~7 s of device time (the first ~35 s, the machine's start), so its 21
# chunks took 4.5 min with the install (73 s); the target's conversion 56 s; stages 00-05 then 15.6 min, and the
# budget ended inside stage 06. Plan a 1.5B session as: ~6 min to get ready, <= 22 min of recipe.
# Measured 2026-12-01 (session 9), the same: ready after 338 s (20 copies + install 81 s), the recipe's 00-06 in
# 1,043 s (convert 52 s), then `launch` with STEPS=curve CURVE="0.25 0.5" (the recipe's run kept) in 306 s: 1,750 s.
# Measured 2026-12-02 (session 10), STEPS=eagle1 with the 1.5B config (EAGLE1_LAYER=27; three servers in stage 06):
# a first call that got no machine cost 91 s; then ready after ~310 s, convert 57 s, the run 1,271 s (02 422 on a
# slower machine, 05 270, 06 456): 1,710 s of 1,800 with 3 polls.
# Measured 2026-12-02 (session 11), STEPS="vllm_extract modes" with the SmolLM2 config: ready after 183 s (4 copies +
# install 79 s), convert 33 s, vllm_extract 327 s, modes' base stages 597 s (02: 505), the offline arm 303 s, the online
# arm 340 s; the spool arm (the last) was cut by the 1,800 s. Run `modes` alone to get the spool arm.
# Measured 2026-12-02 (session 12), the SmolLM2 bundle (5 chunks of 56 MiB): ready after 137 s, convert 23-29 s,
# vllm_extract 300-376 s, generate: 1 engine 129 s, 2 engines 80 s (the 4-engine round cut by the budget). A poll
# that returned and was NOT followed by the next call within ~30 s (time spent reading its files) gave the machine
# back: the plan died with it (generate and modes of the first try lost). Poll again at once; read files after.
set -uo pipefail
phase=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the settings `launch` was given outlive its call: later calls (poll, the plan itself) read them back (a poll that
# fell back to the defaults once packed another run's folder: nothing of the Qwen run came back, session 7)
if [ "$phase" != launch ] && [ "$phase" != install ] && [ -f /tmp/results/plan.env ]; then source /tmp/results/plan.env; fi
CONFIG=${CONFIG:-configs/smollm2-h200.yaml}
RUN=${RUN:-smollm2-h200}
STEPS=${STEPS:-recipe_ab}
# the A/B arm: stages 05-06 again on the same states (measured: lr 1e-3 beat 5e-4; 2 draft layers +0.05 tau)
AB_PARAMS=${AB_PARAMS:--p train.lr=0.002}
SRUN=$RUN-small  # the small run: stage 02 in minutes instead of ~10, for the scaling step and the A/B arms
SMALL=(-p "data.sources=[{kind: bundled, replies: 8}, {kind: self_instruct, limit: 4000}]")
RES=/tmp/results  # what the plan measured; `poll` copies it into $OUT

# the runs' small files: reports, manifests, curves, figures, eval results (no tensors, no checkpoints)
pack_runs() { tar czf "$1" --exclude='dataset' --exclude='verifier' --exclude='*.safetensors' --exclude='*.pt' \
  --exclude='cache' --exclude='.cache' --exclude='checkpoints' --exclude='*.npy' --exclude='*.jsonl' \
  --exclude='spool' outputs/$RUN outputs/$RUN-eagle1 outputs/$RUN-b outputs/$SRUN-a outputs/$SRUN-b outputs/$RUN-f* \
  outputs/$RUN-offline outputs/$RUN-online outputs/$RUN-spool outputs/$SRUN outputs/$SRUN-offline outputs/$SRUN-online \
  outputs/$SRUN-spool 2>/dev/null; }
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

# the recipe's generator setting (graphs up to 2048 sequences: x1.32 over vLLM's H200 defaults, session 3) as 1, 2
# and 4 engines side by side on one GPU: does a small target's generation scale with engines (CPU-bound steps)?
GEN_RECIPE='{"max_num_seqs": 2048, "compilation_config": {"max_cudagraph_capture_size": 2048}}'
bench_generate() { CUDA_VISIBLE_DEVICES=$1 timeout 600 python3 benchmarks/generate.py --config "$CONFIG" \
  --prompts 8192 --max-new-tokens 192 --temperatures 0.7 --variants "$GEN_RECIPE" --engines 1 2 4 --timeout 240 \
  --out "$RES/generate_engines_h200.json" > "$RES/bench_generate.log" 2>&1; }
# random weights (a 16 GB checkpoint written once, loaded by each mode): the capture probe runs and is timed
bench_vllm() { CUDA_VISIBLE_DEVICES=$1 timeout 900 python3 benchmarks/extract.py --backend vllm-all \
  --modes vllm-prefill,vllm-native,vllm-worker --multiprocess --timeout 240 --weights random \
  --out "$RES/extract_vllm_h200.json" > "$RES/bench_vllm.log" 2>&1; }
has_states() { ls outputs/"$1"/manifests/04_*.json >/dev/null 2>&1; }
small_run() { has_states "$SRUN" || run_on "$1" small --run "$SRUN" --stages 00-04 "${SMALL[@]}"; }
# stages 05-06 of the small run in a fork: $1 = GPU, $2 = arm name (a | b), the rest = overrides
small_arm() { local gpu=$1 arm=$2; shift 2; has_states "$SRUN" || return 0
  python3 -c "from eagle3lib.rundir import fork_run; fork_run('outputs/$SRUN', 'outputs/$SRUN-$arm')"
  run_on "$gpu" "arm_$arm" --run "$SRUN-$arm" --stages 05-06 "${SMALL[@]}" -p "evaluate.methods=[embedded]" "$@"; }

case "$phase" in
copy)
  mkdir -p /tmp/bundle && cp .carry/bundle/c*/part.* /tmp/bundle/ && ls -la /tmp/bundle && nvidia-smi -L
  ;;
install)
  bash benchmarks/device/install.sh && exec bash benchmarks/device/session.sh launch
  ;;
launch)
  free_gpus
  rm -rf "$RES" && mkdir -p "$RES"
  printf 'CONFIG=%q RUN=%q STEPS=%q AB_PARAMS=%q EAGLE1_LAYER=%q CURVE=%q ARMS=%q MODES_SMALL=%q\n' "$CONFIG" "$RUN" \
    "$STEPS" "$AB_PARAMS" "${EAGLE1_LAYER:-29}" "${CURVE:-0.25 0.5 1}" "${ARMS:-offline online spool}" \
    "${MODES_SMALL:-0}" > "$RES/plan.env"
  setsid nohup bash benchmarks/device/session.sh plan > "$RES/plan.log" 2>&1 < /dev/null &
  sleep 20; cat "$RES/plan.log"
  ;;
poll)
  end=$(( $(date +%s) + ${WAIT:-540} ))
  while :; do
    cp "$RES"/*.json "$OUT"/ 2>/dev/null
    tar czf "$OUT/logs.tgz" -C "$RES" --exclude='*.json' . 2>/dev/null
    pack_runs "$OUT/runs.tgz"  # every minute: a call cut short (its timeout, the budget) keeps what the runs wrote
    [ -f "$RES/DONE" ] || [ "$(date +%s)" -ge "$end" ] && break
    for _ in 1 2 3 4 5 6; do [ -f "$RES/DONE" ] && break; sleep 10; done
  done
  pack_runs "$OUT/runs.tgz"; df -h /tmp | tail -n 1
  cat "$RES/plan.log"; grep -h "done in\|exit\|rror" "$RES"/*.log | tail -n 12
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
  ;;
plan)
  source /tmp/eagle3-env.sh
  lscpu > "$RES/lscpu.txt" 2>&1  # the host's CPU: the probe's head check and vLLM's scheduling run on it
  # the config's target, converted once (an embedded GGUF), before two runs race: its seconds in convert.log
  step "target of $CONFIG"; t=$(date +%s)
  python3 -c "import sys; from eagle3lib.config import load_config; from eagle3lib.target import resolve_model_path
print(resolve_model_path(load_config(sys.argv[1]).target))" "$CONFIG" > "$RES/convert.log" 2>&1
  echo "target ready after $(( $(date +%s) - t )) s" >> "$RES/convert.log"; tail -n 1 "$RES/convert.log"
  g1=$(second_gpu)
  for s in $STEPS; do
    case "$s" in
    recipe)
      if [ "$g1" = 0 ]; then  # one GPU (and one 64 GB disk): the recipe alone, its clock undisturbed
        step "recipe (GPU 0)"
        run_on 0 recipe --run "$RUN"
      else
        step "recipe (GPU 0) | EAGLE-1 style (GPU $g1)"
        run_on 0 recipe --run "$RUN" &
        run_on "$g1" eagle1 --run "$RUN-eagle1" -p "target.layer_ids=[${EAGLE1_LAYER:-29}]" -p "evaluate.methods=[offline, embedded, vllm]" &
        wait
      fi
      ;;
    eagle1)
      step "EAGLE-1 style (GPU 0): target.layer_ids=[${EAGLE1_LAYER:-29}]"
      run_on 0 eagle1 --run "$RUN-eagle1" -p "target.layer_ids=[${EAGLE1_LAYER:-29}]" -p "evaluate.methods=[serve, ngram]"
      ;;
    curve)
      has_states "$RUN" || { step "stages 00-04 of $RUN"; run_on 0 curve_base --run "$RUN" --stages 00-04; }
      for f in ${CURVE:-0.25 0.5 1}; do
        step "stage 05 at train.train_fraction=$f"
        python3 -c "from eagle3lib.rundir import fork_run; fork_run('outputs/$RUN', 'outputs/$RUN-f$f')"
        run_on 0 "curve_$f" --run "$RUN-f$f" --stages 05 -p "train.train_fraction=$f"
      done
      ;;
    modes)
      # ARMS: which forks (default all three; a base without the offline arm runs stage 02 online: no full capture,
      # no 34 GB of shards); MODES_SMALL=1: the small run's data (stage 02 in ~5 min) instead of the recipe's
      mrun=$RUN; mdata=(); spool_fraction=0.5
      if [ "${MODES_SMALL:-0}" = 1 ]; then mrun=$SRUN; mdata=("${SMALL[@]}"); spool_fraction=1; fi
      arms=${ARMS:-offline online spool}
      base_mode=offline; [[ " $arms " == *" offline "* ]] || base_mode=online
      has_states "$mrun" || { step "stages 00, 01, 02, 04 of $mrun ($base_mode)"
                              run_on 0 modes_base --run "$mrun" --stages 00-02,04 "${mdata[@]}" \
                                -p train.hidden_states=$base_mode; }
      for arm in $arms; do
        step "stage 05, one epoch, hidden states $arm"
        python3 -c "from eagle3lib.rundir import fork_run; fork_run('outputs/$mrun', 'outputs/$mrun-$arm')"
        case "$arm" in
        offline) run_on 0 "mode_$arm" --run "$mrun-$arm" --stages 05 "${mdata[@]}" -p train.epochs=1 ;;
        online) run_on 0 "mode_$arm" --run "$mrun-$arm" --stages 02,04,05 "${mdata[@]}" -p train.epochs=1 \
          -p train.hidden_states=online ;;
        # the producer's vLLM engine shares the GPU with the trainer (a third of it is plenty for a 135M target); on
        # the recipe's data half the training rows (tokens/s is per token; the producer's engine start is then a
        # larger share)
        spool) LIMIT=480 run_on 0 "mode_$arm" --run "$mrun-$arm" --stages 02,04,05 "${mdata[@]}" -p train.epochs=1 \
          -p train.train_fraction=$spool_fraction -p train.hidden_states=spool -p extract.backend=vllm \
          -p extract.gpu_memory_utilization=0.3 ;;
        esac
        python3 benchmarks/hidden_state_modes.py --runs "outputs/$mrun" --out "$RES/online_$mrun.json" \
          --note "$(date -u +%F), $(nvidia-smi -L | head -n 1): session.sh STEPS=modes ARMS='$arms', $CONFIG" \
          > "$RES/modes.log" 2>&1
      done
      ;;
    generate)
      step "the generator: 1, 2 and 4 vLLM engines side by side on GPU 0"
      bench_generate 0
      ;;
    vllm_extract)
      step "vLLM prefill vs native and worker capture, random 8B checkpoint"
      bench_vllm 0
      ;;
    benchmarks)
      step "small run, generator settings, arm a (GPU 0) | vLLM prefill/native/worker, arm b: $AB_PARAMS (GPU $g1)"
      ( small_run 0; bench_generate 0; step "arm a"; small_arm 0 a ) &
      # shellcheck disable=SC2086 - AB_PARAMS is a list of -p KEY=VALUE words
      ( bench_vllm "$g1"; for _ in $(seq 60); do has_states "$SRUN" && break; sleep 10; done
        step "arm b"; small_arm "$g1" b $AB_PARAMS ) &
      wait
      ;;
    scaling)
      srun=$RUN; sdata=()
      if ! has_states "$RUN"; then
        srun=$SRUN; sdata=("${SMALL[@]}")
        step "stages 00-04 for $srun"; small_run 0
      fi
      step "draft training, 1 vs 2 GPUs"
      timeout 600 python3 benchmarks/scaling.py train --config "$CONFIG" --run "$srun" "${sdata[@]}" --gpus 2 \
        --steps 200 --out "$RES/scaling_train_h200x2.json" > "$RES/scaling_train.log" 2>&1
      # 256 rows reached 0.77 of 2x writing 1.4 GB/s of shards: in /dev/shm first (is it the scaling?), then on disk
      step "extraction, 1 vs 2 GPUs, in /dev/shm"
      timeout 300 python3 benchmarks/scaling.py extract --gpus 2 --rows 512 --workdir /dev/shm/eagle3-scaling \
        --out "$RES/scaling_extract_shm_h200x2.json" > "$RES/scaling_extract_shm.log" 2>&1
      rm -rf /dev/shm/eagle3-scaling
      step "extraction, 1 vs 2 GPUs, on disk"
      timeout 400 python3 benchmarks/scaling.py extract --gpus 2 --rows 1024 --out "$RES/scaling_extract_h200x2.json" \
        > "$RES/scaling_extract.log" 2>&1
      ;;
    recipe_ab)
      step "recipe (GPU 0) | generator settings, then the recipe's states trained with: $AB_PARAMS (GPU $g1)"
      run_on 0 recipe --run "$RUN" &
      ( bench_generate "$g1"
        for _ in $(seq 120); do has_states "$RUN" && break; sleep 10; done
        step "fork $RUN -> $RUN-b (stages 05-06 with $AB_PARAMS)"
        python3 -c "from eagle3lib.rundir import fork_run; fork_run('outputs/$RUN', 'outputs/$RUN-b')"
        # shellcheck disable=SC2086 - AB_PARAMS is a list of -p KEY=VALUE words
        run_on "$g1" b --run "$RUN-b" --stages 05-06 $AB_PARAMS -p "evaluate.methods=[offline, embedded]" ) &
      wait
      ;;
    *) step "unknown step $s" ;;
    esac
  done
  step done; touch "$RES/DONE"
  ;;
*)
  echo "unknown phase $phase" >&2; exit 2
  ;;
esac
