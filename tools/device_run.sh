#!/bin/sh
# One device call: install MLX CUDA (if given), then check and time the kernels.
#
#   sh scripts/gpu_run.sh [install|ensure] [quick|full|bench|vout|perlayer|fastpath|finematrix|finematrix16k|fcheck|steplanes|ab|tune|tpk8|tpk16|variants|mma|hostprobe|graphs|gfold|fprobe|gfold_ab|pytest|tests|sweep|qfold|qtile|matrix|model|realmodel|ptx]...
#
# "install" expects .gpu/part1 already copied to /root/mlxw (previous call) and
# .gpu/part2 and .gpu/lib (mlx_lm) carried now; "ensure" reuses a warm install.
# See docs/GPU.md. Logs go to $OUT when set.
set -u
OUT=${OUT:-/tmp/h2o_out}
mkdir -p "$OUT"
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1  # mlx + mlx_lm live in /root/site
status=0

# gpu_split.py over context:budget PAIRS, $strategies (default: the issue's),
# $rounds rounds, a log each as $OUT/PREFIX_context_budget.log; LIMIT seconds a
# run (0: none); ARGS follow.
strategies="kvcache rotating h2o_no_evict h2o h2o_batch64"
rounds=6
split_runs() {
  pairs=$1 prefix=$2 limit=$3
  shift 3
  for cb in $pairs; do
    timeout "$limit" python3 scripts/gpu_split.py "$@" --no-trace --pin 5 --rounds $rounds \
      --context ${cb%:*} --budget ${cb#*:} --strategies $strategies \
      2>&1 | tee "$OUT/${prefix}_${cb%:*}_${cb#*:}.log" \
      | grep -v "^round\|^{" || status=1
  done
}

# split_runs with other STRATEGIES and ROUNDS for this call only:
# split_with STRATEGIES ROUNDS PAIRS PREFIX LIMIT [ARGS]
split_with() {
  kept_s=$strategies kept_r=$rounds
  strategies=$1 rounds=$2
  shift 2
  split_runs "$@"
  strategies=$kept_s rounds=$kept_r
}

for step in "$@"; do
  case "$step" in
    install)
      cp .gpu/part2/* /root/mlxw/ && sh /root/mlxw/install.sh /root/site >/dev/null || exit 3
      cp -r .gpu/lib/* /root/site/ || exit 3
      [ -f .gpu/ptx.tgz ] && mkdir -p /tmp/mlx && tar -xzf .gpu/ptx.tgz -C /tmp/mlx
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available())"
      ;;
    ensure)  # reuse a warm machine's install; mlx_lm travels in .gpu/lib
      python3 -c "import mlx.core as mx; assert mx.cuda.is_available()" || exit 3
      cp -r .gpu/lib/* /root/site/ || exit 3
      [ -f .gpu/ptx.tgz ] && mkdir -p /tmp/mlx && tar -xzf .gpu/ptx.tgz -C /tmp/mlx
      ;;
    model)  # a real model carried in parts (scripts/gpu_model_parts.sh) -> /root/model
      mkdir -p /root/mparts /root/model && cp .gpu/model/m*/* /root/mparts/ 2>/dev/null
      cat $(ls /root/mparts/model.tar.* | sort -t. -k3 -n) | tar -xf - -C /root/model || exit 3
      echo "$(cat /root/mparts/weights.sha256)  /root/model/model.safetensors" | sha256sum -c - || exit 3
      ;;
    tests)  # every test file with a GPU path (or those in $TESTS), on the GPU
      all="test_kernels_gpu test_group_fold_gpu test_queue_fold_gpu test_fused_wiring
        test_step_group test_deferred_scores test_kv_write_gpu test_quantized_kernel
        test_evict_batch test_ops_step test_selfcheck test_native"
      files=$(for t in ${TESTS:-$all}; do printf 'tests/%s.py ' "$t"; done)
      # SIGINT at the limit: pytest still prints which tests failed and why
      timeout -s INT 450 python3 -m pytest -q -rf --tb=short -p no:cacheprovider $files \
        2>&1 | tee "$OUT/pytest_gpu.log" | tail -30 ;;
    sweep)  # the test files that never ran on a GPU (docs/GPU.md, session 14)
      files=$(ls tests/test_*.py | grep -v -e _gpu.py -e fused_wiring -e step_group \
        -e deferred_scores -e quantized_kernel -e evict_batch -e ops_step -e selfcheck -e swift)
      timeout -s INT 540 python3 -m pytest -q -rf --tb=short -p no:cacheprovider $files \
        2>&1 | tee "$OUT/pytest_sweep.log" | tail -40 ;;
    matrix)  # the decode matrix, Qwen3-8B shapes (session 22): contexts
             # 256-16K, budgets 256 / 1K, every strategy, one process each
      split_runs "256:256 4096:256 4096:1024 16384:256 16384:1024" split 105 --steps 32 ;;
    finematrix)  # the matrix interleaved finer (session 24): 40 rounds of 8 tokens a
                 # strategy, so the host's slow and fast phases fall on every strategy
      split_with "$strategies" 40 "256:256 4096:256 4096:1024" finematrix 180 --steps 8 ;;
    finematrix16k)  # its 16K rows (one call each half: the 600 s limit)
      split_with "$strategies" 40 "16384:256 16384:1024" finematrix 240 --steps 8 ;;
    realmodel)  # the decode benchmark on the carried real model (after "model")
      split_runs "256:256 4096:256 4096:1024 16384:1024" real 0 --model /root/model --steps 64 ;;
    vout)  # session 23: the group fold's victims as slices (h2o) or an output a layer
      vout="rotating h2o h2o_victim_outputs"
      split_with "$vout" 6 "4096:256 16384:1024" vout 150 --steps 32
      split_with "$vout" 6 "4096:256" vout_again 150 --steps 32 ;;
    perlayer)  # session 24: the per-layer fused step (no group) against the group
      split_with "rotating h2o h2o_per_layer" 6 "4096:256 16384:1024 256:256 4096:1024" \
        perlayer 150 --steps 32 ;;
    fastpath)  # session 24: the steady state's fast path against the general path
      split_with "rotating h2o h2o_general_path" 6 "4096:256 16384:1024 256:256 4096:1024" \
        fastpath 150 --steps 32 ;;
    fcheck)  # the fold and fused-step sections of gpu_check (masked runs too)
      timeout 400 python3 scripts/gpu_check.py --skip-attention --fused-steps 100 2>&1 \
        | tee "$OUT/check_fused.log" | grep -v ": ok$" || status=1 ;;
    steplanes)  # a whole fused layer step, 32 lanes a key row against the default
      for t in 32 0 32 0; do
        python3 scripts/bench_kernels.py --repeats 3 --dims 128 --ns 256 --step \
          --lanes-per-key $t 2>&1 | tee -a "$OUT/bench_step_tpk$t.log" | grep -v "^{" || status=1
      done ;;
    ab)  # kernel microbenchmark, a base commit (.gpu/old: git archive BASE mlx_h2o
         # scripts/bench_kernels.py) against this tree, alternating; $BENCH_ARGS
      for i in 1 2; do
        python3 .gpu/old/scripts/bench_kernels.py ${BENCH_ARGS:-} 2>&1 \
          | tee -a "$OUT/bench_old.log" | grep -v "^{" || status=1
        python3 scripts/bench_kernels.py ${BENCH_ARGS:-} 2>&1 \
          | tee -a "$OUT/bench_new.log" | grep -v "^{" || status=1
        python3 scripts/bench_kernels.py --plain ${BENCH_ARGS:-} 2>&1 \
          | tee -a "$OUT/bench_plain.log" | grep -v "^{" || status=1
      done ;;
    tpk8)  # four key rows a warp read at D=64 (decode.LANES_PER_KEY = 8): its checks, then D=64 timings
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k float64 2>&1 | tail -3
      timeout 400 python3 scripts/gpu_check.py --attention-only --lanes-per-key 8 2>&1 \
        | tee "$OUT/check_tpk8.log" | grep -v ": ok$" || status=1
      for t in 16 8 16 8; do
        python3 scripts/bench_kernels.py --repeats 3 --dims 64 --lanes-per-key $t 2>&1 \
          | tee -a "$OUT/bench_d64_tpk$t.log" | grep -v "^{" || status=1
      done ;;
    tpk16)  # 16 lanes a key row at D 80 / 96 (never timed): checks at TPK 16, then timings
      timeout 300 python3 scripts/gpu_check.py --attention-only --lanes-per-key 16 2>&1 \
        | tee "$OUT/check_tpk16.log" | grep -v ": ok$" || status=1
      for t in 32 16 32 16; do
        python3 scripts/bench_kernels.py --repeats 3 --dims 80 96 --lanes-per-key $t 2>&1 \
          | tee -a "$OUT/bench_d8096_tpk$t.log" | grep -v "^{" || status=1
      done ;;
    variants)  # pass 1's launch knobs side by side ($VARIANTS, e.g. "'' MAX_ROWS=2"; session 19)
      eval "set -- $VARIANTS"
      timeout 500 python3 scripts/bench_kernels.py --repeats 3 --dims ${DIMS:-64 128} \
        --ns ${NS:-1024 4096 16384 32768} --variants "$@" 2>&1 \
        | tee -a "$OUT/bench_variants.log" | grep -v "^{" || status=1 ;;
    mma)  # the tensor-core pass 1 (session 19): timings with it at D=64 (the default)
          # and off ($VARIANTS), with GPU time per kernel, then its float64 checks and the shared body's
      eval "set -- ${VARIANTS:-\"\" MMA=0}"
      python3 scripts/bench_kernels.py --repeats 3 --dims ${DIMS:-64 128} \
        --ns ${NS:-4096 16384 32768} --variants "$@" --trace 2>&1 \
        | tee -a "$OUT/bench_mma.log" | grep -v "^{" || status=1
      timeout -s INT 270 python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
        tests/test_kernels_gpu.py -k "mma or float64" 2>&1 | tee "$OUT/pytest_mma.log" | tail -8 ;;
    gfold)  # first decode steps ($STRATEGY) with our cubins built / read back /
            # MLX's builds (session 18)
      for run in built cached mlx; do
        [ $run = mlx ] && export MLX_H2O_CUBIN_CACHE=0
        python3 scripts/gpu_step_times.py --strategy ${STRATEGY:-h2o_evict_256} --steps 64 \
          2>&1 | tee "$OUT/step_times_$run.log" || status=1
        unset MLX_H2O_CUBIN_CACHE
      done ;;
    fprobe)  # the group fold's host cost, MLX's build / ours, direct / compiled
      for i in 1 2; do  # two processes: the second finds our cubins on disk
        python3 scripts/gpu_split.py --ops-only 2>&1 | grep "fold probe" | tee -a "$OUT/fold_probe.log"
      done ;;
    gfold_ab)  # the wired cache's GPU check, then decode with either group fold, interleaved
      timeout 560 python3 scripts/gpu_cache_check.py --rounds ${ROUNDS:-8} --variants mlxfold \
        2>&1 | tee "$OUT/cache_check_mlxfold.log" || status=1 ;;
    ptx)  # bring compiled kernels back, so a cold machine skips NVRTC
      tar -czf "$OUT/ptx.tgz" -C /tmp/mlx . && ls -la "$OUT/ptx.tgz" ;;
    quick) python3 scripts/gpu_check.py --quick --fused-steps 120 2>&1 | tee "$OUT/check_quick.log" || status=1 ;;
    full) timeout 420 python3 scripts/gpu_check.py --fused-steps 200 2>&1 | tee "$OUT/check.log" || status=1 ;;
    graphs)  # lead of session 20: does MLX's CUDA graph cache (100 graphs, cleared whole
             # when full) re-instantiate graphs for H2O's decode tokens? H2O vs Rotating
             # with MLX's defaults, a 10x cache, and CUDA graphs off
      for env in MLX_CUDA_GRAPH_CACHE_SIZE=100 MLX_CUDA_GRAPH_CACHE_SIZE=1000 MLX_USE_CUDA_GRAPHS=0; do
        echo "== $env"
        env "$env" timeout 170 python3 scripts/gpu_split.py --pin 5 --rounds 6 --steps 32 \
          --context ${CONTEXT:-4096} --budget ${BUDGET:-256} --strategies rotating h2o 2>&1 \
          | tee -a "$OUT/graphs.log" | grep -v "^round\|^{" || status=1
      done ;;
    hostprobe)  # what a call's graph building costs, piece by piece (session 20)
      python3 scripts/gpu_host_probe.py 2>&1 | tee "$OUT/host_probe.log" || status=1 ;;
    bench) python3 scripts/bench_kernels.py --step 2>&1 | tee "$OUT/bench.log" || status=1 ;;
    tune)
      for u in 4 8; do
        python3 scripts/bench_kernels.py --dims 128 --ns 1024 32768 --tune --repeats 3 --lanes-per-key 32 \
          --keys-per-group $u 2>&1 | tee -a "$OUT/tune.log" || status=1
      done ;;
    pytest) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tail -5 ;;
    qtile)  # the queue fold's tiles: float64 checks of each, its kernel tests, timings
      python3 scripts/gpu_check.py --skip-attention --fused-steps 2 > "$OUT/check_qtile.log" 2>&1 || status=1
      grep -v ": ok$" "$OUT/check_qtile.log"; grep -c ": ok$" "$OUT/check_qtile.log"
      python3 -m pytest -q -p no:cacheprovider tests/test_queue_fold_gpu.py \
        -k "any_visible or rejects or kernel_fold_equals" 2>&1 | tail -3
      python3 scripts/bench_queue_fold.py --reps 10 2>&1 | tee "$OUT/bench_queue_tiles.log" | grep -v "^{" ;;
    qfold)  # the queue fold (kernels/queued.py): float64 checks, its tests, one-fold timings
      python3 scripts/gpu_check.py --skip-attention --fused-steps 60 > "$OUT/check_qfold.log" 2>&1 || status=1
      grep -v ": ok$" "$OUT/check_qfold.log"
      python3 -m pytest -q -p no:cacheprovider tests/test_queue_fold_gpu.py 2>&1 | tail -3
      python3 scripts/bench_queue_fold.py 2>&1 | tee "$OUT/bench_queue_fold.log" | grep -v "^{" ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
