#!/usr/bin/env bash
# One call on the lent H200: environment, GPU tests, benchmark, notebooks; everything it
# measures lands under $OUT (default ./gpu_out) for committing under results/h200/. Figures are
# regenerated from the committed CSVs on the development machine (python -m altup_cupy figures),
# where matplotlib's version is pinned, so the PNGs match CI's regeneration byte for byte.
# The notebooks stage needs the wheels of .whl/ (nbclient, ipykernel: carry .whl).
#   bash scripts/gpu_run.sh [sweep] [bench] [tests] [quickbench] [notebooks]   (default: bench tests notebooks)
# ALTUP_GIT_SHA names the commit being measured (the device copy has no .git). Each stage runs
# under a time limit (ALTUP_STAGE_LIMIT_S, default 400 s), so a hung kernel ends its stage, not the call.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
stages=${*:-bench tests notebooks}
limit=${ALTUP_STAGE_LIMIT_S:-400}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts/ import the package from the working copy
status=0
{
  echo "git_sha: ${ALTUP_GIT_SHA:-unknown}"
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "command: bash scripts/gpu_run.sh $stages"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, cupy, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cupy', cupy.__version__)"
} 2>&1 | tee "$OUT/run_info.txt"

for stage in $stages; do
  start=$(date +%s)
  case $stage in
    sweep)
      timeout "$limit" python3 scripts/sweep_v4.py --out "$OUT/sweep_v4.csv" 2>&1 | tee "$OUT/sweep_v4.log"
      rc=${PIPESTATUS[0]} ;;
    tests)
      ALTUP_REQUIRE_GPU=1 timeout "$limit" python3 -m pytest tests -v -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
      rc=${PIPESTATUS[0]} ;;
    bench)
      # Into the working copy's results/h200, so the notebooks executed next show these numbers.
      timeout "$limit" python3 -m altup_cupy bench --suite all --reps 50 --results-dir results/h200 --figures-dir /tmp/figures 2>&1 | tee "$OUT/bench.log"
      rc=${PIPESTATUS[0]}
      mkdir -p "$OUT/results" && cp results/h200/bench_*.csv "$OUT/results/" ;;
    quickbench)
      timeout "$limit" python3 -m altup_cupy bench --suite benchmark --limit 4 --reps 30 --results-dir "$OUT/quick" --figures-dir /tmp/figures 2>&1 | tee "$OUT/bench.log"
      rc=${PIPESTATUS[0]} ;;
    notebooks)
      OUT="$OUT/notebooks" timeout "$limit" bash scripts/execute_notebooks.sh 2>&1 | tee "$OUT/notebooks.log"
      rc=${PIPESTATUS[0]} ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  echo "== stage $stage: exit $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/run_info.txt"
  [ "$rc" -eq 0 ] || status=1
done
# At most 8 files come back: pack the folders.
(cd "$OUT" && for d in results notebooks quick; do [ -d "$d" ] && tar czf "$d.tar.gz" "$d" && rm -rf "$d"; done; ls -la)
exit $status
