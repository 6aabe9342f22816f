#!/bin/sh
# GPU checks and benchmarks on a CUDA machine, one step after another.
#
#   sh tools/device_run.sh STEP...        (from anywhere; it runs in the repo root)
#
# Steps:
#   install  install MLX with CUDA into $MLX_SITE from $MLX_WHEELS (wheels, or
#            a wheel set split into part1/ part2/ ... folders for transfer, one
#            of which carries the install.sh that joins, checks and installs
#            them), then copy $MLX_LM_DIR's packages
#            (mlx_lm and what it needs beyond mlx) there; prints the GPU and mlx
#   check    the GPU test files ($TESTS), tools/gpu_check.py ($CHECK_ARGS) and
#            tools/gpu_cache_check.py
#   matrix   benchmarks/decode_matrix.py for each context:budget of $PAIRS
#   kernels  benchmarks/bench_kernels.py $KERNEL_ARGS
#
# Settings (environment; paths relative to the repository root unless absolute):
#   OUT          where logs go, a NAME.log per run           (.gpu/out)
#   PYTHON       the interpreter                             (python3)
#   MLX_SITE     a site dir with mlx (CUDA) and mlx_lm, put first on
#                PYTHONPATH; empty: use $PYTHON's own packages (.gpu/site)
#   MLX_WHEELS   install's wheels or wheel halves             (.gpu)
#   MLX_LM_DIR   install's extra packages, copied as they are (.gpu/lib)
#   TESTS        test modules for check           (the GPU test files below)
#   CHECK_ARGS   gpu_check.py's arguments                    (--quick)
#   PAIRS        matrix context:budget pairs                 (4096:256 16384:1024)
#   STRATEGIES   matrix strategies                           (all of decode_matrix.py)
#   ROUNDS STEPS matrix rounds and decode steps a round      (6, 32)
#   PIN          CPU core the matrix runs on; empty: none    (the last core)
#   LIMIT        seconds a run may take; 0: no limit         (270)
#   KERNEL_ARGS  bench_kernels.py's arguments                (--step)
# Exit status: 0 when every run passed, 1 when one failed, 2 for an unknown
# step, 3 when install failed.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 3
OUT=${OUT:-.gpu/out}
PYTHON=${PYTHON:-python3}
MLX_SITE=${MLX_SITE-.gpu/site}
MLX_WHEELS=${MLX_WHEELS:-.gpu}
MLX_LM_DIR=${MLX_LM_DIR:-.gpu/lib}
TESTS=${TESTS:-test_kernels_gpu test_group_fold_gpu test_queue_fold_gpu test_kv_write_gpu
  test_fused_wiring test_step_group test_deferred_scores test_quantized_kernel
  test_evict_batch test_ops_step test_selfcheck}
CHECK_ARGS=${CHECK_ARGS---quick}
PAIRS=${PAIRS:-4096:256 16384:1024}
STRATEGIES=${STRATEGIES:-}
ROUNDS=${ROUNDS:-6}
STEPS=${STEPS:-32}
PIN=${PIN-$(($(nproc) - 1))}
LIMIT=${LIMIT:-270}
KERNEL_ARGS=${KERNEL_ARGS---step}

mkdir -p "$OUT"
case "$MLX_SITE" in "" | /*) ;; *) MLX_SITE=$REPO/$MLX_SITE ;; esac
export PYTHONPATH="${MLX_SITE:+$MLX_SITE:}$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0

# run NAME FILTER CMD...: CMD under $LIMIT, its output in $OUT/NAME.log and
# here (lines matching the grep pattern FILTER left out here, when given).
run() {
  name=$1 filter=$2
  shift 2
  echo "== $name: $*"
  { timeout -s INT "$LIMIT" "$@" 2>&1; echo $? > "$OUT/$name.rc"; } | tee "$OUT/$name.log" \
    | if [ -n "$filter" ]; then grep -v -e "$filter"; else cat; fi
  rc=$(cat "$OUT/$name.rc")
  rm -f "$OUT/$name.rc"
  [ "$rc" = 0 ] || { echo "== $name failed (exit $rc)"; status=1; }
}

install_mlx() {
  [ -n "$MLX_SITE" ] || { echo "install: MLX_SITE is empty"; return 1; }
  mkdir -p "$MLX_SITE"
  if ls "$MLX_WHEELS"/part*/install.sh >/dev/null 2>&1; then
    parts=$(mktemp -d) && cp "$MLX_WHEELS"/part*/* "$parts"/ \
      && sh "$parts"/install.sh "$MLX_SITE" >/dev/null && rm -rf "$parts" || return 1
  else
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade \
      --target "$MLX_SITE" "$MLX_WHEELS"/*.whl || return 1
  fi
  if [ -d "$MLX_LM_DIR" ]; then cp -r "$MLX_LM_DIR"/. "$MLX_SITE"/ || return 1; fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PYTHON" -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available())"
}

for step in "$@"; do
  case "$step" in
    install)
      install_mlx || exit 3 ;;
    check)
      files=""
      for t in $TESTS; do
        if [ -f "tests/$t.py" ]; then files="$files tests/$t.py"; else echo "no tests/$t.py"; fi
      done
      # SIGINT at the limit: pytest still prints which tests failed and why
      if [ -n "$files" ]; then
        run pytest_gpu "" "$PYTHON" -m pytest -q -rf --tb=short -p no:cacheprovider $files
      fi
      run gpu_check ": ok$" "$PYTHON" tools/gpu_check.py $CHECK_ARGS
      run gpu_cache_check "" "$PYTHON" tools/gpu_cache_check.py ;;
    matrix)
      for cb in $PAIRS; do
        run "matrix_${cb%:*}_${cb#*:}" '^round\|^{' "$PYTHON" benchmarks/decode_matrix.py \
          ${PIN:+--pin "$PIN"} --rounds "$ROUNDS" --steps "$STEPS" \
          --context "${cb%:*}" --budget "${cb#*:}" ${STRATEGIES:+--strategies $STRATEGIES}
      done ;;
    kernels)
      run bench_kernels "^{" "$PYTHON" benchmarks/bench_kernels.py $KERNEL_ARGS ;;
    *)
      echo "unknown step $step: use install, check, matrix or kernels"
      exit 2 ;;
  esac
done
exit $status
