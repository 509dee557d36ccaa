#!/usr/bin/env bash
# Issue 31: the trajectory terms' weighting (Eq. 8), measured. LoopQ W4A4 with the configs/tiny.yaml recipe scaled
# as for the other small-ouro rows (256 x 128 tokens, 300 steps, SLT budget 2), 3 seeds, WikiText-2 on 256 windows,
# under the paper's literal squared-L2 norms (state_reduction sum, lambda 0.1) and the mean convention at lambda 1, 10
# and the default (mean, lambda 0.1) again in the same environment as the others. Resumable: a finished row's JSON is
# skipped, a stopped one resumes from its last checkpoint.
#   OMP_NUM_THREADS=1 bash scripts/weighting_sweep.sh [teacher ...]
set -euo pipefail
usage() { sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; }  # the comment block above
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    -*) echo "error: unknown option $arg (arguments are teacher names under loopq/assets; -h for help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
teachers=("${@:-small-ouro-sensitive small-ouro}")
declare -A SETTINGS=(
  [mean-lam0.1]='"--model.state_reduction","mean","--model.lam","0.1"'
  [sum-lam0.1]='"--model.state_reduction","sum","--model.lam","0.1"'
  [mean-lam1]='"--model.state_reduction","mean","--model.lam","1.0"'
  [mean-lam10]='"--model.state_reduction","mean","--model.lam","10.0"'
)
for teacher in ${teachers[@]}; do
  for seed in 0 1 2; do
    for setting in sum-lam0.1 mean-lam10 mean-lam1 mean-lam0.1; do
      out="results/$teacher/weighting/$setting"
      mkdir -p "$out"
      for row in fp.json rtn-w4a4.json; do [ -f "$out/$row" ] || cp "results/$teacher/$row" "$out/$row"; done
      python -m loopq.experiments table1 --model "loopq/assets/$teacher" --out "$out" --methods '[LoopQ]' \
        --bits '[w4a4]' --seeds "[$seed]" --tasks '[]' --ppl_windows 256 --extra "[${SETTINGS[$setting]}]"
    done
  done
done
