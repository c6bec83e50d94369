#!/usr/bin/env bash
# The GPU checks of altup_cupy on this machine's NVIDIA GPU, in the current Python environment.
#
#   bash scripts/gpu_run.sh [STAGE ...]     STAGE: tests, tests_portable, bench, gemma3n, gemma3n_model,
#                                           notebooks, sweep, ab (default: tests tests_portable bench gemma3n
#                                           notebooks)
#
# Set up first (README, "Install"): a CUDA build of torch, then pip install -e ".[gpu,dev]".
# Everything lands in one folder, ALTUP_RESULTS_DIR (default: results/<gpu name>/ of this
# checkout, e.g. results/nvidia-h200/ on an H200):
#   run_info.txt         GPU, driver, versions, commit; each stage's exit code and duration
#   gpu_tests.log        the tests marked gpu (the rest needs no GPU: CI runs it) with
#                        ALTUP_REQUIRE_GPU=1 (no GPU test may be skipped for want of a GPU)
#   gpu_tests_portable.log  the same with ALTUP_MAX_COMPUTE_CAPABILITY=80: the default versions
#                        an sm_80 GPU runs (explicitly requested versions still run as here)
#   bench_*.csv          the benchmark of every implementation on every workload, and bench.log
#                        (figures: figures/ for the H200, <results folder>/figures/ for other GPUs);
#                        host_overhead.csv, each op's host cost per call against torch.matmul's
#   gemma3n_training_step.csv, gemma3n.log   Gemma 3n's AltUp in a training step (scripts/bench_gemma3n.py)
#   gemma3n_model.csv, gemma3n_model_spread.csv, gemma3n_model.log     a whole Gemma 3n model, patched and not
#                        (altup_cupy.lab.gemma3n_model: medians, and each case's p10-p90; rows of this commit
#                        already in the CSV are kept and not measured again)
#   notebooks.log        notebooks/*.ipynb executed in place in GPU mode (scripts/execute_notebooks.sh)
#   sweep_v4.csv, .log   the tuning sweep of the backward's ring kernels, v4 and v6 (Hopper GPUs only),
#   sweep_cublas_algos.csv, .log   and every cuBLASLt algorithm for the collapse's projections
#   programmatic_launch_ab.csv, .log   each programmatic dependent launch against a plain one
#                        (scripts/ab_programmatic_launch.py; Hopper GPUs only)
# Each stage runs under a time limit of ALTUP_STAGE_LIMIT_S seconds (default 1800), so a hung
# kernel ends its stage, not the run. Exit code: 0 if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's package, also for scripts/

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests tests_portable bench gemma3n notebooks)
for stage in "${stages[@]}"; do
  case $stage in
    tests|tests_portable|bench|gemma3n|gemma3n_model|notebooks|sweep|ab) ;;
    *) echo "gpu_run.sh: unknown stage '$stage' (stages: tests tests_portable bench gemma3n gemma3n_model notebooks sweep ab)" >&2
       exit 2 ;;
  esac
done
limit=${ALTUP_STAGE_LIMIT_S:-1800}

if ! gpu=$(python3 -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'; print(torch.cuda.get_device_name())"); then
  echo "gpu_run.sh: needs a CUDA GPU visible to torch (a CUDA build of torch; see README, 'Install')" >&2
  exit 2
fi
results=${ALTUP_RESULTS_DIR:-$(python3 -c "import sys; from altup_cupy.lab.paths import results_dir; print(results_dir(sys.argv[1], '.'))" "$gpu")}
mkdir -p "$results"
echo "gpu_run.sh: $gpu -> $results"

{
  echo "git_sha: ${ALTUP_GIT_SHA:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "command: bash scripts/gpu_run.sh ${stages[*]}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  python3 -c "import sys, torch, cupy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cupy', cupy.__version__)" 2>&1
} | tee "$results/run_info.txt"

run_stage() {  # run_stage LOG COMMAND...: the command under the time limit, its output also in LOG
  local log=$1
  shift
  timeout "$limit" "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}

status=0
for stage in "${stages[@]}"; do
  start=$(date +%s)
  case $stage in
    tests)
      ALTUP_REQUIRE_GPU=1 run_stage "$results/gpu_tests.log" python3 -m pytest tests -m gpu -v -rs -p no:cacheprovider ;;
    tests_portable)
      ALTUP_MAX_COMPUTE_CAPABILITY=80 ALTUP_REQUIRE_GPU=1 run_stage "$results/gpu_tests_portable.log" \
        python3 -m pytest tests -m gpu -q -rs -p no:cacheprovider ;;
    bench)
      run_stage "$results/bench.log" python3 -m altup_cupy bench --suite all --reps 50 --results-dir "$results" ;;
    gemma3n)
      run_stage "$results/gemma3n.log" python3 scripts/bench_gemma3n.py --no-tests --out "$results/gemma3n_training_step.csv" ;;
    gemma3n_model)
      run_stage "$results/gemma3n_model.log" python3 -m altup_cupy.lab.gemma3n_model --config all --resume \
        --time-limit-s "$(( limit * 9 / 10 ))" --no-progress --out "$results/gemma3n_model.csv" ;;
    notebooks)
      ALTUP_NOTEBOOK_MODE=gpu run_stage "$results/notebooks.log" bash scripts/execute_notebooks.sh ;;
    sweep)
      run_stage "$results/sweep_v4.log" python3 scripts/sweep_v4.py --out "$results/sweep_v4.csv" &&
        run_stage "$results/sweep_cublas_algos.log" python3 scripts/sweep_cublas_algos.py \
          --out "$results/sweep_cublas_algos.csv" ;;
    ab)
      run_stage "$results/programmatic_launch_ab.log" python3 scripts/ab_programmatic_launch.py \
        --out "$results/programmatic_launch_ab.csv" ;;
  esac
  rc=$?
  [ "$rc" -ne 124 ] || echo "stage $stage: stopped after ALTUP_STAGE_LIMIT_S=$limit s"
  echo "== stage $stage: exit $rc, $(( $(date +%s) - start )) s" | tee -a "$results/run_info.txt"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
