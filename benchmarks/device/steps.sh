#!/usr/bin/env bash
# The steps of driver.sh's plan, one `run_step NAME` each (sourced by the plan, which has set CONFIG, RUN, RES, g1
# and each step's settings from plan.env, and defined the helpers these use: run_on, fork, has_states, ...).
#
# STEPS: what each runs -> what it writes (stage runs land in outputs/<run>/; what each took on one H200:
# docs/gpu-host.md#what-each-step-takes):
#   recipe       GPU 0: $CONFIG, stages 00-06 as $RUN (one GPU: -> $RES/recipe_<run>.json, benchmarks/recipe.py)
#                | GPU 1: the EAGLE-1-style row, the same data with the draft on one near-final layer
#                (target.layer_ids=[$EAGLE1_LAYER]: default 29, SmolLM2's; 27 for the 1.5B Qwen)
#   eagle1       GPU 0: the EAGLE-1-style run alone ($RUN-eagle1, evaluate.methods=[serve, ngram]: n-gram lookup as a
#                third server): the comparison rows `recipe` has no room for on one GPU
#   recipe_ab    GPU 0: the recipe | GPU 1: the generator benchmark, then the recipe's states forked ($RUN-b) and
#                trained with AB_PARAMS (default -p train.lr=0.002), evaluated offline + embedded (two GPUs)
#   benchmarks   GPU 0: the small run's stages 00-04 (bundled x8 + 4,000 self-instruct prompts), the generator
#                benchmark, arm a | GPU 1: vLLM prefill vs the native and worker captures, then arm b (AB_PARAMS);
#                both arms evaluated embedded (two GPUs)
#   curve        GPU 0: $RUN's stages 00-04 (unless there), then stage 05 on forks at each train.train_fraction of
#                CURVE (default "0.25 0.5 1"): validation EAL against training tokens from one extraction
#                (benchmarks/data_curve.py reads the forks)
#   modes        GPU 0: $RUN's stages 00, 01, 02, 04 (unless there), then one epoch of stage 05 on a fork per arm of
#                ARMS (default "offline online spool"; without offline the base captures no full shards), then
#                benchmarks/hidden_state_modes.py -> $RES/online_<run>.json. MODES_SMALL=1: the small run's data
#   generate     GPU 0: benchmarks/generate.py with ENGINES (default "1 2 4") vLLM engines side by side, 420 s at most
#                a variant -> $RES/generate_engines_h200.json
#   generate_multi  GPU 0: plain vLLM (vllm.LLM(...).generate at its defaults) on $CONFIG's conversations' first
#                turns; then stage 02's self-distillation (continuous multi-turn scheduling) on those conversations,
#                fresh cache, the recipe's generator setting, on each of ENGINES engines, each also answering the
#                first turns in one call: tokens/s by engines against plain vLLM in one run
#                -> $RES/generate_multiturn_<run>.json (each arm's output as it runs: beside it, .<arm>.log).
#                ENGINES="4 1" runs four engines before one, so a lease that ends in the last arm still leaves plain
#                vLLM and four engines in one run; the default "1 2 4" does not fit a 30-minute lease with the 1.5B,
#                and "4 1" wants at least 1,500 device-s left at launch. On an 80 GB card four engines at the 1.5B
#                config's 0.85 share run out of memory (docs/gpu.md#several-generation-engines, "What an engine uses
#                beyond its share"): there, by the same arithmetic, ENGINES="1 2" (not run)
#   peers        GPU 0: $RUN's stages 00-04 (replies from the target's committed cache where it exists), the
#                workbook's stage 05 beside each arm of PEER_ARMS (default speculators_cli; also workbook_adamw,
#                workbook_epochs_x2: benchmarks/peers.py) on its fork, then stage 06 of all of them side by side (k = 3,
#                concurrency 1) -> $RES/peers_<run>.json (+ .md, .png)
#   serve_graphs GPU 0: stage 06's serve step on a random draft of $CONFIG's target (GRAPH_GRID: its k, default 2),
#                with stage 06's CUDA graph sizes and with vLLM's defaults: step time by requests in flight
#                -> $RES/serve_graphs_<run>.json (+ .png; benchmarks/serve_graphs.py)
#   drafter_steps GPU 0: each drafter's server alone with an untrained draft (EAGLE-3 k=3, P-EAGLE k=3, DFlash k=15)
#                against the target alone at concurrency 1, 4, 16 (STEP_GRID: other servers, as --grid's JSON)
#                -> $RES/drafter_steps_<run>.json
#                (benchmarks/drafter_steps.py)
#   algorithms   GPU 0: $RUN's stages 00-04, each drafter of DRAFTERS trained on a fork of its own side by side
#                (ALG_EPOCHS, ALG_TRAIN_FRACTION), then all of them through stage 06, each server alone (ALG_GRID,
#                ALG_BENCH_PROMPTS; ALG_PARAMS: overrides for each of its runs) -> $RES/algorithms_<run>.json
#                (benchmarks/algorithms.py)
#   gen_data     GPU 0: stages 00-02 of $RUN-x$GEN_SCALE ($RUN at GEN_SCALE=1) online: $CONFIG's sources scaled by
#                GEN_SCALE (default 4; 1 = the config's own, e.g. configs/qwen-coder-1.5b-x4-h200.yaml),
#                generated on GEN_ENGINES (default 4) engines (again on one if that fails: the cache keeps what was
#                written); the replies caches come back as caches.txz.* (xz, 15 MiB parts) once the plan is done or
#                with FINAL=1 (recompressed with xz -9e and committed as benchmarks/device/caches/<target>.tar.xz:
#                every entry of the cache it started from is in them)
#   curve_online GPU 0: those committed caches unpacked, stages 00-02 and 04 of $RUN-x$GEN_SCALE online, then stages
#                05 (one epoch, online) and 06 (embedded) on forks at each train.train_fraction of CURVE (default
#                "1"), side by side when there are several
#   serve_vs_plain GPU 0: a finished stage 06's serve figure at concurrency 1 (outputs/$SVP_RUN, default $RUN; after
#                `algorithms`: SVP_RUN=$RUN-drafters) against two plain `vllm serve`s, with and without its EAGLE-3
#                draft, each alone, driven one request after another at its max tokens and at 256
#                -> $RES/serve_vs_plain_<run>.json (benchmarks/serve_vs_plain.py)
#   side_by_side GPU 0: stage 06 of a finished run (outputs/$SVP_RUN) again on a fork ($SVP_RUN-sbs) from that run's
#                own resolved config, its servers side by side (evaluate.serve_side_by_side_kv_gib: 8), then
#                `eagle3 compare` of both -> $RES/side_by_side_<run>.md: what sharing one GPU does to the figures a
#                verdict rests on (docs/serving.md#the-card-and-a-plain-server)
#   kimi_shaped  GPU 0: scripts/kimi_shaped.py's Kimi-K2.5-shaped checkpoint, then stages 00-06 of $CONFIG
#                (configs/kimi-k2.5-shaped-1gpu.yaml) as $RUN, then stage 02 of a fork ($RUN-mp) through vLLM's
#                multiprocess executor -> $RES/kimi_shaped_<run>.json (benchmarks/kimi_shaped.py);
#                its tokenizer is SmolLM2's: bundle CONFIGS="configs/smollm2-h200.yaml configs/kimi-k2.5-shaped-1gpu.yaml"
#   fp8_ab       GPU 0: $RUN-fp8ab, stages 00-06 with bf16 shards and one epoch, then benchmarks/fp8_ab.py's FP8 fork
#                of it (stages 02-06) -> $RES/fp8_ab_$RUN.json
#   vllm_extract GPU 0: vLLM prefill vs the workbook's native and worker captures on a random Llama-3.1-8B-shaped
#                checkpoint (256 x 2048 tokens), the capture probe timed (VLLM_MODES: which modes)
#                -> $RES/extract_vllm_h200.json
#   scaling      both GPUs: draft training 1 vs 2 GPUs (torchrun) on $RUN (else the small run, made first), then
#                extraction 1 vs 2 GPUs in /dev/shm and on disk -> $RES/scaling_*_h200x2.json
# Before any step: the copies and the install (by the bundle's size) and the target's conversion.

# what a result's note opens with: the date, the machine and the commit the plan ran (docs/results.md's columns)
made_on() {
  echo "$(date -u +%F), $(nvidia-smi -L | wc -l)x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" \
    "($(nproc) host cores), at $(git describe --always --dirty --abbrev=7 --exclude '*' 2> /dev/null || echo '(no git)')"
}

run_step() {
  local s=$1
  case "$s" in
  recipe)
    if [ "$g1" = 0 ]; then  # one GPU (and one 64 GB disk): the recipe alone, its clock undisturbed
      step "recipe (GPU 0)"
      unpack_replies "$RUN"
      run_on 0 recipe --run "$RUN"
      python3 benchmarks/recipe.py --run-dir "outputs/$RUN" --out "$RES/recipe_$RUN.json" \
        --note "$(made_on): driver.sh STEPS=recipe, $CONFIG" > "$RES/recipe_json.log" 2>&1
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
      fork "$RUN" "$RUN-f$f"
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
      fork "$mrun" "$mrun-$arm"
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
        --note "$(made_on): driver.sh STEPS=modes ARMS='$arms', $CONFIG" \
        > "$RES/modes.log" 2>&1
    done
    ;;
  generate)
    step "the generator: 1, 2 and 4 vLLM engines side by side on GPU 0"
    bench_generate 0
    ;;
  generate_multi)
    # plain vLLM on $CONFIG's conversations' first turns (--vllm-offline: it has no multi-turn scheduling; first,
    # so a run cut off keeps the reference), then stage 02's self-distillation itself (continuous multi-turn
    # scheduling) on those conversations from a fresh cache on each of ENGINES engines, then the same engines on
    # the first turns in one call (--first-turns)
    # -> $RES/generate_multiturn_$RUN.json: tokens_per_s_by_engines, vllm_offline_tokens_per_s and the ratios
    # (benchmarks/generate.py --multi-turn; the recipe's replies: 384 new tokens, its generator setting: a variant
    # replaces the config's data.gen_vllm_args, so it is passed, as bench_generate passes it)
    step "self-distillation on ${ENGINES:-1 2 4} engines and plain vLLM: $CONFIG's conversations"
    CUDA_VISIBLE_DEVICES=0 timeout 1800 python3 benchmarks/generate.py --config "$CONFIG" --multi-turn \
      --prompts 100000 --max-new-tokens 384 --temperatures 0.0 --variants "$GEN_RECIPE" \
      --engines ${ENGINES:-1 2 4} --first-turns --vllm-offline --timeout 540 \
      --out "$RES/generate_multiturn_$RUN.json" > "$RES/generate_multi.log" 2>&1
    ;;
  serve_graphs)
    # stage 06's serve step on a random draft of $CONFIG's target, servers as $CONFIG has them (the GPU configs:
    # alone, one after another), a level at a time: a speculating server's step time by requests in flight with
    # stage 06's CUDA graph sizes and with vLLM's defaults (benchmarks/serve_graphs.py; GRAPH_GRID: draft tokens per
    # server, default 2, the k the sizes fix)
    step "a random draft's servers: graph sizes against vLLM's defaults"
    # shellcheck disable=SC2086 - GRAPH_GRID is a list of k
    CUDA_VISIBLE_DEVICES=0 timeout 1200 python3 benchmarks/serve_graphs.py --config "$CONFIG" --run "$RUN-graphs" \
      --grid ${GRAPH_GRID:-2} --levels 4 5 9 12 13 16 --out "$RES/serve_graphs_$RUN.json" \
      --png "$RES/serve_graphs_$RUN.png" \
      --note "$(made_on): driver.sh STEPS=serve_graphs, $CONFIG" \
      > "$RES/serve_graphs.log" 2>&1
    ;;
  gen_data)
    x=${GEN_SCALE:-4}; grun=$(gen_run); gargs=(-p train.hidden_states=online -p "$(scaled_sources "$x")" \
      -p "data.gen_engines=${GEN_ENGINES:-4}")
    unpack_replies "$grun"
    step "stages 00-02 of $grun online: ${x}x the recipe's data, ${GEN_ENGINES:-4} generator engines"
    run_on 0 gen_data --run "$grun" --stages 00-02 "${gargs[@]}"
    if ! grep -q "gen_data exit 0 " "$RES/gen_data.log"; then
      free_gpus; step "stages 00-02 of $grun again with one generator engine (the cache keeps what was written)"
      run_on 0 gen_data_1 --run "$grun" --stages 00-02 "${gargs[@]}" -p data.gen_engines=1
    fi
    ;;
  curve_online)
    # the data curve from gen_data's replies caches (committed under benchmarks/device/caches), unpacked: stages
    # 00-02 online and 04 of the GEN_SCALE run (the self-instruct prompts all come from the cache; the distilled
    # replies too when their key matches, which it has not since the key changed:
    # docs/gpu.md#several-generation-engines), then stages 05 (one epoch, online) and 06 (embedded: held-out tau)
    # on forks at train.train_fraction = each of CURVE (default "1": 4x the recipe's data; 0.5: a random half of
    # the 4x rows = 2x; one validation split for all).
    # gen_data's very settings (data.gen_engines included: the data section's hash is in stage 02's manifest, and
    # a missed cache then generates on as many engines). Several forks run side by side on GPU 0 (how much they
    # slow each other is not measured): their stage times are then those of runs sharing one GPU (say so in the
    # result's note)
    x=${GEN_SCALE:-4}; grun=$(gen_run); gargs=(-p train.hidden_states=online -p "$(scaled_sources "$x")" \
      -p "data.gen_engines=${GEN_ENGINES:-4}")
    unpack_replies "$grun"  # without a cache, stage 02 generates every reply
    has_states "$grun" || { step "stages 00-02, 04 of $grun online from the cached replies"
                            run_on 0 curve_base --run "$grun" --stages 00-02,04 "${gargs[@]}"; }
    for f in ${CURVE:-1}; do
      step "stages 05-06 of $grun at train.train_fraction=$f, one epoch online (side by side)"
      fork "$grun" "$grun-f$f"
      run_on 0 "curve_$f" --run "$grun-f$f" --stages 05-06 "${gargs[@]}" -p "train.train_fraction=$f" \
        -p train.epochs=1 -p "evaluate.methods=[embedded]" &
    done
    wait
    ;;
  peers)
    # the workbook beside speculators' own CLI and the workbook's variants (benchmarks/peers.py ARMS) on the recipe's
    # conversations: stages 00-04 of $RUN (its replies from benchmarks/device/caches/$RUN.tar.xz where that exists;
    # else generated on PEER_GEN_ENGINES engines, default 2, and once more on one if that fails: the cache keeps
    # what was written), then the workbook's stage 05 and each arm of PEER_ARMS (default speculators_cli) on its
    # fork, side by side on GPU 0, then stage 06 of every arm side by side: k = 3 alone, at
    # concurrency 1, each server in a fixed share of the GPU (an arm's two servers, the draft's and the baseline's,
    # start together, evaluate.serve_side_by_side_kv_gib=8 (the GPU configs serve alone); those of up to four arms at
    # once; tau does not depend on what else runs, the speedups do: they are then under that sharing) -> $RES/peers_$RUN.json
    # (+ .md, .png)
    pe=(-p "evaluate.serve_concurrency=[1]" -p "evaluate.serve_grid=[{num_speculative_tokens: 3}]"
        -p "evaluate.serve_args=${PEER_SERVE_ARGS:-$PEER_SERVE_GPU}" -p "evaluate.serve_side_by_side_kv_gib=8")
    pg=(-p "data.gen_engines=${PEER_GEN_ENGINES:-2}")
    arms=${PEER_ARMS:-speculators_cli}
    unpack_replies "$RUN"
    if ! has_states "$RUN"; then
      step "stages 00-04 of $RUN (${PEER_GEN_ENGINES:-2} generator engines)"
      run_on 0 peers_base --run "$RUN" --stages 00-04 "${pg[@]}"
      if ! has_states "$RUN"; then
        free_gpus; pg=(-p data.gen_engines=1); step "stages 00-04 of $RUN again with one generator engine"
        run_on 0 peers_base_1 --run "$RUN" --stages 00-04 "${pg[@]}"
      fi
    fi
    # peers.py's own steps, logged and timed as run_on's: $1 = log name, the rest = its arguments
    peers_py() { local name=$1 t; shift; t=$(date +%s)
      CUDA_VISIBLE_DEVICES=0 timeout "${LIMIT:-1800}" python3 benchmarks/peers.py "$@" --run-dir "outputs/$RUN" \
        > "$RES/$name.log" 2>&1
      echo "$name exit $? after $(( $(date +%s) - t )) s" >> "$RES/$name.log"; }
    step "stage 05: the workbook | $arms, each on a fork (side by side on GPU 0)"
    run_on 0 peers_workbook_05 --run "$RUN" --stages 05 "${pg[@]}" &
    for a in $arms; do peers_py "peers_train_$a" train --arm "$a" & done
    wait
    step "stage 06 of the workbook and of $arms (side by side on GPU 0)"
    run_on 0 peers_workbook_06 --run "$RUN" --stages 06 "${pg[@]}" "${pe[@]}" &
    for a in $arms; do sleep 20; peers_py "peers_eval_$a" evaluate --arm "$a" "${pe[@]}" & done
    wait
    # a stage 06 that failed beside the others runs again alone, its servers one after another with vLLM's own
    # memory settings
    pe_alone=("${pe[@]:0:4}" -p "evaluate.serve_args=[]" -p "evaluate.serve_side_by_side_kv_gib=null")
    grep -q "peers_workbook_06 exit 0 " "$RES/peers_workbook_06.log" || { free_gpus
      step "stage 06 of the workbook again, alone"; run_on 0 peers_workbook_06_alone --run "$RUN" --stages 06 "${pg[@]}" "${pe_alone[@]}"; }
    for a in $arms; do
      grep -q "peers_eval_$a exit 0 " "$RES/peers_eval_$a.log" || { free_gpus
        step "stage 06 of $a again, alone"; peers_py "peers_eval_${a}_alone" evaluate --arm "$a" "${pe_alone[@]}"; }
    done
    # shellcheck disable=SC2086 - arms is a list of names
    python3 benchmarks/peers.py report --run-dir "outputs/$RUN" --arms $arms --out "$RES/peers_$RUN.json" \
      --note "$(made_on): driver.sh STEPS=peers PEER_ARMS='$arms', $CONFIG ${pg[*]} ${pe[*]}; training side by side, stage 06 side by side" \
      > "$RES/peers_report.log" 2>&1
    ;;
  drafter_steps)
    # what a step with each drafter costs $CONFIG's target, each server alone, with untrained drafts (a forward
    # costs the same whatever the weights): EAGLE-3 k=3, P-EAGLE k=3, DFlash k=15 against the target alone at
    # concurrency 1, 4, 16 (benchmarks/drafter_steps.py) -> $RES/drafter_steps_$RUN.json
    step "untrained drafts' servers, each alone: the step cost per drafter"
    CUDA_VISIBLE_DEVICES=0 timeout 1500 python3 benchmarks/drafter_steps.py --config "$CONFIG" --run "$RUN-steps" --requests 16 ${STEP_GRID:+--grid "$STEP_GRID"} \
      --out "$RES/drafter_steps_$RUN.json" \
      --note "$(made_on): driver.sh STEPS=drafter_steps, $CONFIG" \
      > "$RES/drafter_steps.log" 2>&1
    ;;
  algorithms)
    # EAGLE-3, P-EAGLE and DFlash from the same states (benchmarks/algorithms.py): stages 00-04 of $RUN (its
    # committed replies), each drafter of DRAFTERS trained on a fork of its own side by side on GPU 0, each with its
    # own train.drafter_settings from $CONFIG (ALG_EPOCHS,
    # default 1, over ALG_TRAIN_FRACTION of the training rows, default all), then $RUN-drafters (`algorithms.py join`: every drafter's finished checkpoints) through stages 05
    # (each resumed: nothing left to train) and 06 with every server alone, one after another (ALG_GRID: the
    # drafters' serve settings; ALG_BENCH_PROMPTS questions per benchmark) -> $RES/algorithms_$RUN.json
    drafters=${DRAFTERS:-eagle3 peagle dflash}
    # ALG_PARAMS: overrides for every run of the step (-p KEY=VALUE words, no spaces inside a value), e.g. fewer
    # rows (-p data.num_samples=2400) where the device time left is short
    # shellcheck disable=SC2206 - ALG_PARAMS is a list of -p KEY=VALUE words
    ta=($ALG_PARAMS -p "train.epochs=${ALG_EPOCHS:-1}" -p "train.train_fraction=${ALG_TRAIN_FRACTION:-1}")
    ea=(-p "evaluate.serve_side_by_side_kv_gib=null" -p "evaluate.benchmark_prompts=${ALG_BENCH_PROMPTS:-40}"
        -p "evaluate.serve_grid=${ALG_GRID:-$ALG_GRID_DEFAULT}")
    # the joined run's overrides, checked before anything trains: refused there, they would end the step after it
    if ! config_ok -p "train.algorithms=[${drafters// /, }]" "${ta[@]}" "${ea[@]}" > "$RES/alg_config.log" 2>&1; then
      step "the joined run's overrides are refused: $(tail -n 1 "$RES/alg_config.log")"; return
    fi
    unpack_replies "$RUN"
    has_states "$RUN" || { step "stages 00-04 of $RUN"; run_on 0 alg_base --run "$RUN" --stages 00-04 $ALG_PARAMS; }
    step "stage 05 of each of $drafters on a fork of its own (side by side on GPU 0)"
    for a in $drafters; do
      fork "$RUN" "$RUN-$a"; run_on 0 "alg_train_$a" --run "$RUN-$a" --stages 05 -p "train.algorithms=[$a]" "${ta[@]}" &
    done
    wait
    step "stages 05 (resumed) and 06 of $RUN-drafters: each server alone"
    # shellcheck disable=SC2086 - drafters is a list of names
    together="training side by side on one GPU,"; [ "$(wc -w <<< "$drafters")" -gt 1 ] || together="training alone,"
    joined=$(python3 benchmarks/algorithms.py join --base "outputs/$RUN" --drafters $drafters 2> "$RES/alg_join.log")
    echo "joined: $joined" >> "$RES/alg_join.log"
    run_on 0 alg_eval --run "$RUN-drafters" --stages 05-06 -p "train.algorithms=$joined" "${ta[@]}" "${ea[@]}"
    python3 benchmarks/algorithms.py report --run-dir "outputs/$RUN-drafters" --out "$RES/algorithms_$RUN.json" \
      --note "$(made_on): driver.sh STEPS=algorithms DRAFTERS='$drafters', $CONFIG ${ta[*]} ${ea[*]}; $together each server alone" \
      > "$RES/alg_report.log" 2>&1
    ;;
  serve_vs_plain)
    step "stage 06's serve figure of ${SVP_RUN:-$RUN} against plain servers, each alone"
    CUDA_VISIBLE_DEVICES=0 timeout 900 python3 benchmarks/serve_vs_plain.py --run-dir "outputs/${SVP_RUN:-$RUN}" \
      --max-tokens 256 --out "$RES/serve_vs_plain_${SVP_RUN:-$RUN}.json" \
      --note "$(made_on): driver.sh STEPS=serve_vs_plain SVP_RUN=${SVP_RUN:-$RUN}, $CONFIG" \
      > "$RES/serve_vs_plain.log" 2>&1
    ;;
  side_by_side)
    step "stage 06 of ${SVP_RUN:-$RUN} again, its servers side by side"
    src=${SVP_RUN:-$RUN}
    # a fork has stages 00-04 (hard links); its drafts and stage 05's manifest are linked in too, and stage 06 runs
    # from scratch (checked on the CPU box with the demo: the source's files stay as they were)
    fork "$src" "$src-sbs" && cp -al "outputs/$src/draft" "outputs/$src-sbs/draft" \
      && ln "outputs/$src"/manifests/05_*.json "outputs/$src-sbs/manifests/"
    CONFIG="outputs/$src/config.yaml" run_on 0 sbs --run "$src-sbs" --stages 06 -p "evaluate.serve_side_by_side_kv_gib=8"
    # the note first (date, machine, commit, command), then the comparison
    { echo "$(made_on): driver.sh STEPS=side_by_side SVP_RUN=$src, stage 06 of" \
        "outputs/$src (each server alone) and of its fork $src-sbs (side by side, evaluate.serve_side_by_side_kv_gib=8)"
      echo; python3 -m eagle3lib.cli compare "outputs/$src" "outputs/$src-sbs"; } > "$RES/side_by_side_$src.md" 2> "$RES/sbs_compare.log"
    ;;
  kimi_shaped)
    # the Kimi-K2.5 path on GPU kernels: scripts/kimi_shaped.py's checkpoint (the kimi_k25 wrapper, MLA and MoE
    # shapes per layer, 2.2B, random weights) at the path $CONFIG names (configs/kimi-k2.5-shaped-1gpu.yaml:
    # /tmp/kimi-shaped), then stages 00-06 of $CONFIG as $RUN -> $RES/kimi_shaped_$RUN.json (benchmarks/kimi_shaped.py:
    # stage seconds, the probe, vLLM's attention backend and MoE kernel, the served draft's tau and tokens/s)
    step "Kimi-K2.5-shaped checkpoint"
    python3 scripts/kimi_shaped.py --out "$(target_model)" > "$RES/kimi_build.log" 2>&1
    # at vLLM's INFO level: its lines naming the attention backend and MoE kernel it chose (the workbook sets
    # WARNING unless VLLM_LOGGING_LEVEL is set, eagle3lib/common/quiet.py) land in the run's engine and server logs
    step "stages 00-06 of $RUN"; (export VLLM_LOGGING_LEVEL=INFO; run_on 0 kimi --run "$RUN")
    # then stage 02 again on a fork, at tensor parallel 1 through the multiprocess executor tensor parallel 8 takes
    # (docs/capture.md#one-gpu-through-the-multi-gpu-path): the capture worker and its probe behind vLLM's RPC
    step "stage 02 of $RUN-mp: the capture through vLLM's multiprocess executor"
    fork "$RUN" "$RUN-mp"
    # without the parent's shards and probe (hard links: the parent keeps them), so that every row is captured again
    rm -rf "outputs/$RUN-mp/dataset/hidden_states" "outputs/$RUN-mp/capture_probe.json"
    run_on 0 kimi_mp --run "$RUN-mp" --stages 02 -p "extract.vllm_args={distributed_executor_backend: mp}"
    python3 benchmarks/kimi_shaped.py --run-dir "outputs/$RUN" --log "$RES/kimi.log" --out "$RES/kimi_shaped_$RUN.json" \
      --mp-run-dir "outputs/$RUN-mp" \
      --note "$(made_on): driver.sh STEPS=kimi_shaped, $CONFIG" \
      > "$RES/kimi_report.log" 2>&1
    ;;
  fp8_ab)
    # FP8 vs bf16 shards on the recipe's data, same seed, one epoch each, held-out tau (embedded): arm A
    # ($RUN-fp8ab) = stages 00-06 with bf16 shards; arm B = benchmarks/fp8_ab.py's fork of it (stage 02 again from
    # the cached replies with extract.fp8_shards=true, then 03-06) -> $RES/fp8_ab_<run>.json. The replies: the
    # target's committed cache where there is one (SmolLM2's distilled replies are in none, so stage 02 distills
    # them: docs/gpu.md#several-generation-engines). Disk: 34.4 GB of bf16 shards + ~17 GB of FP8 of the ~62 GB
    # free. MT-Bench left out (~220 s an arm): with the copies and the target the two arms take most of a
    # 30-minute device budget (docs/gpu-host.md#what-each-step-takes)
    arun=$RUN-fp8ab; abargs=(-p train.epochs=1 -p "evaluate.methods=[embedded]" -p "evaluate.benchmarks=[]")
    unpack_replies "$arun"
    step "FP8 A/B, arm A: $arun, stages 00-06 with bf16 shards, one epoch"
    run_on 0 fp8ab_a --run "$arun" "${abargs[@]}"
    step "FP8 A/B, arm B: the same rows in FP8 shards (benchmarks/fp8_ab.py)"
    t=$(date +%s)
    timeout 1500 python3 benchmarks/fp8_ab.py --config "$CONFIG" --run "$arun" "${abargs[@]}" \
      --out "$RES/fp8_ab_$RUN.json" --note "$(made_on): driver.sh STEPS=fp8_ab, $CONFIG" \
      > "$RES/fp8ab_b.log" 2>&1
    echo "fp8ab_b exit $? after $(( $(date +%s) - t )) s" >> "$RES/fp8ab_b.log"
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
      fork "$RUN" "$RUN-b"
      # shellcheck disable=SC2086 - AB_PARAMS is a list of -p KEY=VALUE words
      run_on "$g1" b --run "$RUN-b" --stages 05-06 $AB_PARAMS -p "evaluate.methods=[offline, embedded]" ) &
    wait
    ;;
  *) step "unknown step $s" ;;
  esac
}
